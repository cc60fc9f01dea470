"""Repository-level pytest configuration.

The suite's options, markers, backend parametrisation and report header come from the installed plugin
(``mla_conformance.pytest_plugin``, entry point ``pytest11``), so they work from any directory; this file only
holds what is specific to this checkout: where the fixtures and goldens live, ``pytester`` for the tests that
run the suite inside a test (tests/meta/harness.py), the expectation file of the installed transformers release,
and the OpenMP wait policy of the timed steps (mla_conformance.perf.cpu_wait).
"""

from pathlib import Path

import pytest

from mla_conformance.perf import cpu_wait

#: before anything imports torch: the CPU threads of the timed steps (the benchmarks) wait passively, as `bench`'s do
cpu_wait.prefer_passive_wait()

#: pytester: the suite-in-suite runs of tests/meta (a top-level conftest is the one place pytest takes it from)
pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parent


def pytest_configure(config):
    _expect_installed_transformers(config)


#: transformers releases whose known failures of hf-transformers are listed (suites/expectations/)
EXPECTATIONS = ROOT / "suites" / "expectations"


def _expect_installed_transformers(config) -> None:
    """The repository's own run holds hf-transformers to the expectation file of the installed transformers
    release (suites/expectations/transformers-<major>.<minor>.txt: its known defects, xfail with their evidence; for
    a release not listed, the newest listed one below it: :func:`expectation_file`), where no --mla-expect was given;
    CI's release matrix passes its files itself. Applied to the collected tests by
    :func:`pytest_collection_modifyitems`, silently where a line matches none (a partial run)."""
    backends = config.getoption("--mla-backend", None)
    if config.getoption("--mla-expect", None) or not runs_suites(config) or (
            backends and "hf-transformers" not in backends):
        return
    try:
        from importlib.metadata import version
        installed = _release(version("transformers"))
    except Exception:  # transformers not installed (or an unreadable version): nothing to expect
        return
    path = expectation_file(installed)
    if path is not None:
        config.stash[_EXPECTED] = path


def _release(text: str) -> tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def expectation_file(installed: tuple[int, int]) -> Path | None:
    """The expectation file of the newest listed release at or below ``installed``: a release's defects stand
    until a later release is listed (one that fixed them shows XPASS, never a failure); None below the oldest."""
    listed = {}
    for path in EXPECTATIONS.glob("transformers-*.txt"):
        try:
            listed[_release(path.stem.removeprefix("transformers-"))] = path
        except ValueError:
            continue
    at_or_below = [v for v in listed if v <= installed]
    return listed[max(at_or_below)] if at_or_below else None


_EXPECTED = pytest.StashKey[Path]()


def pytest_collection_modifyitems(config, items):
    path = config.stash.get(_EXPECTED, None)
    if path is None:
        return
    from mla_conformance.pytest_plugin.selection import apply_expectations  # the plugin's own, as --mla-expect

    apply_expectations(path, items, warn_unmatched=False)


def runs_suites(config) -> bool:
    """The session's paths include this checkout's suites/ (or a directory above it: the default run)."""
    suites = ROOT / "suites"
    if not config.args:
        return True
    for arg in config.args:
        path = (Path(config.invocation_params.dir) / arg.split("::")[0]).resolve()
        if path == suites or suites in path.parents or path in suites.parents:
            return True
    return False


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    return ROOT / "fixtures"
