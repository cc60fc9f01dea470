"""``mla-conformance run`` and ``merge``: run the suite and write reports people and CI read.

``run`` drives pytest on the suites (in a subprocess, pytest's own progress on the terminal), collects
every test's outcome and measured figures through the plugin's ``--mla-results``, and writes into the
output directory, atomically (a temporary directory renamed into place):

* ``conformance.json`` -- versioned schema; environment, per-test outcome, skip reason and figures.
  Byte-identical between two runs on the same machine: no timings, no dates, sorted keys.
* ``conformance.md`` -- the tables (cache bytes, errors, codecs, gating), a summary line per backend.
* ``timings.json`` -- wall times, kept apart so the report stays deterministic.
* PNG plots (bytes per token by format/codec, attention error by dtype or codec, accuracy by codec).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from mla_conformance.errors import MLAInputError

SCHEMA = "mla-conformance/report"
SCHEMA_VERSION = 1


# --------------------------------------------------------------------------- environment


def environment(device: str) -> dict[str, Any]:
    import torch

    from mla_conformance import __version__

    env: dict[str, Any] = {"suite_version": __version__, "python": platform.python_version(),
                           "torch": torch.__version__, "platform": platform.platform(terse=True),
                           "machine": platform.machine(), "device": device}
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    if device.startswith("cuda") and torch.cuda.is_available():
        idx = torch.device(device).index or 0
        cap = torch.cuda.get_device_capability(idx)
        env.update(device_name=torch.cuda.get_device_name(idx), capability=f"{cap[0]}.{cap[1]}",
                   cuda=torch.version.cuda)
    else:
        env.update(device_name=platform.processor() or platform.machine(), capability=None, cuda=None)
    return env


def find_suites() -> Path:
    """The suites directory: ./suites in a checkout, else the one beside the installed package."""
    for cand in (Path.cwd() / "suites", Path(__file__).resolve().parent.parent / "suites"):
        if (cand / "test_cache_bytes.py").exists():
            return cand
    raise MLAInputError("cannot find the suites/ directory: run `mla-conformance run` from a checkout of "
                        "mla-conformance (or pass --suites DIR)")


# --------------------------------------------------------------------------- building the report


def _backend_of(test: dict) -> str:
    return test.get("backend") or (test.get("params") or {}).get("backend") or ""


def is_timing(nodeid: str) -> bool:
    """Benchmarks' figures are clock readings: they go to timings.json, never into conformance.json."""
    return "test_decode_bench.py" in nodeid


def timings_of(results: dict) -> list[dict[str, Any]]:
    return [{"nodeid": t["nodeid"], "params": t.get("params", {}), "figures": t["figures"]}
            for t in sorted(results["tests"], key=lambda t: t["nodeid"]) if is_timing(t["nodeid"]) and t.get("figures")]


def build_report(results: dict, *, name: str, env: dict) -> dict[str, Any]:
    tests = []
    for t in results["tests"]:
        entry = {"nodeid": t["nodeid"], "outcome": t["outcome"]}
        if _backend_of(t):
            entry["backend"] = _backend_of(t)
        params = {k: v for k, v in (t.get("params") or {}).items() if k != "backend"}
        if params:
            entry["params"] = params
        if t.get("reason"):
            entry["reason"] = t["reason"]
        if t.get("device"):
            entry["device"] = t["device"]
        if t.get("figures") and not is_timing(t["nodeid"]):
            entry["figures"] = t["figures"]
        tests.append(entry)
    tests.sort(key=lambda e: e["nodeid"])
    summary: dict[str, dict[str, int]] = {}
    for t in tests:
        key = t.get("backend", "(backend-independent)")
        summary.setdefault(key, {"passed": 0, "failed": 0, "error": 0, "skipped": 0, "xfailed": 0, "xpassed": 0})
        summary[key][t["outcome"]] = summary[key].get(t["outcome"], 0) + 1
    return {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "name": name, "environment": env,
            "backends": results.get("backends", []), "exitstatus": results.get("exitstatus"),
            "summary": summary, "tests": tests}


def _fmt_int(v) -> str:
    return f"{v:,}" if isinstance(v, int) else str(v)


def _fmt_e(v) -> str:
    return f"{v:.3e}" if isinstance(v, (int, float)) else str(v)


def _tests_named(report, fragment):
    return [t for t in report["tests"] if fragment in t["nodeid"] and t.get("figures")]


def render_markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    out = [f"# MLA conformance report: {report['name']}", ""]
    out.append(f"mla-conformance {env['suite_version']} · device {env['device']} ({env.get('device_name')}"
               + (f", capability {env['capability']}" if env.get("capability") else "") + ")"
               + f" · torch {env['torch']} · transformers {env.get('transformers')} · python {env['python']}")
    out += ["", "## Summary", "", "| backend | passed | failed | errors | skipped | xfailed |", "|---|---:|---:|---:|---:|---:|"]
    for backend, s in sorted(report["summary"].items()):
        out.append(f"| {backend} | {s['passed']} | {s['failed']} | {s['error']} | {s['skipped']} | {s['xfailed']} |")
    for backend, s in sorted(report["summary"].items()):
        verdict = "CONFORMS" if s["failed"] == 0 and s["error"] == 0 else "DOES NOT CONFORM"
        out.append(f"\n**{backend}**: {verdict} ({s['passed']} passed, {s['failed']} failed, {s['skipped']} skipped)")

    seed = [t for t in _tests_named(report, "test_seed_table[")]
    if seed:
        out += ["", "## Cache bytes (seed 000: V2-Lite, BF16, 25-token prefill + 1 decode, batch 1, 32 slots)", "",
                "| backend | format | bytes/token/layer | active B | allocated B | tensors |", "|---|---|---:|---:|---:|---|"]
        for t in sorted(seed, key=_backend_of):
            f = t["figures"]
            tens = ", ".join(f"{k} {_fmt_int(v)}" for k, v in sorted(f["tensors"].items()))
            out.append(f"| {t['backend']} | {f['cache_format']} | {_fmt_int(f['per_token_bytes'])} | "
                       f"{_fmt_int(f['active_nbytes'])} | {_fmt_int(f['allocated_nbytes'])} | {tens} |")
        ratio = _tests_named(report, "test_seed_figures_reproduced")
        if ratio:
            f = ratio[0]["figures"]
            out.append(f"\nnaive / absorbed = {_fmt_int(f['naive_active'])} / {_fmt_int(f['absorbed_active'])} = "
                       f"{f['ratio']:.6f}; reduction {f['reduction'] * 100:.2f}% (seed 000: 8.888…, 88.75%)")

    errs = _tests_named(report, "test_numerics.py::test_against_float64")
    if errs:
        out += ["", "## Numerical error against the float64 expanded reference", "",
                "| backend | preset | scenario | dtype | max abs | mean abs | p99 abs | exact | 1-cos | rel Frobenius |",
                "|---|---|---|---|---:|---:|---:|---:|---:|---:|"]
        for t in sorted(errs, key=lambda t: (t["backend"], t["params"]["preset"], t["params"]["dtype"],
                                             t["params"]["scenario"])):
            f, p = t["figures"], t["params"]
            out.append(f"| {t['backend']} | {p['preset']} | {p['scenario']} | {p['dtype']} | {_fmt_e(f['max_abs'])} | "
                       f"{_fmt_e(f['mean_abs'])} | {_fmt_e(f['p99_abs'])} | {f['exact_fraction']:.4f} | "
                       f"{_fmt_e(f['cosine_diff'])} | {_fmt_e(f['rel_fro'])} |")

    for section in REPORT_SECTIONS:
        text = section(report)
        if text:
            out += ["", text]

    skipped = [t for t in report["tests"] if t["outcome"] == "skipped"]
    if skipped:
        out += ["", "## Skipped (with the reason)", ""]
        reasons: dict[str, list[str]] = {}
        for t in skipped:
            reasons.setdefault(t.get("reason", "?"), []).append(t["nodeid"])
        for reason, ids in sorted(reasons.items()):
            out.append(f"- {reason} ({len(ids)} test{'s' if len(ids) > 1 else ''})")
    failed = [t for t in report["tests"] if t["outcome"] in ("failed", "error")]
    if failed:
        out += ["", "## Failures", ""]
        for t in failed:
            out.append(f"- `{t['nodeid']}`: {t.get('reason', '')}")
    return "\n".join(out) + "\n"


def _codec_section(report) -> str | None:
    rows = [t for t in report["tests"] if "test_quantized_kv.py::test_codec_bytes" in t["nodeid"] and t.get("figures")
            and t["params"].get("preset") == "deepseek-v2-lite" and t["params"].get("dtype") == "bfloat16"]
    if not rows:
        return None
    attn = {(t["backend"], t["params"]["codec"]): t["figures"] for t in report["tests"]
            if "test_quantized_kv.py::test_attention_error" in t["nodeid"] and t.get("figures")}
    acc = {(t["backend"], t["params"]["kv_codec"]): t["figures"].get("accuracy") for t in report["tests"]
           if "test_golden_generation_per_codec" in t["nodeid"] and t.get("figures")}
    from mla_conformance.config import MLAConfig

    layers = MLAConfig.preset("deepseek-v2-lite").num_hidden_layers
    out = ["## KV codecs (V2-Lite, BF16 cache; bytes measured from the cache tensors)", "",
           f"| backend | codec | payload B | metadata B | total B/token/layer | model B/token ({layers} layers) | x vs latent | "
           "attention rel error | tiny-model accuracy |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    seed = []
    for t in sorted(rows, key=lambda t: (t["backend"], t["params"]["codec"])):
        f, codec = t["figures"], t["params"]["codec"]
        a = attn.get((t["backend"], codec), {}).get("attention", {})
        a = a.get("rel_fro") if isinstance(a, dict) else None
        g = acc.get((t["backend"], codec))
        out.append(f"| {t['backend']} | {codec} | {_fmt_int(f['payload'])} | {_fmt_int(f['metadata'])} | "
                   f"{_fmt_int(f['bytes_per_token_layer'])} | {_fmt_int(f['model_bytes_per_token'])} | "
                   f"{f['ratio_vs_latent']:.2f} | {_fmt_e(a) if a is not None else ''} | "
                   f"{'' if g is None else f'{g:.4f}'} |")
        if f.get("seed_001"):
            seed.append((codec, f["seed_001"]))
    if seed:
        out += ["", "Seed 001's sizes count no scale or zero-point bytes; with the honest layout:", ""]
        for codec, s in seed:
            out.append(f"- {s['scheme']} (reported {s['reported']}): seed {_fmt_int(s['seed_model_bytes_per_token'])} B/token "
                       f"({s['seed_ratio_vs_expanded']:.1f}x) vs {codec} {_fmt_int(s['honest_model_bytes_per_token'])} B/token "
                       f"({s['honest_ratio_vs_expanded']:.1f}x), +{_fmt_int(s['difference_bytes'])} B")
    return "\n".join(out)


def _generation_section(report) -> str | None:
    rows = [t for t in report["tests"] if "test_generation_golden.py::test_golden_generation[" in t["nodeid"]
            and t.get("figures")]
    if not rows:
        return None
    out = ["## Generation on the embedded tiny model (greedy, accuracy on expected answers)", "",
           "| backend | prompt set | accuracy | golden |", "|---|---|---:|---|"]
    for t in sorted(rows, key=lambda t: (t["backend"], t["params"]["prompt_set"])):
        out.append(f"| {t['backend']} | {t['params']['prompt_set']} | {t['figures']['accuracy']:.4f} | {t['outcome']} |")
    return "\n".join(out)


def _checkpoint_section(report) -> str | None:
    rows = [t for t in report["tests"] if "test_checkpoint.py::test_prefill_decode_on_checkpoint" in t["nodeid"]
            and t.get("figures")]
    pairs = [t for t in report["tests"] if "test_checkpoint.py::test_naive_vs_absorbed_on_checkpoint" in t["nodeid"]
             and t.get("figures")]
    if not rows and not pairs:
        return None
    out = ["## Checkpoint probe (seed 000 sections 4-5: real layer-1 input, prefill + 1 decode)", "",
           "| source | backend | dtype | tokens | active B | allocated B | decode max abs | mean abs | p99 abs | exact |",
           "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for t in sorted(rows, key=lambda t: (t["figures"]["source"], t["backend"], t["figures"]["dtype"])):
        f = t["figures"]
        d = f["decode"]
        out.append(f"| {f['source']} | {t['backend']} | {f['dtype']} | {f['tokens']} | {_fmt_int(f['active_nbytes'])} | "
                   f"{_fmt_int(f['allocated_nbytes'])} | {_fmt_e(d['max_abs'])} | {_fmt_e(d['mean_abs'])} | "
                   f"{_fmt_e(d['p99_abs'])} | {d['exact_fraction']:.4f} |")
    for t in pairs:
        for dtype, m in sorted(t["figures"].items()):
            out.append(f"\nnaive vs absorbed ({t['params'].get('probe', '')} {dtype}, decode token): max {_fmt_e(m['max_abs'])}, "
                       f"mean {_fmt_e(m['mean_abs'])}, p99 {_fmt_e(m['p99_abs'])}, exact {m['exact_fraction']:.4f} "
                       "(seed 000 at V2-Lite: BF16 max 0.0039, FP32 max 1.19e-7)")
    return "\n".join(out)


def _gating_section(report) -> str | None:
    try:
        from mla_conformance.arch import detect, kernel_ids, why_not
    except ImportError:
        return None
    dev = report["environment"]["device"]
    info = detect(dev)
    out = ["## Kernel gating on this device", "", "| kernel | verdict |", "|---|---|"]
    for kid in kernel_ids():
        reason = why_not(kid, info)
        out.append(f"| {kid} | {'runs here' if reason is None else reason} |")
    return "\n".join(out)


#: Extra markdown sections (codecs, gating, generation); each a function(report) -> str | None.
REPORT_SECTIONS: list = [_codec_section, _generation_section, _checkpoint_section, _gating_section]


def write_plots(report: dict[str, Any], directory: Path) -> list[str]:
    """PNG plots of the measured figures (matplotlib, Agg backend, fixed metadata so bytes are stable)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    meta = {"Software": None}
    seed = sorted(_tests_named(report, "test_seed_table["), key=_backend_of)
    codec_rows = [t for t in report["tests"] if "test_quantized_kv.py::test_codec_bytes" in t["nodeid"]
                  and t.get("figures") and t["params"].get("preset") == "deepseek-v2-lite"
                  and t["params"].get("dtype", "bfloat16") == "bfloat16" and t["params"].get("codec") != "none"
                  and t.get("backend") == "reference-absorbed"]
    if seed or codec_rows:
        labels = [f"{t['backend']} ({t['figures']['cache_format']})" for t in seed]
        values = [t["figures"]["per_token_bytes"] for t in seed]
        for t in sorted(codec_rows, key=lambda t: t["params"]["codec"]):
            labels.append(f"codec {t['params']['codec']}")
            values.append(t["figures"]["bytes_per_token_layer"])
        fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(values)), 5))
        ax.bar(range(len(values)), values, color="#4477aa")
        ax.set_xticks(range(len(values)), labels, fontsize=7, rotation=60, ha="right")
        ax.set_yscale("log")
        ax.set_ylabel("bytes / token / layer (V2-Lite, BF16)")
        ax.set_title("KV cache bytes per token by cache format and codec")
        for i, v in enumerate(values):
            ax.text(i, v, f"{v:,}", ha="center", va="bottom", fontsize=7)
        fig.tight_layout()
        fig.savefig(directory / "bytes_per_token.png", dpi=100, metadata=meta)
        plt.close(fig)
        written.append("bytes_per_token.png")
    errs = _tests_named(report, "test_numerics.py::test_against_float64")
    if errs:
        groups: dict[tuple, float] = {}
        for t in errs:
            key = (t["backend"], t["params"]["dtype"])
            groups[key] = max(groups.get(key, 0.0), t["figures"]["rel_fro"])
        keys = sorted(groups)
        fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(keys)), 4))
        ax.bar(range(len(keys)), [groups[k] for k in keys], color="#cc6677")
        ax.set_xticks(range(len(keys)), [f"{b}\n{d}" for b, d in keys], fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("worst relative Frobenius error vs float64")
        ax.set_title("Attention output error by backend and dtype")
        fig.tight_layout()
        fig.savefig(directory / "attention_error.png", dpi=100, metadata=meta)
        plt.close(fig)
        written.append("attention_error.png")
    for plot in PLOT_HOOKS:
        written += plot(report, directory, plt, meta) or []
    return written


def _codec_plots(report, directory, plt, meta) -> list[str]:
    written = []
    attn = sorted(((t["params"]["codec"], t["figures"]["attention"]["rel_fro"]) for t in report["tests"]
                   if "test_quantized_kv.py::test_attention_error" in t["nodeid"] and t.get("figures")
                   and t.get("backend") == "reference-absorbed" and isinstance(t["figures"].get("attention"), dict)))
    if attn:
        fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(attn)), 4))
        ax.bar(range(len(attn)), [v for _, v in attn], color="#ddaa33")
        ax.set_xticks(range(len(attn)), [k for k, _ in attn], rotation=60, ha="right", fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("attention output rel. error vs kv_codec none")
        ax.set_title("Attention error by codec (reference-absorbed, V2-Lite, BF16)")
        fig.tight_layout()
        fig.savefig(directory / "attention_error_by_codec.png", dpi=100, metadata=meta)
        plt.close(fig)
        written.append("attention_error_by_codec.png")
    acc = sorted(((t["params"]["kv_codec"], t["figures"]["accuracy"]) for t in report["tests"]
                  if "test_golden_generation_per_codec" in t["nodeid"] and t.get("figures")
                  and t.get("backend") == "reference-absorbed"))
    if acc:
        fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(acc)), 4))
        ax.bar(range(len(acc)), [v for _, v in acc], color="#117733")
        ax.set_xticks(range(len(acc)), [k for k, _ in acc], rotation=45, ha="right", fontsize=7)
        ax.set_ylim(0, 1.05)
        ax.axhline(0.99, color="grey", lw=0.8, ls="--")
        ax.set_ylabel("accuracy on expected answers")
        ax.set_title("Tiny-model generation accuracy by KV codec")
        fig.tight_layout()
        fig.savefig(directory / "accuracy_by_codec.png", dpi=100, metadata=meta)
        plt.close(fig)
        written.append("accuracy_by_codec.png")
    bench = [t for t in report.get("timings", []) if t["figures"].get("median_s") and "context" in t["params"]]
    if bench:
        fig, ax = plt.subplots(figsize=(6, 4))
        series: dict[str, list] = {}
        for t in bench:
            p = t["params"]
            series.setdefault(f"{p.get('backend')} {p.get('kv_codec', 'none')} b{p.get('batch', 1)}", []).append(
                (int(p["context"]), t["figures"]["median_s"]))
        for label, pts in sorted(series.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] * 1e3 for p in pts], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("decode step median (ms)")
        ax.legend(fontsize=6)
        ax.set_title("Decode time against context")
        fig.tight_layout()
        fig.savefig(directory / "decode_time.png", dpi=100, metadata=meta)
        plt.close(fig)
        written.append("decode_time.png")
    return written


#: Extra plots; each a function(report, directory, plt, metadata) -> list of file names.
PLOT_HOOKS: list = [_codec_plots]


def write_file_atomically(path: Path, text: str) -> None:
    """One file: written beside its target, then renamed over it (a reader never sees half of it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_atomically(directory: Path, files: dict[str, bytes | str], plots_from: dict | None = None) -> None:
    """Write every file into a fresh temporary directory, then swap it into place."""
    directory = directory.resolve()
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
    except OSError as exc:
        raise MLAInputError(f"cannot write the report into {directory}: {exc.strerror or exc}") from None
    try:
        for fname, content in files.items():
            path = tmp / fname
            if isinstance(content, str):
                path.write_text(content, encoding="utf-8")
            else:
                path.write_bytes(content)
        if plots_from is not None:
            write_plots(plots_from, tmp)
        old = None
        if directory.exists():
            old = directory.with_name(f".{directory.name}.old-{os.getpid()}")
            os.replace(directory, old)
        os.replace(tmp, directory)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def default_name() -> str:
    return platform.node().split(".")[0] or "local"


def run_command(args) -> int:
    suites = Path(args.suites) if args.suites else find_suites()
    name = args.name or default_name()
    out = Path(args.out) if args.out else Path("reports") / name
    out_parent = out.resolve().parent
    try:
        out_parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise MLAInputError(f"--out {out}: cannot create {out_parent} ({exc.strerror or exc})") from None
    if not os.access(out_parent, os.W_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise MLAInputError(f"--out {out}: the directory {out_parent} is not writable")
    if args.checkpoint and not Path(args.checkpoint).is_dir():
        raise MLAInputError(f"--checkpoint {args.checkpoint}: no such directory")
    from mla_conformance.backends import get_backend

    for spec in args.backend or []:
        get_backend(spec)  # fail fast, naming the spec
    with tempfile.TemporaryDirectory() as tmpdir:
        results_path = Path(tmpdir) / "results.json"
        cmd = [sys.executable, "-m", "pytest", str(suites), "--ignore", str(suites / "meta"), "-p", "no:cacheprovider",
               "--mla-results", str(results_path), "-rs"]
        for spec in args.backend or []:
            cmd += ["--mla-backend", spec]
        if args.checkpoint:
            cmd += ["--mla-checkpoint", args.checkpoint]
        if args.device:
            cmd += ["--mla-device", args.device]
        cmd += list(args.pytest_args or [])
        print(f"mla-conformance run: {' '.join(cmd[2:])}", flush=True)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd)
        wall = time.perf_counter() - t0
        if not results_path.exists():
            print(f"mla-conformance run: pytest exited {proc.returncode} before any result was recorded; "
                  "no report written", file=sys.stderr)
            return proc.returncode or 1
        results = json.loads(results_path.read_text())
    report = build_report(results, name=name, env=environment(results.get("device", "cpu")))
    files = {"conformance.json": json.dumps(report, indent=1, sort_keys=True) + "\n",
             "conformance.md": render_markdown(report),
             "timings.json": json.dumps({"wall_s": round(wall, 3), "pytest_exit": proc.returncode,
                                         "finished_unix": int(time.time()), "benchmarks": timings_of(results)},
                                        indent=1, sort_keys=True) + "\n"}
    write_atomically(out, files, plots_from={**report, "timings": timings_of(results)})
    s = report["summary"]
    print(f"mla-conformance run: wrote {out}/conformance.json, conformance.md and plots in {wall:.1f} s; "
          + "; ".join(f"{b}: {v['passed']} passed, {v['failed']} failed, {v['skipped']} skipped"
                      for b, v in sorted(s.items())))
    return proc.returncode


# --------------------------------------------------------------------------- merge


def merge_command(args) -> int:
    reports = []
    for path in args.reports:
        p = Path(path)
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise MLAInputError(f"{p}: no such report file") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise MLAInputError(f"{p}: not a JSON report ({exc})") from None
        if data.get("schema") != SCHEMA:
            raise MLAInputError(f"{p}: not an mla-conformance report (schema {data.get('schema')!r})")
        if data.get("schema_version") != SCHEMA_VERSION:
            raise MLAInputError(f"{p}: report schema version {data.get('schema_version')}, this tool reads "
                                f"{SCHEMA_VERSION}")
        reports.append(data)
    columns = []
    cells: dict[str, dict[str, dict]] = {}
    for r in reports:
        for t in r["tests"]:
            backend = t.get("backend", "(suite)")
            col = f"{r['name']} / {backend}"
            if col not in columns:
                columns.append(col)
            check = t["nodeid"].replace(f"[{backend}-", "[").replace(f"[{backend}]", "").replace(f"-{backend}]", "]")
            cells.setdefault(check, {})[col] = {"outcome": t["outcome"], **({"reason": t["reason"]} if t.get("reason") else {})}
    columns.sort()
    matrix = {"schema": "mla-conformance/matrix", "schema_version": 1,
              "hosts": [{"name": r["name"], "environment": r["environment"]} for r in reports],
              "columns": columns, "rows": {k: cells[k] for k in sorted(cells)}}
    symbol = {"passed": "pass", "failed": "FAIL", "error": "ERROR", "skipped": "skip", "xfailed": "xfail", "xpassed": "XPASS"}
    lines = ["# MLA conformance matrix", "", "| check | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    for check in sorted(cells):
        row = []
        for col in columns:
            c = cells[check].get(col)
            if c is None:
                row.append("")
            elif c["outcome"] == "skipped":
                row.append(f"skip: {c.get('reason', '')[:80]}")
            else:
                row.append(symbol.get(c["outcome"], c["outcome"]))
        lines.append(f"| `{check}` | " + " | ".join(row) + " |")
    out = Path(args.out)
    write_atomically(out, {"matrix.json": json.dumps(matrix, indent=1, sort_keys=True) + "\n",
                           "matrix.md": "\n".join(lines) + "\n"})
    print(f"mla-conformance merge: {len(reports)} reports, {len(cells)} checks x {len(columns)} columns -> {out}/matrix.md")
    return 0


def add_cli(sub) -> None:
    p = sub.add_parser("run", help="run the conformance suite and write reports/<name>/conformance.{json,md}",
                       description="Run the conformance suite on the built-in backends (or --backend SPEC...) "
                                   "and write conformance.json, conformance.md and plots. Arguments after `--` "
                                   "go to pytest.")
    p.add_argument("--backend", action="append", metavar="SPEC", help="backend spec (repeatable; default: built-ins)")
    p.add_argument("--checkpoint", metavar="DIR", help="a real DeepSeek checkpoint for the checkpoint tests")
    p.add_argument("--out", metavar="DIR", help="output directory (default reports/<host-name>)")
    p.add_argument("--name", help="report name (default: this host's name)")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available)")
    p.add_argument("--suites", metavar="DIR", help="suites directory (default: ./suites)")
    p.add_argument("pytest_args", nargs="*", metavar="-- PYTEST_ARGS")
    p.set_defaults(func=run_command)
    m = sub.add_parser("merge", help="merge conformance.json reports of several hosts into one matrix")
    m.add_argument("reports", nargs="+", metavar="REPORT.json")
    m.add_argument("--out", required=True, metavar="DIR")
    m.set_defaults(func=merge_command)
