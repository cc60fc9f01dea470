#!/usr/bin/env python
"""Decode under a real torch.cuda.CUDAGraph, as engines call it (issue 26), on a GPU host.

For a future session with a CUDA device. Installs nothing: it uses whatever ``flash_mla`` / ``flashinfer`` the
environment has and reports an op whose package does not import as "not importable". Run from the repository
root::

    python .gpu_check/engine_graphs.py                     # reference-op, flashmla, flashinfer, flashinfer-fa2
    python .gpu_check/engine_graphs.py --op reference-op --s-q 1 --s-q 3

Per op and s_q (causal for s_q > 1; bfloat16, pages of 64, h_q 16): static tensors sized for the largest batch
(q, block_table, cache_seqlens over one paged cache holding every row, and out / lse buffers where the op declares
``out_buffers``) are filled with a batch of every row -- long rows (thousands of keys, where split-KV kernels
split) and short ones -- and one decode call is captured into a graph. Then, for each smaller batch, the same
tensors are refilled in place (the real rows first; the rows past them padding rows: ``cache_seqlens = 0`` -- or
s_q keys for an op that declines queries without keys -- and whatever the block table and q held before, as a
replayed graph sees them) and the graph is replayed. Each replay's real rows are compared with a fresh eager call
on the same tensors (max abs difference; bitwise or not) and with the float64 oracle within the op suite's bounds
(``mla_conformance.checks.op.compare.compare``); the padding rows' out must be finite. A capture that fails is a
row of the table with its exception (an adapter that plans on the host per call cannot be captured as it is).

Prints one table: op, s_q, real / captured rows, capture, replay vs eager, replay vs oracle, eager vs oracle,
padding rows; then the first line of each failure. Exit status 0 when every row passed, 1 when one did not, 2
without a CUDA device (nothing is run).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

from op_adapters import OPS, device_line, importable  # noqa: E402  (this directory's script: one device line, one import probe)

GRAPH_OPS = ("reference-op", "flashmla", "flashinfer", "flashinfer-fa2")
#: the rows of the captured batch: long rows (split-KV kernels split at thousands of keys) and short ones
LENS = (2300, 64, 700, 33, 4100, 129, 17, 1000)
#: the real rows of each replay (a smaller batch padded up to the captured one), as offsets into LENS
BATCHES = (5, 2, 7, 1)
H_Q, PAGE = 16, 64


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:240] if text else ''}"


def run_case(op, s_q: int, device: str) -> list[dict]:
    """Capture at len(LENS) rows, replay for each of BATCHES; one dict per replay (or one for a failed setup)."""
    import torch

    from mla_conformance.checks.op.compare import compare
    from mla_conformance.checks.op.inputs import Spec, build, op_reason
    from mla_conformance.contract.op import D_V, OpCase, declared
    from mla_conformance.impl.ops.reference import oracle

    B = len(LENS)
    causal = s_q > 1
    base = dict(batch=B, s_q=s_q, h_q=H_Q, page_block_size=PAGE, dtype=torch.bfloat16, causal=causal, device=device)
    pad_len = 0
    if op_reason(op, OpCase(**base, rows_without_keys=True)):
        pad_len = s_q                                     # an op that declines queries without keys: s_q keys
        why = op_reason(op, OpCase(**base, rows_without_keys=False))
        if why:
            return [{"n": "-", "capture": f"declined: {why}"}]
    case = OpCase(**base, rows_without_keys=pad_len == 0)
    full = build(Spec(case, LENS, seed=26, spare_pages=4))
    q_all, kv, bt_all, lens_all = (t.clone() for t in full.args())
    scale = full.softmax_scale
    q_s, bt_s, lens_s = q_all.clone(), bt_all.clone(), lens_all.clone()      # the graph's static inputs
    buffers = {}
    if declared(op, "out_buffers"):
        buffers["out"] = torch.empty(B, s_q, H_Q, D_V, dtype=q_s.dtype, device=device)
        if declared(op, "returns_lse"):
            buffers["lse"] = torch.empty(B, H_Q, s_q, dtype=torch.float32, device=device)

    def call():
        return op.decode(q_s, kv, bt_s, lens_s, softmax_scale=scale, causal=causal, **buffers)

    graph = torch.cuda.CUDAGraph()
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):                    # warm-up off the capture stream, as engines do
            for _ in range(2):
                call()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            static = call()
        torch.cuda.synchronize()
    except Exception as exc:
        return [{"n": "-", "capture": f"capture failed: {first_line(exc)}"}]

    rows = []
    for k, n in enumerate(BATCHES):
        real = [(3 * k + i) % B for i in range(n)]       # other rows in each slot: stale pages, lengths, q
        q_s[:n].copy_(q_all[real])
        bt_s[:n].copy_(bt_all[real])
        lens_s[:n].copy_(lens_all[real])
        lens_s[n:].fill_(pad_len)                        # padding rows; their q and block table stay stale
        row = {"n": f"{n}/{B}", "capture": "ok"}
        try:
            graph.replay()
            torch.cuda.synchronize()
            replayed = tuple(None if t is None else t.clone() for t in static)
            eager = call()
            torch.cuda.synchronize()
        except Exception as exc:
            rows.append({**row, "replay": f"raised {first_line(exc)}"})
            continue
        diff = (replayed[0][:n].double() - eager[0][:n].double()).abs()
        row["replay_vs_eager"] = ("bitwise" if torch.equal(replayed[0][:n], eager[0][:n]) else
                                  f"max abs {float(diff.nan_to_num(float('inf')).max()):.2e}")
        sub = OpCase(**{**base, "batch": n}, rows_without_keys=False)
        ref = oracle(q_s[:n].cpu(), kv.cpu(), bt_s[:n].cpu(), lens_s[:n].cpu(), softmax_scale=scale, causal=causal,
                     magnitudes=True)
        for label, (out, lse) in (("replay_vs_oracle", replayed), ("eager_vs_oracle", eager)):
            try:
                compare(op, sub, out[:n], None if lse is None else lse[:n], ref[0], ref[1], check=label,
                        figures={}, oracle=ref)
                row[label] = "ok"
            except AssertionError as exc:
                row[label] = "FAIL"
                row.setdefault("failures", []).append(f"{label}: {str(exc).splitlines()[0][:400]}")
        finite = bool(torch.isfinite(replayed[0][n:]).all()) if n < B else True
        row["padding"] = "finite" if finite else "NON-FINITE"
        rows.append(row)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--op", action="append", help=f"only these ops (repeatable; default {', '.join(GRAPH_OPS)})")
    parser.add_argument("--s-q", action="append", type=int, dest="s_q", help="query tokens per row (repeatable; "
                        "default 1 and 3: single-token decode and a speculative verify of 3)")
    parser.add_argument("--device", default="cuda", help="the CUDA device (default cuda)")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print(f"engine_graphs: {device_line()}: CUDA-graph capture needs a CUDA device; nothing run", file=sys.stderr)
        return 2
    from mla_conformance.specs import get_op

    print(f"device: {device_line()}", flush=True)
    table = []
    for name in args.op or GRAPH_OPS:
        why = importable(OPS.get(name))
        if why:
            table.append((name, "-", {"n": "-", "capture": f"not importable ({OPS.get(name)}: {why})"}))
            continue
        op = get_op(name)
        for s_q in args.s_q or (1, 3):
            print(f"capturing {name} s_q={s_q} ...", flush=True)
            try:
                rows = run_case(op, s_q, args.device)
            except Exception as exc:                     # a setup that raised: its row says so
                rows = [{"n": "-", "capture": f"setup raised {first_line(exc)}"}]
            table += [(name, s_q, r) for r in rows]

    cols = ("replay_vs_eager", "replay_vs_oracle", "eager_vs_oracle", "padding")
    print(f"\n{'op':<16} {'s_q':>3} {'rows':>5}  {'capture':<10} {'replay vs eager':<18} {'replay/oracle':<13} "
          f"{'eager/oracle':<12} padding")
    bad = 0
    for name, s_q, r in table:
        ok = r.get("capture") == "ok" and "replay" not in r and all(r.get(c) in ("ok", "finite") or
                                                                    c == "replay_vs_eager" for c in cols)
        bad += not ok
        if r.get("capture") != "ok" or "replay" in r:
            print(f"{name:<16} {s_q!s:>3} {r['n']:>5}  {r.get('replay', r['capture'])}")
            continue
        print(f"{name:<16} {s_q!s:>3} {r['n']:>5}  {'ok':<10} {r['replay_vs_eager']:<18} {r['replay_vs_oracle']:<13} "
              f"{r['eager_vs_oracle']:<12} {r['padding']}")
    for name, s_q, r in table:
        for line in r.get("failures", []):
            print(f"\n{name} s_q={s_q} rows {r['n']}: {line}")
    return 1 if bad else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
