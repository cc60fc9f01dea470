"""A crash never hangs the run (issues 19, 27): every way a backend can kill or wedge a run, as a scenario that must
*end* with the expected verdict and counts -- a segfault, an abort, os._exit, a hang in C with signals blocked, a
crash on every first call (crashes in a row), a crash in collection and in the backend's import, a stopped process,
xdist's own wedge, serially, under xdist and through plain pytest: a real ``mla-conformance run`` (or a plain
``pytest``) process on a three-test suite of its own with the backends of ``impls/faulty/backends.py`` and
``impls/faulty/collection_backend.py``, whose pytest and workers really die.

A scenario passes when the process ended within :data:`BOUND_S` (the bound on a run that would otherwise hang:
generous, never a claim on speed), no process it started is left (each carries a marker in its environment),
the report is written with the expected outcome and fault of every test, and every crashed, timed-out or
stalled test is named on stderr. :func:`run_scenario` runs one, :func:`check` judges it; the default run makes
:data:`DEFAULT` once per session, three at a time (:func:`run_default`), and judges each in a test of its own;
``python -m tests.meta.test_fault_scenarios --repeat 10 --load`` runs :data:`SCENARIOS` over and over with a sibling
process keeping a core busy, and prints what each run gave.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from mla_conformance.resources import NO_UNUSED_PLUGINS
from mla_conformance.runner.run import OWN_PROCESS_GROUP

from .harness import processes_left, user_env


HERE = Path(__file__).resolve().parent
FAULTY = HERE / "impls" / "faulty" / "backends.py"
COLLECTION = HERE / "impls" / "faulty" / "collection_backend.py"

#: The suite: named test_cache_bytes.py because --suites DIR must hold one. Three attend calls per backend.
SUITE = '''import pytest


@pytest.mark.parametrize("k", [1, 2, 3])
def test_attend(mla_backend, k):
    assert mla_backend.attend(None, None, None, None) == "ok"
'''

#: Plugins the direct runs' processes need not load (each is imported and assertion-rewritten in every process;
#: `run` leaves out resources.UNUSED_PLUGINS itself).
LEAN = [*NO_UNUSED_PLUGINS, "-p", "no:randomly"]

#: Seconds a scenario's process may take before it counts as hung (and is killed): a bound on ending at all.
BOUND_S = 240

#: Seconds --stall-timeout in the scenarios that stall (a stopped process, xdist's wedge).
STALL_S = 3


def write_suite(tmp: Path) -> Path:
    d = tmp / "suite"
    d.mkdir()
    (d / "test_cache_bytes.py").write_text(SUITE)
    return d


def backend_args(*classes: str, flag: str = "--backend") -> list[str]:
    """``--backend PATH:Class`` per class (``impls/faulty/backends.py``'s unless ``collection:`` names the other file)."""
    out = []
    for c in classes:
        path = COLLECTION if c.startswith("collection:") else FAULTY
        out += [flag, f"{path}:{c.removeprefix('collection:')}"]
    return out


#: What a test's row must be: "passed", or the fault kind of an error ("crashed", "timeout", "stalled",
#: "not-run", "cuda").
@dataclass(frozen=True)
class Scenario:
    backends: tuple[str, ...]
    #: backend name -> its rows' kinds in test order (k = 1, 2, 3), or {kind: count or (counts allowed)} in any order
    expect: dict = field(default_factory=dict)
    pytest_args: tuple[str, ...] = ()
    run_args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    direct: bool = False  # plain `pytest`, not `mla-conformance run`
    signal: str | None = None  # the fatal signal named in a crashed row (else the exit code 3, or none)


P, C, T, S, N = "passed", "crashed", "timeout", "stalled", "not-run"
ONE_CRASH = {P: 2, C: 1}  # a process's 2nd call dies (which test that is depends on xdist's batches); the rest pass
#: one xdist worker, chosen (run's default is a worker per core, at most two: runner.run.default_workers; the
#: scenarios "n2" and "n2-stopped" run two)
ONE_WORKER = ("-n", "1")

SCENARIOS = {
    # one xdist worker (run's default on a one-core machine), replaced each time it dies
    "xdist": Scenario(("Good", "Segfault", "NativeHang", "SegfaultFirst"),
                      {"good": (P, P, P), "segfault": ONE_CRASH, "hang-native": {P: 2, T: 1},
                       "segfault-first": (C, C, C)}, ONE_WORKER, signal="SIGSEGV"),
    "xdist-abort-exit": Scenario(("Abort", "Exit"), {"abort": ONE_CRASH, "exit3": ONE_CRASH}, ONE_WORKER),
    # a crash in one worker while the other runs
    "n2": Scenario(("Good", "Segfault", "SegfaultFirst"), {"good": (P, P, P), "segfault": {P: 2, C: 1},
                                                          "segfault-first": (C, C, C)}, ("-n", "2")),
    # serial: pytest itself dies; the tests after the crash are errors "not run"
    "serial-segfault": Scenario(("Good", "Segfault"), {"good": (P, P, P), "segfault": (P, C, N)},
                                ("-p", "no:xdist"), signal="SIGSEGV"),
    "serial-abort": Scenario(("Good", "Abort"), {"good": (P, P, P), "abort": (P, C, N)}, ("-p", "no:xdist"),
                             signal="SIGABRT"),
    "serial-exit": Scenario(("Good", "Exit"), {"good": (P, P, P), "exit3": (P, C, N)}, ("-p", "no:xdist")),
    "serial-hang": Scenario(("Good", "NativeHang"), {"good": (P, P, P), "hang-native": (P, T, N)},
                            ("-p", "no:xdist")),
    "serial-first": Scenario(("SegfaultFirst", "Good"), {"segfault-first": (C, N, N), "good": (N, N, N)},
                             ("-p", "no:xdist"), signal="SIGSEGV"),
    # a process that cannot run at all (stopped): only run's watch over the whole run ends it
    "stopped": Scenario(("Good", "Stopped"), {"good": (P, P, P), "stopped": (P, S, N)}, ONE_WORKER,
                        run_args=("--stall-timeout", str(STALL_S))),
    "serial-stopped": Scenario(("Good", "Stopped"), {"good": (P, P, P), "stopped": (P, S, N)}, ("-p", "no:xdist"),
                               run_args=("--stall-timeout", str(STALL_S))),
    "n2-stopped": Scenario(("Good", "Stopped"), {"good": {P: 3}, "stopped": {P: (1, 2), S: 1, N: (0, 1)}}, ("-n", "2"),
                           run_args=("--stall-timeout", str(STALL_S))),
    # xdist 3.8's own wedge (loadgroup: the replacement waits for a second test that never comes): the watch
    # ends it; checked as "wedged, or xdist replaced the worker properly" (a later xdist may fix it)
    "wedge": Scenario(("Segfault", "Good"), {}, ("-n", "1", "--dist", "loadgroup"),
                      run_args=("--stall-timeout", str(STALL_S))),
    # every xdist worker dies while collecting: the run ends after a few, the report holds no test
    "collection": Scenario(("collection:CollectionCrash", "Good"), {}, ONE_WORKER, env=(("MLA_FAULTY_IMPORT", "worker"),)),
    # the backend's import crashes the process that loads it: run refuses, naming it, before anything is written
    "import": Scenario(("collection:CollectionCrash", "Good"), {}, env=(("MLA_FAULTY_IMPORT", "always"),)),
    # plain pytest, serial: the sentinel names the test; -n 2: xdist records every crash
    "direct-serial": Scenario(("Good", "Exit"), {}, direct=True),
    "direct-n2": Scenario(("Good", "SegfaultFirst"), {}, ("-n", "2"), direct=True),
}

#: The scenarios of the default `pytest` (one run each, three at a time: :func:`run_default`, while the session's other tests keep the
#: other core busy); the rest run in the repeat script (``--repeat``), and tests/meta/test_isolation.py runs -n 2
#: with a crash, hangs and CUDA faults.
DEFAULT = ("xdist", "serial-segfault", "serial-hang", "stopped", "wedge", "collection", "import", "direct-serial")


def run_scenario(key: str, tmp: Path) -> dict:
    """One scenario's process, run in the directory ``tmp`` to its end (or killed, with its process group, after
    :data:`BOUND_S`)."""
    s = SCENARIOS[key]
    suite, out = write_suite(tmp), tmp / "out"
    marker = f"{key}-{os.getpid()}-{time.monotonic_ns()}"
    env = user_env(MLA_FAULT_SCENARIO=marker, **dict(s.env))
    if s.direct:
        (tmp / "pytest.ini").write_text("[pytest]\n")
        cmd = [sys.executable, "-m", "pytest", str(suite), "-c", str(tmp / "pytest.ini"), "--rootdir", str(tmp),
               "--mla-timeout", "0.5", "--mla-device", "cpu",
               *backend_args(*s.backends, flag="--mla-backend"), "-q", *LEAN, *s.pytest_args]
    else:
        cmd = [sys.executable, "-m", "mla_conformance.cli", "run", "--suites", str(suite), "--out", str(out),
               "--name", "host", "--timeout", "0.5", *s.run_args, *backend_args(*s.backends), "--", "-q",
               "--mla-device", "cpu", *LEAN, *s.pytest_args]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **OWN_PROCESS_GROUP)
    try:
        stdout, stderr = proc.communicate(timeout=BOUND_S)
        ended = True
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        ended = False
    wall = time.monotonic() - t0
    report = md = None
    if (out / "conformance.json").is_file():
        report = json.loads((out / "conformance.json").read_text())
        md = (out / "conformance.md").read_text()
    return {"key": key, "ended": ended, "rc": proc.returncode, "stdout": stdout, "stderr": stderr,
            "report": report, "md": md, "out_exists": out.exists(), "orphans": processes_left("MLA_FAULT_SCENARIO", marker), "wall": wall}


def _rows(report: dict, backend: str) -> list[dict]:
    return sorted((t for t in report["tests"] if t.get("backend") == backend), key=lambda t: t["nodeid"])


def _kind(row: dict) -> str:
    return "passed" if row["outcome"] == "passed" else (row.get("fault") or {}).get("kind", row["outcome"])


def check(key: str, got: dict) -> None:
    """AssertionError naming what is wrong with one run of scenario ``key``."""
    s = SCENARIOS[key]
    out = f"\n--- stdout (end)\n{got['stdout'][-3000:]}\n--- stderr (end)\n{got['stderr'][-3000:]}"
    assert got["ended"], f"{key}: still running after {BOUND_S} s: killed{out}"
    assert not got["orphans"], f"{key}: processes left behind: {got['orphans']}{out}"
    err = got["stderr"]
    if key == "import":
        assert got["rc"] == 2 and not got["out_exists"], f"{key}: rc {got['rc']}{out}"
        assert "faulty/collection_backend.py:CollectionCrash" in err and "SIGSEGV" in err and \
               "in its import or constructor" in err, f"{key}: the crash is not named{out}"
        return
    if s.direct:
        text = got["stdout"] + err
        if "-n" in s.pytest_args:  # xdist: every crash of segfault-first recorded, good's tests kept
            assert got["rc"] == 1 and "3 passed, 3 errors" in text, f"{key}: rc {got['rc']}{out}"
            for k in (1, 2, 3):
                assert f"test_attend[segfault-first-{k}]" in text, f"{key}: crash of segfault-first-{k} not named{out}"
        else:  # serial: the process is gone; the sentinel names the test
            assert got["rc"] == 3, f"{key}: rc {got['rc']}{out}"
            assert "pytest ended abruptly while running" in err and "test_attend[exit3-2]" in err, \
                f"{key}: the dead test is not named{out}"
        return
    assert got["rc"] not in (0, None), f"{key}: rc {got['rc']}{out}"
    report = got["report"]
    assert report is not None, f"{key}: no report written (rc {got['rc']}){out}"
    if key == "collection":
        assert "xdist workers in a row died before collecting" in err and not report["tests"], f"{key}{out}"
        return
    if key == "wedge":
        seg = [_kind(r) for r in _rows(report, "segfault")]
        assert seg[:2] == [P, C], f"{key}: segfault's rows {seg}{out}"
        wedged = "the run stalled" in err
        good = [_kind(r) for r in _rows(report, "good")]
        assert (seg[2:], good) == (([N], [N, N, N]) if wedged else ([P], [P, P, P])), \
            f"{key}: wedged={wedged}, rows {seg} {good}{out}"
        return
    assert sorted(report["verdicts"]) == sorted(s.expect), f"{key}: verdicts {sorted(report['verdicts'])}{out}"
    for backend, want in s.expect.items():
        rows = _rows(report, backend)
        kinds = [_kind(r) for r in rows]
        if isinstance(want, dict):
            ok = len(kinds) == 3 and set(kinds) <= set(want) and all(
                kinds.count(k) in (n if isinstance(n, tuple) else (n,)) for k, n in want.items())
            assert ok, f"{key}: {backend} rows {kinds}, want {want}{out}"
        else:
            assert tuple(kinds) == want, f"{key}: {backend} rows {kinds}, want {want}{out}"
        verdict = report["verdicts"][backend]["verdict"]
        assert verdict == ("CONFORMS" if set(kinds) == {P} else "DOES NOT CONFORM"), f"{key}: {backend} {verdict}"
        for row in rows:
            kind = _kind(row)
            if kind in (C, T, S):  # named on stderr, with why
                assert f"{kind.upper()}: {row['nodeid']}: {row['reason']}" in err, f"{key}: {row['nodeid']} not named{out}"
            if kind == C and s.signal:
                assert row["fault"].get("signal") == s.signal, f"{key}: {row}"
            if kind in (C, T) and backend != "exit3" and "serial" not in key:  # where: the innermost frame
                assert "faulty/backends.py" in row["reason"] and "in misbehave" in row["reason"], f"{key}: {row}"
            if kind == C and backend == "exit3":
                assert row["fault"]["exit_code"] == 3, f"{key}: {row}"
            if kind == N:
                assert row["reason"].startswith("not run: "), f"{key}: {row}"
    if S in {_kind(t) for t in report["tests"]}:
        line = "the run stalled: no progress for" in err and "; running: " in err
        state = ("pytest (no xdist worker): pid" if "no:xdist" in s.pytest_args else "; workers: gw") in err
        assert line and state, f"{key}: no stall line naming the running test and the workers' state{out}"


def _burner() -> subprocess.Popen:
    """A sibling process that keeps one core busy."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"], env=user_env())


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="Run the fault scenarios N times in a row; print each run's outcome.")
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--load", action="store_true", help="a sibling process keeps a core busy meanwhile")
    p.add_argument("scenarios", nargs="*", default=sorted(SCENARIOS))
    args = p.parse_args(argv)
    burner = _burner() if args.load else None
    failures = 0
    try:
        for i in range(1, args.repeat + 1):
            for key in args.scenarios:
                with tempfile.TemporaryDirectory(prefix=f"mla-fault-{key}-") as tmp:
                    got = run_scenario(key, Path(tmp))
                try:
                    check(key, got)
                    verdict = "ok"
                except AssertionError as exc:
                    failures += 1
                    verdict = "FAILED: " + str(exc).splitlines()[0]
                    print(f"--- round {i} {key}: {exc}", file=sys.stderr, flush=True)  # the run's output tails
                print(f"round {i:2d} {key:16s} rc {got['rc']!s:>4} {got['wall']:6.1f} s  {verdict}", flush=True)
    finally:
        if burner is not None:
            burner.kill()
            burner.wait()
    print(f"{failures} failed of {args.repeat * len(args.scenarios)} runs")
    return 1 if failures else 0


def run_default(tmp: Path) -> dict:
    """Every scenario of :data:`DEFAULT`, each in a directory of ``tmp``, three at a time: most of a scenario's time
    is a wait (a stall bound, a hang's timeout, xdist restarting a worker), so together they take little more than
    their CPU time."""
    def one(key: str) -> dict:
        (tmp / key).mkdir()
        return run_scenario(key, tmp / key)

    with concurrent.futures.ThreadPoolExecutor(max_workers=3, thread_name_prefix="fault-scenario") as pool:
        return dict(zip(DEFAULT, pool.map(one, DEFAULT)))

pytestmark = pytest.mark.meta


@pytest.fixture(params=DEFAULT)
def fault_run(request, shared, tmp_path_factory):
    runs = shared("fault-scenarios", lambda: run_default(tmp_path_factory.mktemp("fault-scenarios")))
    return request.param, runs[request.param]


def test_the_run_ends_with_the_verdict_the_dead_test_named_and_nothing_left(fault_run):
    check(*fault_run)


# --------------------------------------------------------------------------- the watch's rule, on a journal by hand


@pytest.fixture
def journal_watch():
    """``journal_watch(directory, lines)``: a RunWatch over a journal of ``lines`` written there; each closed (its journal
    file with it) when the test ends, as ``run`` closes its own."""
    import json

    from mla_conformance.runner.watchdog import RunWatch

    made = []

    def watch(tmp_path, lines, **kw):
        journal = tmp_path / "r.json.journal"
        journal.write_text("".join(json.dumps(rec) + "\n" for rec in lines))
        made.append(RunWatch(journal, stall_s=10, test_timeout_s=1, now=0.0, **kw))
        return made[-1]

    yield watch
    for w in made:
        w.close()


def test_the_watch_fires_on_no_progress_beyond_what_is_allowed(tmp_path, journal_watch):
    """Times are the watch's clock, passed in: no test here waits. Idle with every worker collected: the stall
    bound; a test running: plus its --timeout and the C watchdog's margin; a process starting: STARTUP_S."""
    from mla_conformance.pytest_plugin.isolation import hard_deadline
    from mla_conformance.runner.watchdog import STARTUP_S

    (tmp_path / "none").mkdir()
    before = journal_watch(tmp_path / "none", [])  # pytest starting: no line yet
    assert before.poll(STARTUP_S - 1) is None and before.poll(STARTUP_S + 1)
    collected = [{"header": {"backends": ["b"]}}, {"worker": "gw0", "event": "collected", "tests": 3, "pid": 1},
                 {"collection": ["t[b-1]", "t[b-2]"]}]
    idle = journal_watch(tmp_path, collected)
    assert idle.poll(1.0) is None and idle.poll(10.9) is None and idle.poll(11.2)  # the lines were read at 1.0
    assert "no progress for 10 s (--stall-timeout 10 s)" in idle.fired
    assert "no test had started" in idle.description and "gw0 collected 3 tests (pid 1:" in idle.description
    running = journal_watch(tmp_path, collected + [{"start": "t[b-1]"}])
    bound = 10 + hard_deadline(1)
    assert running.poll(0.0) is None and running.poll(bound - 0.1) is None and running.poll(bound + 0.1)
    assert "last test started: t[b-1]" in running.description and "1 not finished" not in running.description
    starting = journal_watch(tmp_path, collected[:1] + [{"worker": "gw1", "event": "starting"}])
    assert starting.poll(0.0) is None and starting.poll(STARTUP_S - 1) is None and starting.poll(STARTUP_S + 1)


def test_the_watch_ends_a_run_whose_workers_die_while_collecting(tmp_path, journal_watch):
    deaths = [{"worker": f"gw{i}", "event": e, **({"error": "Not properly terminated"} if e == "down" else {})}
              for i in range(3) for e in ("starting", "down")]
    watch = journal_watch(tmp_path, deaths)
    assert watch.poll(0.0) and "3 xdist workers in a row died before collecting" in watch.fired
    assert "Not properly terminated" in watch.fired
    later = journal_watch(tmp_path, deaths[:2] + [{"worker": "gw1", "event": "collected"}, {"worker": "gw1", "event": "down"}])
    assert later.poll(0.0) is None  # a worker that collected and then died is a test's crash, not collection's
    # the run's end: xdist takes down the replacements it had just started, uncollected and without an error (the
    # n2 scenario's tenth repeat under load was ended as "died before collecting" with all 9 tests finished)
    ended = journal_watch(tmp_path, [{"collection": ["t[b-1]"]}, {"start": "t[b-1]"}, {"finish": "t[b-1]"}]
                          + [{"worker": f"gw{i}", "event": e} for i in range(2, 5) for e in ("starting", "down")])
    assert ended.poll(0.0) is None


if __name__ == "__main__":
    sys.exit(main())
