"""The ``mla-conformance`` command: one module per command under ``mla_conformance/cli/``, each registering its
command(s) with ``add_cli(subparsers)`` and calling into the domain module that does the work (argparse lives
in cli/ and nowhere else in the package; the domain modules import nothing from it). Running a command imports
its module only, ``--help`` imports them all, and a missing module is an ImportError.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from mla_conformance.errors import MLAInputError
from mla_conformance.perf import cpu_wait

__all__ = ["COMMANDS", "build_parser", "main"]

#: command -> the module whose ``add_cli(sub)`` defines it, in the order of --help.
COMMANDS = {
    "run": "mla_conformance.cli.run", "merge": "mla_conformance.cli.merge",
    "test": "mla_conformance.cli.test",
    "generate": "mla_conformance.cli.generate", "dsa-variant": "mla_conformance.cli.generate",
    "codecs": "mla_conformance.cli.codecs",
    "matrix": "mla_conformance.cli.matrix",
    "budget": "mla_conformance.cli.budget",
    "bench": "mla_conformance.cli.bench",
}

#: What a command's process sets before its module (and so torch) is imported: bench's timed CPU threads wait
#: passively (mla_conformance.perf.cpu_wait: a spinning thread on a shared machine stalls every op).
BEFORE_IMPORT = {"bench": cpu_wait.prefer_passive_wait}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command, or of ``command`` alone (its module only is imported)."""
    from mla_conformance import __version__  # the package root, read when the parser is built

    parser = argparse.ArgumentParser(
        prog="mla-conformance",
        description="Conformance suite for DeepSeek Multi-head Latent Attention (MLA) implementations.",
    )
    parser.add_argument("--version", action="version", version=f"mla-conformance {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in ((COMMANDS[command],) if command in COMMANDS else dict.fromkeys(COMMANDS.values())):
        importlib.import_module(name).add_cli(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in BEFORE_IMPORT:
        BEFORE_IMPORT[argv[0]]()
    parser = build_parser(argv[0] if argv else None)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("mla-conformance: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `mla-conformance budget | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as exc:  # input errors carry their own message; others too, but with a hint
        if isinstance(exc, MLAInputError):
            print(f"mla-conformance {args.command}: error: {exc}", file=sys.stderr)
            return 2
        if isinstance(exc, OSError) and exc.filename:  # a file or device the user named
            print(f"mla-conformance {args.command}: error: {exc.filename}: {exc.strerror or exc}", file=sys.stderr)
            return 2
        raise

