"""The optional paged-cache extension: a backend with ``supports_paging = True`` and
``new_cache(..., page_block_size=N)`` (FlashMLA's layout: shuffled pages of N tokens, a block table).

* paged == contiguous, bit for bit (``torch.equal``): storing tokens in pages changes where they live,
  not the arithmetic. The reference-absorbed paged cache gathers the pages back into the same
  [B, T, 512] / [B, T, 64] operands the contiguous cache slices, so every einsum sees identical values
  and shapes (measured: identical in float64, float32 and bfloat16, tiny and V2-Lite dims, pages 16 and
  64). A backend whose paged path really runs other arithmetic (another kernel) may declare
  ``paged_bit_exact = False`` and is then held to its dtype's tolerance instead.
* a varlen batch with a row that is empty during prefill, decode steps where a row appends nothing,
  and a multi-token chunk after decoding; pages of 16 (rows span pages, partial last pages) and 64.
* NaN in a slot no token was written to never reaches an output: the test fills every floating-point
  buffer of a fresh paged cache with NaN before the first write (the pool's pages hold garbage until
  written), so masking must *select* (0 * NaN is NaN).
* FlashMLA's page layout (mla_conformance.kv.caches.to_flashmla_layout / from_contiguous) against the
  contiguous reference cache's contents.

A backend without the extension (only the base contract) skips with a sentence saying so.
"""

import pytest

from mla_conformance.checks.layer import paged

CASES = [("tiny", "float32"), ("tiny", "bfloat16"), ("dims-576", "bfloat16")]


@pytest.mark.mla_section("paged")
@pytest.mark.parametrize("page_block_size", paged.PAGE_SIZES)
@pytest.mark.parametrize("preset,dtype", CASES)
def test_paged_equals_contiguous(mla_backend, preset, dtype, page_block_size, mla_device, mla_figures):
    """Shuffled pages, varlen batch with empty rows, decode steps: the same outputs as the contiguous cache."""
    paged.check_paged_equals_contiguous(mla_backend, preset, dtype, page_block_size, mla_device, mla_figures)


@pytest.mark.mla_section("paged")
def test_nan_in_unused_pages_never_reaches_outputs(mla_backend, mla_device, mla_figures):
    """Every slot of the paged cache starts as NaN; outputs stay finite and equal the contiguous run."""
    paged.check_nan_in_unused_pages(mla_backend, mla_device, mla_figures)


@pytest.mark.mla_section("paged")
def test_paged_cache_bytes(mla_backend, mla_device, mla_figures):
    """active = stored tokens x 576 x element size; allocated = the bytes of tensors() (pool + block table)."""
    paged.check_paged_cache_bytes(mla_backend, mla_device, mla_figures)
