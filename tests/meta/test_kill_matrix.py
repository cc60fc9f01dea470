"""Every conformance test can fail, and correct code passes it: each cell of tests/meta/kill_matrix.py
runs a conformance test on a broken backend and must come out *failed* -- an AssertionError verdict naming
the backend, not an error, a skip or a pass; the same tests on the correct backends written independently
of the reference must pass (or skip an optional part they do not implement). All of it in one run of the suite
(kill_matrix.layer_matrix_run), through the plugin as a user runs it (tests/meta/harness.py); and every
conformance test of suites/ has a cell."""

import ast
from pathlib import Path

import pytest

from . import harness
from .kill_matrix import (BROKEN, CORRECT, CORRECT_TESTS, ELSEWHERE, ERROR_CELLS, EXEMPT, KILL_MATRIX, LAYER_HINTS,
                          correct_node_ids, layer_matrix_run, node_ids)

pytestmark = pytest.mark.meta
ROOT = harness.ROOT
CELLS = node_ids()
PASSING = correct_node_ids()


def conformance_tests() -> set[str]:
    """file::function of every test function in suites/test_*.py that takes the ``mla_backend`` fixture (but the
    files another meta module kills: kill_matrix.ELSEWHERE)."""
    found = set()
    for path in sorted((ROOT / "suites").glob("test_*.py")):
        if f"suites/{path.name}" in ELSEWHERE:
            continue
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_") and \
                    "mla_backend" in [a.arg for a in node.args.args]:
                found.add(f"suites/{path.name}::{node.name}")
    return found


@pytest.fixture
def run(suite_run) -> harness.SuiteRun:
    return suite_run("layer-matrix", layer_matrix_run)


@pytest.fixture
def outcomes(run) -> dict[str, dict]:
    return run.by_id


@pytest.mark.parametrize("suite,module", sorted(ELSEWHERE.items()))
def test_suites_killed_elsewhere_are_killed_there(suite, module):
    """A suite file left out of this matrix is one another meta module runs its broken implementations on."""
    assert (ROOT / suite).is_file(), f"{suite} does not exist (kill_matrix.ELSEWHERE)"
    assert Path(suite).name in (ROOT / module).read_text(encoding="utf-8"), f"{module} does not run {suite}"


def test_every_conformance_test_has_a_cell():
    tests = conformance_tests()
    missing = sorted(tests - set(KILL_MATRIX) - set(EXEMPT))
    assert not missing, f"conformance tests that no broken backend is shown to fail: {missing}"
    stale = sorted((set(KILL_MATRIX) | set(EXEMPT)) - tests)
    assert not stale, f"kill-matrix rows for tests that do not exist (or take no backend): {stale}"


@pytest.mark.parametrize("test,broken,nodeid", CELLS, ids=[f"{t.split('::')[1]}<-{b}" for t, b, _ in CELLS])
def test_cell_fails(run, test, broken, nodeid):
    reason = run.assert_failed(nodeid, BROKEN[broken][1])
    if "golden" not in test:  # a golden mismatch is syrupy's diff; every other verdict names the backend
        assert BROKEN[broken][1] in reason, f"{nodeid}: the failure does not name the backend: {reason}"
    assert LAYER_HINTS.get(broken, "") in reason, f"{nodeid}: the failure does not say {LAYER_HINTS[broken]!r}: {reason}"


@pytest.mark.parametrize("test,correct,nodeid", PASSING, ids=[f"{t.split('::')[1]}<-{c}" for t, c, _ in PASSING])
def test_correct_backend_passes(outcomes, test, correct, nodeid):
    got = outcomes.get(nodeid)
    assert got is not None, f"{nodeid} did not run"
    if got["outcome"] == "skipped" and correct == "frozen-base":
        return  # its skips: test_frozen_backend_skips_only_what_it_never_declared
    if got["outcome"] == "skipped":  # only an optional part the backend does not implement
        assert CORRECT[correct][1] in got.get("reason", "") and any(
            w in got["reason"] for w in ("paged-cache extension", "kv_codec", "DeepSeek Sparse Attention")), f"{nodeid}: skipped: {got['reason']}"
    else:
        assert got["outcome"] == "passed", f"{nodeid}: {got['outcome']}: {got.get('reason', '')}"


def test_frozen_backend_skips_only_what_it_never_declared(outcomes):
    """The frozen base-contract backend (tests/meta/frozen_base_backend.py, never edited) passes every cell but
    the optional parts, and each of those skips with a sentence naming what it did not declare or declined."""
    name = CORRECT["frozen-base"][1]
    mine = {n: outcomes.get(n, {}) for t, c, n in PASSING if c == "frozen-base"}
    assert mine and all(o.get("outcome") in ("passed", "skipped") for o in mine.values()), mine
    for nodeid, got in mine.items():
        if got["outcome"] != "skipped":
            continue
        reason = got.get("reason", "")
        dsa = "dsa" in nodeid
        assert (f'{name} does not declare DeepSeek Sparse Attention' in reason and 'sparse_attention = "dsa"' in reason
                if dsa else (f"{name}: no " in reason or "supports_paging" in reason)), f"{nodeid}: {reason}"
    assert any(o["outcome"] == "skipped" and "dsa" in n for n, o in mine.items()), "no DSA cell skipped"


def test_correct_backends_pass_most_cells(outcomes):
    for key, (_, name) in CORRECT.items():
        passed = [n for t, c, n in PASSING if c == key and outcomes.get(n, {}).get("outcome") == "passed"]
        expected = len(CORRECT_TESTS[key]) if isinstance(CORRECT_TESTS[key], tuple) else 8
        assert len(passed) >= expected, f"{name}: only {len(passed)} cells passed"


@pytest.mark.parametrize("spec,name,nodeid", ERROR_CELLS, ids=[n for _, n, _ in ERROR_CELLS])
def test_crash_is_recorded_as_error(run, spec, name, nodeid):
    """A backend that raises or returns the wrong shape is an *error* in the results, not a failure."""
    run.assert_error(nodeid, "BackendError", "BackendOutputError")


def test_suites_hold_conformance_tests_only():
    """Every test function in suites/ judges a backend (requests mla_backend); the tool's own tests are in tests/."""
    tool = []
    for path in sorted((ROOT / "suites").glob("test_*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_") and \
                    not {"mla_backend", "mla_op"} & {a.arg for a in node.args.args}:
                tool.append(f"suites/{path.name}::{node.name}")
    assert not tool, f"tests in suites/ that judge no backend (move them to tests/): {tool}"
