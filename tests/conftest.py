"""tests/ holds the tool's own tests. They choose their own backends and ops, so with ``--mla-backend`` or
``--mla-op`` (a verdict on *your* backend or op, from suites/) they are skipped, not run against it.

* ``tests/test_*.py`` -- the tool's parts: codec math, paging internals, the support matrix, the oracles, the
  layout of the package (tests/layers.py: which package may import which);
* ``tests/meta/test_*.py`` -- the suite testing itself: broken implementations must fail their named test,
  independent correct ones must pass, crashes and hangs must end as verdicts;
* ``tests/meta/impls/`` -- the implementations those tests run the suite against, a folder per kind (broken,
  independent, kernel_style, faulty); the frozen base backend and op stay in tests/meta, never edited;
* inner runs of the suite: ``inner_run(key)`` (below) for the runs in other processes (tests/meta/jobs.py, in
  lanes of their own: tests/meta/background.py), ``suite_run(key, build)`` for the in-process ones
  (tests/meta/harness.py, pytester). The whole default run starts every inner run as it starts, and runs
  tests/meta last (pyproject's ``testpaths``), so the runs have most of the session on the idle core.
"""

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

#: the marker of the tool's own tests (the suite's markers are the plugin's: mla_conformance.pytest_plugin.MARKERS)
META_MARKER = "meta: the suite testing itself (broken backends must be caught, independent correct backends must pass)"
#: the Triton interpreter tier (tests/meta/test_triton_tier.py): minutes, so a tier of its own, run by .ci/run
TRITON_MARKER = ("triton_interpret: the built-in triton op through the op suite under Triton's CPU interpreter; "
                 "skipped unless selected with `-m triton_interpret`")


def pytest_configure(config):
    """The markers; and in the whole default run, where every inner run is needed, they all start now
    (tests/meta/jobs.py), before collection, in processes of their own (tests/meta/background.py)."""
    config.addinivalue_line("markers", META_MARKER)
    config.addinivalue_line("markers", TRITON_MARKER)
    if _whole_default_run(config):
        from tests.meta import background, jobs

        background.start(jobs.JOBS)
        _one_thread(config)


def pytest_collection_modifyitems(config, items):
    if "triton_interpret" not in (config.option.markexpr or ""):
        tier = pytest.mark.skip(reason="the Triton interpreter tier (minutes): run it with `pytest -m triton_interpret` "
                                       "after `pip install -e .[triton]`; .ci/run does")
        for item in items:
            if item.get_closest_marker("triton_interpret"):
                item.add_marker(tier)
    given = [opt for opt in ("--mla-backend", "--mla-op") if config.getoption(opt)]
    if not given:
        return
    skip = pytest.mark.skip(reason=f"the tool's own tests (tests/) run without {' / '.join(given)}: they choose "
                                   "their own backends and ops")
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(skip)


#: the options (by dest) of a pytest that shows something instead of running tests: --help, --markers, --fixtures,
#: --fixtures-per-test
NOT_A_RUN = ("help", "markers", "showfixtures", "show_fixtures_per_test")


def _whole_default_run(config) -> bool:
    """``pytest`` as typed: the testpaths, no selection, a serial session that runs tests."""
    opt = config.option
    return (config.args_source == pytest.Config.ArgsSource.TESTPATHS and not hasattr(config, "workerinput")
            and not getattr(opt, "numprocesses", None) and getattr(opt, "dist", "no") == "no"  # an xdist controller
            and not opt.keyword and not opt.markexpr and not getattr(opt, "deselect", None)
            and not opt.collectonly and not any(getattr(opt, dest, False) for dest in NOT_A_RUN)
            and not config.getoption("--mla-backend") and not config.getoption("--mla-op"))


def _one_thread(config) -> None:
    """The jobs take one core: the session keeps to one torch thread (figures as under -n), unless told."""
    if not config.getoption("--mla-threads", None):
        import torch

        torch.set_num_threads(1)


def pytest_collection_finish(session):
    """Start the inner runs a selected, unskipped test reads: its module's ``BACKGROUND`` = {fixture: job keys of
    tests/meta/jobs.py} names them for the tests that use that fixture. A serial session only: an xdist worker
    starts each run in the test that reads it (``inner_run``)."""
    if hasattr(session.config, "workerinput") or session.config.getoption("collectonly", False):
        return
    from tests.meta import background

    wanted = [key for item in session.items if not item.get_closest_marker("skip")
              for fixture, keys in (getattr(getattr(item, "module", None), "BACKGROUND", None) or {}).items()
              if fixture in item.fixturenames for key in keys]
    if wanted:
        background.start(wanted)
        _one_thread(session.config)


def pytest_unconfigure(config):
    from tests.meta import background

    background.shutdown()


@pytest.fixture(scope="session")
def suite_runs(request, tmp_path_factory):
    """The session's inner runs of the suite (tests/meta/harness.py), shared by the xdist workers through the
    session's base temp (each worker's is a directory of it)."""
    from tests.meta.harness import SuiteRuns

    worker = hasattr(request.config, "workerinput")
    return SuiteRuns(tmp_path_factory.getbasetemp().parent / "mla-suite-runs" if worker else None)


@pytest.fixture(scope="session")
def inner_run(suite_runs):
    """``inner_run(key)``: the result of the inner run ``tests/meta/jobs.py``'s ``JOBS[key]`` (a real
    ``mla-conformance`` or pytest process, or several), made once per session and shared by the xdist workers,
    in a process of its own (tests/meta/background.py): started when the session started (a module's
    ``BACKGROUND`` names the runs its fixtures read), else now, by the first test that asks. The one way a meta
    test reads a run of the suite in other processes; ``suite_run`` below is the in-process one (pytester)."""
    from tests.meta import background

    return lambda key: suite_runs.get(key, lambda: background.result(key))


@pytest.fixture
def suite_run(request, suite_runs):
    """``suite_run(key, build)``: the session's inner run of the suite named ``key``, made once by
    ``build(pytester)`` for the first test that asks (tests/meta/harness.py); every later test gets it as made."""
    return lambda key, build: suite_runs.get(key, lambda: build(request.getfixturevalue("pytester")))


@pytest.fixture
def mla_figures(record_property):
    """The tool's own tests are in no report, so their figures are free-form (a plain dict, kept as a test
    property). The suites' figures are what the report reads: there the plugin's fixture refuses a key that
    mla_conformance/schema.py does not declare."""
    data: dict = {}
    yield data
    if data:
        record_property("mla_figures", dict(data))
