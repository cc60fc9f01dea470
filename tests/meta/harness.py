"""The one way a test runs the suite inside a test: as a user runs it (the plugin, ``--mla-backend`` /
``--mla-op`` specs, ``--mla-results``), and reads what each inner test came out as.

* :func:`run_inprocess`: through ``pytester`` in this process (torch, transformers and the suite's modules are
  imported once); the ``suite_run`` fixture (tests/conftest.py) makes one such run per session, whichever test
  asks first, once even under xdist;
* :func:`run_subprocess`: the same command line as a real pytest process;
* :func:`pytest_inprocess`: pytester's run of any other command line (a usage error, an expectation file).

A run selects its tests the standard way: paths and node ids on its command line. Every run: no xdist, pytest's
cache in the run's own directory, none of the project's ``addopts``, the CPU, one torch thread (the outer
session's thread count is restored after an in-process run).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import pytest

from mla_conformance.resources import NO_UNUSED_PLUGINS

ROOT = Path(__file__).resolve().parents[2]

#: the options of every inner run of the suite
#: (resources.UNUSED_PLUGINS are left out where an inner pytest starts: pytest_inprocess, run_subprocess)
BASE = ("-p", "no:xdist", "-p", "no:logging", "-p", "no:unraisableexception", "-q",
        "-o", "addopts=", "--mla-device", "cpu", "--mla-threads", "1")


def user_env(**extra: str) -> dict[str, str]:
    """This process's environment as a user's shell has it: without the variables pytest and xdist set for the
    test that starts the process (PYTEST_CURRENT_TEST, PYTEST_XDIST_WORKER, ...), plus ``extra``."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}, **extra}


def processes_left(variable: str, value: str, wait_s: float = 15.0) -> list[str]:
    """The processes (not zombies) whose environment carries ``variable=value`` -- a marker a test sets for the
    processes it starts, which their children inherit -- once they have had ``wait_s`` to go: "pid: cmdline"."""
    needle = f"{variable}={value}".encode()
    deadline = time.monotonic() + wait_s
    while True:
        left = []
        for p in Path("/proc").iterdir():
            if not p.name.isdigit() or int(p.name) == os.getpid():
                continue
            try:
                if needle in (p / "environ").read_bytes().split(b"\0") and \
                        (p / "stat").read_text().rpartition(")")[2].split()[0] != "Z":
                    cmdline = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                    left.append(f"{p.name}: {cmdline[:200]}")
            except OSError:
                continue
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


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

    def joined(self, other: "SuiteRun") -> "SuiteRun":
        """One view of two runs (their tests; the first's exit code and both logs): a module's matrix made of a
        run of node ids and a run of whole suite files."""
        payload = dict(self.payload)
        for key, value in other.payload.items():  # the implementations each run names, and their declarations
            if isinstance(value, list) and isinstance(payload.get(key), list):
                payload[key] = [*payload[key], *(v for v in value if v not in payload[key])]
            elif isinstance(value, dict) and isinstance(payload.get(key), dict):
                payload[key] = {**payload[key], **value}
        return SuiteRun(self.code, f"{self.log}\n{other.log}", {**payload, "tests": [*self.tests, *other.tests]})

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
    args = [*BASE, "--rootdir", str(ROOT), "-o", f"cache_dir={results.parent / '.pytest_cache'}",
            "--mla-results", str(results), *extra, *map(here, targets)]
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
    """pytester's in-process run of ``args`` (from pytester's directory; the outer torch thread count kept), without
    resources.UNUSED_PLUGINS (hypothesis's plugin counts its sessions at import and at session start: one that
    ends in a usage error before it starts, imported afresh in each inner session, would leave hypothesis
    believing the outer session is still starting)."""
    import torch  # the session's own (tests/meta/conftest.py imported it before any pytester fixture)

    threads = torch.get_num_threads()
    try:
        return pytester.runpytest_inprocess(*NO_UNUSED_PLUGINS, *args, plugins=list(plugins))
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
                   extra: Iterable[str] = (), expect: int | None = None, timeout: float = 600,
                   env: dict[str, str] | None = None) -> SuiteRun:
    """The same run as a pytest process started in ``workdir``; ``env``: variables added to its environment
    (e.g. TRITON_INTERPRET=1, which triton reads when it is imported)."""
    results = workdir / "results.json"
    proc = subprocess.run([sys.executable, "-m", "pytest", *NO_UNUSED_PLUGINS,
                           *suite_args(results, targets, backends, ops, extra)],
                          cwd=workdir, capture_output=True, text=True, timeout=timeout,
                          env=user_env(**(env or {})))
    return _read(results, proc.returncode, proc.stdout + proc.stderr, expect)
