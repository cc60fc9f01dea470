"""The layer across real ranks (issue 44): suites/test_distributed.py on broken distributed backends
(tests/meta/impls/broken/distributed_backends.py), each run as a user runs it (pytester, a pytest process of its own):

* a rank that raises, one killed by a signal, one that hangs: the tests fail naming rank 1 and what it did, the run
  ends within :data:`BOUND_S` (a run that has not ended by then is killed and fails the test), and no process of the
  launch is left -- ``MLA_DIST_REPEAT`` times in a row each (default 1; ``-m distributed``: .ci/run runs it once;
  ``MLA_DIST_REPEAT=10`` for ten in a row; the hang verdict comes after the stall, shortened here to 5 s by
  MLA_DIST_STALL_S);
* TP without the output's all-reduce fails the output test naming a rank; DCP keeping every token on every rank
  fails the cache-bytes test naming the rank, its bytes and its owned tokens.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mla_conformance.checks.layer.distributed import cases_for

from .harness import processes_left

ROOT = Path(__file__).resolve().parents[2]
BROKEN = ROOT / "tests/meta/impls/broken/distributed_backends.py"
SUITE = ROOT / "suites/test_distributed.py"


@pytest.fixture(autouse=True)
def _only_with_marker(request):
    if "distributed" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("the distributed tier: run with -m distributed (.ci/run does)")


pytestmark = pytest.mark.distributed


def _run(pytester, cls: str, *extra: str):
    """The suite on the broken backend ``cls`` in a pytest process of its own; its processes, the spawned ranks
    among them, carry MLA_DIST_META_RUN=<this run> in their environment (:func:`_ranks_left`)."""
    args = ["-n", "0", "--rootdir", str(ROOT), str(SUITE), "-q", "-rfE", "--mla-backend", f"{BROKEN}:{cls}", *extra]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(MARKER, str(pytester.path))
        return pytester.runpytest_subprocess(*args, timeout=BOUND_S)


#: the environment variable that marks a run's processes (spawned ranks inherit the environment)
MARKER = "MLA_DIST_META_RUN"


def _ranks_left(pytester) -> list[str]:
    """The run's processes still alive (a rank the launch did not end): none may be."""
    return processes_left(MARKER, str(pytester.path))


#: a run with a faulty rank must have ended by then (the issue's minute): a bound on ending at all, not a speed claim
BOUND_S = 60
#: how many times in a row each faulty rank runs (MLA_DIST_REPEAT=10: the ten-in-a-row check)
REPEAT = int(os.environ.get("MLA_DIST_REPEAT", "1"))

FAULTS = {
    "RaisesOnRank1": "rank 1 raised RuntimeError: injected failure on rank 1",
    "CrashesOnRank1": "rank 1 crashed: killed by signal SIGKILL",
    "HangsOnRank1": "rank 1 hung",
}


@pytest.mark.parametrize("cls", list(FAULTS))
def test_faulty_rank_is_a_verdict_every_time(pytester, cls, monkeypatch):
    monkeypatch.setenv("MLA_DIST_STALL_S", "5")
    for attempt in range(REPEAT):
        result = _run(pytester, cls)
        text = "\n".join(result.outlines)
        assert result.ret == 1, f"attempt {attempt}: exit {result.ret}:\n{text[-3000:]}"
        assert FAULTS[cls] in text, f"attempt {attempt}: the verdict does not say {FAULTS[cls]!r}:\n{text[-3000:]}"
        assert "error" not in result.parseoutcomes(), f"attempt {attempt}: an error, not a failure:\n{text[-2000:]}"
        assert not _ranks_left(pytester), f"attempt {attempt}: rank processes left: {_ranks_left(pytester)}"


def test_tp_without_allreduce_fails_outputs(pytester):
    result = _run(pytester, "TPWithoutAllReduce")
    text = "\n".join(result.outlines)
    assert "rank 0's output differs from the single-process float64 reference" in text, text[-3000:]
    outcomes = result.parseoutcomes()  # each TP case: its output test fails, its bytes test passes
    n = len(cases_for(("tp",)))
    assert outcomes.get("failed") == n and outcomes.get("passed") == n, outcomes


def test_dcp_keeping_every_token_fails_bytes(pytester):
    result = _run(pytester, "DCPKeepsEveryToken")
    text = "\n".join(result.outlines)
    assert "rank 0's cache holds" in text and "its owned tokens" in text, text[-3000:]
    outcomes = result.parseoutcomes()  # each DCP case: its bytes test fails, its output test passes
    n = len(cases_for(("dcp",)))
    assert outcomes.get("failed") == n and outcomes.get("passed") == n, outcomes
