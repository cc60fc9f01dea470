"""DSA as DeepSeek ships it, through the plugin as a user runs it: the backends of tests/meta/impls/independent/deepseek_v32_backend.py
(written after DeepSeek-V3.2-Exp's inference/model.py, without the suite's reference) on the V3.2-width DSA tests.

* a bf16 latent + FP8 block-128 indexer key (DeepSeek's cache, 1,284 B/token at V3.2 dims) passes the byte tests
  and the v3.2-mini output, short-context and selection tests;
* the indexer RoPE in interleaved pairs on a V3.2 config (DeepSeek's code before its fix of 2025-11-18), with a
  bf16 indexer key, fails test_selection at v3.2-mini (index width 128, bf16) naming the interleaved indexer RoPE;
* a GLM-style backend (interleaved indexer RoPE, declared by its config's indexer_rope_interleave) passes its
  preset, glm-dsa-mini, and declines V3.2's half-split configs with its sentence;
* the same interleaved bug behind DeepSeek's FP8 indexer is not caught (strict xfail): e4m3's worst-case score
  error (0.129 of M per product, the 'indexer-scores fp8-e4m3' row) is wider than the bug's effect (rel_fro
  0.031, max 0.165 of M at v3.2-mini), so every swap it makes lies within the tie bound.
"""

import pytest

from . import harness

pytestmark = pytest.mark.meta
SPEC = "tests/meta/impls/independent/deepseek_v32_backend.py"

REF, PREFIX_BF16, PREFIX_FP8, GLM = ("deepseek-v32-reference-style", "broken-dsa-v32-prefix-interleaved-bf16",
                                     "broken-dsa-v32-prefix-interleaved-fp8", "glm-style-dsa")
D, B = "suites/test_dsa.py", "suites/test_cache_bytes.py"
PASSES = [f"{D}::test_sparse_attention[{REF}-bfloat16-v3.2-mini-varlen_batch]",
          f"{D}::test_short_context_is_dense[{REF}-1-prefill-v3.2-mini-bfloat16]",
          f"{D}::test_short_context_is_dense[{REF}-0-decode-v3.2-mini-bfloat16]",
          f"{D}::test_selection[{REF}-v3.2-mini-varlen_batch]",
          f"{D}::test_cache_bytes_v32_dims[{REF}-6-2-3]",
          f"{B}::test_bytes_formula_dsa[{REF}-1-0-1-v3.2-mini-bfloat16]",
          f"{B}::test_bytes_formula_dsa[{REF}-6-2-3-v3.2-mini-bfloat16]",
          f"{D}::test_sparse_attention[{GLM}-bfloat16-glm-dsa-mini-varlen_batch]",
          f"{D}::test_selection[{GLM}-glm-dsa-mini-varlen_batch]"]
FAILS = {f"{D}::test_selection[{PREFIX_BF16}-v3.2-mini-varlen_batch]": "the indexer's RoPE in the interleaved layout"}
SKIPS = {f"{D}::test_selection[{GLM}-v3.2-mini-varlen_batch]": "declares half-split pairs"}
UNCAUGHT = [f"{D}::test_selection[{PREFIX_FP8}-v3.2-mini-varlen_batch]",
            f"{D}::test_sparse_attention[{PREFIX_FP8}-bfloat16-v3.2-mini-varlen_batch]"]


def _dsa_run(pytester) -> harness.SuiteRun:
    backends = [f"{SPEC}:{cls}" for cls in ("DeepSeekV32Reference", "DeepSeekV32PreFixBF16Key", "DeepSeekV32PreFix",
                                            "GLMStyleDSA")]
    return harness.run_inprocess(pytester, [*PASSES, *FAILS, *SKIPS, *UNCAUGHT], backends=backends)


@pytest.fixture
def outcomes(suite_run) -> dict[str, dict]:
    return suite_run("dsa-meta", _dsa_run).by_id


@pytest.mark.parametrize("nodeid", PASSES)
def test_deepseek_style_backend_passes(outcomes, nodeid):
    got = outcomes.get(nodeid)
    assert got is not None, f"{nodeid} did not run"
    assert got["outcome"] == "passed", f"{nodeid}: {got['outcome']}: {got.get('reason', '')}"


def test_fp8_indexer_cache_measures_1284_bytes(outcomes):
    got = outcomes[f"{B}::test_bytes_formula_dsa[{REF}-6-2-3-v3.2-mini-bfloat16]"]["figures"]
    assert (got["measured_bytes_per_token"], got["formula_bytes_per_token"], got["indexer_format"]) == \
        (1_284, 1_284, "fp8-e4m3-block128"), got


@pytest.mark.parametrize("nodeid", list(FAILS))
def test_interleaved_indexer_rope_fails_naming_it(outcomes, nodeid):
    got = outcomes.get(nodeid)
    assert got is not None, f"{nodeid} did not run"
    assert got["outcome"] == "failed", f"{nodeid}: {got['outcome']}: {got.get('reason', '')}"
    assert FAILS[nodeid] in got.get("reason", "") and PREFIX_BF16 in got["reason"], got.get("reason")


@pytest.mark.parametrize("nodeid", list(SKIPS))
def test_glm_style_declines_half_split(outcomes, nodeid):
    got = outcomes.get(nodeid)
    assert got is not None and got["outcome"] == "skipped" and SKIPS[nodeid] in got.get("reason", ""), got


@pytest.mark.xfail(strict=True, reason="known gap: an FP8 e4m3 indexer's worst-case score bound (0.129 x M) is wider "
                                       "than the interleaved indexer RoPE's effect at v3.2-mini; no rigorous tie bound "
                                       "separates them")
@pytest.mark.parametrize("nodeid", UNCAUGHT)
def test_interleaved_rope_behind_fp8_indexer_is_caught(outcomes, nodeid):
    assert outcomes[nodeid]["outcome"] == "failed", outcomes[nodeid]
