"""The lanes the inner runs of tests/meta/jobs.py run in (tests/meta/background.py): a job's result or failure
reaches the test that reads it, and a lane that dies is named with its output, never waited on forever."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from . import background

pytestmark = pytest.mark.meta


def test_a_lane_writes_each_result_and_each_failure(tmp_path):
    background.run_lane(tmp_path, ["ok", "fails"], {"ok": lambda: {"figure": 1}, "fails": lambda: 1 / 0})
    assert background.read(tmp_path / "ok.pickle", "ok") == {"figure": 1}
    with pytest.raises(AssertionError, match=r"(?s)the job 'fails' failed:.*ZeroDivisionError"):
        background.read(tmp_path / "fails.pickle", "fails")
    assert not list(tmp_path.glob("*.part")), "a result is written whole (renamed into place)"


def test_a_lane_that_dies_is_named_with_its_output(tmp_path, monkeypatch):
    log = tmp_path / "lane.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", "import sys; print('the lane said this'); sys.exit(3)"],
                                stdout=out, stderr=subprocess.STDOUT)
    proc.wait()
    monkeypatch.setitem(background._LANES, "dead-job", (proc, log))
    with pytest.raises(AssertionError, match=r"(?s)'dead-job' ended \(3\) without its result.*the lane said this"):
        background.result("dead-job")


#: a session that starts a lane (its own process group, as background.start does) whose job started a child, says
#: both pids, and waits to be killed
SESSION = '''
import os, subprocess, sys, time
from mla_conformance.report.run import OWN_PROCESS_GROUP
lane = subprocess.Popen([sys.executable, "-c", """
import subprocess, sys, time
from tests.meta import background
background.end_with_parent(poll=0.05)
child = subprocess.Popen(["sleep", "120"])
print(child.pid, flush=True)
time.sleep(120)
"""], stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": sys.argv[1]}, **OWN_PROCESS_GROUP)
print(lane.pid, lane.stdout.readline().strip(), flush=True)
time.sleep(120)
'''


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie nobody has reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="reads the processes' states in /proc")
def test_a_lane_ends_with_the_session_that_started_it(tmp_path):
    """A session killed with SIGKILL (no unconfigure, no shutdown): its lane and the processes the lane's jobs
    started end too, instead of running their jobs to the end."""
    session = subprocess.Popen([sys.executable, "-c", SESSION, background.checkout_on_path()], stdout=subprocess.PIPE,
                               text=True)
    try:
        lane, child = map(int, session.stdout.readline().split())
        assert _alive(lane) and _alive(child)
    finally:
        session.kill()
        session.wait()
    deadline = time.monotonic() + 60  # a hang guard, not a timing: the lane polls every 0.05 s
    while (_alive(lane) or _alive(child)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(lane), "the lane outlived the session that started it"
    assert not _alive(child), "a process of the lane's job outlived the session"
