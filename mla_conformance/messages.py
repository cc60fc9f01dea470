"""How a failure message reads, the one place it is written: a headline (what failed, where, measured against
its bound and by how much), the likely cause on a line of its own when the suite can name one, then the
details (got / expected at the worst element, how many values are over, the bound's key in docs/tolerances.md).

A reader of a failing run sees the verdict and the margin first, as FlashMLA's kernelkit ``check_is_allclose``
prints where, got / expected and how many in a few short lines; the bound's derivation is never printed, only
named (:func:`bound_line`): docs/tolerances.md derives it, under the key the message gives."""

from __future__ import annotations

import math
import re

#: Where every bound a message names is derived.
TOLERANCES_DOC = "docs/tolerances.md"
CAUSE = "likely cause: "


def num(v: float) -> str:
    """A measured figure in a message: three significant digits (``0.00983``, ``2.83e-06``, ``inf``, ``nan``)."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return f"{v:.3g}"


def times(ratio: float) -> str:
    """How many times a bound a figure is: ``3.47x``, ``22,000x`` (two significant digits from 100 up), ``8.0e+35x``."""
    if math.isnan(ratio) or math.isinf(ratio):
        return "inf x" if ratio > 0 else f"{ratio} x"
    if ratio >= 1e6:
        return f"{ratio:.1e}x"
    if ratio >= 100:
        digits = int(math.floor(math.log10(ratio))) - 1
        return f"{int(round(ratio, -digits)):,}x"
    return f"{ratio:.3g}x"


def over(measured: float, bound: float) -> str:
    """``0.00983 vs bound 0.00283, 3.47x over``: measured against its bound, and the margin."""
    ratio = math.inf if bound <= 0 else measured / bound
    return f"{num(measured)} vs bound {num(bound)}, {times(ratio)} over"


def bound_line(key: str, extra: str = "", doc: str = TOLERANCES_DOC) -> str:
    """``bound: OP_TOLERANCES["bfloat16"] (docs/tolerances.md)``: the bound's key, where its derivation lives."""
    return f"bound: {key} ({doc})" + (f"; {extra}" if extra else "")


def cause_text(cause: str) -> str:
    """A likely cause as a sentence of its own: the ``'; likely cause: '`` a hint was written with dropped."""
    text = cause.strip().lstrip(";").strip()
    return text.removeprefix(CAUSE)


def located(name: str, case: str, check: str) -> str:
    """``name [case] check``: where a check ran, as an op failure message begins (:func:`failure` keeps the name and
    the check on the headline and gives the case a line of its own)."""
    return f"{name} [{case}] {check}"


#: a headline that begins as :func:`located` writes it
_LOCATED = re.compile(r"^(?P<name>\S+) \[(?P<case>[^\[\]]+)\] (?P<rest>.*)$", re.S)


def split_case(headline: str) -> tuple[str, str]:
    """(``headline`` without the bracketed case :func:`located` put after the name, that case); ('', ...) untouched."""
    m = _LOCATED.match(headline)
    return (f"{m['name']} {m['rest']}", m["case"]) if m else (headline, "")


def split_cause(text: str) -> tuple[str, str]:
    """(``text`` before ``'; likely cause: '``, the cause after it): a location or hint written with its cause inline."""
    head, sep, cause = text.partition(f"; {CAUSE}")
    return (head, cause) if sep else (text, "")


def failure(headline: str, *details: str, cause: str = "") -> str:
    """The message: ``headline``, then ``likely cause: ...`` when ``cause`` (or an inline ``'; likely cause: ...'``
    of the headline, moved here) says one, then each non-empty detail, then the case a :func:`located` headline
    named (``case: ...``), each on its own line (indented, as pytest prints an AssertionError's lines under ``E``)."""
    headline, inline = split_cause(headline)
    headline, case = split_case(headline)
    causes = [c for c in (cause_text(inline), cause_text(cause)) if c]
    lines = [headline]
    if causes:
        lines.append(f"  {CAUSE}{'; '.join(causes)}")
    lines += [f"  {d}" for d in details if d]
    if case:
        lines.append(f"  case: {case}")
    return "\n".join(lines)


def with_cause(message: str, cause: str) -> str:
    """``message`` (a :func:`failure`, or any one-line message) with ``cause`` inserted as its second line."""
    if not cause_text(cause):
        return message
    head, _, rest = str(message).partition("\n")
    first, _, after = rest.partition("\n")
    if first.startswith(f"  {CAUSE}"):  # one cause line: this cause first, the message's own after it
        return f"{head}\n  {CAUSE}{cause_text(cause)}; {first.removeprefix(f'  {CAUSE}')}" + (f"\n{after}" if after else "")
    return failure(head, cause=cause) + (f"\n{rest}" if rest else "")


def headline(message: str) -> str:
    """A message's first line: what failed, where, by how much (the report's failures table shows it alone)."""
    return str(message).partition("\n")[0]
