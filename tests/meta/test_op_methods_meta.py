"""Every check of the op contract's optional methods can fail, and correct ops pass: each broken op of
tests/meta/impls/broken/op_methods.py must come out *failed* (an AssertionError verdict naming the op and the case, not
an error, a skip or a pass) in the method tests named for it; the ops written independently of reference-op
(tests/meta/impls/independent/op_methods.py) pass every method test they have the method for, and an op with only
decode (tests/meta/frozen_base_op.py, never edited) skips every one, naming the method it lacks. All of it in two
runs of the suite (tests/meta/kill_matrix.py: the plugin, --mla-op, --mla-results, as a user runs it): these tables'
cells, and their correct ops over the method suites (mla_conformance.contract.methods.METHOD_SUITES)."""

import ast

import pytest

from mla_conformance.contract.op import METHOD_DECLARATIONS, SIGNATURES

from . import harness
from .kill_matrix import METHOD_SUITE_FILES, method_cells_run, method_correct_run
from .method_cells import ROOT, INDEPENDENT, BROKEN_OPS, STEP_TEXT, CORRECT_OPS, CONVENTION_OPS, CONVENTION_SKIPS, ERROR_OPS, SUITE_METHOD, CELLS, ERRORS, method_tests

pytestmark = pytest.mark.meta


@pytest.fixture
def run(suite_run) -> harness.SuiteRun:
    return suite_run("method-matrix", lambda pytester: method_cells_run(pytester).joined(method_correct_run(pytester)))


def test_every_method_test_is_failed_by_a_broken_op():
    tests = method_tests()
    covered = {test.split("[")[0] for _, test, _ in CELLS}
    assert not sorted(tests - covered), f"method tests no broken op is shown to fail: {sorted(tests - covered)}"
    assert not sorted(covered - tests), f"cells for method tests that do not exist: {sorted(covered - tests)}"


@pytest.mark.parametrize("key,test,nodeid", CELLS, ids=[f"{t.split('::')[1].split('[')[0]}<-{k}" for k, t, _ in CELLS])
def test_broken_method_fails_its_check(run, key, test, nodeid):
    _, name, _, text = BROKEN_OPS[key]
    reason = run.assert_failed(nodeid, name)
    got = run.result(nodeid)
    assert reason.startswith(f"{name} ["), f"{nodeid}: the failure does not name the op and the case: {reason}"
    assert got.get("figures", {}).get("case"), f"{nodeid}: no case figure recorded: {got}"
    expected = STEP_TEXT.get(key, "") if "composition" in test else text
    assert expected in reason, f"{nodeid}: the failure does not say {expected!r}: {reason}"


def test_the_independent_op_passes_every_method_test(run):
    rows = [t for t in run.tests if t.get("params", {}).get("op") == CORRECT_OPS["independent"][1]]
    assert len(rows) == len([t for t in run.tests if t.get("params", {}).get("op") == "frozen-base-op"]) > 30
    bad = [f"{t['nodeid']}: {t['outcome']} {t.get('reason', '')}" for t in rows if t["outcome"] != "passed"]
    assert not bad, "independent-methods-op does not pass:\n" + "\n".join(bad)


def test_the_decode_only_op_skips_every_method_test_by_name(run):
    """The frozen decode-only op: every method test skips, saying the method it lacks and its signature."""
    rows = [t for t in run.tests if t.get("params", {}).get("op") == "frozen-base-op"]
    assert rows
    for t in rows:
        method = SUITE_METHOD[t["nodeid"].split("::")[0].removeprefix("suites/")]
        assert t["outcome"] == "skipped", t
        assert t["reason"] == (f"op frozen-base-op has no {method} method (optional: {SIGNATURES[method]}; define "
                               f"it to have {method} tested)"), t
    # opt-in: an op written before the methods existed reports the declarations it reported then (decode's only)
    assert set(run["op_declarations"]["frozen-base-op"]) == set(METHOD_DECLARATIONS["decode"])


def test_an_op_with_only_merge_is_an_op(run):
    """merge-only-op passes every merge test and skips the rest naming the method it lacks."""
    rows = [t for t in run.tests if t.get("params", {}).get("op") == "merge-only-op"]
    merge = [t for t in rows if "test_op_merge.py" in t["nodeid"]]
    assert merge and all(t["outcome"] == "passed" for t in merge), [(t["nodeid"], t["outcome"]) for t in merge]
    for t in rows:
        if t in merge:
            continue
        method = SUITE_METHOD[t["nodeid"].split("::")[0].removeprefix("suites/")]
        assert t["outcome"] == "skipped" and t["reason"].startswith(f"op merge-only-op has no {method} method"), t
    assert run["op_declarations"]["merge-only-op"] == {"merge_lse_base": "e", "merge_empty_row": "+inf",
                                                       "merge_empty_input": "either"}


def test_a_dummy_slot_writer_passes_the_write_tests(run):
    """dummy-slot-writer-op (SGLang-style, write_padding_slot = "dummy-slot-0") passes every write test of the latent
    format: its padding tokens go to slot 0; the -1 test skips naming the declaration; the rest skip by name."""
    rows = {t["nodeid"]: t for t in run.tests if t.get("params", {}).get("op") == "dummy-slot-writer-op"}
    passed = {n for n, t in rows.items() if t["outcome"] == "passed"}
    assert {f"suites/test_op_write.py::test_write_{n}[dummy-slot-writer-op{p}]" for n, p in (
        ("latent", "-bfloat16"), ("latent", "-float16"), ("latent", "-float32"), ("padded_batch", ""))} <= passed, rows
    negative = rows["suites/test_op_write.py::test_write_padding_slots[dummy-slot-writer-op]"]
    assert negative["outcome"] == "skipped" and "write_padding_slot is 'dummy-slot-0' (declared)" in negative["reason"]
    bad = [(n, t["outcome"], t.get("reason")) for n, t in rows.items() if t["outcome"] not in ("passed", "skipped")]
    assert not bad, bad
    assert run["op_declarations"]["dummy-slot-writer-op"]["write_padding_slot"] == "dummy-slot-0"


def test_bounds_are_not_loose_for_the_kernel_style_op(run):
    """The independent op rounds P to bfloat16 before P.V (prefill) and to q's dtype (sparse prefill): it uses a
    real share of the derived bound, so the bound is not slack by orders of magnitude."""
    def worst(test):
        return max(float(t.get("figures", {}).get("out_error_over_bound", 0.0)) for t in run.tests
                   if t.get("params", {}).get("op") == "independent-methods-op" and test in t["nodeid"])
    assert 0.05 < worst("test_prefill_varlen[independent-methods-op-bfloat16]") <= 1.0
    assert 0.05 < worst("test_sparse_prefill_vs_oracle") <= 1.0


@pytest.mark.parametrize("path", [INDEPENDENT])
def test_independent_ops_import_nothing_of_the_suite(path):
    tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
    modules = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names} | \
        {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert modules <= {"__future__", "math", "torch"}, modules


@pytest.mark.parametrize("key", sorted(CONVENTION_OPS))
def test_ops_of_other_conventions_pass(run, key):
    """A float32-scale writer without the floor (SGLang) and one computing the scale in bfloat16 (FlashMLA's
    earlier quant.py), a merge taking only -inf as an empty side (FlashInfer's), a prefill without lse (vLLM's and
    SGLang's Triton): every test of their suites passes or skips naming a declaration; the rest skip by name."""
    name, suites = CORRECT_OPS[key][1], [f"suites/{s}" for s in CONVENTION_OPS[key]]
    rows = [t for t in run.tests if t.get("params", {}).get("op") == name]
    mine = [t for t in rows if t["nodeid"].startswith(tuple(suites))]
    assert any(t["outcome"] == "passed" for t in mine), [(t["nodeid"], t["outcome"]) for t in mine]
    for t in rows:
        ok = t["outcome"] == "passed" if t in mine else False
        ok = ok or (t["outcome"] == "skipped" and any(s in t["reason"] for s in CONVENTION_SKIPS))
        assert ok, f"{name}: {t['nodeid']}: {t['outcome']} {t.get('reason', '')}"


def test_a_prefill_without_lse_skips_the_composition_naming_it(run):
    """prefill_returns_lse = False: every out check of prefill runs (and passes), the composition, which merges
    the chunks by their lse, skips naming the declaration."""
    rows = {t["nodeid"]: t for t in run.tests if t.get("params", {}).get("op") == "no-lse-prefill-op"}
    comp = rows["suites/test_op_composition.py::test_chunked_prefill_composition[no-lse-prefill-op]"]
    assert comp["outcome"] == "skipped" and "declares prefill_returns_lse = False" in comp["reason"], comp
    assert all(t["outcome"] == "passed" for n, t in rows.items() if "test_op_prefill.py" in n), rows
    assert run["op_declarations"]["no-lse-prefill-op"]["prefill_returns_lse"] is False


@pytest.mark.parametrize("key,nodeid", ERRORS, ids=[k for k, _ in ERRORS])
def test_contract_violation_is_an_error(run, key, nodeid):
    """A method's result of the wrong dtype or layout, or a missing lse undeclared: one line naming what it
    returned and what the contract expects (layouts included)."""
    reason = run.assert_error(nodeid, "BackendOutputError")
    assert ERROR_OPS[key][3] in reason, f"{nodeid}: the error does not say {ERROR_OPS[key][3]!r}: {reason}"
    assert "\n" not in reason and "tensor(" not in reason, reason
