"""Op contract: sparse decode (indices into the flattened paged cache, FlashMLA's convention): invalid entries
(-1; one past the cache and INT_MAX where the op declares invalid_index "out-of-range"), topk_length, rows with
every index invalid, attn_sink (with +-inf), sparse equal to dense over the selected keys, and the selection split
over two caches (where declared). Every test runs once per op (--mla-op) that accepts a sparse case
(latent cache first, else the FP8 one; 2 queries per row, else 1 where the op decodes one query per row)."""

import pytest

from mla_conformance.checks import op as op_checks
from mla_conformance.contract.op import declared

LENS = (40, 70, 30)  # every query of a sparse case keeps a valid index
TOPK = 32
FORMATS = ("latent", "fp8-e4m3-flashmla")


@pytest.mark.mla_section("op-sparse")
def test_sparse_vs_oracle(mla_op, mla_device, mla_figures):
    """top-32 indices per query over any row's keys (block_table does not restrict them), 2 queries per row."""
    case = op_checks.make_case(mla_op, lens=LENS, s_q=2, h_q=8, topk=TOPK, kv_formats=FORMATS, device=mla_device)
    op_checks.check_against_oracle(mla_op, op_checks.declared_spec(mla_op, case, LENS, seed=20),
                                   check="sparse decode vs oracle",
                            figures=mla_figures)


@pytest.mark.mla_section("op-sparse")
@pytest.mark.parametrize("kind", op_checks.INVALID_KINDS)
def test_sparse_invalid_indices(mla_op, kind, mla_device, mla_figures):
    """A quarter of the entries invalid: -1 for every op; one past the cache (num_blocks * page_block_size) and
    INT_MAX only where the op declares invalid_index = "out-of-range" (FlashMLA's sparse prefill); under the
    default "minus-one" (FlashMLA's sparse decode) the suite hands the op no such index."""
    case = op_checks.make_case(mla_op, lens=LENS, s_q=2, h_q=8, topk=TOPK, kv_formats=FORMATS, device=mla_device)
    op_checks.require_invalid_kind(mla_op, kind)
    op_checks.check_against_oracle(mla_op, op_checks.declared_spec(mla_op, case, LENS, seed=21, invalid=kind),
                            check=f"sparse invalid indices ({kind})", figures=mla_figures)


@pytest.mark.mla_section("op-sparse")
def test_sparse_topk_length(mla_op, mla_device, mla_figures):
    """topk_length[b] < topk: the entries past it hold valid indices, which must be ignored."""
    case = op_checks.make_case(mla_op, lens=LENS, s_q=2, h_q=8, topk=TOPK, kv_formats=FORMATS, device=mla_device)
    op_checks.check_against_oracle(mla_op, op_checks.declared_spec(mla_op, case, LENS, seed=22, topk_length=True),
                            check="sparse topk_length", figures=mla_figures)


@pytest.mark.mla_section("op-sparse")
def test_sparse_all_invalid_rows(mla_op, mla_device, mla_figures):
    """A row whose every index is -1: out 0 and lse the declared empty_row infinity."""
    case = op_checks.make_case(mla_op, lens=LENS, s_q=2, h_q=8, topk=TOPK, kv_formats=FORMATS, device=mla_device,
                        zero_length_rows=True)
    spec = op_checks.declared_spec(mla_op, case, LENS, seed=23, invalid="minus-one", all_invalid_rows=(1,))
    op_checks.check_against_oracle(mla_op, spec, check="sparse row with every index invalid", figures=mla_figures)


@pytest.mark.mla_section("op-sparse")
def test_attn_sink(mla_op, mla_device, mla_figures):
    """attn_sink per head (0, 2, 4, +inf, -inf, 6, cycled): out scaled by exp(lse) / (exp(lse) + exp(sink)),
    0 for +inf, unchanged for -inf; lse unchanged."""
    case = op_checks.make_case(mla_op, lens=LENS, s_q=2, h_q=8, topk=TOPK, attn_sink=True, kv_formats=FORMATS,
                        device=mla_device)
    op_checks.check_against_oracle(mla_op, op_checks.declared_spec(mla_op, case, LENS, seed=24),
                                   check="attn_sink (with +-inf)",
                            figures=mla_figures)


@pytest.mark.mla_section("op-sparse")
def test_sparse_equals_dense(mla_op, mla_device, mla_figures):
    """Sparse decode of one query per row equals dense decode over a cache holding exactly the keys it selects
    (copied byte for byte, in index order, into a new shuffled, poisoned paged cache)."""
    case = op_checks.make_case(mla_op, lens=LENS, s_q=1, h_q=8, topk=TOPK, kv_formats=FORMATS, device=mla_device)
    inp = op_checks.build(op_checks.declared_spec(mla_op, case, LENS, seed=25, invalid="minus-one"))
    dense = op_checks.dense_of_selection(inp)
    op_checks.require(mla_op, dense.case)
    check = "sparse equals dense over the selected keys"
    mla_figures.update(case=case.describe(), check=check)
    sparse_out = op_checks.run_op(mla_op, inp, check)
    dense_out = op_checks.run_op(mla_op, dense, check + " (dense call)")
    ref_out, ref_lse = op_checks.as_reference(*dense_out, declared(mla_op, "lse_base"))
    # the same keys in the same order: |sparse - dense| <= the bounds of both against the sparse case's oracle
    op_checks.compare(mla_op, case, *sparse_out, ref_out, ref_lse, check=check, figures=mla_figures,
               oracle=op_checks.oracle_of(inp.spec), ref_dtype=dense_out[0].dtype,
               against="the dense call over the selected keys")


@pytest.mark.mla_section("op-sparse")
@pytest.mark.parametrize("lengths", [False, True], ids=["all", "lengths"])
def test_sparse_two_caches(mla_op, lengths, mla_device, mla_figures):
    """FlashMLA's two-cache sparse decode (where the op declares sparse_decode_extra_cache): each query's top-32
    split over kv_cache (its first 16 entries) and a second cache of another page size holding the keys of the
    other 16, copied there at shuffled slots; "lengths": topk_length and extra_topk_length, with valid indices
    past each. Against the oracle of the one-cache selection: the same keys under one softmax."""
    op_checks.require_declared(mla_op, "sparse_decode_extra_cache", "sparse decode over two caches (FlashMLA's "
                        "extra_k_cache, extra_indices_in_kvcache, extra_topk_length)")
    case = op_checks.make_case(mla_op, lens=LENS, s_q=2, h_q=8, topk=TOPK, kv_formats=FORMATS, device=mla_device)
    spec = op_checks.declared_spec(mla_op, case, LENS, seed=26, topk_length=lengths)
    extra_page = op_checks.pick_page(mla_op, prefer=[*(p for p in (16, 1, 64) if p != case.page_block_size),
                                              case.page_block_size])  # another page size where it reads one
    inp = op_checks.two_caches(op_checks.build(spec), extra_page, extra_topk_length=lengths)
    check = f"sparse decode over two caches ({'topk lengths' if lengths else 'every entry'}, extra pages of " \
            f"{extra_page})"
    mla_figures.update(case=case.describe(), check=check, extra_page_block_size=extra_page)
    out, lse = op_checks.run_op(mla_op, inp, check)
    ref = op_checks.oracle_of(spec)
    op_checks.compare(mla_op, case, out, lse, ref[0], ref[1], check=check, figures=mla_figures, oracle=ref)
