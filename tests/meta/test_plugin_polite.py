"""The plugin loads in every pytest run of the environment it is installed in (entry point ``pytest11``), so
it must leave other projects alone: a foreign project with its own ``backend`` fixture and a
``benchmark``-marked test collects and passes unchanged, and nothing of the suite (torch, backends, the
header, the summary section) is imported or printed for it."""

import sys

import pytest

pytest_plugins = ["pytester"]
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

code = pytest.main(["-p", "no:cacheprovider", "-rA"])
print(f"POLITE exit={int(code)} torch={'torch' in sys.modules} "
      f"plugin={'mla_conformance.pytest_plugin' in sys.modules}")
'''


def test_foreign_project_with_its_own_backend_fixture(pytester):
    pytester.makepyfile(test_foreign=FOREIGN_TESTS)
    pytester.makeini("[pytest]\n")  # its own rootdir and configuration, not this repository's
    result = pytester.run(sys.executable, "-c", RUN, timeout=120)
    out = "\n".join(result.outlines + result.errlines)
    assert "POLITE exit=0 torch=False plugin=True" in out, out[-3000:]
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed") == 3 and "deselected" not in outcomes, out[-3000:]
    assert "test_backend[1]" in out and "test_backend[2]" in out, out[-3000:]
    # no header lines, no summary section: only pytest's own "plugins:" line names the plugin
    assert not [line for line in out.splitlines() if "mla-conformance" in line and not line.startswith("plugins:")], \
        out[-3000:]
