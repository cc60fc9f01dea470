"""Op contract: poisoned paged caches, page sizes, multi-token decode alignment, head counts, rows without keys
or with one key, non-contiguous q. Every test runs once per op (--mla-op); see mla_conformance.checks.op. The
tests of rows without keys and of non-contiguous q run at s_q 1 for an op that decodes one query per row."""

import pytest

from mla_conformance.checks import op as op_checks


@pytest.mark.mla_section("op-poison")
def test_poisoned_pages(mla_op, mla_device, mla_figures):
    """NaN in unused pages and in the unfilled tail of each row's last page, unused block-table entries at 2**30,
    shuffled block tables, canaries after every buffer: valid rows finite and right, inputs untouched."""
    lens = (37, 32, 1, 50, 15)
    case = op_checks.make_case(mla_op, lens=lens, s_q=1, h_q=8, device=mla_device)
    op_checks.check_against_oracle(mla_op, op_checks.Spec(case, lens, seed=1, spare_pages=3),
                            check="poisoned pages (NaN tails, invalid block ids, canaries)", figures=mla_figures)


@pytest.mark.mla_section("op-shapes")
@pytest.mark.parametrize("causal", [False, True], ids=["non-causal", "causal"])
@pytest.mark.parametrize("s_q", [1, 2, 4, 8])
def test_multi_token_decode(mla_op, s_q, causal, mla_device, mla_figures):
    """s_q queries per row; causal aligns them bottom-right (query i sees keys < len - s_q + i + 1); a row
    shorter than s_q leaves its first causal queries without keys."""
    # a row of 3 keys: causal s_q 4 and 8 leave its first queries without keys; an op that declines rows without
    # keys gets the same test over rows of at least s_q keys
    case, lens = op_checks.make_case_and_lens(mla_op, [(3, 40, 17), (max(3, s_q), 40, 17)], s_q=s_q, h_q=4, causal=causal,
                                       device=mla_device, multi_token=True)
    op_checks.check_against_oracle(mla_op, op_checks.Spec(case, lens, seed=2),
                            check=f"multi-token decode s_q={s_q} {'causal (bottom-right)' if causal else 'non-causal'}",
                            figures=mla_figures)


@pytest.mark.mla_section("op-shapes")
@pytest.mark.parametrize("h_q", [1, 3, 8, 16, 64, 128])
def test_head_counts(mla_op, h_q, mla_device, mla_figures):
    """Query heads per call as tensor parallelism leaves them: 1, odd, powers of two up to 128."""
    lens = (45, 130)
    case = op_checks.make_case(mla_op, lens=lens, s_q=1, h_q=h_q, device=mla_device)
    op_checks.check_against_oracle(mla_op, op_checks.Spec(case, lens, seed=3), check=f"h_q={h_q}", figures=mla_figures)


@pytest.mark.mla_section("op-shapes")
def test_empty_and_single_key_rows(mla_op, mla_device, mla_figures):
    """Rows of 0 keys (out exactly 0, lse the declared empty_row infinity) and of 1 key, 2 causal queries (a
    1-key row's first query has no key either)."""
    lens = (0, 1, 20, 0, 1)
    case = op_checks.make_case(mla_op, lens=lens, s_q=2, h_q=4, causal=True, device=mla_device)
    op_checks.check_against_oracle(mla_op, op_checks.Spec(case, lens, seed=4), check="zero-length and length-1 rows",
                            figures=mla_figures)


@pytest.mark.mla_section("op-shapes")
@pytest.mark.parametrize("page", op_checks.KNOWN_PAGE_SIZES)
def test_page_sizes(mla_op, page, mla_device, mla_figures):
    """Every page size the op declares (page_block_sizes) that the suite builds; rows ending mid-page, on a
    page boundary and one past it."""
    lens = (1, 16, 17, 65)
    case = op_checks.make_case(mla_op, lens=lens, s_q=1, h_q=4, page=page, device=mla_device)
    op_checks.check_against_oracle(mla_op, op_checks.Spec(case, lens, seed=5), check=f"page size {page}", figures=mla_figures)


@pytest.mark.mla_section("op-shapes")
def test_noncontiguous_q(mla_op, mla_device, mla_figures):
    """q as a strided view: [B, h, s, 640] storage transposed to [B, s, h, ...] and sliced to 576 (NaN in the
    64 channels between heads)."""
    lens = (30, 70)
    case = op_checks.make_case(mla_op, lens=lens, s_q=2, h_q=8, device=mla_device)
    op_checks.check_against_oracle(mla_op, op_checks.Spec(case, lens, seed=6, noncontig_q=True), check="non-contiguous q",
                            figures=mla_figures)
