"""pytest plugin (entry point ``pytest11``): the suite's options, markers and hooks; the work is done by
:mod:`.selection` (what runs), :mod:`.session` (the results), :mod:`.terminal` (what is printed),
:mod:`.footprint` (nothing left in the user's directory), :mod:`.isolation` (timeouts, crashes, CUDA faults) and
:mod:`.sentinel` (a serial pytest that dies names its test).

Options::

    --mla-backend SPEC     backend under test (repeatable; default: every built-in)
    --mla-op SPEC          op under test (the kernel-level op contract, mla_conformance.contract.op; repeatable;
                           default: mla_conformance.contract.op.DEFAULT_OPS)
    --mla-device DEV       cpu / cuda / cuda:N (default: cuda when available, else cpu)
    --mla-checkpoint DIR   a real DeepSeek checkpoint for the needs_checkpoint tests
    --mla-results FILE     write every test's outcome and measured figures as JSON (used by `run`)
    --mla-expect FILE      known failures (node-id prefix and reason per line): xfail, XPASS reported
    --mla-timeout SECONDS  bound on each suite test (default 900 s; mla_conformance.pytest_plugin.isolation)
    --mla-threads N        torch CPU threads per process running suite tests (default 1)
    --mla-triton-emulation on|off
                           under TRITON_INTERPRET=1, Triton's interpreter given a GPU's tl.dot and casts (default
                           on: mla_conformance.impl.ops.triton_faithful); off: as triton ships it, for comparison
    --mla-engine SPEC      a serving engine for suites/test_engine.py (ENGINE[:key=value,...]; docs/engines.md)

Any test that takes the ``mla_backend`` fixture runs once per backend, and the backend's name is the
test id's parameter, e.g. ``test_cache_bytes.py::test_seed_table[reference-absorbed]``; any test that takes
``mla_op`` runs once per op (``test_op_numerics.py::test_out_lse_vs_oracle[reference-op-float32]``). The
fixtures are namespaced (``mla_backend``, ``mla_op``, ``mla_figures``, ``mla_device``, ``mla_checkpoint``).

Which tests run: with neither ``--mla-backend`` nor ``--mla-op`` the layer tests run the default backends
and the op tests the default ops; ``--mla-backend`` alone deselects the op tests, ``--mla-op`` alone the
layer tests (one summary line says how many and why); both options run both.

The plugin loads in every pytest run of the environment it is installed in, so it stays out of the way of
other projects: it parametrises only tests that request ``mla_backend`` or ``mla_op``, and it imports torch
and resolves backends, ops and the device only when an ``--mla-*`` option is given, the run's paths cover
this suite, or a test requesting one of its fixtures is collected. Another project's own ``backend``
fixture, ``benchmark`` tests and failure tracebacks are left alone.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# the checks assert with bare `assert`s: rewritten wherever the package is installed from (a wheel, an editable
# install run from outside the checkout), so their failures show the compared values
pytest.register_assert_rewrite("mla_conformance.checks")

from mla_conformance.pytest_plugin import footprint, isolation, selection, terminal
from mla_conformance.pytest_plugin.session import ResultsSession, is_failure, new_figures, sync_figures

#: plugin modules registered with this one (pytest honours ``pytest_plugins`` in an entry-point plugin)
pytest_plugins = ["mla_conformance.pytest_plugin.generated"]

#: The suite's markers, registered wherever the suites run (an installed wheel has no pyproject.toml; with
#: ``--strict-markers`` a run through ``--pyargs`` from any directory knows them). This table is their one owner.
MARKERS = (
    "mla_section(name): the report section a conformance test's results belong to (recorded in the results "
    "JSON; the report finds its rows by section, never by test name)",
    "requires_kernel(kernel_id): gate a test on a kernel of the support matrix (e.g. flashmla/dense_decode); skips "
    "with a sentence naming the kernel, the architectures it needs and this device",
    "needs_checkpoint: needs --mla-checkpoint DIR (a real DeepSeek-V2/V3 checkpoint); skips with a reason otherwise",
    "benchmark: decode timings with pytest-benchmark; deselected by default, run with `-m benchmark "
    "--benchmark-only`",
    "distributed: layer cases across W > 2 spawned ranks (suites/test_distributed.py, --mla-world-size); .ci/run "
    "runs W = 4 and 8",
    "slow: long-running conformance checks (large presets, long contexts); included in the default run unless "
    "deselected",
)


def pytest_addoption(parser):
    group = parser.getgroup("mla-conformance", "MLA conformance suite")
    group.addoption("--mla-backend", action="append", default=None, metavar="SPEC",
                    help="backend under test: a built-in name, package.module:attr or path/file.py:attr "
                         "(repeatable; default: every built-in backend)")
    group.addoption("--mla-op", action="append", default=None, metavar="SPEC",
                    help="op under test (the kernel-level op contract, mla_conformance.contract.op): a built-in name, "
                         "package.module:attr or path/file.py:attr (repeatable; default: the built-in "
                         "reference-op). --mla-op alone runs the op tests only, --mla-backend alone the layer "
                         "tests only, both run both")
    group.addoption("--mla-device", default=None, metavar="DEV",
                    help="device for the checks: cpu, cuda or cuda:N (default: cuda when available, else cpu)")
    group.addoption("--mla-checkpoint", default=None, metavar="DIR",
                    help="a real DeepSeek-V2/V3 checkpoint directory (safetensors) for needs_checkpoint tests")
    group.addoption("--mla-results", default=None, metavar="FILE",
                    help="write each test's outcome and measured figures to FILE as JSON")
    group.addoption("--mla-expect", action="append", default=None, metavar="FILE",
                    help="expectation file: known failures, one node-id prefix and its reason per line; listed "
                         "tests become xfail, a listed test that passes is reported (XPASS), an unmatched line warns")
    group.addoption("--mla-timeout", type=float, default=None, metavar="SECONDS",
                    help="bound on each suite test (setup + call + teardown; default "
                         f"{isolation.DEFAULT_TIMEOUT_S:g} s, 0 = none): past it the test is an error 'timed out after N s' "
                         "with every thread's stack; a hang in native code ends the process (under xdist the "
                         "worker is replaced and the run goes on)")
    group.addoption("--mla-threads", type=int, default=None, metavar="N",
                    help="torch CPU threads in each process running suite tests (default: 1 in an xdist worker, "
                         "so -n N workers do not oversubscribe the cores; torch's own count in a serial run; "
                         "mla-conformance run passes 1, so a report's figures do not depend on -n)")
    group.addoption("--mla-triton-emulation", choices=("on", "off"), default="on", metavar="on|off",
                    help="under TRITON_INTERPRET=1, Triton's CPU interpreter computes tl.dot and casts as a GPU "
                         "does: float32 operands cut to TF32 unless input_precision='ieee', bfloat16 / float16 "
                         "operands widened with float32 sums, float32 -> bfloat16 rounded to nearest even "
                         "(default on; docs/triton.md); off: the interpreter as triton ships it, for comparison")
    group.addoption("--mla-engine", action="append", default=None, metavar="SPEC",
                    help="a serving engine for suites/test_engine.py: ENGINE[:key=value,...], e.g. "
                         "vllm:attention_backend=CPU_MLA,dtype=float32 (repeatable; docs/engines.md); without it "
                         "the engine tests skip")
    group.addoption("--mla-world-size", type=int, action="append", default=None, metavar="W",
                    help="world size of the distributed layer cases (suites/test_distributed.py: W spawned ranks "
                         "on gloo; repeatable; default 2; W > 2 carry the `distributed` marker)")


def pytest_load_initial_conftests(early_config, parser, args):
    footprint.block_cache(early_config)


def pytest_configure(config):
    footprint.benchmark_storage(config)  # first: pytest-benchmark creates its storage in its own pytest_configure
    for line in MARKERS:
        config.addinivalue_line("markers", line)
    # nothing is imported or resolved here unless an --mla option asks for it: bad options are a usage error
    # before any test runs; everything else waits until a test of the suite is collected
    selection.check_options(config)
    if os.environ.get("TRITON_INTERPRET") == "1" and config.getoption("--mla-triton-emulation") == "on" and \
            selection.runs_suite(config):  # the faithful tier: only the suite's runs, only under the interpreter
        # imports triton: only under the interpreter, never in a plain run
        from mla_conformance.impl.ops import triton_faithful
        triton_faithful.install()
    config.pluginmanager.register(_Recorder(ResultsSession.of(config)), "mla-conformance-recorder")


def pytest_report_header(config):
    if not selection.runs_suite(config):
        return None  # another project's run (or not yet known): see pytest_report_collectionfinish
    selection.engaged(config)["header"] = True
    return terminal.header_lines(config)


def pytest_report_collectionfinish(config, items):
    if selection.engaged(config).get("header") or not any(selection.is_suite_item(i) for i in items):
        return None
    selection.engaged(config)["header"] = True
    return terminal.header_lines(config)


def pytest_generate_tests(metafunc):
    selection.parametrize(metafunc)


def pytest_collection_modifyitems(config, items):
    selection.select(config, items)


def pytest_sessionstart(session):
    ResultsSession.of(session.config).open_fault_file()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    results = ResultsSession.of(item.config)
    if selection.is_suite_item(item):
        results.sentinel.started(item.config, item.nodeid)
    if not results.arm(item):
        yield
        return
    try:
        yield
    finally:
        results.disarm()


def pytest_runtest_setup(item):
    selection.gate(item)


@pytest.fixture(scope="session")
def mla_device(request) -> str:
    """The device the checks run on (--mla-device)."""
    return selection.device_of(request.config)


@pytest.fixture
def mla_checkpoint(request) -> Path | None:
    ckpt = request.config.getoption("--mla-checkpoint")
    return Path(ckpt) if ckpt else None


@pytest.fixture
def mla_figures(request):
    """The test's measured figures (a :class:`mla_conformance.schema.Figures`: only declared keys); they
    go into the --mla-results JSON and reports -- failing tests' too (the checks fill it before they raise)."""
    return new_figures(request.node)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    sync_figures(item)  # before the report copies the test's user_properties
    outcome = yield
    rep = outcome.get_result()
    if rep.failed and call.when == "call" and selection.is_suite_item(item) and \
            is_failure(call.excinfo) and not hasattr(rep, "wasxfail"):
        # a conformance verdict: the message says it all; show it with short frames (the suite's own
        # helpers hide themselves with __tracebackhide__), not pages of suite source
        rep.longrepr = item._repr_failure_py(call.excinfo, style="short")
    ResultsSession.of(item.config).entry_of(item, call, rep)


def pytest_report_teststatus(report, config):
    fault = getattr(report, "mla_fault", None)
    if fault is not None and report.failed:
        return "error", "E", ("TIMEOUT" if fault.get("kind") == "timeout" else "CRASHED")
    return None


def pytest_collection_finish(session):  # a serial pytest: what it is to run, journalled (`run` names what it missed)
    ResultsSession.of(session.config).collected(item.nodeid for item in session.items)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):  # xdist controller: where each worker's fault file and benchmarks go
    results = ResultsSession.of(node.config)
    results.configure_node(node)
    footprint.hand_to_worker(node)
    results.worker_event(node, "starting")


@pytest.hookimpl(optionalhook=True)
def pytest_testnodeready(node):
    ResultsSession.of(node.config).worker_event(node, "ready")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    results = ResultsSession.of(node.config)
    results.collected(ids)
    results.worker_event(node, "collected", tests=len(ids))


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    ResultsSession.of(node.config).worker_down(node, error)


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched):
    node = getattr(report, "node", None)
    if getattr(node, "config", None) is not None:
        ResultsSession.of(node.config).crashed(crashitem, report, node)


class _Recorder:
    """The hooks that get no config (tests started, reported, finished), for this process's session."""

    def __init__(self, results: ResultsSession):
        self.results = results

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_logstart(self, nodeid, location):
        self.results.started(nodeid)

    def pytest_runtest_logreport(self, report):
        self.results.reported(report)

    @pytest.hookimpl(trylast=True)  # after xdist has sent the test's reports and its logfinish
    def pytest_runtest_logfinish(self, nodeid, location):
        self.results.done(nodeid)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    terminal.summary(terminalreporter, config)


def pytest_sessionfinish(session, exitstatus):
    results = ResultsSession.of(session.config)
    results.sentinel.finish()
    results.finish(exitstatus)
