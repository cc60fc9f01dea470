"""Ops written as engines' decode kernels handle padded CUDA-graph batches, from the op contract alone (torch and
math only: nothing of mla_conformance, its reference-op or its oracle). Correct: each must pass the op suite, with
skips naming only what it declines (tests/meta/test_op_meta.py):

* :class:`SplitByMaxLenOp`: split-KV as FlashDecoding / FlashInfer plan it: the number of splits from the batch's
  *max* length (one split per 256 keys, at most 8), every row's keys cut into chunks of that size, each chunk's
  partial (out, lse) in float32, merged by LSE -- an empty chunk (a short row's tail, a padding row's every chunk)
  weighs 0 and a row with no keys is out 0, lse +inf. Its result depends on the batch (the split does): not
  batch invariant;
* :class:`ZeroPaddingAfterOp`: one pass per row with an unguarded softmax (a row with no keys is 0/0 = NaN, as
  the kernel leaves it), then every row of cache_seqlens 0 set to out 0, lse +inf after the call -- vLLM's fix
  for FlashInfer #2883 / vLLM #37815. It zeroes zero-length rows and nothing else, so it declines a causal query
  before its row's first key (``case.queries_before_first_key``) and keeps zero-length rows: the two kinds of
  ``rows_without_keys`` declined apart;
* :class:`UndefinedPaddingOp`: the same kernel without the fix: it declares ``padding_rows = "undefined"`` (a
  padded batch's zero-length rows are NaN, not looked at) and declines a zero-length row anywhere else.
"""

from __future__ import annotations

import math

import torch

NOPE, ROW = 512, 576
#: keys per split of the batch's longest row, and the most splits
SPLIT_KEYS, MAX_SPLITS = 256, 8


def _keys(kv_cache, block_table, b: int, L: int) -> torch.Tensor:
    """Row b's first L keys [L, 576] (its pages only: a row of 0 keys reads no page)."""
    page = kv_cache.shape[1]
    pos = torch.arange(L)
    return kv_cache[block_table[b, pos // page].long(), pos % page, 0]


def _visible(L: int, s_q: int, causal: bool) -> torch.Tensor:
    """[s_q, L] bool: the keys each query attends (causal: bottom-right)."""
    limit = torch.tensor([L - s_q + i + 1 if causal else L for i in range(s_q)])
    return torch.arange(L)[None, :] < limit[:, None]


def _partial(q, keys, allowed, scale: float, guarded: bool):
    """q [s_q, h, 576], keys [n, 576], allowed [s_q, n]: (out [s_q, h, 512], natural lse [s_q, h], -inf for no keys).
    Unguarded: a query with no keys is 0/0 = NaN, as a kernel without the check leaves it."""
    acc = q.dtype
    s = torch.einsum("shd,nd->shn", q, keys.to(acc)) * scale
    s = torch.where(allowed[:, None, :], s, torch.full((), -math.inf, dtype=acc))
    m = s.amax(-1) if s.shape[-1] else torch.full(s.shape[:2], -math.inf, dtype=acc)
    safe = torch.where(torch.isinf(m), torch.zeros_like(m), m) if guarded else m
    p = torch.exp(s - safe[..., None])
    l = p.sum(-1)
    o = torch.einsum("shn,nd->shd", p, keys[:, :NOPE].to(acc))
    if guarded:
        empty = l == 0
        return (torch.where(empty[..., None], torch.zeros_like(o), o / torch.where(empty, 1, l)[..., None]),
                torch.where(empty, torch.full_like(l, -math.inf), safe + torch.log(torch.where(empty, 1, l))))
    return o / l[..., None], m + torch.log(l)


class _EngineOp:
    page_block_sizes = (1, 16, 64)
    deterministic = True

    def unsupported_reason(self, case):
        if case.sparse or case.attn_sink or case.kv_format != "latent":
            return "decodes dense over a latent cache, without a sink, only (an engine-style test op)"
        return None

    def decode(self, q, kv_cache, block_table, cache_seqlens, *, softmax_scale, causal, indices=None,
               topk_length=None, attn_sink=None):
        B, s_q, h, _ = q.shape
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        lens = [int(x) for x in cache_seqlens.tolist()]
        out = torch.empty(B, s_q, h, NOPE, dtype=acc)
        lse = torch.empty(B, h, s_q, dtype=torch.float32)
        plan = self.plan(lens)
        for b, L in enumerate(lens):
            o, l = self.row(q[b].to(acc), _keys(kv_cache, block_table, b, L), _visible(L, s_q, causal),
                            softmax_scale, plan)
            out[b] = o
            lse[b] = torch.where(torch.isneginf(l), torch.full_like(l, math.inf), l).T.to(torch.float32)
        return self.finish(out.to(q.dtype), lse, lens)

    def plan(self, lens):
        return None

    def finish(self, out, lse, lens):
        return out, lse


class SplitByMaxLenOp(_EngineOp):
    name = "split-by-max-len-op"

    def plan(self, lens):
        """The chunk size every row is split by: the batch's longest row over its number of splits."""
        longest = max(lens, default=0)
        splits = max(1, min(MAX_SPLITS, -(-longest // SPLIT_KEYS)))
        return max(1, -(-longest // splits))

    def row(self, q, keys, allowed, scale, chunk):
        n = keys.shape[0]
        parts = [_partial(q, keys[a:a + chunk], allowed[:, a:a + chunk], scale, guarded=True)
                 for a in range(0, max(n, 1), chunk)]
        lses = torch.stack([l for _, l in parts])                     # [splits, s_q, h]
        total = torch.logsumexp(lses, dim=0)                         # -inf when every chunk is empty
        safe = torch.where(torch.isinf(total), torch.zeros_like(total), total)
        w = torch.exp(lses - safe)                                   # an empty chunk weighs 0
        return sum(w[j][..., None] * parts[j][0] for j in range(len(parts))), total


class UndefinedPaddingOp(_EngineOp):
    name = "undefined-padding-op"
    padding_rows = "undefined"

    def unsupported_reason(self, case):
        if case.queries_before_first_key:
            return ("leaves a causal query before its row's first key undefined (0/0 of an unguarded softmax, "
                    "as the kernel leaves it)")
        if case.zero_length_rows and not case.padding_rows:
            return ("leaves a zero-length row undefined (0/0 of an unguarded softmax) outside a padded batch, "
                    "where it declares padding_rows = 'undefined'")
        return super().unsupported_reason(case)

    def row(self, q, keys, allowed, scale, plan):
        return _partial(q, keys, allowed, scale, guarded=False)


class ZeroPaddingAfterOp(UndefinedPaddingOp):
    name = "zero-padding-after-op"
    padding_rows = None  # the default, "defined": it zeroes them
    batch_invariant = True

    def unsupported_reason(self, case):
        if case.queries_before_first_key:
            return ("leaves a causal query before its row's first key undefined (it zeroes zero-length rows after "
                    "the call, as vLLM does, and nothing else)")
        return _EngineOp.unsupported_reason(self, case)

    def finish(self, out, lse, lens):
        empty = torch.tensor(lens) == 0                               # vLLM: zero the padded rows after the call
        out = torch.where(empty[:, None, None, None], torch.zeros((), dtype=out.dtype), out)
        return out, torch.where(empty[:, None, None], torch.full((), math.inf), lse)
