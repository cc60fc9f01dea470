"""Repository-level pytest configuration.

The suite's options, markers, backend parametrisation and report header come from the installed plugin
(``mla_conformance.pytest_plugin``, entry point ``pytest11``), so they work from any directory; this file only
holds what is specific to this checkout: where the fixtures and goldens live, ``pytester`` for the tests that
run the suite inside a test (tests/meta/harness.py), and xdist's grouping.
"""

from pathlib import Path

import pytest

#: pytester: the suite-in-suite runs of tests/meta (a top-level conftest is the one place pytest takes it from)
pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parent


def pytest_configure(config):
    """Under xdist (``-n N``), tests marked ``xdist_group`` go to one worker: a meta module's run of the suite
    (the kill matrix, the op meta session) then happens once per session, not once per worker. ``--dist
    loadgroup`` is ``load`` for every unmarked test."""
    if getattr(config.option, "dist", "no") == "load":
        config.option.dist = "loadgroup"


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    return ROOT / "fixtures"
