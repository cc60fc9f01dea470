"""``mla-conformance run``: the suites in a pytest subprocess (pytest's own progress on the terminal), every
test's outcome and figures collected through the plugin's ``--mla-results``, the report written into the
output directory (:mod:`mla_conformance.report.outdir`):

* ``conformance.json`` -- versioned schema; environment, a verdict per backend and op, per-test outcome,
  skip reason and figures (:mod:`mla_conformance.report.build`). Byte-identical between two runs on the
  same machine, with or without ``-n N``.
* ``conformance.md`` -- :mod:`mla_conformance.report.markdown`.
* ``timings.json`` -- wall times and benchmark figures, kept apart so the report stays deterministic.
* PNG plots of what the run measured (:mod:`mla_conformance.report.plots`).

Inputs are checked first; a run that fails before pytest writes nothing (not even an empty ``reports/``).
``run`` exits non-zero when a backend or op fails or is NOT TESTED (unless it was not named and the pytest
arguments narrowed the selection). A test whose worker died, that timed out or hit a CUDA fault is an error
with a ``fault`` (:mod:`mla_conformance.pytest_plugin.isolation`); a run that makes no progress is ended by
its watch (:mod:`mla_conformance.runner.watchdog`) and reported from the journal; SIGINT / SIGTERM keep the
results gathered so far beside ``--out`` and leave the previous report as it was.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from mla_conformance.arch.device import check_device
from mla_conformance.contract.layer import BUILTINS
from mla_conformance.contract.op import BUILTIN_OPS
from mla_conformance.engine.report import add_engine_rows, print_engine_rows
from mla_conformance.engine.report import run_options as engine_run_options
from mla_conformance.errors import MLAInputError
from mla_conformance.model.checkpoint import validate_checkpoint
from mla_conformance.pytest_plugin import isolation
from mla_conformance.report.build import build_report, timings_of
from mla_conformance.report.environment import environment
from mla_conformance.report.markdown import render_markdown
from mla_conformance.report.outdir import check_out_dir, write_file_atomically, write_owned_dir
from mla_conformance.report.plots import safe_plots
from mla_conformance.runner.suites import find_suites
from mla_conformance.runner.watchdog import DEFAULT_STALL_S, RunWatch
from mla_conformance.resources import pytest_run_args
from mla_conformance.specs import spec_name


def default_name() -> str:
    return platform.node().split(".")[0] or "local"


def _check_name(name: str) -> str:
    if not name or name in (".", "..") or "/" in name or "\\" in name or name.strip() != name:
        raise MLAInputError(f"--name {name!r}: a report name is one word (letters, digits, -, _, .)")
    return name


def write_report(out: Path, results: dict, *, name: str, env: dict, wall: float, pytest_exit: int) -> dict:
    """Build and write the report directory from the plugin's results; returns the report."""
    report = add_engine_rows(build_report(results, name=name, env=env), results)  # --engine's rows
    timings = timings_of(results)
    files = {"conformance.json": json.dumps(report, indent=1, sort_keys=True) + "\n",
             "conformance.md": lambda plots: render_markdown(report, plots=plots),
             "timings.json": json.dumps({"wall_s": round(wall, 3), "pytest_exit": pytest_exit,
                                         "finished_unix": int(time.time()), "benchmarks": timings},
                                        indent=1, sort_keys=True) + "\n"}
    report["_plots"] = write_owned_dir(out, files, kind="report",
                                       extra=lambda tmp: safe_plots({**report, "timings": timings}, tmp))
    return report


def run_command(args) -> int:
    """``mla-conformance run``: every input checked (one line naming it on error) before anything is written,
    the output directory last, then pytest in a subprocess and the report from its results."""
    suites = Path(args.suites) if args.suites else find_suites()
    if args.suites and not (suites / "test_cache_bytes.py").is_file():
        raise MLAInputError(f"--suites {args.suites}: not the suites directory (no test_cache_bytes.py)")
    name = _check_name(args.name or default_name())
    device = check_device(args.device) if args.device else None
    # fail fast, naming the spec, before anything is written
    backend_names = [checked_spec_name(spec, "backend") for spec in args.backend or []]
    suite_paths, engine_opts, engine_only = engine_run_options(args, suites)  # --engine (docs/engines.md)
    op_names = []
    for spec in args.op or []:
        try:
            op_names.append(checked_spec_name(spec, "op"))
        except MLAInputError as exc:
            raise MLAInputError(f"--op: {exc}") from None
    if args.checkpoint:
        try:
            validate_checkpoint(args.checkpoint)
        except MLAInputError as exc:
            raise MLAInputError(f"--checkpoint: {exc}") from None
    out = check_out_dir(args.out if args.out else Path("reports") / name, "report")  # creates nothing
    user_args = list(args.pytest_args or [])
    partial = partial_results_path(out)
    with tempfile.TemporaryDirectory(prefix="mla-conformance-run-") as tmpdir:
        results_path = Path(tmpdir) / "results.json"
        cmd = [sys.executable, "-m", "pytest", *suite_paths, *pytest_run_args(suites, tmpdir), "--mla-results",
               str(results_path), "-rfE"]
        for spec in args.backend or []:
            cmd += ["--mla-backend", spec]
        for spec in args.op or []:
            cmd += ["--mla-op", spec]
        cmd += engine_opts
        for w in args.world_size or []:  # the distributed layer cases at W ranks (suites/test_distributed.py)
            cmd += ["--mla-world-size", str(w)]
        if args.checkpoint:
            cmd += ["--mla-checkpoint", args.checkpoint]
        if device:
            cmd += ["--mla-device", device]
        if args.timeout is not None:
            cmd += ["--mla-timeout", f"{args.timeout:g}"]
        # engine only: serial (no -n: none of a checkout's addopts), each xdist worker would start the engines again
        cmd += ([] if engine_only else isolation_args(user_args)) + threads_args(user_args) + user_args
        print(f"mla-conformance run: {' '.join(cmd[2:])}", flush=True)
        journal = isolation.journal_path(results_path)
        stall = DEFAULT_STALL_S if args.stall_timeout is None else args.stall_timeout
        watch = RunWatch(journal, stall_s=stall, now=time.monotonic(),
                         test_timeout_s=isolation.DEFAULT_TIMEOUT_S if args.timeout is None else args.timeout)
        t0 = time.perf_counter()
        returncode, signum = _run_pytest(cmd, watch)
        wall = time.perf_counter() - t0
        watch.close()
        if signum is not None:
            return _interrupted(signum, out, partial, results_path, journal)
        results = None
        if watch.fired:  # pytest was ended: the journal has what it gathered
            print(f"mla-conformance run: the run stalled: {watch.fired}; {watch.description}; pytest and its "
                  "workers were ended; " + ("the report holds the results recorded, the running tests as stalled "
                                            "and the tests not reached as not run" if watch.state.collection is not None
                                            else "the report holds no test: none had been collected"), file=sys.stderr)
            results = results_from_journal(journal, returncode, stalled=watch.fired)
            if results is None:
                print("mla-conformance run: no result had been recorded; no report written", file=sys.stderr)
                return 1
            returncode = 1
        elif results_path.exists():
            try:
                results = json.loads(results_path.read_text())
            except ValueError as exc:
                print(f"mla-conformance run: the results pytest wrote are not JSON ({exc}); no report written",
                      file=sys.stderr)
                return returncode or 1
        else:  # pytest itself died (a serial run: no worker to replace): the journal has what it gathered
            results = results_from_journal(journal, returncode, Path(str(results_path) + ".fault"))
            if results is None:
                print(f"mla-conformance run: pytest {isolation.describe_exit(returncode)} before any result was "
                      "recorded (while it started or collected: loading a backend or op, a conftest or a plugin; "
                      "the stack above, from faulthandler, says where); no report written", file=sys.stderr)
                return returncode if returncode > 0 else 1
            died = [t for t in results["tests"] if (t.get("fault") or {}).get("serial")]
            print(f"mla-conformance run: pytest {isolation.describe_exit(returncode)}"
                  + (f" while running {', '.join(t['nodeid'] for t in died)}" if died else "")
                  + "; the tests after it did not run (a serial run: "
                  + ("the engine suite runs serially" if engine_only else "`-p no:xdist` or `-n 0` given")
                  + ", so no worker could be replaced); the report holds what was recorded", file=sys.stderr)
            returncode = returncode if returncode > 0 else 1
    report = write_report(out, results, name=name, env=environment(results.get("device", "cpu")), wall=wall,
                          pytest_exit=returncode)
    _remove_partial(partial)
    plots = report.pop("_plots")
    written = ["conformance.json", "conformance.md", "timings.json"] + plots
    print(f"mla-conformance run: wrote {out}: {', '.join(written)} in {wall:.1f} s")
    judged = [(b, v, report["summary"][b]) for b, v in sorted(report["verdicts"].items())]
    judged += [(f"op {o}", v, v["summary"]) for o, v in sorted((report.get("op_results") or {}).items())]
    for who, v, s in judged:
        print(f"  {who}: {v['verdict']} ({s['passed']} passed, {s['failed']} failed, {s['error']} errors, "
              f"{s['skipped']} skipped)")
    faults = [t for t in report["tests"] if (t.get("fault") or {}).get("kind") in ("crashed", "timeout", "stalled")]
    for t in faults:
        print(f"  {t['fault']['kind'].upper()}: {t['nodeid']}: {t.get('reason', '')}", file=sys.stderr)
    not_run = [t for t in report["tests"] if (t.get("fault") or {}).get("kind") == "not-run"]
    if not_run:
        print(f"  NOT RUN: {len(not_run)} test{'s' if len(not_run) != 1 else ''} (errors in the report): "
              f"{not_run[0]['reason']}", file=sys.stderr)
    print_engine_rows(report)
    not_selected = [who for who, v, _ in judged if v["verdict"] == "NOT SELECTED"]
    if not_selected and not watch.fired:
        print(f"mla-conformance run: not selected (no test of theirs matched the pytest arguments; not a failure): "
              f"{', '.join(not_selected)}")
    named = {f"op {n}" for n in op_names} | set(backend_names)
    narrowed = narrows_selection(user_args)
    not_tested = [who for who, v, _ in judged if v["verdict"] == "NOT TESTED"]
    failing = [who for who in not_tested if who in named or not (narrowed or engine_only)]
    if not_tested:
        tolerated = [who for who in not_tested if who not in failing]
        print(f"mla-conformance run: NOT TESTED: {', '.join(not_tested)}: every selected test skipped "
              f"(skip reasons in {out / 'conformance.md'})"
              + (f"; not failing the run for {', '.join(tolerated)}: not named by --backend/--op, and the "
                 "pytest arguments narrowed the selection" if tolerated else ""), file=sys.stderr)
        if failing:
            return returncode or 1
    return returncode


def checked_spec_name(spec: str, kind: str) -> str:
    """:func:`mla_conformance.specs.spec_name`, the user's code loaded in a forked child when this process is a
    command's (one thread): an import or constructor that crashes the process (a segfault in an extension) is one
    line naming the spec and how the process died, as a spec that raises is, and nothing is written. In a
    process with threads (a test calling the command in-process) it loads here: forking would copy their locks."""
    if spec.strip() in (BUILTIN_OPS if kind == "op" else BUILTINS) or threading.active_count() > 1 \
            or not hasattr(os, "fork"):
        return spec_name(spec, kind)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the name, or the error's message, then out without running any cleanup
        os.close(read)
        try:
            try:
                out = {"name": spec_name(spec, kind)}
            except MLAInputError as exc:
                out = {"error": str(exc)}
            except BaseException as exc:  # noqa: BLE001 - reported as spec_name would have raised it
                out = {"error": f"{spec}: {type(exc).__name__}: {exc}"}
            os.write(write, json.dumps(out).encode())
        finally:
            for stream in (sys.stdout, sys.stderr):  # what the spec's import printed
                stream.flush()
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as fh:
        data = fh.read()
    _, status = os.waitpid(pid, 0)
    try:
        got = json.loads(data.decode()) if data else {}
    except ValueError:
        got = {}
    if "name" in got:
        return got["name"]
    if "error" in got:
        raise MLAInputError(got["error"])
    code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    raise MLAInputError(f"{spec}: the process loading this {kind} {isolation.describe_exit(code)} (a crash in "
                        "its import or constructor): no test can run it")


def narrows_selection(pytest_args: list[str]) -> bool:
    """The pytest arguments select a subset of the suite (-k, -m, --deselect, a node id or a test file)."""
    for a in pytest_args:
        if a in ("-k", "-m", "--deselect", "--lf", "--last-failed") or a.startswith(("-k", "-m", "--deselect=")):
            return True
        if not a.startswith("-") and ("::" in a or a.endswith(".py")):
            return True
    return False


#: ``run`` runs its tests in xdist workers that are replaced when they die (:func:`default_workers` unless -n is
#: given); a backend that crashes in every test costs a worker start per test, bounded by this many restarts.
MAX_WORKER_RESTARTS = 1000
#: At most this many workers by default: a second worker uses a second core, and the report does not depend on the
#: count (tests/meta/test_report.py: plain and -n 2 byte-identical); each worker imports torch and transformers and
#: builds the session's weights and oracles itself, and on a GPU holds its own CUDA context, so more are left to
#: ``-n``.
DEFAULT_WORKERS_MAX = 2


def default_workers() -> int:
    """The workers of a run that does not choose: one per core this process may use, at most
    :data:`DEFAULT_WORKERS_MAX`."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(DEFAULT_WORKERS_MAX, cores))


def isolation_args(pytest_args: list[str], workers: int | None = None) -> list[str]:
    """The pytest arguments that make the run survive its backend: ``-n`` :func:`default_workers` (xdist workers,
    each replaced when it dies; ``workers`` overrides the count) unless the user chose the distribution (``-n``,
    ``--dist``, ``--tx``) or turned xdist off (``-p no:xdist``, ``--pdb``, ``--trace``); ``--max-worker-restart``
    unless given."""
    if importlib.util.find_spec("xdist") is None:
        return []
    joined = [a.replace(" ", "") for a in pytest_args]
    if "no:xdist" in joined or "-pno:xdist" in joined or any(a in ("--pdb", "--trace") for a in joined):
        return []
    marks = [pytest_args[i + 1] for i, a in enumerate(pytest_args[:-1]) if a == "-m"]
    if "--benchmark-only" in joined or any("benchmark" in m and "not benchmark" not in m for m in marks):
        return []  # pytest-benchmark does not time under xdist: benchmarks run in-process
    out = []
    chose = any(a in ("-n", "--numprocesses", "--dist", "-d", "--tx") or
                a.startswith(("-n", "--numprocesses=", "--dist=", "--tx=")) for a in joined)
    if not chose:
        out += ["-n", str(default_workers() if workers is None else workers)]
        if importlib.util.find_spec("pytest_benchmark"):  # its "disabled under xdist" warning: they are deselected
            out += ["-W", "ignore:Benchmarks are automatically disabled:pytest_benchmark.logger.PytestBenchmarkWarning"]
    if not any(a.startswith("--max-worker-restart") for a in joined):
        out += ["--max-worker-restart", str(MAX_WORKER_RESTARTS)]
    return out


def threads_args(pytest_args: list[str]) -> list[str]:
    """``--mla-threads 1`` unless the user gave a count: a report's figures do not depend on how the run was
    distributed (serial, -n N) or on the machine's core count (a reduction's order depends on the threads)."""
    return [] if any(a.startswith("--mla-threads") for a in pytest_args) else ["--mla-threads", "1"]


#: Seconds pytest gets to stop after run forwards SIGINT / SIGTERM before its process group is killed.
STOP_GRACE_S = 5.0


def _killpg(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


#: Popen's arguments for a child in a process group of its own (signalled and killed as a group) that stays in the
#: caller's session, so that it shares the CPU as the caller's other processes do (on Linux the scheduler groups
#: processes by session).
OWN_PROCESS_GROUP = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}


def pytest_group() -> dict:
    """How ``run`` starts its pytest: in a process group of its own (:data:`OWN_PROCESS_GROUP`), or, where one of
    run's standard streams is a terminal, in a session of its own (whose pgid is its pid too): a background process
    group of the terminal's session is stopped (SIGTTOU) when it writes to the terminal under ``stty tostop``, and
    whenever it reads from it (SIGTTIN: ``--pdb``); the terminal is not a new session's controlling terminal."""
    if any(os.isatty(fd) for fd in (0, 1, 2)):
        return {"start_new_session": True}
    return OWN_PROCESS_GROUP


def _run_pytest(cmd: list[str], watch: RunWatch | None = None) -> tuple[int, int | None]:
    """Run pytest in a process group of its own (:func:`pytest_group`); (its return code, the signal that
    interrupted ``run`` or None).

    SIGINT, SIGTERM or SIGHUP to ``run`` is forwarded to the whole group as SIGINT (pytest stops after
    saying where it was); a second signal, or pytest still running :data:`STOP_GRACE_S` later, kills the
    group. The ``watch`` (:mod:`mla_conformance.runner.watchdog`) is polled meanwhile: when the run has
    stalled the group is killed (``watch.fired`` says why). Whatever the group left running when pytest exits
    (a worker, a test's child) is killed too.
    """
    # faulthandler from the first line: a crash while pytest or a worker starts prints its stack too
    proc = subprocess.Popen(cmd, **pytest_group(), env={**os.environ, "PYTHONFAULTHANDLER": "1"})
    if watch is not None:
        watch.pid = proc.pid
    got: list[int] = []
    deadline: list[float] = []

    def forward(signum, frame):
        got.append(signum)
        if len(got) == 1:
            deadline.append(time.monotonic() + STOP_GRACE_S)
            _killpg(proc.pid, signal.SIGINT)
        else:
            _killpg(proc.pid, signal.SIGKILL)

    handled = (signal.SIGINT, signal.SIGTERM) + ((signal.SIGHUP,) if hasattr(signal, "SIGHUP") else ())
    old = {}
    if threading.current_thread() is threading.main_thread():
        old = {sig: signal.signal(sig, forward) for sig in handled}
    try:
        while True:
            try:
                returncode = proc.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                if deadline and time.monotonic() > deadline[0]:
                    _killpg(proc.pid, signal.SIGKILL)
                elif watch is not None and not got and watch.poll(time.monotonic()):
                    _killpg(proc.pid, signal.SIGKILL)
    except BaseException:
        _killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    _killpg(proc.pid, signal.SIGKILL)  # stragglers of the group (the leader is gone; its pgid is not reused
    # while members remain)
    return returncode, (got[0] if got else None)


def partial_results_path(out: Path) -> Path:
    """Where an interrupted run keeps the results it gathered: beside --out, never inside it."""
    return out.parent / f"{out.name}.partial-results.json"


PARTIAL_SCHEMA = "mla-conformance/partial-results"


def _remove_partial(path: Path) -> None:
    """A finished run's report supersedes an earlier interrupted run's partial results (ours only)."""
    try:
        if json.loads(path.read_text(encoding="utf-8")).get("schema") == PARTIAL_SCHEMA:
            path.unlink()
    except (OSError, ValueError, AttributeError):
        pass


def results_from_journal(journal: Path, returncode: int | None, fault_file: Path | None = None, *,
                         stalled: str | None = None) -> dict | None:
    """The results a pytest that died (or that ``run`` ended: ``stalled`` says why) had journalled: its running
    tests are errors (``stalled``; else ``crashed``, or ``timeout`` when the watchdog's dump is in
    ``fault_file``), the collected tests it never reached are errors (``not-run``); None when it journalled no
    test."""
    j = isolation.read_journal(journal)
    if j["header"] is None:
        return None
    tests = dict(j["results"])
    dump = ""
    if fault_file is not None:
        try:
            dump = fault_file.read_text(encoding="utf-8", errors="replace")
        except OSError:
            dump = ""
    for nodeid in j["running"]:
        entry = dict(tests.get(nodeid) or {"nodeid": nodeid})
        where = isolation.innermost_frame(dump)
        if stalled:
            fault = {"kind": "stalled"}
            reason = f"stalled: {stalled} while it ran; `mla-conformance run` ended the run"
        elif isolation.is_watchdog_dump(dump):
            fault = {"kind": "timeout", "native": True, "serial": True, "stack": isolation.current_block(dump)}
            reason = ("timed out (--mla-timeout)" + (f" in {where}" if where else "") + ": Python could not "
                      "interrupt it, so the watchdog ended pytest (a serial run: the tests after it did not run)")
        else:
            fault = {"kind": "crashed", "exit_code": returncode, "serial": True}
            if returncode is not None and returncode < 0:
                fault["signal"] = isolation.signal_name(-returncode)
            reason = (f"crashed: pytest {isolation.describe_exit(returncode)} while running it (a serial run: the "
                      "tests after it did not run)")
        entry.update(outcome="error", reason=reason, fault=fault)
        tests[nodeid] = entry
    why = (f"the run stalled ({stalled}) and `mla-conformance run` ended it" if stalled else
           f"pytest {isolation.describe_exit(returncode)}" + (f" while running {', '.join(j['running'])}"
                                                               if j["running"] else ""))
    header = j["header"]
    for nodeid in j["collection"] or []:
        if nodeid not in tests:
            tests[nodeid] = {"nodeid": nodeid, "outcome": "error", "reason": f"not run: {why}",
                             "fault": {"kind": "not-run"},
                             "params": isolation.params_from_nodeid(nodeid, header.get("backends") or [],
                                                                    header.get("ops") or [])}
    return {**header, "exitstatus": returncode, "tests": [tests[k] for k in sorted(tests)]}


def _interrupted(signum: int, out: Path, partial: Path, results_path: Path, journal: Path) -> int:
    """``run`` got SIGINT / SIGTERM: pytest is gone; keep what it gathered beside --out, say what ran."""
    j = isolation.read_journal(journal)
    results = None
    if results_path.exists():
        try:
            results = json.loads(results_path.read_text())
        except ValueError:
            results = None
    running = j["running"]
    if results is None and j["header"] is not None:  # a running test's entry holds only its setup: left out
        results = {**j["header"], "tests": [j["results"][k] for k in sorted(j["results"]) if k not in running]}
    name = isolation.signal_name(signum)
    msg = f"mla-conformance run: interrupted by {name}" + (
        f" while running {', '.join(running)}" if running else "") + "; pytest and its workers were ended"
    if results is not None and results.get("tests"):
        payload = {"schema": PARTIAL_SCHEMA, "interrupted_by": name, "running": running, **results}
        try:
            write_file_atomically(partial, json.dumps(payload, indent=1, sort_keys=True, default=str) + "\n")
            msg += f"; the {len(results['tests'])} results gathered so far are in {partial}"
        except OSError as exc:
            msg += f"; the results gathered so far could not be kept ({exc.strerror or exc})"
    else:
        msg += "; no result had been recorded yet"
    print(msg + f"; the previous report in {out} is untouched", file=sys.stderr)
    return 128 + signum
