"""tests/ holds the tool's own tests (codec math, paging internals, the support matrix, the CLI and reports,
and tests/meta: the suite testing itself with its broken and independent backends). They choose their own
backends, so with ``--mla-backend`` (a verdict on *your* backend, from suites/) they are skipped, not run
against it."""

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--mla-backend"):
        return
    skip = pytest.mark.skip(reason="the tool's own tests (tests/) run without --mla-backend: they choose their "
                                   "own backends")
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(skip)
