"""The one way a test runs the suite inside a test: as a user runs it (the plugin, ``--mla-backend`` /
``--mla-op`` specs, ``--mla-results``), and reads what each inner test came out as.

* :func:`run_inprocess`: through ``pytester`` in this process (torch, transformers and the suite's modules are
  imported once); the ``suite_run`` fixture (tests/conftest.py) makes one such run per session for all the
  tests of a module, whichever asks first, once even under xdist (:class:`SuiteRuns`);
* :func:`run_subprocess`: the same command line as a real pytest process, for the inner runs of
  tests/meta/jobs.py, which run in processes of their own (tests/meta/background.py);
* :class:`Keep` (tests/meta/keep.py): a plugin of a run keeping some tests by node id and every test of some
  backends and ops (a session that runs the whole suite on one backend and chosen cells on others);
* :func:`pytest_inprocess`: pytester's run of any other command line (a usage error, an expectation file).

Every run: no xdist, no cache, none of the project's ``addopts``, the CPU, one torch thread (the outer
session's thread count is restored after an in-process run).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from . import background
from .keep import Keep

import pytest

ROOT = background.ROOT

#: the options of every inner run of the suite
BASE = ("-p", "no:xdist", "-p", "no:cacheprovider", "-p", "no:logging", "-p", "no:unraisableexception",
        "-p", "no:anyio", "-q", "-o", "addopts=", "--mla-device", "cpu",
        "--mla-threads", "1")


def here(ref: str) -> str:
    """A path, node id or ``path:attr`` spec of this checkout made absolute (an inner run starts in pytester's
    directory); anything else (a built-in name, an option, an absolute path) is left as it is."""
    path, sep, rest = ref.partition("::")
    if not sep:
        path, sep, rest = ref.rpartition(":") if ".py:" in ref else (ref, "", "")
    if not path or path.startswith("/") or not (ROOT / path).exists():
        return ref
    return f"{ROOT / path}{sep}{rest}"


@dataclass
class SuiteRun:
    """One inner run: its exit code, its output and its --mla-results JSON."""

    code: int
    log: str
    payload: dict
    by_id: dict[str, dict] = field(init=False)

    def __post_init__(self):
        self.by_id = {t["nodeid"]: t for t in self.payload.get("tests", [])}

    @property
    def tests(self) -> list[dict]:
        return self.payload.get("tests", [])

    def __getitem__(self, key: str):
        return self.payload[key]

    def only(self, files: Iterable[str]) -> "SuiteRun":
        """The same run with only the tests of ``files`` (``suites/test_x.py``): one matrix's view of a run that
        holds several."""
        files = tuple(files)
        return SuiteRun(self.code, self.log, {**self.payload, "tests": [t for t in self.tests
                                                                         if t["nodeid"].split("::")[0] in files]})

    def tail(self, n: int = 4000) -> str:
        return self.log[-n:]

    def result(self, nodeid: str) -> dict:
        """The entry of one inner test (an AssertionError naming it when it did not run)."""
        got = self.by_id.get(nodeid)
        assert got is not None, f"{nodeid} did not run"
        return got

    def assert_failed(self, nodeid: str, name: str) -> str:
        """The test came out *failed* (an AssertionError verdict, not an error, a skip or a pass) with a
        message; returns the message."""
        got = self.result(nodeid)
        assert got["outcome"] == "failed", (f"{nodeid}: expected the check to fail {name}, got {got['outcome']}: "
                                            f"{got.get('reason', '')}")
        reason = got.get("reason", "")
        assert reason, f"{nodeid}: the failure says nothing"
        return reason

    def printed_failure(self, nodeid: str) -> str:
        """The first ``E   AssertionError: `` line the run printed in the failure section of ``nodeid`` (what a
        user sees); else the section, or the log's end, to show."""
        head = re.search(rf"^_+ {re.escape(nodeid.split('::')[-1])} _+$", self.log, re.M)
        if head is None:
            return f"no failure section for {nodeid} in the run's output:\n{self.tail(3000)}"
        section = re.split(r"^(?:_+ \S.* _+|=+ .* =+)$", self.log[head.end():], maxsplit=1, flags=re.M)[0]
        line = re.search(r"^E   AssertionError: .*$", section, re.M)
        return line.group(0) if line else section[-3000:]

    def assert_error(self, nodeid: str, *kinds: str) -> str:
        """The test came out an *error* (a crash or a contract violation) whose reason starts with one of
        ``kinds`` (exception names); returns the reason."""
        got = self.result(nodeid)
        assert got["outcome"] == "error", f"{nodeid}: {got['outcome']}: {got.get('reason', '')}"
        reason = got.get("reason", "")
        assert reason.startswith(kinds), f"{nodeid}: not an error of {kinds}: {got}"
        return reason


def suite_args(results: Path, targets: Iterable[str], backends: Iterable[str] = (), ops: Iterable[str] = (),
               extra: Iterable[str] = ()) -> list[str]:
    """The inner command line: :data:`BASE`, ``--rootdir`` this checkout (node ids read ``suites/…`` as in a
    checkout), ``--mla-results``, the targets (paths or node ids) and the specs, made absolute."""
    args = [*BASE, "--rootdir", str(ROOT), "--mla-results", str(results), *extra, *map(here, targets)]
    for spec in backends:
        args += ["--mla-backend", here(spec)]
    for spec in ops:
        args += ["--mla-op", here(spec)]
    return args


def _read(results: Path, code: int, log: str, expect: int | None) -> SuiteRun:
    assert results.is_file(), f"the inner run wrote no results (exit {code}):\n{log[-4000:]}"
    run = SuiteRun(code, log, json.loads(results.read_text(encoding="utf-8")))
    if expect is not None:
        assert code == expect, f"expected exit {expect}, got {code}:\n{run.tail()}"
    return run


def pytest_inprocess(pytester, *args: str, plugins: Iterable = ()) -> pytest.RunResult:
    """pytester's in-process run of ``args`` (from pytester's directory; the outer torch thread count kept)."""
    import torch  # the session's own (tests/meta/conftest.py imported it before any pytester fixture)

    threads = torch.get_num_threads()
    try:
        return pytester.runpytest_inprocess(*args, plugins=list(plugins))
    finally:
        torch.set_num_threads(threads)


def run_inprocess(pytester, targets: Iterable[str], *, backends: Iterable[str] = (), ops: Iterable[str] = (),
                  extra: Iterable[str] = (), plugins: Iterable = (), expect: int | None = None) -> SuiteRun:
    """The suite's ``targets`` on ``backends`` / ``ops`` in this process; ``expect``: the exit code it must
    have (1: some inner test failed, as a kill matrix's must)."""
    results = pytester.path / "results.json"
    got = pytest_inprocess(pytester, *suite_args(results, targets, backends, ops, extra), plugins=plugins)
    return _read(results, int(got.ret), "\n".join(got.outlines + got.errlines), expect)


def run_subprocess(workdir: Path, targets: Iterable[str], *, backends: Iterable[str] = (), ops: Iterable[str] = (),
                   extra: Iterable[str] = (), keep: Keep | None = None, expect: int | None = None,
                   timeout: float = 600, env: dict[str, str] | None = None) -> SuiteRun:
    """The same run as a pytest process started in ``workdir`` (a background job's scratch directory); with
    ``keep``, only the tests it keeps run (the others are deselected); ``env``: variables added to its
    environment (e.g. TRITON_INTERPRET=1, which triton reads when it is imported)."""
    results = workdir / "results.json"
    command = [sys.executable, "-m", "pytest"]
    env = dict(env or {})
    if keep is not None:  # the plugin module, by name (``-p``), from this checkout
        (workdir / "keep.json").write_text(keep.to_json(), encoding="utf-8")
        command += ["-p", "tests.meta.keep", "--meta-keep", str(workdir / "keep.json")]
        env["PYTHONPATH"] = background.checkout_on_path()
    proc = subprocess.run([*command, *suite_args(results, targets, backends, ops, extra)],
                          cwd=workdir, capture_output=True, text=True, timeout=timeout,
                          env=background.env(**env))
    return _read(results, proc.returncode, proc.stdout + proc.stderr, expect)


class SuiteRuns:
    """The session's inner runs (or any result a module's tests share) by name: each made once, by the first
    test that asks; a run that raised raises again for every later test (as a failing module fixture does).

    Under xdist the workers share them through ``shared`` (a directory of the session's base temp): the first
    worker to ask makes the run under a lock and writes it there, the others wait for it and read it. (The meta
    modules' ``xdist_group`` marks would keep a run's tests on one worker, but with pytest 9.2 xdist 3.8's
    ``--dist loadgroup`` groups nothing: pytest-dev/pytest-xdist#1386.)"""

    def __init__(self, shared: Path | None = None):
        self.shared = shared
        self._runs: dict[str, tuple[bool, object]] = {}

    def get(self, key: str, build: Callable[[], object]):
        if key not in self._runs:
            self._runs[key] = self._made(key, build) if self.shared is None else self._shared(key, build)
        ok, value = self._runs[key]
        if not ok:
            raise value
        return value

    @staticmethod
    def _made(key: str, build: Callable[[], object]) -> tuple[bool, object]:
        try:
            return True, build()
        except Exception as exc:  # noqa: BLE001 - kept and raised to every test of the run
            return False, exc

    def _shared(self, key: str, build: Callable[[], object]) -> tuple[bool, object]:
        import fcntl
        import pickle

        self.shared.mkdir(parents=True, exist_ok=True)
        done = self.shared / f"{key}.pickle"
        with open(self.shared / f"{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # the first worker makes the run; the others wait here
            if not done.is_file():
                ok, value = self._made(key, build)
                done.write_bytes(pickle.dumps((True, value) if ok else (False, f"{type(value).__name__}: {value}")))
                return ok, value
        ok, value = pickle.loads(done.read_bytes())
        return (True, value) if ok else (False, AssertionError(f"the {key} run failed in another xdist worker: {value}"))
