"""pytest plugin (entry point ``pytest11``): options, backend parametrisation, gating and the header.

Options::

    --mla-backend SPEC     backend under test (repeatable; default: every built-in)
    --mla-op SPEC          op under test (the kernel-level op contract, mla_conformance.ops; repeatable;
                           default: mla_conformance.ops.DEFAULT_OPS)
    --mla-device DEV       cpu / cuda / cuda:N (default: cuda when available, else cpu)
    --mla-checkpoint DIR   a real DeepSeek checkpoint for the needs_checkpoint tests
    --mla-results FILE     write every test's outcome and measured figures as JSON (used by `run`)

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
from pathlib import Path

import pytest

_BACKENDS_KEY = pytest.StashKey[list]()
_OPS_KEY = pytest.StashKey[list]()
_DEVICE_KEY = pytest.StashKey[str]()
_RESULTS_KEY = pytest.StashKey[dict]()
_ENGAGED_KEY = pytest.StashKey[dict]()  # "header": header printed; "items": suite tests collected; counts

#: the plugin's fixtures: a test requesting any of them is a test of this suite
FIXTURES = ("mla_backend", "mla_op", "mla_figures", "mla_device", "mla_checkpoint")
_OPTIONS = ("--mla-backend", "--mla-op", "--mla-device", "--mla-checkpoint", "--mla-results", "--mla-expect")
BENCHMARK_HINT = "pytest -m benchmark --benchmark-only -p no:xdist"


def pytest_addoption(parser):
    group = parser.getgroup("mla-conformance", "MLA conformance suite")
    group.addoption("--mla-backend", action="append", default=None, metavar="SPEC",
                    help="backend under test: a built-in name, package.module:attr or path/file.py:attr "
                         "(repeatable; default: every built-in backend)")
    group.addoption("--mla-op", action="append", default=None, metavar="SPEC",
                    help="op under test (the kernel-level op contract, mla_conformance.ops): a built-in name, "
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
    from mla_conformance.backends import DEFAULT_BACKENDS, get_backend

    return _resolved(config, _BACKENDS_KEY, "--mla-backend", "backend", DEFAULT_BACKENDS, get_backend)


def _ops(config) -> list:
    """The ops under test (--mla-op, else DEFAULT_OPS), resolved once per session."""
    from mla_conformance.ops import DEFAULT_OPS, get_op

    return _resolved(config, _OPS_KEY, "--mla-op", "op", DEFAULT_OPS, get_op)


def _op_declarations(op) -> dict:
    """The op's declarations, JSON-able (tuples as lists)."""
    from mla_conformance.ops import declarations

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
        if os.environ.get("PYTEST_XDIST_WORKER") and dev == "cpu":
            import torch  # N workers on N cores: one intra-op thread each, or they oversubscribe the CPU

            torch.set_num_threads(max(1, (os.cpu_count() or 1) //
                                      int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))
    return dev


def _device(config) -> str:
    import torch

    dev = config.getoption("--mla-device")
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
    ckpt = config.getoption("--mla-checkpoint")
    if ckpt:  # checked once, before any test: config, weights, tokenizer named as missing/corrupt
        from mla_conformance.checkpoint import validate_checkpoint
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
        entry["reason"] = (msg.strip().splitlines() or [""])[0][:1000]
    for key, value in item.user_properties:
        if key == "mla_figures":
            entry["figures"] = value


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):  # xdist: collect workers' results
    results = node.config.stash.get(_RESULTS_KEY, None)
    extra = getattr(node, "workeroutput", {}).get("mla_results")
    if results is not None and extra:
        results.update(json.loads(extra))


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
    workeroutput = getattr(config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker hands its results to the controller
        workeroutput["mla_results"] = json.dumps(results)
        return
    path = config.getoption("--mla-results")
    if path:
        kind = _deselected_kind(config)
        backends = [] if kind == "layer" else [b.name for b in _backends(config)]
        ops = [] if kind == "op" else _ops(config)
        payload = {"exitstatus": int(exitstatus), "device": device_of(config),
                   "backends": backends, "ops": [o.name for o in ops],
                   "op_declarations": {o.name: _op_declarations(o) for o in ops},
                   "tests": [results[k] for k in sorted(results)]}
        tmp = Path(path).with_suffix(".tmp")
        tmp.write_text(json.dumps(payload, indent=1, sort_keys=True, default=str))
        os.replace(tmp, path)
