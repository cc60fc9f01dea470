"""What a run tests: which backends and ops (resolved once per session), which device, which tests of the
suite run (parametrisation by backend and op, the deselection of one kind, of the benchmarks, expectation
files) and the per-test gates (``requires_kernel``, ``needs_checkpoint``).

Nothing here imports torch or resolves anything until an ``--mla-*`` option asks for it or a test of the
suite is collected: the plugin loads in every pytest run of the environment.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import pytest

from mla_conformance.arch import kernel_skip_reason
from mla_conformance.contract.layer import DEFAULT_BACKENDS
from mla_conformance.contract.op import DEFAULT_OPS, declarations
from mla_conformance.errors import MLAInputError
from mla_conformance.model.checkpoint import validate_checkpoint
from mla_conformance.resources import check_goldens_writable, suites_dir

#: the plugin's fixtures: a test requesting any of them is a test of this suite
FIXTURES = ("mla_backend", "mla_op", "mla_figures", "mla_device", "mla_checkpoint")
#: what makes a suite test an op test or a layer test (the layer tests across ranks take their backend as
#: suites/test_distributed.py's ``distributed_backend`` parameter, which the report also counts as the backend)
KIND_FIXTURES = {"op": ("mla_op",), "layer": ("mla_backend", "distributed_backend")}
#: the options that make a run one of this suite's, whatever its paths
OPTIONS = ("--mla-backend", "--mla-op", "--mla-device", "--mla-checkpoint", "--mla-results", "--mla-expect",
           "--mla-timeout", "--mla-threads")
#: the name ``--pyargs`` runs the installed suites by
SUITES_PACKAGE = "mla_conformance.suites"

_BACKENDS_KEY = pytest.StashKey[list]()
_OPS_KEY = pytest.StashKey[list]()
_DEVICE_KEY = pytest.StashKey[str]()
_THREADS_KEY = pytest.StashKey[int]()
_ENGAGED_KEY = pytest.StashKey[dict]()  # "header": header printed; "items": suite tests collected; counts


def options_given(config) -> bool:
    return any(config.getoption(opt) for opt in OPTIONS)


def suite_dirs() -> list[Path]:
    try:
        return [suites_dir().resolve()]
    except MLAInputError:
        return []


def names_suites(args, invocation_dir, pyargs: bool) -> bool:
    """The run's arguments name this suite: the package (``--pyargs mla_conformance.suites[.module]``), or
    paths that are, contain or lie in its directory."""
    args = [str(a).split("::")[0] for a in args]
    if pyargs and any(a == SUITES_PACKAGE or a.startswith(SUITES_PACKAGE + ".") for a in args):
        return True
    dirs = suite_dirs() if args else []
    for arg in args:
        path = Path(arg)
        if not path.is_absolute():
            path = Path(invocation_dir) / path
        try:
            path = path.resolve()
        except OSError:
            continue
        if any(path == d or d in path.parents or path in d.parents for d in dirs):
            return True
    return False


def covers_suite(config) -> bool:
    """The run's paths (arguments, or testpaths) are or contain one of this suite's directories."""
    return names_suites(config.args, config.invocation_params.dir, bool(config.getoption("pyargs", False)))


def runs_suite(config) -> bool:
    """This run is one of the suite's: an ``--mla-*`` option is given or its arguments name the suite."""
    return options_given(config) or covers_suite(config)


def is_suite_item(item) -> bool:
    """A test of this suite: it requests one of the plugin's fixtures."""
    names = getattr(item, "fixturenames", ())
    return any(n in names for n in FIXTURES)


def engaged(config) -> dict:
    """What this run has shown of the suite so far: the header, suite tests collected, what was deselected."""
    return config.stash.setdefault(_ENGAGED_KEY, {})


# --------------------------------------------------------------------------- backends, ops, device


def _resolved(config, key, option: str, kind: str, defaults, resolve) -> list:
    """The objects under test for one option (its specs, else ``defaults``), resolved once per session with
    ``resolve``; a bad spec or two objects of one name is a usage error naming the option."""
    objs = config.stash.get(key, None)
    if objs is not None:
        return objs
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


def backends(config) -> list:
    """The backends under test (--mla-backend, else DEFAULT_BACKENDS), resolved once per session (and only
    when something needs them)."""
    from mla_conformance.specs import get_backend  # imports torch: the plugin loads in every pytest run

    return _resolved(config, _BACKENDS_KEY, "--mla-backend", "backend", DEFAULT_BACKENDS, get_backend)


def ops(config) -> list:
    """The ops under test (--mla-op, else DEFAULT_OPS), resolved once per session."""
    from mla_conformance.specs import get_op  # imports torch: the plugin loads in every pytest run

    return _resolved(config, _OPS_KEY, "--mla-op", "op", DEFAULT_OPS, get_op)


def op_declarations(op) -> dict:
    """The op's declarations, JSON-able (tuples as lists)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in declarations(op).items()}


def deselected_kind(config) -> str | None:
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
        fix_threads(config)
    return dev


def fix_threads(config) -> None:
    """The torch intra-op thread count of a process that runs suite tests: --mla-threads when given (``run``
    gives 1: a reduction's order, and so a figure's last digits, depends on it, so its report is the same
    serially and with -n N); else 1 in an xdist worker (N workers with a thread per core each oversubscribe
    the CPU: on 2 shared cores, 2 threads ran test_numerics.py 6x slower than 1), and torch's own count in a
    serial pytest (a verdict on one backend uses every core). Set once torch is imported: here, or before the
    first suite test."""
    if config.stash.get(_THREADS_KEY, None) or "torch" not in sys.modules:
        return
    torch = sys.modules["torch"]
    given = config.getoption("--mla-threads")
    threads = config.stash[_THREADS_KEY] = given or (1 if hasattr(config, "workerinput") else torch.get_num_threads())
    torch.set_num_threads(threads)


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


def check_options(config) -> None:
    """Bad options are a usage error before any test runs: the specs, the device, the numbers, the
    checkpoint (config, weights, tokenizer named as missing or corrupt). Resolves only what was given."""
    if config.getoption("--mla-backend"):
        backends(config)
    if config.getoption("--mla-op"):
        ops(config)
    if config.getoption("--mla-device"):
        device_of(config)
    timeout = config.getoption("--mla-timeout")
    if timeout is not None and timeout < 0:
        raise pytest.UsageError(f"--mla-timeout {timeout:g}: expected seconds >= 0 (0: no timeout)")
    threads = config.getoption("--mla-threads")
    if threads is not None and threads < 1:
        raise pytest.UsageError(f"--mla-threads {threads}: expected an integer >= 1")
    ckpt = config.getoption("--mla-checkpoint")
    if ckpt:
        try:
            validate_checkpoint(ckpt)
        except MLAInputError as exc:
            raise pytest.UsageError(f"--mla-checkpoint: {exc}") from None


# --------------------------------------------------------------------------- which tests run


def parametrize(metafunc) -> None:
    """A test requesting ``mla_backend`` runs once per backend, ``mla_op`` once per op; the id is the name."""
    if "mla_backend" in metafunc.fixturenames:
        objs = backends(metafunc.config)
        device_of(metafunc.config)
        metafunc.parametrize("mla_backend", objs, ids=[b.name for b in objs])
    if "mla_op" in metafunc.fixturenames:
        objs = ops(metafunc.config)
        device_of(metafunc.config)
        metafunc.parametrize("mla_op", objs, ids=[o.name for o in objs])


def benchmark_selected(config) -> bool:
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


def _apply_expectations(config, items) -> None:
    for path in config.getoption("--mla-expect") or []:
        apply_expectations(path, items)


def apply_expectations(path, items, *, warn_unmatched: bool = True) -> None:
    """Mark the items an expectation file lists xfail (not strict: a listed test that passes is XPASS), with
    the file, line and reason; a line that matches no item warns unless ``warn_unmatched`` is False (a partial
    run of the repository's own file: conftest.py)."""
    for prefix, reason, n in read_expectations(str(path)):
        hits = [item for item in items if item.nodeid.startswith(prefix)]
        for item in hits:
            item.add_marker(pytest.mark.xfail(reason=f"expected ({Path(path).name}:{n}): {reason}", strict=False))
        if not hits and warn_unmatched:
            warnings.warn(pytest.PytestWarning(f"--mla-expect {path}:{n}: {prefix!r} matches no collected test"))


def _deselect(config, items: list, out: list) -> None:
    ids = {id(item) for item in out}
    items[:] = [item for item in items if id(item) not in ids]
    config.hook.pytest_deselected(items=out)


def select(config, items: list) -> None:
    """Expectation files mark their tests xfail; ``--mla-backend`` alone deselects the op tests, ``--mla-op``
    alone the layer tests; the decode benchmarks are deselected unless selected (the summary says how to
    run them); ``--snapshot-update`` (syrupy) is refused outside a source checkout."""
    _apply_expectations(config, items)
    suite = [item for item in items if is_suite_item(item)]
    if not suite:
        return
    state = engaged(config)
    state["items"] = True
    kind = deselected_kind(config)
    if kind is not None:  # --mla-backend alone: a verdict on backends, no op tests; --mla-op alone: the reverse
        fixtures = KIND_FIXTURES[kind]
        out = [item for item in suite if any(f in getattr(item, "fixturenames", ()) for f in fixtures)]
        if out:
            _deselect(config, items, out)
            gone = {id(item) for item in out}
            suite = [item for item in suite if id(item) not in gone]
            state["kind_deselected"] = (kind, len(out))
    if getattr(config.option, "update_snapshots", False):  # syrupy's --snapshot-update: goldens of a checkout only
        try:
            check_goldens_writable()
        except MLAInputError as exc:
            raise pytest.UsageError(f"--snapshot-update: {exc}") from None
    if benchmark_selected(config):
        return
    bench = [item for item in suite if item.get_closest_marker("benchmark")]
    if bench:
        _deselect(config, items, bench)
        state["benchmarks_deselected"] = len(bench)


def gate(item) -> None:
    """Skip a test whose kernel this device cannot run (``requires_kernel``), or that needs a checkpoint
    none was given for (``needs_checkpoint``), with the sentence saying why."""
    marker = item.get_closest_marker("requires_kernel")
    if marker is not None:
        kernel = marker.args[0] if marker.args else marker.kwargs["kernel_id"]
        reason = kernel_skip_reason(kernel, device_of(item.config))
        if reason:
            pytest.skip(reason)
    if item.get_closest_marker("needs_checkpoint") and not item.config.getoption("--mla-checkpoint"):
        pytest.skip("needs a real checkpoint: pass --mla-checkpoint DIR (e.g. a local DeepSeek-V2-Lite)")
