"""The PNG plots of what a run measured (bytes per token, attention error, codecs, accuracy, decode time):
matplotlib on the Agg backend with fixed metadata, so the same report draws the same bytes."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from mla_conformance.report.build import backend_of, formula_bytes, in_section, measured_bytes, tolerance_of
from mla_conformance.report.fmt import NOT_MEASURED

PLOT_TITLES = {
    "bytes_per_token.png": "KV cache bytes per token by cache format and codec",
    "attention_error.png": "Attention output error against float64, by backend and dtype",
    "attention_error_by_codec.png": "Attention error by KV codec",
    "accuracy_by_codec.png": "Tiny-model generation accuracy by KV codec",
    "decode_time.png": "Decode step time against context (timings.json)",
}


class _Pyplot:
    """matplotlib.pyplot on the Agg backend, imported when the first plot is drawn: a report with nothing to plot
    (its tests measured no figures) writes no PNG and never imports matplotlib, the heaviest import a report has."""

    def __getattr__(self, name: str):  # each use: matplotlib.use("Agg") again is a no-op once it is the backend
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        return getattr(plt, name)


def write_plots(report: dict[str, Any], directory: Path) -> list[str]:
    """PNG plots of the measured figures (matplotlib, Agg backend, fixed metadata so bytes are stable)."""
    plt = _Pyplot()
    written = []
    meta = {"Software": None}
    seed = sorted(in_section(report, "v2-lite-cache-probe"), key=backend_of)
    codec_rows = [t for t in in_section(report, "codec-bytes")
                  if t.get("params", {}).get("preset") == "deepseek-v2-lite"
                  and t["params"].get("dtype", "bfloat16") == "bfloat16" and t["params"].get("codec") != "none"
                  and t.get("backend") == "reference-absorbed"]
    if seed or codec_rows:
        rows = seed + sorted(codec_rows, key=lambda t: t["params"]["codec"])
        labels = [f"{t['backend']} ({t['figures'].get('cache_format', '?')})" for t in seed]
        labels += [f"codec {t['params']['codec']}" for t in rows[len(seed):]]
        measured = [measured_bytes(t["figures"]) for t in rows]  # never the formula in its place
        formula = [formula_bytes(t["figures"]) for t in rows]
        fig, ax = plt.subplots(figsize=(max(6.5, 0.6 * len(rows) + 2), 5.5))
        xs = [i for i, v in enumerate(measured) if v is not None]
        ax.bar(xs, [measured[i] for i in xs], color="#4477aa", label="measured (cache tensors, this run)")
        fx = [i for i, v in enumerate(formula) if v is not None]
        if fx:
            ax.scatter(fx, [formula[i] for i in fx], marker="_", s=500, color="black",
                       label="formula (declared format)")
        ax.set_xticks(range(len(rows)), labels, fontsize=8, rotation=45, ha="right")
        ax.set_yscale("log")
        ax.set_ylabel("bytes / token / layer")
        ax.set_title("KV cache bytes per token (V2-Lite dims, BF16): measured and formula")
        floor = min([v for v in measured + formula if v] or [1])
        for i, v in enumerate(measured):
            ax.text(i, v if v is not None else floor, f"{v:,}" if v is not None else NOT_MEASURED, ha="center",
                    va="bottom", fontsize=7)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(directory / "bytes_per_token.png", dpi=100, metadata=meta)
        plt.close(fig)
        written.append("bytes_per_token.png")
    errs = in_section(report, "numerics")
    if errs:
        groups: dict[tuple, float] = {}
        bounds: dict[tuple, float] = {}  # the rel_fro bound each group's rows recorded (one per dtype)
        for t in errs:
            key = (t.get("backend", ""), t["params"]["dtype"])
            groups[key] = max(groups.get(key, 0.0), t["figures"]["rel_fro"])
            tol = tolerance_of(t["figures"])[0]
            if tol is not None:
                bounds[key] = min(bounds.get(key, tol), tol)
        keys = sorted(groups)
        fig, ax = plt.subplots(figsize=(max(6.5, 0.9 * len(keys) + 2), 5))
        ax.bar(range(len(keys)), [max(groups[k], 1e-18) for k in keys], color="#cc6677", label="worst measured")
        tols = [bounds.get(k) for k in keys]
        if any(v is not None for v in tols):
            ax.scatter([i for i, v in enumerate(tols) if v is not None], [v for v in tols if v is not None],
                       marker="_", s=600, color="black", label="tolerance of the dtype")
        ax.set_xticks(range(len(keys)), [f"{b} {d}" for b, d in keys], fontsize=8, rotation=35, ha="right")
        ax.set_yscale("log")
        ax.set_ylabel("relative Frobenius error vs float64")
        ax.set_title("Attention output error by backend and dtype (worst test)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(directory / "attention_error.png", dpi=100, metadata=meta)
        plt.close(fig)
        written.append("attention_error.png")
    for plot in PLOT_HOOKS:
        written += plot(report, directory, plt, meta) or []
    return written


def safe_plots(report: dict[str, Any], directory: Path) -> list[str]:
    """write_plots, but a figure it cannot draw (an unexpected figure layout) costs a warning, not the report."""
    try:
        return write_plots(report, directory)
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        if "matplotlib.pyplot" in sys.modules:
            sys.modules["matplotlib.pyplot"].close("all")
        print(f"mla-conformance: warning: plots skipped ({type(exc).__name__}: {exc})", file=sys.stderr)
        return sorted(p.name for p in directory.glob("*.png"))


def _codec_plots(report, directory, plt, meta) -> list[str]:
    written = []
    attn = sorted(((t["params"]["codec"], t["figures"]["attention"]["rel_fro"]) for t in report["tests"]
                   if t.get("section") == "codec-attention" and t.get("figures")
                   and t.get("backend") == "reference-absorbed" and isinstance(t["figures"].get("attention"), dict)))
    if attn:
        names = ["none"] + [k for k, _ in attn if k != "none"]
        values = {k: v for k, v in attn}
        fig, ax = plt.subplots(figsize=(max(6.5, 0.6 * len(names) + 2), 5.5))
        xs = [i for i, k in enumerate(names) if values.get(k)]
        ax.bar(xs, [values[names[i]] for i in xs], color="#ddaa33", label="reference-absorbed")
        ax.set_xticks(range(len(names)), names, rotation=45, ha="right", fontsize=8)
        ax.set_yscale("log")
        low = min(v for v in values.values() if v) if any(values.values()) else 1e-3
        ax.set_xlim(-0.8, len(names) - 0.2)
        ax.text(0, low, "0\n(baseline)", ha="center", va="bottom", fontsize=7)
        ax.set_ylabel("rel. error vs codec none")
        ax.set_title("Attention output error by KV codec (V2-Lite, BF16)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(directory / "attention_error_by_codec.png", dpi=100, metadata=meta)
        plt.close(fig)
        written.append("attention_error_by_codec.png")
    acc = sorted(((t["params"]["kv_codec"], t["figures"]["accuracy"]) for t in report["tests"]
                  if t.get("section") == "golden-codec" and t.get("figures")
                  and t.get("backend") == "reference-absorbed"))
    if acc:
        fig, ax = plt.subplots(figsize=(max(6.5, 0.7 * len(acc) + 2), 5))
        ax.bar(range(len(acc)), [v for _, v in acc], color="#117733", label="reference-absorbed")
        ax.set_xticks(range(len(acc)), [k for k, _ in acc], rotation=45, ha="right", fontsize=8)
        ax.set_ylim(0, 1.05)
        ax.axhline(0.99, color="grey", lw=0.8, ls="--", label="0.99: floor of the INT8 codecs' test")
        ax.set_ylabel("accuracy on the pinned answers")
        ax.set_title("Tiny-model generation accuracy by KV codec")
        ax.legend(fontsize=8, loc="lower left")
        fig.tight_layout()
        fig.savefig(directory / "accuracy_by_codec.png", dpi=100, metadata=meta)
        plt.close(fig)
        written.append("accuracy_by_codec.png")
    bench = [t for t in report.get("timings", []) if t["figures"].get("median_s") and "context" in t["params"]]
    if bench:
        fig, ax = plt.subplots(figsize=(6.5, 4.5))
        series: dict[str, list] = {}
        for t in bench:
            p = t["params"]
            series.setdefault(f"{p.get('backend')} {p.get('kv_codec', 'none')} batch {p.get('batch', 1)}", []).append(
                (int(p["context"]), t["figures"]["median_s"]))
        for label, pts in sorted(series.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] * 1e3 for p in pts], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (cached tokens)")
        ax.set_ylabel("decode step median (ms)")
        ax.legend(fontsize=7)
        ax.set_title("Decode step time against context")
        fig.tight_layout()
        fig.savefig(directory / "decode_time.png", dpi=100, metadata=meta)
        plt.close(fig)
        written.append("decode_time.png")
    return written


#: Extra plots; each a function(report, directory, plt, metadata) -> list of file names.
PLOT_HOOKS: list = [_codec_plots]
