"""Broken variants of the ``triton`` op (mla_conformance.impl.ops.triton_mla), each with one bug a Triton MLA decode
has had or could have, each failed under the interpreter by the op test named for it in
tests/test_triton_tier.py. Each overrides one of the op's metadata steps; the kernels are the op's own."""

from __future__ import annotations

import torch

from mla_conformance.impl.ops.triton_mla import TritonMLAOp


class WrongSplitMerge(TritonMLAOp):
    """Split-KV partials averaged, not weighted by their lse: right while a query's keys fit in one split, wrong
    once they are split."""

    name = "broken-triton-split-merge"

    def combine(self, o_part, lse_part, attn_sink, shape):
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
