"""Broken ops: each is reference-op with one bug that a shipped MLA kernel or its glue has had, and each must be
*failed* (an AssertionError verdict, not an error) by the op test named for it in tests/meta/test_op_meta.py.

They reuse reference-op on purpose: the bug is the only difference, so the named check is what catches it.
"""

from __future__ import annotations

import math

import torch

from mla_conformance.impl.ops.reference import ReferenceOp


class Base2DeclaredE(ReferenceOp):
    """Returns its lse in base 2 (log2-sum-exp2, as FlashInfer does) but declares the default natural log
    (SGLang #40903: a base-2 LSE merged as natural log)."""

    name = "broken-lse-base2-as-e"
    lse_base = None  # the default, "e"

    def decode(self, *args, **kwargs):
        out, lse = super().decode(*args, **kwargs)
        return out, lse / math.log(2.0)


class NaturalDeclaredBase2(ReferenceOp):
    """Declares FlashInfer's lse_base = "2" but returns the natural log (an adapter that passes the kernel's
    declaration on and converts its lse to natural anyway): the converse of Base2DeclaredE."""

    name = "broken-lse-natural-as-2"
    lse_base = "2"


class NanForEmptyRows(ReferenceOp):
    """A query with no keys returns NaN (0/0 of an unguarded softmax) instead of out 0 and lse +inf."""

    name = "broken-nan-empty-rows"

    def decode(self, q, kv_cache, block_table, cache_seqlens, **kwargs):
        out, lse = super().decode(q, kv_cache, block_table, cache_seqlens, **kwargs)
        empty = torch.isinf(lse)                                   # [B, h, s_q]
        out = torch.where(empty.transpose(1, 2)[..., None], torch.full_like(out, math.nan), out)
        return out, torch.where(empty, torch.full_like(lse, math.nan), lse)


class ReadsPageTail(ReferenceOp):
    """Reads every key of a row's last page, up to the page boundary, past cache_seqlens (vLLM #37442: tiles
    read past seq_len; FlashInfer #941): the unfilled tail's contents leak in."""

    name = "broken-reads-page-tail"

    def decode(self, q, kv_cache, block_table, cache_seqlens, *, causal, **kwargs):
        page = kv_cache.shape[1]
        padded = (cache_seqlens + page - 1) // page * page
        return super().decode(q, kv_cache, block_table, padded.to(cache_seqlens.dtype), causal=causal, **kwargs)


class TopLeftCausal(ReferenceOp):
    """Causal multi-token decode aligned top-left: query i sees keys 0..i instead of the last s_q positions
    (vLLM #24045)."""

    name = "broken-top-left-causal"

    def decode(self, q, kv_cache, block_table, cache_seqlens, *, causal, indices=None, **kwargs):
        if not causal or indices is not None or q.shape[1] == 1:
            return super().decode(q, kv_cache, block_table, cache_seqlens, causal=causal, indices=indices, **kwargs)
        outs, lses = [], []
        for i in range(q.shape[1]):
            lens = torch.clamp(cache_seqlens, max=i + 1)
            o, l = super().decode(q[:, i:i + 1], kv_cache, block_table, lens, causal=False, **kwargs)
            outs.append(o)
            lses.append(l)
        return torch.cat(outs, 1), torch.cat(lses, 2)


class MinusOneIsLastToken(ReferenceOp):
    """Sparse index -1 read Python-style, as the last slot of the flattened cache, instead of ignored."""

    name = "broken-minus-one-last-token"

    def decode(self, q, kv_cache, block_table, cache_seqlens, *, indices=None, **kwargs):
        if indices is not None:
            n = kv_cache.shape[0] * kv_cache.shape[1]
            indices = torch.where(indices == -1, torch.full_like(indices, n - 1), indices)
        return super().decode(q, kv_cache, block_table, cache_seqlens, indices=indices, **kwargs)


class SinkIgnored(ReferenceOp):
    """Accepts attn_sink and ignores it."""

    name = "broken-attn-sink-ignored"

    def decode(self, *args, attn_sink=None, **kwargs):
        return super().decode(*args, **kwargs)


def _with_scales(kv_cache: torch.Tensor, fn) -> torch.Tensor:
    """A copy of a 656-byte FP8 cache with its float32 tile scales replaced by fn(scales)."""
    kv = kv_cache.clone()
    scales = kv[..., 512:528].contiguous().view(torch.float32)
    kv[..., 512:528] = fn(scales).contiguous().view(torch.uint8)
    return kv


class Fp8ExponentOnly(ReferenceOp):
    """Declares fp32 tile scales but reads only their power of two (a kernel built for ue8m0 scales,
    vLLM #49435): a scale of 0.75 is read as 0.5."""

    name = "broken-fp8-exponent-only"
    fp8_scale_format = "fp32"

    def decode(self, q, kv_cache, *args, **kwargs):
        if kv_cache.dtype == torch.uint8:
            kv_cache = _with_scales(kv_cache, lambda s: torch.where(s > 0, torch.exp2(torch.floor(torch.log2(s))), s))
        return super().decode(q, kv_cache, *args, **kwargs)


class Fp8ScalesAsBf16(ReferenceOp):
    """Reads the 16 scale bytes as bfloat16 values (the first 4 of 8) instead of 4 float32 (vLLM #54563)."""

    name = "broken-fp8-scales-as-bf16"

    def decode(self, q, kv_cache, *args, **kwargs):
        if kv_cache.dtype == torch.uint8:
            kv_cache = _with_scales(kv_cache, lambda s: s.view(torch.bfloat16)[..., :4].to(torch.float32))
        return super().decode(q, kv_cache, *args, **kwargs)


class RaisesOnDecode(ReferenceOp):
    """Crashes: an error, not a failure."""

    name = "broken-op-raises"

    def decode(self, *args, **kwargs):
        raise RuntimeError("kernel launch failed")


class WrongLseLayout(ReferenceOp):
    """Returns lse as [B, s_q, h_q]: a contract violation (an error), not a verdict."""

    name = "broken-op-lse-layout"

    def decode(self, *args, **kwargs):
        out, lse = super().decode(*args, **kwargs)
        return out, lse.transpose(1, 2).contiguous()


class WritesPastBlockTable(ReferenceOp):
    """Pads the block table in place with a -1 terminator one entry past its end (a buffer overrun the
    canary after every input buffer catches)."""

    name = "broken-writes-past-block-table"

    def decode(self, q, kv_cache, block_table, cache_seqlens, **kwargs):
        out = super().decode(q, kv_cache, block_table, cache_seqlens, **kwargs)
        flat = torch.as_strided(block_table, (block_table.numel() + 1,), (1,), block_table.storage_offset())
        flat[-1] = -1
        return out


class IgnoresQStrides(ReferenceOp):
    """Reads q's storage as if q were contiguous (a kernel handed q.data_ptr() without its strides)."""

    name = "broken-ignores-q-strides"

    def decode(self, q, *args, **kwargs):
        strides, acc = [], 1
        for n in reversed(q.shape):
            strides.insert(0, acc)
            acc *= n
        q = torch.as_strided(q, q.shape, strides, q.storage_offset())
        return super().decode(q, *args, **kwargs)


class NaiveSoftmax(ReferenceOp):
    """exp(score) without subtracting the running max, in float32: the sum overflows once lse passes
    log(3.4e38) = 88.72 and out becomes inf / inf = NaN (magnitudes large enough to expose it: SGLang #6101)."""

    name = "broken-naive-softmax"

    def decode(self, *args, **kwargs):
        out, lse = super().decode(*args, **kwargs)
        over = lse > math.log(torch.finfo(torch.float32).max)                # where float32 exp sums overflow
        out = torch.where(over.transpose(1, 2)[..., None], torch.full_like(out, math.nan), out)
        return out, torch.where(over, torch.full_like(lse, math.inf), lse)


class IgnoresTopkLength(ReferenceOp):
    """Accepts topk_length and uses every index of the row."""

    name = "broken-ignores-topk-length"

    def decode(self, *args, topk_length=None, **kwargs):
        return super().decode(*args, **kwargs)


class Nondeterministic(ReferenceOp):
    """Declares deterministic but alternates between two reduction precisions from call to call (as an
    atomics-based split-KV reduction changes its order): right within tolerance, not bitwise repeatable."""

    name = "broken-nondeterministic"

    def __init__(self):
        self.calls = 0

    def decode(self, q, kv_cache, *args, **kwargs):
        self.calls += 1
        if self.calls % 2 or q.dtype == torch.float64:
            return super().decode(q, kv_cache, *args, **kwargs)
        kv = kv_cache if kv_cache.dtype == torch.uint8 else kv_cache.double()
        out, lse = super().decode(q.double(), kv, *args, **kwargs)
        return out.to(q.dtype), lse


class BatchVariant(ReferenceOp):
    """Declares batch_invariant but takes another reduction path for a batch of one row (as kernels pick a
    split-KV plan from the batch size)."""

    name = "broken-batch-variant"

    def decode(self, q, kv_cache, *args, **kwargs):
        if q.shape[0] > 1 or q.dtype == torch.float64:
            return super().decode(q, kv_cache, *args, **kwargs)
        kv = kv_cache if kv_cache.dtype == torch.uint8 else kv_cache.double()
        out, lse = super().decode(q.double(), kv, *args, **kwargs)
        return out.to(q.dtype), lse


class HeadsCapped(ReferenceOp):
    """Launches at most 64 heads: the output of heads 64 and up is never written (zeros here; FlashInfer
    #3125: a grid too large leaves output unwritten with no exception)."""

    name = "broken-heads-capped-at-64"

    def decode(self, q, *args, **kwargs):
        out, lse = super().decode(q, *args, **kwargs)
        out[:, :, 64:] = 0
        lse[:, 64:] = 0
        return out, lse


class AssumesPage64(ReferenceOp):
    """Declares pages of 1, 16 and 64 tokens but finds position p at block_table[b, p // 64], offset p % 64,
    whatever the cache's page size."""

    name = "broken-assumes-page-64"

    def decode(self, q, kv_cache, block_table, cache_seqlens, *, causal, indices=None, **kwargs):
        page = kv_cache.shape[1]
        if indices is not None or causal or page == 64:
            return super().decode(q, kv_cache, block_table, cache_seqlens, causal=causal, indices=indices, **kwargs)
        B, s_q = q.shape[:2]
        T = int(cache_seqlens.max()) if B else 0
        pos = torch.arange(T, device=q.device)
        col = torch.clamp(pos // 64, max=block_table.shape[1] - 1)
        slots = block_table.long()[:, col] * page + pos % 64                       # [B, T]
        slots = torch.where(pos[None, :] < cache_seqlens.long()[:, None], slots, torch.full_like(slots, -1))
        idx = slots.clamp(-1, 2 ** 31 - 1).to(torch.int32)[:, None, :].expand(B, s_q, T).contiguous()
        return super().decode(q, kv_cache, block_table, cache_seqlens, causal=False, indices=idx, **kwargs)


class IgnoresExtraCache(ReferenceOp):
    """Declares the two-cache sparse decode but attends to the first cache's selection only (the second cache's
    keys dropped: a kernel that loops over one scope)."""

    name = "broken-ignores-extra-cache"

    def decode(self, *args, extra_k_cache=None, extra_indices=None, extra_topk_length=None, **kwargs):
        return super().decode(*args, **kwargs)


class IgnoresExtraTopkLength(ReferenceOp):
    """Reads every entry of the second cache's indices, extra_topk_length ignored."""

    name = "broken-ignores-extra-topk-length"

    def decode(self, *args, extra_topk_length=None, **kwargs):
        return super().decode(*args, **kwargs)
