"""The processes the inner runs of tests/meta/jobs.py run in, so that they take the core a serial session leaves idle.

A serial ``pytest`` keeps one core busy (torch runs one thread per process, ``--mla-threads``); the inner runs
spend their time in subprocesses of their own (the kill matrix's pytest, workers that start, crash, hang and time
out). The whole default run starts every job when the session starts, a selection those its tests read when
collection ends (tests/conftest.py). A *lane* is one ``python -m tests.meta.jobs`` process that runs its jobs one
after the other, at a lower priority, and writes each result to a file of the session's directory as it ends; a
test reads it through the ``inner_run`` fixture, which waits for that file. The longest job has a lane of its own,
the others share one. The session's own process starts the lanes and only waits for files: it runs no thread of
its own, so nothing it does (pytester, monkeypatch.setenv) can race a spawn.
"""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterable

from mla_conformance.report.run import OWN_PROCESS_GROUP

ROOT = Path(__file__).resolve().parents[2]

#: The job that takes longest (the kill matrix's process): a lane of its own, started first.
LONGEST = "kill-matrix"

#: Dropped from the lanes' environment, so that their pytest processes keep and share bytecode, pytest's
#: assertion-rewritten plugin and test modules among it (why and what it saves: the root conftest.py, which does
#: the same for the session's own process).
NO_BYTECODE = "PYTHONDONTWRITEBYTECODE"

#: The lanes, and so every process they start, run at a lower priority (children inherit a nice value): the
#: session's own tests keep their core, the jobs get the rest -- the longest job's lane first, the other lane what
#: that one leaves (it has the session's length to finish; the longest job barely does). A lane, and every process
#: it starts, stays in the session's own session (OWN_PROCESS_GROUP: a new session would be a new autogroup on
#: Linux, beyond nice's reach), with no terminal on its standard streams (``mla-conformance run`` starts its pytest
#: in a session of its own where it has one: report/run.pytest_group).
NICE = {LONGEST: 10, "others": 19}

#: The session's directory for the jobs' results and scratch directories, as the lanes are told it.
DIR_ENV = "MLA_META_JOBS_DIR"

_DIR: Path | None = None
_LANES: dict[str, tuple[subprocess.Popen, Path]] = {}  # job key -> (its lane's process, the lane's output)
_DIRS: list[Path] = []  # scratch directories of jobs run outside a lane (fault_scenarios.py --repeat)


def checkout_on_path() -> str:
    """PYTHONPATH with this checkout first: a process started elsewhere imports ``tests.meta`` from it."""
    return os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))


def env(**extra: str) -> dict[str, str]:
    """This process's environment (less :data:`NO_BYTECODE`) plus ``extra``: what a job's subprocess gets."""
    return {**{k: v for k, v in os.environ.items() if k != NO_BYTECODE}, **extra}


def scratch(prefix: str) -> Path:
    """A fresh directory for one job: in a lane, under the session's directory (removed with it when the session
    ends: :func:`shutdown`); elsewhere a temporary directory removed by this process's :func:`shutdown`."""
    parent = os.environ.get(DIR_ENV)
    d = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    if parent is None:
        _DIRS.append(d)
    return d


def _session_dir() -> Path:
    global _DIR
    if _DIR is None:
        _DIR = Path(tempfile.mkdtemp(prefix="mla-meta-jobs-"))
    return _DIR


def _result_file(key: str) -> Path:
    return _session_dir() / f"{key}.pickle"


def start(keys: Iterable[str]) -> None:
    """Start the jobs ``keys`` not started yet: :data:`LONGEST` in a lane of its own, the others in one lane, in
    the order given."""
    keys = [k for k in dict.fromkeys(keys) if k not in _LANES]
    for lane in ([k for k in keys if k == LONGEST], [k for k in keys if k != LONGEST]):
        if lane:
            _start_lane(lane)


def _start_lane(keys: list[str]) -> None:
    d = _session_dir()
    log = d / f"lane-{keys[0]}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tests.meta.jobs", str(d), *keys], cwd=ROOT,
                                env=env(**{DIR_ENV: str(d), "PYTHONPATH": checkout_on_path()}),
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, **OWN_PROCESS_GROUP)
    for key in keys:
        _LANES[key] = (proc, log)


def result(key: str) -> Any:
    """The job's result, once its lane has written it (the job is started now if it was not)."""
    if key not in _LANES:
        start([key])
    proc, log = _LANES[key]
    done = _result_file(key)
    while not done.is_file():
        if proc.poll() is not None and not done.is_file():
            tail = log.read_text(encoding="utf-8", errors="replace")[-4000:] if log.is_file() else ""
            raise AssertionError(f"the process running the job {key!r} ended ({proc.returncode}) without its "
                                 f"result; its output:\n{tail}")
        time.sleep(0.05)
    return read(done, key)


def read(done: Path, key: str) -> Any:
    """A result file's value; an AssertionError with the job's traceback where the job raised."""
    ok, value = pickle.loads(done.read_bytes())
    if not ok:
        raise AssertionError(f"the job {key!r} failed:\n{value}")
    return value


def lower_priority(keys: list[str]) -> None:
    """A lane's first step: its :data:`NICE` (POSIX; elsewhere the jobs share the CPU evenly with the session)."""
    if hasattr(os, "nice"):
        os.nice(NICE[LONGEST] if keys == [LONGEST] else NICE["others"])


def end_with_parent(poll: float = 0.5) -> None:
    """A lane's guard (POSIX; a lane leads its process group): a daemon thread that kills the lane's group -- the
    lane and the processes its jobs started -- once the process that started it is gone. A session killed with
    SIGKILL never reaches :func:`shutdown`; its lanes would otherwise run their jobs to the end."""
    parent = os.getppid()
    if not hasattr(os, "killpg") or os.getpgrp() != os.getpid():
        return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll)
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, name="end-with-parent", daemon=True).start()


def run_lane(directory: Path, keys: list[str], jobs: dict) -> None:
    """What a lane's process does (``python -m tests.meta.jobs DIR KEY...``, after :func:`lower_priority` and
    :func:`end_with_parent`): each job in turn, its result (or the traceback of what it raised) written to
    ``DIR/KEY.pickle`` when it ends."""
    import traceback

    for key in keys:
        try:
            value = (True, jobs[key]())
        except Exception as exc:  # noqa: BLE001 - handed to the tests that read the job
            value = (False, "".join(traceback.format_exception(exc)))
        part = directory / f"{key}.pickle.part"
        part.write_bytes(pickle.dumps(value))
        part.rename(directory / f"{key}.pickle")


def shutdown() -> None:
    """End the lanes still running (with every process of their group) and remove the session's directory."""
    global _DIR
    for proc in {id(p): p for p, _ in _LANES.values()}.values():
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    _LANES.clear()
    for d in [*_DIRS, *([_DIR] if _DIR is not None else [])]:
        shutil.rmtree(d, ignore_errors=True)
    _DIRS.clear()
    _DIR = None
