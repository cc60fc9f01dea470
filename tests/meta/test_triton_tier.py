"""The Triton interpreter tier (marker ``triton_interpret``; not in the default run: minutes, not seconds): the
built-in ``triton`` op (mla_conformance.impl.ops.triton_mla) through the whole op suite on CPU under Triton's
interpreter (``TRITON_INTERPRET=1``) with the faithful tier on (mla_conformance.impl.ops.triton_faithful: the
interpreter given a GPU's tl.dot and casts; the plugin's default), as a user runs their own Triton kernel on a
CPU-only CI host; the emulation's arithmetic against torch's; the op's broken variants
(tests/meta/impls/broken/triton_ops.py) failed by their named tests, the two that only the faithful tier catches
passing with ``--mla-triton-emulation=off``; and a reduced layer suite through ``--mla-backend op:triton``. Run it
with ``pytest -m triton_interpret`` (``.ci/run`` does, after the README's test command, and prints its time);
without triton installed it skips with a sentence."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from . import harness

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
    r"does not declare dcp",  # decode context parallelism is opt-in (suites/test_op_dcp.py)
)

#: broken variant -> (the op test that must fail it, the likely cause its message must name, or None where the
#: suite names none yet: the split merge, the dropped tile scale and the nudged cast are told only what differs)
CELLS = {
    f"{BROKEN}:WrongSplitMerge": ("suites/test_op_numerics.py::test_out_lse_vs_oracle[broken-triton-split-merge-float32]",
                                  None),
    f"{BROKEN}:TopLeftCausal": ("suites/test_op_paging.py::test_multi_token_decode[broken-triton-top-left-causal-4-causal]",
                                "top-left"),
    f"{BROKEN}:DroppedTileScale": ("suites/test_op_fp8.py::test_fp8_vs_dequantized_oracle[broken-triton-dropped-tile-scale]",
                                   None),
    f"{BROKEN}:DefaultTF32Dot": ("suites/test_op_numerics.py::test_out_lse_vs_oracle[broken-triton-tf32-dot-float32]",
                                 "likely cause: TF32 inputs"),
    f"{BROKEN}:NudgedBf16Cast": ("suites/test_op_fp8.py::test_fp8_vs_dequantized_oracle[broken-triton-nudged-bf16-cast]",
                                 None),
}
#: the variants whose bug is a GPU's arithmetic that Triton's interpreter as shipped hides: their named tests pass
#: with ``--mla-triton-emulation=off``
FAITHFUL_ONLY = (f"{BROKEN}:DefaultTF32Dot", f"{BROKEN}:NudgedBf16Cast")

#: the layer suite through op:triton on the interpreter: numerics in float32 and float16, paging, and one golden
#: generation of the embedded model (bfloat16 numerics run too: bfloat16 dots, faithful under the emulation)
LAYER = ("suites/test_numerics.py::test_against_float64", "suites/test_numerics.py::test_float16",
         "suites/test_paged_cache.py", "suites/test_generation_golden.py::test_golden_generation[op:triton-tiny-short]")


@pytest.fixture(scope="module", autouse=True)
def _triton():
    pytest.importorskip("triton", reason="triton is not installed: `pip install -e .[triton]` (mla-conformance[triton]) "
                                         "to run the Triton interpreter tier")


def _run(targets, **kw):
    with tempfile.TemporaryDirectory(prefix="mla-triton-") as tmp:
        return harness.run_subprocess(Path(tmp), targets, env=INTERPRET, timeout=900, **kw)


#: run under TRITON_INTERPRET=1 (a fresh process: triton reads it when a kernel is defined): small kernels through
#: the interpreter with the emulation on and off, measured against torch; prints one JSON object
SEMANTICS = r"""
import json, numpy as np, torch, triton, triton.language as tl
from mla_conformance.impl.ops import triton_faithful as triton_faithful

@triton.jit
def dot(a_ptr, b_ptr, c_ptr, N: tl.constexpr, PREC: tl.constexpr):
    i = tl.arange(0, N)
    a = tl.load(a_ptr + i[:, None] * N + i[None, :])
    b = tl.load(b_ptr + i[:, None] * N + i[None, :])
    tl.store(c_ptr + i[:, None] * N + i[None, :], tl.dot(a, b, input_precision=PREC))

@triton.jit
def cast(x_ptr, y_ptr, s_ptr, w_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    x = tl.load(x_ptr + i)
    y = x.to(tl.bfloat16)
    tl.store(y_ptr + i, y)
    tl.store(s_ptr + i, x)                      # float32 stored through a bfloat16 pointer
    tl.store(w_ptr + i, y.to(tl.float32) * 1.0)

@triton.jit
def arith(x_ptr, y_ptr, o_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    x = tl.load(x_ptr + i)
    y = tl.load(y_ptr + i)
    tl.store(o_ptr + i, x * y + x)

g = torch.Generator().manual_seed(0)
N = 32
a, b = torch.randn(N, N, generator=g), torch.randn(N, N, generator=g)
def rel(x, ref):
    return float((x.double() - ref).abs().max() / ref.abs().max())
def tf32(t, mode):
    return torch.from_numpy(triton_faithful.tf32_round(t.numpy(), mode)).double()
ties = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 2 ** -130 * 3, float("inf"), float("nan"),
                     3.4e38, 1.0 + 2 ** -9])
m = 4096 - ties.numel()  # tl.arange: a power of two
x = torch.cat([torch.randn(m, generator=g) * 10.0 ** torch.randint(-30, 30, (m,), generator=g), ties])
n = x.numel()
res = {}
for on in (True, False):
    with triton_faithful.emulation(on):
        r = res["on" if on else "off"] = {"installed": triton_faithful.installed()}
        for prec in (None, "tf32", "ieee", "tf32x3"):
            c = torch.empty(N, N)
            dot[(1,)](a, b, c, N, prec)
            r[f"dot {prec} vs ieee"] = rel(c, a.double() @ b.double())
            r[f"dot {prec} vs truncated"] = rel(c, tf32(a, "truncate") @ tf32(b, "truncate"))
        for dt in (torch.bfloat16, torch.float16):
            c = torch.empty(N, N)
            dot[(1,)](a.to(dt), b.to(dt), c, N, "ieee")
            r[f"dot {dt}"] = rel(c, a.to(dt).double() @ b.to(dt).double())
        y, s = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
        w = torch.empty(n)
        cast[(1,)](x, y, s, w, n)
        want = x.to(torch.bfloat16)
        nan = torch.isnan(want)  # NaN: a NaN (torch's bits and a GPU's canonical 0x7FFF differ)
        same = lambda t: bool(((t.view(torch.int16) == want.view(torch.int16)) | nan & torch.isnan(t)).all())
        r["cast rne"], r["store rne"] = same(y), same(s)
        r["cast nan"] = bool(torch.isnan(y[-3]))
        r["widen exact"] = bool(torch.equal(torch.nan_to_num(w), torch.nan_to_num(y.float())))
        xb, yb = torch.randn(n, generator=g).to(torch.bfloat16), torch.randn(n, generator=g).to(torch.bfloat16)
        o = torch.empty_like(xb)
        arith[(1,)](xb, yb, o, n)
        r["bf16 arithmetic"] = bool(torch.equal(o, xb * yb + xb))
one = np.float32([1 + 2 ** -11, 1 + 3 * 2 ** -11, -(1 + 2 ** -11)])
res["tf32_round"] = {m: [float(v) for v in triton_faithful.tf32_round(one, m)] for m in triton_faithful.TF32_MODES}
print(json.dumps(res))
"""


def test_triton_op_conforms_under_interpreter():
    """The whole op suite on ``--mla-op triton``: nothing fails or errors, every skip names a method or declaration
    the op does not have."""
    run = _run(["suites"], ops=["triton"])
    bad = [t for t in run.tests if t["outcome"] in ("failed", "error")]
    assert not bad and run.code == 0, "\n".join(f"{t['nodeid']}: {t['outcome']}: {t.get('reason', '')[:400]}"
                                                for t in bad) or run.tail()
    by_file: dict[str, list[dict]] = {}
    for t in run.tests:  # the op's tests (the layer, engine and across-ranks suites judge no op: they skip)
        if t.get("params", {}).get("op"):
            by_file.setdefault(t["nodeid"].split("::")[0], []).append(t)
    # a file none of whose tests ran is one of a method or a declaration the op does not have; every other runs
    unrun = [f for f, tests in by_file.items() if all(t["outcome"] == "skipped" for t in tests)
             and not all(re.search(r"has no \w+ method|does not declare \w+", t.get("reason", "")) for t in tests)]
    assert not unrun, f"op suite files whose every test skipped: {unrun}"
    odd = [t for tests in by_file.values() for t in tests if t["outcome"] == "skipped"
           and not any(re.search(p, t.get("reason", "")) for p in ALLOWED_SKIPS)]
    assert not odd, "skips the tier does not expect:\n" + "\n".join(f"{t['nodeid']}: {t.get('reason')}" for t in odd)


def test_broken_triton_variants_fail_their_tests():
    """A split-KV merge that averages its splits, a top-left causal mask, a dropped FP8 tile scale, float32 dots
    left at triton's default TF32, a cast nudged for a truncating interpreter: each failed (not errored) by its
    named test under the faithful tier, with the cause in the message where the suite names one (and the TF32
    cause nowhere else)."""
    run = _run([test for test, _ in CELLS.values()], ops=list(CELLS))
    for spec, (test, words) in CELLS.items():
        reason = run.assert_failed(test, spec)
        assert words is None or words in reason, f"{test}: the failure does not say {words!r}:\n{reason[:1500]}"
        assert words == "likely cause: TF32 inputs" or "TF32" not in reason, f"{test}: TF32 named:\n{reason[:1500]}"


def test_only_the_faithful_tier_catches_gpu_arithmetic():
    """The TF32 default dot and the nudged cast pass their named tests under Triton's interpreter as shipped
    (``--mla-triton-emulation=off``: IEEE float32 dots whatever the precision, truncating casts) -- what CPU CI
    said of them before the faithful tier -- and fail them with it (test_broken_triton_variants_fail_their_tests)."""
    run = _run([CELLS[spec][0] for spec in FAITHFUL_ONLY], ops=list(FAITHFUL_ONLY),
               extra=["--mla-triton-emulation=off"])
    for spec in FAITHFUL_ONLY:
        got = run.result(CELLS[spec][0])
        assert got["outcome"] == "passed", f"{spec} with the emulation off: {got['outcome']}: {got.get('reason')}"


def test_faithful_tier_arithmetic():
    """Under the interpreter, with the emulation on: a float32 dot at the default or "tf32" precision equals the
    product of the operands cut to TF32 (truncated: :data:`triton_faithful.DEFAULT_TF32`) and not the IEEE one,
    "ieee" the IEEE one, "tf32x3" within float32 rounding of it; bfloat16 / float16 dots the exact products
    summed in float32; float32 -> bfloat16 casts and stores the bits of torch's round-to-nearest-even (ties,
    subnormals, inf, NaN included); bfloat16 arithmetic torch's. With it off: the interpreter as shipped (IEEE
    whatever the precision, bfloat16 dots on the storage bits, truncating casts)."""
    proc = subprocess.run([sys.executable, "-c", SEMANTICS], capture_output=True, text=True, timeout=300,
                          cwd=harness.ROOT, env={**os.environ, **INTERPRET,
                               "PYTHONPATH": os.pathsep.join(filter(None, [str(harness.ROOT), os.environ.get("PYTHONPATH")]))})
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    on, off = res["on"], res["off"]
    assert on["installed"] == "truncate" and off["installed"] is None, res
    for prec in ("None", "tf32"):
        assert on[f"dot {prec} vs truncated"] < 1e-6 < 1e-4 < on[f"dot {prec} vs ieee"], (prec, on)
    assert on["dot ieee vs ieee"] < 1e-6 and on["dot tf32x3 vs ieee"] < 1e-6, on
    assert on["dot torch.bfloat16"] < 1e-6 and on["dot torch.float16"] < 1e-6, on
    assert on["cast rne"] and on["store rne"] and on["cast nan"] and on["widen exact"] and on["bf16 arithmetic"], on
    assert all(off[f"dot {p} vs ieee"] < 1e-6 for p in ("None", "tf32", "ieee", "tf32x3")), off
    assert off["dot torch.bfloat16"] > 1.0 and not off["cast rne"] and not off["bf16 arithmetic"], off
    t = 2 ** -10
    assert res["tf32_round"] == {"truncate": [1.0, 1 + t, -1.0], "rna": [1 + t, 1 + 2 * t, -(1 + t)],
                                 "rne": [1.0, 1 + 2 * t, -1.0]}, res["tf32_round"]


def test_layer_suite_through_triton_op():
    """``--mla-backend op:triton``: the layer numerics, paging and a golden generation through the Triton op."""
    run = _run(list(LAYER), backends=["op:triton"])
    bad = [t for t in run.tests if t["outcome"] in ("failed", "error")]
    assert not bad and run.code == 0, "\n".join(f"{t['nodeid']}: {t['outcome']}: {t.get('reason', '')[:400]}"
                                                for t in bad) or run.tail()
    assert any(t["outcome"] == "passed" for t in run.tests), run.tail()
