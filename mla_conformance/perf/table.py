"""The ``bench`` report as a terminal table: one row per backend x context (timed, skipped or not timed)."""

from __future__ import annotations

from typing import Any

from mla_conformance.arch.device import device_line
from mla_conformance.perf.bench import ratio_pairs


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
    policy = report.get("cpu_wait_policy")
    lines = [f"decode step on {device_line(report['device'])}"
             + (f" (OMP_WAIT_POLICY={policy})" if policy and report["device"].get("device") == "cpu" else "")
             + ", measured bandwidth "
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
    pairs = ratio_pairs(report["results"])
    if pairs:
        byte_ratio = report.get("cache_byte_ratio")
        lines += ["", "reference-naive / reference-absorbed time per step (absorbed speed-up)"
                  + (f"; the cache byte ratio (expanded / latent bytes per token) is {byte_ratio:.2f}x" if byte_ratio
                     else "") + ":"]
        bw = report["measured_bandwidth_gb_per_s"]
        lines += [f"  context {k}: {n['median_s'] / a['median_s']:.2f}x (absorbed {a['gb_per_s']:.2f} GB/s = "
                  f"{a['bandwidth_fraction']:.1%} of the measured {bw:.1f} GB/s copy bandwidth, naive "
                  f"{n['gb_per_s']:.2f} GB/s = {n['bandwidth_fraction']:.1%})" for k, n, a in pairs]
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
