"""Repository-level pytest configuration.

The suite's options, markers, backend parametrisation and report header come from the installed plugin
(``mla_conformance.pytest_plugin``, entry point ``pytest11``), so they work from any directory; this file only
holds what is specific to this checkout: where the fixtures and goldens live, ``pytester`` for the tests that
run the suite inside a test (tests/meta/harness.py), xdist's grouping of their tests, and the OpenMP wait policy
of the timed steps (mla_conformance.perf.cpu_wait).
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
    """Under xdist (``-n N``), tests marked ``xdist_group`` go to one worker (``--dist loadgroup`` is ``load``
    for every unmarked test), so the tests of a meta module's run of the suite do not wait on the worker making
    it (the run is made once either way: tests/meta/harness.py SuiteRuns). The controller schedules by group;
    a worker, which parses only the command line, is told to name its tests by group. With pytest 9.2 and
    xdist 3.8 the naming has no effect (pytest-dev/pytest-xdist#1386) until xdist's fix is released."""
    if getattr(config.option, "dist", "no") == "load":
        config.option.dist = "loadgroup"
    if getattr(config, "workerinput", {}).get("loadgroup"):
        config.option.loadgroup = True


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    if node.config.getoption("dist") == "loadgroup":
        node.workerinput["loadgroup"] = True


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    return ROOT / "fixtures"
