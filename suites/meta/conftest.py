"""suites/meta tests the suite itself: its broken backends, the kill matrix, the CLI and reports. They
choose their own backends, so with ``--mla-backend`` (a verdict on *your* backend) they are skipped, not
run against it: ``pytest suites --mla-backend X`` is X's verdict and nothing else."""

import pytest


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--mla-backend"):
        return
    skip = pytest.mark.skip(reason="the suite's own tests (suites/meta) run without --mla-backend: "
                                   "they choose their own backends")
    for item in items:
        if "meta" in str(item.path.parent.name):
            item.add_marker(skip)
