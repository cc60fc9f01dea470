"""The plugin as a user meets it. It loads in every pytest run of the environment it is installed in (entry point
``pytest11``), so it must leave other projects alone: a foreign project with its own ``backend`` fixture and a
``benchmark``-marked test collects and passes unchanged, and nothing of the suite (torch, backends, the header,
the summary section) is imported or printed for it. A run of the shipped suites from any directory
(``pytest --pyargs mla_conformance.suites``) knows the suite's markers under ``--strict-markers`` and writes
nothing into that directory. Skips are listed once; a figure the report's schema does not declare is refused."""

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from . import harness
from .harness import user_env

pytestmark = pytest.mark.meta

FOREIGN_TESTS = '''
import pytest


@pytest.fixture(params=[1, 2])
def backend(request):
    return request.param


def test_backend(backend):
    assert backend in (1, 2)


@pytest.mark.benchmark
def test_their_benchmark():
    assert True
'''

RUN = '''
import sys
import pytest

code = pytest.main(["-rA"])
print(f"POLITE exit={int(code)} torch={'torch' in sys.modules} "
      f"plugin={'mla_conformance.pytest_plugin' in sys.modules}")
'''


def _foreign_process(project: Path) -> tuple[int, str]:
    """The foreign project run in a fresh interpreter (torch must not be imported there): (exit code, output)."""
    (project / "test_foreign.py").write_text(FOREIGN_TESTS, encoding="utf-8")
    (project / "pytest.ini").write_text("[pytest]\n", encoding="utf-8")  # its own rootdir and configuration
    proc = subprocess.run([sys.executable, "-c", RUN], cwd=project, capture_output=True, text=True, timeout=120,
                          env=user_env())
    return proc.returncode, proc.stdout + proc.stderr



@pytest.fixture(scope="module")
def foreign_run(tmp_path_factory) -> tuple[int, str]:
    return _foreign_process(tmp_path_factory.mktemp("foreign"))


def test_foreign_project_with_its_own_backend_fixture(foreign_run):
    _, out = foreign_run
    assert "POLITE exit=0 torch=False plugin=True" in out, out[-3000:]
    assert "3 passed" in out and "deselected" not in out, out[-3000:]
    assert "test_backend[1]" in out and "test_backend[2]" in out, out[-3000:]
    # no header lines, no summary section: only pytest's own "plugins:" line names the plugin
    assert not [line for line in out.splitlines() if "mla-conformance" in line and not line.startswith("plugins:")], \
        out[-3000:]


#: one cheap test of the shipped suites (its module imports torch; the rest of the run is pytest's own)
PYARGS = ("--pyargs", "mla_conformance.suites.test_cache_bytes", "-k", "test_seed_table and reference-absorbed")


def test_pyargs_from_anywhere_writes_nothing_there(pytester, monkeypatch):
    """`pytest --pyargs mla_conformance.suites...` in a directory of the user's (no pytest configuration
    there: pytest's rootdir and cache directory are that directory) runs under --strict-markers and leaves the
    directory as it was: no .pytest_cache (the cache plugin is not loaded for it), no .benchmarks. In this
    process (pytest configures a fresh session from the command line as a new process would)."""
    user = pytester.mkdir("my-project")
    (user / "notes.txt").write_text("mine\n", encoding="utf-8")
    monkeypatch.chdir(user)
    result = harness.pytest_inprocess(pytester, *PYARGS, "--strict-markers", "--mla-device", "cpu", "-n", "0")
    out = "\n".join(result.outlines + result.errlines)
    assert result.ret == 0 and result.parseoutcomes().get("passed") == 1, out[-3000:]
    assert f"rootdir: {user}" in out, out[-3000:]  # the case of the bug: pytest rooted in the user's directory
    assert sorted(p.name for p in user.iterdir()) == ["notes.txt"], (sorted(p.name for p in user.iterdir()),
                                                                     out[-3000:])


def test_pyargs_keeps_the_cache_when_asked_for(pytester, monkeypatch):
    """--lf (or any cache option) asks for pytest's cache: it is loaded, and written where pytest keeps it."""
    user = pytester.mkdir("my-project")
    monkeypatch.chdir(user)
    result = harness.pytest_inprocess(pytester, *PYARGS, "--lf", "--mla-device", "cpu", "-n", "0")
    assert result.ret == 0, "\n".join(result.outlines[-40:])
    assert (user / ".pytest_cache").is_dir()


SKIPPING = '''
import pytest


@pytest.mark.parametrize("k", [1, 2, 3])
def test_declines(mla_figures, k):
    pytest.skip("my-mla does not declare the thing")


def test_other(mla_figures):
    pytest.skip("another reason")
'''


def test_skips_are_listed_once(pytester):
    """The plugin's block groups the skips by reason with their counts; pytest's own -rs lines list every skip,
    and then the block leaves them out. The project's addopts summarise failures and errors only."""
    pytester.makepyfile(test_skipping=SKIPPING)
    got = harness.pytest_inprocess(pytester, "-n", "0", "-rfE")
    out = "\n".join(got.outlines)
    assert "mla-conformance skips by reason" in out and "3 my-mla does not declare the thing" in out, out
    assert "1 another reason" in out and "SKIPPED [" not in out, out
    got = harness.pytest_inprocess(pytester, "-n", "0", "-rs")
    out = "\n".join(got.outlines)
    assert out.count("my-mla does not declare the thing") == 1 and "SKIPPED [3]" in out, out
    assert "skips by reason" not in out, out
    addopts = tomllib.loads((harness.ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["pytest"][
        "ini_options"]["addopts"].split()
    chars = "".join(a[2:] for a in addopts if a.startswith("-r"))
    assert chars and not set(chars) & set("sa"), f"addopts {addopts}: -r lists the skips the plugin's block lists"


FIGURES = '''
def test_declared(mla_figures):
    mla_figures["case"] = "B=1"


def test_undeclared(mla_figures):
    mla_figures["my_own_number"] = 1.0
'''


def test_figures_are_the_schemas(pytester):
    """mla_figures takes only the figure keys mla_conformance.schema declares: another key is an error
    naming the key and where to declare it; declared figures reach the results."""
    pytester.makepyfile(test_figs=FIGURES)
    results = pytester.path / "results.json"
    got = harness.pytest_inprocess(pytester, "-n", "0", "--mla-device", "cpu",
                                   "--mla-results", str(results))
    run = harness.SuiteRun(int(got.ret), "\n".join(got.outlines), json.loads(results.read_text()))
    assert run.result("test_figs.py::test_declared")["figures"] == {"case": "B=1"}
    reason = run.assert_error("test_figs.py::test_undeclared", "UndeclaredFigure")
    assert "'my_own_number' is not declared" in reason and "mla_conformance/schema.py" in reason, reason
