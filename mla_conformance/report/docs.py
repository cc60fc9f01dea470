"""``mla-conformance docs``: the tables of markers.md, generated from the code that owns them.

markers.md keeps its prose by hand; its tables are written between marker comments::

    <!-- generated: tolerances (mla-conformance docs) -->
    | ... |
    <!-- end generated -->

and rewritten in place by ``mla-conformance docs`` from the pytest options the plugin registers
(:func:`mla_conformance.pytest_plugin.pytest_addoption`), :data:`mla_conformance.checks.TOLERANCES` and
``OP_TOLERANCES``, :data:`mla_conformance.kv.codecs.CODECS` (bytes per token at DeepSeek-V2-Lite dims in BF16)
with :data:`mla_conformance.kv.codecs.ERROR_BOUNDS`, :data:`mla_conformance.arch.MATRIX`, and the op suite's
sections (the ``mla_section("op-...")`` markers of ``suites/test_op_*.py``, read from the source).
``mla-conformance docs --check`` changes nothing and exits 1 naming the sections that differ.
"""

from __future__ import annotations

import argparse
import ast
import math
import re
import sys
from decimal import Decimal
from pathlib import Path
from typing import Any, Callable

from mla_conformance.resources import source_checkout

#: markers.md of the source checkout; None for an installed wheel (markers.md is not shipped: pass --path)
DEFAULT_PATH = _checkout / "markers.md" if (_checkout := source_checkout()) else None

REGENERATE = "mla-conformance docs"
BEGIN = "<!-- generated: {name} (" + REGENERATE + ") -->"
END = "<!-- end generated -->"
_BLOCK_RE = re.compile(r"<!-- generated: (?P<name>[a-z_]+) \([^)]*\) -->\n(?P<body>.*?)<!-- end generated -->",
                       re.DOTALL)

#: The preset and cache dtype of the codec table's byte columns.
CODEC_PRESET = "deepseek-v2-lite"
CODEC_DTYPE = "bfloat16"


# --------------------------------------------------------------------------- formatting


def num(x: float) -> str:
    """A bound as the shortest decimal that round-trips, in scientific notation: 2.5e-2, 1e-6, 0."""
    if x == 0:
        return "0"
    d = Decimal(repr(float(x))).normalize()
    sign, digits, exp = d.as_tuple()
    e = exp + len(digits) - 1
    mant = str(digits[0]) + ("." + "".join(str(v) for v in digits[1:]) if len(digits) > 1 else "")
    return ("-" if sign else "") + (mant if e == 0 else f"{mant}e{e}")


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _table(headers: tuple[str, ...], align: tuple[str, ...], rows: list[tuple[Any, ...]]) -> str:
    rule = tuple("---:" if a == "r" else "---" for a in align)
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(rule) + " |"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def bound(x: float) -> str:
    """A bound that is a small power of two (half a step of a float format) as 2^-k, else :func:`num`."""
    if 0 < x < 1e-2:
        mant, exp = math.frexp(x)
        if mant == 0.5:
            return f"2^{exp - 1}"
    return num(x)


# --------------------------------------------------------------------------- the tables


class _OptionRecorder:
    """A stand-in for pytest's parser: records what ``pytest_addoption`` registers."""

    def __init__(self):
        self.options: list[tuple[tuple[str, ...], dict[str, Any]]] = []

    def getgroup(self, *args, **kwargs):
        return self

    def addoption(self, *names, **kwargs):
        self.options.append((names, kwargs))


def options_table() -> str:
    from mla_conformance import pytest_plugin as plugin

    rec = _OptionRecorder()
    plugin.pytest_addoption(rec)
    rows = []
    for names, kw in rec.options:
        metavar = kw.get("metavar")
        form = ", ".join(f"`{n}{' ' + metavar if metavar else ''}`" for n in names)
        rows.append((form, kw.get("help", "") + (" (repeatable)" if kw.get("action") == "append"
                                                  and "repeatable" not in kw.get("help", "") else "")))
    return _table(("option", "meaning"), ("l", "l"), rows)


def tolerances_table() -> str:
    from mla_conformance.checks import TOLERANCES

    rows = [(dtype, num(t.rel_fro), num(t.max_rel), t.reason) for dtype, t in TOLERANCES.items()]
    return _table(("dtype", "rel_fro", "max_rel", "reason"), ("l", "r", "r", "l"), rows)


def op_tolerances_table() -> str:
    from mla_conformance import checks

    table = getattr(checks, "OP_TOLERANCES", None)
    if table is None:
        return "*(no `OP_TOLERANCES` table in `mla_conformance/checks.py` yet)*\n"
    def roundings(x: float) -> str:  # n roundings of float32 or float64: "52 x 2^-24"
        for k in (24, 53):
            n = x * 2.0 ** k
            if n > 1 and n == int(n) and n < 4096:
                return f"{int(n)} x 2^-{k}"
        return bound(x)

    rows = [(f"`{key}`", bound(t.p_round), roundings(t.dot), roundings(t.acc), t.reason) for key, t in table.items()]
    return _table(("q dtype / KV format", "p_round (x S)", "dot (x T)", "acc (x S)", "reason"),
                  ("l", "r", "r", "r", "l"), rows)


def _sections_of(path: Path) -> list[tuple[str, str]]:
    """(section, test function) for each test of a suite module with an ``mla_section`` marker, from its source."""
    out = []
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not node.name.startswith("test_"):
            continue
        for deco in node.decorator_list:
            if (isinstance(deco, ast.Call) and isinstance(deco.func, ast.Attribute) and deco.func.attr == "mla_section"
                    and deco.args and isinstance(deco.args[0], ast.Constant)):
                out.append((str(deco.args[0].value), node.name))
    return out


def op_sections_table() -> str:
    from mla_conformance.resources import suites_dir

    sections: dict[str, list[str]] = {}
    for path in sorted(suites_dir().glob("test_op_*.py")):
        for section, test in _sections_of(path):
            sections.setdefault(section, []).append(f"`{path.name}::{test}`")
    if not sections:
        return "*(no op suite in this installation: no suites/test_op_*.py)*\n"
    return _table(("section", "tests (each once per op)"), ("l", "l"),
                  [(f"`{sec}`", ", ".join(tests)) for sec, tests in sorted(sections.items())])


def codecs_table() -> str:
    import torch

    from mla_conformance.kv.codecs import CODECS, ERROR_BOUNDS
    from mla_conformance.model.config import MLAConfig

    config = MLAConfig.preset(CODEC_PRESET)
    dtype = getattr(torch, CODEC_DTYPE)
    rows = []
    for name, codec in CODECS.items():
        b = codec.bytes_per_token(config, dtype)
        per_cache = codec.global_nbytes(config)
        size = f"{b['payload']} + {b['metadata']} = {b['total']}" + (f" (+{per_cache} B per cache)"
                                                                    if per_cache else "")
        bound = ERROR_BOUNDS[name]
        rows.append((f"`{name}`", codec.description, size, codec.kpe, codec.quant_study or "-",
                     f"{num(bound.latent)} / {num(bound.attention)}", bound.reason))
    return _table(("codec", "layout", "B/token/layer (payload + metadata)", "k_pe", "seed 001 scheme",
                   "bound latent / attention", "why"), ("l", "l", "r", "l", "l", "r", "l"), rows)


def _ver(v: tuple[int, int] | None) -> str:
    return "not stated" if v is None else f"{v[0]}.{v[1]}"


def _min_cuda(targets) -> str:
    first = _ver(targets[0].min_cuda)
    rest = [f"{_ver(t.min_cuda)} on {t.name}" for t in targets[1:] if t.min_cuda != targets[0].min_cuda]
    return "; ".join([first, *rest])


def support_matrix_table() -> str:
    from mla_conformance.arch import MATRIX

    rows = []
    for row in MATRIX:
        runs_on = ", ".join(f"{t.name} ({', '.join(f'{c[0]}.{c[1]}' for c in t.capabilities)})"
                            for t in row.targets)
        dims = " or ".join(map(str, row.head_dim_k)) + "/" + " or ".join(map(str, row.head_dim_v))
        page = "-" if row.page_block_size is None else "/".join(map(str, row.page_block_size))
        rows.append((f"`{row.kernel_id}`", runs_on, _min_cuda(row.targets), row.kv_dtype, page,
                     f"{row.mode}, {dims}", row.confidence))
    return _table(("kernel id", "runs on (compute capability)", "min CUDA", "KV cache", "page block",
                   "mode, head dims K/V", "confidence"), ("l",) * 7, rows)


#: Section name -> the function writing its body, in markers.md order.
SECTIONS: dict[str, Callable[[], str]] = {
    "options": options_table,
    "support_matrix": support_matrix_table,
    "tolerances": tolerances_table,
    "op_sections": op_sections_table,
    "op_tolerances": op_tolerances_table,
    "kv_codecs": codecs_table,
}


# --------------------------------------------------------------------------- rewriting markers.md


def render(text: str) -> tuple[str, list[str]]:
    """``text`` with every generated section rewritten, and the names of the sections that changed.

    A ValueError when a section of :data:`SECTIONS` has no markers, or a marker names an unknown one.
    """
    found = [m.group("name") for m in _BLOCK_RE.finditer(text)]
    unknown = [n for n in found if n not in SECTIONS]
    missing = [n for n in SECTIONS if n not in found]
    if unknown or missing:
        parts = ([f"unknown section(s) {', '.join(unknown)}"] if unknown else []) + (
            [f"no markers for section(s) {', '.join(missing)} "
             f"(add {BEGIN.format(name=missing[0])} ... {END})"] if missing else [])
        raise ValueError("; ".join(parts))
    stale: list[str] = []

    def sub(m: re.Match) -> str:
        name = m.group("name")
        body = SECTIONS[name]()
        if body != m.group("body"):
            stale.append(name)
        return BEGIN.format(name=name) + "\n" + body + END

    return _BLOCK_RE.sub(sub, text), stale


def _cmd_docs(args: argparse.Namespace) -> int:
    from mla_conformance.cli import UserError

    if args.path is None:
        raise UserError("--path FILE: markers.md belongs to a source checkout of mla-conformance, and this is an "
                        "installed one")
    path = Path(args.path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise UserError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    try:
        new, stale = render(text)
    except ValueError as exc:
        raise UserError(f"{path}: {exc}") from None
    if args.check:
        if stale or new != text:
            print(f"{path}: stale generated section(s): {', '.join(stale) or 'marker lines'}; "
                  f"regenerate with `{REGENERATE}`", file=sys.stderr)
            return 1
        print(f"{path}: generated sections up to date ({', '.join(SECTIONS)})")
        return 0
    if new != text:
        path.write_text(new, encoding="utf-8")
        print(f"{path}: rewrote {', '.join(stale) or 'marker lines'}")
    else:
        print(f"{path}: generated sections up to date ({', '.join(SECTIONS)})")
    return 0


def add_cli(subparsers: Any) -> None:
    """Register ``mla-conformance docs``."""
    p = subparsers.add_parser(
        "docs",
        help="rewrite markers.md's generated tables (options, tolerances, op sections, codecs, support matrix) "
             "from the code",
        description="Rewrite the tables of markers.md between '<!-- generated: NAME (...) -->' and "
                    "'<!-- end generated -->' from the plugin's options, TOLERANCES and OP_TOLERANCES, the op "
                    "suite's sections, CODECS + ERROR_BOUNDS and the kernel support matrix; with --check, change "
                    "nothing and exit 1 naming the stale sections.",
    )
    p.add_argument("--check", action="store_true", help="exit 1 when a generated section differs from the code")
    p.add_argument("--path", default=str(DEFAULT_PATH) if DEFAULT_PATH else None, metavar="FILE",
                   help="the markdown file to rewrite (default: markers.md of this checkout)")
    p.set_defaults(func=_cmd_docs)
