"""The report from the plugin's results: per-test rows (outcome, reason, figures rounded), a verdict per
backend and per op, and the accessors renderers read recorded figures through.

Verdicts: a backend with a failed or errored test DOES NOT CONFORM; one with no test in the run at all is
NOT SELECTED (the pytest arguments deselected it: no verdict, no failure); one with no executed
conformance test (0 passed, failed, errored or xpassed) is NOT TESTED; else it CONFORMS. Ops (their rows
carry ``params["op"]``) are judged by the same rule, apart from the backends: their rows count under
neither a backend nor the backend-independent bucket.

Byte-identical for the same results: no timings, no dates, sorted keys, floats rounded to
:data:`SIG_DIGITS` significant digits (``cosine_diff`` to :data:`COSINE_DIGITS`).
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

SCHEMA = "mla-conformance/report"
SCHEMA_VERSION = 1
#: Significant digits of every float figure in conformance.json (1 - cos: :data:`COSINE_DIGITS`).
SIG_DIGITS = 4
#: ``cosine_diff`` = 1 - cos is 1 minus a number near 1: its float64 noise (~1e-16 absolute) moves its
#: 4th digit when the thread count changes the summation order, so it keeps 3.
COSINE_DIGITS = 3

VERDICTS = ("CONFORMS", "DOES NOT CONFORM", "NOT TESTED", "NOT SELECTED")
OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")
INDEPENDENT = "(backend-independent)"


def backend_of(test: dict) -> str:
    return test.get("backend") or (test.get("params") or {}).get("backend") or ""


def op_of(test: dict) -> str:
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
        if backend_of(t):
            entry["backend"] = backend_of(t)
        elif op_of(t):
            entry["op"] = op_of(t)
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


# --------------------------------------------------------------------------- reading recorded figures


def in_section(report, section: str) -> list[dict]:
    """The report's rows of one section that carry figures (recorded from each test's ``mla_section``
    marker), never found by test name: renaming a test changes no section."""
    return [t for t in report["tests"] if t.get("section") == section and t.get("figures")]


#: Keys of a bytes row's figures, in order of preference. Measured: bytes written per stored token, counted
#: in the cache's own tensors. Formula: what the declared format takes, as the check recorded it, never
#: read as a measurement.
MEASURED_BYTES_KEYS = ("measured_bytes_per_token", "bytes_per_token")
FORMULA_BYTES_KEYS = ("formula_bytes_per_token", "format_bytes_per_token")


def number(f: dict, *keys) -> int | float | None:
    """The first of ``keys`` whose figure is a number (not a flag), or None."""
    for k in keys:
        v = f.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return v
    return None


def measured_bytes(f: dict) -> int | float | None:
    """A row's measured bytes per stored token, or None: never the format formula."""
    return number(f, *MEASURED_BYTES_KEYS)


def formula_bytes(f: dict) -> int | float | None:
    """A row's formula bytes per stored token (the declared format's), or None."""
    return number(f, *FORMULA_BYTES_KEYS)


def tolerance_of(f: dict) -> tuple[float | None, float | None]:
    """The (rel_fro, max_rel) bounds a row recorded it was held to; None where it recorded none."""
    return number(f, "tolerance_rel_fro"), number(f, "tolerance_max_rel")


def margin(measured: float | None, tolerance: float | None) -> float | None:
    """tolerance / measured: how many times the error could grow before failing (below 1 fails)."""
    if measured is None or tolerance is None:
        return None
    if measured == 0:
        return math.inf
    return float(f"{tolerance / measured:.3g}")
