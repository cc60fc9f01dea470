"""``mla-conformance merge``: conformance.json reports of several hosts in one matrix (rows: checks; columns:
report / backend, and apart from them report / op), written as matrix.json and matrix.md. Reports with the
same name are kept apart by their run id; the order of the arguments does not change the result. On the
terminal: each column's verdict and the skip reasons, wrapped at its width; the full text is in the file.
"""

from __future__ import annotations

import json
import shutil
import sys
import textwrap
from pathlib import Path
from typing import Any

from mla_conformance.engine.report import merged_engine_markdown, merged_engine_rows
from mla_conformance.errors import MLAInputError
from mla_conformance.report.build import INDEPENDENT, SCHEMA, SCHEMA_VERSION, op_of, run_id, verdict_of
from mla_conformance.report.fmt import cell, declared_cell
from mla_conformance.report.outdir import check_out_dir, write_owned_dir

MATRIX_SCHEMA = "mla-conformance/matrix"
#: 3: op results in their own grid (``ops``: columns report / op, verdicts, declarations, rows)
MATRIX_SCHEMA_VERSION = 3


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
            op = op_of(t) if not t.get("backend") else ""
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
        extra = [("LSE base", lambda c: declared_cell((ops.declarations.get(c) or {}).get("lse_base"))),
                 ("empty row lse", lambda c: declared_cell((ops.declarations.get(c) or {}).get("empty_row")))]
        lines += ["", "## Ops (the op contract)", "",
                  "Rows: op checks; columns: report / op, with the LSE base and empty-row convention each op "
                  "declared in that run.", ""]
        lines += ops.markdown(extra)
    engines = merged_engine_rows([(label[rid], r) for rid, (_, r) in by_id.items()])  # --engine's rows
    if engines:
        matrix["engines"] = engines
        lines += merged_engine_markdown(engines)
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
                    row.append(cell(f"skip: {c.get('reason', '')}"))  # the whole reason: the file is not a terminal
                else:
                    row.append(self.SYMBOL.get(c["outcome"], c["outcome"]))
            lines.append(f"| `{check}` | " + " | ".join(row) + " |")
        return lines


#: The skip reasons ``merge`` prints per grid (the most frequent); all of them are in matrix.md.
SKIP_REASONS_SHOWN = 10


def terminal_lines(matrix: dict, width: int) -> list[str]:
    """What ``merge`` prints: each column's verdict and the skip reasons with their counts, wrapped at
    ``width`` between words (a word longer than the line stays whole); the tables are in matrix.md."""
    grids = [("layer backends", matrix)] + ([("ops", matrix["ops"])] if matrix.get("ops") else [])
    out: list[str] = []
    for title, grid in grids:
        if not grid["columns"]:
            continue
        out.append(f"{title}:")
        for col in grid["columns"]:
            out += _wrap(f"{col}: {grid['verdicts'].get(col, '(no verdict)')}", width, "  ", "      ")
        reasons: dict[str, int] = {}
        for cells in grid["rows"].values():
            for c in cells.values():
                if c["outcome"] == "skipped":
                    reasons[c.get("reason", "")] = reasons.get(c.get("reason", ""), 0) + 1
        if reasons:
            out.append(f"{title}, skipped cells by reason:")
            ranked = sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))
            for reason, n in ranked[:SKIP_REASONS_SHOWN]:
                out += _wrap(f"{n} x {reason}", width, "  ", "      ")
            if len(ranked) > SKIP_REASONS_SHOWN:
                out.append(f"  and {len(ranked) - SKIP_REASONS_SHOWN} more reasons (matrix.md)")
    return out


def _wrap(text: str, width: int, first: str, rest: str) -> list[str]:
    return textwrap.wrap(text, width=max(width, 20), initial_indent=first, subsequent_indent=rest,
                         break_long_words=False, break_on_hyphens=False) or [first]


def merge_command(reports: list[str], out: str | Path) -> int:
    """``mla-conformance merge``: the matrix of ``reports`` written into ``out`` (matrix.json, matrix.md)."""
    out = check_out_dir(out, "matrix")
    loaded = [(str(p), load_report(p)) for p in reports]
    matrix, md = merge_reports(loaded)
    write_owned_dir(out, {"matrix.json": json.dumps(matrix, indent=1, sort_keys=True) + "\n", "matrix.md": md},
                    kind="matrix")
    ops = matrix.get("ops")
    width = shutil.get_terminal_size((100, 24)).columns
    summary = (f"mla-conformance merge: {len(matrix['hosts'])} reports, {len(matrix['rows'])} checks x "
               f"{len(matrix['columns'])} columns" + (f"; ops: {len(ops['rows'])} checks x {len(ops['columns'])} "
                                                      "columns" if ops else "") + f" -> {out}/matrix.md")
    print("\n".join(_wrap(summary, width, "", "  ") + terminal_lines(matrix, width)))
    return 0
