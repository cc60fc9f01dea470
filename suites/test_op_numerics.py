"""Op contract (mla_conformance.contract.op): out and lse against the float64 oracle, the split-KV merge, determinism and
batch invariance. Every test runs once per op (--mla-op; the test id carries its name); inputs are poisoned
paged caches behind shuffled block tables with canaries after every buffer (mla_conformance.checks.op).
A test built at s_q 2 whose rule is not about multi-token decode runs at s_q 1 for an op that declines s_q > 1 (a
decode-only op: op_checks.make_case's variants); an op that takes s_q 2 gets the s_q 2 case.
Tolerances: mla_conformance.checks.OP_TOLERANCES."""

import pytest

from mla_conformance.checks import op as op_checks
from mla_conformance.contract.op import declared
from mla_conformance.model.attention_oracles import merge_by_lse

LENS = (37, 100, 5, 64)


@pytest.mark.mla_section("op-numerics")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float64"])
def test_out_lse_vs_oracle(mla_op, dtype, mla_device, mla_figures):
    """out and lse (converted from the declared lse_base) of a 4-row batch, 2 queries each (1 where the op decodes
    one query per row), non-causal."""
    case = op_checks.make_case(mla_op, lens=LENS, s_q=2, h_q=8, dtypes=(dtype,), device=mla_device)
    op_checks.check_against_oracle(mla_op, op_checks.Spec(case, LENS), check="out/lse vs float64 oracle", figures=mla_figures)


@pytest.mark.mla_section("op-numerics")
def test_attn_sink_dense(mla_op, mla_device, mla_figures):
    """attn_sink on dense causal decode (2 queries per row; per head 0, 2, 4, +inf, -inf, 6, cycled): out scaled
    by exp(lse) / (exp(lse) + exp(sink)), 0 for +inf, unchanged for -inf; lse unchanged (where the op declares
    attn_sink)."""
    case = op_checks.make_case(mla_op, lens=LENS, s_q=2, h_q=8, attn_sink=True, causal=True, device=mla_device)
    op_checks.check_against_oracle(mla_op, op_checks.Spec(case, LENS, seed=8), check="attn_sink on dense decode (with +-inf)",
                            figures=mla_figures)


@pytest.mark.mla_section("op-split-kv")
@pytest.mark.parametrize("s_q", [1, 2])
def test_split_kv_merge(mla_op, s_q, mla_device, mla_figures):
    """Each row's keys split at a page boundary into two calls; their results merged by LSE (in the declared
    base) equal the single call, within the bounds of both sides. Rows of one page have an empty first part
    (its lse is the declared infinity); an op that declines rows without keys gets rows of two pages or more."""
    if not declared(mla_op, "returns_lse"):
        pytest.skip(f"{mla_op.name}: declares returns_lse = False: partial results cannot be merged without their "
                    "lse (the op contract's default `returns_lse = True` opts this test in)")
    with_empty, without = (100, 37, 5, 64), (100, 70, 130, 66)  # one-page rows (empty first parts), or none
    try:
        case, lens = op_checks.make_case(mla_op, lens=with_empty, s_q=s_q, h_q=8, device=mla_device,
                                  zero_length_rows=True, multi_token=True), with_empty
    except pytest.skip.Exception:
        case, lens = op_checks.make_case(mla_op, lens=without, s_q=s_q, h_q=8, device=mla_device,
                                  rows_without_keys=False, multi_token=True), without
    if max(lens) <= case.page_block_size:
        pytest.skip(f"{mla_op.name}: page size {case.page_block_size} leaves every row one page: nothing to split")
    spec = op_checks.Spec(case, lens)
    inp = op_checks.build(spec)
    check = "split-KV merge by LSE equals the single call"
    mla_figures.update(case=case.describe(), check=check)
    whole = op_checks.run_op(mla_op, inp, check)
    one, two = op_checks.split_at_pages(inp)
    p1 = op_checks.run_op(mla_op, one, check + " (first pages)")
    p2 = op_checks.run_op(mla_op, two, check + " (last pages)")
    base = declared(mla_op, "lse_base")
    out, lse = merge_by_lse(p1[0], p1[1], p2[0], p2[1], base)
    ref_out, ref_lse = op_checks.as_reference(*whole, base)
    # |merged - single| <= the merged side's bound + the single call's, both against the oracle
    op_checks.compare(mla_op, case, out, lse, ref_out, ref_lse, check=check, figures=mla_figures,
                      oracle=op_checks.oracle_of(spec),
               lse_base="e", empty_lse=float("inf"), merged=True, out_dtype=p1[0].dtype, ref_dtype=whole[0].dtype,
               against="the single call")


@pytest.mark.mla_section("op-determinism")
def test_deterministic(mla_op, mla_device, mla_figures):
    """The same call twice gives bitwise the same out and lse (where the op declares deterministic)."""
    op_checks.require_declared(mla_op, "deterministic", "bitwise determinism")
    case = op_checks.make_case(mla_op, lens=LENS, s_q=2, h_q=16, device=mla_device)
    inp = op_checks.build(op_checks.Spec(case, LENS))
    check = "deterministic: two identical calls"
    first = op_checks.run_op(mla_op, inp, check)
    second = op_checks.run_op(mla_op, inp, check)
    mla_figures["case"] = case.describe()
    op_checks.bitwise_equal(mla_op, case, first, second, check=check, what="declares deterministic = True but the second "
                     "call", figures=mla_figures)


@pytest.mark.mla_section("op-determinism")
def test_batch_invariant(mla_op, mla_device, mla_figures):
    """A row's out and lse are bitwise the same alone and in the batch (where the op declares batch_invariant)."""
    op_checks.require_declared(mla_op, "batch_invariant", "batch invariance")
    case = op_checks.make_case(mla_op, lens=LENS, s_q=2, h_q=16, device=mla_device)
    inp = op_checks.build(op_checks.Spec(case, LENS))
    check = "batch invariant: a row alone vs in the batch"
    out, lse = op_checks.run_op(mla_op, inp, check)
    mla_figures["case"] = case.describe()
    for b in (0, 2):
        alone = op_checks.single_row(inp, b)
        got = op_checks.run_op(mla_op, alone, check)
        op_checks.bitwise_equal(mla_op, case, (out[b:b + 1], None if lse is None else lse[b:b + 1]), got, check=check,
                         what=f"declares batch_invariant = True but row {b} (cache_seqlens {LENS[b]}) alone",
                         figures=mla_figures)
