"""Every op check can fail, and correct ops pass: each broken op of tests/meta/impls/broken/ops.py must come out
*failed* (an AssertionError verdict naming the op, not an error, a skip or a pass) in the op tests named for it;
the ops written independently of reference-op (tests/meta/impls/independent/op.py) pass every op test, the one that
implements only the base contract with explicit skips for what it does not declare; crashing ops are *errors*.
All of it through the plugin (--mla-op, --mla-results), as a user runs it: a run of the op matrix's cells and
one of its correct ops over OP_SUITES (:func:`op_cells_run`, :func:`op_correct_run`)."""

import ast
import json

import pytest

from . import harness
from .test_kill_matrix import ELSEWHERE

pytestmark = pytest.mark.meta

HERE = "tests/meta"
OPS = f"{HERE}/impls/broken/ops.py"
CALL_OPS = f"{HERE}/impls/broken/call_ops.py"
KERNEL_OPS = f"{HERE}/impls/kernel_style/kernel_ops.py"
FROZEN = f"{HERE}/frozen_base_op.py"
ENGINE_OPS = f"{HERE}/impls/kernel_style/engine_ops.py"
BROKEN_ENGINE = f"{HERE}/impls/broken/engine_ops.py"

#: broken op -> (spec, the name it reports, the op tests (file::function[params after the op name]) that must fail it)
BROKEN_OPS = {
    "ignores-extra-cache": (f"{OPS}:IgnoresExtraCache", "broken-ignores-extra-cache",
                            ["test_op_sparse.py::test_sparse_two_caches[-all]"]),
    "ignores-extra-topk-length": (f"{OPS}:IgnoresExtraTopkLength", "broken-ignores-extra-topk-length",
                                  ["test_op_sparse.py::test_sparse_two_caches[-lengths]"]),
    "lse-base2-as-e": (f"{OPS}:Base2DeclaredE", "broken-lse-base2-as-e",
                       ["test_op_numerics.py::test_out_lse_vs_oracle[-float32]", "test_op_numerics.py::test_split_kv_merge[-1]",
                        "test_op_sparse.py::test_sparse_vs_oracle[]"]),
    "lse-natural-as-2": (f"{OPS}:NaturalDeclaredBase2", "broken-lse-natural-as-2",
                         ["test_op_numerics.py::test_out_lse_vs_oracle[-float32]"]),
    "nan-empty-rows": (f"{OPS}:NanForEmptyRows", "broken-nan-empty-rows",
                       ["test_op_paging.py::test_empty_and_single_key_rows[]",
                        "test_op_sparse.py::test_sparse_all_invalid_rows[]", "test_op_numerics.py::test_split_kv_merge[-2]"]),
    "reads-page-tail": (f"{OPS}:ReadsPageTail", "broken-reads-page-tail",
                        ["test_op_paging.py::test_poisoned_pages[]", "test_op_fp8.py::test_fp8_all_zero_kv[]"]),
    "top-left-causal": (f"{OPS}:TopLeftCausal", "broken-top-left-causal",
                        ["test_op_paging.py::test_multi_token_decode[-4-causal]"]),
    "minus-one-last-token": (f"{OPS}:MinusOneIsLastToken", "broken-minus-one-last-token",
                             ["test_op_sparse.py::test_sparse_invalid_indices[-minus-one]",
                              "test_op_sparse.py::test_sparse_equals_dense[]"]),
    "attn-sink-ignored": (f"{OPS}:SinkIgnored", "broken-attn-sink-ignored",
                          ["test_op_sparse.py::test_attn_sink[]", "test_op_numerics.py::test_attn_sink_dense[]"]),
    # P kept to 3 bits fewer than the cache dtype: an error ~4x the derived bound (written without the reference)
    "coarse-p": (f"{KERNEL_OPS}:CoarsePOp", "broken-coarse-p",
                 ["test_op_numerics.py::test_out_lse_vs_oracle[-bfloat16]",
                  "test_op_numerics.py::test_out_lse_vs_oracle[-float16]"]),
    "fp8-exponent-only": (f"{OPS}:Fp8ExponentOnly", "broken-fp8-exponent-only", ["test_op_fp8.py::test_fp8_scale_probe[]"]),
    "fp8-scales-as-bf16": (f"{OPS}:Fp8ScalesAsBf16", "broken-fp8-scales-as-bf16",
                           ["test_op_fp8.py::test_fp8_scale_probe[]", "test_op_fp8.py::test_fp8_vs_dequantized_oracle[]"]),
    "writes-past-block-table": (f"{OPS}:WritesPastBlockTable", "broken-writes-past-block-table",
                                ["test_op_paging.py::test_poisoned_pages[]"]),
    "ignores-q-strides": (f"{OPS}:IgnoresQStrides", "broken-ignores-q-strides", ["test_op_paging.py::test_noncontiguous_q[]"]),
    "naive-softmax": (f"{OPS}:NaiveSoftmax", "broken-naive-softmax", ["test_op_fp8.py::test_fp8_magnitude_sweep[-x256]"]),
    "ignores-topk-length": (f"{OPS}:IgnoresTopkLength", "broken-ignores-topk-length",
                            ["test_op_sparse.py::test_sparse_topk_length[]"]),
    "nondeterministic": (f"{OPS}:Nondeterministic", "broken-nondeterministic", ["test_op_numerics.py::test_deterministic[]"]),
    "batch-variant": (f"{OPS}:BatchVariant", "broken-batch-variant", ["test_op_numerics.py::test_batch_invariant[]"]),
    "heads-capped": (f"{OPS}:HeadsCapped", "broken-heads-capped-at-64", ["test_op_paging.py::test_head_counts[-128]"]),
    "assumes-page-64": (f"{OPS}:AssumesPage64", "broken-assumes-page-64", ["test_op_paging.py::test_page_sizes[-16]"]),
    # engines' padded CUDA-graph batches and graph replays (tests/meta/impls/broken/engine_ops.py: the reports they model)
    "nan-padding-long-max-len": (f"{BROKEN_ENGINE}:NanPaddingAtLongMaxLen", "broken-nan-padding-at-long-max-len",
                                 ["test_op_padding.py::test_padded_batch[-trailing]"]),
    "reads-block-table-minus-one": (f"{BROKEN_ENGINE}:ReadsBlockTableMinusOne", "broken-reads-block-table-minus-one",
                                    ["test_op_padding.py::test_padded_batch[-trailing]"]),
    "metadata-sized-to-real-rows": (f"{BROKEN_ENGINE}:MetadataSizedToRealRows", "broken-metadata-sized-to-real-rows",
                                    ["test_op_padding.py::test_padded_batch[-trailing]",
                                     "test_op_padding.py::test_padded_batch[-interleaved]"]),
    "zeroes-trailing-rows-only": (f"{BROKEN_ENGINE}:ZeroesTrailingRowsOnly", "broken-zeroes-trailing-rows-only",
                                  ["test_op_padding.py::test_padded_batch[-interleaved]"]),
    "undefined-padding-leaks": (f"{BROKEN_ENGINE}:UndefinedPaddingLeaks", "broken-undefined-padding-leaks",
                                ["test_op_padding.py::test_padded_batch[-interleaved]"]),
    "sparse-reads-at-topk-length-0": (f"{BROKEN_ENGINE}:SparseReadsAtTopkLengthZero",
                                      "broken-sparse-reads-at-topk-length-0",
                                      ["test_op_padding.py::test_padded_sparse_batch[-trailing]",
                                       "test_op_padding.py::test_padded_sparse_batch[-interleaved]"]),
    "stale-plan-on-data-ptr": (f"{BROKEN_ENGINE}:StalePlanOnDataPtr", "broken-stale-plan-on-data-ptr",
                               ["test_op_replay.py::test_graph_replay[-dense]",
                                "test_op_replay.py::test_graph_replay[-sparse]"]),
    # engines' calls (issue 26): preallocated outputs, speculative verification
    "rejects-out": (f"{CALL_OPS}:RejectsOutAtMultiToken", "broken-rejects-out-multi-token",
                    ["test_op_out_buffers.py::test_out_buffers[-2]"]),
    "half-written-out": (f"{CALL_OPS}:HalfWrittenOut", "broken-half-written-out",
                         ["test_op_out_buffers.py::test_out_buffers[-3]"]),
    "new-tensor-out": (f"{CALL_OPS}:NewTensorOut", "broken-new-tensor-out", ["test_op_out_buffers.py::test_out_buffers[-1]"]),
    "ignores-out-strides": (f"{CALL_OPS}:IgnoresOutStrides", "broken-ignores-out-strides",
                            ["test_op_out_buffers.py::test_out_buffers_strided[-tokens-first]",
                             "test_op_out_buffers.py::test_out_buffers_strided[-heads-first]"]),
    "same-output": (f"{CALL_OPS}:SameOutputAllPositions", "broken-same-output-all-positions",
                    ["test_op_speculative.py::test_speculative_verify[-6]"]),
    "rows-past-batch": (f"{CALL_OPS}:ReadsRowsPastBatch", "broken-reads-rows-past-batch",
                        ["test_op_speculative.py::test_speculative_verify[-3]"]),
    "nan-at-q-len-2": (f"{CALL_OPS}:NanAtQLen2", "broken-nan-at-q-len-2",
                       ["test_op_paging.py::test_multi_token_decode[-2-causal]"]),
}

#: a failure message must say this (the likely cause) for the broken op's cells
HINTS = {"top-left-causal": "likely cause: top-left causal alignment",
         "nan-padding-long-max-len": "only at a long max length",
         "reads-block-table-minus-one": "the op read a page through a padding row",
         "metadata-sized-to-real-rows": "xLLM #1939",
         "zeroes-trailing-rows-only": "as if padding always trailed the batch",
         "undefined-padding-leaks": "NaN leaked into a real row",
         "sparse-reads-at-topk-length-0": "the op read a key through a padding row",
         "stale-plan-on-data-ptr": "state the op kept from an earlier call",
         "rejects-out": "rejects a legal preallocated buffer", "half-written-out": "only query position 0 of each row",
         "new-tensor-out": "is not the buffer it was handed", "ignores-out-strides": "likely cause: the op wrote its out / lse buffers as if they were contiguous",
         "same-output": "likely cause: every query position of row",
         "rows-past-batch": "likely cause: the op reads block_table / cache_seqlens rows past the batch",
         "nan-at-q-len-2": "non-finite value(s) in queries with keys",
         "lse-natural-as-2": "the lse matches the natural log"}

#: correct ops: every op test runs on them; "all" must pass; otherwise they may skip only with the sentences
#: of SKIPS[mode] (their own unsupported_reason, or a declaration they do not make)
CORRECT_OPS = {
    "independent": (f"{HERE}/impls/independent/op.py:IndependentOp", "independent-op", "all"),
    "base-contract": (f"{HERE}/impls/independent/op.py:BaseContractOp", "base-contract-op", "base"),
    # P rounded to the cache dtype before P.V, float32 accumulation, online softmax over pages (half precision)
    "p-rounding-bf16": (f"{KERNEL_OPS}:PRoundingOp", "p-rounding-op", "dtype"),
    "p-rounding-fp16": (f"{KERNEL_OPS}:PRoundingFp16Op", "p-rounding-fp16-op", "dtype"),
    "split-kv": (f"{KERNEL_OPS}:SplitKVOp", "split-kv-op", "dtype"),
    "no-lse-triton": (f"{KERNEL_OPS}:NoLseTritonOp", "no-lse-triton-op", "no-lse"),
    "frozen": (f"{FROZEN}:FrozenBaseOp", "frozen-base-op", "frozen"),
    # as engines run decode in padded CUDA-graph batches: split-KV by the batch's max length; padding rows zeroed
    # after the call (vLLM); padding rows left NaN and declared undefined
    "split-by-max-len": (f"{ENGINE_OPS}:SplitByMaxLenOp", "split-by-max-len-op", "engine"),
    "zero-padding-after": (f"{ENGINE_OPS}:ZeroPaddingAfterOp", "zero-padding-after-op", "engine"),
    "undefined-padding": (f"{ENGINE_OPS}:UndefinedPaddingOp", "undefined-padding-op", "engine"),
}
#: a skip that names the declaration opting the op in (the op suite's own sentences)
DECLARATION_SKIPS = ("kv_formats is", "page_block_sizes is", "does not declare sparse_decode",
                     "does not declare attn_sink", "does not declare deterministic", "does not declare batch_invariant",
                     "invalid_index = 'minus-one'", "declares returns_lse = False", "does not declare out_buffers")
SKIPS = {
    "base": ("implements dense decode only", "takes no attn_sink",
             "reads a latent cache in q's dtype only",  # its own sentence, asked before the declarations
             *DECLARATION_SKIPS),
    "dtype": ("computes with a ",),  # the kernel-style ops take one dtype
    "no-lse": ("computes with a ", "leaves a query with no keys undefined", *DECLARATION_SKIPS),
    "frozen": DECLARATION_SKIPS,
    "engine": ("decodes dense over a latent cache, without a sink, only", "leaves a causal query before its row's first "
               "key undefined", "leaves a zero-length row undefined", *DECLARATION_SKIPS),
}

#: crashes and contract violations are errors, not verdicts
ERROR_OPS = {
    "raises": (f"{OPS}:RaisesOnDecode", "broken-op-raises", "test_op_numerics.py::test_out_lse_vs_oracle[-float32]"),
    "lse-layout": (f"{OPS}:WrongLseLayout", "broken-op-lse-layout", "test_op_numerics.py::test_out_lse_vs_oracle[-float32]"),
    "half-lse": (f"{KERNEL_OPS}:HalfLseOp", "broken-half-lse", "test_op_numerics.py::test_out_lse_vs_oracle[-bfloat16]"),
}
#: what an error's message must say
ERROR_TEXT = {"half-lse": ("lse is bfloat16, not float32", "significant bits", "merged")}


def _op_node(test: str, name: str) -> str:
    path, rest = test.split("::")
    func, params = rest.split("[")
    return f"suites/{path}::{func}[{name}{params}"


#: (broken op key, op test, node id) of every op cell; (error op key, node id) of every crash cell
OP_CELLS = [(key, test, _op_node(test, name)) for key, (_, name, tests) in BROKEN_OPS.items() for test in tests]
OP_ERRORS = [(key, _op_node(test, name)) for key, (_, name, test) in ERROR_OPS.items()]


#: the op suites of the op matrix: every suites/test_op_*.py but those another meta module kills (ELSEWHERE)
OP_SUITES = [f"suites/{p.name}" for p in sorted((harness.ROOT / "suites").glob("test_op_*.py"))
             if f"suites/{p.name}" not in ELSEWHERE]

def op_cells_run(pytester) -> harness.SuiteRun:
    """Every op cell on its broken op, the crash cells of the erroring ops."""
    ops = [spec for spec, _, _ in [*BROKEN_OPS.values(), *ERROR_OPS.values()]]
    return harness.run_inprocess(pytester, [*(n for _, _, n in OP_CELLS), *(n for _, n in OP_ERRORS)], ops=ops,
                                 expect=1)


def op_correct_run(pytester) -> harness.SuiteRun:
    """Every test of :data:`OP_SUITES` on every correct op."""
    return harness.run_inprocess(pytester, OP_SUITES, ops=[spec for spec, _, _ in CORRECT_OPS.values()])

ROOT = harness.ROOT
SUITES = ROOT / "suites"
CELLS, ERRORS = OP_CELLS, OP_ERRORS


def op_tests() -> set[str]:
    """file::function of every test in the op suites of this matrix (each requests mla_op)."""
    found = set()
    for path in (ROOT / f for f in OP_SUITES):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                assert "mla_op" in [a.arg for a in node.args.args], f"{path.name}::{node.name} takes no mla_op"
                found.add(f"{path.name}::{node.name}")
    return found


@pytest.fixture
def run(suite_run) -> harness.SuiteRun:
    """The op matrix: every cell on its broken op, and every test of OP_SUITES on the correct ops."""
    return suite_run("op-matrix", lambda pytester: op_cells_run(pytester).joined(op_correct_run(pytester)))


def test_every_op_test_is_failed_by_a_broken_op():
    tests = op_tests()
    covered = {test.split("[")[0] for _, test, _ in CELLS}
    assert not sorted(tests - covered), f"op tests no broken op is shown to fail: {sorted(tests - covered)}"
    assert not sorted(covered - tests), f"cells for op tests that do not exist: {sorted(covered - tests)}"


@pytest.mark.parametrize("key,test,nodeid", CELLS, ids=[f"{t.split('::')[1].split('[')[0]}<-{k}" for k, t, _ in CELLS])
def test_broken_op_fails_its_check(run, key, test, nodeid):
    name = BROKEN_OPS[key][1]
    reason = run.assert_failed(nodeid, name)
    got = run.result(nodeid)
    assert reason.startswith(f"{name} ") and "\n  case: B=" in reason, \
        f"{nodeid}: the failure does not name the op and (on a line of its own) the case: {reason}"
    assert got.get("figures", {}).get("case"), f"{nodeid}: no case figure recorded: {got}"
    if key in HINTS:
        assert HINTS[key] in reason, f"{nodeid}: the failure does not name the likely cause {HINTS[key]!r}: {reason}"


def test_declarations_decide_what_runs(run):
    """invalid_index: an op of the default "minus-one" is handed -1 only (the other kinds skip naming the
    declaration); returns_lse = False: out checks run with lse None, the merge skips naming returns_lse."""
    by = run.by_id
    kind = "suites/test_op_sparse.py::test_sparse_invalid_indices[no-lse-triton-op-{}]"
    assert by[kind.format("minus-one")]["outcome"] == "passed"
    for k in ("past-end", "int-max"):
        got = by[kind.format(k)]
        assert got["outcome"] == "skipped" and "defaults to invalid_index = 'minus-one'" in got["reason"] \
            and "(declare invalid_index = 'out-of-range'" in got["reason"], got
    assert by[kind.format("int-max").replace("no-lse-triton-op", "independent-op")]["outcome"] == "passed"
    merge = by["suites/test_op_numerics.py::test_split_kv_merge[no-lse-triton-op-1]"]
    assert merge["outcome"] == "skipped" and "returns_lse = False" in merge["reason"], merge
    dense = by["suites/test_op_numerics.py::test_out_lse_vs_oracle[no-lse-triton-op-bfloat16]"]
    assert dense["outcome"] == "passed" and dense["figures"]["lse_compared"] is False, dense
    # rows without keys declined with the op's own sentence; the multi-token test falls back to rows of s_q keys
    assert "leaves a query with no keys undefined" in by[
        "suites/test_op_paging.py::test_empty_and_single_key_rows[no-lse-triton-op]"]["reason"]
    assert by["suites/test_op_paging.py::test_multi_token_decode[no-lse-triton-op-8-causal]"]["outcome"] == "passed"


def test_padding_declarations_and_the_two_kinds_of_rows_without_keys(run):
    """An op declines one kind of query without keys and keeps the other (zero-padding-after-op: zero-length rows
    yes, causal queries before the first key no); padding_rows = 'undefined' leaves padding rows unlooked at; the
    frozen base op passes the padded and replayed batches (legal under the base contract)."""
    by = run.by_id
    empty = by["suites/test_op_paging.py::test_empty_and_single_key_rows[zero-padding-after-op]"]
    assert empty["outcome"] == "skipped" and "causal query before its row's first key" in empty["reason"], empty
    merge = by["suites/test_op_numerics.py::test_split_kv_merge[zero-padding-after-op-1]"]
    assert merge["outcome"] == "passed" and "rows without keys" in merge["figures"]["case"], merge  # empty parts
    for op in ("zero-padding-after-op", "undefined-padding-op", "frozen-base-op", "base-contract-op"):
        for layout in ("trailing", "interleaved"):
            got = by[f"suites/test_op_padding.py::test_padded_batch[{op}-{layout}]"]
            assert got["outcome"] == "passed", got
            assert got["figures"]["padding_rows_compared"] is (op != "undefined-padding-op"), got
    assert by["suites/test_op_replay.py::test_graph_replay[frozen-base-op-dense]"]["outcome"] == "passed"
    assert by["suites/test_op_replay.py::test_graph_replay[zero-padding-after-op-dense]"]["figures"]["replay_bitwise"]


def test_the_likely_cause_is_named_only_where_it_applies(run):
    """The top-left hint is not handed to ops failing causal tests for other reasons (the op methods' matrix, in
    the same run, has its own top-left op)."""
    for t in run.only(OP_SUITES).tests:
        if HINTS["top-left-causal"] in t.get("reason", ""):
            assert t.get("params", {}).get("op") == BROKEN_OPS["top-left-causal"][1], t["nodeid"]


def test_bounds_are_not_loose_for_the_p_rounding_ops(run):
    """The correct P-rounding ops use a real share of the bound (the bound is not slack by orders of magnitude),
    and the 4x broken op exceeds it by about 4x: the derived bound separates them."""
    def worst(name, test):
        rows = [t for t in run.tests if t.get("params", {}).get("op") == name and test in t["nodeid"]]
        return max(float(t.get("figures", {}).get("out_error_over_bound", 0.0)) for t in rows)
    for name in ("p-rounding-op", "p-rounding-fp16-op", "split-kv-op"):
        assert 0.3 < worst(name, "test_out_lse_vs_oracle") <= 1.0, (name, worst(name, "test_out_lse_vs_oracle"))
    for dt in ("bfloat16", "float16"):
        ratio = worst("broken-coarse-p", f"test_out_lse_vs_oracle[broken-coarse-p-{dt}]")
        assert 3.0 < ratio < 6.0, (dt, ratio)


@pytest.mark.parametrize("key", list(CORRECT_OPS))
def test_correct_op_passes(run, key):
    _, name, mode = CORRECT_OPS[key]
    mine = run.only(OP_SUITES).tests
    rows = [t for t in mine if t.get("params", {}).get("op") == name]
    expected = sum(1 for t in mine if t.get("params", {}).get("op") == CORRECT_OPS["independent"][1])
    assert len(rows) == expected and rows, f"{name}: {len(rows)} op tests ran, expected {expected}"
    bad = [f"{t['nodeid']}: {t['outcome']} {t.get('reason', '')}" for t in rows if t["outcome"] not in ("passed", "skipped")]
    assert not bad, f"{name} does not pass:\n" + "\n".join(bad)
    skipped = [t for t in rows if t["outcome"] == "skipped"]
    if mode == "all":
        assert not skipped, f"{name} declares every optional part but skipped: {[t['nodeid'] for t in skipped]}"
        return
    # every sentence of a skip (first_supported joins them with '; ') is one the op may skip with
    odd = [f"{t['nodeid']}: {t.get('reason')}" for t in skipped if not t.get("reason", "").startswith(f"{name}: ")
           or not all(any(s in part for s in SKIPS[mode]) for part in t["reason"].removeprefix(f"{name}: ").split("; "))]
    assert not odd, f"{name} skipped for reasons other than what it does not declare:\n" + "\n".join(odd)
    passed = len(rows) - len(skipped)
    assert passed >= 20, f"{name}: {passed} passed, {len(skipped)} skipped"
    if mode == "dtype":  # one dtype: only the test_out_lse_vs_oracle parametrisations of other dtypes skip
        assert all("test_out_lse_vs_oracle" in t["nodeid"] or "test_op_fp8" in t["nodeid"] for t in skipped), \
            [t["nodeid"] for t in skipped]
    if mode in ("base", "frozen"):
        assert len(skipped) >= 10, f"{name}: {passed} passed, {len(skipped)} skipped"


@pytest.mark.parametrize("key,nodeid", ERRORS, ids=[k for k, _ in ERRORS])
def test_crash_is_an_error(run, key, nodeid):
    reason = run.assert_error(nodeid, "BackendError", "BackendOutputError")
    for text in ERROR_TEXT.get(key, ()):
        assert text in reason, f"{nodeid}: the error does not say {text!r}: {reason}"


@pytest.mark.parametrize("path", sorted({spec.split(":")[0] for spec, _, _ in CORRECT_OPS.values()}))
def test_independent_ops_import_nothing_of_the_suite(path):
    """The correct ops share no code with reference-op or the oracle: their files import torch and math only."""
    tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
    modules = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names} | \
        {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert modules <= {"__future__", "math", "torch"}, modules


def test_the_frozen_op_is_the_base_contract():
    """The frozen op has exactly the base contract's surface: a name, unsupported_reason and decode, and no optional
    declaration (the README's op, its relation to this one: tests/meta/test_readme_template.py)."""
    from mla_conformance.contract.op import DECLARATIONS

    tree = ast.parse((ROOT / FROZEN.split(":")[0]).read_text(encoding="utf-8"))
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef)]
    members = {n.targets[0].id if isinstance(n, ast.Assign) else n.name for n in cls.body
               if isinstance(n, (ast.Assign, ast.FunctionDef))}
    assert members == {"name", "unsupported_reason", "decode"}, members
    assert not members & set(DECLARATIONS)


def test_results_record_ops_and_declarations(run):
    names = [name for _, name, _ in [*BROKEN_OPS.values(), *ERROR_OPS.values(), *CORRECT_OPS.values()]]
    assert run["ops"] == names, run["ops"]  # the cells run's, then the correct ops' run's
    decl = run["op_declarations"]["independent-op"]
    assert decl == {"lse_base": "2", "returns_lse": True, "empty_row": "-inf", "sparse_decode": True,
                    "sparse_decode_extra_cache": True,
                    "invalid_index": "out-of-range", "attn_sink": True, "page_block_sizes": [1, 16, 64],
                    "kv_formats": ["latent", "fp8-e4m3-flashmla"], "fp8_scale_format": "fp32",
                    "deterministic": True, "batch_invariant": True, "head_dims": [[576, 512]],
                    "padding_rows": "defined", "out_buffers": True}, decl
    assert run["op_declarations"]["undefined-padding-op"]["padding_rows"] == "undefined"
    assert run["op_declarations"]["no-lse-triton-op"]["returns_lse"] is False
    assert run["op_declarations"]["base-contract-op"]["page_block_sizes"] == [64]
    row = run.by_id["suites/test_op_numerics.py::test_out_lse_vs_oracle[independent-op-float32]"]
    assert row["params"] == {"op": "independent-op", "dtype": "float32"} and row["section"] == "op-numerics", row
    assert {"case", "out_max_abs", "out_rel_fro", "out_error_over_bound", "lse_max_abs", "tolerance_p_round",
            "tolerance_dot", "tolerance_acc", "tolerance_u_out"} <= set(row["figures"])


# --------------------------------------------------------------------------- the plugin's --mla-op selection


SELECTION_TESTS = """
def test_layer(mla_backend):
    pass


def test_op(mla_op):
    pass
"""


def _collect(pytester, *options) -> tuple[int, str]:
    """Collect one layer test and one op test (a file of their own in pytester's directory: collecting the real
    suites costs seconds) with the given options, in this process."""
    pytester.makepyfile(test_kinds=SELECTION_TESTS)
    # no:unraisableexception: its cleanup runs gc.collect() twice per session, 2/3 of a collection's time here
    got = harness.pytest_inprocess(pytester, "-n", "0", "-p", "no:unraisableexception",
                                   "-q", "--co", *options)
    return int(got.ret), "\n".join(got.outlines + got.errlines)


def _ids(out: str, kind: str) -> list[str]:
    return [line for line in out.splitlines() if f"::test_{kind}[" in line]


def test_selection_by_options(pytester):
    from mla_conformance.contract.layer import DEFAULT_BACKENDS

    independent = f"{ROOT / 'tests/meta/impls/independent/op.py'}:IndependentOp"
    code, out = _collect(pytester)  # neither option: the default backends' layer tests, the default ops' op tests
    assert code == 0 and len(_ids(out, "layer")) == len(DEFAULT_BACKENDS), out[-3000:]
    assert [line.split("[")[1] for line in _ids(out, "op")] == ["reference-op]"], out[-3000:]
    code, out = _collect(pytester, "--mla-backend", "reference-absorbed")  # a verdict on a backend
    assert code == 0 and _ids(out, "layer") and not _ids(out, "op"), out[-3000:]
    assert "1 op tests deselected: --mla-backend was given without --mla-op" in out, out[-3000:]
    code, out = _collect(pytester, "--mla-op", independent)  # a verdict on an op
    assert code == 0 and not _ids(out, "layer") and _ids(out, "op") == [line for line in _ids(out, "op")
                                                                          if "[independent-op]" in line], out[-3000:]
    assert f"{len(DEFAULT_BACKENDS)} layer tests deselected: --mla-op was given without --mla-backend" in out, \
        out[-3000:]
    code, out = _collect(pytester, "--mla-op", independent, "--mla-backend", "reference-absorbed")  # both
    assert code == 0 and _ids(out, "layer") and _ids(out, "op") and "deselected:" not in out, out[-3000:]


def test_an_op_verdict_deselects_the_layer_tests_across_ranks(pytester):
    """--mla-op alone: suites/test_distributed.py's tests, parametrized by ``distributed_backend`` rather than
    ``mla_backend``, are layer tests too, so deselected; they were collected as an empty parameter set, skipped,
    and `mla-conformance run --op reference-op` reported a backend named 'token' (pytest's NOTSET) as NOT TESTED
    and exited 1."""
    got = harness.pytest_inprocess(pytester, "-n", "0", "-p", "no:unraisableexception", "-q", "--co", "--rootdir",
                                   str(ROOT), str(ROOT / "suites/test_distributed.py"), "--mla-op", "reference-op")
    out = "\n".join(got.outlines + got.errlines)
    tests = sum(line.startswith("def test_") for line in (ROOT / "suites/test_distributed.py").read_text().splitlines())
    assert "test_distributed.py::" not in out, out[-3000:]
    assert f"{tests} layer tests deselected: --mla-op was given without --mla-backend" in out, out[-3000:]


def test_an_empty_parameter_set_names_no_backend(pytester):
    """A suite test whose backend parameter has no value (pytest's one placeholder test, skipped) is recorded
    without a backend: pytest's placeholder NOTSET, whose name is "token", was the report's backend 'token'."""
    pytester.makepyfile(test_empty="""
import pytest

@pytest.mark.parametrize("distributed_backend", [])
def test_across_ranks(distributed_backend, mla_figures):
    pass
""")
    results = pytester.path / "results.json"
    got = harness.pytest_inprocess(pytester, "-n", "0", "-p", "no:unraisableexception", "-q", "--mla-backend",
                                   "reference-absorbed", "--mla-results", str(results))
    (entry,) = json.loads(results.read_text())["tests"]
    assert entry["outcome"] == "skipped" and "backend" not in entry.get("params", {}), (entry, got.outlines[-5:])


@pytest.mark.parametrize("spec,message", [
    ("no-such-op", "--mla-op: op spec 'no-such-op': not a built-in op"),
    ("reference-opp", "did you mean 'reference-op'?"),
    ("tests/meta/impls/independent/op.py:Missing", "--mla-op: op spec 'tests/meta/impls/independent/op.py:Missing'"),
])
def test_bad_op_spec_is_a_usage_error(pytester, spec, message):
    code, out = _collect(pytester, "--mla-op", spec)
    assert code == pytest.ExitCode.USAGE_ERROR and message in out, out[-3000:]


def test_duplicate_op_names_are_refused(pytester):
    code, out = _collect(pytester, "--mla-op", "reference-op", "--mla-op", "reference-op")
    assert code == pytest.ExitCode.USAGE_ERROR and "--mla-op: two ops share the name(s) ['reference-op']" in out, out
