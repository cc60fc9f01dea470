"""What several commands share: the input error, the preset option's words, argparse types, the device check."""

from __future__ import annotations

import argparse

from mla_conformance.arch.capability import parse_capability
from mla_conformance.arch.device import check_device
from mla_conformance.errors import UserError
from mla_conformance.model.config import PRESETS

__all__ = ["DEFAULT_PRESET", "UserError", "capability_arg", "check_device", "positive_int", "preset_help"]

#: The preset every command defaults to (--preset).
DEFAULT_PRESET = "deepseek-v2-lite"


def preset_help(default: str | None = DEFAULT_PRESET) -> str:
    """``--preset`` help: every preset name (from MLAConfig's presets), and the default."""
    names = ", ".join(PRESETS)
    return f"MLAConfig preset, one of: {names}" + (f" (default: {default})" if default else "")


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (argparse prints the one-line error and exits 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def capability_arg(text: str) -> tuple[int, int]:
    """argparse type: a compute capability (``9.0``, ``12.0``, ``sm_100``) as ``(major, minor)``."""
    try:
        return parse_capability(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
