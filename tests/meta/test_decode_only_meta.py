"""Decode-only ops get the whole verdict (issue 45): an op that declines s_q > 1 -- most decode kernels -- runs every
op test whose rule is not about multi-token decode at s_q 1 (dtype numerics in float32 / bfloat16 / float16,
non-contiguous q, empty and single-key rows, sparse decode, split-KV at s_q 1), and the layer suite through it
(``--mla-backend op:SPEC``): prefill rows by the suite's reference over the op's cache, every one-token decode step
through the op.

Two in-process runs of the suite (tests/meta/harness.py), as a user runs it: the cells below by node id, and the
op suites on the two correct decode-only ops:

* the README's MyOp restricted to s_q 1 (tests/meta/impls/independent/decode_only_op.py: its decode is the README's,
  verbatim) over the op suites (test_op_meta.OP_SUITES) passes, its skips name only what it does not declare or its
  s_q sentence, and it executes out / lse numerics in float32, bfloat16 and float16 at s_q 1; behind op: it passes
  the layer numerics, paging, bytes, multi-token steps and the tiny model's golden generation (it declares
  head_dims "any": the tiny model is 80 / 64);
* an op doing sparse decode only, in bfloat16, at s_q 1, over the FP8 656-byte cache (FlashMLA's sparse decode as
  its test oracle runs it) executes the sparse tests; an op declaring every optional part at s_q 1 only passes every
  op test but the s_q > 1 parametrisations of the multi-token tests (tests/meta/impls/independent/narrow_ops.py);
* the broken decode-only ops (tests/meta/impls/broken/decode_only_ops.py) are *failed* by the tests named for them
  (:data:`CELLS`), naming the op and the case, and pass the dtypes they compute right.

Cases for ops that take s_q > 1 are unchanged (the kill matrix and tests/meta/test_op_meta.py hold every existing
verdict); the case choice itself is checked here without a run (:func:`test_make_case_variants`).
"""

from __future__ import annotations

import ast
import dataclasses

import pytest

from . import harness
from .test_op_meta import OP_SUITES
from .test_readme_template import OP_SECTION, readme_block

pytestmark = pytest.mark.meta
ROOT = harness.ROOT

INDEPENDENT = "tests/meta/impls/independent/decode_only_op.py"
NARROW = "tests/meta/impls/independent/narrow_ops.py"
BROKEN = "tests/meta/impls/broken/decode_only_ops.py"
MY_OP, SPARSE_OP, EVERY = "decode-only-my-op", "sparse-fp8-decode-only-op", "decode-only-independent-op"
NAN_ROW, BF16_ROPE = "broken-decode-only-nan-zero-key-row", "broken-decode-only-bf16-no-rope"
OPS = [f"{INDEPENDENT}:DecodeOnlyMyOp", f"{NARROW}:SparseFp8DecodeOnlyOp", f"{NARROW}:DecodeOnlyIndependentOp",
       f"{BROKEN}:NanForZeroKeyRow", f"{BROKEN}:RopeDroppedInBfloat16"]
BACKENDS = [f"op:{ROOT / INDEPENDENT}:DecodeOnlyMyOp", f"op:{ROOT / BROKEN}:RopeDroppedInBfloat16"]  # made absolute

N, P, S = "suites/test_op_numerics.py", "suites/test_op_paging.py", "suites/test_op_sparse.py"
#: broken op's node id -> the words its failure must say
CELLS = {
    f"{P}::test_empty_and_single_key_rows[{NAN_ROW}]": "has no keys, so out must be exactly 0; got nan",
    f"{N}::test_split_kv_merge[{NAN_ROW}-1]": "non-finite",
    f"{N}::test_out_lse_vs_oracle[{BF16_ROPE}-bfloat16]": "",
    # behind op:, its bfloat16 decode steps (the prefill is the suite's reference): the layer suite catches it too
    f"suites/test_numerics.py::test_against_float64[op:{BF16_ROPE}-bfloat16-prefill_decode-v3-mini]": "",
}
#: what the broken ops compute right: these pass
RIGHT = [f"{N}::test_out_lse_vs_oracle[{BF16_ROPE}-float32]", f"{N}::test_out_lse_vs_oracle[{BF16_ROPE}-float16]",
         f"{P}::test_noncontiguous_q[{NAN_ROW}]", f"{N}::test_out_lse_vs_oracle[{NAN_ROW}-bfloat16]"]
#: the layer suite through the restricted MyOp (op:): numerics, half precision, paging, bytes, MTP steps, goldens
LAYER = [f"suites/test_numerics.py::test_against_float64[op:{MY_OP}-float32-prefill_decode-tiny]",
         f"suites/test_numerics.py::test_against_float64[op:{MY_OP}-bfloat16-varlen_batch-v3-mini]",
         f"suites/test_numerics.py::test_float16[op:{MY_OP}-tiny]",
         f"suites/test_paged_cache.py::test_paged_equals_contiguous[op:{MY_OP}-tiny-float32-64]",
         f"suites/test_cache_bytes.py::test_bytes_formula[op:{MY_OP}-6-2-3-float32-tiny]",
         f"suites/test_layer_padding.py::test_multi_token_steps[op:{MY_OP}]",
         f"suites/test_generation_golden.py::test_golden_generation[op:{MY_OP}-tiny-short]"]
#: the sparse tests the sparse FP8 decode-only op executes (each built at s_q 2 before, declined by it)
SPARSE = [f"{S}::test_sparse_vs_oracle[{SPARSE_OP}]", f"{S}::test_sparse_topk_length[{SPARSE_OP}]",
          f"{S}::test_sparse_all_invalid_rows[{SPARSE_OP}]", f"{S}::test_attn_sink[{SPARSE_OP}]",
          *(f"{S}::test_sparse_invalid_indices[{SPARSE_OP}-{k}]" for k in ("minus-one", "past-end", "int-max")),
          *(f"{S}::test_sparse_two_caches[{SPARSE_OP}-{k}]" for k in ("all", "lengths"))]
#: the sentences the restricted MyOp may skip with: its own, or a declaration it does not make
MY_OP_SKIPS = ("decodes one query per row (s_q 1), not s_q", "kv_formats is", "page_block_sizes is",
               "does not declare sparse_decode", "does not declare attn_sink", "does not declare deterministic",
               "does not declare batch_invariant", "does not declare out_buffers", "has no prefill method",
               "has no merge method", "has no write method", "has no sparse_prefill method")


def _run(pytester) -> harness.SuiteRun:
    cells = harness.run_inprocess(pytester, [*CELLS, *RIGHT, *LAYER, *SPARSE], backends=BACKENDS, ops=OPS, expect=1)
    return cells.joined(harness.run_inprocess(pytester, OP_SUITES, ops=[OPS[0], OPS[2]]))


@pytest.fixture
def run(suite_run) -> harness.SuiteRun:
    return suite_run("decode-only-meta", _run)


def _mine(run, name: str) -> list[dict]:
    return [t for t in run.only(OP_SUITES).tests if t.get("params", {}).get("op") == name]


def test_decode_only_my_op_passes_the_op_suites(run):
    rows = _mine(run, MY_OP)
    assert rows, "the restricted MyOp ran no op test"
    bad = [f"{t['nodeid']}: {t['outcome']} {t.get('reason', '')}" for t in rows if t["outcome"] not in ("passed", "skipped")]
    assert not bad, "the restricted MyOp does not pass:\n" + "\n".join(bad)
    odd = [f"{t['nodeid']}: {t.get('reason')}" for t in rows if t["outcome"] == "skipped" and not all(
        any(s in part for s in MY_OP_SKIPS) for part in t.get("reason", "").split("; "))]
    assert not odd, "skipped for reasons other than its s_q sentence or what it does not declare:\n" + "\n".join(odd)
    passed = [t["nodeid"] for t in rows if t["outcome"] == "passed"]
    # 14 before s_q 1 (issue 45); now also out / lse in 4 dtypes, empty and single-key rows, non-contiguous q
    assert len(passed) >= 20, f"{len(passed)} op tests executed: {passed}"


#: the op tests about multi-token decode: their s_q > 1 parametrisations skip for a decode-only op (no fallback)
MULTI_TOKEN = ("test_multi_token_decode[", "test_speculative_verify[", "test_out_buffers[", "test_split_kv_merge[")


def test_every_test_not_about_multi_token_decode_runs_on_a_decode_only_op(run):
    """IndependentOp restricted to s_q 1, every optional part declared: every op test passes but the s_q > 1
    parametrisations of the multi-token tests, which skip with its s_q sentence alone."""
    rows = _mine(run, EVERY)
    bad = [f"{t['nodeid']}: {t['outcome']} {t.get('reason', '')}" for t in rows if t["outcome"] != "passed" and not (
        t["outcome"] == "skipped" and t["nodeid"].split("::")[1].startswith(MULTI_TOKEN)
        and t.get("reason", "").startswith(f"{EVERY}: {EVERY} decodes one query per row (s_q 1), not s_q ")
        and ";" not in t.get("reason", ""))]
    assert rows and not bad, f"{EVERY}:\n" + "\n".join(bad)
    for test in ("test_op_numerics.py::test_deterministic", "test_op_numerics.py::test_batch_invariant",
                 "test_op_numerics.py::test_attn_sink_dense", "test_op_fp8.py::test_fp8_vs_dequantized_oracle",
                 "test_op_out_buffers.py::test_out_buffers_strided"):
        got = [t for t in rows if t["nodeid"].startswith(f"suites/{test}[")]
        assert got and all(t["outcome"] == "passed" and "s_q=1" in t["figures"].get("case", "s_q=1") for t in got), got


@pytest.mark.parametrize("test", ["test_out_lse_vs_oracle[{}-float32]", "test_out_lse_vs_oracle[{}-bfloat16]",
                                  "test_out_lse_vs_oracle[{}-float16]", "test_split_kv_merge[{}-1]"])
def test_decode_only_numerics_run_in_every_dtype(run, test):
    got = run.result(f"{N}::{test.format(MY_OP)}")
    assert got["outcome"] == "passed", got
    assert "s_q=1" in got["figures"]["case"], got["figures"]


@pytest.mark.parametrize("test", ["test_empty_and_single_key_rows[{}]", "test_noncontiguous_q[{}]"])
def test_shape_tests_run_at_s_q_1(run, test):
    got = run.result(f"{P}::{test.format(MY_OP)}")
    assert got["outcome"] == "passed" and "s_q=1" in got["figures"]["case"], got


def test_skip_sentences_give_every_variants_reason(run):
    """A test the op declines at s_q 2 and at s_q 1 skips naming both reasons, the variant's named as such; a test
    about multi-token decode skips with the s_q sentence only (no s_q 1 fallback: its own s_q 1 case exists)."""
    sparse = run.result(f"{S}::test_sparse_vs_oracle[{MY_OP}]")
    assert sparse["outcome"] == "skipped", sparse
    assert sparse["reason"] == (f"{MY_OP}: {MY_OP} decodes one query per row (s_q 1), not s_q 2; s_q 1: does not declare "
                                "sparse_decode (the op contract's optional declaration `sparse_decode = True`), so "
                                "sparse decode (top-32 indices) is not tested"), sparse["reason"]
    mtp = run.result(f"{P}::test_multi_token_decode[{MY_OP}-2-causal]")
    assert mtp["outcome"] == "skipped" and mtp["reason"] == f"{MY_OP}: {MY_OP} decodes one query per row (s_q 1), not " \
                                                            "s_q 2", mtp  # one sentence, not one per row-length option
    assert run.result(f"{P}::test_multi_token_decode[{MY_OP}-1-causal]")["outcome"] == "passed"


@pytest.mark.parametrize("nodeid", LAYER)
def test_layer_suite_runs_through_a_decode_only_op(run, nodeid):
    got = run.result(nodeid)
    assert got["outcome"] == "passed", f"{nodeid}: {got['outcome']}: {got.get('reason', '')}"


@pytest.mark.parametrize("nodeid", SPARSE)
def test_sparse_fp8_decode_only_op_executes_the_sparse_tests(run, nodeid):
    got = run.result(nodeid)
    assert got["outcome"] == "passed", f"{nodeid}: {got['outcome']}: {got.get('reason', '')}"
    assert "s_q=1" in got["figures"]["case"] and "fp8" in got["figures"]["case"], got["figures"]


@pytest.mark.parametrize("nodeid", list(CELLS))
def test_broken_decode_only_op_fails_its_test(run, nodeid):
    name = nodeid.split("[")[1].removeprefix("op:")
    name = NAN_ROW if name.startswith(NAN_ROW) else BF16_ROPE
    reason = run.assert_failed(nodeid, name)
    shown = name if "::test_against_float64[" not in nodeid else f"op:{name}"
    assert reason.startswith(f"{shown} "), f"{nodeid}: the failure does not name the op: {reason}"
    assert CELLS[nodeid] in reason, f"{nodeid}: the failure does not say {CELLS[nodeid]!r}: {reason}"


@pytest.mark.parametrize("nodeid", RIGHT)
def test_broken_decode_only_op_passes_what_it_computes_right(run, nodeid):
    got = run.result(nodeid)
    assert got["outcome"] == "passed", f"{nodeid}: {got['outcome']}: {got.get('reason', '')}"


def test_the_restricted_op_is_the_readmes():
    """DecodeOnlyMyOp's decode is the README's MyOp.decode, verbatim (the restriction is its unsupported_reason and
    its head_dims declaration)."""
    def decode_of(source: str, cls: str) -> str:
        tree = ast.parse(source)
        (node,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls]
        (fn,) = [n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "decode"]
        return ast.dump(fn)

    mine = (ROOT / INDEPENDENT).read_text(encoding="utf-8")
    assert decode_of(mine, "DecodeOnlyMyOp") == decode_of(readme_block(OP_SECTION), "MyOp")


def test_make_case_variants():
    """make_case: an op that takes s_q 2 gets today's case; a decode-only op the s_q 1 variant; an op that declines the
    s_q 2 case for another reason (a causal query before the first key) keeps today's skip; a test about multi-token
    decode never falls back; a page size the op declines for this case is replaced by another it declares."""
    from mla_conformance.checks import op as op_checks
    from mla_conformance.impl.ops.reference import ReferenceOp

    def op_of(name, reason, **decl):
        return type(name, (ReferenceOp,), {"name": name, "unsupported_reason": lambda self, case: reason(case), **decl})()

    lens = (0, 1, 20)
    reference = ReferenceOp()
    assert op_checks.make_case(reference, lens=lens, s_q=2, causal=True).s_q == 2
    one = op_of("one", lambda c: "one query only" if c.s_q > 1 else None)
    case = op_checks.make_case(one, lens=lens, s_q=2, causal=True)
    assert (case.s_q, case.dtype, case.zero_length_rows, case.queries_before_first_key) == \
        (1, op_checks.make_case(reference, lens=lens, s_q=2).dtype, True, False)
    with pytest.raises(pytest.skip.Exception, match="^one: one query only$"):
        op_checks.make_case(one, lens=lens, s_q=2, causal=True, multi_token=True)
    no_qbfk = op_of("no-qbfk", lambda c: "no causal query before the first key" if c.queries_before_first_key else None)
    with pytest.raises(pytest.skip.Exception, match="^no-qbfk: no causal query before the first key$"):
        op_checks.make_case(no_qbfk, lens=lens, s_q=2, causal=True)
    page64 = op_of("page-64", lambda c: "pages of 64 only here" if c.page_block_size != 64 else None)
    assert op_checks.make_case(page64, lens=lens, s_q=2).page_block_size == 64
    neither = op_of("neither", lambda c: f"not s_q {c.s_q}" if c.s_q > 1 else "not float32" if c.dtype.is_floating_point
                    and c.dtype.itemsize == 4 else None, page_block_sizes=(64,))
    case = op_checks.make_case(neither, lens=lens, s_q=2)
    assert dataclasses.astuple(case)[:2] == (3, 1) and str(case.dtype) == "torch.bfloat16", case
    with pytest.raises(pytest.skip.Exception, match=r"^neither: not s_q 2; s_q 1: not float32$"):
        op_checks.make_case(neither, lens=lens, s_q=2, dtypes=("float32",))
