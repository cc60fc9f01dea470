"""pytest plugin (entry point ``pytest11``): options, backend parametrisation, gating and the header.

Options::

    --mla-backend SPEC     backend under test (repeatable; default: every built-in)
    --mla-op SPEC          op under test (the kernel-level op contract, mla_conformance.contract.op; repeatable;
                           default: mla_conformance.contract.op.DEFAULT_OPS)
    --mla-device DEV       cpu / cuda / cuda:N (default: cuda when available, else cpu)
    --mla-checkpoint DIR   a real DeepSeek checkpoint for the needs_checkpoint tests
    --mla-results FILE     write every test's outcome and measured figures as JSON (used by `run`)
    --mla-timeout SECONDS  bound on each suite test (default 900 s; mla_conformance.pytest_plugin.isolation)
    --mla-threads N        torch CPU threads per process running suite tests (default 1)

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

import json
import os
import platform
import sys
from pathlib import Path

import pytest

from mla_conformance.pytest_plugin import isolation

_BACKENDS_KEY = pytest.StashKey[list]()
_OPS_KEY = pytest.StashKey[list]()
_DEVICE_KEY = pytest.StashKey[str]()
_RESULTS_KEY = pytest.StashKey[dict]()
_ENGAGED_KEY = pytest.StashKey[dict]()  # "header": header printed; "items": suite tests collected; counts

#: plugin modules registered with this one (pytest honours ``pytest_plugins`` in an entry-point plugin)
pytest_plugins = ["mla_conformance.pytest_plugin.generated"]

#: the plugin's fixtures: a test requesting any of them is a test of this suite
FIXTURES = ("mla_backend", "mla_op", "mla_figures", "mla_device", "mla_checkpoint")
_OPTIONS = ("--mla-backend", "--mla-op", "--mla-device", "--mla-checkpoint", "--mla-results", "--mla-expect",
            "--mla-timeout", "--mla-threads")
_RUN_KEY = pytest.StashKey[dict]()  # this process's run state: journal, watch, tests started / finished, fault dir
BENCHMARK_HINT = "pytest -m benchmark --benchmark-only -p no:xdist"


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


def _options_given(config) -> bool:
    return any(config.getoption(opt) for opt in _OPTIONS)


def _suite_dirs() -> list[Path]:
    from mla_conformance.errors import MLAInputError
    from mla_conformance.resources import suites_dir

    try:
        return [suites_dir().resolve()]
    except MLAInputError:
        return []


def _covers_suite(config) -> bool:
    """The run's paths (arguments, or testpaths) are or contain one of this suite's directories."""
    dirs = _suite_dirs()
    for arg in config.args:
        path = Path(str(arg).split("::")[0])
        if not path.is_absolute():
            path = Path(config.invocation_params.dir) / path
        try:
            path = path.resolve()
        except OSError:
            continue
        if any(path == d or d in path.parents or path in d.parents for d in dirs):
            return True
    return False


def is_suite_item(item) -> bool:
    """A test of this suite: it requests one of the plugin's fixtures."""
    names = getattr(item, "fixturenames", ())
    return any(n in names for n in FIXTURES)


def _engaged(config) -> dict:
    return config.stash.setdefault(_ENGAGED_KEY, {})


def _resolved(config, key, option: str, kind: str, defaults, resolve) -> list:
    """The objects under test for one option (its specs, else ``defaults``), resolved once per session with
    ``resolve``; a bad spec or two objects of one name is a usage error naming the option."""
    objs = config.stash.get(key, None)
    if objs is not None:
        return objs
    from mla_conformance.errors import MLAInputError

    objs = []
    try:
        for spec in config.getoption(option) or list(defaults):
            objs.append(resolve(spec))
    except MLAInputError as exc:
        raise pytest.UsageError(f"{option}: {exc}") from None
    names = [o.name for o in objs]
    dupes = {n for n in names if names.count(n) > 1}
    if dupes:
        raise pytest.UsageError(f"{option}: two {kind}s share the name(s) {sorted(dupes)}; test ids need unique names")
    config.stash[key] = objs
    return objs


def _backends(config) -> list:
    """The backends under test (--mla-backend, else DEFAULT_BACKENDS), resolved once per session (and only
    when something needs them)."""
    from mla_conformance.contract.layer import DEFAULT_BACKENDS
    from mla_conformance.specs import get_backend

    return _resolved(config, _BACKENDS_KEY, "--mla-backend", "backend", DEFAULT_BACKENDS, get_backend)


def _ops(config) -> list:
    """The ops under test (--mla-op, else DEFAULT_OPS), resolved once per session."""
    from mla_conformance.contract.op import DEFAULT_OPS
    from mla_conformance.specs import get_op

    return _resolved(config, _OPS_KEY, "--mla-op", "op", DEFAULT_OPS, get_op)


def _op_declarations(op) -> dict:
    """The op's declarations, JSON-able (tuples as lists)."""
    from mla_conformance.contract.op import declarations

    return {k: list(v) if isinstance(v, tuple) else v for k, v in declarations(op).items()}


def _deselected_kind(config) -> str | None:
    """Which kind of suite test this run leaves out: "op" (--mla-backend alone), "layer" (--mla-op alone)."""
    backend, op = bool(config.getoption("--mla-backend")), bool(config.getoption("--mla-op"))
    if backend and not op:
        return "op"
    if op and not backend:
        return "layer"
    return None


def device_of(config) -> str:
    """The device the checks run on (--mla-device, else cuda when available, else cpu); resolved once."""
    dev = config.stash.get(_DEVICE_KEY, None)
    if dev is None:
        dev = config.stash[_DEVICE_KEY] = _device(config)
        _fix_threads(config)
    return dev


def _fix_threads(config) -> None:
    """The torch intra-op thread count of a process that runs suite tests: --mla-threads when given (``run``
    gives 1: a reduction's order, and so a figure's last digits, depends on it, so its report is the same
    serially and with -n N); else 1 in an xdist worker (N workers with a thread per core each oversubscribe
    the CPU: on 2 shared cores, 2 threads ran test_numerics.py 6x slower than 1), and torch's own count in a
    serial pytest (a verdict on one backend uses every core). Set once torch is imported: here, or before the
    first suite test."""
    state = _run_state(config)
    if state.get("threads") or "torch" not in sys.modules:
        return
    given = config.getoption("--mla-threads")
    state["threads"] = given or (1 if hasattr(config, "workerinput") else sys.modules["torch"].get_num_threads())
    sys.modules["torch"].set_num_threads(state["threads"])


def _device(config) -> str:
    dev = config.getoption("--mla-device")
    if dev == "cpu":  # torch is not needed to know that (an xdist worker starts faster without it)
        return dev
    import torch

    if dev is None:
        dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev.startswith("cuda"):
        if not torch.cuda.is_available():
            raise pytest.UsageError(f"--mla-device {dev}: torch sees no CUDA device on this host "
                                    f"(torch {torch.__version__}, CUDA build {torch.version.cuda})")
        worker = os.environ.get("PYTEST_XDIST_WORKER")  # spread xdist workers over the visible GPUs
        if dev == "cuda" and worker and worker.startswith("gw"):
            dev = f"cuda:{int(worker[2:]) % torch.cuda.device_count()}"
    elif dev != "cpu":
        raise pytest.UsageError(f"--mla-device {dev!r}: expected cpu, cuda or cuda:N")
    return dev


MARKERS = (
    "mla_section(name): the report section a conformance test's results belong to (recorded in the results "
    "JSON; the report finds its rows by section, never by test name)",
    "requires_kernel(kernel_id): gate a test on a kernel of the support matrix (e.g. flashmla/dense_decode)",
    "needs_checkpoint: needs --mla-checkpoint DIR (a real DeepSeek-V2/V3 checkpoint)",
    "benchmark: decode timings with pytest-benchmark; deselected by default",
    "slow: long-running conformance checks",
)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    _benchmark_storage(config)  # first: pytest-benchmark creates its storage in its own pytest_configure
    _configure(config)


def _benchmark_storage(config) -> None:
    """When this suite runs with its benchmarks deselected, give pytest-benchmark a throwaway storage so
    no ``.benchmarks/`` is left in the current directory; another project's run is left alone."""
    if getattr(config.option, "benchmark_storage", None) != "file://./.benchmarks" or _benchmark_selected(config):
        return
    given = getattr(config, "workerinput", {}).get("mla_benchmark_storage")
    if given:  # an xdist worker uses its controller's (a worker that dies cleans up nothing)
        config.option.benchmark_storage = given
        return
    pyargs = any(str(a).startswith("mla_conformance.suites") for a in config.args)
    if not (pyargs or _options_given(config) or _covers_suite(config)):
        return
    import shutil
    import tempfile

    tmp = tempfile.mkdtemp(prefix="mla-conformance-benchmarks-")
    config.option.benchmark_storage = "file://" + tmp
    config.add_cleanup(lambda: shutil.rmtree(tmp, ignore_errors=True))


def _configure(config):
    # nothing is imported or resolved here unless an --mla option asks for it: bad options are a usage
    # error before any test runs; everything else waits until a test of the suite is collected
    # the suite's own markers, registered wherever the suites run (an installed wheel has no pyproject.toml)
    for line in MARKERS:
        config.addinivalue_line("markers", line)
    if config.getoption("--mla-backend"):
        _backends(config)
    if config.getoption("--mla-op"):
        _ops(config)
    if config.getoption("--mla-device"):
        device_of(config)
    if config.getoption("--mla-results"):
        config.stash[_RESULTS_KEY] = {}
    timeout = config.getoption("--mla-timeout")
    if timeout is not None and timeout < 0:
        raise pytest.UsageError(f"--mla-timeout {timeout:g}: expected seconds >= 0 (0: no timeout)")
    threads = config.getoption("--mla-threads")
    if threads is not None and threads < 1:
        raise pytest.UsageError(f"--mla-threads {threads}: expected an integer >= 1")
    config.pluginmanager.register(_Recorder(config), "mla-conformance-recorder")
    ckpt = config.getoption("--mla-checkpoint")
    if ckpt:  # checked once, before any test: config, weights, tokenizer named as missing/corrupt
        from mla_conformance.model.checkpoint import validate_checkpoint
        from mla_conformance.errors import MLAInputError

        try:
            validate_checkpoint(ckpt)
        except MLAInputError as exc:
            raise pytest.UsageError(f"--mla-checkpoint: {exc}") from None


def pytest_report_header(config):
    if not (_options_given(config) or _covers_suite(config)):
        return None  # another project's run (or not yet known): see pytest_report_collectionfinish
    _engaged(config)["header"] = True
    return _header_lines(config)


def pytest_report_collectionfinish(config, items):
    if _engaged(config).get("header") or not any(is_suite_item(i) for i in items):
        return None
    _engaged(config)["header"] = True
    return _header_lines(config)


def _header_lines(config) -> list[str]:
    import torch

    from mla_conformance import __version__

    kind = _deselected_kind(config)
    parts = []
    if kind != "layer":
        parts.append(f"backends {', '.join(b.name for b in _backends(config))}")
    if kind != "op":
        parts.append(f"ops {', '.join(o.name for o in _ops(config))}")
    lines = [f"mla-conformance {__version__}: {'; '.join(parts)}"]
    dev = device_of(config)
    if dev.startswith("cuda"):
        idx = torch.device(dev).index or 0
        cap = torch.cuda.get_device_capability(idx)
        lines.append(f"device {dev}: {torch.cuda.get_device_name(idx)}, SM{cap[0]}{cap[1]} "
                     f"(capability {cap[0]}.{cap[1]}), CUDA {torch.version.cuda}")
    else:
        lines.append(f"device cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    from importlib import metadata

    try:  # from the metadata: importing transformers costs ~0.45 s in every pytest process and xdist worker
        tv = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        tv = "not installed"
    lines.append(f"torch {torch.__version__}, transformers {tv}, python {platform.python_version()}")
    ckpt = config.getoption("--mla-checkpoint")
    if ckpt:
        lines.append(f"checkpoint {ckpt}")
    return lines


def pytest_generate_tests(metafunc):
    if "mla_backend" in metafunc.fixturenames:
        backends = _backends(metafunc.config)
        device_of(metafunc.config)
        metafunc.parametrize("mla_backend", backends, ids=[b.name for b in backends])
    if "mla_op" in metafunc.fixturenames:
        ops = _ops(metafunc.config)
        device_of(metafunc.config)
        metafunc.parametrize("mla_op", ops, ids=[o.name for o in ops])


def _benchmark_selected(config) -> bool:
    expr = config.getoption("markexpr", "") or ""
    return "benchmark" in expr and "not benchmark" not in expr or bool(config.getoption("benchmark_only", False))


def read_expectations(path: str) -> list[tuple[str, str, int]]:
    """Lines ``<node-id prefix>  <reason>``; ``#`` starts a comment line. Returns (prefix, reason, line)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise pytest.UsageError(f"--mla-expect {path}: cannot read it ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise pytest.UsageError(f"--mla-expect {path}: not a text file") from None
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        prefix, _, reason = line.partition(" ")
        reason = reason.strip().lstrip("#").strip()
        if "::" not in prefix and not prefix.endswith(".py") and "/" not in prefix:
            raise pytest.UsageError(f"--mla-expect {path}:{n}: {prefix!r} is not a node-id prefix "
                                    "(expected e.g. suites/test_numerics.py::test_against_float64[my-mla-)")
        if not reason:
            raise pytest.UsageError(f"--mla-expect {path}:{n}: entry {prefix!r} gives no reason")
        out.append((prefix, reason, n))
    return out


def _apply_expectations(config, items):
    import warnings

    for path in config.getoption("--mla-expect") or []:
        for prefix, reason, n in read_expectations(path):
            hits = [item for item in items if item.nodeid.startswith(prefix)]
            for item in hits:
                item.add_marker(pytest.mark.xfail(reason=f"expected ({Path(path).name}:{n}): {reason}", strict=False))
            if not hits:
                warnings.warn(pytest.PytestWarning(f"--mla-expect {path}:{n}: {prefix!r} matches no collected test"))


def pytest_collection_modifyitems(config, items):
    _apply_expectations(config, items)
    suite = [item for item in items if is_suite_item(item)]
    if not suite:
        return
    _engaged(config)["items"] = True
    kind = _deselected_kind(config)
    if kind is not None:  # --mla-backend alone: a verdict on backends, no op tests; --mla-op alone: the reverse
        fixture = "mla_op" if kind == "op" else "mla_backend"
        out = [item for item in suite if fixture in getattr(item, "fixturenames", ())]
        if out:
            ids = {id(item) for item in out}
            items[:] = [item for item in items if id(item) not in ids]
            suite = [item for item in suite if id(item) not in ids]
            config.hook.pytest_deselected(items=out)
            _engaged(config)["kind_deselected"] = (kind, len(out))
    if getattr(config.option, "update_snapshots", False):  # syrupy's --snapshot-update: goldens of a checkout only
        from mla_conformance.errors import MLAInputError
        from mla_conformance.resources import check_goldens_writable

        try:
            check_goldens_writable()
        except MLAInputError as exc:
            raise pytest.UsageError(f"--snapshot-update: {exc}") from None
    if _benchmark_selected(config):
        return
    # the suite's decode benchmarks are deselected, not skipped one by one; the summary says how to run them
    bench = [item for item in suite if item.get_closest_marker("benchmark")]
    if bench:
        ids = {id(item) for item in bench}
        items[:] = [item for item in items if id(item) not in ids]
        config.hook.pytest_deselected(items=bench)
        _engaged(config)["benchmarks_deselected"] = len(bench)


def pytest_runtest_setup(item):
    marker = item.get_closest_marker("requires_kernel")
    if marker is not None:
        from mla_conformance.arch import kernel_skip_reason

        kernel = marker.args[0] if marker.args else marker.kwargs["kernel_id"]
        reason = kernel_skip_reason(kernel, device_of(item.config))
        if reason:
            pytest.skip(reason)
    if item.get_closest_marker("needs_checkpoint") and not item.config.getoption("--mla-checkpoint"):
        pytest.skip("needs a real checkpoint: pass --mla-checkpoint DIR (e.g. a local DeepSeek-V2-Lite)")


@pytest.fixture(scope="session")
def mla_device(request) -> str:
    """The device the checks run on (--mla-device)."""
    return device_of(request.config)


@pytest.fixture
def mla_checkpoint(request) -> Path | None:
    ckpt = request.config.getoption("--mla-checkpoint")
    return Path(ckpt) if ckpt else None


@pytest.fixture
def mla_figures(request):
    """A dict the test fills with measured figures; they go into the --mla-results JSON and reports --
    failing tests' too (the checks fill it before they raise)."""
    data: dict = {}
    request.node.user_properties.append(("mla_figures", data))
    yield data
    if not data:
        request.node.user_properties.remove(("mla_figures", data))


def _is_failure(excinfo) -> bool:
    """A check's verdict (AssertionError: the backend ran and is wrong) -- as opposed to an error (the
    backend raised or broke the contract's types: mla_conformance.errors.BackendError, or anything else)."""
    from mla_conformance.errors import BackendError

    return excinfo is not None and isinstance(excinfo.value, AssertionError) and not isinstance(excinfo.value, BackendError)


#: the results' names of the plugin's parametrised fixtures
_PARAM_NAMES = {"mla_backend": "backend", "mla_op": "op"}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.failed and call.when == "call" and is_suite_item(item) and _is_failure(call.excinfo) and \
            not hasattr(rep, "wasxfail"):
        # a conformance verdict: the message says it all; show it with short frames (the suite's own
        # helpers hide themselves with __tracebackhide__), not pages of suite source
        rep.longrepr = item._repr_failure_py(call.excinfo, style="short")
    results = item.config.stash.get(_RESULTS_KEY, None)
    if results is None:
        return
    entry = results.setdefault(item.nodeid, {"nodeid": item.nodeid, "outcome": "passed"})
    params = getattr(item, "callspec", None)
    if params is not None:
        # the results' parameter names are the report's: the backend is "backend", not the fixture's name
        entry["params"] = {_PARAM_NAMES.get(k, k): (getattr(v, "name", None) or str(v))
                           for k, v in params.params.items()}
    entry["device"] = device_of(item.config)
    section = item.get_closest_marker("mla_section")
    if section is not None and section.args:
        entry["section"] = str(section.args[0])
    if rep.passed and hasattr(rep, "wasxfail"):
        entry["outcome"] = "xpassed"
        entry["reason"] = rep.wasxfail
    elif rep.skipped:
        entry["outcome"] = "xfailed" if hasattr(rep, "wasxfail") else "skipped"
        if isinstance(rep.longrepr, tuple):
            entry["reason"] = rep.longrepr[2].removeprefix("Skipped: ")
        elif hasattr(rep, "wasxfail"):
            entry["reason"] = rep.wasxfail
    elif rep.failed and entry["outcome"] not in ("failed", "error"):
        entry["outcome"] = "failed" if rep.when == "call" and _is_failure(call.excinfo) else "error"
        if call.excinfo is not None:
            msg = f"{call.excinfo.typename}: {call.excinfo.value}" if entry["outcome"] == "error" else \
                str(call.excinfo.value)
        else:
            crash = getattr(rep.longrepr, "reprcrash", None)
            msg = crash.message if crash else str(rep.longrepr)
        fault = _fault_of(item, call.excinfo) if call.excinfo is not None else None
        if fault is not None:
            msg = fault.pop("reason")
            entry["fault"] = fault
        entry["reason"] = (msg.strip().splitlines() or [""])[0][:1000]
    for key, value in item.user_properties:
        if key == "mla_figures":
            entry["figures"] = value
    # the entry travels with the report: an xdist controller records it from there, so a worker that dies
    # later loses nothing already reported
    rep.mla_result = json.dumps(entry, sort_keys=True, default=str)
    if rep.failed and call.excinfo is not None and call.excinfo.errisinstance(isolation.TestTimeout):
        rep.mla_fault = entry.get("fault")  # shown as TIMEOUT (pytest_report_teststatus)


def _fault_of(item, excinfo) -> dict | None:
    """A timeout or CUDA fault in a test's exception, as the entry's ``fault`` (with its one-line
    ``reason``); for a sticky CUDA error the process is marked to end after the test (or stop, serially)."""
    if excinfo.errisinstance(isolation.TestTimeout):
        text = str(excinfo.value)
        head, _, stacks = text.partition("\n\nstacks of every thread (faulthandler):\n")
        return {"kind": "timeout", "after_s": _timeout(item.config), "native": False,
                "stack": isolation.current_block(stacks), "reason": head}
    cuda = isolation.cuda_fault(excinfo.value)
    if cuda is None:
        return None
    what, sticky = cuda
    first = (f"{excinfo.typename}: {excinfo.value}".strip().splitlines() or [""])[0]
    if not sticky:
        return {"kind": "cuda", "error": what, "sticky": False,
                "reason": f"{what} (the backend ran out of GPU memory: a smaller preset or batch, or a leak in "
                          f"the backend): {first}"}
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    state = _run_state(item.config)
    state["poisoned"] = item.nodeid
    after = ("the worker process ends after this test and xdist starts a fresh one" if worker else
             "the run stops after this test (serial: run under xdist, e.g. -n 1, to have the process replaced)")
    if not worker:
        item.session.shouldstop = (f"sticky CUDA error in {item.nodeid} ({what}): this process's CUDA context is "
                                   "unusable, so no later test would say anything about its backend; run under "
                                   "xdist (-n 1) to have the process replaced")
    return {"kind": "cuda", "error": what, "sticky": True,
            "reason": f"{what} (sticky: the CUDA context is unusable; {after}): {first}"}


# --------------------------------------------------------------------------- crashes, hangs, the journal
#
# The process that writes --mla-results (serial pytest, or the xdist controller) records every result from
# the reports as they arrive, and journals them (mla_conformance.pytest_plugin.isolation.Journal), so what a worker reported
# before it died, or a run gathered before it was killed, is kept. Workers only report.


def _is_worker(config) -> bool:
    return hasattr(config, "workerinput")


def _run_state(config) -> dict:
    return config.stash.setdefault(_RUN_KEY, {"running": {}, "finished": set()})


def _timeout(config) -> float:
    value = config.getoption("--mla-timeout")
    return isolation.DEFAULT_TIMEOUT_S if value is None else max(0.0, float(value))


def _results_header(config, exitstatus) -> dict:
    kind = _deselected_kind(config)
    backends = [] if kind == "layer" else [b.name for b in _backends(config)]
    ops = [] if kind == "op" else _ops(config)
    return {"exitstatus": int(exitstatus) if exitstatus is not None else None, "device": device_of(config),
            "backends": backends, "ops": [o.name for o in ops],
            "op_declarations": {o.name: _op_declarations(o) for o in ops}}


def _journal(config):
    """The journal beside --mla-results (opened, with its header, on the first test), or None."""
    state = _run_state(config)
    if "journal" not in state:
        path = config.getoption("--mla-results")
        state["journal"] = None
        if path and not _is_worker(config) and config.stash.get(_RESULTS_KEY, None) is not None:
            try:
                journal = isolation.Journal(isolation.journal_path(path))
            except OSError:
                return None
            journal.write({"header": _results_header(config, None)})
            state["journal"] = journal
    return state["journal"]


def pytest_sessionstart(session):
    config = session.config
    fault_dir = getattr(config, "workerinput", {}).get("mla_fault_dir")
    if fault_dir:  # an xdist worker: fatal-error dumps and the watchdog's go where the controller reads them
        import faulthandler

        fh = open(Path(fault_dir) / f"{config.workerinput.get('workerid', 'gw')}.txt", "w+", encoding="utf-8")
        _run_state(config)["fault_file"] = fh
        faulthandler.enable(file=fh, all_threads=True)
    elif config.getoption("--mla-results") and not _is_worker(config):
        # serial: fatal errors stay on stderr; the watchdog's dump goes beside the results, where `run`
        # reads it when pytest itself was ended
        try:
            _run_state(config)["fault_file"] = open(str(config.getoption("--mla-results")) + ".fault", "w+",
                                                    encoding="utf-8")
        except OSError:
            pass


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if is_suite_item(item):
        _fix_threads(item.config)
    timeout = _timeout(item.config) if is_suite_item(item) else 0
    if timeout <= 0:
        yield
        return
    state = _run_state(item.config)
    watch = state.get("watch")
    if watch is None or watch.timeout != timeout:
        watch = state["watch"] = isolation.Watch(timeout, state.get("fault_file"))
    watch.arm()
    try:
        yield
    finally:
        watch.disarm()


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):  # xdist controller: where each worker's fault file goes
    config = node.config
    state = _run_state(config)
    if "fault_dir" not in state:
        import shutil
        import tempfile

        results = config.getoption("--mla-results")
        where = Path(results).resolve().parent if results else None
        try:
            state["fault_dir"] = tempfile.mkdtemp(prefix="mla-conformance-faults-", dir=where)
        except OSError:
            state["fault_dir"] = tempfile.mkdtemp(prefix="mla-conformance-faults-")
        config.add_cleanup(lambda d=state["fault_dir"]: shutil.rmtree(d, ignore_errors=True))
    node.workerinput["mla_fault_dir"] = state["fault_dir"]
    storage = getattr(config.option, "benchmark_storage", None)
    if isinstance(storage, str) and storage.startswith("file://") and "mla-conformance-benchmarks-" in storage:
        node.workerinput["mla_benchmark_storage"] = storage


def _read_fault_file(config, workerid: str) -> str:
    fault_dir = _run_state(config).get("fault_dir")
    if not fault_dir:
        return ""
    path = Path(fault_dir) / f"{workerid}.txt"
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
        path.unlink()
    except OSError:
        return ""
    return text


def _known_params(config, nodeid: str) -> dict:
    """A crashed test's backend or op when no report of it carried its parameters: the name in its id."""
    params = nodeid.partition("[")[2].rstrip("]")
    if not params:
        return {}
    found = {}
    for key, names in (("backend", lambda: [b.name for b in _backends(config)]),
                       ("op", lambda: [o.name for o in _ops(config)])):
        try:
            hits = [n for n in names() if params == n or params.startswith(n + "-") or params.endswith("-" + n)
                    or f"-{n}-" in params]
        except pytest.UsageError:
            hits = []
        if hits:
            found[key] = max(hits, key=len)
    return found


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched):
    """xdist: a worker died while ``crashitem`` was its current test. Say how it died and record the test as
    an error (``crashed``, or ``timeout`` when the watchdog ended it); a worker that ended itself after a
    finished test (a sticky CUDA error) is no crash of that test."""
    node = getattr(report, "node", None)
    config = getattr(node, "config", None)
    if config is None:
        return
    state = _run_state(config)
    workerid = getattr(getattr(node, "gateway", None), "id", "?")
    popen = getattr(getattr(getattr(node, "gateway", None), "_io", None), "popen", None)
    returncode = None
    if popen is not None:
        try:
            returncode = popen.wait(timeout=10)
        except Exception:  # noqa: BLE001 - still running or not a Popen: no code to report
            returncode = None
    dump = _read_fault_file(config, workerid)
    if crashitem in state["finished"] and crashitem not in state["running"]:
        # its reports are all in: the worker ended after it (the plugin ends a worker after a sticky CUDA
        # error, so xdist replaces it); nothing to count
        report.outcome, report.when, report.longrepr = "passed", "teardown", None
        report.mla_ignore = True
        return
    started = crashitem in state["running"]
    how = isolation.describe_exit(returncode)
    stack = isolation.current_block(dump)
    where = isolation.innermost_frame(dump)
    timeout = _timeout(config)
    if isolation.is_watchdog_dump(dump):
        fault = {"kind": "timeout", "after_s": timeout, "native": True, "stack": stack}
        reason = (f"timed out after {timeout:g} s (--mla-timeout)" + (f" in {where}" if where else "") +
                  ": Python could not interrupt it (a native call that blocks signals or holds the GIL, a hung "
                  "kernel), so its worker process was ended and a fresh one runs the rest")
    else:
        fatal = isolation.fatal_signal_of(dump)
        fault = {"kind": "crashed", "exit_code": returncode, "stack": stack}
        if returncode is not None and returncode < 0:
            fault["signal"] = isolation.signal_name(-returncode)
        reason = (f"crashed: its worker process {how}" + (f" ({fatal})" if fatal and fatal.lower() not in how.lower() else "") +
                  (f" in {where}" if where else "") + (" while running it" if started else
                                                      " before this test started (it did not run)") +
                  "; a fresh worker runs the rest")
    report.mla_fault = fault
    report.mla_reason = reason
    report.when = "call"
    report.longrepr = (f"{reason}\n\n(xdist: worker {workerid!r} crashed while running {crashitem!r})"
                       + (f"\n\n{dump.strip()}" if dump.strip() else ""))


def pytest_report_teststatus(report, config):
    fault = getattr(report, "mla_fault", None)
    if fault is not None and report.failed:
        return "error", "E", ("TIMEOUT" if fault.get("kind") == "timeout" else "CRASHED")
    return None


class _Recorder:
    """Per session (registered in pytest_configure): the hooks that get no config -- tests started,
    reported and finished. In the process that writes --mla-results it records and journals each result;
    in an xdist worker it ends the process after a test that left a sticky CUDA error."""

    def __init__(self, config):
        self.config = config
        self.state = _run_state(config)

    def _recording(self) -> bool:
        return not _is_worker(self.config) and self.config.stash.get(_RESULTS_KEY, None) is not None

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_logstart(self, nodeid, location):
        if self._recording():
            self.state["running"][nodeid] = True
            self.state["finished"].discard(nodeid)
            journal = _journal(self.config)
            if journal is not None:
                journal.write({"start": nodeid})

    def pytest_runtest_logreport(self, report):
        if not self._recording() or getattr(report, "mla_ignore", False):
            return
        results = self.config.stash[_RESULTS_KEY]
        data = getattr(report, "mla_result", None)
        fault = getattr(report, "mla_fault", None)
        if isinstance(data, str):
            entry = json.loads(data)
        elif fault is not None:  # xdist's report of a crashed test: its earlier entry, now an error
            entry = dict(results.get(report.nodeid) or {"nodeid": report.nodeid})
            if "params" not in entry:
                params = _known_params(self.config, report.nodeid)
                if params:
                    entry["params"] = params
            entry.update(outcome="error", reason=report.mla_reason[:1000], fault=fault)
            entry.setdefault("device", device_of(self.config))
        else:
            return  # another plugin's report (or a worker's report of a test outside the suite)
        results[report.nodeid] = entry
        journal = _journal(self.config)
        if journal is not None:
            journal.write({"result": entry})
        if fault is not None and data is None:  # its worker is gone: the test will send no logfinish
            self.state["running"].pop(report.nodeid, None)
            self.state["finished"].add(report.nodeid)
            if journal is not None:
                journal.write({"finish": report.nodeid})

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_logfinish(self, nodeid, location):
        if self._recording():
            self.state["running"].pop(nodeid, None)
            self.state["finished"].add(nodeid)
            journal = _journal(self.config)
            if journal is not None:
                journal.write({"finish": nodeid})
        elif _is_worker(self.config) and self.state.get("poisoned") == nodeid:
            # trylast: xdist has sent this test's reports and its logfinish; the controller sees the worker
            # end after a finished test and starts a fresh one (pytest_handlecrashitem)
            import sys

            sys.stdout.flush()
            isolation.sys_stderr().write(f"\nmla-conformance: sticky CUDA error in {nodeid}: this worker's CUDA "
                                         "context is unusable; ending the worker so xdist replaces it\n")
            isolation.sys_stderr().flush()
            os._exit(0)


_SKIP_LINES = 12


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Once: how to run the deselected benchmarks; the skips grouped by reason, one line each with its count."""
    engaged = _engaged(config)
    if not (engaged.get("header") or engaged.get("items") or _options_given(config)):
        return
    tr = terminalreporter
    counts: dict[str, int] = {}
    for rep in tr.stats.get("skipped", []):
        if hasattr(rep, "wasxfail"):
            continue
        longrepr = rep.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
        reason = (reason.removeprefix("Skipped: ").strip().splitlines() or ["(no reason)"])[0]
        reason = reason if len(reason) <= 200 else reason[:199] + "…"
        counts[reason] = counts.get(reason, 0) + 1
    deselected = engaged.get("benchmarks_deselected", 0)
    kind_deselected = engaged.get("kind_deselected")
    if kind_deselected is None and _deselected_kind(config) and config.pluginmanager.hasplugin("dsession"):
        kind_deselected = (_deselected_kind(config), None)  # xdist: the workers deselected, uncounted here
    conventions = _rope_conventions(tr)
    if not counts and not deselected and not kind_deselected and not conventions:
        return
    tr.write_sep("=", "mla-conformance skips by reason" if counts else "mla-conformance")
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    width = len(str(ranked[0][1])) if ranked else 1
    for reason, n in ranked[:_SKIP_LINES]:
        tr.write_line(f"{n:>{width}} {reason}")
    if len(ranked) > _SKIP_LINES:
        rest = ranked[_SKIP_LINES:]
        tr.write_line(f"… {len(rest)} more reasons ({sum(n for _, n in rest)} skips); -rs lists every one")
    if deselected:
        tr.write_line(f"{deselected} decode benchmarks deselected: run them with `{BENCHMARK_HINT}`")
    if kind_deselected:
        kind, n = kind_deselected
        n = "" if n is None else f"{n} "
        if kind == "op":
            tr.write_line(f"{n}op tests deselected: --mla-backend was given without --mla-op (a verdict on "
                          "backends); add --mla-op SPEC (e.g. --mla-op reference-op) to run them too")
        else:
            tr.write_line(f"{n}layer tests deselected: --mla-op was given without --mla-backend (a verdict on "
                          "ops); add --mla-backend SPEC to run them too")
    if conventions:
        tr.write_line("RoPE convention (YaRN cos/sin factor, test_conventions.py): "
                      + "; ".join(f"{b} {c}" for b, c in sorted(conventions.items())))


def _rope_conventions(tr) -> dict[str, str]:
    """Per backend, the ``rope_convention`` its conventions test recorded in its figures (the test id's
    parameter is the backend's name); from the reports, so xdist workers' count too."""
    out: dict[str, str] = {}
    for key in ("passed", "failed"):
        for rep in tr.stats.get(key, []):
            if getattr(rep, "when", None) != "call":
                continue
            for name, value in getattr(rep, "user_properties", ()) or ():
                if name == "mla_figures" and isinstance(value, dict) and value.get("rope_convention"):
                    backend = rep.nodeid.rsplit("[", 1)[-1].rstrip("]") if "[" in rep.nodeid else rep.nodeid
                    out[backend] = str(value["rope_convention"])
    return out


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    results = config.stash.get(_RESULTS_KEY, None)
    if results is None:
        return
    if _is_worker(config):  # a worker's results went to the controller with each report
        return
    path = config.getoption("--mla-results")
    if path:
        running = _run_state(config)["running"]  # interrupted mid-test: no result of it (its setup "passed")
        payload = {**_results_header(config, exitstatus),
                   "tests": [results[k] for k in sorted(results) if k not in running]}
        tmp = Path(path).with_suffix(".tmp")
        tmp.write_text(json.dumps(payload, indent=1, sort_keys=True, default=str))
        os.replace(tmp, path)
        state = _run_state(config)
        journal = state.get("journal")
        if journal is not None:  # the results file holds it all now (interrupted: `run` reads what was running)
            journal.close(remove=int(exitstatus) != int(pytest.ExitCode.INTERRUPTED))
        fault_file = state.pop("fault_file", None)
        if fault_file is not None:
            fault_file.close()
            if not _is_worker(config):
                Path(fault_file.name).unlink(missing_ok=True)
