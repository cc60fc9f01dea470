"""Op contract: the composition of an op's prefill, merge and write as engines run chunked prefill over cached
context in "MHA mode" -- the cache written (by the op's write where it has one), the context read back in chunks
of 24 tokens (3 chunks over pages of 16: chunks hold parts of pages; rows whose context ended have kv_len 0),
up-projected per head, prefill(causal=False) per chunk, prefill(causal=True) over the new tokens, merged pairwise
with merge -- equal to one float64 causal pass over context + new tokens; every step is checked, so a failure
names it. Runs once per op (--mla-op) that has prefill and merge; see mla_conformance.checks.op.composition."""

import pytest

from mla_conformance.checks.op import composition as composition_checks


@pytest.mark.mla_section("op_composition")
def test_chunked_prefill_composition(mla_op, mla_device, mla_figures):
    """Rows of 0, 20 and 70 context tokens and 3, 5, 4 new tokens, 4 heads, bfloat16: the merged result of the
    three context chunks and the new tokens equals the float64 causal pass over all 90 + 12 keys."""
    spec = composition_checks.CompositionSpec(device=mla_device)
    composition_checks.run_composition(mla_op, spec, figures=mla_figures)
