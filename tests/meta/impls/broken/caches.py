"""Broken backends of the cache and the contract (bytes, slots, poison, isolation, codecs, paging), and
correct backends whose legitimate differences the suite must report instead of failing.

Each broken one has exactly one thing wrong; tests/meta/test_kill_matrix.py names the conformance test that
must *fail* on it (an AssertionError verdict, not a crash).
"""

from __future__ import annotations

import torch

from mla_conformance.model import reference as ref
from mla_conformance.impl.backends.reference import ReferenceAbsorbed, ReferenceNaive
from mla_conformance.kv.caches import LatentSlotCache, PagedLatentCache, QuantizedLatentCache, SlotCache
from mla_conformance.kv.codecs import IntCodec

try:
    from ..independent.backend import IndependentMLA, LatentCache
except ImportError:  # loaded by path (--mla-backend tests/meta/impls/broken/caches.py:NAME): no parent package
    import importlib.util
    import sys
    from pathlib import Path

    _name = "_mla_meta_independent_backend"
    if _name not in sys.modules:
        _spec = importlib.util.spec_from_file_location(_name, Path(__file__).parent.parent / "independent" / "backend.py")
        sys.modules[_name] = importlib.util.module_from_spec(_spec)
        _spec.loader.exec_module(sys.modules[_name])
    IndependentMLA, LatentCache = sys.modules[_name].IndependentMLA, sys.modules[_name].LatentCache


# --------------------------------------------------------------------------- bytes and slots


class _BytePool(SlotCache):
    """Every buffer of a SlotCache kept in one flat uint8 pool (as engines type FP8 caches), viewed back."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], dtype, *, batch_size, capacity, device, config,
                 declared_active_per_token: int):
        elem = torch.empty(0, dtype=dtype).element_size()
        sizes = {k: batch_size * capacity * int(torch.tensor(s).prod()) * elem for k, s in shapes.items()}
        self.pool = torch.zeros(sum(sizes.values()), dtype=torch.uint8, device=device)
        views, start = {}, 0
        for k, s in shapes.items():
            views[k] = self.pool[start:start + sizes[k]].view(dtype).view(batch_size, capacity, *s)
            start += sizes[k]
        super().__init__(views, batch_size=batch_size, capacity=capacity, device=device, config=config)
        self.declared = declared_active_per_token

    def tensors(self):
        return {"pool": self.pool}

    def active_nbytes(self):  # says what a latent cache would hold
        return int(self.seq_lens.sum()) * self.declared


class ExpandedUint8ClaimsLatent(ReferenceNaive):
    """Stores the expanded per-head K/V in a flat uint8 pool, declares a latent cache and self-reports
    latent-sized active bytes: only bytes measured from the tensors catch it."""

    name = "broken-expanded-uint8-pool"
    cache_format = "latent"

    def new_cache(self, config, *, batch_size, capacity, dtype, device, kv_codec="none"):
        H = config.num_attention_heads
        return _BytePool({"k": (H, config.qk_head_dim), "v": (H, config.v_head_dim)}, dtype,
                         batch_size=batch_size, capacity=capacity, device=device, config=config,
                         declared_active_per_token=config.latent_dim * torch.empty(0, dtype=dtype).element_size())


class ShortAllocation(ReferenceAbsorbed):
    """Preallocates 4 slots fewer than the capacity asked for (fine until a row fills up)."""

    name = "broken-short-allocation"
    supports_paging = False

    def new_cache(self, config, *, batch_size, capacity, dtype, device, kv_codec="none"):
        cache = LatentSlotCache.allocate(config, batch_size=batch_size, capacity=max(1, capacity - 4), dtype=dtype,
                                         device=device)
        return cache


class CopiesTensors(ReferenceAbsorbed):
    """tensors() returns copies of the buffers: what the suite writes never reaches the cache."""

    name = "broken-tensors-are-copies"
    supports_paging = False

    def new_cache(self, config, **kw):
        cache = super().new_cache(config, **kw)
        cache.tensors = lambda: {k: v.clone() for k, v in cache._buffers.items()}
        return cache


# --------------------------------------------------------------------------- poison and isolation


class MasksByMultiply(ReferenceAbsorbed):
    """Reads every slot up to the longest row and removes other rows' unwritten slots by multiplying the
    probabilities with 0 (FlashInfer #941 / vLLM #37442): exact on a zero-filled cache, NaN on a real one."""

    name = "broken-masks-by-multiply"
    supports_paging = False

    def attend(self, weights, hidden_states, positions, cache, lengths=None):
        lengths, new_lens = cache.write_plan(positions, lengths)
        q_nope, q_pe, c, k_pe = ref.project(weights, hidden_states, positions)
        cache.write_latent(c, k_pe, lengths)
        T = int(new_lens.max())
        allowed = cache.allowed(lengths, new_lens, hidden_states.shape[1], T)
        raw = cache.tensors()
        c_all, kpe_all = raw["kv_latent"][:, :T], raw["k_pe"][:, :T]
        cfg = weights.config
        w_uk, w_uv = ref.split_kv_b(weights)
        q_lat = torch.einsum("bshd,hdc->bshc", q_nope, w_uk)
        scores = (torch.einsum("bshc,btc->bsht", q_lat, c_all) + torch.einsum("bshr,btr->bsht", q_pe, kpe_all))
        scores = scores.float() * cfg.softmax_scale
        keep = allowed[:, :, None, :].float()
        p = torch.exp(scores - torch.nan_to_num(scores, nan=0.0).amax(-1, keepdim=True)) * keep
        p = (p / p.sum(-1, keepdim=True)).to(q_nope.dtype)
        o = torch.einsum("bshc,hdc->bshd", torch.einsum("bsht,btc->bshc", p, c_all), w_uv)
        cache.commit(new_lens)
        return (o.flatten(-2) @ weights["o_proj.weight"].T).to(hidden_states.dtype)


class MutatesWeights(ReferenceAbsorbed):
    """Nudges o_proj.weight in place after each call (a cached "fused" weight written back)."""

    name = "broken-mutates-weights"
    supports_paging = False

    def attend(self, weights, hidden_states, positions, cache, lengths=None):
        out = super().attend(weights, hidden_states, positions, cache, lengths)
        with torch.no_grad():
            weights["o_proj.weight"].mul_(1.001)
        return out


# --------------------------------------------------------------------------- codecs


class _NoScalesCache(QuantizedLatentCache):
    def active_nbytes(self):
        """Counts the quantized values and forgets the scale bytes (the latent quantization study's slip)."""
        meta = sum(t[0, 0].numel() * t.element_size() for k, t in self._buffers.items() if "scale" in k or "min" in k)
        return super().active_nbytes() - int(self.seq_lens.sum()) * meta


class ScalesNotCounted(ReferenceAbsorbed):
    name = "broken-scales-not-counted"
    supports_paging = False

    def new_cache(self, config, *, batch_size, capacity, dtype, device, kv_codec="none"):
        cache = super().new_cache(config, batch_size=batch_size, capacity=capacity, dtype=dtype, device=device,
                                  kv_codec=kv_codec)
        if isinstance(cache, QuantizedLatentCache):
            cache.__class__ = _NoScalesCache
        return cache


class _ThreeLevelsInInt8(IntCodec):
    """int8-g32's layout (same bytes) holding only 3 levels per group (-amax, 0, amax): a quantizer bug,
    not a layout change."""

    def encode(self, c, k_pe, cache_dtype, globals=None):
        parts = super().encode(c, k_pe, cache_dtype, globals)
        q = parts["c_q"].to(torch.float32)
        parts["c_q"] = (torch.round(q / 127) * 127).to(torch.int8)
        return parts


class BadInt8Codec(ReferenceAbsorbed):
    """kv_codec int8-g32 with the right bytes but 3 levels of precision inside them."""

    name = "broken-int8-codec"
    supports_paging = False

    def unsupported_reason(self, config, *, dtype, device, kv_codec="none"):
        return None if kv_codec in ("none", "int8-g32") else f"{self.name} implements only int8-g32"

    def new_cache(self, config, *, batch_size, capacity, dtype, device, kv_codec="none"):
        cache = super().new_cache(config, batch_size=batch_size, capacity=capacity, dtype=dtype, device=device,
                                  kv_codec=kv_codec)
        if kv_codec == "int8-g32":
            cache.codec = _ThreeLevelsInInt8("int8-g32", bits=8, symmetric=True, group=32)
        return cache


# --------------------------------------------------------------------------- paging


class _LeakyPages(PagedLatentCache):
    def read_latent(self, T, new_lens=None):
        """Hands back the raw pages: slots no token was written to keep their garbage (NaN)."""
        kv = self.gather(T)["kv"]
        return kv[..., : self.kv_lora_rank], kv[..., self.kv_lora_rank:]


class LeakyPages(ReferenceAbsorbed):
    """Paged cache whose reads return unwritten slots as they are (no torch.where)."""

    name = "broken-leaky-pages"

    def new_cache(self, config, *, batch_size, capacity, dtype, device, kv_codec="none", page_block_size=None):
        if page_block_size is None:
            return super().new_cache(config, batch_size=batch_size, capacity=capacity, dtype=dtype, device=device,
                                     kv_codec=kv_codec)
        return _LeakyPages(config, batch_size=batch_size, capacity=capacity, dtype=dtype, device=device,
                           page_block_size=page_block_size)


class _BlockTableUncounted(PagedLatentCache):
    def allocated_nbytes(self):
        """The pools only: the block table is left out of the allocation."""
        return sum(t.numel() * t.element_size() for k, t in self.tensors().items() if k != "block_table")


class PagedBytesUncounted(ReferenceAbsorbed):
    name = "broken-paged-bytes"

    def new_cache(self, config, *, batch_size, capacity, dtype, device, kv_codec="none", page_block_size=None):
        cache = super().new_cache(config, batch_size=batch_size, capacity=capacity, dtype=dtype, device=device,
                                  kv_codec=kv_codec, page_block_size=page_block_size)
        if isinstance(cache, PagedLatentCache):
            cache.__class__ = _BlockTableUncounted
        return cache


# --------------------------------------------------------------------------- crashes and refusals


class DeclinesEverything:
    """Implements the contract and declines every case: nothing is tested, so nothing may be called conformant."""

    name = "declines-everything"

    def unsupported_reason(self, config, *, dtype, device, kv_codec="none"):
        return "this build has no kernels for this host"

    def new_cache(self, *args, **kwargs):
        raise AssertionError("never called")

    def attend(self, *args, **kwargs):
        raise AssertionError("never called")


# --------------------------------------------------------------------------- correct, legitimately different


class _Oversized(LatentCache):
    def __init__(self, config, batch_size, capacity, dtype, device):
        super().__init__(config, batch_size, 4 * capacity, dtype, device)
        self.capacity = capacity  # the rows still hold at most `capacity` tokens


class OverAllocating(IndependentMLA):
    """The independent backend with 4x the requested slots per row (an engine's pool / max_seq_len
    policy): correct, so it must pass every byte test, with its overhead reported."""

    name = "independent-overallocating"

    def new_cache(self, config, *, batch_size, capacity, dtype, device, kv_codec="none"):
        reason = self.unsupported_reason(config, dtype=dtype, device=device, kv_codec=kv_codec)
        if reason is not None:
            raise ValueError(reason)
        return _Oversized(config, batch_size, capacity, dtype, device)
