"""``flashmla``: absorbed MLA with DeepSeek's FlashMLA dense decode kernel over a paged latent cache.

Projections, RoPE and the two absorptions run in torch (:mod:`mla_conformance.reference`); only the
attention over the cache runs in the kernel::

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
kernel's head dims 576 / 512), then :func:`mla_conformance.arch.why_not` for ``flashmla/dense_decode``
on the device, then that ``flash_mla`` imports.

``get_mla_metadata`` changed signature across FlashMLA releases; :func:`mla_metadata` inspects the
installed one:

* ``get_mla_metadata(cache_seqlens, num_heads_per_head_k, num_heads_k)`` (first release) and
  ``get_mla_metadata(cache_seqlens, num_q_tokens_per_head_k, num_heads_k, num_heads_q=None,
  is_fp8_kvcache=False, topk=None)`` return ``(tile_scheduler_metadata, num_splits)`` tensors;
  the second argument is ``s_q * h_q // h_kv`` in both.
* ``get_mla_metadata(*args, **kwargs)`` (current) returns ``(FlashMLASchedMeta(), None)``, filled in
  by the first ``flash_mla_with_kvcache`` call; it must then get ``num_splits=None``.

Either way the pair goes to ``flash_mla_with_kvcache(..., tile_scheduler_metadata, num_splits)``.
"""

from __future__ import annotations

import inspect

import torch

from mla_conformance import reference as ref
from mla_conformance.cache import PagedLatentCache, to_flashmla_layout

KERNEL_ID = "flashmla/dense_decode"
PAGE_BLOCK_SIZE = 64
HEAD_DIM_V = 512
ROPE_DIM = 64
FP8_CODEC = "fp8-e4m3-flashmla"


def mla_metadata(get_mla_metadata, cache_seqlens: torch.Tensor, s_q: int, h_q: int, h_kv: int = 1):
    """Call the installed ``get_mla_metadata`` as its signature wants; returns (tile_scheduler_metadata, num_splits)."""
    try:
        params = inspect.signature(get_mla_metadata).parameters
    except (TypeError, ValueError):  # a compiled function without a signature: the first release's form
        params = None
    if params is not None:
        named = [p for p in params.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if not named:  # current interface: an empty FlashMLASchedMeta, initialised by the kernel call
            return get_mla_metadata()
        if "num_heads_q" in params:
            return get_mla_metadata(cache_seqlens, s_q * h_q // h_kv, h_kv, num_heads_q=h_q)
    return get_mla_metadata(cache_seqlens, s_q * h_q // h_kv, h_kv)


class FlashMLA:
    """FlashMLA dense decode (SM90, bf16, page block 64) behind the backend contract."""

    name = "flashmla"
    cache_format = "latent"
    supports_paging = True
    page_block_sizes = (PAGE_BLOCK_SIZE,)
    kv_codecs = ("none",)
    kernel_id = KERNEL_ID

    def __init__(self, flash_mla_module=None):
        # a stand-in module (tests) replaces `import flash_mla`; gating still judges the real device
        self._module = flash_mla_module

    # ------------------------------------------------------------------ gating
    def unsupported_reason(self, config, *, dtype, device, kv_codec="none"):
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
                    f"not {str(dtype).removeprefix('torch.')}")
        if config.kv_lora_rank != HEAD_DIM_V or config.qk_rope_head_dim != ROPE_DIM:
            return (f"FlashMLA dense decode has fixed head dims 576 (K) / 512 (V): it needs kv_lora_rank 512 and "
                    f"qk_rope_head_dim 64, this config has {config.kv_lora_rank} and {config.qk_rope_head_dim}")
        from mla_conformance.arch import detect, why_not

        reason = why_not(KERNEL_ID, detect(device))
        if reason:
            return reason
        if self._module is None:
            try:
                import flash_mla  # noqa: F401
            except Exception as exc:
                return f"FlashMLA dense decode: the flash_mla package does not import ({type(exc).__name__}: {exc})"
        return None

    # ------------------------------------------------------------------ cache
    def new_cache(self, config, *, batch_size, capacity, dtype, device, kv_codec="none", page_block_size=None):
        page_block_size = PAGE_BLOCK_SIZE if page_block_size is None else page_block_size
        if page_block_size != PAGE_BLOCK_SIZE:
            raise ValueError(f"FlashMLA dense decode reads pages of {PAGE_BLOCK_SIZE} tokens, not {page_block_size}")
        if kv_codec != "none":
            raise ValueError(f"{self.name} stores kv_codec 'none' only, not {kv_codec!r}")
        return PagedLatentCache(config, batch_size=batch_size, capacity=capacity, dtype=dtype, device=device,
                                kv_codec=kv_codec, page_block_size=page_block_size)

    # ------------------------------------------------------------------ attention
    def _flash_mla(self):
        if self._module is not None:
            return self._module
        import flash_mla

        return flash_mla

    def _kernel(self, q: torch.Tensor, k_cache, block_table, cache_seqlens, softmax_scale: float) -> torch.Tensor:
        """One flash_mla_with_kvcache call: q [b, s_q, H, 576] -> o_lat [b, s_q, H, 512]."""
        fm = self._flash_mla()
        s_q, h_q, h_kv = q.shape[1], q.shape[2], k_cache.shape[2]
        tile_scheduler_metadata, num_splits = mla_metadata(fm.get_mla_metadata, cache_seqlens, s_q, h_q, h_kv)
        out, _lse = fm.flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, HEAD_DIM_V,
                                              tile_scheduler_metadata, num_splits,
                                              softmax_scale=softmax_scale, causal=True)
        return out

    def attend(self, weights, hidden_states, positions, cache, lengths=None):
        if hidden_states.dtype != weights.dtype:
            raise ValueError(f"hidden_states are {hidden_states.dtype} but weights are {weights.dtype}")
        if not isinstance(cache, PagedLatentCache):
            raise TypeError(f"{self.name}: expected the PagedLatentCache of new_cache(), got {type(cache).__name__}")
        cfg = weights.config
        lengths, new_lens = cache.write_plan(positions, lengths)
        q_nope, q_pe, c, k_pe = ref.project(weights, hidden_states, positions)
        cache.write_latent(c, k_pe, lengths)
        w_uk, w_uv = ref.split_kv_b(weights)
        q = torch.cat([torch.einsum("bshd,hdc->bshc", q_nope, w_uk), q_pe], dim=-1)  # [B, S, H, 576]
        k_cache, block_table, cache_seqlens = to_flashmla_layout(cache, new_lens)

        B, S, H = q.shape[:3]
        o_lat = torch.zeros(B, S, H, cfg.kv_lora_rank, dtype=q.dtype, device=q.device)
        for n in sorted({int(v) for v in lengths.tolist()} - {0}):
            rows = (lengths == n).nonzero().flatten().to(q.device)
            o_lat[rows, :n] = self._kernel(q[rows, :n].contiguous(), k_cache, block_table[rows].contiguous(),
                                           cache_seqlens[rows].contiguous(), cfg.softmax_scale).to(q.dtype)
        o = torch.einsum("bshc,hdc->bshd", o_lat, w_uv)
        out = o.flatten(-2) @ weights["o_proj.weight"].T
        cache.commit(new_lens)
        return out.to(hidden_states.dtype)
