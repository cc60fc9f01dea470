"""``flashmla``: absorbed MLA with DeepSeek's FlashMLA dense decode kernel over a paged latent cache.

Projections and an op: :class:`FlashMLA` is :class:`mla_conformance.impl.ops.layer.OpBackend` over
:class:`mla_conformance.impl.ops.flashmla.FlashMLAOp` (the op ``flashmla``). Projections, RoPE and the two
absorptions run in torch (:mod:`mla_conformance.model.reference`); only the attention over the cache runs in the
kernel::

    q      = [q_nope W_UK | q_pe]                         [B, S, H, 576]   (query absorbs W_UK)
    o_lat  = flash_mla_with_kvcache(q, k_cache, ...)      [B, S, H, 512]   (causal, paged, page block 64)
    out    = o_proj(o_lat W_UV^T)                                            (output absorbs W_UV)

Every call, prefill chunks (S > 1) included, goes through the kernel: with ``causal=True`` FlashMLA
aligns the S queries with the *last* S keys of each row (query i sees keys < cache_seqlens - S + i + 1,
the MTP / speculative-decode form), which is exactly query i at position seq_lens + i when the row
appended S tokens. Rows of a padded batch appended fewer tokens, so the rows are grouped by how many
they appended and each group is one kernel call with that many queries (a decode step with every row
at one token: one call); rows that appended nothing are left out.

Gating (``unsupported_reason``): kv_codec "none" only (FlashMLA's FP8 cache runs in the sparse decode
kernel, which needs top-k indices this backend does not produce), bfloat16, kv_lora 512 + rope 64 (the
kernel's head dims 576 / 512), then the op's: :func:`mla_conformance.arch.why_not` for
``flashmla/dense_decode`` on the device, then that ``flash_mla`` imports.

``get_mla_metadata`` across FlashMLA releases: :func:`mla_conformance.impl.ops.flashmla.mla_metadata`
(re-exported here).
"""

from __future__ import annotations

import torch

from mla_conformance.contract.op import OpCase
from mla_conformance.dtypes import dtype_name
from mla_conformance.impl.backends.reference import ReferenceDSA
from mla_conformance.impl.ops.flashmla import DENSE_KERNEL, FlashMLAOp, FlashMLASparseOp, mla_metadata
from mla_conformance.impl.ops.layer import OpBackend
from mla_conformance.kv.caches import FP8IndexerLatentCache
from mla_conformance.kv.codecs import get_codec
from mla_conformance.model import reference

KERNEL_ID = DENSE_KERNEL
PAGE_BLOCK_SIZE = 64
HEAD_DIM_V = 512
ROPE_DIM = 64
FP8_CODEC = "fp8-e4m3-flashmla"


class FlashMLA(OpBackend):
    """FlashMLA dense decode (SM90, bf16, page block 64) behind the backend contract: projections + the op."""

    kernel_id = KERNEL_ID
    # FlashMLA reads one page size: the paged tests compare two runs of the same kernel at page 64
    paged_bit_exact = True

    def __init__(self, flash_mla_module=None):
        # a stand-in module (tests) replaces `import flash_mla`; gating still judges the real device
        super().__init__(FlashMLAOp(flash_mla_module=flash_mla_module), page_block_size=PAGE_BLOCK_SIZE)
        self.name = "flashmla"

    # ------------------------------------------------------------------ gating
    def request_reason(self, config, *, dtype, device, kv_codec="none"):
        """Request-level reasons first (they read the same on any device), then the op's."""
        if getattr(config, "dsa", False):
            return (f"this backend drives FlashMLA's dense decode; DeepSeek Sparse Attention (index_topk "
                    f"{config.index_topk}) needs flashmla/sparse_decode with top-k indices, not implemented here")
        if kv_codec == FP8_CODEC:
            return (f"FlashMLA's FP8 cache ({FP8_CODEC}, 656 bytes/token) runs in the sparse decode kernel "
                    "(flashmla/sparse_decode: flash_mla_with_kvcache with top-k indices and is_fp8_kvcache), "
                    "which this backend does not implement; it runs dense decode over a bfloat16 cache "
                    "(kv_codec 'none')")
        if kv_codec != "none":
            return f"FlashMLA dense decode reads an unquantized bfloat16 cache; kv_codec {kv_codec!r} is not supported"
        if dtype != torch.bfloat16:
            return (f"FlashMLA dense decode takes bfloat16 only (the BF16 cache of FlashMLA's README), "
                    f"not {dtype_name(dtype)}")
        if config.kv_lora_rank != HEAD_DIM_V or config.qk_rope_head_dim != ROPE_DIM:
            return (f"FlashMLA dense decode has fixed head dims 576 (K) / 512 (V): it needs kv_lora_rank 512 and "
                    f"qk_rope_head_dim 64, this config has {config.kv_lora_rank} and {config.qk_rope_head_dim}")
        return None

    # ------------------------------------------------------------------ cache
    def new_cache(self, config, *, batch_size, capacity, dtype, device, kv_codec="none", page_block_size=None):
        page_block_size = PAGE_BLOCK_SIZE if page_block_size is None else page_block_size
        if page_block_size != PAGE_BLOCK_SIZE:
            raise ValueError(f"FlashMLA dense decode reads pages of {PAGE_BLOCK_SIZE} tokens, not {page_block_size}")
        if kv_codec != "none":
            raise ValueError(f"{self.name} stores kv_codec 'none' only, not {kv_codec!r}")
        return super().new_cache(config, batch_size=batch_size, capacity=capacity, dtype=dtype, device=device,
                                 kv_codec=kv_codec, page_block_size=page_block_size)


class FlashMLASparse:
    """``flashmla-sparse``: DeepSeek Sparse Attention (V3.2) with FlashMLA's sparse decode over the FP8 656-byte cache.

    reference-dsa's cache (``fp8-e4m3-flashmla``: the 656-byte latent row plus the packed FP8 indexer key,
    788 B/token), projections and lightning-indexer selection (top-min(index_topk, len) per query, causal),
    then the attention over the selected tokens in :class:`mla_conformance.impl.ops.flashmla.FlashMLASparseOp`:
    the [B, capacity, 656] latent buffer is handed to the kernel as pages of one token ([B * capacity, 1, 1,
    656], no copy), each selected position p of row b as the flat index ``b * capacity + p`` (-1 stays -1),
    ``causal=False`` (the selection is already causal). The query absorbs W_UK, the output W_UV, as
    everywhere. Gating: DSA configs with kv_codec ``fp8-e4m3-flashmla`` (bfloat16, kv_lora 512 + rope 64),
    then the op's sentences (the matrix's for ``flashmla/sparse_decode`` first).
    """

    name = "flashmla-sparse"
    sparse_attention = "dsa"
    cache_format = "latent+indexer"
    supports_paging = False
    kv_codecs = (FP8_CODEC,)
    kernel_id = "flashmla/sparse_decode"

    def __init__(self, flash_mla_module=None):
        self.op = FlashMLASparseOp(flash_mla_module=flash_mla_module)
        self._dsa = ReferenceDSA()  # its cache, projections and indexer selection

    def unsupported_reason(self, config, *, dtype, device, kv_codec="none"):
        if not getattr(config, "dsa", False):
            return ("flashmla-sparse runs DeepSeek Sparse Attention (index_topk set) through FlashMLA's sparse "
                    "decode; this config is dense MLA (the flashmla backend drives dense decode)")
        if kv_codec != FP8_CODEC:
            return (f"FlashMLA's sparse decode reads the FP8 656-byte cache only: kv_codec {FP8_CODEC!r}, "
                    f"not {kv_codec!r}")
        reason = get_codec(kv_codec).unsupported_reason(config, dtype)
        if reason:
            return reason
        case = OpCase(batch=1, s_q=1, h_q=int(config.num_attention_heads), page_block_size=1, dtype=dtype,
                      kv_format="fp8-e4m3-flashmla", topk=int(config.index_topk), causal=False, device=str(device))
        return self.op.unsupported_reason(case)

    def new_cache(self, config, *, batch_size, capacity, dtype, device, kv_codec="none", page_block_size=None):
        if kv_codec != FP8_CODEC:
            raise ValueError(f"{self.name} stores kv_codec {FP8_CODEC!r} only, not {kv_codec!r}")
        return self._dsa.new_cache(config, batch_size=batch_size, capacity=capacity, dtype=dtype, device=device,
                                   kv_codec=kv_codec, page_block_size=page_block_size)

    def attend(self, weights, hidden_states, positions, cache, lengths=None):
        if hidden_states.dtype != weights.dtype:
            raise ValueError(f"hidden_states are {hidden_states.dtype} but weights are {weights.dtype}")
        if not isinstance(cache, FP8IndexerLatentCache):
            raise TypeError(f"{self.name}: expected the FP8 latent + indexer cache of new_cache(), got "
                            f"{type(cache).__name__}")
        cfg = weights.config
        B, S = hidden_states.shape[:2]
        lengths, new_lens = cache.write_plan(positions, lengths)
        q_nope, q_pe, c, k_pe = reference.project(weights, hidden_states, positions)
        cache.write_latent(c, k_pe, lengths)
        T = int(new_lens.max())
        allowed = cache.allowed(lengths, new_lens, S, T)
        idx = self._dsa.select(weights, hidden_states, positions, cache, lengths, new_lens, allowed)
        cache.last_topk_indices = idx
        kv = cache.tensors()["kv"]                                                    # [B, capacity, 656] uint8
        capacity = kv.shape[1]
        k_cache = kv.view(B * capacity, 1, 1, kv.shape[-1])                           # pages of one token
        rows = torch.arange(B, device=idx.device).view(B, 1, 1)
        flat = torch.where(idx >= 0, rows * capacity + idx, torch.full_like(idx, -1)).to(torch.int32)
        w_uk, w_uv = reference.split_kv_b(weights)
        q = torch.cat([torch.einsum("bshd,hdc->bshc", q_nope, w_uk), q_pe], dim=-1)  # [B, S, H, 576]
        block_table = torch.arange(B * capacity, dtype=torch.int32, device=kv.device).view(B, capacity)
        o_lat, _lse = self.op.decode(q.to(torch.bfloat16), k_cache, block_table, new_lens.to(torch.int32),
                                     softmax_scale=cfg.softmax_scale, causal=False, indices=flat)
        o = torch.einsum("bshc,hdc->bshd", o_lat.to(q.dtype), w_uv)
        out = o.flatten(-2) @ weights["o_proj.weight"].T
        cache.commit(new_lens)
        return out.to(hidden_states.dtype)


__all__ = ["FlashMLA", "FlashMLASparse", "KERNEL_ID", "mla_metadata"]
