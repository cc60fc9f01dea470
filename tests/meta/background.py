"""The threads the inner runs of tests/meta/jobs.py run on, so that they take the core a serial session leaves idle.

A serial ``pytest`` keeps one core busy (torch runs one thread per process, ``--mla-threads``); the inner runs
spend their time in subprocesses (the kill matrix's pytest, workers that start, crash, hang and time out). The
whole default run starts every job when the session starts, a selection those its tests read when collection
ends (tests/conftest.py); on two threads, at a lower priority, they run while the rest of the session goes on,
and the tests read their results through the ``inner_run`` fixture. Jobs never call pytest in this process
(pytest is not thread-safe): they drive subprocesses only. Under xdist, or when a test asks first, a job runs in
the test.
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

_POOL: concurrent.futures.ThreadPoolExecutor | None = None
_JOBS: dict[str, concurrent.futures.Future] = {}
_DIRS: list[Path] = []

#: The environment the jobs' processes get, taken before any test runs. A job passes it (``env=background.env()``)
#: rather than inheriting: CPython spawns through vfork(), so a child shares this process's memory until it execs,
#: and the main thread's tests change os.environ meanwhile (pytester, monkeypatch.setenv); glibc's setenv may
#: reallocate ``environ`` under the child's execve: "OSError: [Errno 14] Bad address" (CI; reproduced with one
#: thread spawning /bin/true while another sets variables: 111 of 300 spawns failed). An explicit env is copied
#: by the spawning thread. (Turning vfork off instead costs ~0.1 s per spawn from this 2-3 GB process.)
_ENV = dict(os.environ)

#: Dropped from the jobs' environment, so that their pytest processes keep and share bytecode, pytest's
#: assertion-rewritten plugin and test modules among it (why and what it saves: the root conftest.py, which does
#: the same for the session's own process).
NO_BYTECODE = "PYTHONDONTWRITEBYTECODE"


#: The jobs' threads, and so every process they start, run at this lower priority (on Linux a thread's nice value
#: is its own and its children inherit it): the session's own tests keep their core, the jobs get the rest.
NICE = 10


#: Jobs at a time. Most jobs wait on their processes more than they compute (workers that start, crash, hang and
#: time out); with two, the longest job (:data:`LONGEST`, started first) computes while the others take turns on
#: the second thread, and every job's processes yield to the session's tests (:data:`NICE`).
WORKERS = 2
#: The job that takes longest (the kill matrix's process), started first in the whole default run
#: (tests/conftest.py) so that it does not wait behind the others.
LONGEST = "kill-matrix"


def env(**extra: str) -> dict[str, str]:
    """The session's starting environment (less :data:`NO_BYTECODE`) plus ``extra``: what a job's subprocess
    gets."""
    return {**{k: v for k, v in _ENV.items() if k != NO_BYTECODE}, **extra}


def scratch(prefix: str) -> Path:
    """A fresh directory for one job, removed at the end of the session (:func:`shutdown`)."""
    d = Path(tempfile.mkdtemp(prefix=prefix))
    _DIRS.append(d)
    return d


def _lower_priority() -> None:
    if hasattr(os, "nice"):  # POSIX (elsewhere the jobs share the CPU evenly with the session)
        os.nice(NICE)


def start(key: str, fn: Callable[[], Any]) -> None:
    """Run ``fn`` on a background thread, once per session: two jobs at a time (:data:`WORKERS`), the rest wait
    their turn in the order started."""
    global _POOL
    if _POOL is None:
        _POOL = concurrent.futures.ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="meta-background",
                                                      initializer=_lower_priority)
    if key not in _JOBS:
        _JOBS[key] = _POOL.submit(fn)


def result(key: str, fn: Callable[[], Any]) -> Any:
    """The started job's result (waiting for it), else ``fn()`` run now."""
    job = _JOBS.get(key)
    return job.result() if job is not None else fn()


def shutdown() -> None:
    if _POOL is not None:
        _POOL.shutdown(wait=True, cancel_futures=True)
    for d in _DIRS:
        shutil.rmtree(d, ignore_errors=True)
