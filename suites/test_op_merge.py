"""Op contract, optional ``merge`` (two partial attentions merged by their lse, in the declared merge_lse_base):
out and lse against the float64 merge of the same inputs -- float32 / bfloat16 / float16 out, +inf and -inf
marking an empty side on either side (FA2 and FA3 disagree on which; only the one an op declares in
merge_empty_input where it declares one), both sides empty (out 0, the declared merge_empty_row: the output's
marker), strided out and an lse laid out [h, T]. Every test runs once per op (--mla-op) that has
``merge``; see mla_conformance.checks.op.merge."""

import pytest

from mla_conformance.checks.op import merge as merge_checks


@pytest.mark.mla_section("op_merge")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_merge_vs_oracle(mla_op, dtype, mla_device, mla_figures):
    """Finite lse on both sides, spread over +-24 (weights up to e^48 apart, some within 1e-3): out in out_a's
    dtype within one rounding of it."""
    spec = merge_checks.spec_for(mla_op, dtype=dtype, seed=1, device=mla_device)
    merge_checks.check_against_oracle(mla_op, spec, check=f"merge of {dtype} partials vs float64", figures=mla_figures)


@pytest.mark.mla_section("op_merge")
def test_merge_empty_sides(mla_op, mla_device, mla_figures):
    """One side empty, marked +inf or -inf (the op's merge_empty_input where declared), on either side: the
    result is the other side, exactly up to rounding; an infinity is never a value."""
    spec = merge_checks.spec_for(mla_op, empties=merge_checks.ONE_SIDED, seed=2, device=mla_device)
    merge_checks.check_against_oracle(mla_op, spec, check="merge with one empty side (+inf or -inf)", figures=mla_figures)


@pytest.mark.mla_section("op_merge")
def test_merge_both_empty(mla_op, mla_device, mla_figures):
    """Both sides empty in every combination of +inf and -inf (those merge_empty_input takes): out exactly 0 and
    lse the declared merge_empty_row (vLLM #28181: NaN from 0 / 0)."""
    spec = merge_checks.spec_for(mla_op, empties=merge_checks.BOTH_EMPTY, seed=3, device=mla_device)
    merge_checks.check_against_oracle(mla_op, spec, check="merge of two empty sides", figures=mla_figures)


@pytest.mark.mla_section("op_merge")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_merge_strided(mla_op, dtype, mla_device, mla_figures):
    """out_a a view padded by 16 channels (NaN there), lse_a a [T, h] view of [h, T] storage (vLLM's lse
    layout), one-sided empties."""
    spec = merge_checks.spec_for(mla_op, dtype=dtype, empties=merge_checks.ONE_SIDED, strided=True, seed=4, device=mla_device)
    merge_checks.check_against_oracle(mla_op, spec, check="merge of strided inputs", figures=mla_figures)
