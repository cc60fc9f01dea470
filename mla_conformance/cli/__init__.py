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
#: command -> the module whose ``add_cli(sub)`` defines it (only that module is imported to run it: ``run``
#: imports no torch; ``--help`` imports them all)
COMMANDS = {
    "run": "mla_conformance.report", "merge": "mla_conformance.report",
    "test": "mla_conformance.cli.test",
    "generate": "mla_conformance.generation.generate", "dsa-variant": "mla_conformance.generation.generate",
    "codecs": "mla_conformance.kv.codec_table",
    "matrix": "mla_conformance.arch",
    "budget": "mla_conformance.kv.budget",
    "bench": "mla_conformance.perf.bench",
    "docs": "mla_conformance.report.docs",
}
SUBCOMMAND_MODULES = tuple(dict.fromkeys(COMMANDS.values()))


from mla_conformance.errors import MLAInputError


class UserError(MLAInputError):
    """An input error reported to the user as one line, without a traceback."""


#: The preset every command defaults to (--preset).
DEFAULT_PRESET = "deepseek-v2-lite"

#: One line per preset, for --help and the README.
PRESET_NOTES = {
    "deepseek-v2-lite": "DeepSeek-V2-Lite attention: 16 heads, no q_lora, kv_lora 512, YaRN x40, 27 layers",
    "deepseek-v2": "DeepSeek-V2: 128 heads, q_lora 1536, kv_lora 512, YaRN x40, 60 layers",
    "deepseek-v3": "DeepSeek-V3: 128 heads, q_lora 1536, kv_lora 512, YaRN x40, 61 layers",
    "deepseek-v3.2": "DeepSeek-V3.2 (V3's attention dims; seed 004's KV budget) with its DSA indexer: "
                     "64 heads of 128, top-2048",
    "tiny": "4 heads, q_lora 64, kv_lora 64, YaRN x4 past 64 positions, 2 layers (fast CPU numerics)",
    "v3-mini": "V3 head dims (kv_lora 512, rope 64) with q_lora and 2 heads, YaRN x8 past 128 positions",
    "tiny-dsa": "tiny with DeepSeek Sparse Attention: indexer 4 heads of 32, top-16 (selection bites from token 17)",
}


def preset_help(default: str | None = DEFAULT_PRESET) -> str:
    """``--preset`` help: every preset name (from MLAConfig's presets), and the default."""
    from mla_conformance.model.config import PRESETS

    names = ", ".join(PRESETS)
    return f"MLAConfig preset, one of: {names}" + (f" (default: {default})" if default else "")


def check_device(device: str | None, option: str = "--device") -> str:
    """``cpu``, ``cuda`` or ``cuda:N`` that torch can use here; UserError (one line, exit 2) otherwise."""
    import torch

    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return device
    kind, _, index = device.partition(":")
    if kind != "cuda" or (index and not index.isdigit()):
        raise UserError(f"{option} {device!r}: expected cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise UserError(f"{option} {device}: torch sees no CUDA device on this host (torch {torch.__version__}, "
                        f"{build})")
    if index and int(index) >= torch.cuda.device_count():
        raise UserError(f"{option} {device}: this host has {torch.cuda.device_count()} CUDA device(s), "
                        f"cuda:0..cuda:{torch.cuda.device_count() - 1}")
    return device


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (argparse prints the one-line error and exits 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command, or of ``command`` alone (its module only is imported)."""
    from mla_conformance import __version__

    parser = argparse.ArgumentParser(
        prog="mla-conformance",
        description="Conformance suite for DeepSeek Multi-head Latent Attention (MLA) implementations.",
    )
    parser.add_argument("--version", action="version", version=f"mla-conformance {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in ((COMMANDS[command],) if command in COMMANDS else SUBCOMMAND_MODULES):
        importlib.import_module(name).add_cli(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
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
        import os

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

