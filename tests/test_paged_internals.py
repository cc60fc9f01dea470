"""The tool's own tests of suites/test_paged_cache.py's machinery (no backend under test): moved out of the
conformance suite, which keeps only tests that judge a backend."""

import math
from pathlib import Path

import pytest
import torch

from mla_conformance import checks
from mla_conformance.checks.layer.paged import (CALLS, CAPACITY, PAGE_SIZES, TOTALS, Paged, drive, paged_inputs,
                                          paged_weights, require_paging)
from mla_conformance.kv.caches import LatentSlotCache, PagedLatentCache, from_contiguous, to_flashmla_layout
from mla_conformance.specs import get_backend

ROOT = Path(__file__).resolve().parent.parent
#: FlashMLA's FP8 (one uint8 buffer), a codec with a calibrated global scale, and one with packed int4 k_pe
CODEC_CASES = [("fp8-e4m3-flashmla", "dims-576"), ("int8-tensor", "tiny"), ("int4-asym-g16-kpe-int4", "tiny")]


@pytest.fixture(scope="module")
def runs():
    """reference-absorbed over CALLS at 576-wide latents, bf16: the contiguous cache and paged caches (16, 64)."""
    ref = get_backend("reference-absorbed")
    w = paged_weights("dims-576", torch.bfloat16)
    x = paged_inputs(w.config)
    _, contiguous = drive(ref, w, x, CALLS)
    paged = {n: drive(Paged(ref, n), w, x, CALLS)[1] for n in PAGE_SIZES}
    return contiguous, paged


def test_base_contract_backend_skips_not_fails():
    """IndependentMLA has only the base contract: the paged tests skip it, naming the extension."""
    independent = get_backend(f"{ROOT / 'tests' / 'meta' / 'impls' / 'independent' / 'backend.py'}:IndependentMLA")
    assert not hasattr(independent, "supports_paging")
    with pytest.raises(pytest.skip.Exception) as info:
        require_paging(independent, 16)
    assert str(info.value) == ("independent-absorbed does not implement the optional paged-cache extension "
                               "(supports_paging)")


def test_listed_page_sizes_gate():
    flashmla = get_backend("mla_conformance.impl.backends.flashmla:FlashMLA")
    require_paging(flashmla, 64)
    with pytest.raises(pytest.skip.Exception, match="blocks of 64 tokens, not 16"):
        require_paging(flashmla, 16)


@pytest.mark.parametrize("page_block_size", PAGE_SIZES)
def test_flashmla_layout_holds_the_contiguous_cache(runs, page_block_size):
    """k_cache[block_table[b, t // N], t % N, 0] == [kv_latent | k_pe][b, t] for every stored token."""
    contiguous, paged = runs[0], runs[1][page_block_size]
    k_cache, block_table, cache_seqlens = to_flashmla_layout(paged)
    N, B = page_block_size, len(TOTALS)
    assert k_cache.data_ptr() == paged.kv_pages.data_ptr()  # the pool itself, no copy
    assert k_cache.shape == (paged.num_pages, N, 1, 576) and k_cache.dtype == torch.bfloat16
    assert block_table.dtype == torch.int32 and block_table.shape == (B, math.ceil(CAPACITY / N))
    assert cache_seqlens.dtype == torch.int32 and cache_seqlens.tolist() == list(TOTALS)
    owned = block_table.flatten()
    assert owned.unique().numel() == owned.numel()  # no page is shared
    assert not torch.equal(owned.sort().values, owned), "pages are handed out in order, not shuffled"
    spare = sorted(set(range(paged.num_pages)) - set(owned.tolist()))
    assert len(spare) == paged.spare_pages >= 2 and bool(torch.isnan(k_cache[spare]).all())
    bufs = contiguous.tensors()
    expect = torch.cat([bufs["kv_latent"], bufs["k_pe"]], dim=-1)
    for b, n in enumerate(TOTALS):
        t = torch.arange(n)
        got = k_cache[block_table[b, t // N].long(), t % N, 0]
        assert torch.equal(got, expect[b, :n]), f"row {b}"
        tail = torch.arange(n, CAPACITY)
        assert bool(torch.isnan(k_cache[block_table[b, tail // N].long(), tail % N]).all()), f"row {b} tail"
    # the contiguous cache converts to the same pages' contents
    k2, bt2, sl2 = to_flashmla_layout(contiguous, page_block_size=N)
    for b, n in enumerate(TOTALS):
        t = torch.arange(n)
        assert torch.equal(k2[bt2[b, t // N].long(), t % N, 0], expect[b, :n])
    assert torch.equal(sl2, cache_seqlens)


@pytest.mark.parametrize("page_block_size", PAGE_SIZES)
def test_read_latent_equals_contiguous(runs, page_block_size):
    """Gathered through the block table, the pages read back as the contiguous slots (zeros past each row)."""
    contiguous, paged = runs[0], runs[1][page_block_size]
    T = max(TOTALS)
    c_ref, kpe_ref = contiguous.read_latent(T)
    c, kpe = paged.read_latent(T)
    assert torch.equal(c, c_ref) and torch.equal(kpe, kpe_ref)
    assert paged.active_nbytes() == contiguous.active_nbytes() == sum(TOTALS) * 576 * 2
    assert paged.allocated_nbytes() == sum(t.numel() * t.element_size() for t in paged.tensors().values())
    assert set(paged.tensors()) == {"kv_pages", "block_table"}


def test_from_contiguous_round_trip():
    gen = torch.Generator().manual_seed(3)
    c = torch.randn(3, 50, 512, generator=gen).to(torch.bfloat16)
    k_pe = torch.randn(3, 50, 64, generator=gen).to(torch.bfloat16)
    lengths = torch.tensor([50, 0, 17])
    cache = from_contiguous(c, k_pe, lengths, 16, capacity=64)
    assert cache.seq_lens.tolist() == [50, 0, 17] and cache.capacity == 64
    valid = (torch.arange(50)[None, :] < lengths[:, None])[..., None]
    rc, rk = cache.read_latent(50)
    assert torch.equal(rc, torch.where(valid, c, 0)) and torch.equal(rk, torch.where(valid, k_pe, 0))
    k_cache, bt, sl = to_flashmla_layout(cache)
    t = torch.arange(17)
    assert torch.equal(k_cache[bt[2, t // 16].long(), t % 16, 0], torch.cat([c[2, :17], k_pe[2, :17]], -1))
    assert sl.tolist() == [50, 0, 17]
    assert cache.active_nbytes() == 67 * 576 * 2


def test_masking_by_selection_is_what_keeps_nan_out():
    """Teeth: a paged cache that hands back the raw pages (no torch.where) leaks NaN into outputs."""

    class Leaky(PagedLatentCache):
        def read_latent(self, T, new_lens=None):
            kv = self.gather(T)["kv"]
            return kv[..., : self.kv_lora_rank], kv[..., self.kv_lora_rank:]

    ref = get_backend("reference-absorbed")

    class LeakyBackend(Paged):
        def new_cache(self, config, **kw):
            kw.pop("kv_codec", None)
            return Leaky(config, page_block_size=16, **kw)

    w = checks.weights_for("tiny", torch.float32)
    with pytest.raises(AssertionError, match="non-finite"):
        drive(LeakyBackend(ref, 16), w, paged_inputs(w.config), CALLS)


def test_page_arguments_are_checked():
    cfg = checks.weights_for("tiny", torch.float32).config
    with pytest.raises(ValueError, match="page_block_size"):
        PagedLatentCache(cfg, batch_size=1, capacity=8, dtype=torch.float32, page_block_size=0)
    cache = PagedLatentCache(cfg, batch_size=2, capacity=8, dtype=torch.float32, page_block_size=4)
    with pytest.raises(ValueError, match="overflow"):
        cache.write_plan(torch.arange(9).expand(2, 9), None)
    assert isinstance(cache, LatentSlotCache) and cache.max_pages_per_row == 2


def test_unknown_or_unavailable_codec_is_a_clear_error():
    cfg = checks.weights_for("tiny", torch.bfloat16).config
    with pytest.raises(ValueError, match="kv_codec 'fp5-nope'"):
        PagedLatentCache(cfg, batch_size=1, capacity=8, dtype=torch.bfloat16, kv_codec="fp5-nope")
    with pytest.raises(ValueError, match="512"):  # the codec's own reason: FlashMLA's FP8 layout needs 512 + 64
        PagedLatentCache(cfg, batch_size=1, capacity=8, dtype=torch.bfloat16, kv_codec="fp8-e4m3-flashmla")


@pytest.mark.parametrize("page_block_size", PAGE_SIZES)
@pytest.mark.parametrize("codec,preset", CODEC_CASES)
def test_quantized_pages_equal_contiguous_codec(codec, preset, page_block_size):
    """A codec's buffers in pages (NaN / 0xFF until written): outputs == reference-absorbed's contiguous codec cache."""
    ref = get_backend("reference-absorbed")
    w = paged_weights(preset, torch.bfloat16)
    checks.require_support(ref, w.config, dtype=w.dtype, device="cpu", kv_codec=codec)
    x = paged_inputs(w.config)
    contiguous, ccache = drive(ref, w, x, CALLS, kv_codec=codec)
    paged, cache = drive(Paged(ref, page_block_size), w, x, CALLS, kv_codec=codec)
    assert isinstance(cache, PagedLatentCache)
    assert torch.equal(paged, contiguous), checks.format_metrics(checks.error_metrics(paged, contiguous))
    assert cache.active_nbytes() == ccache.active_nbytes()
    assert cache.allocated_nbytes() == sum(t.numel() * t.element_size() for t in cache.tensors().values())
    if codec == "fp8-e4m3-flashmla":
        k_cache, _, _ = to_flashmla_layout(cache)
        assert k_cache.dtype == torch.uint8 and k_cache.shape == (cache.num_pages, page_block_size, 1, 656)
        assert cache.active_nbytes() == sum(TOTALS) * 656
        bt = cache.block_table
        for b, n in enumerate(TOTALS):  # the same 656 bytes per token as the contiguous codec cache
            t = torch.arange(n)
            assert torch.equal(k_cache[bt[b, t // page_block_size].long(), t % page_block_size, 0],
                               ccache.tensors()["kv"][b, :n])
