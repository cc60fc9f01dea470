"""Cells of the report's markdown tables: numbers, ratios, outcomes, declarations."""

from __future__ import annotations

import math

#: What a cell says when the run recorded no figure for it (the renderer never computes one in its place).
NOT_RECORDED = "not recorded"
#: A bytes cell with no measurement (the formula is never shown in its place).
NOT_MEASURED = "not measured"


def fmt_int(v) -> str:
    return f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else str(v)


def fmt_e(v) -> str:
    return f"{v:.3e}" if isinstance(v, (int, float)) and not isinstance(v, bool) else ("" if v is None else str(v))


def fmt_x(v) -> str:
    if v is None:
        return ""
    if v == math.inf:
        return "inf"
    return f"{v:.3g}x"


def mark(t) -> str:
    """A row's first cell: **FAIL**, **ERROR**, xfail, XPASS or ok."""
    return {"failed": "**FAIL**", "error": "**ERROR**", "xfailed": "xfail", "xpassed": "XPASS"}.get(t["outcome"], "ok")


def cell(text) -> str:
    """Text safe in a markdown table cell (a ``|`` would end the cell, a line break the row)."""
    return str(text).replace("|", "/").replace("\n", "<br>")


def declared_cell(value) -> str:
    """An op declaration: yes / no, (576, 512) pairs as 576/512, lists joined by commas."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (list, tuple)):
        return ", ".join("/".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v) for v in value)
    return "" if value is None else str(value)


def numbers_cell(numbers: dict) -> str:
    """``key value`` pairs, sorted by key (floats as 1.234e-05, ints with separators; ``row`` left out)."""
    return ", ".join(f"{k} {fmt_e(v) if isinstance(v, float) else fmt_int(v)}" for k, v in sorted(numbers.items())
                     if k != "row")


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'s' if n != 1 else ''}"
