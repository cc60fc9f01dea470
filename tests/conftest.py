"""tests/ holds the tool's own tests (codec math, paging internals, the support matrix, the CLI and reports,
and tests/meta: the suite testing itself with its broken and independent backends). They choose their own
backends and ops, so with ``--mla-backend`` or ``--mla-op`` (a verdict on *your* backend or op, from suites/)
they are skipped, not run against it."""

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    given = [opt for opt in ("--mla-backend", "--mla-op") if config.getoption(opt)]
    if not given:
        return
    skip = pytest.mark.skip(reason=f"the tool's own tests (tests/) run without {' / '.join(given)}: they choose "
                                   "their own backends and ops")
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(skip)


def pytest_collection_finish(session):
    """Start the background jobs, one at a time (one core) (tests/meta/background.py) of the selected modules that declare
    ``BACKGROUND`` (job name -> callable), in a serial session only (an xdist worker runs them in its tests)."""
    if hasattr(session.config, "workerinput") or session.config.getoption("collectonly", False):
        return
    from tests.meta import background

    started = False
    modules = {item.module for item in session.items if getattr(item, "module", None) is not None}
    for module in sorted(modules, key=lambda m: m.__name__):
        jobs = getattr(module, "BACKGROUND", None)
        if jobs and not any(item.get_closest_marker("skip") for item in session.items if item.module is module):
            background.start(jobs)
            started = True
    if started and not session.config.getoption("--mla-threads", None):
        import torch  # the jobs take one core: the session keeps to one thread (figures as under -n)

        torch.set_num_threads(1)


def pytest_sessionfinish(session):
    from tests.meta import background

    background.shutdown()
