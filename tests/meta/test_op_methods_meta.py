"""Every check of the op contract's optional methods can fail, and correct ops pass: each broken op of
tests/meta/impls/broken/op_methods.py must come out *failed* (an AssertionError verdict naming the op and the case, not
an error, a skip or a pass) in the method tests named for it; the ops written independently of reference-op
(tests/meta/impls/independent/op_methods.py) pass every method test they have the method for, and an op with only
decode (tests/meta/frozen_base_op.py, never edited) skips every one, naming the method it lacks. All of it in two
runs of the suite (:func:`method_cells_run`, :func:`method_correct_run`: the plugin, --mla-op, --mla-results, as a user runs it): these tables'
cells, and their correct ops over the method suites (mla_conformance.contract.methods.METHOD_SUITES)."""

import ast

import pytest

from mla_conformance.contract.op import METHOD_DECLARATIONS, SIGNATURES

from . import harness
from mla_conformance.contract.methods import METHOD_SPECS, METHOD_SUITES

pytestmark = pytest.mark.meta

ROOT = harness.ROOT
SUITES = ROOT / "suites"
BROKEN = "tests/meta/impls/broken/op_methods.py"
INDEPENDENT = "tests/meta/impls/independent/op_methods.py"
FROZEN = "tests/meta/frozen_base_op.py"

#: broken op -> (spec, the name it reports, the method tests (file::function[params after the op name]) that must
#: fail it, and what the failure must say)
BROKEN_OPS = {
    "prefill-top-left": (f"{BROKEN}:TopLeftCausalPrefill", "broken-prefill-top-left",
                         ["test_op_prefill.py::test_prefill_context_and_new_tokens[]"],
                         "likely cause: top-left causal alignment"),
    "prefill-nan-empty": (f"{BROKEN}:NanForEmptyPrefill", "broken-prefill-nan-empty",
                          ["test_op_prefill.py::test_prefill_varlen[-float32]",
                           "test_op_composition.py::test_chunked_prefill_composition[]"], "has no keys"),
    "prefill-natural-as-2": (f"{BROKEN}:NaturalLseDeclaredBase2Prefill", "broken-prefill-natural-as-2",
                             ["test_op_prefill.py::test_prefill_non_causal[]"], "the lse matches the natural log"),
    "prefill-no-lse-nan-empty": (f"{BROKEN}:NoLseNanForEmptyPrefill", "broken-prefill-no-lse-nan-empty",
                                 ["test_op_prefill.py::test_prefill_varlen[-float32]"], "has no keys"),
    "prefill-padding-row-writes": (f"{BROKEN}:PaddingRowWritesStart", "broken-prefill-padding-row-writes",
                                   ["test_op_prefill.py::test_prefill_padding_sequences[-trailing]",
                                    "test_op_prefill.py::test_prefill_padding_sequences[-interleaved]"],
                                   "likely cause: a zero-length padding sequence"),
    "prefill-always-causal": (f"{BROKEN}:AlwaysCausalPrefill", "broken-prefill-always-causal",
                              ["test_op_prefill.py::test_prefill_non_causal[]"], "lse"),
    "prefill-kv-head-modulo": (f"{BROKEN}:KvHeadModuloPrefill", "broken-prefill-kv-head-modulo",
                               ["test_op_prefill.py::test_prefill_heads[-hq6-hk2]"], "differs from the float64"),
    "prefill-ignores-strides": (f"{BROKEN}:IgnoresStridesPrefill", "broken-prefill-ignores-strides",
                                ["test_op_prefill.py::test_prefill_strided[]"], "NaN"),
    "prefill-v3-dims-only": (f"{BROKEN}:V3DimsOnlyPrefill", "broken-prefill-v3-dims-only",
                             ["test_op_prefill.py::test_prefill_head_dims[-d256-256]"], "differs from the float64"),
    "sparse-lse-base2": (f"{BROKEN}:SparseLseBase2DeclaredE", "broken-sparse-lse-base2",
                         ["test_op_sparse_prefill.py::test_sparse_prefill_vs_oracle[-d576-v32]"],
                         "the lse matches base 2"),
    "sparse-minus-one-last": (f"{BROKEN}:SparseMinusOneIsLastToken", "broken-sparse-minus-one-last",
                              ["test_op_sparse_prefill.py::test_sparse_prefill_invalid_indices[]"],
                              "differs from the float64"),
    "sparse-empty-minus-inf": (f"{BROKEN}:SparseEmptyRowMinusInf", "broken-sparse-empty-minus-inf",
                               ["test_op_sparse_prefill.py::test_sparse_prefill_all_invalid_rows[]"], "lse must be inf"),
    "sparse-ignores-topk-length": (f"{BROKEN}:SparseIgnoresTopkLength", "broken-sparse-ignores-topk-length",
                                   ["test_op_sparse_prefill.py::test_sparse_prefill_topk_length[]"], ""),
    "sparse-sink-into-lse": (f"{BROKEN}:SparseSinkIntoLse", "broken-sparse-sink-into-lse",
                             ["test_op_sparse_prefill.py::test_sparse_prefill_attn_sink[]"], "lse"),
    "merge-both-empty-nan": (f"{BROKEN}:MergeBothEmptyNaN", "broken-merge-both-empty-nan",
                             ["test_op_merge.py::test_merge_both_empty[]",
                              "test_op_composition.py::test_chunked_prefill_composition[]"], "has no keys"),
    "merge-plus-inf-as-value": (f"{BROKEN}:MergePlusInfAsValue", "broken-merge-plus-inf-as-value",
                                ["test_op_merge.py::test_merge_empty_sides[]"], "declare merge_empty_input = '-inf'"),
    "merge-base2-as-e": (f"{BROKEN}:MergeBase2AsE", "broken-merge-base2-as-e",
                         ["test_op_merge.py::test_merge_vs_oracle[-float32]",
                          "test_op_merge.py::test_merge_vs_oracle[-bfloat16]",
                          "test_op_merge.py::test_merge_vs_oracle[-float16]"], "declared base 2"),
    "merge-ignores-lse-strides": (f"{BROKEN}:MergeIgnoresLseStrides", "broken-merge-ignores-lse-strides",
                                  ["test_op_merge.py::test_merge_strided[-float32]",
                                   "test_op_merge.py::test_merge_strided[-bfloat16]"], ""),
    "write-whole-page": (f"{BROKEN}:WholePageWriter", "broken-write-whole-page",
                         ["test_op_write.py::test_write_latent[-bfloat16]", "test_op_write.py::test_write_latent[-float16]",
                          "test_op_write.py::test_write_latent[-float32]",
                          "test_op_write.py::test_write_then_decode[-latent]"], "rewrites whole pages"),
    "write-minus-one-slot-zero": (f"{BROKEN}:MinusOneToSlotZero", "broken-write-minus-one-slot-zero",
                                  ["test_op_write.py::test_write_padding_slots[]"], "slot_mapping -1"),
    "write-minus-one-last-slot": (f"{BROKEN}:MinusOneToLastSlot", "broken-write-minus-one-last-slot",
                                  ["test_op_write.py::test_write_padding_slots[]",
                                   "test_op_write.py::test_write_padded_batch[]"], "the last, Python-style -1"),
    "write-dummy-page": (f"{BROKEN}:DummyPageWriter", "broken-write-dummy-page",
                         ["test_op_write.py::test_write_padded_batch[]", "test_op_write.py::test_write_latent[-bfloat16]"],
                         "wrote more than slot 0"),
    "write-no-scale-floor": (f"{BROKEN}:NoScaleFloorWriter", "broken-write-no-scale-floor",
                             ["test_op_write.py::test_write_fp8_flashmla[]"], "no 1e-4 floor"),
    "write-scale-convention": (f"{BROKEN}:WrongScaleConventionWriter", "broken-write-scale-convention",
                               ["test_op_write.py::test_write_fp8_scale_probe[]"], "follow the 'fp32' convention"),
    "write-zero-tile-nan": (f"{BROKEN}:ZeroTileTimesInfWriter", "broken-write-zero-tile-nan",
                            ["test_op_write.py::test_write_fp8_flashmla[]"], "likely cause: 0 x inf"),
    "write-amax-240": (f"{BROKEN}:Amax240Writer", "broken-write-amax-240",
                       ["test_op_write.py::test_write_fp8_flashmla[]"], "e4m3fnuz's largest"),
    "write-scale-mismatch": (f"{BROKEN}:ScaleMismatchWriter", "broken-write-scale-mismatch",
                             ["test_op_write.py::test_write_fp8_scale_probe[]"], "divided by another scale"),
    "write-kpe-scaled": (f"{BROKEN}:KpeScaledWriter", "broken-write-kpe-scaled",
                         ["test_op_write.py::test_write_kpe_unscaled[]",
                          "test_op_write.py::test_write_then_decode[-fp8-e4m3-flashmla]"], "k_pe divided by"),
    "write-model1-per-token": (f"{BROKEN}:Model1PerTokenRows", "broken-write-model1-per-token",
                               ["test_op_write.py::test_write_model1[]",
                                "test_op_write.py::test_write_then_decode[-fp8-e4m3-model1]"], "584-byte rows"),
}
#: the composition names the step that failed
STEP_TEXT = {"merge-both-empty-nan": "composition step 5: merge(", "prefill-nan-empty": "composition step 1: prefill("}

#: correct ops: name -> (spec, reported name)
CORRECT_OPS = {
    "independent": (f"{INDEPENDENT}:IndependentMethodsOp", "independent-methods-op"),
    "merge-only": (f"{INDEPENDENT}:MergeOnlyOp", "merge-only-op"),
    "dummy-slot-writer": (f"{INDEPENDENT}:DummySlotWriterOp", "dummy-slot-writer-op"),
    "frozen": (f"{FROZEN}:FrozenBaseOp", "frozen-base-op"),
    "no-floor-fp32-writer": (f"{INDEPENDENT}:NoFloorFp32Writer", "no-floor-fp32-writer"),
    "bf16-scale-writer": (f"{INDEPENDENT}:Bf16ScaleWriter", "bf16-scale-writer"),
    "minus-inf-merge": (f"{INDEPENDENT}:MinusInfMergeOp", "minus-inf-merge-op"),
    "no-lse-prefill": (f"{INDEPENDENT}:NoLsePrefillOp", "no-lse-prefill-op"),
}
#: correct ops of a convention other than reference-op's, written from the published code of a kernel: they pass
#: every test of the suites named (or skip one with a declaration's sentence) and skip every other, naming the
#: method they lack or the declaration that opts them in
CONVENTION_OPS = {"no-floor-fp32-writer": ("test_op_write.py",), "bf16-scale-writer": ("test_op_write.py",),
                  "minus-inf-merge": ("test_op_merge.py",), "no-lse-prefill": ("test_op_prefill.py", "test_op_merge.py")}
#: the skips a convention op may have: a method it lacks, a declared value another test needs, no lse
CONVENTION_SKIPS = (" has no ", "is (", "declares prefill_returns_lse = False")

#: contract violations: errors (BackendOutputError), not verdicts: key -> (spec, name, node, what the error says)
ERROR_OPS = {
    "prefill-no-lse-undeclared": (f"{BROKEN}:NoLsePrefillUndeclared", "broken-prefill-no-lse-undeclared",
                                  "test_op_prefill.py::test_prefill_non_causal[]",
                                  "declares prefill_returns_lse = False"),
    "prefill-lse-heads-first": (f"{BROKEN}:PrefillLseHeadsFirst", "broken-prefill-lse-heads-first",
                                "test_op_prefill.py::test_prefill_non_causal[]",
                                "expected float32 [total_q, h_q] = (19, 8); it is laid out [h_q, total_q]"),
    "merge-out-float32": (f"{BROKEN}:MergeOutFloat32", "broken-merge-out-float32",
                          "test_op_merge.py::test_merge_vs_oracle[-bfloat16]", "expected bfloat16 [T, h, d]"),
}
#: the method each suite's tests need first (the one an op without it is told it lacks): a method's suites (its
#: MethodSpec's) need it; the composition (prefill, then merge) needs prefill first
SUITE_METHOD = {**{suite: spec.name for spec in METHOD_SPECS if not spec.base for suite in spec.suites},
                "test_op_composition.py": "prefill"}


def _node(test: str, name: str) -> str:
    path, rest = test.split("::")
    func, params = rest.split("[")
    return f"suites/{path}::{func}[{name}{params}"


CELLS = [(key, test, _node(test, name)) for key, (_, name, tests, _) in BROKEN_OPS.items() for test in tests]
ERRORS = [(key, _node(test, name)) for key, (_, name, test, _) in ERROR_OPS.items()]


def method_tests() -> set[str]:
    """file::function of every test in the method suites (each requests mla_op)."""
    found = set()
    for name in METHOD_SUITES:
        for node in ast.parse((SUITES / name).read_text(encoding="utf-8")).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                assert "mla_op" in [a.arg for a in node.args.args], f"{name}::{node.name} takes no mla_op"
                found.add(f"{name}::{node.name}")
    return found


#: the suites of the op methods beyond decode
METHOD_SUITE_FILES = [f"suites/{name}" for name in METHOD_SUITES]


def method_cells_run(pytester) -> harness.SuiteRun:
    """The op methods' cells on their broken ops, and the crash cells."""
    ops = [s for s, *_ in [*BROKEN_OPS.values(), *ERROR_OPS.values()]]
    cells = [*(n for _, _, n in CELLS), *(n for _, n in ERRORS)]
    return harness.run_inprocess(pytester, cells, ops=list(dict.fromkeys(ops)), expect=1)


def method_correct_run(pytester) -> harness.SuiteRun:
    """Every test of the method suites on the correct method ops."""
    return harness.run_inprocess(pytester, METHOD_SUITE_FILES, ops=[s for s, *_ in CORRECT_OPS.values()])



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
    assert reason.startswith(f"{name} ") and "\n  case: " in reason, \
        f"{nodeid}: the failure does not name the op and (on a line of its own) the case: {reason}"
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
