"""``python tools/docs.py [--check] [--path FILE]``: the generated tables of markers.md and docs/*.md, written from the
code that owns them. A maintainer's script of the checkout, not part of the wheel; the default ``pytest``
(tests/meta/test_docs.py) fails while a generated table differs from the code.

Each file keeps its prose by hand; its tables are written between marker comments::

    <!-- generated: tolerances (python tools/docs.py) -->
    | ... |
    <!-- end generated -->

and rewritten in place by ``python tools/docs.py`` (:func:`update`) from the pytest options the plugin registers
(:func:`mla_conformance.pytest_plugin.pytest_addoption`), :data:`mla_conformance.checks.TOLERANCES` and
``OP_TOLERANCES``, :data:`mla_conformance.kv.codecs.CODECS` (bytes per token at DeepSeek-V2-Lite dims in BF16)
with :data:`mla_conformance.kv.codecs.ERROR_BOUNDS`, :data:`mla_conformance.arch.MATRIX`, the presets
(:data:`mla_conformance.model.config.PRESETS`), the op contract's methods and declarations, and the op suite's
sections (the ``mla_section("op-...")`` markers of ``suites/test_op_*.py``, read from the source). :data:`FILES`
says which file holds which section. ``python tools/docs.py --check`` changes nothing and exits 1 naming the
files and sections that differ.
"""

from __future__ import annotations

import ast
import math
import re
from decimal import Decimal
from pathlib import Path
from typing import Any, Callable

from mla_conformance.resources import source_checkout, suites_dir
from mla_conformance import checks
from mla_conformance import pytest_plugin as plugin
from mla_conformance.cli.matrix import support_matrix_table
from mla_conformance.checks import TOLERANCES
from mla_conformance.contract.methods import METHOD_SPECS
from mla_conformance.kv.codecs import CODECS, ERROR_BOUNDS
from mla_conformance.model.config import PRESETS, MLAConfig

#: The source checkout; None for an installed wheel (markers.md and docs/ are not shipped: pass a path)
CHECKOUT = source_checkout()

#: The files with generated sections, relative to the checkout, and the sections each holds (one owner each).
FILES: dict[str, tuple[str, ...]] = {
    "markers.md": ("options", "op_sections"),
    "docs/support-matrix.md": ("support_matrix",),
    "docs/tolerances.md": ("tolerances", "op_tolerances"),
    "docs/codecs.md": ("kv_codecs",),
    "docs/cli.md": ("presets",),
    "docs/op-contract.md": ("op_methods", "op_tensors"),
}

REGENERATE = "python tools/docs.py"
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
    rows = [(dtype, num(t.rel_fro), num(t.max_rel), t.reason) for dtype, t in TOLERANCES.items()]
    return _table(("dtype", "rel_fro", "max_rel", "reason"), ("l", "r", "r", "l"), rows)


def op_tolerances_table() -> str:
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


def op_methods_table() -> str:
    """The op contract's methods: signature and declarations with their defaults (contract/methods.py METHOD_SPECS)."""
    def value(v: Any) -> str:
        return repr(v).replace("'", '"')

    rows = [(f"`{spec.name}`", f"`{spec.signature}`",
             ", ".join(f"`{d.name}` = `{value(d.default)}`" for d in spec.declarations) or "-")
            for spec in METHOD_SPECS]
    return _table(("method", "signature", "declarations (defaults)"), ("l", "l", "l"), rows)


def op_tensors_table() -> str:
    """Every method's tensors: shape and what each holds, inputs then results (contract/methods.py METHOD_SPECS)."""
    rows = [(f"`{spec.name}`" if i == 0 else "", f"`{name}`", shape, text)
            for spec in METHOD_SPECS for i, (name, shape, text) in enumerate(spec.tensors)]
    return _table(("method", "tensor", "shape", "dtype, layout, meaning"), ("l", "l", "l", "l"), rows)


def presets_table() -> str:
    """Every MLAConfig preset's dimensions, read from the configs."""
    rows = []
    for name in PRESETS:
        c = MLAConfig.preset(name)
        rs = c.rope_scaling
        yarn = f"x{rs['factor']:g} past {rs['original_max_position_embeddings']:,}" if rs else "-"
        indexer = (f"{c.index_n_heads} x {c.index_head_dim}, top-{c.index_topk}"
                   + (", interleaved RoPE" if c.indexer_rope_interleave else "")) if c.index_topk else "-"
        rows.append((f"`{name}`", c.num_attention_heads, c.hidden_size, c.q_lora_rank or "-",
                     f"{c.kv_lora_rank} + {c.qk_rope_head_dim}", f"{c.qk_nope_head_dim} / {c.v_head_dim}", yarn,
                     c.num_hidden_layers, indexer))
    return _table(("preset", "heads", "hidden", "q_lora", "kv_lora + rope", "qk_nope / v", "YaRN", "layers",
                   "indexer (heads x dim, top-k)"), ("l", "r", "r", "r", "r", "r", "l", "r", "l"), rows)


#: Section name -> the function writing its body.
SECTIONS: dict[str, Callable[[], str]] = {
    "options": options_table,
    "support_matrix": support_matrix_table,
    "tolerances": tolerances_table,
    "op_sections": op_sections_table,
    "op_tolerances": op_tolerances_table,
    "kv_codecs": codecs_table,
    "presets": presets_table,
    "op_methods": op_methods_table,
    "op_tensors": op_tensors_table,
}


# --------------------------------------------------------------------------- rewriting the files


def render(text: str, sections: tuple[str, ...] | None = None) -> tuple[str, list[str]]:
    """``text`` with every generated section rewritten, and the names of the sections that changed.

    ``sections``: the sections the text must hold (a file's entry in :data:`FILES`); None: the ones its markers
    name (at least one). A ValueError when one of ``sections`` has no markers, or a marker names a section that is
    unknown or not among ``sections``.
    """
    found = [m.group("name") for m in _BLOCK_RE.finditer(text)]
    expected = tuple(sections) if sections is not None else tuple(n for n in found if n in SECTIONS)
    unknown = [n for n in found if n not in SECTIONS]
    elsewhere = [n for n in found if n in SECTIONS and n not in expected]
    missing = [n for n in expected if n not in found] if sections is not None else ([] if found else ["NAME"])
    if unknown or elsewhere or missing:
        owner = {n: f for f, names in FILES.items() for n in names}
        parts = ([f"unknown section(s) {', '.join(unknown)} (known: {', '.join(SECTIONS)})"] if unknown else []) + (
            [f"section(s) {', '.join(elsewhere)} belong to " + ", ".join(sorted({owner[n] for n in elsewhere}))]
            if elsewhere else []) + (
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


def sections_for(path: Path) -> tuple[str, ...] | None:
    """The sections :data:`FILES` assigns to a file at ``path`` (matched on its last path parts: a copy of
    docs/tolerances.md anywhere holds the tolerances), or None for a file FILES does not name."""
    parts = Path(path).parts
    for rel, names in FILES.items():
        rel_parts = Path(rel).parts
        if parts[-len(rel_parts):] == rel_parts:
            return names
    return None


def update(paths: list[Path] | None = None, *, check: bool) -> tuple[int, list[str], list[str]]:
    """Rewrite the generated sections of ``paths`` (None: every file of :data:`FILES` in the source checkout), or
    with ``check`` only compare them. Returns (exit status, lines for stdout, lines for stderr): 1 when a checked
    section differs from the code. A ValueError naming the file for a file that cannot be read or whose markers
    are wrong (and for paths=None in an installed wheel, which ships none of these files)."""
    if paths is None:
        if CHECKOUT is None:
            raise ValueError("markers.md and docs/ belong to a source checkout of mla-conformance, and this is an "
                             "installed one: pass --path FILE")
        paths = [CHECKOUT / rel for rel in FILES]
    out: list[str] = []
    err: list[str] = []
    rc = 0
    for path in map(Path, paths):
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"{path}: cannot read it ({exc.strerror or exc})") from None
        try:
            new, stale = render(text, sections_for(path))
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
        names = ", ".join(m.group("name") for m in _BLOCK_RE.finditer(text))
        if new == text:
            out.append(f"{path}: generated sections up to date ({names})")
        elif check:
            err.append(f"{path}: stale generated section(s): {', '.join(stale) or 'marker lines'}; "
                       f"regenerate with `{REGENERATE}`")
            rc = 1
        else:
            path.write_text(new, encoding="utf-8")
            out.append(f"{path}: rewrote {', '.join(stale) or 'marker lines'}")
    return rc, out, err


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="python tools/docs.py", description=(
        "Rewrite the tables between '<!-- generated: NAME (...) -->' and '<!-- end generated -->' from the plugin's "
        "options, TOLERANCES and OP_TOLERANCES, the op suite's sections, CODECS + ERROR_BOUNDS, the presets, the op "
        "methods and the kernel support matrix, in " + ", ".join(FILES) + " of this checkout (or the files given); "
        "with --check, change nothing and exit 1 naming the stale sections."))
    p.add_argument("--check", action="store_true", help="exit 1 when a generated section differs from the code")
    p.add_argument("--path", action="append", metavar="FILE",
                   help="a markdown file to rewrite (repeatable; default: every file above, in this checkout)")
    args = p.parse_args(argv)
    try:
        rc, out, err = update([Path(x) for x in args.path] if args.path else None, check=args.check)
    except ValueError as exc:  # a file that cannot be read, wrong markers, or no checkout: one line, exit 2
        print(f"python tools/docs.py: {exc}", file=sys.stderr)
        return 2
    for line in out:
        print(line)
    for line in err:
        print(line, file=sys.stderr)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
