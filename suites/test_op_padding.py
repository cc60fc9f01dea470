"""Op contract: padded decode batches, as an engine pads a batch for a captured CUDA graph: real rows followed by,
or interleaved with, padding rows of cache_seqlens 0 whose block-table rows hold -1 (vLLM), 0, or stale ids of an
earlier batch (NaN-poisoned pages, or another row's pages); one real row long enough that split-KV kernels split.
Padding rows are zero-length rows of the base contract (out 0, lse empty_row) unless the op declares
padding_rows = "undefined"; real rows equal the same rows unpadded and the oracle; no page is read through a
padding row (mla_conformance.checks.op.padding). Every test runs once per op (--mla-op)."""

import pytest

from mla_conformance.checks import op as op_checks
from mla_conformance.checks.op.padding import FILLS, LAYOUTS, Padded, check_padded

#: one row of thousands of keys (split-KV kernels split it), short rows, one of a single page
LENS = (2048, 37, 5, 130)
#: sparse decode: top-32 over the rows' keys; a padding row has every index -1 and topk_length 0
SPARSE_LENS = (300, 40, 70)
TOPK = 32
PAD = len(FILLS)


@pytest.mark.mla_section("op-padding")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_padded_batch(mla_op, layout, mla_device, mla_figures):
    """4 real rows (2048, 37, 5, 130 keys) and 4 padding rows, after them or between them, whose block-table rows
    hold -1, 0, stale ids of pages NaN since, and stale ids of the long row's pages."""
    case = op_checks.make_case(mla_op, lens=LENS + (0,) * PAD, s_q=1, h_q=4, device=mla_device, padding_rows=PAD)
    real = op_checks.make_case(mla_op, lens=LENS, s_q=1, h_q=4, page=case.page_block_size,
                               dtypes=(op_checks.dtype_name(case.dtype),),
                        device=mla_device)
    check_padded(mla_op, Padded(op_checks.Spec(real, LENS, seed=30), layout),
                 check=f"padded batch ({layout} padding rows; block-table rows of -1, 0, stale ids)",
                 figures=mla_figures)


@pytest.mark.mla_section("op-padding")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_padded_sparse_batch(mla_op, layout, mla_device, mla_figures):
    """Sparse decode (where declared): 3 real rows, 3 padding rows with every index -1, topk_length 0 and
    block-table rows of -1."""
    case = op_checks.make_case(mla_op, lens=SPARSE_LENS + (0,) * 3, s_q=1, h_q=4, topk=TOPK,
                        kv_formats=("latent", "fp8-e4m3-flashmla"), device=mla_device, padding_rows=3)
    real = op_checks.make_case(mla_op, lens=SPARSE_LENS, s_q=1, h_q=4, topk=TOPK, page=case.page_block_size,
                        kv_formats=(case.kv_format,), dtypes=(op_checks.dtype_name(case.dtype),), device=mla_device)
    check_padded(mla_op, Padded(op_checks.declared_spec(mla_op, real, SPARSE_LENS, seed=31), layout, ("minus-one",), 3),
                 check=f"padded sparse batch ({layout} padding rows, every index -1, topk_length 0)",
                 figures=mla_figures)
