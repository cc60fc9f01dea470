"""Built-in reference backends: ``reference-naive`` (expanded K/V cache), ``reference-absorbed`` and
``reference-dsa`` (DeepSeek Sparse Attention over a latent + indexer-key cache).

Both preallocate ``capacity`` slots per row (hence seed 000's allocated figures) and differ only in
what they cache and in which of the two attention paths of :mod:`mla_conformance.model.reference` they run.
"""

from __future__ import annotations

import torch

from mla_conformance.model import reference

from mla_conformance.model import dsa_reference as dsa_ref
from mla_conformance.contract.layer import dense_only_reason
from mla_conformance.kv.caches import (FP8IndexerLatentCache, IndexerLatentCache, LatentSlotCache, PagedLatentCache, QuantizedLatentCache,
                                   SlotCache)
from mla_conformance.kv.codecs import get_codec
from mla_conformance.model.weights import MLAWeights

__all__ = ["ReferenceNaive", "ReferenceAbsorbed", "ReferenceDSA", "SlotCache", "LatentSlotCache", "IndexerLatentCache"]


class _ReferenceBackend:
    cache_format = "latent"
    kv_codecs: tuple[str, ...] = ("none",)

    def unsupported_reason(self, config, *, dtype, device, kv_codec="none"):
        if dense_only_reason(self.name, config):
            return dense_only_reason(self.name, config)
        if kv_codec not in self.kv_codecs:
            return (f"{self.name} stores an unquantized cache; kv_codec {kv_codec!r} is not supported "
                    "(reference-absorbed implements the quantized codecs)")
        if not torch.empty(0, dtype=dtype).is_floating_point():
            return f"{self.name} needs a floating-point dtype, got {dtype}"
        return None

    def _check(self, weights: MLAWeights, hidden_states: torch.Tensor):
        if hidden_states.dtype != weights.dtype:
            raise ValueError(f"hidden_states are {hidden_states.dtype} but weights are {weights.dtype}")


class ReferenceNaive(_ReferenceBackend):
    """Caches the expanded per-head K [nope + rope] and V: H x (qk_head + v) elements per token."""

    name = "reference-naive"
    cache_format = "expanded"

    def new_cache(self, config, *, batch_size, capacity, dtype, device, kv_codec="none"):
        H = config.num_attention_heads
        bufs = {
            "k": torch.zeros(batch_size, capacity, H, config.qk_head_dim, dtype=dtype, device=device),
            "v": torch.zeros(batch_size, capacity, H, config.v_head_dim, dtype=dtype, device=device),
        }
        return SlotCache(bufs, batch_size=batch_size, capacity=capacity, device=device, config=config)

    def attend(self, weights, hidden_states, positions, cache, lengths=None):
        self._check(weights, hidden_states)
        lengths, new_lens = cache.write_plan(positions, lengths)
        q_nope, q_pe, c, k_pe = reference.project(weights, hidden_states, positions)
        k, v = reference.expand_kv(weights, c, k_pe)
        cache.write("k", k, lengths)
        cache.write("v", v, lengths)
        T = int(new_lens.max())
        allowed = cache.allowed(lengths, new_lens, hidden_states.shape[1], T)
        k_all, v_all = cache.read("k", T, new_lens), cache.read("v", T, new_lens)
        out = reference.naive_scores_and_mix(weights, q_nope, q_pe, k_all, v_all, allowed)
        cache.commit(new_lens)
        return out.to(hidden_states.dtype)


class ReferenceAbsorbed(_ReferenceBackend):
    """Caches the normed latent c (kv_lora) and the rotated k_pe (rope): 576 elements per token.

    Optional parts it opts into: every codec of mla_conformance.kv.codecs (quantize on write, dequantize on
    read), and a paged cache (``new_cache(..., page_block_size=N)``).
    """

    name = "reference-absorbed"

    supports_paging = True

    def unsupported_reason(self, config, *, dtype, device, kv_codec="none"):
        if dense_only_reason(self.name, config):
            return dense_only_reason(self.name, config)
        if not torch.empty(0, dtype=dtype).is_floating_point():
            return f"{self.name} needs a floating-point dtype, got {dtype}"
        if kv_codec == "none":
            return None
        try:
            codec = get_codec(kv_codec)
        except ValueError as exc:  # unknown codec name: say which ones exist
            return f"{self.name}: {exc}"
        return codec.unsupported_reason(config, dtype)

    def new_cache(self, config, *, batch_size, capacity, dtype, device, kv_codec="none", page_block_size=None):
        if page_block_size is not None:
            return PagedLatentCache(config, batch_size=batch_size, capacity=capacity, dtype=dtype, device=device,
                                    kv_codec=kv_codec, page_block_size=page_block_size)
        if kv_codec != "none":
            return QuantizedLatentCache(config, batch_size=batch_size, capacity=capacity, dtype=dtype,
                                        device=device, kv_codec=kv_codec)
        return LatentSlotCache.allocate(config, batch_size=batch_size, capacity=capacity, dtype=dtype, device=device)

    def attend(self, weights, hidden_states, positions, cache, lengths=None):
        self._check(weights, hidden_states)
        lengths, new_lens = cache.write_plan(positions, lengths)
        q_nope, q_pe, c, k_pe = reference.project(weights, hidden_states, positions)
        cache.write_latent(c, k_pe, lengths)
        T = int(new_lens.max())
        allowed = cache.allowed(lengths, new_lens, hidden_states.shape[1], T)
        allowed = self.attended(weights, hidden_states, positions, cache, lengths, new_lens, allowed)
        c_all, kpe_all = cache.read_latent(T, new_lens)
        out = reference.absorbed_scores_and_mix(weights, q_nope, q_pe, c_all, kpe_all, allowed)
        cache.commit(new_lens)
        return out.to(hidden_states.dtype)

    def attended(self, weights, hidden_states, positions, cache, lengths, new_lens, allowed):
        """[B, S, T] the keys each query attends: all the causal ones (DSA narrows them to its selection)."""
        return allowed


class ReferenceDSA(ReferenceAbsorbed):
    """DeepSeek Sparse Attention (V3.2): caches the normed latent c, the rotated k_pe and the lightning
    indexer's key per token (``cache_format = "latent+indexer"``: kv_lora + rope + index_head_dim elements,
    1,408 B per token in BF16 at 512/64/128), scores every cached token with the indexer, keeps the
    top-min(index_topk, len) per query (causal) and runs absorbed MLA over the selected tokens only.

    Dense configs (index_topk None) are declined with a sentence: reference-absorbed is that backend.
    Indexer scores and selection run in float32 (float64 for a float64 cache) over the cached keys, as
    DeepSeek's kernels accumulate them. ``kv_codec="fp8-e4m3-flashmla"`` (V3.2 dims, bfloat16) is the FP8
    form: FlashMLA's 656-byte latent row plus an FP8 indexer key with float32 power-of-two block scales
    (128 + 4 B), 788 B per token; the indexer query is FP8-rounded the same way (DeepSeek's act_quant).
    The indexer's RoPE follows the config's ``indexer_rope_interleave``. The indexer key is stored in the cache
    dtype (``indexer_format`` "cache-dtype", the default) or, with the FP8 codec, as "fp8-e4m3-block128" (declared
    by the cache). The last call's selection is on the cache as ``last_topk_indices`` ([B, S, index_topk] int64, -1 padded),
    and the indexer scores it was taken from as ``last_indexer_scores`` (float32 [B, S, T] over key positions
    0..T-1, -inf where masked).
    """

    name = "reference-dsa"
    sparse_attention = "dsa"  # the opt-in declaration (the DSA tests run on it)
    cache_format = "latent+indexer"
    supports_paging = False
    #: the indexer's RoPE layout: None = the config's (``indexer_rope_interleave``: half-split for DeepSeek-V3.2,
    #: interleaved for GLM-5-style configs); a fixed "half" / "interleaved" ignores the config
    indexer_rope_layout = None

    def unsupported_reason(self, config, *, dtype, device, kv_codec="none"):
        if not config.dsa:
            return (f"{self.name} implements DeepSeek Sparse Attention only (index_topk set); this config is dense "
                    "MLA, which reference-absorbed implements")
        if not torch.empty(0, dtype=dtype).is_floating_point():
            return f"{self.name} needs a floating-point dtype, got {dtype}"
        if kv_codec == "fp8-e4m3-flashmla":
            reason = get_codec(kv_codec).unsupported_reason(config, dtype)
            return f"{self.name}: {reason}" if reason else None
        if kv_codec != "none":
            return (f"{self.name} implements the unquantized latent + indexer cache and its FP8 form "
                    f"(fp8-e4m3-flashmla, 788 B/token); kv_codec {kv_codec!r} is not supported")
        return None

    def new_cache(self, config, *, batch_size, capacity, dtype, device, kv_codec="none", page_block_size=None):
        if page_block_size is not None:
            raise ValueError(f"{self.name} has no paged cache")
        if kv_codec != "none":
            return FP8IndexerLatentCache(config, batch_size=batch_size, capacity=capacity, dtype=dtype,
                                         device=device, kv_codec=kv_codec)
        return IndexerLatentCache.allocate(config, batch_size=batch_size, capacity=capacity, dtype=dtype,
                                           device=device)

    def select(self, weights, hidden_states, positions, cache, lengths, new_lens, allowed):
        """Write this call's indexer keys; return the selection [B, S, index_topk] (-1 padded)."""
        q_i, k_i, w_i = dsa_ref.indexer_project(weights, hidden_states, positions, rope_layout=self.indexer_rope_layout)
        T = allowed.shape[-1]
        acc = torch.float64 if hidden_states.dtype == torch.float64 else torch.float32
        if isinstance(cache, FP8IndexerLatentCache):
            q_i = dsa_ref.fp8_block_dequant(q_i)
            cache.write_index_k(k_i, lengths)
            k_all = cache.read_index_k(T, new_lens).to(acc)
        else:
            cache.write("index_k", k_i, lengths)
            k_all = cache.read("index_k", T, new_lens).to(acc)
        scores = dsa_ref.indexer_scores(q_i.to(acc), k_all, w_i.to(acc), allowed)
        cache.last_indexer_scores = scores.to(torch.float32)  # the optional hook: [B, S, T], -inf where masked
        return self.topk(scores, weights.config.index_topk)

    def topk(self, scores, topk):
        idx = dsa_ref.select_topk(scores, topk)
        if idx.shape[-1] < topk:
            idx = torch.nn.functional.pad(idx, (0, topk - idx.shape[-1]), value=-1)
        return idx

    def attended(self, weights, hidden_states, positions, cache, lengths, new_lens, allowed):
        """The causal keys narrowed to the indexer's top-k (recorded on the cache as last_topk_indices)."""
        idx = self.select(weights, hidden_states, positions, cache, lengths, new_lens, allowed)
        cache.last_topk_indices = idx
        return allowed & dsa_ref.selection_mask(idx, allowed.shape[-1])
