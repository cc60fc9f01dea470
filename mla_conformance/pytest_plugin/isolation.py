"""A run that survives its backend: crashes, hangs and CUDA faults of the code under test become results.

The plugin (:mod:`mla_conformance.pytest_plugin`) uses these pieces; ``mla-conformance run`` reads what they leave.

* **Timeouts** (``--mla-timeout SECONDS``, default :data:`DEFAULT_TIMEOUT_S`, 0 = off): each suite test's
  setup, call and teardown together get that long. Past it, ``SIGALRM`` raises :class:`TestTimeout` in the
  test ("timed out after N s", with the stack of every thread from :mod:`faulthandler`): an *error*, and the
  run goes on in the same process. A hang Python cannot interrupt (native code that blocks signals or holds
  the GIL) meets a second, C-level watchdog :func:`hard_deadline` seconds later: faulthandler dumps every
  thread into the process's fault file and ends the process; under xdist the controller records the test as
  timed out and xdist starts a fresh worker.
* **Crashes**: a worker that dies (a signal, ``os._exit``) is reported by xdist as "crashed while running
  <nodeid>"; the controller adds how it died (:func:`describe_exit`) and the fatal-error dump faulthandler
  wrote into the worker's fault file, and the test is an *error* recorded as ``crashed``.
* **CUDA faults** (:func:`cuda_fault`): an out-of-memory error or a CUDA error is an *error* naming it;
  after a sticky one (an illegal memory access, a device-side assert, ...: the CUDA context is unusable)
  the worker ends itself once the test is reported, so xdist replaces it rather than reuse the context.
* **The journal** (:class:`Journal`, ``<--mla-results FILE>.journal``): one JSON line per test started, per
  result and per test finished, the run's collection, and each xdist worker's start, collection and end,
  written as they happen by the process that writes the results file: what a run that was killed had
  gathered (:func:`read_journal`), and what ``run``'s watch over the whole run reads to see it make progress
  (:mod:`mla_conformance.runner.watchdog`).
"""

from __future__ import annotations

import faulthandler
import json
import os
import re
import signal
import tempfile
import threading
from pathlib import Path

#: Default of ``--mla-timeout`` / ``run --timeout``: one test's setup + call + teardown. Generous: the largest
#: presets on a GPU take seconds, a real checkpoint's load on CPU minutes.
DEFAULT_TIMEOUT_S = 900.0

#: The fault-file prefix faulthandler writes when its watchdog fires (``dump_traceback_later``).
_WATCHDOG_HEAD = "Timeout ("


def hard_deadline(timeout: float) -> float:
    """Seconds after which the C-level watchdog ends a process whose test ignored its timeout: the timeout
    plus a tenth of it (at least 0.5 s, at most 30 s) for the timeout's exception to unwind."""
    return timeout + min(30.0, max(0.5, timeout / 10))


class TestTimeout(BaseException):
    """A test ran past ``--mla-timeout`` (a BaseException: a backend's ``except Exception`` cannot swallow it)."""

    __test__ = False  # not a test class, whatever pytest's python_classes say


# --------------------------------------------------------------------------- how a process died


_SIGNAL_NOTES = {
    "SIGSEGV": "segmentation fault: an invalid memory access in native code",
    "SIGBUS": "bus error: a misaligned or unmapped memory access in native code",
    "SIGILL": "illegal instruction: code built for another CPU, or a corrupted stack",
    "SIGFPE": "arithmetic fault in native code (an integer division by zero)",
    "SIGABRT": "abort(): a failed assertion or std::terminate in native code",
    "SIGKILL": "killed outright: the kernel's out-of-memory killer, or someone's kill -9",
    "SIGTERM": "terminated by a signal from outside",
}


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe_exit(returncode: int | None) -> str:
    """How a process ended, from its return code (negative: the signal that killed it)."""
    if returncode is None:
        return "died (its exit status could not be read)"
    if returncode < 0:
        name = signal_name(-returncode)
        note = _SIGNAL_NOTES.get(name)
        return f"was killed by {name}" + (f" ({note})" if note else "")
    return f"exited with code {returncode} (os._exit() or exit() in native code, or a fatal error)"


def fatal_signal_of(dump: str) -> str | None:
    """The fatal error faulthandler names in a dump ("Fatal Python error: Segmentation fault"), or None."""
    m = re.search(r"Fatal Python error: ([^\n]+)", dump or "")
    return m.group(1).strip() if m else None


def is_watchdog_dump(dump: str) -> bool:
    return (dump or "").lstrip().startswith(_WATCHDOG_HEAD)


_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")


def normalise_stacks(dump: str, limit: int = 20_000) -> str:
    """A faulthandler dump with thread addresses replaced (they change every run), at most ``limit`` chars."""
    text = _ADDRESS.sub("0x…", dump or "").strip()
    return text if len(text) <= limit else text[:limit] + "\n… (cut)"


def innermost_frame(dump: str) -> str | None:
    """``file:line in function`` of the innermost frame of the thread faulthandler marks current (else the
    last thread listed: the main thread, whose frames come last)."""
    blocks = re.split(r"\n(?=(?:Current thread|Thread) )", "\n" + (dump or ""))
    blocks = [b for b in blocks if b.strip()]
    current = [b for b in blocks if b.lstrip().startswith("Current thread")]
    for block in (current or blocks[-1:]):
        m = re.search(r'File "([^"]+)", line (\d+) in (\S+)', block)
        if m:
            return f"{m.group(1)}:{m.group(2)} in {m.group(3)}"
    return None


# --------------------------------------------------------------------------- CUDA faults

#: Errors after which the CUDA context is unusable ("sticky"): every later CUDA call in the process fails.
STICKY_CUDA = ("illegal memory access", "misaligned address", "illegal instruction", "unspecified launch failure",
               "device-side assert", "uncorrectable ecc error", "hardware stack error", "launch timed out",
               "cublas_status_execution_failed", "an illegal address")


def _chain(exc):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def cuda_fault(exc: BaseException | str | None) -> tuple[str, bool] | None:
    """(what, sticky) for a CUDA out-of-memory error or CUDA error anywhere in ``exc``'s chain (or message),
    else None. ``what`` names it ("CUDA out of memory", "CUDA error: an illegal memory access was
    encountered"); ``sticky``: the CUDA context is unusable after it."""
    if exc is None:
        return None
    excs = [exc] if isinstance(exc, str) else list(_chain(exc))
    for e in excs:
        text = e if isinstance(e, str) else f"{type(e).__name__}: {e}"
        low = text.lower()
        oom = type(e).__name__ == "OutOfMemoryError" or "cuda out of memory" in low or "cudaerrormemoryallocation" in low
        if oom:
            return "CUDA out of memory", False
        m = re.search(r"(cuda error: [^\n]+|cudaError\w*[^\n]*|cublas_status_\w+)", text, re.IGNORECASE)
        if m or type(e).__name__ == "AcceleratorError":
            what = (m.group(1) if m else str(e).splitlines()[0] if str(e) else type(e).__name__).strip()
            return what, any(s in low for s in STICKY_CUDA)
    return None


# --------------------------------------------------------------------------- a test's fault, described


def crash_fault(dump: str, returncode: int | None, timeout: float, started: bool) -> tuple[dict, str]:
    """(fault, reason) of a test whose xdist worker died while it was the worker's current test: ended by the
    watchdog (``timeout``: its dump in the worker's fault file), else crashed (how the process ended, the fatal
    error faulthandler named, the innermost frame); ``started``: the test had begun."""
    stack = current_block(dump)
    where = innermost_frame(dump)
    if is_watchdog_dump(dump):
        return ({"kind": "timeout", "after_s": timeout, "native": True, "stack": stack},
                f"timed out after {timeout:g} s (--mla-timeout)" + (f" in {where}" if where else "") +
                ": Python could not interrupt it (a native call that blocks signals or holds the GIL, a hung "
                "kernel), so its worker process was ended and a fresh one runs the rest")
    how = describe_exit(returncode)
    fatal = fatal_signal_of(dump)
    fault = {"kind": "crashed", "exit_code": returncode, "stack": stack}
    if returncode is not None and returncode < 0:
        fault["signal"] = signal_name(-returncode)
    return fault, (f"crashed: its worker process {how}" +
                   (f" ({fatal})" if fatal and fatal.lower() not in how.lower() else "") +
                   (f" in {where}" if where else "") +
                   (" while running it" if started else " before this test started (it did not run)") +
                   "; a fresh worker runs the rest")


def exception_fault(exc: BaseException, typename: str, timeout: float, worker: bool) -> dict | None:
    """A timeout or CUDA fault in a test's exception, as the results entry's ``fault`` with its one-line
    ``reason`` (popped by the caller), else None. ``worker``: the test ran in an xdist worker (a sticky CUDA
    error ends the worker; serially it stops the run)."""
    if isinstance(exc, TestTimeout):
        head, _, stacks = str(exc).partition("\n\nstacks of every thread (faulthandler):\n")
        return {"kind": "timeout", "after_s": timeout, "native": False, "stack": current_block(stacks), "reason": head}
    cuda = cuda_fault(exc)
    if cuda is None:
        return None
    what, sticky = cuda
    first = (f"{typename}: {exc}".strip().splitlines() or [""])[0]
    if not sticky:
        return {"kind": "cuda", "error": what, "sticky": False,
                "reason": f"{what} (the backend ran out of GPU memory: a smaller preset or batch, or a leak in "
                          f"the backend): {first}"}
    after = ("the worker process ends after this test and xdist starts a fresh one" if worker else
             "the run stops after this test (serial: run under xdist, e.g. -n 1, to have the process replaced)")
    return {"kind": "cuda", "error": what, "sticky": True,
            "reason": f"{what} (sticky: the CUDA context is unusable; {after}): {first}"}


# --------------------------------------------------------------------------- per-test watch


class Watch:
    """Per process: arms the soft timeout (SIGALRM) and the hard watchdog (faulthandler) around each test."""

    def __init__(self, timeout: float, fault_file=None):
        self.timeout = float(timeout)
        self.fault_file = fault_file  # where the watchdog's dump goes (a worker's fault file, else stderr)
        self._old = None
        self._can_alarm = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()

    def _on_alarm(self, signum, frame):
        buf = tempfile.TemporaryFile(mode="w+")
        try:
            faulthandler.dump_traceback(file=buf, all_threads=True)
            buf.seek(0)
            stacks = normalise_stacks(buf.read())
        finally:
            buf.close()
        where = f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}" if frame else None
        raise TestTimeout(f"timed out after {self.timeout:g} s (--mla-timeout)" + (f" in {where}" if where else "")
                          + "\n\nstacks of every thread (faulthandler):\n" + stacks)

    def arm(self) -> None:
        if self.timeout <= 0:
            return
        if self.fault_file is not None:  # this test's dump only
            self.fault_file.seek(0)
            self.fault_file.truncate()
            self.fault_file.flush()
        if self._can_alarm:
            self._old = signal.signal(signal.SIGALRM, self._on_alarm)
            signal.setitimer(signal.ITIMER_REAL, self.timeout)
        faulthandler.dump_traceback_later(hard_deadline(self.timeout), exit=True,
                                          file=self.fault_file if self.fault_file is not None else sys_stderr())

    def disarm(self) -> None:
        if self.timeout <= 0:
            return
        faulthandler.cancel_dump_traceback_later()
        if self._can_alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            if self._old is not None:
                signal.signal(signal.SIGALRM, self._old)
            self._old = None


_STDERR = []


def sys_stderr():
    """A file on the process's real stderr (fd 2 duplicated once: pytest captures sys.stderr during tests)."""
    if not _STDERR:
        _STDERR.append(os.fdopen(os.dup(2), "w"))
    return _STDERR[0]


# --------------------------------------------------------------------------- the journal


def journal_path(results_path: str | Path) -> Path:
    return Path(str(results_path) + ".journal")


class Journal:
    """Append-only JSON lines: ``{"header": …}``, ``{"collection": [nodeid, …]}``, ``{"start": nodeid}``,
    ``{"result": entry}``, ``{"finish": nodeid}``, ``{"worker": id, "event": "starting" | "ready" | "collected" |
    "down", …}``; each line flushed as it is written."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._fh = open(self.path, "a", encoding="utf-8", buffering=1)

    def write(self, record: dict) -> None:
        if self._fh is None:
            return
        try:
            self._fh.write(json.dumps(record, sort_keys=True, default=str) + "\n")
            self._fh.flush()
        except (OSError, ValueError):
            pass

    def close(self, remove: bool = False) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        if remove:
            self.path.unlink(missing_ok=True)


class JournalState:
    """What a journal's records say, fed in order (:meth:`feed`): ``header`` (dict or None), ``results``
    {nodeid: entry}, ``running`` {nodeid: None} (started, not finished, in start order), ``finished`` (count),
    ``collection`` (the node ids the run collected, or None), ``workers`` {id: the worker's last event, with
    its pid, test count and error}, ``last_test`` (nodeid, "started" or "finished") and
    ``deaths_before_collection`` (workers in a row that died, down with an error, before collecting). One reader
    for `run`'s report of a dead pytest and for its watch over a live one (:mod:`mla_conformance.runner.watchdog`)."""

    def __init__(self):
        self.header: dict | None = None
        self.results: dict[str, dict] = {}
        self.running: dict[str, None] = {}
        self.finished = 0
        self.collection: list[str] | None = None
        self.workers: dict[str, dict] = {}
        self.last_test: tuple[str, str] | None = None
        self.deaths_before_collection = 0

    def feed(self, line: str) -> bool:
        """One line of the journal; False for a torn or foreign line (the writer was killed mid-line)."""
        try:
            rec = json.loads(line)
        except ValueError:
            return False
        if not isinstance(rec, dict):
            return False
        if "header" in rec:
            self.header = rec["header"]
        elif "start" in rec:
            self.running[rec["start"]] = None
            self.last_test = (rec["start"], "started")
        elif "finish" in rec:
            self.running.pop(rec["finish"], None)
            self.finished += 1
            self.last_test = (rec["finish"], "finished")
        elif "collection" in rec:
            if self.collection is None and isinstance(rec["collection"], list):
                self.collection = [str(n) for n in rec["collection"]]
        elif "worker" in rec:
            state = self.workers.setdefault(str(rec["worker"]), {})
            # a death: down with an error (xdist also takes down, without one, the replacements it started just
            # before the last test finished, uncollected: no death)
            if rec.get("event") == "down" and rec.get("error") and state.get("event") != "collected":
                self.deaths_before_collection += 1
            elif rec.get("event") == "collected":
                self.deaths_before_collection = 0
            state.update({k: v for k, v in rec.items() if k != "worker"})
        elif isinstance(rec.get("result"), dict) and rec["result"].get("nodeid"):
            self.results[rec["result"]["nodeid"]] = rec["result"]
        else:
            return False
        return True


def read_journal(path: str | Path) -> dict:
    """What a journal holds (:class:`JournalState`): ``header``, ``results``, ``running`` (a list, in start
    order), ``collection`` and ``workers``. A torn last line (the writer was killed) is ignored."""
    state = JournalState()
    try:
        lines = Path(path).read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        lines = []
    for line in lines:
        state.feed(line)
    return {"header": state.header, "results": state.results, "running": list(state.running),
            "collection": state.collection, "workers": state.workers}


def params_from_nodeid(nodeid: str, backends, ops) -> dict:
    """A test's backend and op when no report of it carried its parameters: the names (of ``backends`` and
    ``ops``) in its id's parameters (the longest that matches)."""
    params = nodeid.partition("[")[2].rstrip("]")
    if not params:
        return {}
    found = {}
    for key, names in (("backend", backends), ("op", ops)):
        hits = [n for n in names if params == n or params.startswith(n + "-") or params.endswith("-" + n)
                or f"-{n}-" in params]
        if hits:
            found[key] = max(hits, key=len)
    return found


def current_block(dump: str, limit: int = 8_000) -> str:
    """The stack of the thread faulthandler marks current (else the last thread listed), addresses
    normalised: what a report keeps (the other threads' stacks change from run to run)."""
    blocks = [b for b in re.split(r"\n(?=(?:Current thread|Thread) )", "\n" + (dump or "")) if b.strip()]
    current = [b for b in blocks if b.lstrip().startswith("Current thread")]
    chosen = (current or blocks[-1:] or [""])[0]
    lines = chosen.strip().splitlines()
    for i, line in enumerate(lines):  # the frames of the code under test, not pytest's and xdist's below them
        if i and any(p in line for p in ("/_pytest/", "/pluggy/", "/xdist/", "/execnet/")):
            lines = lines[:i]
            break
    return normalise_stacks("\n".join(lines), limit)
