"""The results of a run: one :class:`ResultsSession` per pytest process (``ResultsSession.of(config)``).

It turns each suite test's reports into its results entry (outcome, reason, parameters, device, section, the
figures of ``mla_figures``, a ``fault`` for a timeout, crash or CUDA fault) and, in the process that writes
``--mla-results FILE`` (a serial pytest, or the xdist controller), records every entry as its report arrives,
journals it (:class:`mla_conformance.pytest_plugin.isolation.Journal`) so that what a worker reported before it
died, or a run gathered before it was killed, is kept, and writes FILE at the end. Workers only report: an
entry travels with its report (``mla_result``).

It also holds the per-process run state the isolation needs: the tests started and finished, the timeout
watch, the fault files faulthandler writes into, a sticky CUDA error's test.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from _pytest.compat import NOTSET  # the value of an empty parameter set's one test (pytest has no public name)

from mla_conformance.pytest_plugin import isolation, selection
from mla_conformance.pytest_plugin.sentinel import Sentinel
from mla_conformance.errors import BackendError
from mla_conformance.schema import Figures

_KEY = pytest.StashKey["ResultsSession"]()
_FIGURES_KEY = pytest.StashKey[dict]()

#: the results' names of the parameters that say which backend or op a test judges (selection.KIND_FIXTURES)
PARAM_NAMES = {name: "backend" if kind == "layer" else kind
               for kind, names in selection.KIND_FIXTURES.items() for name in names}


def is_failure(excinfo) -> bool:
    """A check's verdict (AssertionError: the backend ran and is wrong) -- as opposed to an error (the
    backend raised or broke the contract's types: mla_conformance.errors.BackendError, or anything else)."""
    return excinfo is not None and isinstance(excinfo.value, AssertionError) and not isinstance(excinfo.value, BackendError)


def new_figures(item):
    """The ``mla_figures`` of a test: a :class:`mla_conformance.schema.Figures` (it refuses a key the
    schema does not declare), kept with the test; :func:`sync_figures` copies it into the reports."""
    figures = item.stash[_FIGURES_KEY] = Figures()
    return figures


def sync_figures(item) -> dict | None:
    """The test's figures so far as a plain dict, in its ``user_properties`` as ``("mla_figures", dict)`` (a
    plain dict: xdist's serializer takes no dict subclass); None and no entry when it recorded none."""
    figures = item.stash.get(_FIGURES_KEY, None)
    props = [p for p in item.user_properties if p[0] != "mla_figures"]
    plain = dict(figures) if figures else None
    if plain is not None:
        props.append(("mla_figures", plain))
    item.user_properties[:] = props
    return plain


def worker_popen(node):
    """The ``subprocess.Popen`` of an xdist worker started by execnet's popen gateway, or None."""
    return getattr(getattr(getattr(node, "gateway", None), "_io", None), "popen", None)


def worker_pid(node) -> int | None:
    return getattr(worker_popen(node), "pid", None)


#: A reason's line longer than this is cut (a long likely cause must not push the case off the reason).
REASON_LINE_CHARS = 600


def message_lines(msg: str) -> str:
    """A failure's reason: its message's first line (the headline: what failed, where, by how much) and the
    indented lines after it (the likely cause, got / expected, the bound's key, the case:
    :mod:`mla_conformance.messages`), each cut at :data:`REASON_LINE_CHARS`; pytest's own ``assert ...``
    explanation after them is left out."""
    lines = msg.strip().splitlines() or [""]
    kept = [lines[0].rstrip()]
    for line in lines[1:]:
        if not line.startswith(" "):
            break
        kept.append(line.rstrip())
    return "\n".join(line if len(line) <= REASON_LINE_CHARS else line[:REASON_LINE_CHARS - 1] + "…"
                     for line in kept[:12])


class ResultsSession:
    """This process's results and run state (see the module's docstring)."""

    def __init__(self, config):
        self.config = config
        self.results: dict[str, dict] | None = {} if config.getoption("--mla-results") else None
        self.running: dict[str, bool] = {}  # started, not finished (an interrupted test has no result)
        self.finished: set[str] = set()
        self.journal: isolation.Journal | None = None
        self._journal_opened = False
        self._header_written = False
        self._collection_written = False
        self.fault_file = None  # where faulthandler writes (a worker's file, or beside --mla-results)
        self.fault_dir: str | None = None  # xdist controller: the workers' fault files
        self.watch: isolation.Watch | None = None
        self.poisoned: str | None = None  # the test after which this worker ends (a sticky CUDA error)
        self.sentinel = Sentinel()  # a serial pytest that dies names its test (mla_conformance.pytest_plugin.sentinel)

    @classmethod
    def of(cls, config) -> "ResultsSession":
        session = config.stash.get(_KEY, None)
        if session is None:
            session = config.stash[_KEY] = cls(config)
        return session

    @property
    def is_worker(self) -> bool:
        return hasattr(self.config, "workerinput")

    @property
    def recording(self) -> bool:
        """This process records the results (it writes --mla-results): not an xdist worker."""
        return self.results is not None and not self.is_worker

    def timeout(self) -> float:
        value = self.config.getoption("--mla-timeout")
        return isolation.DEFAULT_TIMEOUT_S if value is None else max(0.0, float(value))

    # ----------------------------------------------------------------------- one test's entry

    def entry_of(self, item, call, rep) -> None:
        """Update the test's entry from one phase's report, and attach it to the report (an xdist controller
        records it from there)."""
        if self.results is None:
            return
        entry = self.results.setdefault(item.nodeid, {"nodeid": item.nodeid, "outcome": "passed"})
        params = getattr(item, "callspec", None)
        if params is not None:
            # the results' parameter names are the report's: the backend is "backend", not the fixture's name; an
            # empty parameter set's placeholder (pytest's NOTSET, whose .name is "token") names no backend or op
            entry["params"] = {PARAM_NAMES.get(k, k): (getattr(v, "name", None) or str(v))
                               for k, v in params.params.items() if v is not NOTSET}
        entry["device"] = selection.device_of(item.config)
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
            entry["outcome"] = "failed" if rep.when == "call" and is_failure(call.excinfo) else "error"
            if call.excinfo is not None:
                msg = f"{call.excinfo.typename}: {call.excinfo.value}" if entry["outcome"] == "error" else \
                    str(call.excinfo.value)
            else:
                crash = getattr(rep.longrepr, "reprcrash", None)
                msg = crash.message if crash else str(rep.longrepr)
            fault = self._fault_of(item, call.excinfo) if call.excinfo is not None else None
            if fault is not None:
                msg = fault.pop("reason")
                entry["fault"] = fault
            entry["reason"] = message_lines(msg)
        figures = item.stash.get(_FIGURES_KEY, None)
        if figures:
            entry["figures"] = dict(figures)
        rep.mla_result = json.dumps(entry, sort_keys=True, default=str)
        if rep.failed and call.excinfo is not None and call.excinfo.errisinstance(isolation.TestTimeout):
            rep.mla_fault = entry.get("fault")  # shown as TIMEOUT (pytest_report_teststatus)

    def _fault_of(self, item, excinfo) -> dict | None:
        """The entry's ``fault`` of a test's exception (with its ``reason``); after a sticky CUDA error this
        worker ends once the test is reported (serially, the run stops)."""
        worker = bool(os.environ.get("PYTEST_XDIST_WORKER"))
        fault = isolation.exception_fault(excinfo.value, excinfo.typename, self.timeout(), worker)
        if fault is not None and fault.get("sticky"):
            self.poisoned = item.nodeid
            if not worker:
                item.session.shouldstop = (f"sticky CUDA error in {item.nodeid} ({fault['error']}): this process's "
                                           "CUDA context is unusable, so no later test would say anything about its "
                                           "backend; run under xdist (-n 1) to have the process replaced")
        return fault

    # ----------------------------------------------------------------------- recording, as reports arrive

    def header(self, exitstatus) -> dict:
        kind = selection.deselected_kind(self.config)
        backends = [] if kind == "layer" else [b.name for b in selection.backends(self.config)]
        ops = [] if kind == "op" else selection.ops(self.config)
        return {"exitstatus": int(exitstatus) if exitstatus is not None else None,
                "device": selection.device_of(self.config), "backends": backends, "ops": [o.name for o in ops],
                "op_declarations": {o.name: selection.op_declarations(o) for o in ops}}

    def _write(self, record: dict) -> None:
        """One journal record (the journal beside --mla-results opened, with the header, on the first)."""
        if not self.recording:
            return
        if not self._journal_opened:
            self._journal_opened = True
            try:
                self.journal = isolation.Journal(isolation.journal_path(self.config.getoption("--mla-results")))
            except OSError:
                self.journal = None
        if self.journal is not None:
            if not self._header_written:
                self._header_written = True
                self.journal.write({"header": self.header(None)})
            self.journal.write(record)

    def started(self, nodeid: str) -> None:
        if self.recording:
            self.running[nodeid] = True
            self.finished.discard(nodeid)
            self._write({"start": nodeid})

    def collected(self, nodeids) -> None:
        """The tests the run is to run (a serial pytest's collection, or the first xdist worker's): `run` names
        from it the tests a run that was ended did not reach."""
        if self.recording and not self._collection_written:
            self._collection_written = True
            self._write({"collection": [str(n) for n in nodeids]})

    def worker_event(self, node, event: str, **info) -> None:
        """xdist controller: a worker starting, ready (its pid), collected (its test count) or down (its
        error); `run`'s watch sees the run make progress from these as from tests."""
        if self.recording:
            gateway = getattr(node, "gateway", None)
            pid = worker_pid(node)
            self._write({"worker": str(getattr(gateway, "id", None) or "?"), "event": event,
                         **({"pid": pid} if pid else {}), **info})

    def reported(self, report) -> None:
        if not self.recording or getattr(report, "mla_ignore", False):
            return
        data = getattr(report, "mla_result", None)
        fault = getattr(report, "mla_fault", None)
        if isinstance(data, str):
            entry = json.loads(data)
        elif fault is not None:  # xdist's report of a crashed test: its earlier entry, now an error
            entry = dict(self.results.get(report.nodeid) or {"nodeid": report.nodeid})
            if "params" not in entry:
                params = self._known_params(report.nodeid)
                if params:
                    entry["params"] = params
            entry.update(outcome="error", reason=report.mla_reason[:1000], fault=fault)
            entry.setdefault("device", selection.device_of(self.config))
        else:
            return  # another plugin's report (or a worker's report of a test outside the suite)
        self.results[report.nodeid] = entry
        self._write({"result": entry})
        if fault is not None and data is None:  # its worker is gone: the test will send no logfinish
            self.running.pop(report.nodeid, None)
            self.finished.add(report.nodeid)
            self._write({"finish": report.nodeid})

    def done(self, nodeid: str) -> None:
        if self.recording:
            self.running.pop(nodeid, None)
            self.finished.add(nodeid)
            self._write({"finish": nodeid})
        elif self.is_worker and self.poisoned == nodeid:
            # xdist has sent this test's reports and its logfinish; the controller sees the worker end after a
            # finished test and starts a fresh one (pytest_handlecrashitem)
            sys.stdout.flush()
            isolation.sys_stderr().write(f"\nmla-conformance: sticky CUDA error in {nodeid}: this worker's CUDA "
                                         "context is unusable; ending the worker so xdist replaces it\n")
            isolation.sys_stderr().flush()
            os._exit(0)

    def _known_params(self, nodeid: str) -> dict:
        """A crashed test's backend or op when no report of it carried its parameters: the name in its id."""
        names = {}
        for key, names_of in (("backend", lambda: [b.name for b in selection.backends(self.config)]),
                              ("op", lambda: [o.name for o in selection.ops(self.config)])):
            try:
                names[key] = names_of()
            except pytest.UsageError:
                names[key] = []
        return isolation.params_from_nodeid(nodeid, names["backend"], names["op"])

    def finish(self, exitstatus) -> None:
        """Write --mla-results (tests interrupted mid-test have no result) and close the journal and fault file."""
        if not self.recording:
            return
        path = self.config.getoption("--mla-results")
        payload = {**self.header(exitstatus),
                   "tests": [self.results[k] for k in sorted(self.results) if k not in self.running]}
        tmp = Path(path).with_suffix(".tmp")
        tmp.write_text(json.dumps(payload, indent=1, sort_keys=True, default=str))
        os.replace(tmp, path)
        if self.journal is not None:  # the results file holds it all now (interrupted: `run` reads what was running)
            self.journal.close(remove=int(exitstatus) != int(pytest.ExitCode.INTERRUPTED))
        if self.fault_file is not None:
            self.fault_file.close()
            Path(self.fault_file.name).unlink(missing_ok=True)
            self.fault_file = None

    # ----------------------------------------------------------------------- timeouts and crashes

    def open_fault_file(self) -> None:
        """Where faulthandler writes: an xdist worker's file in the controller's fault directory (fatal-error
        dumps and the watchdog's); serially, the watchdog's dump beside --mla-results, where `run` reads it
        when pytest itself was ended."""
        fault_dir = getattr(self.config, "workerinput", {}).get("mla_fault_dir")
        if fault_dir:
            import faulthandler

            name = f"{self.config.workerinput.get('workerid', 'gw')}.txt"
            self.fault_file = open(Path(fault_dir) / name, "w+", encoding="utf-8")
            faulthandler.enable(file=self.fault_file, all_threads=True)
        elif self.recording:
            try:
                self.fault_file = open(str(self.config.getoption("--mla-results")) + ".fault", "w+", encoding="utf-8")
            except OSError:
                pass

    def arm(self, item) -> bool:
        """Start the watch of a suite test (its torch threads fixed first); False when no timeout applies."""
        if not selection.is_suite_item(item):
            return False
        selection.fix_threads(item.config)
        timeout = self.timeout()
        if timeout <= 0:
            return False
        if self.watch is None or self.watch.timeout != timeout:
            self.watch = isolation.Watch(timeout, self.fault_file)
        self.watch.arm()
        return True

    def disarm(self) -> None:
        if self.watch is not None:
            self.watch.disarm()

    def configure_node(self, node) -> None:
        """xdist controller: each worker's fault file goes into one directory (beside --mla-results when it
        can), removed at the end."""
        if self.fault_dir is None:
            import shutil
            import tempfile

            results = self.config.getoption("--mla-results")
            where = Path(results).resolve().parent if results else None
            try:
                self.fault_dir = tempfile.mkdtemp(prefix="mla-conformance-faults-", dir=where)
            except OSError:
                self.fault_dir = tempfile.mkdtemp(prefix="mla-conformance-faults-")
            self.config.add_cleanup(lambda d=self.fault_dir: shutil.rmtree(d, ignore_errors=True))
        node.workerinput["mla_fault_dir"] = self.fault_dir

    def _read_fault_file(self, workerid: str, keep: bool = False) -> str:
        if not self.fault_dir:
            return ""
        path = Path(self.fault_dir) / f"{workerid}.txt"
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
            if not keep:
                path.unlink()
        except OSError:
            return ""
        return text

    def worker_down(self, node, error) -> None:
        """xdist controller: a worker ended (``error``: it died); the fatal error and innermost frame its fault
        file names go into the journal's record (a worker that dies while collecting has no test to carry them)."""
        info = {"error": str(error)[:500]} if error else {}
        if error:
            dump = self._read_fault_file(str(getattr(getattr(node, "gateway", None), "id", "?")), keep=True)
            fatal, where = isolation.fatal_signal_of(dump), isolation.innermost_frame(dump)
            if fatal or where:
                info["fatal"] = " in ".join(x for x in (fatal, where) if x)
        self.worker_event(node, "down", **info)

    def crashed(self, crashitem: str, report, node) -> None:
        """xdist: a worker died while ``crashitem`` was its current test. Say how it died and record the test
        as an error (``crashed``, or ``timeout`` when the watchdog ended it); a worker that ended itself after
        a finished test (a sticky CUDA error) is no crash of that test."""
        workerid = getattr(getattr(node, "gateway", None), "id", "?")
        popen = worker_popen(node)
        returncode = None
        if popen is not None:
            try:
                returncode = popen.wait(timeout=10)
            except Exception:  # noqa: BLE001 - still running or not a Popen: no code to report
                returncode = None
        dump = self._read_fault_file(workerid)
        if crashitem in self.finished and crashitem not in self.running:
            # its reports are all in: the worker ended after it (the plugin ends a worker after a sticky CUDA
            # error, so xdist replaces it); nothing to count
            report.outcome, report.when, report.longrepr = "passed", "teardown", None
            report.mla_ignore = True
            return
        fault, reason = isolation.crash_fault(dump, returncode, self.timeout(), crashitem in self.running)
        report.mla_fault = fault
        report.mla_reason = reason
        report.when = "call"
        report.longrepr = (f"{reason}\n\n(xdist: worker {workerid!r} crashed while running {crashitem!r})"
                           + (f"\n\n{dump.strip()}" if dump.strip() else ""))
