"""``mla-conformance run`` and ``merge``: run the suite and write reports people and CI read.

``run`` drives pytest on the suites (in a subprocess, pytest's own progress on the terminal), collects
every test's outcome and measured figures through the plugin's ``--mla-results``, and writes into the
output directory:

* ``conformance.json`` -- versioned schema; environment, a verdict per backend, per-test outcome, skip
  reason and figures. Byte-identical between two runs on the same machine, with or without ``-n N``:
  no timings, no dates, sorted keys, floats rounded to :data:`SIG_DIGITS` significant digits.
* ``conformance.md`` -- verdicts, failures first, the tables (cache bytes, errors with tolerance and
  margin, codecs, generation), links to the plots, skips grouped by reason.
* ``timings.json`` -- wall times and benchmark figures, kept apart so the report stays deterministic.
* PNG plots of what the run measured (bytes per token, attention error, codecs, accuracy).
* ``.mla-conformance-report`` -- the marker naming the files above: the tool writes only into a
  directory it creates, an empty one, or one whose every file its marker names. Anything else there is
  an error that names the files, and nothing is touched. The new report is written into a temporary
  sibling and swapped in; a failure or Ctrl-C leaves the previous report as it was.

Verdicts: a backend with a failed or errored test DOES NOT CONFORM; one with no test in the run at all is
NOT SELECTED (the pytest arguments deselected it: no verdict, no failure); one with no executed
conformance test (0 passed, failed, errored or xpassed) is NOT TESTED (``run`` exits non-zero, unless it
was not named and the pytest arguments narrowed the selection); else it CONFORMS. A test whose worker
died, that timed out or hit a CUDA fault is an error with a ``fault`` (:mod:`mla_conformance.pytest_plugin.isolation`).
``failed`` = a conformance check found the output or bytes wrong; ``error`` = the backend raised or
returned the wrong type/shape/dtype, or the test could not be set up.

Ops (the op contract, :mod:`mla_conformance.contract.op`) are judged by the same rule, apart from the backends:
their rows (``params["op"]``) count under neither a backend nor the backend-independent bucket. The
report's ``op_results`` holds, per op, its verdict, counts, skip reasons, the declarations the run
recorded (LSE base, empty-row convention, page sizes, KV formats, FP8 scale format, determinism, batch
invariance) and its cases by section (one line per check and case: outcome, reason, the figures it
measured and the bounds it was held to).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from mla_conformance.pytest_plugin import isolation
from mla_conformance.errors import MLAInputError

SCHEMA = "mla-conformance/report"
SCHEMA_VERSION = 1
MATRIX_SCHEMA = "mla-conformance/matrix"
#: 3: op results in their own grid (``ops``: columns report / op, verdicts, declarations, rows)
MATRIX_SCHEMA_VERSION = 3

#: Significant digits of every float figure in conformance.json (1 - cos: :data:`COSINE_DIGITS`).
SIG_DIGITS = 4
#: ``cosine_diff`` = 1 - cos is 1 minus a number near 1: its float64 noise (~1e-16 absolute) moves its
#: 4th digit when the thread count changes the summation order, so it keeps 3.
COSINE_DIGITS = 3

#: The marker file in every directory this tool writes (JSON: kind and the files it owns).
MARKER = ".mla-conformance-report"

VERDICTS = ("CONFORMS", "DOES NOT CONFORM", "NOT TESTED", "NOT SELECTED")
OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")
INDEPENDENT = "(backend-independent)"

#: The seeds' experiments, by the names the report and README use.
EXPERIMENTS = {
    "seed 000": ("V2-Lite cache probe", "what a cache holds after a prefill and one decode step at "
                 "DeepSeek-V2-Lite dimensions in BF16, read from the cache's own tensors."),
    "seed 001": ("latent quantization study", "bytes and error of quantized encodings of the latent cache "
                 "(INT8/INT4/INT2/FP8, per tensor, token or channel group), scales and zero points counted."),
    "seed 004": ("KV budget", "KV bytes per token of MHA, GQA and MLA, decode arithmetic intensity and the "
                 "registers and shared memory of one MLA decode tile (`mla-conformance budget`)."),
}


# --------------------------------------------------------------------------- environment


def environment(device: str) -> dict[str, Any]:
    import torch

    from mla_conformance import __version__

    env: dict[str, Any] = {"suite_version": __version__, "python": platform.python_version(),
                           "torch": torch.__version__, "platform": platform.platform(terse=True),
                           "machine": platform.machine(), "device": device}
    from importlib import metadata

    try:  # the installed release, read without importing it (0.5 s)
        env["transformers"] = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        env["transformers"] = None
    if device.startswith("cuda") and torch.cuda.is_available():
        idx = torch.device(device).index or 0
        cap = torch.cuda.get_device_capability(idx)
        env.update(device_name=torch.cuda.get_device_name(idx), capability=f"{cap[0]}.{cap[1]}",
                   cuda=torch.version.cuda)
    else:
        env.update(device_name=platform.processor() or platform.machine(), capability=None, cuda=None)
    from mla_conformance.arch import kernel_ids, kernel_skip_reason

    # judged when the run happens, on the device it ran on: rendering reads this, never the renderer's host
    env["kernel_gating"] = {kid: kernel_skip_reason(kid, device) for kid in kernel_ids()}
    return env


def find_suites() -> Path:
    """The installed conformance suites, ``mla_conformance.suites`` (the checkout's suites/ when editable)."""
    from mla_conformance.resources import suites_dir

    suites = suites_dir()
    if not (suites / "test_cache_bytes.py").is_file():
        raise MLAInputError(f"{suites}: the installed suites lack test_cache_bytes.py; reinstall mla-conformance "
                            "(or pass --suites DIR)")
    return suites


# --------------------------------------------------------------------------- building the report


def _backend_of(test: dict) -> str:
    return test.get("backend") or (test.get("params") or {}).get("backend") or ""


def _op_of(test: dict) -> str:
    """The op a row judges (the op suite records it as ``params["op"]``, the report as ``op``); "" for none."""
    return test.get("op") or (test.get("params") or {}).get("op") or ""


def is_timing(test) -> bool:
    """Benchmarks' figures are clock readings: they go to timings.json, never into conformance.json."""
    return isinstance(test, dict) and test.get("section") == "decode-timing"


def timings_of(results: dict) -> list[dict[str, Any]]:
    return [{"nodeid": t["nodeid"], "params": t.get("params", {}), "figures": t["figures"]}
            for t in sorted(results["tests"], key=lambda t: t["nodeid"]) if is_timing(t) and t.get("figures")]


def round_floats(value: Any, digits: int = SIG_DIGITS, key: str | None = None) -> Any:
    """Every float in ``value`` to ``digits`` significant digits (``cosine_diff`` to COSINE_DIGITS)."""
    if isinstance(value, float):
        if not math.isfinite(value) or value == 0.0:
            return value
        d = COSINE_DIGITS if key == "cosine_diff" else digits
        return float(f"{value:.{d - 1}e}")
    if isinstance(value, dict):
        return {k: round_floats(v, digits, k) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [round_floats(v, digits, key) for v in value]
    return value


def verdict_of(counts: dict[str, int]) -> str:
    """DOES NOT CONFORM on any failed/error; NOT SELECTED when no test of it was in the run (the pytest
    arguments deselected them all: no verdict, and no failure); NOT TESTED when every test of it that ran
    skipped; else CONFORMS."""
    if counts.get("failed", 0) or counts.get("error", 0):
        return "DOES NOT CONFORM"
    if not any(counts.get(k, 0) for k in OUTCOMES):
        return "NOT SELECTED"
    if counts.get("passed", 0) + counts.get("xpassed", 0) == 0:
        return "NOT TESTED"
    return "CONFORMS"


def run_id(report: dict[str, Any]) -> str:
    """A content hash of the report (its ``run_id`` left out): equal reports, equal ids."""
    body = {k: v for k, v in report.items() if k != "run_id"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:12]


def _skip_reasons(rows: list[dict]) -> list[dict[str, Any]]:
    reasons: dict[str, int] = {}
    for t in rows:
        if t["outcome"] == "skipped":
            reasons[t.get("reason", "?")] = reasons.get(t.get("reason", "?"), 0) + 1
    return [{"reason": r, "count": n} for r, n in sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))]


def _executed(counts: dict[str, int]) -> int:
    return sum(counts.get(k, 0) for k in ("passed", "failed", "error", "xpassed"))


def _flat_numbers(value: Any, prefix: str = "") -> dict[str, float | int]:
    """The numbers of a figures dict, nested keys joined by '.' (``out.rel_fro``); text and flags left out."""
    out: dict[str, float | int] = {}
    if isinstance(value, dict):
        for k, v in value.items():
            out.update(_flat_numbers(v, f"{prefix}{k}."))
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        out[prefix[:-1]] = value
    return out


def op_case_of(test: dict) -> str:
    """A row's one-line case: the ``case`` figure the op suite records, else (a row skipped or broken before
    it described its case) the test's parameters other than the op, "" when it has none."""
    case = (test.get("figures") or {}).get("case")
    if isinstance(case, str) and case:
        return case
    params = {k: v for k, v in (test.get("params") or {}).items() if k not in ("op", "backend")}
    return ", ".join(f"{k}={params[k]}" for k in sorted(params))


def _is_tolerance(key: str) -> bool:
    """A bound a figure was held to (``tolerance_out_rtol``), as opposed to what was measured."""
    return key.rsplit(".", 1)[-1].startswith("tol")


def op_check_of(test: dict) -> str:
    """What a row checked: the ``check`` figure the op suite records, else the test's function name."""
    check = (test.get("figures") or {}).get("check")
    return check if isinstance(check, str) and check else test["nodeid"].split("::")[-1].split("[")[0]


def _json_value(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v


def _op_results(tests: list[dict], ops: list[str], declarations: dict) -> dict[str, dict[str, Any]]:
    """Per op: verdict (the backends' rule), counts, skip reasons, its recorded declarations, and its cases
    grouped by section (case, outcome, node id, reason, measured numbers)."""
    out = {}
    for op in sorted(set(ops) | {t["op"] for t in tests if t.get("op")}):
        rows = [t for t in tests if t.get("op") == op]
        counts = dict.fromkeys(OUTCOMES, 0)
        for t in rows:
            counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
        sections: dict[str, list[dict[str, Any]]] = {}
        for t in rows:
            case = {"check": op_check_of(t), "case": op_case_of(t), "outcome": t["outcome"], "nodeid": t["nodeid"]}
            if t.get("reason"):
                case["reason"] = t["reason"]
            numbers = _flat_numbers(t.get("figures") or {})
            measured = {k: v for k, v in numbers.items() if not _is_tolerance(k)}
            tolerance = {k.rsplit(".", 1)[-1].removeprefix("tolerance_"): v for k, v in numbers.items()
                         if _is_tolerance(k)}
            row = (t.get("figures") or {}).get("tolerance")
            if isinstance(row, str) and tolerance:
                tolerance["row"] = row
            if measured:
                case["measured"] = measured
            if tolerance:
                case["tolerance"] = tolerance
            sections.setdefault(t.get("section", "(no section)"), []).append(case)
        decl = declarations.get(op)
        out[op] = {"verdict": verdict_of(counts), "executed": _executed(counts), "summary": counts,
                   "skip_reasons": _skip_reasons(rows),
                   "declarations": ({k: _json_value(v) for k, v in decl.items()} if isinstance(decl, dict) else None),
                   "sections": {s: sorted(c, key=lambda c: (c["check"], c["case"], c["nodeid"]))
                                for s, c in sorted(sections.items())}}
    return out


def build_report(results: dict, *, name: str, env: dict) -> dict[str, Any]:
    tests = []
    for t in results["tests"]:
        entry = {"nodeid": t["nodeid"], "outcome": t["outcome"]}
        if _backend_of(t):
            entry["backend"] = _backend_of(t)
        elif _op_of(t):
            entry["op"] = _op_of(t)
        params = {k: v for k, v in (t.get("params") or {}).items() if k not in ("backend", "op")}
        if params:
            entry["params"] = params
        if t.get("reason"):
            entry["reason"] = t["reason"]
        if t.get("device"):
            entry["device"] = t["device"]
        if t.get("section"):
            entry["section"] = t["section"]
        if t.get("figures") and not is_timing(t):
            entry["figures"] = round_floats(t["figures"])
        if t.get("fault"):  # crashed / timeout / cuda: what ended the test, as the plugin recorded it
            entry["fault"] = round_floats(t["fault"])
        tests.append(entry)
    tests.sort(key=lambda e: e["nodeid"])
    backends = list(results.get("backends", []))
    summary: dict[str, dict[str, int]] = {b: dict.fromkeys(OUTCOMES, 0) for b in backends}
    for t in tests:
        if t.get("op"):  # an op's row: judged in op_results, never under a backend or "independent"
            continue
        key = t.get("backend", INDEPENDENT)
        summary.setdefault(key, dict.fromkeys(OUTCOMES, 0))
        summary[key][t["outcome"]] = summary[key].get(t["outcome"], 0) + 1
    verdicts = {}
    for b in sorted(k for k in summary if k != INDEPENDENT):
        verdicts[b] = {"verdict": verdict_of(summary[b]), "executed": _executed(summary[b]),
                       "skip_reasons": _skip_reasons([t for t in tests if t.get("backend") == b])}
    ops = list(results.get("ops") or [])
    report = {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "name": name, "environment": env,
              "backends": backends, "exitstatus": results.get("exitstatus"), "summary": summary,
              "verdicts": verdicts, "float_significant_digits": SIG_DIGITS, "tests": tests}
    op_results = _op_results(tests, ops, results.get("op_declarations") or {})
    if op_results:  # a report of a run without ops reads as before
        report["ops"] = ops
        report["op_results"] = op_results
    report["run_id"] = run_id(report)
    return report


# --------------------------------------------------------------------------- markdown


def _fmt_int(v) -> str:
    return f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else str(v)


def _fmt_e(v) -> str:
    return f"{v:.3e}" if isinstance(v, (int, float)) and not isinstance(v, bool) else ("" if v is None else str(v))


def _fmt_x(v) -> str:
    if v is None:
        return ""
    if v == math.inf:
        return "inf"
    return f"{v:.3g}x"


def _in_section(report, section: str) -> list[dict]:
    """The report's rows of one section that carry figures (recorded from each test's ``mla_section``
    marker), never found by test name: renaming a test changes no section."""
    return [t for t in report["tests"] if t.get("section") == section and t.get("figures")]


def _mark(t) -> str:
    return {"failed": "**FAIL**", "error": "**ERROR**", "xfailed": "xfail", "xpassed": "XPASS"}.get(t["outcome"], "ok")


def _tolerance(t) -> tuple[float | None, float | None]:
    f, dtype = t["figures"], (t.get("params") or {}).get("dtype")
    tol_rf, tol_mr = f.get("tolerance_rel_fro"), f.get("tolerance_max_rel")
    if (tol_rf is None or tol_mr is None) and dtype:
        try:
            from mla_conformance.checks import TOLERANCES

            tol = TOLERANCES.get(dtype)
        except ImportError:
            tol = None
        if tol is not None:
            tol_rf = tol.rel_fro if tol_rf is None else tol_rf
            tol_mr = tol.max_rel if tol_mr is None else tol_mr
    return tol_rf, tol_mr


def margin(measured: float | None, tolerance: float | None) -> float | None:
    """tolerance / measured: how many times the error could grow before failing (below 1 fails)."""
    if measured is None or tolerance is None:
        return None
    if measured == 0:
        return math.inf
    return float(f"{tolerance / measured:.3g}")


def _verdict_lines(report) -> list[str]:
    verdicts = report.get("verdicts") or {}
    if not report["summary"] and report.get("op_results"):
        return ["## Verdicts", "", "No layer backend was under test in this run (ops only: see below)."]
    out = ["## Verdicts", "",
           "| backend | verdict | passed | failed | errors | skipped | xfailed | xpassed |",
           "|---|---|---:|---:|---:|---:|---:|---:|"]
    for backend, s in sorted(report["summary"].items(), key=lambda kv: (kv[0] == INDEPENDENT, kv[0])):
        v = verdicts.get(backend, {}).get("verdict", "" if backend == INDEPENDENT else verdict_of(s))
        out.append(f"| {backend} | {f'**{v}**' if v else '(not a backend)'} | {s.get('passed', 0)} | "
                   f"{s.get('failed', 0)} | {s.get('error', 0)} | {s.get('skipped', 0)} | {s.get('xfailed', 0)} | "
                   f"{s.get('xpassed', 0)} |")
    out += ["", "*failed*: a conformance check found the backend's output or bytes wrong. *errors*: the backend "
                "raised, or returned the wrong type, shape or dtype (or the test could not be set up). "
                "Both fail the run. **NOT TESTED**: every selected test of the backend skipped; that is no "
                "verdict of conformance, and `mla-conformance run` exits non-zero. **NOT SELECTED**: the run's "
                "pytest arguments (`-k`, `-m`, node ids) selected no test of it; no verdict, no failure."]
    for backend, v in sorted(verdicts.items()):
        if v["verdict"] == "NOT TESTED":
            out += ["", f"**{backend}: NOT TESTED** ({v['executed']} conformance tests executed). "
                        + ("Skip reasons:" if v["skip_reasons"] else "None of its tests executed.")]
            out += [f"- {r['reason']} ({r['count']} test{'s' if r['count'] != 1 else ''})" for r in v["skip_reasons"]]
    return out


#: The op declarations in the report's op table: key, column heading.
OP_DECLARATION_COLUMNS = (("lse_base", "LSE base"), ("empty_row", "empty row lse"),
                          ("page_block_sizes", "page sizes"), ("kv_formats", "KV formats"),
                          ("fp8_scale_format", "FP8 scales"), ("deterministic", "deterministic"),
                          ("batch_invariant", "batch invariant"), ("head_dims", "head dims qk/v"))


def _declared_cell(value) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (list, tuple)):  # (576, 512) pairs as 576/512
        return ", ".join("/".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v) for v in value)
    return "" if value is None else str(value)


def _declaration_columns(ops: dict) -> list[tuple[str, str]]:
    """The op table's declaration columns: the known ones, then any other an op recorded (by its name)."""
    known = dict(OP_DECLARATION_COLUMNS)
    extra = sorted({k for v in ops.values() for k in (v.get("declarations") or {}) if k not in known})
    return list(OP_DECLARATION_COLUMNS) + [(k, k.replace("_", " ")) for k in extra]


def _op_verdict_lines(report) -> list[str]:
    ops = report.get("op_results") or {}
    if not ops:
        return []
    columns = _declaration_columns(ops)
    out = ["## Ops (the op contract)", "",
           "Kernel-level implementations of one decode step over a paged latent cache (`--mla-op`), judged "
           "by the backends' rule. The declarations are the ones each op made in this run (defaults filled "
           "in where it declared nothing): the LSE base its lse is read in, what a query with no keys returns "
           "(out 0 and this lse), the page sizes and KV formats it is tested on, how its FP8 caches are "
           "scaled, whether it promised bitwise determinism and batch invariance, and the head dims it takes "
           "(another declaration an op recorded gets a column of its own).", "",
           "| op | verdict | passed | failed | errors | skipped | xfailed | xpassed | "
           + " | ".join(h for _, h in columns) + " |",
           "|---|---|---:|---:|---:|---:|---:|---:|" + "---|" * len(columns)]
    for op, v in sorted(ops.items()):
        s, decl = v["summary"], v.get("declarations")
        cells = ([_declared_cell(decl.get(k)) for k, _ in columns] if isinstance(decl, dict)
                 else ["(not recorded)"] + [""] * (len(columns) - 1))
        out.append(f"| {op} | **{v['verdict']}** | {s.get('passed', 0)} | {s.get('failed', 0)} | "
                   f"{s.get('error', 0)} | {s.get('skipped', 0)} | {s.get('xfailed', 0)} | {s.get('xpassed', 0)} | "
                   + " | ".join(c.replace("|", "/") for c in cells) + " |")
    for op, v in sorted(ops.items()):
        if v["verdict"] == "NOT TESTED":
            out += ["", f"**op {op}: NOT TESTED** ({v['executed']} conformance tests executed). "
                        + ("Skip reasons:" if v["skip_reasons"] else "None of its tests executed.")]
            out += [f"- {r['reason']} ({r['count']} test{'s' if r['count'] != 1 else ''})" for r in v["skip_reasons"]]
    return out


def _numbers_cell(numbers: dict) -> str:
    return ", ".join(f"{k} {_fmt_e(v) if isinstance(v, float) else _fmt_int(v)}" for k, v in sorted(numbers.items())
                     if k != "row")


def _op_case_lines(report) -> list[str]:
    ops = report.get("op_results") or {}
    by_section: dict[str, list[tuple[str, dict]]] = {}
    for op, v in ops.items():
        for section, cases in v["sections"].items():
            by_section.setdefault(section, []).extend((op, c) for c in cases)
    if not by_section:
        return []
    out = ["## Op cases", "",
           "Per section of the op suite, one row per check and case: its outcome and the figures it measured "
           "(*tolerance*: the bounds it was held to, from `OP_TOLERANCES`; markers.md). Failing rows first."]
    for section in sorted(by_section):
        out += ["", f"### {section}", "", "| | op | check | case | measured | tolerance |", "|---|---|---|---|---|---|"]
        rows = sorted(by_section[section], key=lambda oc: (oc[1]["outcome"] not in ("failed", "error"), oc[0],
                                                           oc[1]["check"], oc[1]["case"], oc[1]["nodeid"]))
        for op, c in rows:
            shown = _numbers_cell(c.get("measured") or {})
            if c["outcome"] != "passed" and c.get("reason"):
                reason = c["reason"] if len(c["reason"]) <= 200 else c["reason"][:199] + "…"
                shown = (shown + "; " if shown else "") + reason
            tol = c.get("tolerance") or {}
            tol_cell = (f"{tol['row']}: " if tol.get("row") else "") + _numbers_cell(tol)
            out.append(f"| {_mark(c) if c['outcome'] != 'skipped' else 'skip'} | {op} | {c['check'].replace('|', '/')} | "
                       f"{c['case'].replace('|', '/')} | {shown.replace('|', '/')} | {tol_cell.replace('|', '/')} |")
    return out


def _failure_lines(report) -> list[str]:
    failed = [t for t in report["tests"] if t["outcome"] in ("failed", "error")]
    if not failed:
        return []
    out = ["## Failures", "", "| outcome | test | message |", "|---|---|---|"]
    for t in sorted(failed, key=lambda t: (t["outcome"], t["nodeid"])):
        msg = (t.get("reason") or "").replace("|", "\\|")
        cause = (t.get("figures") or {}).get("likely_cause")
        if cause:
            msg += f" *Likely cause:* {cause}"
        out.append(f"| {t['outcome']} | `{t['nodeid']}` | {msg} |")
    return out


def _slots(f) -> str:
    if f.get("allocated_slots") is None or f.get("requested_slots") is None:
        return ""
    if f.get("preallocated") is False:  # nothing allocated up front: the cache grows with the tokens
        return f"grows: {_fmt_int(f['allocated_slots'])} now, {_fmt_int(f['requested_slots'])} requested"
    over = f.get("slot_overhead")
    if over is None and f["requested_slots"]:
        over = f["allocated_slots"] / f["requested_slots"]
    return f"{_fmt_int(f['allocated_slots'])} / {_fmt_int(f['requested_slots'])}" + (
        f" ({over:.3g}x)" if over is not None else "")


#: Keys of a bytes row's figures, in order of preference. Measured: bytes written per stored token, counted
#: in the cache's own tensors. Formula: what the declared format takes (checks.format_bytes_per_token), never
#: read as a measurement.
MEASURED_BYTES_KEYS = ("measured_bytes_per_token", "bytes_per_token")
FORMULA_BYTES_KEYS = ("formula_bytes_per_token", "format_bytes_per_token")
NOT_MEASURED = "not measured"


def _first(f: dict, keys) -> Any:
    for k in keys:
        v = f.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return v
    return None


def measured_bytes(f: dict) -> int | float | None:
    """A row's measured bytes per stored token, or None: never the format formula."""
    return _first(f, MEASURED_BYTES_KEYS)


def formula_bytes(f: dict) -> int | float | None:
    """A row's formula bytes per stored token (the declared format's), or None."""
    return _first(f, FORMULA_BYTES_KEYS)


def _bytes_cell(v) -> str:
    return NOT_MEASURED if v is None else _fmt_int(v)


def _probe_formula(seed: list[dict]) -> dict[str, Any] | None:
    """The format formula at the probe's dims and dtype, from the config the rows recorded (never typed)."""
    f = next((t["figures"] for t in seed if t["figures"].get("preset") and t["figures"].get("dtype")), None)
    if f is None:
        return None
    try:
        from mla_conformance.checks import DTYPES, format_bytes_per_token
        from mla_conformance.model.config import MLAConfig

        config, dtype = MLAConfig.preset(f["preset"]), DTYPES[f["dtype"]]
        latent = format_bytes_per_token(config, "latent", dtype)
        expanded = format_bytes_per_token(config, "expanded", dtype)
    except (ImportError, LookupError, ValueError, MLAInputError):  # a preset or dtype this tool does not know
        return None
    return {"preset": f["preset"], "dtype": f["dtype"], "tokens": f.get("tokens"), "batch": f.get("batch"),
            "capacity": f.get("capacity"), "latent": latent, "expanded": expanded,
            "latent_elements": config.latent_dim, "expanded_elements": config.expanded_dim}


def _probe_sentence(name: str, sentence: str, formula: dict | None) -> str:
    if formula is None:
        return f"The {name} (seed 000) measures {sentence}"
    setup = (f"{formula['tokens']} stored tokens" if formula.get("tokens") is not None else "its tokens") + (
        f" (batch {formula['batch']}, {formula['capacity']} slots requested)" if formula.get("batch") is not None
        and formula.get("capacity") is not None else "")
    return (f"The {name} (seed 000) measures what a cache holds after {setup} at {formula['preset']} dimensions "
            f"in {formula['dtype']}, read from the cache's own tensors. *measured*: the bytes per stored token "
            f"written into those tensors in this run; *formula*: what the declared format takes at these dims "
            f"(`checks.format_bytes_per_token`, computed from the config): {formula['latent']:,} B per token per "
            f"layer latent ({formula['latent_elements']} elements), {formula['expanded']:,} B expanded "
            f"({formula['expanded_elements']:,} elements), {formula['expanded'] / formula['latent']:.4g}x. A row "
            f"without a measurement says \"{NOT_MEASURED}\".")


def _bytes_lines(report) -> list[str]:
    seed = _in_section(report, "v2-lite-cache-probe")
    out: list[str] = []
    if seed:
        name, sentence = EXPERIMENTS["seed 000"]
        formula = _probe_formula(seed)
        out += ["## Cache bytes: the " + name, "", _probe_sentence(name, sentence, formula), "",
                "| | backend | format | bytes/token/layer measured | bytes/token/layer formula | active B (measured) | "
                "allocated B | slots allocated / requested | tensors |",
                "|---|---|---|---:|---:|---:|---:|---:|---|"]
        for t in sorted(seed, key=_backend_of):
            f = t["figures"]
            tens = ", ".join(f"{k} {_fmt_int(v)}" for k, v in sorted((f.get("tensors") or {}).items()))
            fb = formula_bytes(f)
            out.append(f"| {_mark(t)} | {t.get('backend', '')} | {f.get('cache_format', '')} | "
                       f"{_bytes_cell(measured_bytes(f))} | {'' if fb is None else _fmt_int(fb)} | "
                       f"{_fmt_int(f.get('active_nbytes', ''))} | {_fmt_int(f.get('allocated_nbytes', ''))} | "
                       f"{_slots(f)} | {tens} |")
        probe = {t.get("backend"): t["figures"] for t in seed if t.get("outcome") == "passed"}
        if {"reference-naive", "reference-absorbed"} <= set(probe):
            naive, absorbed = probe["reference-naive"]["active_nbytes"], probe["reference-absorbed"]["active_nbytes"]
            out.append(f"\nMeasured: reference-naive active bytes / reference-absorbed active bytes = "
                       f"{_fmt_int(naive)} / {_fmt_int(absorbed)} = {naive / absorbed:.6f} "
                       f"(expanded over latent); the latent cache is {(1 - absorbed / naive) * 100:.2f}% smaller"
                       + (f". Formula at these dims: {formula['expanded']:,} / {formula['latent']:,} = "
                          f"{formula['expanded'] / formula['latent']:.6f}" if formula else "") + ".")
    over = [t for t in report["tests"] if t.get("figures") and t["figures"].get("allocated_slots") is not None
            and t["figures"].get("requested_slots") is not None
            and t["figures"]["allocated_slots"] != t["figures"]["requested_slots"]
            and t["figures"].get("preallocated") is not False]
    growing = sorted({_backend_of(t) for t in report["tests"] if t.get("figures")
                      and t["figures"].get("preallocated") is False and _backend_of(t)})
    if growing:
        out += ["", f"Caches that grow with the tokens (nothing preallocated, so no slot count to judge or "
                    f"report): {', '.join(growing)}."]
    if over:
        out += ["", "### Slot overhead (a figure, not a failure)", "",
                "Slot counts that differ from the requested capacity are the engine's allocation policy (pools, "
                "max_seq_len, growth on demand), not its format: bytes per slot are judged against the format, "
                "slot counts only reported.", "",
                "| | test | requested slots | allocated slots | allocated / requested | bytes/token measured | "
                "bytes/token formula |", "|---|---|---:|---:|---:|---:|---:|"]
        for t in over:
            f = t["figures"]
            ratio = f.get("slot_overhead") or (f["allocated_slots"] / f["requested_slots"] if f["requested_slots"] else None)
            out.append(f"| {_mark(t)} | `{t['nodeid']}` | {_fmt_int(f['requested_slots'])} | "
                       f"{_fmt_int(f['allocated_slots'])} | {_fmt_x(ratio)} | {_bytes_cell(measured_bytes(f))} | "
                       f"{'' if formula_bytes(f) is None else _fmt_int(formula_bytes(f))} |")
    return out


def _error_lines(report) -> list[str]:
    errs = _in_section(report, "numerics")
    if not errs:
        return []
    out = ["## Numerical error against the float64 expanded reference", "",
           "Per test, the worst row. *rel Frobenius* = ||out - ref||_F / ||ref||_F; *max rel* = max |out - ref| / "
           "rms(ref); *tol* = the stated tolerance of that dtype (markers.md); *margin* = tolerance / measured for "
           "the tighter of the two (below 1x fails); *1 - cos* = 1 - cosine similarity of out and ref.", "",
           "| | backend | preset | scenario | dtype | rel Frobenius | tol | max rel | tol | margin | max abs | "
           "p99 abs | 1 - cos |",
           "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    failing_first = sorted(errs, key=lambda t: (t["outcome"] not in ("failed", "error"), t.get("backend", ""),
                                                t["params"].get("preset", ""), t["params"].get("dtype", ""),
                                                t["params"].get("scenario", "")))
    for t in failing_first:
        f, p = t["figures"], t["params"]
        tol_rf, tol_mr = _tolerance(t)
        margins = [m for m in (margin(f.get("rel_fro"), tol_rf), margin(f.get("max_rel"), tol_mr)) if m is not None]
        out.append(f"| {_mark(t)} | {t.get('backend', '')} | {p.get('preset', '')} | {p.get('scenario', '')} | "
                   f"{p.get('dtype', '')} | {_fmt_e(f.get('rel_fro'))} | {_fmt_e(tol_rf)} | {_fmt_e(f.get('max_rel'))} | "
                   f"{_fmt_e(tol_mr)} | {_fmt_x(min(margins)) if margins else ''} | {_fmt_e(f.get('max_abs'))} | "
                   f"{_fmt_e(f.get('p99_abs'))} | {_fmt_e(f.get('cosine_diff'))} |")
    causes = [t for t in failing_first if t["figures"].get("likely_cause")]
    for t in causes:
        out.append(f"\n`{t['nodeid']}`: likely cause: {t['figures']['likely_cause']}")
    return out


def render_markdown(report: dict[str, Any], plots: list[str] | None = None) -> str:
    env = report["environment"]
    out = [f"# MLA conformance report: {report['name']}", ""]
    out.append(f"mla-conformance {env['suite_version']} · device {env['device']} ({env.get('device_name')}"
               + (f", capability {env['capability']}" if env.get("capability") else "") + ")"
               + f" · torch {env['torch']} · transformers {env.get('transformers')} · python {env['python']}")
    out += [""] + _verdict_lines(report)
    for part in (_op_verdict_lines, _failure_lines, _bytes_lines, _error_lines, _op_case_lines):
        lines = part(report)
        if lines:
            out += [""] + lines
    for section in REPORT_SECTIONS:
        try:
            text = section(report)
        except (KeyError, TypeError, ValueError, IndexError) as exc:  # a figure layout it does not know
            text = f"({section.__name__.strip('_')}: not rendered, {type(exc).__name__}: {exc})"
        if text:
            out += ["", text]
    if plots:
        out += ["", "## Plots", ""]
        out += [f"- [{PLOT_TITLES.get(p, p)}]({p})" for p in plots]
    skipped = [t for t in report["tests"] if t["outcome"] == "skipped"]
    if skipped:
        out += ["", "## Skipped, grouped by reason", "", "| tests | reason |", "|---:|---|"]
        reasons: dict[str, int] = {}
        for t in skipped:
            reasons[t.get("reason", "?")] = reasons.get(t.get("reason", "?"), 0) + 1
        for reason, n in sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0])):
            out.append(f"| {n} | {reason.replace('|', '/')} |")
    return "\n".join(out) + "\n"


def _codec_section(report) -> str | None:
    rows = [t for t in _in_section(report, "codec-bytes")
            if t.get("params", {}).get("preset") == "deepseek-v2-lite" and t["params"].get("dtype") == "bfloat16"]
    if not rows:
        return None
    attn = {(t.get("backend"), t["params"].get("codec")): t["figures"] for t in report["tests"]
            if t.get("section") == "codec-attention" and t.get("figures")}
    acc = {(t.get("backend"), t["params"].get("kv_codec")): t["figures"].get("accuracy") for t in report["tests"]
           if t.get("section") == "golden-codec" and t.get("figures")}
    from mla_conformance.model.config import MLAConfig

    layers = MLAConfig.preset("deepseek-v2-lite").num_hidden_layers
    name, sentence = EXPERIMENTS["seed 001"]
    has_attn = any(attn.get((t.get("backend"), t["params"]["codec"])) for t in rows)
    has_acc = any(acc.get((t.get("backend"), t["params"]["codec"])) is not None for t in rows)
    head = ["", "backend", "codec", "payload B (formula)", "metadata B (formula)", "B/token/layer measured",
            "B/token/layer formula", f"model B/token (formula x {layers} layers)", "BF16 latent B (formula) / measured B"]
    if has_attn:
        head.append("attention rel. error vs codec none")
    if has_acc:
        head.append("tiny-model accuracy")
    try:
        from mla_conformance.checks import format_bytes_per_token
        import torch

        latent = f", {format_bytes_per_token(MLAConfig.preset('deepseek-v2-lite'), 'latent', torch.bfloat16):,} " \
                 "B/token/layer by the formula"
    except ImportError:
        latent = ""
    out = [f"## KV codecs: the {name}", "",
           f"The {name} (seed 001) compares {sentence} *measured*: bytes per stored token written into the cache "
           "tensors in this run, at V2-Lite dims with a BF16 cache; *formula*: the codec's payload + metadata "
           "(`Codec.bytes_per_token`). *BF16 latent B / measured B* is the compression relative to the "
           f"unquantized latent (codec `none`{latent}): above 1 is smaller.", "",
           "| " + " | ".join(head) + " |", "|---|---|---|" + "---:|" * (len(head) - 3)]
    seed = []
    for t in sorted(rows, key=lambda t: (t.get("backend", ""), t["params"]["codec"])):
        f, codec = t["figures"], t["params"]["codec"]
        cells = [_mark(t), t.get("backend", ""), codec, _fmt_int(f.get("payload", "")), _fmt_int(f.get("metadata", "")),
                 _bytes_cell(measured_bytes(f)),
                 "" if formula_bytes(f) is None else _fmt_int(formula_bytes(f)),
                 _fmt_int(f.get("model_bytes_per_token", "")),
                 f"{f['ratio_vs_latent']:.3f}" if isinstance(f.get("ratio_vs_latent"), (int, float)) else ""]
        if has_attn:
            a = attn.get((t.get("backend"), codec), {}).get("attention", {})
            a = a.get("rel_fro") if isinstance(a, dict) else None
            cells.append("0 (baseline)" if codec == "none" and a is None else _fmt_e(a))
        if has_acc:
            g = acc.get((t.get("backend"), codec))
            cells.append("" if g is None else f"{g:.4f}")
        out.append("| " + " | ".join(cells) + " |")
        if f.get("quant_study"):
            seed.append((codec, f["quant_study"]))
    if seed:
        out += ["", "The study's printed sizes (as it printed them, quoted from `codecs.QUANT_STUDY_SCHEMES`) count "
                    f"no scale or zero-point bytes. With them (the codec's formula x {layers} layers), per token; "
                    "*compression* is relative to the expanded BF16 cache (per-head K and V):", ""]
        for codec, s in seed:
            out.append(f"- {s['scheme']} (printed {s['reported']}): printed {_fmt_int(s['seed_model_bytes_per_token'])} B "
                       f"({s['seed_ratio_vs_expanded']:.1f}x compression) vs formula {codec} "
                       f"{_fmt_int(s['honest_model_bytes_per_token'])} B ({s['honest_ratio_vs_expanded']:.1f}x "
                       f"compression), +{_fmt_int(s['difference_bytes'])} B")
    return "\n".join(out)


def _generation_section(report) -> str | None:
    rows = [t for t in report["tests"] if t.get("section") == "golden"
            and t.get("figures")]
    if not rows:
        return None
    out = ["## Generation on the embedded tiny model", "",
           "Greedy generation with every layer's attention through the backend; *accuracy* = fraction of the "
           "pinned answer tokens produced; *golden* = the tokens equal the stored snapshot.", "",
           "| | backend | prompt set | accuracy | golden |", "|---|---|---|---:|---|"]
    for t in sorted(rows, key=lambda t: (t.get("backend", ""), t["params"].get("prompt_set", ""))):
        out.append(f"| {_mark(t)} | {t.get('backend', '')} | {t['params'].get('prompt_set', '')} | "
                   f"{t['figures']['accuracy']:.4f} | {t['outcome']} |")
    return "\n".join(out)


def _checkpoint_section(report) -> str | None:
    rows = [t for t in report["tests"] if t.get("section") == "checkpoint"
            and t.get("figures") and t["figures"].get("source") == "checkpoint"]
    pairs = [t for t in report["tests"] if t.get("section") == "checkpoint-naive-vs-absorbed"
             and t.get("figures") and (t.get("params") or {}).get("probe") == "checkpoint"]
    if not rows and not pairs:
        return None
    name = EXPERIMENTS["seed 000"][0]
    out = [f"## The {name} on the given checkpoint", "",
           "The real layer-1 attention input of the checkpoint (its tokenizer, embedding and layer 0), a prefill "
           "and one decode step per backend; errors of the decode token against the float64 reference.", "",
           "| | backend | dtype | tokens | active B | allocated B | decode max abs | mean abs | p99 abs |",
           "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for t in sorted(rows, key=lambda t: (t.get("backend", ""), t["figures"]["dtype"])):
        f = t["figures"]
        d = f["decode"]
        out.append(f"| {_mark(t)} | {t.get('backend', '')} | {f['dtype']} | {f['tokens']} | {_fmt_int(f['active_nbytes'])} | "
                   f"{_fmt_int(f['allocated_nbytes'])} | {_fmt_e(d['max_abs'])} | {_fmt_e(d['mean_abs'])} | "
                   f"{_fmt_e(d['p99_abs'])} |")
    for t in pairs:
        for dtype, m in sorted(t["figures"].items()):
            if isinstance(m, dict):
                out.append(f"\nreference-absorbed against reference-naive ({dtype}, decode token), measured in "
                           f"this run: max abs {_fmt_e(m['max_abs'])}, mean abs {_fmt_e(m['mean_abs'])}, p99 abs "
                           f"{_fmt_e(m['p99_abs'])}")
    return "\n".join(out)


def _gating_section(report) -> str | None:
    """From the environment recorded when the run happened (``kernel_gating``), never re-detected."""
    env = report["environment"]
    gating = env.get("kernel_gating")
    if not gating:
        return None
    dev = env["device"]
    if not dev.startswith("cuda") and all(r is not None for r in gating.values()):
        return ("## Kernel gating on this device\n\nNo CUDA device (`" + dev + "`): none of the "
                f"{len(gating)} kernels of the support matrix runs here; their tests skip with the "
                "reason. `mla-conformance matrix --capability X.Y` says which run on a given GPU."
                + "\n\n" + "\n".join(_adapter_lines(report)))
    out = ["## Kernel gating on this device", "", "| kernel | verdict |", "|---|---|"]
    for kid, reason in sorted(gating.items()):
        out.append(f"| {kid} | {'runs here' if reason is None else reason} |")
    return "\n".join(out + [""] + _adapter_lines(report))


def _adapter_lines(report) -> list[str]:
    """The suite's FlashMLA / FlashInfer adapters, each with whether it has ever run on the real kernel
    (``arch.ADAPTERS``, ``arch.RUN_ON_HARDWARE``: a property of this suite's version, not of the host)."""
    try:
        from mla_conformance.arch import NOT_RUN_ON_HARDWARE, adapter_status
    except ImportError:
        return []
    judged = set(report.get("verdicts") or {}) | set(report.get("op_results") or {})
    out = ["Adapters of these kernels in this suite (built-in ops; `flashmla` and `flashmla-sparse` also as layer "
           "backends):", ""]
    for kid, st in sorted(adapter_status().items()):
        names = ", ".join(f"`{n}`" + (" (judged in this run)" if n in judged else "") for n in st["adapters"])
        out.append(f"- {kid}: {names}: " + ("run on hardware" if st["run_on_hardware"] else NOT_RUN_ON_HARDWARE))
    return out


def rope_conventions(report) -> dict[str, dict[str, Any]]:
    """Per backend, the RoPE convention its conventions test recorded (``figures["rope_convention"]``), with
    the errors against each oracle; a backend whose test ran without recording one (skipped, errored) maps to
    its outcome and reason. Backends with no such row are left out."""
    out: dict[str, dict[str, Any]] = {}
    for t in sorted(report["tests"], key=lambda t: t["nodeid"]):
        f = t.get("figures") or {}
        if t.get("section") != "conventions" and "rope_convention" not in f:
            continue
        backend = _backend_of(t)
        if not backend or (backend in out and out[backend].get("convention")):
            continue
        out[backend] = {"convention": f.get("rope_convention"), "outcome": t["outcome"], "reason": t.get("reason"),
                        "errors": {k.removeprefix("rel_fro_"): v for k, v in sorted(f.items())
                                   if k.startswith("rel_fro_") and isinstance(v, (int, float))}}
    return out


def _convention_section(report) -> str | None:
    found = rope_conventions(report)
    if not found:
        return None
    try:
        from mla_conformance.model.reference import ROPE_CONVENTIONS
    except ImportError:
        ROPE_CONVENTIONS = {}
    out = ["## RoPE convention each backend follows", "",
           "YaRN's cos/sin factor where published code disagrees (a config with mscale != mscale_all_dim; "
           "`suites/test_conventions.py`): either convention conforms, the test records which one the backend "
           "matched. *rel Frobenius*: measured against each float64 oracle in this run.", "",
           "| | backend | RoPE convention | rel Frobenius per oracle |", "|---|---|---|---|"]
    for backend, c in sorted(found.items()):
        conv = c["convention"]
        if conv:
            shown = f"**{conv}**" + (f" ({ROPE_CONVENTIONS[conv]})" if conv in ROPE_CONVENTIONS else "")
        else:
            shown = f"not recorded ({c['outcome']}" + (f": {c['reason'][:160]}" if c.get("reason") else "") + ")"
        errs = ", ".join(f"{k} {_fmt_e(v)}" for k, v in c["errors"].items())
        out.append(f"| {_mark(c) if c['outcome'] != 'skipped' else 'skip'} | {backend} | {shown.replace('|', '/')} | "
                   f"{errs} |")
    return "\n".join(out)


#: Extra markdown sections (conventions, codecs, gating, generation); each a function(report) -> str | None.
REPORT_SECTIONS: list = [_convention_section, _codec_section, _generation_section, _checkpoint_section,
                         _gating_section]


# --------------------------------------------------------------------------- plots

PLOT_TITLES = {
    "bytes_per_token.png": "KV cache bytes per token by cache format and codec",
    "attention_error.png": "Attention output error against float64, by backend and dtype",
    "attention_error_by_codec.png": "Attention error by KV codec",
    "accuracy_by_codec.png": "Tiny-model generation accuracy by KV codec",
    "decode_time.png": "Decode step time against context (timings.json)",
}


def write_plots(report: dict[str, Any], directory: Path) -> list[str]:
    """PNG plots of the measured figures (matplotlib, Agg backend, fixed metadata so bytes are stable)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    meta = {"Software": None}
    seed = sorted(_in_section(report, "v2-lite-cache-probe"), key=_backend_of)
    codec_rows = [t for t in _in_section(report, "codec-bytes")
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
    errs = _in_section(report, "numerics")
    if errs:
        groups: dict[tuple, float] = {}
        for t in errs:
            key = (t.get("backend", ""), t["params"]["dtype"])
            groups[key] = max(groups.get(key, 0.0), t["figures"]["rel_fro"])
        keys = sorted(groups)
        fig, ax = plt.subplots(figsize=(max(6.5, 0.9 * len(keys) + 2), 5))
        ax.bar(range(len(keys)), [max(groups[k], 1e-18) for k in keys], color="#cc6677", label="worst measured")
        tols = []
        for k in keys:
            try:
                from mla_conformance.checks import TOLERANCES

                tols.append(TOLERANCES[k[1]].rel_fro if k[1] in TOLERANCES else None)
            except ImportError:
                tols.append(None)
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


def _safe_plots(report: dict[str, Any], directory: Path) -> list[str]:
    """write_plots, but a figure it cannot draw (an unexpected figure layout) costs a warning, not the report."""
    try:
        return write_plots(report, directory)
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        import matplotlib.pyplot as plt

        plt.close("all")
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


# --------------------------------------------------------------------------- owned, atomic writes


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _names(paths) -> str:
    paths = sorted(paths)
    shown = ", ".join(paths[:6])
    return shown + (f" and {len(paths) - 6} more" if len(paths) > 6 else "")


def _read_marker(directory: Path) -> dict | None:
    try:
        data = json.loads((directory / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) and data.get("tool") == "mla-conformance" else None


def check_out_dir(out: str | Path, kind: str, option: str = "--out") -> Path:
    """The resolved output directory, if this tool may write it; else MLAInputError naming what is there.

    Writable: a path that does not exist (its parent is created), an empty directory, or a directory
    whose marker says ``kind`` and names every file in it. Never the current directory or one above it.
    """
    given = str(out)
    path = Path(out).expanduser().resolve()
    cwd = Path.cwd().resolve()
    if path == cwd or path in cwd.parents:
        raise MLAInputError(f"{option} {given}: is the current directory or one above it; the report is "
                            f"swapped in as a whole directory, so give a directory of its own (e.g. reports/NAME)")
    if path.exists() or path.is_symlink():
        if not path.is_dir():
            raise MLAInputError(f"{option} {given}: exists and is not a directory; nothing was touched")
        entries = sorted(p.name for p in path.iterdir())
        if entries:
            marker = _read_marker(path)
            if marker is None:
                raise MLAInputError(f"{option} {given}: holds files mla-conformance did not write ({_names(entries)}); "
                                    "nothing was touched: give a new or empty directory")
            owned = set(marker.get("files", [])) | {MARKER}
            foreign = [e for e in entries if e not in owned]
            if marker.get("kind") != kind:
                raise MLAInputError(f"{option} {given}: holds a {marker.get('kind')} written by mla-conformance, "
                                    f"not a {kind}; nothing was touched: give another directory")
            if foreign:
                raise MLAInputError(f"{option} {given}: holds files mla-conformance did not write ({_names(foreign)}); "
                                    "nothing was touched: move them away or give another directory")
            for e in entries:
                if e != MARKER and not (path / e).is_file():
                    raise MLAInputError(f"{option} {given}: {e} is not a plain file; nothing was touched")
    parent = path.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        probe = tempfile.mkdtemp(prefix=f".{path.name}.probe-", dir=parent)
        os.rmdir(probe)
    except OSError as exc:
        raise MLAInputError(f"{option} {given}: cannot write in {parent} ({exc.strerror or exc})") from None
    if path.is_dir():  # proven writable before any work: a file created and removed in it
        if os.path.ismount(path):
            raise MLAInputError(f"{option} {given}: is a mount point; the report is swapped in as a whole "
                                f"directory, so give a directory inside it (e.g. {Path(given) / 'NAME'})")
        try:
            fd, probe = tempfile.mkstemp(prefix=".mla-conformance-probe-", dir=path)
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            raise MLAInputError(f"{option} {given}: cannot write in it ({exc.strerror or exc}); nothing was "
                                "touched") from None
    return path


def check_out_file(out: str | Path, schema: str, option: str = "--out") -> Path:
    """The output file, if this tool may write it: new, or a JSON file whose ``schema`` is ``schema``."""
    given = str(out)
    path = Path(out).expanduser()
    if path.is_dir():
        raise MLAInputError(f"{option} {given}: is a directory; give a file name (e.g. {Path(given) / 'bench.json'})")
    if path.exists() or path.is_symlink():
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError, UnicodeDecodeError):
            data = None
        if not isinstance(data, dict) or data.get("schema") != schema:
            raise MLAInputError(f"{option} {given}: exists and was not written by mla-conformance ({schema}); "
                                "nothing was touched: give a new file name")
    parent = path.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=f".{path.name}.probe-", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise MLAInputError(f"{option} {given}: cannot write in {parent} ({exc.strerror or exc})") from None
    return path


@contextlib.contextmanager
def _no_interrupt():
    """SIGINT held back for the few renames of a swap (delivered right after)."""
    if hasattr(signal, "pthread_sigmask") and threading.current_thread() is threading.main_thread():
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
    else:
        yield


def write_file_atomically(path: Path, text: str) -> None:
    """One file: written beside its target, then renamed over it (a reader never sees half of it).

    Callers check ownership first (:func:`check_out_file`); the mode follows the user's umask.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_owned_dir(directory: Path, files: dict[str, bytes | str], *, kind: str,
                    plots_from: dict | None = None) -> list[str]:
    """Write ``files`` (and plots) into a temporary sibling, then swap it in for ``directory``.

    Ownership is checked again right before the swap. On any failure or Ctrl-C the temporary directory
    goes and ``directory`` is as it was. Returns the plot file names written.
    """
    directory = check_out_dir(directory, kind)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
    except OSError as exc:
        raise MLAInputError(f"cannot write into {directory.parent}: {exc.strerror or exc}") from None
    old = None
    try:
        os.chmod(tmp, 0o777 & ~_umask())
        plots = _safe_plots(plots_from, tmp) if plots_from is not None else []
        for fname, content in files.items():
            if callable(content):
                content = content(plots)
            path = tmp / fname
            if isinstance(content, str):
                path.write_text(content, encoding="utf-8")
            else:
                path.write_bytes(content)
        owned = sorted(set(files) | set(plots))
        (tmp / MARKER).write_text(json.dumps({"tool": "mla-conformance", "kind": kind, "files": owned},
                                             indent=1, sort_keys=True) + "\n", encoding="utf-8")
        check_out_dir(directory, kind)
        with _no_interrupt():
            if directory.exists():
                old = Path(tempfile.mkdtemp(prefix=f".{directory.name}.old-", dir=directory.parent))
                os.replace(directory, old)
            try:
                os.replace(tmp, directory)
            except BaseException:
                if old is not None:
                    os.replace(old, directory)
                    old = None
                raise
        return plots
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


# --------------------------------------------------------------------------- run


def default_name() -> str:
    return platform.node().split(".")[0] or "local"


def _check_name(name: str) -> str:
    if not name or name in (".", "..") or "/" in name or "\\" in name or name.strip() != name:
        raise MLAInputError(f"--name {name!r}: a report name is one word (letters, digits, -, _, .)")
    return name


def write_report(out: Path, results: dict, *, name: str, env: dict, wall: float, pytest_exit: int) -> dict:
    """Build and write the report directory from the plugin's results; returns the report."""
    report = build_report(results, name=name, env=env)
    timings = timings_of(results)
    files = {"conformance.json": json.dumps(report, indent=1, sort_keys=True) + "\n",
             "conformance.md": lambda plots: render_markdown(report, plots=plots),
             "timings.json": json.dumps({"wall_s": round(wall, 3), "pytest_exit": pytest_exit,
                                         "finished_unix": int(time.time()), "benchmarks": timings},
                                        indent=1, sort_keys=True) + "\n"}
    report["_plots"] = write_owned_dir(out, files, kind="report", plots_from={**report, "timings": timings})
    return report


def run_command(args) -> int:
    from mla_conformance.cli import check_device

    suites = Path(args.suites) if args.suites else find_suites()
    if args.suites and not (suites / "test_cache_bytes.py").is_file():
        raise MLAInputError(f"--suites {args.suites}: not the suites directory (no test_cache_bytes.py)")
    name = _check_name(args.name or default_name())
    from mla_conformance.specs import get_backend
    from mla_conformance.specs import get_op

    for spec in args.backend or []:
        get_backend(spec)  # fail fast, naming the spec, before anything is written
    for spec in args.op or []:
        try:
            get_op(spec)
        except MLAInputError as exc:
            raise MLAInputError(f"--op: {exc}") from None
    out = check_out_dir(args.out if args.out else Path("reports") / name, "report")
    device = check_device(args.device) if args.device else None
    if args.checkpoint:
        from mla_conformance.model.checkpoint import validate_checkpoint

        try:
            validate_checkpoint(args.checkpoint)
        except MLAInputError as exc:
            raise MLAInputError(f"--checkpoint: {exc}") from None
    from mla_conformance.resources import pytest_location_args

    user_args = list(args.pytest_args or [])
    partial = partial_results_path(out)
    with tempfile.TemporaryDirectory(prefix="mla-conformance-run-") as tmpdir:
        results_path = Path(tmpdir) / "results.json"
        cmd = [sys.executable, "-m", "pytest", str(suites), *pytest_location_args(suites, tmpdir), "-p", "no:cacheprovider",
               "--mla-results", str(results_path), "-ra"]
        import importlib.util

        if importlib.util.find_spec("pytest_benchmark"):  # its storage, or an empty .benchmarks/ lands in the cwd
            cmd += ["--benchmark-storage", f"file://{Path(tmpdir) / 'benchmarks'}"]
        for spec in args.backend or []:
            cmd += ["--mla-backend", spec]
        for spec in args.op or []:
            cmd += ["--mla-op", spec]
        if args.checkpoint:
            cmd += ["--mla-checkpoint", args.checkpoint]
        if device:
            cmd += ["--mla-device", device]
        if args.timeout is not None:
            cmd += ["--mla-timeout", f"{args.timeout:g}"]
        cmd += isolation_args(user_args) + threads_args(user_args) + user_args
        print(f"mla-conformance run: {' '.join(cmd[2:])}", flush=True)
        t0 = time.perf_counter()
        returncode, signum = _run_pytest(cmd)
        wall = time.perf_counter() - t0
        journal = isolation.journal_path(results_path)
        if signum is not None:
            return _interrupted(signum, out, partial, results_path, journal)
        results = None
        if results_path.exists():
            try:
                results = json.loads(results_path.read_text())
            except ValueError as exc:
                print(f"mla-conformance run: the results pytest wrote are not JSON ({exc}); no report written",
                      file=sys.stderr)
                return returncode or 1
        else:  # pytest itself died (a serial run: no worker to replace): the journal has what it gathered
            results = results_from_journal(journal, returncode, Path(str(results_path) + ".fault"))
            if results is None:
                print(f"mla-conformance run: pytest {isolation.describe_exit(returncode)} before any result was "
                      "recorded; no report written", file=sys.stderr)
                return returncode or 1
            died = [t for t in results["tests"] if (t.get("fault") or {}).get("serial")]
            print(f"mla-conformance run: pytest {isolation.describe_exit(returncode)}"
                  + (f" while running {', '.join(t['nodeid'] for t in died)}" if died else "")
                  + "; the tests after it did not run (a serial run: `-p no:xdist` or `-n 0` given, so no worker "
                    "could be replaced); the report holds what was recorded", file=sys.stderr)
            returncode = returncode if returncode > 0 else 1
    report = write_report(out, results, name=name, env=environment(results.get("device", "cpu")), wall=wall,
                          pytest_exit=returncode)
    _remove_partial(partial)
    plots = report.pop("_plots")
    written = ["conformance.json", "conformance.md", "timings.json"] + plots
    print(f"mla-conformance run: wrote {out}: {', '.join(written)} in {wall:.1f} s")
    judged = [(b, v, report["summary"][b]) for b, v in sorted(report["verdicts"].items())]
    judged += [(f"op {o}", v, v["summary"]) for o, v in sorted((report.get("op_results") or {}).items())]
    for who, v, s in judged:
        print(f"  {who}: {v['verdict']} ({s['passed']} passed, {s['failed']} failed, {s['error']} errors, "
              f"{s['skipped']} skipped)")
    faults = [t for t in report["tests"] if (t.get("fault") or {}).get("kind") in ("crashed", "timeout")]
    for t in faults:
        print(f"  {t['fault']['kind'].upper()}: {t['nodeid']}: {t.get('reason', '')}", file=sys.stderr)
    not_selected = [who for who, v, _ in judged if v["verdict"] == "NOT SELECTED"]
    if not_selected:
        print(f"mla-conformance run: not selected (no test of theirs matched the pytest arguments; not a failure): "
              f"{', '.join(not_selected)}")
    named = {f"op {o.name}" for o in _named(args.op, "op")} | {b.name for b in _named(args.backend, "backend")}
    narrowed = narrows_selection(user_args)
    not_tested = [who for who, v, _ in judged if v["verdict"] == "NOT TESTED"]
    failing = [who for who in not_tested if who in named or not narrowed]
    if not_tested:
        tolerated = [who for who in not_tested if who not in failing]
        print(f"mla-conformance run: NOT TESTED: {', '.join(not_tested)}: every selected test skipped "
              f"(skip reasons in {out / 'conformance.md'})"
              + (f"; not failing the run for {', '.join(tolerated)}: not named by --backend/--op, and the "
                 "pytest arguments narrowed the selection" if tolerated else ""), file=sys.stderr)
        if failing:
            return returncode or 1
    return returncode


def _named(specs, kind: str) -> list:
    """The backends (kind "backend") or ops the user named, resolved (they resolved before the run)."""
    if not specs:
        return []
    if kind == "op":
        from mla_conformance.specs import get_op

        return [get_op(s) for s in specs]
    from mla_conformance.specs import get_backend

    return [get_backend(s) for s in specs]


def narrows_selection(pytest_args: list[str]) -> bool:
    """The pytest arguments select a subset of the suite (-k, -m, --deselect, a node id or a test file)."""
    for a in pytest_args:
        if a in ("-k", "-m", "--deselect", "--lf", "--last-failed") or a.startswith(("-k", "-m", "--deselect=")):
            return True
        if not a.startswith("-") and ("::" in a or a.endswith(".py")):
            return True
    return False


#: ``run`` runs its tests in an xdist worker that is replaced when it dies (``-n 1`` unless -n is given);
#: a backend that crashes in every test costs a worker start per test, bounded by this many restarts.
MAX_WORKER_RESTARTS = 1000


def isolation_args(pytest_args: list[str]) -> list[str]:
    """The pytest arguments that make the run survive its backend: ``-n 1`` (one xdist worker, replaced when
    it dies) unless the user chose the distribution (``-n``, ``--dist``, ``--tx``) or turned xdist off
    (``-p no:xdist``, ``--pdb``, ``--trace``); ``--max-worker-restart`` unless given."""
    import importlib.util

    if importlib.util.find_spec("xdist") is None:
        return []
    joined = [a.replace(" ", "") for a in pytest_args]
    if "no:xdist" in joined or "-pno:xdist" in joined or any(a in ("--pdb", "--trace") for a in joined):
        return []
    marks = [pytest_args[i + 1] for i, a in enumerate(pytest_args[:-1]) if a == "-m"]
    if "--benchmark-only" in joined or any("benchmark" in m and "not benchmark" not in m for m in marks):
        return []  # pytest-benchmark does not time under xdist: benchmarks run in-process
    out = []
    chose = any(a in ("-n", "--numprocesses", "--dist", "-d", "--tx") or
                a.startswith(("-n", "--numprocesses=", "--dist=", "--tx=")) for a in joined)
    if not chose:
        out += ["-n", "1"]
        if importlib.util.find_spec("pytest_benchmark"):  # its "disabled under xdist" warning: they are deselected
            out += ["-W", "ignore:Benchmarks are automatically disabled:pytest_benchmark.logger.PytestBenchmarkWarning"]
    if not any(a.startswith("--max-worker-restart") for a in joined):
        out += ["--max-worker-restart", str(MAX_WORKER_RESTARTS)]
    return out


def threads_args(pytest_args: list[str]) -> list[str]:
    """``--mla-threads 1`` unless the user gave a count: a report's figures do not depend on how the run was
    distributed (serial, -n N) or on the machine's core count (a reduction's order depends on the threads)."""
    return [] if any(a.startswith("--mla-threads") for a in pytest_args) else ["--mla-threads", "1"]


#: Seconds pytest gets to stop after run forwards SIGINT / SIGTERM before its process group is killed.
STOP_GRACE_S = 5.0


def _killpg(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _run_pytest(cmd: list[str]) -> tuple[int, int | None]:
    """Run pytest in a process group of its own; (its return code, the signal that interrupted ``run`` or None).

    SIGINT, SIGTERM or SIGHUP to ``run`` is forwarded to the whole group as SIGINT (pytest stops after
    saying where it was); a second signal, or pytest still running :data:`STOP_GRACE_S` later, kills the
    group. Whatever the group left running when pytest exits (a worker, a test's child) is killed too.
    """
    proc = subprocess.Popen(cmd, start_new_session=True)
    got: list[int] = []
    deadline: list[float] = []

    def forward(signum, frame):
        got.append(signum)
        if len(got) == 1:
            deadline.append(time.monotonic() + STOP_GRACE_S)
            _killpg(proc.pid, signal.SIGINT)
        else:
            _killpg(proc.pid, signal.SIGKILL)

    handled = (signal.SIGINT, signal.SIGTERM) + ((signal.SIGHUP,) if hasattr(signal, "SIGHUP") else ())
    old = {}
    if threading.current_thread() is threading.main_thread():
        old = {sig: signal.signal(sig, forward) for sig in handled}
    try:
        while True:
            try:
                returncode = proc.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                if deadline and time.monotonic() > deadline[0]:
                    _killpg(proc.pid, signal.SIGKILL)
    except BaseException:
        _killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    _killpg(proc.pid, signal.SIGKILL)  # stragglers of the group (the leader is gone; its pgid is not reused
    # while members remain)
    return returncode, (got[0] if got else None)


def partial_results_path(out: Path) -> Path:
    """Where an interrupted run keeps the results it gathered: beside --out, never inside it."""
    return out.parent / f"{out.name}.partial-results.json"


PARTIAL_SCHEMA = "mla-conformance/partial-results"


def _remove_partial(path: Path) -> None:
    """A finished run's report supersedes an earlier interrupted run's partial results (ours only)."""
    try:
        if json.loads(path.read_text(encoding="utf-8")).get("schema") == PARTIAL_SCHEMA:
            path.unlink()
    except (OSError, ValueError, AttributeError):
        pass


def results_from_journal(journal: Path, returncode: int | None, fault_file: Path | None = None) -> dict | None:
    """The results a pytest that died had journalled, its running test recorded as an error (``crashed``,
    or ``timeout`` when the watchdog's dump is in ``fault_file``); None when it journalled nothing."""
    j = isolation.read_journal(journal)
    if j["header"] is None:
        return None
    tests = dict(j["results"])
    dump = ""
    if fault_file is not None:
        try:
            dump = fault_file.read_text(encoding="utf-8", errors="replace")
        except OSError:
            dump = ""
    for nodeid in j["running"]:
        entry = dict(tests.get(nodeid) or {"nodeid": nodeid})
        where = isolation.innermost_frame(dump)
        if isolation.is_watchdog_dump(dump):
            fault = {"kind": "timeout", "native": True, "serial": True, "stack": isolation.current_block(dump)}
            reason = ("timed out (--mla-timeout)" + (f" in {where}" if where else "") + ": Python could not "
                      "interrupt it, so the watchdog ended pytest")
        else:
            fault = {"kind": "crashed", "exit_code": returncode, "serial": True}
            if returncode is not None and returncode < 0:
                fault["signal"] = isolation.signal_name(-returncode)
            reason = f"crashed: pytest {isolation.describe_exit(returncode)} while running it"
        entry.update(outcome="error", reason=reason + " (a serial run: the tests after it did not run)", fault=fault)
        tests[nodeid] = entry
    return {**j["header"], "exitstatus": returncode, "tests": [tests[k] for k in sorted(tests)]}


def _interrupted(signum: int, out: Path, partial: Path, results_path: Path, journal: Path) -> int:
    """``run`` got SIGINT / SIGTERM: pytest is gone; keep what it gathered beside --out, say what ran."""
    j = isolation.read_journal(journal)
    results = None
    if results_path.exists():
        try:
            results = json.loads(results_path.read_text())
        except ValueError:
            results = None
    running = j["running"]
    if results is None and j["header"] is not None:  # a running test's entry holds only its setup: left out
        results = {**j["header"], "tests": [j["results"][k] for k in sorted(j["results"]) if k not in running]}
    name = isolation.signal_name(signum)
    msg = f"mla-conformance run: interrupted by {name}" + (
        f" while running {', '.join(running)}" if running else "") + "; pytest and its workers were ended"
    if results is not None and results.get("tests"):
        payload = {"schema": PARTIAL_SCHEMA, "interrupted_by": name, "running": running, **results}
        try:
            write_file_atomically(partial, json.dumps(payload, indent=1, sort_keys=True, default=str) + "\n")
            msg += f"; the {len(results['tests'])} results gathered so far are in {partial}"
        except OSError as exc:
            msg += f"; the results gathered so far could not be kept ({exc.strerror or exc})"
    else:
        msg += "; no result had been recorded yet"
    print(msg + f"; the previous report in {out} is untouched", file=sys.stderr)
    return 128 + signum


# --------------------------------------------------------------------------- merge


def check_key(test: dict) -> str:
    """A test's row in the matrix: its function and its parameters other than the backend or op, by name."""
    base = test["nodeid"].split("[", 1)[0]
    params = {k: v for k, v in (test.get("params") or {}).items() if k not in ("backend", "op")}
    if not params:
        return base
    return base + "[" + ", ".join(f"{k}={params[k]}" for k in sorted(params)) + "]"


def load_report(path: str | Path) -> dict:
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise MLAInputError(f"{p}: no such report file") from None
    except IsADirectoryError:
        raise MLAInputError(f"{p}: is a directory; give its conformance.json") from None
    except OSError as exc:
        raise MLAInputError(f"{p}: cannot read it ({exc.strerror or exc})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise MLAInputError(f"{p}: not a JSON report ({exc})") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise MLAInputError(f"{p}: not an mla-conformance report (schema "
                            f"{data.get('schema') if isinstance(data, dict) else None!r})")
    if data.get("schema_version") != SCHEMA_VERSION:
        raise MLAInputError(f"{p}: report schema version {data.get('schema_version')}, this tool reads "
                            f"{SCHEMA_VERSION}")
    return data


def merge_reports(reports: list[tuple[str, dict]], warn=None) -> tuple[dict, str]:
    """(matrix, markdown) of ``(source, report)`` pairs; the result does not depend on their order."""
    warn = warn or (lambda msg: print(f"mla-conformance merge: warning: {msg}", file=sys.stderr))
    by_id: dict[str, tuple[str, dict]] = {}
    for source, r in sorted(reports, key=lambda sr: (run_id(sr[1]), sr[0])):
        rid = run_id(r)
        if rid in by_id:
            warn(f"{source} is the same report as {by_id[rid][0]} (run id {rid}); counted once")
            continue
        by_id[rid] = (source, r)
    names: dict[str, list[str]] = {}
    for rid, (_, r) in by_id.items():
        names.setdefault(r["name"], []).append(rid)
    label = {}
    for name, rids in sorted(names.items()):
        if len(rids) == 1:
            label[rids[0]] = name
        else:
            for rid in rids:
                label[rid] = f"{name} [{rid}]"
            warn(f"{len(rids)} different reports are named {name!r} ("
                 + ", ".join(by_id[rid][0] for rid in sorted(rids)) + "): kept apart as "
                 + ", ".join(repr(label[rid]) for rid in sorted(rids)))
    layer = _Grid()
    ops = _Grid()
    for rid in sorted(by_id, key=lambda i: label[i]):
        r = by_id[rid][1]
        verdicts, op_results = r.get("verdicts") or {}, r.get("op_results") or {}
        for backend, v in verdicts.items():  # a NOT TESTED backend has a column even with no row
            layer.column(f"{label[rid]} / {backend}", v.get("verdict"))
        for op, v in op_results.items():
            ops.column(f"{label[rid]} / {op}", v.get("verdict"), v.get("declarations"))
        for t in r["tests"]:
            op = _op_of(t) if not t.get("backend") else ""
            if op:
                col = f"{label[rid]} / {op}"
                ops.column(col, op_results.get(op, {}).get("verdict"))
                ops.cell(check_key(t), col, t)
                continue
            backend = t.get("backend", INDEPENDENT)
            col = f"{label[rid]} / {backend}"
            layer.column(col, None if backend == INDEPENDENT else verdicts.get(backend, {}).get(
                "verdict", verdict_of((r.get("summary") or {}).get(backend, {}))))
            layer.cell(check_key(t), col, t)
    matrix = {"schema": MATRIX_SCHEMA, "schema_version": MATRIX_SCHEMA_VERSION,
              "hosts": sorted(({"name": r["name"], "label": label[rid], "run_id": rid,
                                "environment": r["environment"]} for rid, (_, r) in by_id.items()),
                              key=lambda h: h["label"]),
              **layer.as_json()}
    if ops.columns:
        matrix["ops"] = {**ops.as_json(), "declarations": {c: ops.declarations[c] for c in sorted(ops.declarations)}}
    lines = ["# MLA conformance matrix", "",
             "Rows: checks (test and parameters); columns: report / backend. *FAIL*: a check found the output "
             "or bytes wrong; *ERROR*: the backend raised or returned the wrong type/shape.", ""]
    lines += layer.markdown() if layer.columns else ["(no layer backend in these reports)"]
    if ops.columns:
        extra = [("LSE base", lambda c: _declared_cell((ops.declarations.get(c) or {}).get("lse_base"))),
                 ("empty row lse", lambda c: _declared_cell((ops.declarations.get(c) or {}).get("empty_row")))]
        lines += ["", "## Ops (the op contract)", "",
                  "Rows: op checks; columns: report / op, with the LSE base and empty-row convention each op "
                  "declared in that run.", ""]
        lines += ops.markdown(extra)
    return matrix, "\n".join(lines) + "\n"


class _Grid:
    """One matrix: columns (report / backend or op), their verdicts, and rows of checks x columns."""

    SYMBOL = {"passed": "pass", "failed": "**FAIL**", "error": "**ERROR**", "skipped": "skip", "xfailed": "xfail",
              "xpassed": "XPASS"}

    def __init__(self):
        self.columns: list[str] = []
        self.verdicts: dict[str, str] = {}
        self.declarations: dict[str, Any] = {}
        self.cells: dict[str, dict[str, dict]] = {}

    def column(self, col: str, verdict: str | None, declarations: Any = None) -> None:
        if col not in self.columns:
            self.columns.append(col)
        if verdict is not None:
            self.verdicts.setdefault(col, verdict)
        if declarations is not None:
            self.declarations.setdefault(col, declarations)

    def cell(self, check: str, col: str, t: dict) -> None:
        if col in self.cells.get(check, {}):
            check = f"{check} ({t['nodeid']})"
        self.cells.setdefault(check, {})[col] = {"outcome": t["outcome"],
                                                 **({"reason": t["reason"]} if t.get("reason") else {})}

    def as_json(self) -> dict[str, Any]:
        columns = sorted(self.columns)
        return {"columns": columns, "verdicts": {c: self.verdicts[c] for c in columns if c in self.verdicts},
                "rows": {k: self.cells[k] for k in sorted(self.cells)}}

    def markdown(self, extra_rows=()) -> list[str]:
        columns = sorted(self.columns)
        lines = ["| check | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns),
                 "| **verdict** | " + " | ".join(self.verdicts.get(c, "") for c in columns) + " |"]
        for title, value in extra_rows:
            lines.append(f"| **{title}** | " + " | ".join(value(c) for c in columns) + " |")
        for check in sorted(self.cells):
            row = []
            for col in columns:
                c = self.cells[check].get(col)
                if c is None:
                    row.append("")
                elif c["outcome"] == "skipped":
                    row.append(f"skip: {c.get('reason', '')[:80]}".replace("|", "/"))
                else:
                    row.append(self.SYMBOL.get(c["outcome"], c["outcome"]))
            lines.append(f"| `{check}` | " + " | ".join(row) + " |")
        return lines


def merge_command(args) -> int:
    out = check_out_dir(args.out, "matrix")
    reports = [(str(p), load_report(p)) for p in args.reports]
    matrix, md = merge_reports(reports)
    write_owned_dir(out, {"matrix.json": json.dumps(matrix, indent=1, sort_keys=True) + "\n", "matrix.md": md},
                    kind="matrix")
    ops = matrix.get("ops")
    print(f"mla-conformance merge: {len(matrix['hosts'])} reports, {len(matrix['rows'])} checks x "
          f"{len(matrix['columns'])} columns" + (f"; ops: {len(ops['rows'])} checks x {len(ops['columns'])} columns"
                                                  if ops else "") + f" -> {out}/matrix.md")
    return 0


def _seconds(text: str) -> float:
    """argparse type: seconds >= 0."""
    import argparse

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {text}")
    return value


def add_cli(sub) -> None:
    p = sub.add_parser("run", help="run the conformance suite and write reports/<name>/conformance.{json,md}",
                       description="Run the conformance suite on the built-in backends and op (or --backend "
                                   "SPEC... and/or --op SPEC...) and write conformance.json, conformance.md and "
                                   "plots into --out, a new or empty directory or one holding an earlier report "
                                   "of this tool (anything else there is an error; nothing is touched). "
                                   "Arguments after `--` go to pytest, e.g. `-- -k tiny -n 2`. Exits non-zero "
                                   "when a backend or op fails or is NOT TESTED (no conformance test executed).")
    p.add_argument("--backend", action="append", metavar="SPEC",
                   help="backend spec (repeatable); with --op alone no backend runs; with neither, the built-in "
                        "backends and the built-in op")
    from mla_conformance.contract.op import BUILTIN_OPS, DEFAULT_OPS

    p.add_argument("--op", action="append", metavar="SPEC",
                   help=f"op spec (the op contract; repeatable): a built-in op ({', '.join(BUILTIN_OPS)}), "
                        f"package.module:attr or path/to/file.py:attr; with --backend alone no op runs; with "
                        f"neither, {', '.join(DEFAULT_OPS)}")
    p.add_argument("--checkpoint", metavar="DIR",
                   help="a real DeepSeek checkpoint for the checkpoint tests (config, weights and tokenizer "
                        "are checked before any test runs)")
    p.add_argument("--out", metavar="DIR", help="output directory (default reports/<name>)")
    p.add_argument("--name", help="report name (default: this host's name)")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available)")
    p.add_argument("--suites", metavar="DIR", help="suites directory (default: the installed suites, mla_conformance.suites)")
    p.add_argument("--timeout", type=_seconds, metavar="SECONDS",
                   help=f"bound on each test (pytest's --mla-timeout; default {isolation.DEFAULT_TIMEOUT_S:g} s, 0 = "
                        "none): past it the test is an error and the run goes on in a fresh worker")
    p.add_argument("pytest_args", nargs="*", metavar="-- PYTEST_ARGS")
    p.set_defaults(func=run_command)
    m = sub.add_parser("merge", help="merge conformance.json reports of several hosts into one matrix",
                       description="Merge conformance.json reports into one matrix (rows: checks; columns: report "
                                   "x backend). Reports with the same name are kept apart by their run id; the "
                                   "order of the arguments does not change the result.")
    m.add_argument("reports", nargs="+", metavar="REPORT.json")
    m.add_argument("--out", required=True, metavar="DIR",
                   help="output directory: new, empty, or holding an earlier matrix of this tool")
    m.set_defaults(func=merge_command)
