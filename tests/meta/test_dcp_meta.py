"""Decode context parallelism at op level (issue 44): one in-process pytester run of suites/test_op_dcp.py, where

* every broken DCP op (tests/meta/impls/broken/dcp_ops.py, each modelled on a public report) is *failed* -- an
  AssertionError, not an error -- by the tests named for it, at a sharding where its bug shows (IDS), the message
  naming the cause, and passes them at a sharding where it is right (an op whose bug needs S > 1, at S = 1);
* the correct ones (tests/meta/impls/independent/dcp_ops.py: vLLM-style all-gather + reduce-scatter, an all-to-all,
  the "local" convention, lse in base 2 merged in base 2) and reference-op pass every test;
* the frozen base op (no DCP declaration) skips every test with the sentence naming ``dcp`` (opt-in).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.meta
ROOT = Path(__file__).resolve().parents[2]
SUITE = "suites/test_op_dcp.py"
BROKEN = ROOT / "tests/meta/impls/broken/dcp_ops.py"
GOOD = ROOT / "tests/meta/impls/independent/dcp_ops.py"
FROZEN = ROOT / "tests/meta/frozen_base_op.py"
ALL_IDS = [f"S{s}-W{w}" for s in (1, "page", 64) for w in (2, 4, 8)]
#: the shardings the meta run holds each op to: a broken op at one sharding where its bug shows (S = page: W 4 and an
#: interleave > 1), a correct op at two (every S = 1 convention and the largest W with S = 64); the suite itself
#: runs all nine on reference-op
IDS = ["Spage-W4"]
CORRECT_IDS = ["S1-W2", "S64-W8"]
TESTS = ["test_dcp_dense", "test_dcp_causal", "test_dcp_sparse", "test_dcp_padding_rows", "test_dcp_fp8",
         "test_dcp_attn_sink", "test_dcp_write"]

#: broken op class -> (its name, the tests named for it, the words its failure must say, ids it is right at)
CELLS = {
    "Base2CombinedAsE": ("broken-dcp-base2-combined-as-e", ("test_dcp_dense",), "combine merged them as base e", ()),
    "Base2MergedAsE": ("broken-dcp-base2-merged-as-e", ("test_dcp_dense",), "merged here as the declared dcp_lse_base",
                       ()),
    "GlobalIndicesNotLocalised": ("broken-dcp-global-indices", ("test_dcp_sparse",),
                                  "neither filtered to the tokens it owns nor localised", ()),
    "LocalLengthCausalBound": ("broken-dcp-local-causal-bound", ("test_dcp_causal",),
                               "causal bound from the rank-local length", ()),
    "OwnershipForS1": ("broken-dcp-ownership-s1", ("test_dcp_dense", "test_dcp_write"), "ownership computed for S = 1",
                       ("S1-W2",)),
    "EmptyShardAsRealPartial": ("broken-dcp-empty-shard-merged", ("test_dcp_dense",),
                                "empty shard merged as a real partial", ()),
    "WritesUnownedTokens": ("broken-dcp-writes-unowned", ("test_dcp_write",), "a rank writing tokens it does not own",
                            ()),
    "OutputSizedByLocalHeads": ("broken-dcp-local-heads", ("test_dcp_dense",), "sized by the local head count", ()),
}
CORRECT = {"AllGatherReduceScatterOp": "dcp-ag-rs", "AllToAllOp": "dcp-all-to-all", "LocalShardOp": "dcp-local",
           "Base2WithBase2CombineOp": "dcp-base2"}
#: the tests each correct op is held to: the combines where a merge happens, the "local" convention everywhere
CORRECT_TESTS = {"dcp-ag-rs": TESTS[:-1], "dcp-all-to-all": TESTS[:-1], "dcp-local": TESTS,
                 "dcp-base2": ["test_dcp_dense", "test_dcp_causal", "test_dcp_attn_sink"]}


def _nodes() -> list[str]:
    """Each broken op at its named tests (where it is wrong and where it is right); the correct ops at theirs; the
    frozen base op at every test and sharding."""
    nodes = [f"{SUITE}::{test}[{name}-{i}]" for name, tests, _, right in CELLS.values() for test in tests
             for i in (*IDS, *right)]
    nodes += [f"{SUITE}::{test}[{name}-{i}]" for name in CORRECT.values() for test in CORRECT_TESTS[name]
              for i in CORRECT_IDS]
    return nodes + [f"{SUITE}::{test}[frozen-base-op-{i}]" for test in TESTS for i in ALL_IDS]


@pytest.fixture
def dcp_run(suite_run):
    """{node id: (outcome, 'when', message)} of one run (:func:`_nodes`), made once per session by the first test
    that asks (tests/conftest.py's suite_run; from pytester's directory, the node ids read against this checkout:
    --rootdir)."""
    return suite_run("dcp-meta", _run)


def _run(pytester) -> dict:
    import torch

    threads = torch.get_num_threads()
    ops = [f"{BROKEN}:{c}" for c in CELLS] + [f"{GOOD}:{c}" for c in CORRECT] + [f"{FROZEN}:FrozenBaseOp"]
    args = ["-n", "0", "-o", f"cache_dir={pytester.path / '.cache'}", "--rootdir", str(ROOT), "-q", *(f"{ROOT}/{n}" for n in _nodes())]
    for spec in ops:
        args += ["--mla-op", spec]
    try:
        result = pytester.runpytest_inprocess(*args)
    finally:
        torch.set_num_threads(threads)
    got = {}
    for rep in result.reprec.getreports("pytest_runtest_logreport"):
        if rep.when == "call" or rep.outcome != "passed":
            crash = getattr(rep.longrepr, "reprcrash", None)
            msg = crash.message if crash is not None else str(rep.longrepr or "")
            if rep.skipped and isinstance(rep.longrepr, tuple):
                msg = rep.longrepr[2]
            got[rep.nodeid] = (rep.outcome, rep.when, msg)
    assert got, "\n".join(result.outlines[-30:])
    return got


@pytest.mark.parametrize("cls", list(CELLS))
def test_broken_dcp_op_fails_its_named_test(dcp_run, cls):
    name, tests, words, right = CELLS[cls]
    for test, i in ((test, i) for test in tests for i in (*IDS, *right)):
        node = f"{SUITE}::{test}[{name}-{i}]"
        assert node in dcp_run, f"{node} did not run: {sorted(dcp_run)[:5]}"
        outcome, when, msg = dcp_run[node]
        if i in right:
            assert outcome == "passed", f"{node}: {outcome}: {msg}"
            continue
        assert outcome == "failed" and when == "call", f"{node}: {outcome} at {when}: {msg}"
        assert msg.startswith("AssertionError"), f"{node}: an error, not a failure: {msg}"
        assert words in msg, f"{node}: the message does not say {words!r}: {msg}"


@pytest.mark.parametrize("name", list(CORRECT.values()))
def test_correct_dcp_ops_pass(dcp_run, name):
    mine = {n: v for n, v in dcp_run.items() if f"[{name}-" in n}
    assert len(mine) == len(CORRECT_TESTS[name]) * len(CORRECT_IDS), f"{name}: {len(mine)} tests ran"
    bad = {n: v for n, v in mine.items() if v[0] != "passed"}
    assert not bad, f"{name}: {len(bad)} not passed, e.g. {next(iter(bad.items()))}"


def test_frozen_base_op_skips_naming_dcp(dcp_run):
    mine = {n: v for n, v in dcp_run.items() if "[frozen-base-op-" in n}
    assert len(mine) == len(TESTS) * len(ALL_IDS)
    for n, (outcome, _, msg) in mine.items():
        assert outcome == "skipped" and "does not declare dcp" in msg, (n, outcome, msg)
