"""Repository-level pytest configuration.

The suite's options, backend parametrisation and report header come from the installed plugin
(``mla_conformance.pytest_plugin``, entry point ``pytest11``), so they work from any directory; this file only
holds what is specific to this checkout: where the fixtures and goldens live.
"""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    return ROOT / "fixtures"
