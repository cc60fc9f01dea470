"""``mla-conformance docs``: the tables of markers.md, generated from the code that owns them.

markers.md keeps its prose by hand; its tables are written between marker comments::

    <!-- generated: tolerances (mla-conformance docs) -->
    | ... |
    <!-- end generated -->

and rewritten in place by ``mla-conformance docs`` from :data:`mla_conformance.checks.TOLERANCES`,
:data:`mla_conformance.codecs.CODECS` (bytes per token at DeepSeek-V2-Lite dims in BF16) with
:data:`mla_conformance.codecs.ERROR_BOUNDS`, and :data:`mla_conformance.arch.MATRIX`.
``mla-conformance docs --check`` changes nothing and exits 1 naming the sections that differ.
"""

from __future__ import annotations

import argparse
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


# --------------------------------------------------------------------------- the tables


def tolerances_table() -> str:
    from mla_conformance.checks import TOLERANCES

    rows = [(dtype, num(t.rel_fro), num(t.max_rel), t.reason) for dtype, t in TOLERANCES.items()]
    return _table(("dtype", "rel_fro", "max_rel", "reason"), ("l", "r", "r", "l"), rows)


def codecs_table() -> str:
    import torch

    from mla_conformance.codecs import CODECS, ERROR_BOUNDS
    from mla_conformance.config import MLAConfig

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
    "support_matrix": support_matrix_table,
    "tolerances": tolerances_table,
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
        help="rewrite markers.md's generated tables (tolerances, codecs, support matrix) from the code",
        description="Rewrite the tables of markers.md between '<!-- generated: NAME (...) -->' and "
                    "'<!-- end generated -->' from TOLERANCES, CODECS + ERROR_BOUNDS and the kernel support "
                    "matrix; with --check, change nothing and exit 1 naming the stale sections.",
    )
    p.add_argument("--check", action="store_true", help="exit 1 when a generated section differs from the code")
    p.add_argument("--path", default=str(DEFAULT_PATH) if DEFAULT_PATH else None, metavar="FILE",
                   help="the markdown file to rewrite (default: markers.md of this checkout)")
    p.set_defaults(func=_cmd_docs)
