"""The conformance suites ``run`` and ``test`` drive: the installed ``mla_conformance.suites`` (the checkout's
suites/ in an editable install)."""

from __future__ import annotations

from pathlib import Path

from mla_conformance.errors import MLAInputError
from mla_conformance.resources import suites_dir


def find_suites() -> Path:
    """The installed suites directory; MLAInputError when it lacks the suites."""
    suites = suites_dir()
    if not (suites / "test_cache_bytes.py").is_file():
        raise MLAInputError(f"{suites}: the installed suites lack test_cache_bytes.py; reinstall mla-conformance "
                            "(or pass --suites DIR)")
    return suites
