"""The Triton interpreter tier (marker ``triton_interpret``; not in the default run: minutes, not seconds): the
built-in ``triton`` op (mla_conformance.impl.ops.triton_mla) through the whole op suite on CPU under Triton's
interpreter (``TRITON_INTERPRET=1``), as a user runs their own Triton kernel on a CPU-only CI host; its broken
variants (tests/meta/impls/broken/triton_ops.py) failed by their named tests; and a reduced layer suite through
``--mla-backend op:triton``. Run it with ``pytest -m triton_interpret`` (``.ci/run`` does, after the README's
test command, and prints its time); without triton installed it skips with a sentence."""

from __future__ import annotations

import re

import pytest

from . import background, harness

pytestmark = pytest.mark.triton_interpret

INTERPRET = {"TRITON_INTERPRET": "1"}
BROKEN = "tests/meta/impls/broken/triton_ops.py"

#: what the op suite may skip on ``triton``, each a sentence naming what the op does not have or declare
ALLOWED_SKIPS = (
    r"op triton has no (prefill|sparse_prefill|merge|write) method",
    r"does not declare sparse_decode_extra_cache",
    r"does not declare out_buffers",
    r"triton takes float32, float16 and bfloat16 q .*not float64",
    r"kv_formats is .* not 'fp8-e4m3-model1'",
)

#: broken variant -> (the op test that must fail it, the likely cause its message must name, or None where the
#: suite names none yet: the split merge and the dropped tile scale are told only what differs)
CELLS = {
    f"{BROKEN}:WrongSplitMerge": ("suites/test_op_numerics.py::test_out_lse_vs_oracle[broken-triton-split-merge-float32]",
                                  None),
    f"{BROKEN}:TopLeftCausal": ("suites/test_op_paging.py::test_multi_token_decode[broken-triton-top-left-causal-4-causal]",
                                "top-left"),
    f"{BROKEN}:DroppedTileScale": ("suites/test_op_fp8.py::test_fp8_vs_dequantized_oracle[broken-triton-dropped-tile-scale]",
                                   None),
}

#: the layer suite through op:triton on the interpreter: numerics in float32 and float16, paging, and one golden
#: generation of the embedded model (bfloat16 numerics run too: the kernels load and upcast, never dot bfloat16)
LAYER = ("suites/test_numerics.py::test_against_float64", "suites/test_numerics.py::test_float16",
         "suites/test_paged_cache.py", "suites/test_generation_golden.py::test_golden_generation[op:triton-tiny-short]")


@pytest.fixture(scope="module", autouse=True)
def _triton():
    pytest.importorskip("triton", reason="triton is not installed: `pip install -e .[triton]` (mla-conformance[triton]) "
                                         "to run the Triton interpreter tier")


def _run(targets, **kw):
    return harness.run_subprocess(background.scratch("mla-triton-"), targets, env=INTERPRET, timeout=900, **kw)


def test_triton_op_conforms_under_interpreter():
    """The whole op suite on ``--mla-op triton``: nothing fails or errors, every skip names a method or declaration
    the op does not have."""
    run = _run(["suites"], ops=["triton"])
    bad = [t for t in run.tests if t["outcome"] in ("failed", "error")]
    assert not bad and run.code == 0, "\n".join(f"{t['nodeid']}: {t['outcome']}: {t.get('reason', '')[:400]}"
                                                for t in bad) or run.tail()
    by_file: dict[str, list[dict]] = {}
    for t in run.tests:
        by_file.setdefault(t["nodeid"].split("::")[0], []).append(t)
    # a file none of whose tests ran is one of a method or a declaration the op does not have; every other runs
    unrun = [f for f, tests in by_file.items() if all(t["outcome"] == "skipped" for t in tests)
             and not all(re.search(r"has no \w+ method|does not declare \w+", t.get("reason", "")) for t in tests)]
    assert not unrun, f"op suite files whose every test skipped: {unrun}"
    odd = [t for t in run.tests if t["outcome"] == "skipped"
           and not any(re.search(p, t.get("reason", "")) for p in ALLOWED_SKIPS)]
    assert not odd, "skips the tier does not expect:\n" + "\n".join(f"{t['nodeid']}: {t.get('reason')}" for t in odd)


def test_broken_triton_variants_fail_their_tests():
    """A split-KV merge that averages its splits, a top-left causal mask, a dropped FP8 tile scale: each failed (not
    errored) by its named test, with the cause in the message."""
    run = _run([test for test, _ in CELLS.values()], ops=list(CELLS))
    for spec, (test, words) in CELLS.items():
        reason = run.assert_failed(test, spec)
        assert words is None or words in reason, f"{test}: the failure does not say {words!r}:\n{reason[:1500]}"


def test_layer_suite_through_triton_op():
    """``--mla-backend op:triton``: the layer numerics, paging and a golden generation through the Triton op."""
    run = _run(list(LAYER), backends=["op:triton"])
    bad = [t for t in run.tests if t["outcome"] in ("failed", "error")]
    assert not bad and run.code == 0, "\n".join(f"{t['nodeid']}: {t['outcome']}: {t.get('reason', '')[:400]}"
                                                for t in bad) or run.tail()
    assert any(t["outcome"] == "passed" for t in run.tests), run.tail()
