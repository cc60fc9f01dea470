"""tests/ holds the tool's own tests. They choose their own backends and ops, so with ``--mla-backend`` or
``--mla-op`` (a verdict on *your* backend or op, from suites/) they are skipped, not run against it.

* ``tests/test_*.py`` -- the tool's parts: codec math, paging internals, the support matrix, the oracles, the
  layout of the package (tests/layers.py: which package may import which);
* ``tests/meta/test_*.py`` -- the suite testing itself: broken implementations must fail their named test,
  independent correct ones must pass, crashes and hangs must end as verdicts;
* ``tests/meta/impls/`` -- the implementations those tests run the suite against, a folder per kind (broken,
  independent, kernel_style, faulty); the frozen base backend and op stay in tests/meta, never edited.

A meta module's runs of the suite (pytester, tests/meta/harness.py, or a real ``mla-conformance`` process) are made
once per session through :func:`shared`: pytest-xdist's recipe for a session fixture, a file lock in the session's
base temp, so that under ``-n`` the worker that asks first makes the run and the others read it.
"""

import os
import pickle
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

#: the marker of the tool's own tests (the suite's markers are the plugin's: mla_conformance.pytest_plugin.MARKERS)
META_MARKER = "meta: the suite testing itself (broken backends must be caught, independent correct backends must pass)"
#: the Triton interpreter tier (tests/meta/test_triton_tier.py): minutes, so a tier of its own, run by .ci/run
TRITON_MARKER = ("triton_interpret: the built-in triton op through the op suite under Triton's CPU interpreter; "
                 "skipped unless selected with `-m triton_interpret`")


def pytest_configure(config):
    config.addinivalue_line("markers", META_MARKER)
    config.addinivalue_line("markers", TRITON_MARKER)


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


class _Failed:
    """What a failed build leaves in the shared file: the other workers raise it instead of building again."""

    def __init__(self, key: str, exc: BaseException):
        self.text = f"the shared run {key!r} failed in another worker: {type(exc).__name__}: {exc}"


@pytest.fixture(scope="session")
def shared(tmp_path_factory):
    """``shared(key, build)``: ``build()``'s value, made once per session. Under xdist the first worker to ask
    makes it under a file lock in the base temp's parent (which every worker's base temp shares) and pickles it
    there; the others wait for the lock and read it (pytest-xdist's documented session-fixture recipe). A build
    that raised raises again for every test that asks."""
    made: dict = {}
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    root = tmp_path_factory.getbasetemp().parent if worker else None

    def get(key: str, build):
        if key not in made:
            made[key] = _build(key, build) if root is None else _shared_build(root, key, build)
        value = made[key]
        if isinstance(value, _Failed):
            raise AssertionError(value.text)
        if isinstance(value, BaseException):
            raise value
        return value

    return get


def _build(key: str, build):
    try:
        return build()
    except Exception as exc:  # noqa: BLE001 - raised again to every test that asks
        return exc


def _shared_build(root: Path, key: str, build):
    from filelock import FileLock

    done = root / f"shared-{key}.pickle"
    with FileLock(str(done) + ".lock"):
        if done.is_file():
            return pickle.loads(done.read_bytes())
        value = _build(key, build)
        done.write_bytes(pickle.dumps(_Failed(key, value) if isinstance(value, BaseException) else value))
        return value


@pytest.fixture
def suite_run(request, shared):
    """``suite_run(key, build)``: the session's inner run of the suite named ``key``, made once by
    ``build(pytester)`` (tests/meta/harness.py) for the first test that asks; every later test gets it as made."""
    return lambda key, build: shared(key, lambda: build(request.getfixturevalue("pytester")))


@pytest.fixture
def mla_figures(record_property):
    """The tool's own tests are in no report, so their figures are free-form (a plain dict, kept as a test
    property). The suites' figures are what the report reads: there the plugin's fixture refuses a key that
    mla_conformance/schema.py does not declare."""
    data: dict = {}
    yield data
    if data:
        record_property("mla_figures", dict(data))
