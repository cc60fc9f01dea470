"""A run that survives its backend (issue 19): crashes, hangs, CUDA faults and signals become verdicts.

The backends of ``impls/faulty/backends.py`` ``os._exit``, hang in Python or raise CUDA errors on their 2nd ``attend``
of a process. They run through ``mla-conformance run -- -n 2`` on a three-test suite of their own
(tests/meta/test_fault_scenarios.py ``SUITE``, written as the ``--suites`` directory): a real ``mla-conformance run``
process (its pytest and workers are real processes that really die). Timeouts are 0.5 s, so each hang costs 0.5-1 s.
The other faults, run's default (one worker) and serial runs: tests/meta/test_fault_scenarios.py.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mla_conformance.report import build, outdir
from mla_conformance.runner import run as run_command
from mla_conformance.pytest_plugin import isolation
from mla_conformance.cli import main

from .harness import processes_left, user_env
from .test_fault_scenarios import LEAN, ONE_WORKER, backend_args, write_suite

pytestmark = pytest.mark.meta

SCENARIOS = {  # mode -> (pytest args, backends); one worker, serial runs and more: tests/meta/test_fault_scenarios.py
    "n2": (["-n", "2"], ("Good", "Exit", "PythonHang", "CudaIllegalAccess", "CudaOOM")),
}


def _faulty_process(tmp: Path, mode: str):
    """`mla-conformance run` (a real process: its pytest and workers are real processes that really die) on the
    faulty backends of one scenario: (mode, rc, conformance.json, conformance.md)."""
    extra, classes = SCENARIOS[mode]
    suite, out = write_suite(tmp), tmp / "out"
    proc = subprocess.run([sys.executable, "-m", "mla_conformance.cli", "run", "--suites", str(suite), "--out",
                           str(out), "--name", "host", "--timeout", "0.5", *backend_args(*classes), "--", "-q",
                           "--mla-device", "cpu", *LEAN, *extra], capture_output=True, text=True, timeout=120,
                          env=user_env())
    if not (out / "conformance.json").is_file():
        raise AssertionError(f"{mode}: no report (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return mode, proc.returncode, json.loads((out / "conformance.json").read_text()), \
        (out / "conformance.md").read_text()


def _sigterm_process(tmp_path: Path) -> dict:
    """kill -TERM on a running `mla-conformance run` (a real one: the signal must reach `run`) once its hanging
    test has started, in its one worker; what the test then looks at."""
    suite, out = write_suite(tmp_path), tmp_path / "out"
    out.mkdir()
    (out / "conformance.json").write_text("previous\n")
    (out / outdir.MARKER).write_text(json.dumps({"tool": "mla-conformance", "kind": "report",
                                            "files": ["conformance.json"]}))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    marker = f"sigterm-{os.getpid()}-{time.monotonic_ns()}"  # every process of the run inherits it
    env = user_env(TMPDIR=str(tmpdir), MLA_FAULT_SCENARIO=marker)
    proc = subprocess.Popen([sys.executable, "-m", "mla_conformance.cli", "run", "--suites", str(suite), "--out",
                             str(out), "--timeout", "60", *backend_args("PythonHang"), "--", "-q",
                             "--mla-device", "cpu", *LEAN, *ONE_WORKER],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    hung = "test_attend[hang-python-2]"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # until the hanging test has started (the journal says so)
        journals = list(tmpdir.glob("mla-conformance-run-*/results.json.journal"))
        if journals and f'"start": "suite/test_cache_bytes.py::{hung}"' in journals[0].read_text():
            break
        time.sleep(0.05)
    else:
        proc.kill()
        return {"started": False, "stderr": proc.communicate()[1][-2000:]}
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=30)
    partial = run_command.partial_results_path(out)  # read here: under xdist another worker may read this result
    return {"started": True, "returncode": proc.returncode, "stderr": stderr, "hung": hung, "partial_path": partial,
            "partial": partial.read_text() if partial.is_file() else None,
            "before": before, "after": {p.name: p.read_bytes() for p in out.iterdir()},
            "tmp_left": [p.name for p in tmpdir.iterdir() if p.name != f"pytest-of-{user()}"],
            "procs_left": processes_left("MLA_FAULT_SCENARIO", marker)}


#: How long the terminal run is waited for (three tests on one good backend, LEAN, one worker: seconds, far below
#: this); a run whose pytest is stopped by SIGTTOU never ends, so a bound there must be.
TERMINAL_BOUND_S = 60

#: Started in a session of its own by terminal_run: makes the terminal (argv[1], a pty's slave) its controlling
#: terminal by opening it, sets ``stty tostop`` on it, gives it as stdin, stdout and stderr, and execs argv[2:].
ON_A_TERMINAL = """
import os, sys, termios
fd = os.open(sys.argv[1], os.O_RDWR)
attrs = termios.tcgetattr(fd)
attrs[3] |= termios.TOSTOP
termios.tcsetattr(fd, termios.TCSANOW, attrs)
for std in (0, 1, 2):
    os.dup2(fd, std)
os.execv(sys.argv[2], sys.argv[2:])
"""


def _terminal_process(tmp: Path) -> dict:
    """`mla-conformance run` on a good backend typed at a terminal with ``stty tostop`` (a pty, the run's
    controlling terminal, its output read here): its pytest must neither stop on writing the terminal nor keep it
    from ending. What the terminal showed, the exit status and whether the report was written; or that it had not
    ended within TERMINAL_BOUND_S (the run was then killed)."""
    import pty  # POSIX only

    suite, out = write_suite(tmp), tmp / "out"
    master, slave = pty.openpty()  # the slave stays open here: the master reads EIO while no process holds it
    cmd = [sys.executable, "-m", "mla_conformance.cli", "run", "--suites", str(suite), "--out", str(out), "--name",
           "host", "--timeout", "30", *backend_args("Good"), "--", "-q", "--mla-device", "cpu", *LEAN, *ONE_WORKER]
    proc = subprocess.Popen([sys.executable, "-c", ON_A_TERMINAL, os.ttyname(slave), *cmd], start_new_session=True,
                            env=user_env())
    shown, deadline = b"", time.monotonic() + TERMINAL_BOUND_S
    try:
        while time.monotonic() < deadline:
            ready = select.select([master], [], [], 0.2)[0]
            if ready:
                shown += os.read(master, 65536)
            elif proc.poll() is not None:  # ended, and all it wrote has been read
                break
        ended = proc.poll() is not None
        if not ended:  # the whole session: run's pytest may be in a process group of its own
            for pid in _in_session(proc.pid):
                os.kill(pid, signal.SIGKILL)
            proc.wait()
    finally:
        os.close(master)
        os.close(slave)
    return {"ended": ended, "returncode": proc.returncode, "shown": shown.decode(errors="replace"),
            "report": (out / "conformance.json").is_file()}


def _in_session(sid: int) -> list[int]:
    """The pids of the processes in session ``sid``, whatever process group each is in."""
    pids = []
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and os.getsid(int(p.name)) == sid:
                pids.append(int(p.name))
        except OSError:  # ended meanwhile
            pass
    return pids


def user() -> str:
    import getpass

    return getpass.getuser()


@pytest.fixture(params=sorted(SCENARIOS))
def faulty_run(request, shared, tmp_path_factory):
    mode = request.param
    return shared(f"faulty-{mode}", lambda: _faulty_process(tmp_path_factory.mktemp(f"faulty-{mode}"), mode))


def test_every_fault_is_an_error_naming_the_test_and_every_other_test_is_kept(faulty_run):
    mode, rc, report, md = faulty_run
    names = {"n2": ("good", "exit3", "hang-python", "cuda-illegal", "cuda-oom")}[mode]
    assert rc != 0
    assert sorted(report["verdicts"]) == sorted(names)
    by_backend = {b: [t for t in report["tests"] if t.get("backend") == b] for b in names}
    for backend, rows in by_backend.items():
        assert len(rows) == 3, f"{backend}: every test recorded ({[r['nodeid'] for r in rows]})"
        bad = [t for t in rows if t["outcome"] != "passed"]
        if backend == "good":
            assert not bad and report["verdicts"][backend]["verdict"] == "CONFORMS"
            continue
        assert report["verdicts"][backend]["verdict"] == "DOES NOT CONFORM", backend
        assert len(bad) == 1 and bad[0]["outcome"] == "error", (backend, bad)
        (t,) = bad
        if backend == "hang-python":  # where: the innermost frame (os._exit leaves none)
            assert "faulty/backends.py" in t["reason"] and "in misbehave" in t["reason"], t
        kind = t["fault"]["kind"]
        if backend == "exit3":
            assert kind == "crashed" and t["fault"]["exit_code"] == 3 and "exited with code 3" in t["reason"]
        elif backend == "hang-python":
            assert kind == "timeout" and not t["fault"]["native"] and t["reason"].startswith("timed out after 0.5 s")
        elif backend == "cuda-illegal":
            assert kind == "cuda" and t["fault"]["sticky"] and "illegal memory access" in t["reason"]
        elif backend == "cuda-oom":
            assert kind == "cuda" and not t["fault"]["sticky"] and "CUDA out of memory" in t["reason"]
        assert f"| {backend} | **DOES NOT CONFORM** |" in md


def test_a_sticky_cuda_error_replaces_the_worker(faulty_run):
    """After the illegal memory access the worker ended itself; the next test of that backend ran in a fresh
    process (its attend count restarted, so it passed) and nothing was counted twice."""
    mode, _, report, _ = faulty_run
    rows = sorted((t for t in report["tests"] if t.get("backend") == "cuda-illegal"), key=lambda t: t["nodeid"])
    assert [t["outcome"] for t in rows].count("error") == 1 and len(rows) == 3


# --------------------------------------------------------------------------- signals


@pytest.fixture(scope="module")
def sigterm_run(tmp_path_factory) -> dict:
    return _sigterm_process(tmp_path_factory.mktemp("sigterm"))


def test_sigterm_ends_the_process_group_keeps_the_report_and_the_results(sigterm_run):
    """kill -TERM on a running `mla-conformance run`: exit 128 + 15, the running test named, the results so far
    kept beside --out, the previous report untouched, no temporary file and no process left."""
    got = sigterm_run
    assert got["started"], "the hanging test never started: " + got["stderr"]
    stderr, hung, partial = got["stderr"], got["hung"], got["partial_path"]
    assert got["returncode"] == 128 + signal.SIGTERM, stderr
    assert "interrupted by SIGTERM while running" in stderr and hung in stderr, stderr
    assert str(partial) in stderr and "untouched" in stderr and got["partial"] is not None
    data = json.loads(got["partial"])
    assert data["schema"] == run_command.PARTIAL_SCHEMA and data["running"] == [f"suite/test_cache_bytes.py::{hung}"]
    assert [t["outcome"] for t in data["tests"]] == ["passed"], "the test finished before the signal is kept"
    assert got["after"] == got["before"], "the previous report is untouched"
    assert not got["tmp_left"], f"temporary files left: {got['tmp_left']}"  # pytest's own basetemp may stay
    assert not got["procs_left"], f"processes of the run left behind: {got['procs_left']}"


@pytest.fixture
def terminal_run(tmp_path) -> dict:
    return _terminal_process(tmp_path)


def test_run_typed_at_a_terminal_with_tostop_ends(terminal_run):
    """`mla-conformance run` at a terminal under ``stty tostop``: its pytest writes to the terminal without being
    stopped (a background process group of the terminal's session would be: SIGTTOU), and the run ends with its
    report (runner/run.pytest_group)."""
    got = terminal_run
    assert got["ended"], f"the run had not ended (its pytest stopped on writing the terminal?):\n{got['shown'][-2000:]}"
    assert got["returncode"] == 0 and got["report"], got["shown"][-2000:]
    assert "passed" in got["shown"], f"pytest's summary never reached the terminal:\n{got['shown'][-2000:]}"


# --------------------------------------------------------------------------- the pieces, in process


def test_a_serial_pytest_that_died_leaves_a_report_from_its_journal(tmp_path):
    """`run -- -p no:xdist`: pytest itself dies; the journal's results stand and the running test is the error."""
    journal = isolation.Journal(tmp_path / "r.json.journal")
    journal.write({"header": {"backends": ["b"], "ops": [], "device": "cpu", "op_declarations": {}}})
    for k in (1, 2):
        nodeid = f"suite/test_x.py::test_a[b-{k}]"
        journal.write({"start": nodeid})
        journal.write({"result": {"nodeid": nodeid, "outcome": "passed", "params": {"backend": "b"}}})
        if k == 1:
            journal.write({"finish": nodeid})
    journal.close()
    with open(tmp_path / "r.json.journal", "a") as fh:
        fh.write('{"torn": ')  # the writer was killed mid-line
    results = run_command.results_from_journal(tmp_path / "r.json.journal", -signal.SIGSEGV)
    rows = {t["nodeid"]: t for t in results["tests"]}
    assert rows["suite/test_x.py::test_a[b-1]"]["outcome"] == "passed"
    dead = rows["suite/test_x.py::test_a[b-2]"]
    assert dead["outcome"] == "error" and dead["fault"]["signal"] == "SIGSEGV" and "SIGSEGV" in dead["reason"]
    assert dead["params"] == {"backend": "b"} and "did not run" in dead["reason"]
    assert build.build_report(results, name="h", env={})["verdicts"]["b"]["verdict"] == "DOES NOT CONFORM"


@pytest.mark.parametrize("exc, expect", [
    (RuntimeError("CUDA error: an illegal memory access was encountered"), (True, "illegal memory access")),
    (RuntimeError("CUDA error: device-side assert triggered"), (True, "device-side assert")),
    (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), (False, "CUDA out of memory")),
    (type("OutOfMemoryError", (RuntimeError,), {})("oom"), (False, "CUDA out of memory")),
    (type("AcceleratorError", (RuntimeError,), {})("CUDA error: misaligned address"), (True, "misaligned address")),
    (RuntimeError("boom"), None),
])
def test_cuda_faults_are_named_and_sticky_ones_known(exc, expect):
    got = isolation.cuda_fault(exc)
    if expect is None:
        assert got is None
    else:
        assert got[1] is expect[0] and expect[1] in got[0]
    wrapped = Exception("my-mla.attend raised")  # a BackendError wrapping it still names it
    wrapped.__cause__ = exc
    assert (isolation.cuda_fault(wrapped) is None) is (expect is None)


def test_how_a_process_died_is_said():
    assert "SIGSEGV" in isolation.describe_exit(-11) and "segmentation fault" in isolation.describe_exit(-11)
    assert "out-of-memory killer" in isolation.describe_exit(-9)
    assert "exited with code 3" in isolation.describe_exit(3)


@pytest.mark.parametrize("user, added", [
    ([], ["-n", "2", "-W", "ignore:Benchmarks are automatically disabled:pytest_benchmark.logger.PytestBenchmarkWarning",
          "--max-worker-restart", str(run_command.MAX_WORKER_RESTARTS)]),
    (["-n", "2"], ["--max-worker-restart", str(run_command.MAX_WORKER_RESTARTS)]),
    (["-n4", "--max-worker-restart", "3"], []),
    (["-p", "no:xdist"], []),
    (["--pdb"], []),
    (["-m", "benchmark", "--benchmark-only"], []),
])
def test_run_isolates_tests_in_a_worker_unless_told_otherwise(user, added):
    assert run_command.isolation_args(user, workers=2) == added


def test_run_takes_a_worker_per_core_up_to_two(monkeypatch):
    for cores, workers in ((1, 1), (2, 2), (16, run_command.DEFAULT_WORKERS_MAX)):
        monkeypatch.setattr(run_command.os, "sched_getaffinity", lambda pid, cores=cores: set(range(cores)))
        assert run_command.isolation_args([])[:2] == ["-n", str(workers)], cores


@pytest.mark.parametrize("breakage", ["read-only", "mount point"])
def test_out_proven_writable_before_any_test(tmp_path, capsys, monkeypatch, breakage):
    out = tmp_path / "ro"
    out.mkdir()
    if breakage == "read-only":  # as on a read-only mount (root ignores chmod, so the probe's write fails here)
        real = outdir.tempfile.mkstemp

        def mkstemp(*a, dir=None, **kw):
            if dir is not None and Path(dir) == out:
                raise OSError(30, "Read-only file system")
            return real(*a, dir=dir, **kw)

        monkeypatch.setattr(outdir.tempfile, "mkstemp", mkstemp)
    else:
        monkeypatch.setattr(outdir.os.path, "ismount", lambda p: Path(p) == out)
    ran = []
    monkeypatch.setattr(run_command, "_run_pytest", lambda cmd, watch=None: ran.append(cmd) or (0, None))
    rc = main(["run", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and not ran and len(err.strip().splitlines()) == 1, err
    assert ("Read-only file system" in err) if breakage == "read-only" else ("mount point" in err)


@pytest.mark.parametrize("argv, rc", [(["--", "-k", "test_seed_table"], 0),
                                      (["--backend", "reference-absorbed", "--", "-k", "test_seed_table"], 1),
                                      ([], 1)])
def test_not_tested_fails_the_run_unless_unnamed_and_narrowed(tmp_path, capsys, monkeypatch, argv, rc):
    """Issue 18 item 6: a default backend whose -k-selected tests all skipped is reported NOT TESTED but does
    not fail a narrowed run; one the user named, or any in a full run, does. A deselected op is NOT SELECTED."""
    results = {"backends": ["reference-absorbed"], "ops": ["reference-op"], "exitstatus": 0, "device": "cpu",
               "tests": [{"nodeid": "suites/test_cache_bytes.py::test_seed_table[reference-absorbed]",
                          "outcome": "skipped", "params": {"backend": "reference-absorbed"}, "reason": "declined"}]}

    def fake(cmd, watch=None):
        Path(cmd[cmd.index("--mla-results") + 1]).write_text(json.dumps(results))
        return 0, None

    monkeypatch.setattr(run_command, "_run_pytest", fake)
    assert main(["run", "--out", str(tmp_path / "r"), *argv]) == rc
    out, err = capsys.readouterr()
    assert "reference-absorbed: NOT TESTED" in out and "op reference-op: NOT SELECTED" in out
    assert ("not failing the run for reference-absorbed" in err) is (rc == 0)
