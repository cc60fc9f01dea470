"""What one decode step must move and compute: bytes of the weights and FLOPs by the backend's cache format.

**Bytes per step** = ``cache.active_nbytes()`` at ``context`` tokens + the bytes of every attention
weight of the layer (all of them are read by a decode step): the minimum a step must move; achieved
GB/s = bytes / median time. Backends that also materialise intermediates (transformers 5.x expands the
whole latent cache into per-head K/V on every call; a quantized cache is dequantized on read) move more
than this, so their GB/s is an *effective* figure.

**FLOPs of one step** (B rows, one query token each, N = context + 1 keys including the new token,
H heads, d_qk = nope + rope, d_c = kv_lora, d_r = rope; multiply-adds count 2; softmax, norms and RoPE
are O(H N) and left out)::

    projections   2 B [hidden (H d_qk)  or  hidden q_lora + q_lora H d_qk]      query
                + 2 B hidden (d_c + d_r)                                          kv_a
                + 2 B H d_v hidden                                                o_proj
    "absorbed"    + 2 B H (nope d_c + d_c d_v)         absorb W_UK into q, W_UV into the output
                  + 2 B H N (2 d_c + d_r)               scores on the 576-wide latent + mix on c
    "expanded"    + 2 B d_c H (nope + d_v)             expand the new token
                  + 2 B H N (d_qk + d_v)                scores + mix on per-head K/V
    "expand-per-call" (a latent cache expanded on every call, transformers 5.x)
                  + 2 B N d_c H (nope + d_v) + 2 B H N (d_qk + d_v)

    "sparse" (DeepSeek Sparse Attention, a "latent+indexer" cache; K = min(index_topk, N), n indexer heads
              of width d_i)
                  + 2 B H (nope d_c + d_c d_v) + 2 B H K (2 d_c + d_r)   absorbed MLA over the K selected
                  + 2 B (q_lora n d_i + hidden d_i + hidden n)           indexer q, k and head weights
                  + 2 B n d_i N                                         indexer scores over every key

The model follows the backend's declared ``cache_format`` ("latent" -> absorbed, "expanded" ->
expanded, "latent+indexer" -> sparse), except ``HFCache`` holding the latent, which transformers expands
per call.
"""

from __future__ import annotations

from mla_conformance.contract.layer import cache_format_of
from mla_conformance.impl.backends.hf import HFCache
from mla_conformance.model.config import MLAConfig


def weight_nbytes(weights) -> int:
    """Bytes of every attention weight of the layer (all read by one decode step)."""
    return sum(t.numel() * t.element_size() for t in weights.values())


def decode_flops(config: MLAConfig, context: int, batch: int, model: str) -> int:
    """FLOPs of one decode step over ``context`` cached tokens (see the module docstring)."""
    c = config
    H, d_c, d_r, nope, d_v = (c.num_attention_heads, c.kv_lora_rank, c.qk_rope_head_dim,
                              c.qk_nope_head_dim, c.v_head_dim)
    d_qk = nope + d_r
    N = context + 1
    if c.q_lora_rank is None:
        q = c.hidden_size * H * d_qk
    else:
        q = c.hidden_size * c.q_lora_rank + c.q_lora_rank * H * d_qk
    per_row = 2 * (q + c.hidden_size * (d_c + d_r) + H * d_v * c.hidden_size)
    if model == "absorbed":
        per_row += 2 * H * (nope * d_c + d_c * d_v) + 2 * H * N * (2 * d_c + d_r)
    elif model == "expanded":
        per_row += 2 * d_c * H * (nope + d_v) + 2 * H * N * (d_qk + d_v)
    elif model == "expand-per-call":
        per_row += 2 * N * d_c * H * (nope + d_v) + 2 * H * N * (d_qk + d_v)
    elif model == "sparse":
        if not c.dsa:
            raise ValueError("the sparse FLOP model needs a DeepSeek Sparse Attention config (index_topk set)")
        K = min(c.index_topk, N)
        n, d_i = c.index_n_heads, c.index_head_dim
        per_row += 2 * H * (nope * d_c + d_c * d_v) + 2 * H * K * (2 * d_c + d_r)
        per_row += 2 * ((c.q_lora_rank or 0) * n * d_i + c.hidden_size * d_i + c.hidden_size * n) + 2 * n * d_i * N
    else:
        raise ValueError(f"unknown FLOP model {model!r}")
    return batch * per_row


def flop_model(backend, cache) -> str:
    fmt = cache_format_of(backend, cache)
    if isinstance(cache, HFCache) and fmt in ("latent", "latent+indexer"):
        return "expand-per-call"  # transformers' eager DeepseekV32Attention masks the dense scores to its top-k
    if fmt == "latent+indexer":
        return "sparse"
    return "absorbed" if fmt == "latent" else "expanded"
