"""A crash never hangs the run (issue 27): each scenario of tests/meta/fault_scenarios.py in the default run --
a segfault, an abort, os._exit, a hang in C with signals blocked, a crash on every first call (crashes in a row),
a crash in collection and in the backend's import, a stopped process, xdist's own wedge, serially, under xdist and
through plain pytest -- must end with the expected verdict and counts, the dead test named, the report written
and no process left. Each is a real process, three at a time (fault_scenarios.run_default), made once per session
and judged by one test each, under the load of the session's other tests. ``python -m tests.meta.fault_scenarios
--repeat 10 --load`` runs every scenario over and over."""

import pytest

from .fault_scenarios import DEFAULT, check, run_default

pytestmark = pytest.mark.meta


@pytest.fixture(params=DEFAULT)
def fault_run(request, shared, tmp_path_factory):
    runs = shared("fault-scenarios", lambda: run_default(tmp_path_factory.mktemp("fault-scenarios")))
    return request.param, runs[request.param]


def test_the_run_ends_with_the_verdict_the_dead_test_named_and_nothing_left(fault_run):
    check(*fault_run)


# --------------------------------------------------------------------------- the watch's rule, on a journal by hand


def _watch(tmp_path, lines, **kw):
    import json

    from mla_conformance.report.watchdog import RunWatch

    journal = tmp_path / "r.json.journal"
    journal.write_text("".join(json.dumps(rec) + "\n" for rec in lines))
    watch = RunWatch(journal, stall_s=10, test_timeout_s=1, now=0.0, **kw)
    return watch


def test_the_watch_fires_on_no_progress_beyond_what_is_allowed(tmp_path):
    """Times are the watch's clock, passed in: no test here waits. Idle with every worker collected: the stall
    bound; a test running: plus its --timeout and the C watchdog's margin; a process starting: STARTUP_S."""
    from mla_conformance.pytest_plugin.isolation import hard_deadline
    from mla_conformance.report.watchdog import STARTUP_S

    (tmp_path / "none").mkdir()
    before = _watch(tmp_path / "none", [])  # pytest starting: no line yet
    assert before.poll(STARTUP_S - 1) is None and before.poll(STARTUP_S + 1)
    collected = [{"header": {"backends": ["b"]}}, {"worker": "gw0", "event": "collected", "tests": 3, "pid": 1},
                 {"collection": ["t[b-1]", "t[b-2]"]}]
    idle = _watch(tmp_path, collected)
    assert idle.poll(1.0) is None and idle.poll(10.9) is None and idle.poll(11.2)  # the lines were read at 1.0
    assert "no progress for 10 s (--stall-timeout 10 s)" in idle.fired
    assert "no test had started" in idle.description and "gw0 collected 3 tests (pid 1:" in idle.description
    running = _watch(tmp_path, collected + [{"start": "t[b-1]"}])
    bound = 10 + hard_deadline(1)
    assert running.poll(0.0) is None and running.poll(bound - 0.1) is None and running.poll(bound + 0.1)
    assert "last test started: t[b-1]" in running.description and "1 not finished" not in running.description
    starting = _watch(tmp_path, collected[:1] + [{"worker": "gw1", "event": "starting"}])
    assert starting.poll(0.0) is None and starting.poll(STARTUP_S - 1) is None and starting.poll(STARTUP_S + 1)


def test_the_watch_ends_a_run_whose_workers_die_while_collecting(tmp_path):
    deaths = [{"worker": f"gw{i}", "event": e, **({"error": "Not properly terminated"} if e == "down" else {})}
              for i in range(3) for e in ("starting", "down")]
    watch = _watch(tmp_path, deaths)
    assert watch.poll(0.0) and "3 xdist workers in a row died before collecting" in watch.fired
    assert "Not properly terminated" in watch.fired
    later = _watch(tmp_path, deaths[:2] + [{"worker": "gw1", "event": "collected"}, {"worker": "gw1", "event": "down"}])
    assert later.poll(0.0) is None  # a worker that collected and then died is a test's crash, not collection's
