"""Compute capabilities and versions as data: ``"9.0"``, ``"sm_90a"``, ``(12, 0)`` -> ``(major, minor)``.

The one parser of a capability the user types (``matrix --capability``, ``budget --capability``) or a source
states, and the spellings the rest of :mod:`mla_conformance.arch` prints (``"9.0"``, ``"SM90"``).
"""
from __future__ import annotations

import re
from typing import Any

#: (major, minor), e.g. (9, 0)
Capability = tuple[int, int]

_CAP_RE = re.compile(r"^\s*(\d{1,2})\s*\.\s*(\d)\s*$")
_SM_RE = re.compile(r"^\s*(?:sm|compute)_?(\d{2,3})[af]?\s*$", re.IGNORECASE)
_VERSION_RE = re.compile(r"^\s*\d+\.\d+(\.\d+)?\s*$")


def parse_capability(value: Any) -> Capability:
    """``(9, 0)``, ``"9.0"``, ``"sm_90"``, ``"sm90a"``, ``"SM120"`` -> ``(major, minor)``.

    Raises ValueError for anything else (the message says what was expected).
    """
    if isinstance(value, (tuple, list)) and len(value) == 2 and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        return (int(value[0]), int(value[1]))
    if isinstance(value, str):
        m = _CAP_RE.match(value)
        if m:
            return (int(m.group(1)), int(m.group(2)))
        m = _SM_RE.match(value)
        if m:
            digits = m.group(1)
            return (int(digits[:-1]), int(digits[-1]))
    raise ValueError(f"expected a compute capability such as 9.0, 12.0 or sm_100, got {value!r}")


def cap_str(cap: Capability) -> str:
    """``(9, 0)`` -> ``"9.0"``."""
    return f"{cap[0]}.{cap[1]}"


def sm_name(cap: Capability) -> str:
    """``(9, 0)`` -> ``"SM90"``."""
    return f"SM{cap[0]}{cap[1]}"


def parse_version(text: str | None) -> tuple[int, int] | None:
    """``"12.8"``, ``"12.8.1"`` -> ``(12, 8)``; None for None, ``""`` or no leading ``X.Y``."""
    if not text:
        return None
    m = re.match(r"^\s*(\d+)\.(\d+)", str(text))
    return (int(m.group(1)), int(m.group(2))) if m else None


def parse_cuda_version(text: str) -> str:
    """A CUDA version as typed (``"12.8"``, ``"12.8.1"``) -> ``"12.8"``; ValueError naming the text otherwise."""
    ver = parse_version(text)
    if ver is None or not _VERSION_RE.match(text):
        raise ValueError(f"expected a CUDA version such as 12.8, got {text!r}")
    return f"{ver[0]}.{ver[1]}"


def version_str(ver: tuple[int, int] | None) -> str | None:
    """``(12, 8)`` -> ``"12.8"``; None stays None."""
    return None if ver is None else f"{ver[0]}.{ver[1]}"
