"""FROZEN: an op written once to the base op contract exactly as README.md shows it ("Check your own kernel"):
a ``name``, ``unsupported_reason`` and ``decode``, no optional declaration. Never edit this file when the op
contract gains a feature: tests/meta/test_op_meta.py asserts it passes the whole op suite with explicit
skips, each naming the declaration that would opt it in. A new optional part that this op fails is a
part the suite assumed instead of asking for (opt-in, never opt-out).

torch and math only: nothing of mla_conformance.
"""

from __future__ import annotations

import math

import torch


class FrozenBaseOp:
    name = "frozen-base-op"

    def unsupported_reason(self, case):
        return None

    def decode(self, q, kv_cache, block_table, cache_seqlens, *, softmax_scale, causal,
               indices=None, topk_length=None, attn_sink=None):
        if indices is not None or topk_length is not None or attn_sink is not None:
            raise NotImplementedError("frozen-base-op implements dense decode only")
        B, s_q, h_q, _ = q.shape
        page = kv_cache.shape[1]
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        out = torch.zeros(B, s_q, h_q, 512, dtype=acc)
        lse = torch.full((B, h_q, s_q), math.inf, dtype=torch.float32)   # +inf: a query with no keys
        for b in range(B):
            length = int(cache_seqlens[b])
            pos = torch.arange(length)
            blocks = block_table[b].long()[pos // page]
            keys = kv_cache[blocks, pos % page, 0].to(acc)                   # [L, 576]: written slots only
            for i in range(s_q):
                visible = length - s_q + i + 1 if causal else length       # causal: bottom-right
                if visible <= 0:
                    continue
                k = keys[:visible]
                logits = (q[b, i].to(acc) @ k.T) * softmax_scale           # [h_q, visible]
                out[b, i] = torch.softmax(logits, dim=-1) @ k[:, :512]
                lse[b, :, i] = torch.logsumexp(logits, dim=-1).to(torch.float32)
        return out.to(q.dtype), lse
