"""Broken ops modelled on the public reports of MLA kernels under engines' padded CUDA-graph batches and graph
replays; each is a correct op of tests/meta/impls/kernel_style/engine_ops.py (or reference-op) with the one bug, and each must be
*failed* by the test named for it in tests/meta/test_op_meta.py (BROKEN_OPS), the cause in the message (HINTS):

* :class:`NanPaddingAtLongMaxLen` -- FlashInfer #2883 / vLLM #37815: split-KV planned by the batch's max length;
  once the longest row makes it split, a zero-length row's partials are 0/0 and merge to NaN;
* :class:`ReadsBlockTableMinusOne` -- vLLM #35969: for seq_lens 0 the kernel's last block is n_block = -1 and it
  reads ``block_table[b, -1]``'s page anyway (its weights are 0, but 0 x NaN of a poisoned page is NaN);
* :class:`MetadataSizedToRealRows` -- xLLM #1939: the per-row work list is built for the real rows (length > 0)
  and the kernel's row b reads entry b of it, clamped past its end: a padding row gets a real row's work;
* :class:`ZeroesTrailingRowsOnly` -- vLLM's fix done as ``out[num_real:] = 0``: right when padding trails the
  batch, NaN left in padding rows between real rows;
* :class:`UndefinedPaddingLeaks` -- declares ``padding_rows = "undefined"`` but an empty row writes its NaN partial
  into the split-KV workspace slot of the next row, which it was allotted none of: NaN in a real row;
* :class:`SparseReadsAtTopkLengthZero` -- a sparse loop over topk_length that runs once for 0 (loosely
  FlashInfer #5015): a sparse padding row reads slot -1;
* :class:`StalePlanOnDataPtr` -- a plan (lengths, block table, indices) cached on the tensors' ``data_ptr`` and
  reused when the graph's tensors are refilled for the next replay.
"""

from __future__ import annotations

import math

import torch

from mla_conformance.impl.ops.reference import ReferenceOp

from tests.meta.impls.kernel_style.engine_ops import (NOPE, SPLIT_KEYS, SplitByMaxLenOp, UndefinedPaddingOp, _keys,
                                                       _partial, _visible)


class NanPaddingAtLongMaxLen(SplitByMaxLenOp):
    name = "broken-nan-padding-at-long-max-len"

    def plan(self, lens):
        self.splits = max(lens, default=0) > SPLIT_KEYS   # the batch's max length makes it split
        return super().plan(lens)

    def row(self, q, keys, allowed, scale, chunk):
        if keys.shape[0] or not self.splits:   # one split: the kernel's unsplit path guards an empty row
            return super().row(q, keys, allowed, scale, chunk)
        parts = [_partial(q, keys[:0], allowed[:, :0], scale, guarded=False) for _ in range(2)]
        lses = torch.stack([l for _, l in parts])                     # -inf, -inf
        total = torch.logsumexp(lses, dim=0)
        w = torch.exp(lses - total)                                   # exp(-inf - -inf) = NaN
        return sum(w[j][..., None] * parts[j][0] for j in range(2)), total


class ReadsBlockTableMinusOne(SplitByMaxLenOp):
    name = "broken-reads-block-table-minus-one"

    def decode(self, q, kv_cache, block_table, cache_seqlens, **kwargs):
        out, lse = super().decode(q, kv_cache, block_table, cache_seqlens, **kwargs)
        page = kv_cache.shape[1]
        for b, L in enumerate(cache_seqlens.tolist()):
            if L == 0:  # n_block = ceil(0 / page) - 1 = -1: block_table[b, -1] read, its keys weighed 0
                keys = kv_cache[int(block_table[b, -1])][:, 0].to(out.dtype)
                out[b] = out[b] + torch.zeros(keys.shape[0], dtype=out.dtype) @ keys[:, :NOPE]
        return out, lse


class MetadataSizedToRealRows(SplitByMaxLenOp):
    name = "broken-metadata-sized-to-real-rows"

    def decode(self, q, kv_cache, block_table, cache_seqlens, *, softmax_scale, causal, **kwargs):
        B, s_q = q.shape[:2]
        lens = [int(x) for x in cache_seqlens.tolist()]
        work = [b for b, L in enumerate(lens) if L > 0]               # the real rows' work list
        out = torch.zeros(B, s_q, q.shape[2], NOPE)
        lse = torch.full((B, q.shape[2], s_q), math.inf)
        chunk = self.plan(lens)
        for b in range(B):
            if not work:
                break
            src = work[min(b, len(work) - 1)]                         # entry b, clamped past the list's end
            o, l = self.row(q[src].float(), _keys(kv_cache, block_table, src, lens[src]),
                            _visible(lens[src], s_q, causal), softmax_scale, chunk)
            out[b], lse[b] = o, l.T
        return out.to(q.dtype), lse


class ZeroesTrailingRowsOnly(UndefinedPaddingOp):
    name = "broken-zeroes-trailing-rows-only"
    padding_rows = None  # declares them defined

    def finish(self, out, lse, lens):
        n = sum(1 for L in lens if L > 0)                           # assumes the padding rows trail the batch
        out, lse = out.clone(), lse.clone()
        out[n:], lse[n:] = 0, math.inf
        return out, lse


class UndefinedPaddingLeaks(UndefinedPaddingOp):
    name = "broken-undefined-padding-leaks"

    def decode(self, q, kv_cache, block_table, cache_seqlens, *, softmax_scale, causal, **kwargs):
        B, s_q, h = q.shape[:3]
        lens = [int(x) for x in cache_seqlens.tolist()]
        chunk = SplitByMaxLenOp.plan(self, lens)
        counts = [-(-L // chunk) for L in lens]                      # chunks per row: 0 for an empty row
        start = [sum(counts[:b]) for b in range(B)]
        ws_out = torch.zeros(sum(counts) + 1, s_q, h, NOPE)
        ws_lse = torch.full((sum(counts) + 1, s_q, h), -math.inf)
        for b, L in enumerate(lens):
            keys, allowed = _keys(kv_cache, block_table, b, L), _visible(L, s_q, causal)
            # an empty row still runs one chunk, its "last" slot start + count - 1: the previous row's last one
            slots = [start[b] + j for j in range(counts[b])] or [start[b] - 1]
            for j, slot in enumerate(slots):
                a = j * chunk
                o, l = _partial(q[b].float(), keys[a:a + chunk], allowed[:, a:a + chunk], softmax_scale, False)
                ws_out[slot], ws_lse[slot] = o, l
        out = torch.empty(B, s_q, h, NOPE)
        lse = torch.empty(B, h, s_q)
        for b in range(B):
            lses = ws_lse[start[b]:start[b] + counts[b]]
            total = torch.logsumexp(lses, dim=0) if counts[b] else torch.full((s_q, h), -math.inf)
            w = torch.exp(lses - total)
            out[b] = (w[..., None] * ws_out[start[b]:start[b] + counts[b]]).sum(0) / (w.sum(0)[..., None] if
                                                                                      counts[b] else 0)
            lse[b] = torch.where(torch.isneginf(total), torch.full_like(total, math.inf), total).T
        return out.to(q.dtype), lse


class SparseReadsAtTopkLengthZero(ReferenceOp):
    """Sparse decode whose loop over a row's topk_length runs once before testing it (a do-while), the first
    index unchecked: a padding row (topk_length 0, every index -1) reads flattened slot -1 (loosely FlashInfer
    #5015: sparse MLA hangs on a padded batch, a loop over topk_length that mishandles 0)."""

    name = "broken-sparse-reads-at-topk-length-0"

    def decode(self, q, kv_cache, block_table, cache_seqlens, *, indices=None, topk_length=None, **kwargs):
        if indices is not None and topk_length is not None and bool((topk_length == 0).any()):
            zero = topk_length == 0
            indices = indices.clone()
            first = indices[:, :, 0]
            first[zero] = torch.where(first[zero] < 0, kv_cache.shape[0] * kv_cache.shape[1] - 1, first[zero])
            topk_length = torch.where(zero, torch.ones_like(topk_length), topk_length)
        return super().decode(q, kv_cache, block_table, cache_seqlens, indices=indices, topk_length=topk_length,
                              **kwargs)


class StalePlanOnDataPtr(ReferenceOp):
    """reference-op with a plan -- the lengths, block table and sparse indices it was built from -- cached on the
    tensors' data_ptr (the tensors kept alive with it, so no other tensor gets their address)."""

    name = "broken-stale-plan-on-data-ptr"

    def __init__(self):
        self.plans = {}

    def decode(self, q, kv_cache, block_table, cache_seqlens, *, indices=None, topk_length=None, **kwargs):
        tensors = (block_table, cache_seqlens, indices, topk_length)
        key = tuple(None if t is None else (t.data_ptr(), tuple(t.shape)) for t in tensors)
        if key not in self.plans:
            self.plans[key] = (tensors, tuple(None if t is None else t.clone() for t in tensors))
        block_table, cache_seqlens, indices, topk_length = self.plans[key][1]
        return super().decode(q, kv_cache, block_table, cache_seqlens, indices=indices, topk_length=topk_length,
                              **kwargs)


__all__ = ["NanPaddingAtLongMaxLen", "ReadsBlockTableMinusOne", "MetadataSizedToRealRows", "ZeroesTrailingRowsOnly",
           "UndefinedPaddingLeaks", "SparseReadsAtTopkLengthZero", "StalePlanOnDataPtr"]
