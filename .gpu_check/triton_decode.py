#!/usr/bin/env python
"""The built-in ``triton`` op on a GPU host: its verdict, how the GPU's arithmetic compares with the faithful
interpreter tier's, then its decode time and achieved bandwidth at DeepSeek-V3 dims, beside the device's measured
copy bandwidth and beside FlashMLA where the host runs it.

For a session lent a GPU (nothing here has run on one yet). Installs nothing; needs torch with CUDA and triton.
Run from the repository root, unset TRITON_INTERPRET (the interpreter runs CPU tensors only)::

    python .gpu_check/triton_decode.py                 # verdict, then timings (bf16 and FP8)
    python .gpu_check/triton_decode.py --verdict-only
    python .gpu_check/triton_decode.py --batch 64 --keys 32768 --iters 20
    python .gpu_check/triton_decode.py --faithful-only     # the TF32 probe and the GPU / faithful-tier errors

1. ``pytest suites --mla-op triton --mla-device cuda`` (the whole op suite) and, unless ``--ops-only``,
   ``pytest suites/test_numerics.py suites/test_paged_cache.py --mla-backend op:triton --mla-device cuda``.
2. For each configuration (bfloat16 latent cache; FP8 656-byte cache with a bfloat16 q): B rows of ``--keys`` keys,
   h_q 128, pages of 64, s_q 1. A configuration whose op-suite tests failed is **not timed** (the table says so).
   Time: CUDA events, median of ``--iters`` calls after warm-up. Bandwidth: the bytes a decode must read (every
   row's cache rows, q) and write (out, lse), over the median time; beside it the device's copy bandwidth
   (a 2 GiB device-to-device copy: read + write bytes over its time) and FlashMLA's time on the same inputs when
   ``flash_mla`` imports (bfloat16 only: its dense decode reads no FP8 cache).

Before the timings (unless ``--verdict-only``), the faithful interpreter tier
(mla_conformance/impl/ops/triton_faithful.py, docs/triton.md) beside the GPU:

* the TF32 probe: ``tl.dot`` of a float32 matrix by the identity at triton's default input_precision, on the GPU:
  which TF32 conversion its outputs are (truncate / rna / rne / ieee), against ``triton_faithful.DEFAULT_TF32``;
* the op's error on the GPU and under the interpreter (a subprocess with TRITON_INTERPRET=1, CPU) with the faithful
  tier on and off, same inputs (float32, bfloat16, float16 latent; FP8 656-byte with a bfloat16 q; B=2 rows of
  300 keys, h_q 16, pages of 64, s_q 2 causal): max |out - oracle| / max |oracle|, max |lse - oracle|, and the
  largest |GPU - interpreter| of out (the faithful tier should be the one near the GPU).

Exit status 0 when nothing failed or errored.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

try:  # the TF32 probe's kernel (module level: triton resolves a kernel's names in its module's globals)
    import triton
    import triton.language as tl
except ImportError:  # the verdict needs no triton in this process
    triton = None

if triton is not None:
    @triton.jit
    def _identity_dot(a_ptr, b_ptr, c_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        a = tl.load(a_ptr + i[:, None] * N + i[None, :])
        b = tl.load(b_ptr + i[:, None] * N + i[None, :])
        tl.store(c_ptr + i[:, None] * N + i[None, :], tl.dot(a, b))


def verdict(args_: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        results = Path(tmp) / "results.json"
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "--mla-results", str(results),
                               *args_], cwd=ROOT, capture_output=True, text=True)
        payload = json.loads(results.read_text()) if results.is_file() else {"tests": []}
    tests = payload.get("tests", [])
    count = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "error", "skipped")}
    bad = [f"{t['nodeid']}: {t.get('reason', '')[:200]}" for t in tests if t["outcome"] in ("failed", "error")]
    return {"args": " ".join(args_), "code": proc.returncode, **count, "bad": bad, "tail": proc.stdout[-1500:]}


def time_calls(fn, iters: int) -> float:
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def copy_bandwidth() -> float:
    import torch

    src = torch.empty(2 ** 31, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / time_calls(lambda: dst.copy_(src), 10)


def inputs(batch: int, keys: int, fp8: bool):
    import torch

    from mla_conformance.impl.ops.reference import encode_fp8_656

    page, h_q = 64, 128
    pages = keys // page
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, 1, h_q, 576, device="cuda", generator=g).to(torch.bfloat16)
    latent = torch.randn(batch * pages, page, 1, 576, device="cuda", generator=g)
    if fp8:
        cache = torch.cat([encode_fp8_656(latent[i:i + 256]) for i in range(0, latent.shape[0], 256)])
    else:
        cache = latent.to(torch.bfloat16)
    del latent
    block_table = torch.randperm(batch * pages, device="cuda").to(torch.int32).view(batch, pages)
    lens = torch.full((batch,), keys, dtype=torch.int32, device="cuda")
    return q, cache, block_table, lens


# --------------------------------------------------------------------------- the faithful tier beside the GPU

FAITHFUL_CONFIGS = ("float32", "bfloat16", "float16", "fp8")


def faithful_inputs(config: str) -> dict:
    """CPU inputs of one configuration (seeded): B=2 rows of 300 keys, h_q 16, pages of 64, s_q 2, causal."""
    import torch

    from mla_conformance.impl.ops.reference import encode_fp8_656

    g = torch.Generator().manual_seed(7)
    B, s_q, h, page, keys = 2, 2, 16, 64, 300
    pages = -(-keys // page)
    dtype = torch.bfloat16 if config == "fp8" else getattr(torch, config)
    latent = torch.randn(B * pages, page, 1, 576, generator=g)
    cache = encode_fp8_656(latent) if config == "fp8" else latent.to(dtype)
    return {"q": torch.randn(B, s_q, h, 576, generator=g).to(dtype), "kv_cache": cache,
            "block_table": torch.randperm(B * pages, generator=g).to(torch.int32).view(B, pages),
            "cache_seqlens": torch.tensor([keys, keys - 77], dtype=torch.int32)}


def decode(op, inp: dict, device: str):
    import torch

    moved = {k: v.to(device) for k, v in inp.items()}
    out, lse = op.decode(moved["q"], moved["kv_cache"], moved["block_table"], moved["cache_seqlens"],
                         softmax_scale=192 ** -0.5, causal=True)
    if device != "cpu":
        torch.cuda.synchronize()
    return out.cpu(), lse.cpu()


def interpreted(path: str, emulation: str) -> int:
    """(Run with TRITON_INTERPRET=1.) The op on CPU under the interpreter, the faithful tier ``emulation`` on or
    off, on each configuration's inputs in ``path`` (a torch file written by :func:`faithful_table`); outputs
    saved beside them."""
    import torch

    from mla_conformance.impl.ops import triton_faithful
    from mla_conformance.impl.ops.triton_mla import TritonMLAOp

    if emulation == "on":
        triton_faithful.install()
    inputs = torch.load(path)
    torch.save({c: decode(TritonMLAOp(), inp, "cpu") for c, inp in inputs.items()}, f"{path}.{emulation}")
    return 0


def tf32_probe() -> str:
    """Which TF32 conversion the GPU's default float32 ``tl.dot`` does: A @ I (one product per output, exact sums)
    gives the conversion of A's elements."""
    import numpy as np
    import torch

    from mla_conformance.impl.ops import triton_faithful

    n = 64
    a = torch.randn(n, n, generator=torch.Generator().manual_seed(0))
    a[0, :4] = torch.tensor([1 + 2 ** -11, 1 + 3 * 2 ** -11, -(1 + 2 ** -11), 1024.5])  # ties
    c = torch.empty(n, n, device="cuda")
    _identity_dot[(1,)](a.cuda(), torch.eye(n, device="cuda"), c, n)
    got = c.cpu().numpy()
    modes = {m: triton_faithful.tf32_round(a.numpy(), m) for m in triton_faithful.TF32_MODES}
    modes["ieee"] = a.numpy()
    same = [m for m, v in modes.items() if np.array_equal(v, got)]
    near = {m: int((v != got).sum()) for m, v in modes.items()}
    return (f"TF32 probe (default tl.dot of float32 x identity, {n}x{n}): the GPU's conversion is "
            f"{' / '.join(same) or 'none of ' + str(list(modes))} (values differing per mode: {near}); the faithful "
            f"tier's default: {triton_faithful.DEFAULT_TF32}")


def faithful_table() -> None:
    """The op's error on the GPU and under the interpreter (faithful tier on and off), same inputs."""
    import torch

    from mla_conformance.impl.ops.reference import oracle
    from mla_conformance.impl.ops.triton_mla import TritonMLAOp

    print(tf32_probe())
    inputs = {c: faithful_inputs(c) for c in FAITHFUL_CONFIGS}
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "inputs.pt")
        torch.save(inputs, path)
        runs = {}
        for emulation in ("on", "off"):
            proc = subprocess.run([sys.executable, __file__, "--interpreted", path, "--emulation", emulation],
                                  cwd=ROOT, capture_output=True, text=True,
                                  env={**os.environ, "TRITON_INTERPRET": "1"})
            if proc.returncode != 0:
                print(f"interpreter run (emulation {emulation}) failed:\n{proc.stderr[-2000:]}")
                runs[emulation] = None
            else:
                runs[emulation] = torch.load(f"{path}.{emulation}")
    print(f"{'config':<10} {'where':<26} {'out err / max|ref|':>18} {'lse max err':>12} {'max |gpu - it|':>15}")
    for c, inp in inputs.items():
        ref_out, ref_lse = oracle(inp["q"].double(), inp["kv_cache"], inp["block_table"], inp["cache_seqlens"],
                                  softmax_scale=192 ** -0.5, causal=True)
        scale = float(ref_out.abs().max())
        gpu = decode(TritonMLAOp(), inp, "cuda")
        rows = [("GPU", gpu), ("interpreter, faithful tier", (runs["on"] or {}).get(c)),
                ("interpreter as shipped", (runs["off"] or {}).get(c))]
        for where, got in rows:
            if got is None:
                print(f"{c:<10} {where:<26} {'-':>18}")
                continue
            out, lse = got[0].double(), got[1].double()
            vs_gpu = "" if where == "GPU" else f"{float((out - gpu[0].double()).abs().max()):>15.3e}"
            print(f"{c:<10} {where:<26} {float((out - ref_out).abs().max()) / scale:>18.3e} "
                  f"{float((lse - ref_lse).abs().nan_to_num(nan=float('inf')).max()):>12.3e} {vs_gpu}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verdict-only", action="store_true")
    parser.add_argument("--ops-only", action="store_true", help="the op suite only, not the layer suite through the op")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--keys", type=int, default=32768)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--faithful-only", action="store_true", help="the TF32 probe and the GPU / faithful-tier "
                        "errors only")
    parser.add_argument("--interpreted", metavar="INPUTS", help=argparse.SUPPRESS)  # the interpreter subprocess
    parser.add_argument("--emulation", choices=("on", "off"), default="on", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.interpreted:
        return interpreted(args.interpreted, args.emulation)
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: this script is for a GPU host (on CPU: `pytest -m triton_interpret`)")
        return 2
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("TRITON_INTERPRET=1 is set: unset it (the interpreter runs CPU tensors)")
        return 2
    print(f"device: {torch.cuda.get_device_name()} (capability {'.'.join(map(str, torch.cuda.get_device_capability()))}), "
          f"torch {torch.__version__}, CUDA {torch.version.cuda}")
    if args.faithful_only:
        faithful_table()
        return 0
    runs = [verdict(["suites", "--mla-op", "triton", "--mla-device", "cuda"])]
    if not args.ops_only:
        runs.append(verdict(["suites/test_numerics.py", "suites/test_paged_cache.py", "--mla-backend", "op:triton",
                             "--mla-device", "cuda"]))
    failed_ids = []
    for run in runs:
        print(f"{run['args']}: exit {run['code']}, {run['passed']} passed, {run['failed']} failed, "
              f"{run['error']} errors, {run['skipped']} skipped")
        for line in run["bad"]:
            print(f"  {line}")
        failed_ids += run["bad"]
    if args.verdict_only:
        return 0 if not failed_ids else 1
    faithful_table()
    from mla_conformance.impl.ops.triton_mla import TritonMLAOp

    op = TritonMLAOp()
    scale = 192 ** -0.5
    bw = copy_bandwidth()
    print(f"copy bandwidth (2 GiB device-to-device): {bw / 1e9:.0f} GB/s")
    try:
        import flash_mla  # noqa: F401

        from mla_conformance.impl.ops.flashmla import FlashMLAOp
        flashmla = FlashMLAOp()
    except Exception as exc:  # not installed here
        flashmla = None
        print(f"FlashMLA not timed: {type(exc).__name__}: {exc}")
    print(f"{'config':<28} {'triton ms':>10} {'GB/s':>8} {'% copy':>7} {'flashmla ms':>12}")
    for fp8 in (False, True):
        name = f"B={args.batch} keys={args.keys} {'fp8-656' if fp8 else 'bf16'}"
        fmt = "fp8-e4m3-flashmla" if fp8 else "latent"
        broken = [i for i in failed_ids if ("fp8" in i) == fp8 or "numerics" in i]
        if broken:
            print(f"{name:<28} not timed: its conformance failed ({len(broken)} tests, above)")
            continue
        q, cache, bt, lens = inputs(args.batch, args.keys, fp8)
        seconds = time_calls(lambda: op.decode(q, cache, bt, lens, softmax_scale=scale, causal=False), args.iters)
        moved = cache.numel() * cache.element_size() + q.numel() * 2 + args.batch * 128 * (512 * 2 + 4)
        fm = "-"
        if flashmla is not None and not fp8:
            try:
                fm = f"{time_calls(lambda: flashmla.decode(q, cache, bt, lens, softmax_scale=scale, causal=False), args.iters) * 1e3:.3f}"
            except Exception as exc:
                fm = f"failed: {type(exc).__name__}"
        print(f"{name:<28} {seconds * 1e3:>10.3f} {moved / seconds / 1e9:>8.0f} {moved / seconds / bw * 100:>6.0f}% "
              f"{fm:>12}   ({fmt})")
        del q, cache, bt, lens
        torch.cuda.empty_cache()
    return 0 if not failed_ids else 1


if __name__ == "__main__":
    sys.exit(main())
