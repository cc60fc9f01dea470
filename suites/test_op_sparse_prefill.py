"""Op contract, optional ``sparse_prefill`` (FlashMLA's ``flash_mla_sparse_fwd``, its tests/ref.py semantics): out,
max_logits and lse against the float64 oracle, with FlashMLA's corner cases -- out-of-range indices (negative,
s_kv, INT_MAX), rows of every index invalid (out 0, max_logits -inf, lse +inf), topk_length, attention sinks of
+-inf, d_qk 576 (V3.2) and 512 (MODEL1). Every test runs once per op (--mla-op) that has ``sparse_prefill``; see
mla_conformance.checks.op.sparse_prefill."""

import pytest

from mla_conformance.checks.op import sparse_prefill as sparse_prefill_checks


@pytest.mark.mla_section("op_sparse_prefill")
@pytest.mark.parametrize("d_qk", [576, 512], ids=["d576-v32", "d512-model1"])
def test_sparse_prefill_vs_oracle(mla_op, d_qk, mla_device, mla_figures):
    """top-64 indices of 96 keys per query, 64 heads: d_qk 576 (V3.2) or 512 (MODEL1, where declared in
    sparse_prefill_head_dims), d_v 512."""
    spec = sparse_prefill_checks.SparseSpec(d_qk=d_qk, seed=1, device=mla_device)
    sparse_prefill_checks.check_against_oracle(mla_op, spec, check=f"sparse prefill d_qk {d_qk} vs float64 oracle",
                                               figures=mla_figures)


@pytest.mark.mla_section("op_sparse_prefill")
def test_sparse_prefill_invalid_indices(mla_op, mla_device, mla_figures):
    """A third of the entries invalid, FlashMLA's candidates: -2^31, -123456, -1, s_kv, 114514, 2^31 - 1 -- all
    ignored (an index < 0 or >= s_kv)."""
    spec = sparse_prefill_checks.SparseSpec(invalid_share=1 / 3, seed=2, device=mla_device)
    sparse_prefill_checks.check_against_oracle(mla_op, spec, check="sparse prefill, out-of-range indices ignored",
                                               figures=mla_figures)


@pytest.mark.mla_section("op_sparse_prefill")
def test_sparse_prefill_all_invalid_rows(mla_op, mla_device, mla_figures):
    """Queries 1 and 4 have every index invalid: out 0, max_logits -inf, lse +inf (FlashMLA's ref.py)."""
    spec = sparse_prefill_checks.SparseSpec(invalid_share=1 / 4, all_invalid_rows=(1, 4), seed=3, device=mla_device)
    sparse_prefill_checks.check_against_oracle(mla_op, spec, check="sparse prefill, rows with no valid index",
                                               figures=mla_figures)


@pytest.mark.mla_section("op_sparse_prefill")
def test_sparse_prefill_topk_length(mla_op, mla_device, mla_figures):
    """topk_length[s] < topk (where declared, sparse_prefill_topk_length): entries past it hold valid indices,
    which must be ignored."""
    spec = sparse_prefill_checks.SparseSpec(topk_length=True, invalid_share=1 / 8, seed=4, device=mla_device)
    sparse_prefill_checks.check_against_oracle(mla_op, spec, check="sparse prefill topk_length", figures=mla_figures)


@pytest.mark.mla_section("op_sparse_prefill")
def test_sparse_prefill_attn_sink(mla_op, mla_device, mla_figures):
    """attn_sink per head (0, 2, +inf, -inf, -1, 4, cycled; where declared, sparse_prefill_attn_sink): out scaled
    by exp(lse) / (exp(lse) + exp(sink)), 0 for +inf, unchanged for -inf; lse and max_logits unchanged; a row with
    no valid index stays 0."""
    spec = sparse_prefill_checks.SparseSpec(attn_sink=True, all_invalid_rows=(2,), seed=5, device=mla_device)
    sparse_prefill_checks.check_against_oracle(mla_op, spec, check="sparse prefill attn_sink (with +-inf)",
                                               figures=mla_figures)
