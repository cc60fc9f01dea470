"""The op methods' meta run's tables (tests/meta/test_op_methods_meta.py reads them; tests/meta/kill_matrix.py runs
their cells in the layer matrix's process): each broken op of tests/meta/impls/broken/op_methods.py and the method
tests that must fail it, the correct ops, the ops that must error, and the method suites' tests."""

import ast

from mla_conformance.contract.methods import METHOD_SPECS, METHOD_SUITES
from tests.meta import harness

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
