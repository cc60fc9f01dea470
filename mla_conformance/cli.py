"""The ``mla-conformance`` command.

Each subcommand lives next to the code it drives and registers itself through an
``add_cli(subparsers)`` function; this module only wires them together, so a
subcommand's module is imported only when it exists.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# (module, description) in the order they appear in --help.
SUBCOMMAND_MODULES = (
    "mla_conformance.report",     # run, merge
    "mla_conformance.generate",   # generate
    "mla_conformance.codecs",     # codecs
    "mla_conformance.arch",       # matrix
    "mla_conformance.budget",     # budget
    "mla_conformance.bench",      # bench
)


from mla_conformance.errors import MLAInputError


class UserError(MLAInputError):
    """An input error reported to the user as one line, without a traceback."""


def build_parser() -> argparse.ArgumentParser:
    from mla_conformance import __version__

    parser = argparse.ArgumentParser(
        prog="mla-conformance",
        description="Conformance suite for DeepSeek Multi-head Latent Attention (MLA) implementations.",
    )
    parser.add_argument("--version", action="version", version=f"mla-conformance {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:
                continue
            raise
        add = getattr(module, "add_cli", None)
        if add is not None:
            add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
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
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as exc:  # input errors carry their own message; others too, but with a hint
        if isinstance(exc, MLAInputError):
            print(f"mla-conformance {args.command}: error: {exc}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    raise SystemExit(main())
