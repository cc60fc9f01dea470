"""Broken decode-only ops: reference-op restricted to one query per row (s_q 1, as vLLM's CPU ``mla_decode_kvcache``
and SGLang's AMX ``decode_attention_cpu`` decode), each with one bug such a kernel has had; each must be *failed* by
the op test named for it in tests/meta/test_decode_only_meta.py -- tests that before ran at s_q 2 only and skipped
for these ops. Every case of more than one query per row is declined with a sentence.
"""

from __future__ import annotations

import math

import torch

from mla_conformance.impl.ops.reference import ReferenceOp


class _DecodeOnly(ReferenceOp):
    """reference-op that decodes one query per row; no prefill, merge or write (a decode kernel)."""

    prefill = sparse_prefill = merge = write = None

    def unsupported_reason(self, case):
        s_q = getattr(case, "s_q", 1)
        if s_q > 1:
            return f"{self.name} decodes one query per row (s_q 1), not s_q {s_q}"
        return super().unsupported_reason(case)


class NanForZeroKeyRow(_DecodeOnly):
    """A row of zero keys returns NaN: every split's lse is -inf and the split merge computes exp(-inf - -inf) (SGLang's
    AMX ``decode_attention_cpu`` as vLLM 0.32's CPU build vendors it)."""

    name = "broken-decode-only-nan-zero-key-row"

    def decode(self, q, kv_cache, block_table, cache_seqlens, **kwargs):
        out, lse = super().decode(q, kv_cache, block_table, cache_seqlens, **kwargs)
        if kwargs.get("indices") is not None:
            return out, lse
        empty = (cache_seqlens == 0).to(out.device)                 # [B]
        nan = torch.full((), math.nan, dtype=out.dtype, device=out.device)
        return (torch.where(empty[:, None, None, None], nan, out),
                torch.where(empty[:, None, None], torch.full((), math.nan, device=lse.device), lse))


class RopeDroppedInBfloat16(_DecodeOnly):
    """Its bfloat16 instantiation computes the logits over the 512 latent channels only (the 64 rope channels of q
    and the key left out: a template instantiated for the wrong head dim); float32 and float16 are right."""

    name = "broken-decode-only-bf16-no-rope"

    def decode(self, q, kv_cache, block_table, cache_seqlens, **kwargs):
        if q.dtype == torch.bfloat16 and kv_cache.dtype == torch.bfloat16 and q.shape[-1] == 576:
            q = torch.cat([q[..., :512], torch.zeros_like(q[..., 512:])], dim=-1)
        return super().decode(q, kv_cache, block_table, cache_seqlens, **kwargs)
