"""Real processes of the tool, started as a user starts them, for the meta tests that judge what a process does:
the console script from another directory (test_cli.py), crashes and signals through ``mla-conformance run``
(test_isolation.py), a foreign project's pytest with the plugin installed (test_plugin_polite.py), the report under
xdist (test_report.py). Each function takes a fresh directory to work in and returns a picklable result, so that a
test module can make it once per session through the ``shared`` fixture (tests/conftest.py).
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

from mla_conformance.report import outdir
from mla_conformance.report import run as run_command
from mla_conformance.resources import suites_dir

from .fault_scenarios import LEAN, ONE_WORKER, backend_args, run_default, write_suite

def user_env(**extra: str) -> dict[str, str]:
    """This process's environment as a user's shell has it: without the variables pytest and xdist set for the
    test that starts the process (PYTEST_CURRENT_TEST, PYTEST_XDIST_WORKER, ...), plus ``extra``."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}, **extra}


# --------------------------------------------------------------------------- the console script (test_cli.py)

NODEID = "suites/test_cache_bytes.py::test_bytes_formula[reference-absorbed-1-0-1-float32-tiny]"


def test_command_run(tmp: Path):
    """`mla-conformance test --backend reference-absorbed -- <a checkout id> -v`, typed in another directory: the
    console script, a real process: (its directory, exit code, output, what it left in the directory)."""
    script = Path(sys.executable).parent / "mla-conformance"
    cmd = [str(script)] if script.is_file() else [sys.executable, "-m", "mla_conformance.cli"]
    proc = subprocess.run([*cmd, "test", "--backend", "reference-absorbed", "--", NODEID, "-v"], cwd=tmp,
                          capture_output=True, text=True, timeout=300, env=user_env())
    return tmp, proc.returncode, proc.stdout + proc.stderr, sorted(p.name for p in tmp.iterdir())


# --------------------------------------------------------------------------- crashes and signals (test_isolation.py)

SCENARIOS = {  # mode -> (pytest args, backends); one worker, serial runs and more: tests/meta/fault_scenarios.py
    "n2": (["-n", "2"], ("Good", "Exit", "PythonHang", "CudaIllegalAccess", "CudaOOM")),
}


def faulty_run(tmp: Path, mode: str):
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


def sigterm_run(tmp_path: Path) -> dict:
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
    env = user_env(TMPDIR=str(tmpdir))
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
            "procs_left": [p for p in Path("/proc").iterdir() if p.name.isdigit() and cmdline_has(p, str(suite))]}


#: How long terminal_run waits for the run (three tests on one good backend, LEAN, one worker: 1.4 s wall on an idle
#: 2-core machine); a run whose pytest is stopped by SIGTTOU never ends.
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


def terminal_run(tmp: Path) -> dict:
    """`mla-conformance run` on a good backend typed at a terminal with ``stty tostop`` (a pty, the run's
    controlling terminal, its output read here): its pytest must neither stop on writing the terminal nor keep it
    from ending. What the terminal showed, the exit status and whether the report was written; or that it had not
    ended within TERMINAL_BOUND_S (the run was then killed)."""
    import pty  # POSIX only, as the other jobs' process groups are

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


def cmdline_has(proc: Path, text: str) -> bool:
    try:
        return text in (proc / "cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False


# --------------------------------------------------------------------------- a foreign project (test_plugin_polite.py)

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


def foreign_run(project: Path) -> tuple[int, str]:
    """The foreign project run in a fresh interpreter (torch must not be imported there): (exit code, output)."""
    (project / "test_foreign.py").write_text(FOREIGN_TESTS, encoding="utf-8")
    (project / "pytest.ini").write_text("[pytest]\n", encoding="utf-8")  # its own rootdir and configuration
    proc = subprocess.run([sys.executable, "-c", RUN], cwd=project, capture_output=True, text=True, timeout=120,
                          env=user_env())
    return proc.returncode, proc.stdout + proc.stderr


# --------------------------------------------------------------------------- the report under xdist (test_report.py)

#: A small run that reaches every kind of report row: the V2-Lite cache probe (bytes table, the naive /
#: absorbed ratio, plots) and one numerics row per layer backend, and reference-op in two op sections.
SUBSET = ("seed_table or (test_against_float64 and tiny and float32 and prefill and not decode) "
          "or (test_out_lse_vs_oracle and float32) or test_deterministic")

#: The suite modules SUBSET draws from; the others are not collected (all of them: a second more per process).
SUBSET_FILES = ("test_cache_bytes.py", "test_numerics.py", "test_op_numerics.py")


def run_args(out: Path, *mode: str) -> list[str]:
    ignore = [f"--ignore={p}" for p in sorted(suites_dir().glob("test_*.py")) if p.name not in SUBSET_FILES]
    return ["run", "--out", str(out), "--name", "host", "--backend", "reference-naive", "--backend",
            "reference-absorbed", "--op", "reference-op", "--", "-q", *mode, "-k", SUBSET, *ignore]


def xdist_run(tmp: Path):
    """The same run into b/ with `-n 2` (two worker processes, one torch thread each, their results handed to the
    controller): the real `mla-conformance run` process, a job (:data:`JOBS`). Returns (its dir, b/, exit code, output)."""
    proc = subprocess.run([sys.executable, "-m", "mla_conformance.cli", *run_args(tmp / "b", "-n", "2")],
                          cwd=tmp, capture_output=True, text=True, timeout=300, env=user_env())
    return tmp, tmp / "b", proc.returncode, proc.stdout + proc.stderr
