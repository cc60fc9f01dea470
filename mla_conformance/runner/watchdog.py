"""``run``'s watch over the whole run: pytest is ended when the run makes no progress, so no fault of the backend
or of pytest-xdist can leave ``run`` waiting forever.

Progress is a line added to the results journal (:class:`mla_conformance.pytest_plugin.isolation.Journal`): a
test started, reported or finished, the collection, an xdist worker starting, ready, collected or down. The
run has *stalled* when no line came for ``--stall-timeout`` seconds (default :data:`DEFAULT_STALL_S`) beyond
what a running test is allowed (its ``--timeout`` and the C watchdog's margin,
:func:`mla_conformance.pytest_plugin.isolation.hard_deadline`: a test that runs past them has already been
ended by its own watchdog, unless its process cannot run at all, e.g. stopped), and at least
:data:`STARTUP_S` while a process starts (pytest before its first line, a worker before it collected), or when
:data:`COLLECTION_DEATHS` workers in a row died before collecting (each replacement dies the same way). ``run``
then kills pytest's process group and writes the report from the journal: the running tests are errors
(``stalled``), the tests not reached are errors (``not-run``), every result already in is kept.

The watch reads the journal only: it works whatever pytest and xdist are doing (a controller waiting on an idle
worker, a stopped process, a deadlock at exit).
"""

from __future__ import annotations

import os
from pathlib import Path

from mla_conformance.pytest_plugin import isolation

#: Default of ``run --stall-timeout``: seconds with no progress at all (and no test running) before ``run``
#: ends the run. Starting a worker and collecting the suites takes a few seconds; a loaded machine, more.
DEFAULT_STALL_S = 60.0

#: While a process is starting (pytest before its first journal line, an xdist worker before it has collected),
#: the bound is at least this: importing torch and collecting on a loaded machine is slow, and no test runs.
STARTUP_S = 120.0

#: Workers in a row that died before collecting their tests: the run is ended (xdist would start up to
#: ``--max-worker-restart`` of them, each dying the same way).
COLLECTION_DEATHS = 3


class RunWatch:
    """Polled by ``run`` while pytest runs (:meth:`poll`); :attr:`fired` is why it ended the run, or None."""

    def __init__(self, journal: Path, *, stall_s: float, test_timeout_s: float, pid: int | None = None,
                 now: float = 0.0):
        self.journal = Path(journal)
        self.stall_s = float(stall_s)
        #: what a running test may take before its own watchdog ends it (none without a test timeout)
        self.allowance = isolation.hard_deadline(test_timeout_s) if test_timeout_s > 0 else None
        self.pid = pid  # pytest's
        self.state = isolation.JournalState()
        self.last = now  # when the last line came (the start of pytest before any)
        self.fired: str | None = None
        self.description = ""  # the last test and each worker's state when it fired (describe())
        self._seen = False  # a journal line was read
        self._fh = None
        self._tail = ""

    def _read(self) -> bool:
        if self._fh is None:
            try:
                self._fh = open(self.journal, encoding="utf-8", errors="replace")
            except OSError:
                return False
        chunk = self._fh.read()
        if not chunk:
            return False
        lines = (self._tail + chunk).split("\n")
        self._tail = lines.pop()  # a line still being written
        return any([self.state.feed(line) for line in lines])

    def poll(self, now: float) -> str | None:
        """Read what the journal gained; the reason the run has stalled (and :attr:`fired` set), else None."""
        if self.fired is not None:
            return self.fired
        if self._read():
            self.last = now
            self._seen = True
        if self.state.deaths_before_collection >= COLLECTION_DEATHS:
            errors = sorted({", ".join(str(w[k]) for k in ("error", "fatal") if w.get(k)) or "no error given"
                             for w in self.state.workers.values() if w.get("event") == "down"})
            self.fired = (f"{self.state.deaths_before_collection} xdist workers in a row died before collecting "
                          f"their tests ({'; '.join(errors)}): each replacement would die the same way")
        elif self.stall_s > 0:
            running = bool(self.state.running)
            if running and self.allowance is None:
                return None  # --timeout 0: a test may take any time
            bound = self.stall_s + (self.allowance if running else 0.0)
            starting = not self._seen or any(w.get("event") in ("starting", "ready")
                                             for w in self.state.workers.values())
            if starting:
                bound = max(bound, STARTUP_S)
            if now - self.last > bound:
                self.fired = (f"no progress for {now - self.last:.0f} s (--stall-timeout {self.stall_s:g} s"
                              + (f", beyond the running test's --timeout and its C watchdog, {self.allowance:g} s"
                                 if running else "") + (f"; {STARTUP_S:g} s at least while a process starts"
                                                        if starting else "") + ")")
        if self.fired is not None:
            self.description = self.describe()  # before the processes are ended
        return self.fired

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def describe(self) -> str:
        """The last test and the state of each worker (or of pytest, serially), for the line ``run`` prints."""
        st = self.state
        last = (f"last test {st.last_test[1]}: {st.last_test[0]}" if st.last_test else "no test had started")
        running = f"; running: {', '.join(st.running)}" if st.running else "; no test running"
        todo = len(st.collection) - st.finished if st.collection is not None else None
        counts = (f"; {st.finished} tests finished" + (f" of {len(st.collection)}" if st.collection is not None
                                                       else "") + (f", {todo} not finished" if todo else ""))
        if st.workers:
            workers = "; workers: " + ", ".join(f"{wid} {_worker_state(w)}" for wid, w in sorted(st.workers.items()))
        else:
            workers = f"; pytest (no xdist worker): {process_state(self.pid)}"
        return last + running + counts + workers


def _worker_state(w: dict) -> str:
    event = w.get("event")
    if event == "down":
        why = ", ".join(str(w[k]) for k in ("error", "fatal") if w.get(k))
        return "down" + (f" ({why})" if why else "")
    what = {"starting": "starting", "ready": "started, collecting",
            "collected": f"collected {w.get('tests', '?')} tests"}.get(event, str(event))
    return f"{what} ({process_state(w.get('pid'))})"


_STATES = {"R": "running", "S": "sleeping", "D": "in uninterruptible wait", "T": "stopped", "t": "stopped",
           "Z": "a zombie", "X": "dead", "I": "idle"}


def process_state(pid: int | None) -> str:
    """``pid N: sleeping, 1.2 s CPU`` from /proc (Linux), ``pid N: gone`` when it has ended."""
    if not pid:
        return "pid unknown"
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return f"pid {pid}: gone"
    fields = stat.rpartition(")")[2].split()
    try:
        cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (IndexError, ValueError, OSError):
        cpu = None
    state = _STATES.get(fields[0] if fields else "?", fields[0] if fields else "?")
    return f"pid {pid}: {state}" + (f", {cpu:.1f} s CPU" if cpu is not None else "")
