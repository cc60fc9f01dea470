"""The lanes the inner runs of tests/meta/jobs.py run in (tests/meta/background.py): a job's result or failure
reaches the test that reads it, and a lane that dies is named with its output, never waited on forever."""

import subprocess
import sys

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
