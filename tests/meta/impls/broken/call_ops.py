"""Broken ops called as engines call them (issue 26): each is reference-op (which declares ``out_buffers``) with one
bug modelled on a public report, and each must be *failed* (an AssertionError verdict naming the cause, not an
error) by the op test named for it in tests/meta/test_op_meta.py (BROKEN_OPS, HINTS):

* preallocated outputs (suites/test_op_out_buffers.py): an out rejected at q_len > 1, an out half-written at
  q_len > 1 (FlashInfer #2856 / #2876), new tensors returned instead of the buffers, the buffers' strides ignored;
* speculative verification (suites/test_op_speculative.py, test_op_paging.py): one output for every query position
  when q_len is not a power of two (ROCm aiter #2720), a causal multi-token batch flattened to B x q_len query rows
  against B block-table rows (vLLM #51848 / #51065), NaN at q_len 2 (FlashMLA-ETAP).
"""

from __future__ import annotations

import math

import torch

from mla_conformance.impl.ops.reference import ReferenceOp


class RejectsOutAtMultiToken(ReferenceOp):
    """Checks a preallocated out against one query per row, [B, h_q, 512], so a legal [B, q_len, h_q, 512] out is
    rejected at q_len > 1 (FlashInfer #2856 / #2876)."""

    name = "broken-rejects-out-multi-token"

    def decode(self, q, *args, out=None, lse=None, **kwargs):
        B, s_q, h_q = q.shape[:3]
        if out is not None and s_q > 1:
            raise ValueError(f"out must be of shape {(B, h_q, 512)}, got {tuple(out.shape)}")
        return super().decode(q, *args, out=out, lse=lse, **kwargs)


class HalfWrittenOut(ReferenceOp):
    """Writes query position 0 of each row into a preallocated out and leaves the rest as it was (a kernel whose
    store indexes the out as if q_len were 1; FlashInfer #2856 / #2876's multi-token out)."""

    name = "broken-half-written-out"

    def decode(self, *args, out=None, lse=None, **kwargs):
        res_out, res_lse = super().decode(*args, **kwargs)
        if out is None:
            return res_out, res_lse
        out[:, :1].copy_(res_out[:, :1])
        if lse is not None:
            lse.copy_(res_lse)
        return out, (res_lse if lse is None else lse)


class NewTensorOut(ReferenceOp):
    """Declares out_buffers, takes out= / lse= and returns new tensors, the buffers never written."""

    name = "broken-new-tensor-out"

    def decode(self, *args, out=None, lse=None, **kwargs):
        return super().decode(*args, **kwargs)


class IgnoresOutStrides(ReferenceOp):
    """Writes out and lse through their data pointers as if they were contiguous (strides ignored): a strided
    buffer's gaps are written and its last elements are not."""

    name = "broken-ignores-out-strides"

    def decode(self, *args, out=None, lse=None, **kwargs):
        res = super().decode(*args, **kwargs)
        if out is None:
            return res
        for buf, value in zip((out, lse), res):
            if buf is not None:
                torch.as_strided(buf, buf.shape, value.contiguous().stride(), buf.storage_offset()).copy_(value)
        return out, (res[1] if lse is None else lse)


class SameOutputAllPositions(ReferenceOp):
    """Gives every query position of a row query position 0's output and lse when q_len is not a power of two
    (ROCm aiter #2720)."""

    name = "broken-same-output-all-positions"

    def decode(self, q, *args, out=None, lse=None, **kwargs):
        s_q = q.shape[1]
        res_out, res_lse = super().decode(q, *args, **kwargs)
        if s_q & (s_q - 1):
            res_out = res_out[:, :1].expand_as(res_out).contiguous()
            res_lse = res_lse[:, :, :1].expand_as(res_lse).contiguous()
        return tuple(r if buf is None else buf.copy_(r) for r, buf in zip((res_out, res_lse), (out, lse)))


class ReadsRowsPastBatch(ReferenceOp):
    """Causal multi-token decode flattened to B x q_len query rows, each read as its own sequence through
    block_table[r] and cache_seqlens[r], while the tables keep B rows (vLLM #51848 / #51065: Triton MLA expands the
    tables only on the non-causal path): rows past B are read, and the first B x q_len rows are the wrong ones."""

    name = "broken-reads-rows-past-batch"

    def decode(self, q, kv_cache, block_table, cache_seqlens, *, causal, indices=None, out=None, lse=None, **kwargs):
        B, s_q, h_q, d = q.shape
        if not causal or s_q == 1 or indices is not None:
            return super().decode(q, kv_cache, block_table, cache_seqlens, causal=causal, indices=indices, out=out,
                                  lse=lse, **kwargs)
        rows = B * s_q
        table = torch.as_strided(block_table, (rows, block_table.shape[1]), block_table.stride(),
                                 block_table.storage_offset())
        lens = torch.as_strided(cache_seqlens, (rows,), cache_seqlens.stride(), cache_seqlens.storage_offset())
        o, l = super().decode(q.reshape(rows, 1, h_q, d), kv_cache, table, lens, causal=False, **kwargs)
        res = o.view(B, s_q, h_q, -1), l.view(B, s_q, h_q).transpose(1, 2).contiguous()
        return tuple(r if buf is None else buf.copy_(r) for r, buf in zip(res, (out, lse)))


class NanAtQLen2(ReferenceOp):
    """NaN in the second query position of every row at q_len 2 (FlashMLA-ETAP: a tile of two query rows that
    reads an uninitialised row of its softmax state)."""

    name = "broken-nan-at-q-len-2"

    def decode(self, q, *args, out=None, lse=None, **kwargs):
        res_out, res_lse = super().decode(q, *args, **kwargs)
        if q.shape[1] == 2:
            res_out[:, 1] = math.nan
            res_lse[:, :, 1] = math.nan
        return tuple(r if buf is None else buf.copy_(r) for r, buf in zip((res_out, res_lse), (out, lse)))
