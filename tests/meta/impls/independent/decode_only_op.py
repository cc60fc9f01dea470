"""A correct decode-only op: the README's MyOp ("Check your own kernel") restricted to one query per row, as most
decode kernels are (vLLM's CPU ``mla_decode_kvcache``, XQA-style kernels). Its ``decode`` is the README's, verbatim
(tests/meta/test_decode_only_meta.py holds it to that); ``unsupported_reason`` declines s_q > 1 with a sentence.
Narrower decode-only ops (every declaration, sparse FP8 only): tests/meta/impls/independent/narrow_ops.py.

It declares ``head_dims = "any"`` (the README's MyOp declares nothing, so 576 / 512 only): the README's decode
takes ``head_dim_v``, and the embedded tiny model (kv_lora 64 + rope 16) is what the layer suite's goldens run;
an op of only 576 / 512 never sees them.

torch and math only: nothing of mla_conformance.
"""

from __future__ import annotations

import math

import torch


class DecodeOnlyMyOp:
    name = "decode-only-my-op"
    head_dims = "any"

    def unsupported_reason(self, case):  # case: mla_conformance.contract.op.OpCase
        s_q = getattr(case, "s_q", 1)
        if s_q > 1:
            return f"{self.name} decodes one query per row (s_q 1), not s_q {s_q}"
        return None

    def decode(self, q, kv_cache, block_table, cache_seqlens, *, softmax_scale, causal,
               indices=None, topk_length=None, attn_sink=None, head_dim_v=512):
        """Dense decode over a paged latent cache (it declares no sparse_decode or attn_sink: never passed)."""
        B, s_q, h_q, _ = q.shape
        acc, page = torch.float64 if q.dtype == torch.float64 else torch.float32, kv_cache.shape[1]
        out = torch.zeros(B, s_q, h_q, head_dim_v, dtype=acc, device=q.device)
        lse = torch.empty(B, h_q, s_q, device=q.device)
        for b in range(B):
            pos = torch.arange(int(cache_seqlens[b]), device=q.device)
            keys = kv_cache[block_table[b, pos // page].long(), pos % page, 0].to(acc)  # [len, d_qk]: row b's keys
            logits = torch.einsum("shd,td->hst", q[b].to(acc), keys) * softmax_scale
            if causal:  # bottom-right aligned: query i attends keys < len - s_q + i + 1
                last = len(pos) - s_q + torch.arange(s_q, device=q.device)
                logits = logits.masked_fill(pos > last[:, None], -math.inf)
            out[b] = torch.einsum("hst,tv->shv", torch.softmax(logits, -1).nan_to_num(0.0), keys[:, :head_dim_v])
            lse[b] = torch.logsumexp(logits, -1).nan_to_num(neginf=math.inf)  # a query with no keys: out 0, lse +inf
        return out.to(q.dtype), lse

