"""``mla-conformance docs``: rewrite the generated tables of markers.md and docs/*.md from the code that owns them
(:func:`mla_conformance.report.docs.update`); ``--check`` changes nothing and exits 1 naming the stale ones."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from mla_conformance.cli.common import UserError
from mla_conformance.report.docs import FILES, update


def add_cli(sub: Any) -> None:
    """Register ``mla-conformance docs``."""
    p = sub.add_parser(
        "docs",
        help="rewrite the generated tables of markers.md and docs/ (options, tolerances, op sections, codecs, "
             "support matrix) from the code",
        description="Rewrite the tables between '<!-- generated: NAME (...) -->' and '<!-- end generated -->' from "
                    "the plugin's options, TOLERANCES and OP_TOLERANCES, the op suite's sections, CODECS + "
                    "ERROR_BOUNDS and the kernel support matrix, in " + ", ".join(FILES) + " of this checkout (or "
                    "the files given); with --check, change nothing and exit 1 naming the stale sections.",
    )
    p.add_argument("--check", action="store_true", help="exit 1 when a generated section differs from the code")
    p.add_argument("--path", action="append", metavar="FILE",
                   help="a markdown file to rewrite (repeatable; default: every file above, in this checkout)")
    p.set_defaults(func=run)


def run(args) -> int:
    try:
        rc, out, err = update([Path(p) for p in args.path] if args.path else None, check=args.check)
    except ValueError as exc:  # a file that cannot be read, wrong markers, or no checkout: one line, exit 2
        raise UserError(str(exc)) from None
    for line in out:
        print(line)
    for line in err:
        print(line, file=sys.stderr)
    return rc
