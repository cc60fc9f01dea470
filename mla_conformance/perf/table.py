"""The ``bench`` report as a terminal table: one row per backend x context (timed, skipped or not timed)."""

from __future__ import annotations

from typing import Any

from mla_conformance.arch.device import device_line


def _checked(r: dict[str, Any]) -> str:
    """The gate's worst error as a fraction of its bound, over the rows (rel_fro, and max_abs/rms where bounded)."""
    c = r.get("correctness") or {}
    m, b = c.get("measured") or {}, c.get("bound") or {}
    if not m.get("rows") or not b.get("rows"):
        return "?"
    used = 0.0
    for got, lim in zip(m["rows"], b["rows"]):
        for name in ("rel_fro", "max_rel"):
            if lim.get(name):
                used = max(used, got[name] / lim[name])
    return f"{used:.2f}"


def format_table(report: dict[str, Any]) -> str:
    lines = [f"decode step on {device_line(report['device'])}, measured bandwidth "
             f"{report['measured_bandwidth_gb_per_s']:.1f} GB/s; every timed step was first checked against the "
             "float64 oracle (err/bound: its worst error over its bound, the suite's plus the score-rounding term)",
             ""]
    w = max([22] + [len(r["backend"]) for r in report["results"]])
    head = (f"{'backend':<{w}} {'codec':<10} {'context':>8} {'batch':>5} {'ms/step':>9} {'MB/step':>9} "
            f"{'GB/s':>7} {'of bw':>6} {'MFLOP':>9} {'GFLOP/s':>8} {'err/bound':>9}  flop model")
    lines += [head, "-" * len(head)]
    for r in report["results"]:
        lead = f"{r['backend']:<{w}} {r['kv_codec']:<10} {r['context']:>8} {r['batch']:>5}"
        if r.get("skipped"):
            lines.append(f"{lead}  skipped: {r['skipped']}")
            continue
        if r.get("not_timed"):
            lines.append(f"{lead}  {r['not_timed']}")
            continue
        lines.append(f"{lead} {r['median_s'] * 1e3:>9.3f} {r['bytes_per_step'] / 1e6:>9.2f} {r['gb_per_s']:>7.2f} "
                     f"{r['bandwidth_fraction']:>6.1%} {r['flops'] / 1e6:>9.1f} {r['gflop_per_s']:>8.2f} "
                     f"{_checked(r):>9}  {r['flop_model']}")
    ratios = report.get("naive_over_absorbed") or {}
    if ratios:
        lines += ["", "reference-naive / reference-absorbed time per step (absorbed speed-up):"]
        lines += [f"  context {k}: {v:.2f}x" for k, v in ratios.items()]
    for key in ("sparse_decode_bytes", "sparse_decode_bytes_preset"):
        sparse = report.get(key)
        if not sparse:
            continue
        lines += ["", f"DeepSeek Sparse Attention decode, bytes read per step per row and layer at {sparse['preset']} "
                      f"dims (index_topk {sparse['index_topk']}; measured B/token):"]
        for form, f in sparse["forms"].items():
            if f.get("skipped"):
                lines.append(f"  {form:<18} skipped: {f['skipped']}")
                continue
            bpt = f["bytes_per_token"]
            for r in f["contexts"]:
                lines.append(f"  {form:<18} latent {bpt['latent']} + indexer {bpt['indexer']} B/token, context "
                             f"{r['context']:>6}: dense {r['dense_bytes'] / 1e6:8.2f} MB, sparse "
                             f"{r['sparse_bytes'] / 1e6:8.2f} MB, dense/sparse {r['dense_over_sparse']:.2f}x")
    return "\n".join(lines)
