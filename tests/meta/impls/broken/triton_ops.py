"""Broken variants of the ``triton`` op (mla_conformance.impl.ops.triton_mla), each with one bug a Triton MLA decode
has had or could have, each failed under the interpreter by the op test named for it in
tests/meta/test_triton_tier.py. The first three override one of the op's metadata steps (the kernels are the op's
own); the last two are bugs of a GPU's arithmetic that Triton's interpreter as shipped hides, which only the
faithful tier (mla_conformance.impl.ops.triton_faithful, on by default) catches: both pass the tier with
``--mla-triton-emulation=off`` and fail it with the emulation on."""

from __future__ import annotations

import torch

from mla_conformance.impl.ops.triton_mla import TritonMLAOp

try:  # the tier runs these where triton is installed; elsewhere the module imports all the same
    import triton
    import triton.language as tl

    from mla_conformance.impl.ops.triton_kernels import _e4m3_to_float
except ImportError:  # pragma: no cover - triton not installed
    triton = None


class WrongSplitMerge(TritonMLAOp):
    """Split-KV partials averaged, not weighted by their lse: right while a query's keys fit in one split, wrong
    once they are split."""

    name = "broken-triton-split-merge"

    def combine(self, o_part, lse_part, attn_sink, shape, out_dtype=torch.float32):
        B, s_q, H, d_v = shape
        has = torch.isfinite(lse_part)                                        # [B * s_q, splits, h]
        n = has.sum(1).clamp(min=1)
        out = torch.where(has[..., None], o_part, 0).sum(1) / n[..., None]    # the mean of the non-empty splits
        lse = torch.logsumexp(torch.where(has, lse_part, -torch.inf), dim=1)
        lse = torch.where(has.any(1), lse, torch.inf)
        if attn_sink is not None:  # the sink as the op applies it: only the merge is wrong
            out = out * torch.where(has.any(1), torch.sigmoid(lse - attn_sink.float()), 0)[..., None]
        return out.view(B, s_q, H, d_v), lse.view(B, s_q, H).transpose(1, 2).contiguous()


class TopLeftCausal(TritonMLAOp):
    """Causal multi-token decode aligned top-left: query i sees keys 0..i, not the row's last s_q positions."""

    name = "broken-triton-top-left-causal"

    def visible_keys(self, cache_seqlens, s_q, causal, topk, topk_length):
        if not causal or topk is not None:
            return super().visible_keys(cache_seqlens, s_q, causal, topk, topk_length)
        B = cache_seqlens.shape[0]
        first = torch.arange(1, s_q + 1, device=cache_seqlens.device)[None, :]
        return torch.minimum(first, cache_seqlens.to(torch.int64)[:, None]).reshape(B * s_q).to(torch.int32)


class DroppedTileScale(TritonMLAOp):
    """The FP8 rows' float32 tile scales never applied (read as 1.0): the e4m3 values taken as the latent."""

    name = "broken-triton-dropped-tile-scale"

    def fp8_views(self, rows):
        data, scales, rope = super().fp8_views(rows)
        return data, torch.ones_like(scales), rope


class DefaultTF32Dot(TritonMLAOp):
    """Float32 q and cache dotted with ``tl.dot``'s default input_precision: "tf32" on an NVIDIA GPU, so each
    operand of q.K and P.V keeps 10 of its 23 mantissa bits (about 2^-11 relative per product), far past the float32
    bounds. Triton's interpreter as shipped multiplies float32 in IEEE whatever the precision, so it passes there."""

    name = "broken-triton-tf32-dot"
    float32_dot_precision = None


if triton is not None:
    @triton.jit
    def _dequantize_nudged(rows_ptr, scale_ptr, rope_ptr, out_ptr, N_ROWS, BLOCK_R: tl.constexpr):
        """656-byte FP8 rows [N, 656] (as bytes, float32 [N, 164] scales, bfloat16 [N, 328] rope) -> bfloat16
        latent rows [N, 576], each e4m3 x tile-scale value nudged half a bfloat16 step away from zero before the
        cast (the bug: see :class:`NudgedBf16Cast`)."""
        r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        ok = r < N_ROWS
        d = tl.arange(0, 512)
        raw = tl.load(rows_ptr + r[:, None] * 656 + d[None, :], mask=ok[:, None], other=0)
        scale = tl.load(scale_ptr + r[:, None] * 164 + 128 + d[None, :] // 128, mask=ok[:, None], other=0.0)
        value = _e4m3_to_float(raw) * scale
        tl.store(out_ptr + r[:, None] * 576 + d[None, :], (value * 1.00390625).to(tl.bfloat16), mask=ok[:, None])
        e = tl.arange(0, 64)
        rope = tl.load(rope_ptr + r[:, None] * 328 + 264 + e[None, :], mask=ok[:, None], other=0.0)
        tl.store(out_ptr + r[:, None] * 576 + 512 + e[None, :], rope, mask=ok[:, None])


class NudgedBf16Cast(TritonMLAOp):
    """The 656-byte FP8 rows dequantized to a bfloat16 latent in a pass of its own (as an engine that keeps an FP8
    cache for a bfloat16 kernel does), then decoded through the op's float32 path (no bfloat16 dot: what
    docs/triton.md advised for the shipped interpreter), its cast written against the interpreter's:
    that ``.to(tl.bfloat16)`` truncates, so each value is nudged half a bfloat16 step away from zero first
    (``value * (1 + 2^-8)``: round half up by hand). Where the cast truncates, the e4m3 x power-of-two values
    (bfloat16 values) come back exactly; where it rounds to nearest even, as on a GPU, every value whose mantissa
    is not zero goes up one bfloat16 step (2^-7 relative), and every score with it."""

    name = "broken-triton-nudged-bf16-cast"

    def decode(self, q, kv_cache, block_table, cache_seqlens, **kw):
        if kv_cache.dtype != torch.uint8 or kv_cache.shape[-1] != 656:
            return super().decode(q, kv_cache, block_table, cache_seqlens, **kw)
        num_blocks, page = kv_cache.shape[0], kv_cache.shape[1]
        n = num_blocks * page
        rows, scales, rope = self.fp8_views(kv_cache.reshape(n, 656).contiguous())
        latent = torch.empty(n, 576, dtype=torch.bfloat16, device=kv_cache.device)
        _dequantize_nudged[(-(-n // 64),)](rows, scales, rope, latent, n, BLOCK_R=64)
        out, lse = super().decode(q.float(), latent.float().view(num_blocks, page, 1, 576), block_table,
                                  cache_seqlens, **kw)
        return out.to(q.dtype), lse
