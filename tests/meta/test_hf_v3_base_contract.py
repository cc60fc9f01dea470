"""A user's backend written to the base layer contract only -- transformers' own DeepseekV3Attention and
DynamicCache (tests/meta/impls/independent/hf_deepseek_v3_backend.py, no optional declarations) -- run through the suite as a
user runs it: the plugin, ``--mla-backend path/to/file.py:attr``, ``--mla-results``. It must pass; the optional
parts it never declared skip with the sentence naming the declaration (DeepSeek Sparse Attention) or its own
sentence (kv_codec). One pytest session in this process (torch and transformers imported once;
tests/meta/harness.py).

The selection is a cheap cross-section (a few seconds on CPU): one numerics case per query path (q_lora on tiny
and v3-mini, plain q_proj on V2-Lite dims), the byte rule, one codec and every DSA test (they skip); the full
run is ``pytest suites --mla-backend tests/meta/impls/independent/hf_deepseek_v3_backend.py:HFDeepseekV3`` (62 passed, the rest
skipped, when it was written)."""

import json

import pytest

from . import harness

pytestmark = pytest.mark.meta
BACKEND = "tests/meta/impls/independent/hf_deepseek_v3_backend.py:HFDeepseekV3"
NAME = "hf-deepseek-v3"
SELECTION = "dsa or float32-prefill_decode-tiny or bfloat16-varlen_batch-deepseek-v2-lite or float32-prefill-v3-mini " \
            "or 6-2-3-bfloat16-tiny or test_attention_error and int8-g32"
DSA_DECLARATION = f"{NAME} does not declare DeepSeek Sparse Attention"
#: the only skips a base-contract backend may get: an optional part it does not declare / implement
OPTIONAL_SKIPS = (DSA_DECLARATION, f"{NAME}: {NAME} caches what transformers' DynamicCache stores",
                  f"{NAME} does not implement the optional paged-cache extension")


def _hf_run(pytester) -> harness.SuiteRun:
    return harness.run_inprocess(pytester, ["suites"], backends=[BACKEND], extra=["-s", "-k", SELECTION], expect=0)


@pytest.fixture
def outcomes(suite_run) -> dict[str, dict]:
    pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
    return suite_run("hf-v3-base-contract", _hf_run).by_id


def _is_dsa(nodeid: str) -> bool:
    return nodeid.startswith("suites/test_dsa.py::") or "dsa" in nodeid.lower()


def test_passes_with_no_failures_or_errors(outcomes):
    bad = {n: f"{t['outcome']}: {t.get('reason', '')[:300]}" for n, t in outcomes.items()
           if t["outcome"] not in ("passed", "skipped")}
    assert not bad, f"{len(bad)} tests did not pass or skip: {json.dumps(bad, indent=1)}"
    passed = [n for n, t in outcomes.items() if t["outcome"] == "passed"]
    assert any(n.startswith("suites/test_numerics.py::") for n in passed), "no numerics test ran"
    assert any(n.startswith("suites/test_cache_bytes.py::") for n in passed), "no cache-bytes test ran"


def test_every_dsa_test_skips_naming_the_declaration(outcomes):
    dsa = {n: t for n, t in outcomes.items() if _is_dsa(n)}
    assert any(n.startswith("suites/test_dsa.py::") for n in dsa), "no DSA test was selected"
    wrong = {n: f"{t['outcome']}: {t.get('reason', '')[:300]}" for n, t in dsa.items()
             if t["outcome"] != "skipped" or DSA_DECLARATION not in t.get("reason", "")
             or 'sparse_attention = "dsa"' not in t.get("reason", "")}
    assert not wrong, f"DSA tests that did not skip naming the declaration: {json.dumps(wrong, indent=1)}"


def test_skips_only_optional_parts_it_never_declared(outcomes):
    other = {n: t.get("reason", "")[:300] for n, t in outcomes.items()
             if t["outcome"] == "skipped" and not t.get("reason", "").startswith(OPTIONAL_SKIPS)}
    assert not other, f"skips that are not an undeclared optional part: {json.dumps(other, indent=1)}"
    codec = [t for t in outcomes.values() if t["outcome"] == "skipped" and "kv_codec" in t.get("reason", "")]
    assert codec and all("is not supported" in t["reason"] for t in codec), "the codec tests did not skip with " \
        "the backend's own sentence"
