"""conformance.md: what a reader comes for first -- verdicts, the ops' verdicts with the declarations that differ
from the contract's defaults, failures (identical ones grouped), cache bytes, each backend's numerical error
closest to its bound, conventions, codecs, generation, gating, links to the plots -- then the long tables (every
numerics test, every op case, the generic sections) and the skips grouped by reason. Reads the report and nothing
else; byte-identical for the same report."""

from __future__ import annotations

from typing import Any

from mla_conformance.contract.methods import METHOD_SPECS, declaration
from mla_conformance.engine.report import engine_markdown
from mla_conformance.report.build import INDEPENDENT, number, op_case_of, verdict_of
from mla_conformance.report.distributed import distributed_markdown
from mla_conformance.messages import headline
from mla_conformance.report.fmt import NOT_RECORDED, cell, declared_cell, fmt_e, mark, numbers_cell, plural
from mla_conformance.report.plots import PLOT_TITLES
from mla_conformance.report.sections import REPORT_SECTIONS, bytes_lines, error_lines, error_summary_lines
from mla_conformance.schema import SECTIONS

#: The sections rendered as one generic table each (test, case, outcome, worst error and bound): those of the op
#: contract's optional methods (their MethodSpecs'; the base method's, decode's, are the op cases' tables), and
#: the composition's and the generated cases'.
GENERIC_SECTIONS: tuple[str, ...] = (*(sec for spec in METHOD_SPECS if not spec.base for sec in spec.sections),
                                     "op_composition", "op_generated", "layer_generated")


def _not_tested_lines(who: str, v: dict) -> list[str]:
    out = ["", f"**{who}: NOT TESTED** ({v['executed']} conformance tests executed). "
               + ("Skip reasons:" if v["skip_reasons"] else "None of its tests executed.")]
    return out + [f"- {r['reason']} ({plural(r['count'], 'test')})" for r in v["skip_reasons"]]


def _counts(s: dict) -> str:
    return (f"{s.get('passed', 0)} | {s.get('failed', 0)} | {s.get('error', 0)} | {s.get('skipped', 0)} | "
            f"{s.get('xfailed', 0)} | {s.get('xpassed', 0)}")


def _verdict_lines(report) -> list[str]:
    verdicts = report.get("verdicts") or {}
    if not report["summary"] and report.get("op_results"):
        return ["## Verdicts", "", "No layer backend was under test in this run (ops only: see below)."]
    out = ["## Verdicts", "",
           "| backend | verdict | passed | failed | errors | skipped | xfailed | xpassed |",
           "|---|---|---:|---:|---:|---:|---:|---:|"]
    for backend, s in sorted(report["summary"].items(), key=lambda kv: (kv[0] == INDEPENDENT, kv[0])):
        v = verdicts.get(backend, {}).get("verdict", "" if backend == INDEPENDENT else verdict_of(s))
        out.append(f"| {backend} | {f'**{v}**' if v else '(not a backend)'} | {_counts(s)} |")
    out += ["", "*failed*: a conformance check found the backend's output or bytes wrong. *errors*: the backend "
                "raised, or returned the wrong type, shape or dtype (or the test could not be set up). "
                "Both fail the run. **NOT TESTED**: every selected test of the backend skipped; that is no "
                "verdict of conformance, and `mla-conformance run` exits non-zero. **NOT SELECTED**: the run's "
                "pytest arguments (`-k`, `-m`, node ids) selected no test of it; no verdict, no failure."]
    for backend, v in sorted(verdicts.items()):
        if v["verdict"] == "NOT TESTED":
            out += _not_tested_lines(backend, v)
    return out


#: The op declarations in the report's op table: key, column heading.
OP_DECLARATION_COLUMNS = (("lse_base", "LSE base"), ("empty_row", "empty row lse"),
                          ("page_block_sizes", "page sizes"), ("kv_formats", "KV formats"),
                          ("fp8_scale_format", "FP8 scales"), ("deterministic", "deterministic"),
                          ("batch_invariant", "batch invariant"), ("head_dims", "head dims qk/v"))


def _as_json(value):
    """A declaration's value as the report holds it (tuples as lists)."""
    return [_as_json(v) for v in value] if isinstance(value, (list, tuple)) else value


def _is_default(key: str, value) -> bool:
    """Whether ``value`` is the op contract's default of declaration ``key`` (a key the contract does not know never
    is: its column is shown)."""
    try:
        default = declaration(key).default
    except ValueError:
        return False
    return _as_json(value) == _as_json(default)


def _differing_declarations(ops: dict) -> list[tuple[str, str]]:
    """The declarations some op made other than the contract's default, as (key, heading): the known ones in their
    order, then any other by its name; one every op leaves at its default is left out (docs/op-contract.md lists
    them with their defaults)."""
    known = dict(OP_DECLARATION_COLUMNS)
    decls = [v["declarations"] for v in ops.values() if isinstance(v.get("declarations"), dict)]
    differs = {k for d in decls for k, value in d.items() if not _is_default(k, value)}
    extra = sorted(k for k in differs if k not in known)
    return [(k, h) for k, h in OP_DECLARATION_COLUMNS if k in differs] + [(k, k.replace("_", " ")) for k in extra]


def _default_cell(key: str) -> str:
    try:
        return declared_cell(_as_json(declaration(key).default))
    except ValueError:
        return "(not in the contract)"


def _op_verdict_lines(report) -> list[str]:
    ops = report.get("op_results") or {}
    if not ops:
        return []
    names = sorted(ops)
    out = ["## Ops (the op contract)", "",
           "Kernel-level implementations of one decode step over a paged latent cache (`--mla-op`) and the optional "
           "methods they declare, judged by the backends' rule.", "",
           "| op | verdict | passed | failed | errors | skipped | xfailed | xpassed |",
           "|---|---|---:|---:|---:|---:|---:|---:|"]
    for op in names:
        out.append(f"| {op} | **{ops[op]['verdict']}** | {_counts(ops[op]['summary'])} |")
    rows = _differing_declarations(ops)
    if rows:
        out += ["", "The declarations each op made in this run (defaults filled in where it declared nothing) that "
                    "differ from the op contract's defaults, one row each; every other declaration is at its default "
                    "for every op (docs/op-contract.md lists them all).", "",
                "| declaration | default | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
        for key, heading in rows:
            cells = [declared_cell(d.get(key)) if isinstance(d := ops[op].get("declarations"), dict)
                     else "(not recorded)" for op in names]
            out.append(f"| {heading} | {cell(_default_cell(key))} | " + " | ".join(map(cell, cells)) + " |")
    for op, v in sorted(ops.items()):
        if v["verdict"] == "NOT TESTED":
            out += _not_tested_lines(f"op {op}", v)
    return out


def _op_case_lines(report) -> list[str]:
    ops = report.get("op_results") or {}
    by_section: dict[str, list[tuple[str, dict]]] = {}
    for op, v in ops.items():
        for section, cases in v["sections"].items():
            if section not in GENERIC_SECTIONS:  # those have a table of their own (generic_lines)
                by_section.setdefault(section, []).extend((op, c) for c in cases)
    if not by_section:
        return []
    out = ["## Op cases", "",
           "Per section of the op suite, one row per check and case: its outcome and the figures it measured "
           "(*tolerance*: the row of `OP_TOLERANCES` it was held to, derived in docs/tolerances.md; the bounds "
           "themselves where a check recorded no row). Failing rows first."]
    for section in sorted(by_section):
        out += ["", f"### {section}", "", "| | op | check | case | measured | tolerance |", "|---|---|---|---|---|---|"]
        rows = sorted(by_section[section], key=lambda oc: (oc[1]["outcome"] not in ("failed", "error"), oc[0],
                                                           oc[1]["check"], oc[1]["case"], oc[1]["nodeid"]))
        for op, c in rows:
            shown = numbers_cell(c.get("measured") or {})
            if c["outcome"] != "passed" and c.get("reason"):
                reason = headline(c["reason"])
                reason = reason if len(reason) <= 200 else reason[:199] + "…"
                shown = (shown + "; " if shown else "") + reason
            tol = c.get("tolerance") or {}
            tol_cell = tol["row"] if tol.get("row") else numbers_cell(tol)
            out.append(f"| {mark(c) if c['outcome'] != 'skipped' else 'skip'} | {op} | {cell(c['check'])} | "
                       f"{cell(c['case'])} | {cell(shown)} | {cell(tol_cell)} |")
    return out


def _worst(f: dict) -> str:
    """A generic row's worst error against its bound, as the check recorded it."""
    over = number(f, "out_error_over_bound")
    if over is not None:
        return f"{fmt_e(over)} x the bound"
    err = number(f, "out_rel_fro", "rel_fro")
    if err is None:
        return NOT_RECORDED
    tol = number(f, "tolerance_rel_fro")
    return f"rel_fro {fmt_e(err)} (tolerance {fmt_e(tol) if tol is not None else NOT_RECORDED})"


def _generic_lines(report) -> list[str]:
    """One table per section of :data:`GENERIC_SECTIONS` the run has rows of:
    test, case, outcome and the worst error against its bound."""
    out: list[str] = []
    for section in sorted(GENERIC_SECTIONS):
        rows = [t for t in report["tests"] if t.get("section") == section]
        if not rows:
            continue
        out += ([""] if out else []) + [f"## {section}: {SECTIONS[section]}", "",
                "| | backend / op | test | case | worst error / bound |", "|---|---|---|---|---|"]
        for t in sorted(rows, key=lambda t: (t["outcome"] not in ("failed", "error"), t["nodeid"])):
            f = t.get("figures") or {}
            worst = _worst(f) if t["outcome"] != "skipped" else ""
            if t["outcome"] != "passed" and t.get("reason"):
                worst = (worst + "; " if worst else "") + headline(t["reason"])
            test = t["nodeid"].split("::")[-1].split("[")[0]
            out.append(f"| {mark(t) if t['outcome'] != 'skipped' else 'skip'} | {t.get('backend') or t.get('op', '')} "
                       f"| {cell(test)} | {cell(op_case_of(t))} | {cell(worst)} |")
    return out


#: A failure group shows this many test ids; the rest are counted.
FAILURE_IDS_SHOWN = 3


def _failure_lines(report) -> list[str]:
    """Failures and errors, identical ones (same outcome, message and likely cause) one row with a count."""
    failed = [t for t in report["tests"] if t["outcome"] in ("failed", "error")]
    if not failed:
        return []
    groups: dict[tuple[str, str], list[str]] = {}
    for t in failed:
        msg = (t.get("reason") or "").strip().replace("|", "\\|")
        cause = (t.get("figures") or {}).get("likely_cause")
        if cause and "likely cause:" not in msg:
            msg += f"\n*Likely cause:* {cause}"
        msg = msg.replace("\n", "<br>")
        groups.setdefault((t["outcome"], msg), []).append(t["nodeid"])
    out = ["## Failures", "", "| outcome | test | message |", "|---|---|---|"]
    for (outcome, msg), ids in sorted(groups.items(), key=lambda g: (g[0][0], sorted(g[1])[0], g[0][1])):
        ids = sorted(ids)
        shown = ", ".join(f"`{i}`" for i in ids[:FAILURE_IDS_SHOWN])
        tests = shown if len(ids) == 1 else f"{len(ids)} tests: {shown}" + (
            f" and {len(ids) - FAILURE_IDS_SHOWN} more" if len(ids) > FAILURE_IDS_SHOWN else "")
        out.append(f"| {outcome} | {tests} | {msg} |")
    return out


def render_markdown(report: dict[str, Any], plots: list[str] | None = None) -> str:
    env = report["environment"]
    out = [f"# MLA conformance report: {report['name']}", ""]
    out.append(f"mla-conformance {env['suite_version']} · device {env['device']} ({env.get('device_name')}"
               + (f", capability {env['capability']}" if env.get("capability") else "") + ")"
               + f" · torch {env['torch']} · transformers {env.get('transformers')} · python {env['python']}")
    out += [""] + _verdict_lines(report)
    # first the verdicts and the figures a reader comes for, then the long tables (every test's row)
    for part in (_op_verdict_lines, _failure_lines, bytes_lines, error_summary_lines):
        lines = part(report)
        if lines:
            out += [""] + lines
    for part in (engine_markdown, distributed_markdown):  # engines end to end, the layer across ranks, ops under DCP
        text = part(report).strip("\n")
        if text:
            out += ["", text]
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
    for part in (error_lines, _op_case_lines, _generic_lines):
        lines = part(report)
        if lines:
            out += [""] + lines
    skipped = [t for t in report["tests"] if t["outcome"] == "skipped"]
    if skipped:
        out += ["", "## Skipped, grouped by reason", "", "| tests | reason |", "|---:|---|"]
        reasons: dict[str, int] = {}
        for t in skipped:
            reasons[t.get("reason", "?")] = reasons.get(t.get("reason", "?"), 0) + 1
        for reason, n in sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0])):
            out.append(f"| {n} | {cell(reason)} |")
    return "\n".join(out) + "\n"
