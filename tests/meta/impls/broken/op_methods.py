"""Broken implementations of the op contract's optional methods: each is reference-op with one bug a shipped
prefill, merge, sparse-prefill or cache-write kernel (or its glue) has had, and each must be *failed* (an
AssertionError verdict, not an error) by the method test named for it in tests/meta/test_op_methods_meta.py.
They reuse reference-op on purpose: the bug is the only difference, so the named check is what catches it.
"""

from __future__ import annotations

import math

import torch

from mla_conformance.impl.ops.reference import ReferenceOp
from mla_conformance.kv import model1
from mla_conformance.kv.codecs import encode_flashmla_fp8


# --------------------------------------------------------------------------- prefill


class TopLeftCausalPrefill(ReferenceOp):
    """Causal prefill aligned top-left: query i of a row sees keys 0..i, not the row's last m positions (the
    bug class of vLLM #24045 in prefill: invisible when q_len == kv_len)."""

    name = "broken-prefill-top-left"

    def prefill(self, q, k, v, cu_seqlens_q, cu_seqlens_k, *, softmax_scale, causal):
        if not causal:
            return super().prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale=softmax_scale, causal=False)
        outs, lses = [], []
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        for b in range(len(cq) - 1):
            for i in range(cq[b + 1] - cq[b]):
                n = min(i + 1, ck[b + 1] - ck[b])
                o, l = super().prefill(q[cq[b] + i:cq[b] + i + 1], k[ck[b]:ck[b] + n], v[ck[b]:ck[b] + n],
                                       torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0, n], dtype=torch.int32),
                                       softmax_scale=softmax_scale, causal=False)
                outs.append(o)
                lses.append(l)
        return torch.cat(outs), torch.cat(lses)


class NanForEmptyPrefill(ReferenceOp):
    """A query with no keys (kv_len = 0, a causal query before its row's first key) gets NaN: an unguarded
    softmax's 0 / 0 (SGLang #22291: context chunks with kv_len = 0 rows)."""

    name = "broken-prefill-nan-empty"

    def prefill(self, *args, **kwargs):
        out, lse = super().prefill(*args, **kwargs)
        empty = torch.isinf(lse)
        return torch.where(empty[..., None], math.nan, out), torch.where(empty, math.nan, lse)


class NaturalLseDeclaredBase2Prefill(ReferenceOp):
    """Declares prefill_lse_base = "2" (FlashInfer's ragged prefill) but returns the natural log."""

    name = "broken-prefill-natural-as-2"
    prefill_lse_base = "2"


class NoLseNanForEmptyPrefill(NanForEmptyPrefill):
    """Declares prefill_returns_lse = False (vLLM's context_attention_fwd) and leaves a query with no keys NaN:
    without an lse, every out check still runs."""

    name = "broken-prefill-no-lse-nan-empty"
    prefill_returns_lse = False

    def prefill(self, *args, **kwargs):
        return super().prefill(*args, **kwargs)[0], None


class PaddingRowWritesStart(ReferenceOp):
    """One program per sequence, each writing at least its first query: a zero-length padding sequence writes its
    empty result (out 0, lse +inf) at its start offset -- the next sequence's first query, or past the end, which
    the kernel clamps to the batch's last query."""

    name = "broken-prefill-padding-row-writes"

    def prefill(self, q, k, v, cu_seqlens_q, cu_seqlens_k, *, softmax_scale, causal):
        out, lse = super().prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale=softmax_scale, causal=causal)
        cq = cu_seqlens_q.tolist()
        for b in range(len(cq) - 1):
            if cq[b + 1] == cq[b] and q.shape[0]:
                t = min(cq[b], q.shape[0] - 1)
                out[t], lse[t] = 0, math.inf
        return out, lse


class AlwaysCausalPrefill(ReferenceOp):
    """Applies the causal mask whatever ``causal`` says (a kernel instantiated for causal only): the context
    chunks of chunked prefill lose their later keys."""

    name = "broken-prefill-always-causal"

    def prefill(self, *args, causal, **kwargs):
        return super().prefill(*args, causal=True, **kwargs)


class KvHeadModuloPrefill(ReferenceOp):
    """Maps query head h to kv head h % h_k instead of h // (h_q / h_k) (the grouping transposed): right for
    h_k = 1 and h_k = h_q only."""

    name = "broken-prefill-kv-head-modulo"

    def prefill(self, q, k, v, *args, **kwargs):
        h_q, h_k = q.shape[1], k.shape[1]
        if h_k in (1, h_q):
            return super().prefill(q, k, v, *args, **kwargs)
        idx = torch.arange(h_q) % h_k
        return super().prefill(q, k[:, idx], v[:, idx], *args, **kwargs)


class IgnoresStridesPrefill(ReferenceOp):
    """Reads k and v's storage as if they were contiguous (a kernel handed data_ptr() without strides)."""

    name = "broken-prefill-ignores-strides"

    def prefill(self, q, k, v, *args, **kwargs):
        def contiguous_reading(x):
            strides, acc = [], 1
            for n in reversed(x.shape):
                strides.insert(0, acc)
                acc *= n
            return torch.as_strided(x, x.shape, strides, x.storage_offset())
        return super().prefill(q, contiguous_reading(k), contiguous_reading(v), *args, **kwargs)


class V3DimsOnlyPrefill(ReferenceOp):
    """Declares any head dims but computes scores over the first 192 channels of q and k only (hard-coded
    DeepSeek-V3 dims: 128 nope + 64 rope)."""

    name = "broken-prefill-v3-dims-only"

    def prefill(self, q, k, v, *args, **kwargs):
        return super().prefill(q[..., :192], k[..., :192], v, *args, **kwargs)


# --------------------------------------------------------------------------- sparse prefill


class SparseLseBase2DeclaredE(ReferenceOp):
    """Returns the sparse prefill's lse in base 2 (the kernel's internal log2-sum-exp2) but declares the
    default natural log."""

    name = "broken-sparse-lse-base2"

    def sparse_prefill(self, *args, **kwargs):
        out, mx, lse = super().sparse_prefill(*args, **kwargs)
        return out, mx, lse / math.log(2.0)


class SparseMinusOneIsLastToken(ReferenceOp):
    """Reads index -1 Python-style, as the last key (kv[s_kv - 1]), instead of ignoring it."""

    name = "broken-sparse-minus-one-last"

    def sparse_prefill(self, q, kv, indices, **kwargs):
        indices = torch.where(indices == -1, torch.full_like(indices, kv.shape[0] - 1), indices)
        return super().sparse_prefill(q, kv, indices, **kwargs)


class SparseEmptyRowMinusInf(ReferenceOp):
    """A row with no valid index returns lse -inf (FA3's convention) instead of FlashMLA's +inf."""

    name = "broken-sparse-empty-minus-inf"

    def sparse_prefill(self, *args, **kwargs):
        out, mx, lse = super().sparse_prefill(*args, **kwargs)
        return out, mx, torch.where(torch.isposinf(lse), -math.inf, lse)


class SparseIgnoresTopkLength(ReferenceOp):
    """Accepts topk_length and uses every entry of the row."""

    name = "broken-sparse-ignores-topk-length"

    def sparse_prefill(self, *args, topk_length=None, **kwargs):
        return super().sparse_prefill(*args, **kwargs)


class SparseSinkIntoLse(ReferenceOp):
    """Folds the attention sink into the returned lse (logaddexp(lse, sink)): out is right, lse is not the
    log-sum-exp over the keys any more."""

    name = "broken-sparse-sink-into-lse"

    def sparse_prefill(self, *args, attn_sink=None, **kwargs):
        out, mx, lse = super().sparse_prefill(*args, attn_sink=attn_sink, **kwargs)
        if attn_sink is not None:
            lse = torch.where(torch.isposinf(lse), lse, torch.logaddexp(lse, attn_sink.to(lse.dtype)[None, :]))
        return out, mx, lse


# --------------------------------------------------------------------------- merge


class MergeBothEmptyNaN(ReferenceOp):
    """Both sides empty: out = (0 x 0 + 0 x 0) / (0 + 0) = NaN (vLLM PR #28181, #39148)."""

    name = "broken-merge-both-empty-nan"

    def merge(self, out_a, lse_a, out_b, lse_b):
        out, lse = super().merge(out_a, lse_a, out_b, lse_b)
        both = torch.isinf(lse_a) & torch.isinf(lse_b)
        return torch.where(both[..., None], math.nan, out), torch.where(both, math.nan, lse)


class MergePlusInfAsValue(ReferenceOp):
    """Treats only -inf as an empty side (FlashInfer's merge_state) and does not declare merge_empty_input =
    "-inf": an lse of +inf (FA2's empty marker) is taken as a value, max = +inf, weights exp(inf - inf) = NaN."""

    name = "broken-merge-plus-inf-as-value"

    def merge(self, out_a, lse_a, out_b, lse_b):
        la, lb = lse_a.float(), lse_b.float()
        m = torch.maximum(la, lb)
        m0 = torch.where(torch.isneginf(m), 0.0, m)
        wa, wb = torch.exp(la - m0), torch.exp(lb - m0)
        out = (out_a.float() * wa[..., None] + out_b.float() * wb[..., None]) / (wa + wb)[..., None]
        return out.to(out_a.dtype), m0 + torch.log(wa + wb)


class MergeBase2AsE(ReferenceOp):
    """Declares merge_lse_base = "2" (it is handed FlashInfer's base-2 lse) but weighs the sides by exp(lse), as
    if natural (SGLang #40903: ~12% error)."""

    name = "broken-merge-base2-as-e"
    merge_lse_base = "2"

    def merge(self, out_a, lse_a, out_b, lse_b):
        return super().merge(out_a, lse_a, out_b, lse_b)   # natural-log arithmetic on base-2 values


class MergeIgnoresLseStrides(ReferenceOp):
    """Reads lse_a's storage as a contiguous [T, h] tensor (vLLM keeps lse as [h, T]: a stride mismatch)."""

    name = "broken-merge-ignores-lse-strides"

    def merge(self, out_a, lse_a, out_b, lse_b):
        lse_a = torch.as_strided(lse_a, lse_a.shape, (lse_a.shape[1], 1), lse_a.storage_offset())
        return super().merge(out_a, lse_a, out_b, lse_b)


# --------------------------------------------------------------------------- write


class WholePageWriter(ReferenceOp):
    """Rewrites every slot of each page it writes into: the slots of the page it was not given are zeroed (a
    writer that stages whole pages)."""

    name = "broken-write-whole-page"

    def write(self, kv_c, k_pe, kv_cache, slot_mapping, *, kv_format):
        page = kv_cache.shape[1]
        if kv_format != "fp8-e4m3-model1":
            blocks = torch.unique(slot_mapping[slot_mapping >= 0] // page)
            kv_cache[blocks] = 0
        super().write(kv_c, k_pe, kv_cache, slot_mapping, kv_format=kv_format)


class MinusOneToSlotZero(ReferenceOp):
    """Writes padding tokens (slot_mapping -1) to slot 0 (the slot clamped to 0 instead of skipped)."""

    name = "broken-write-minus-one-slot-zero"

    def write(self, kv_c, k_pe, kv_cache, slot_mapping, *, kv_format):
        super().write(kv_c, k_pe, kv_cache, slot_mapping.clamp_min(0), kv_format=kv_format)


class MinusOneToLastSlot(ReferenceOp):
    """Writes padding tokens (slot_mapping -1) to the cache's last slot: the slot used as a Python index, where -1
    is the last element (a writer that indexes the flat cache with slot_mapping as given)."""

    name = "broken-write-minus-one-last-slot"

    def write(self, kv_c, k_pe, kv_cache, slot_mapping, *, kv_format):
        slots = kv_cache.shape[0] * kv_cache.shape[1]
        super().write(kv_c, k_pe, kv_cache, torch.where(slot_mapping < 0, slot_mapping + slots, slot_mapping),
                      kv_format=kv_format)


class DummyPageWriter(ReferenceOp):
    """Declares write_padding_slot = "dummy-slot-0" but gives each padding token its own slot of the first page (a
    dummy *page* reserved): slots 1, 2, ... of block 0 change, which no token owns."""

    name = "broken-write-dummy-page"
    write_padding_slot = "dummy-slot-0"

    def write(self, kv_c, k_pe, kv_cache, slot_mapping, *, kv_format):
        pad = slot_mapping == 0
        slots = slot_mapping.clone()
        slots[pad] = torch.arange(int(pad.sum()), device=slots.device) % kv_cache.shape[1]
        super().write(kv_c, k_pe, kv_cache, slots, kv_format=kv_format)


class NoScaleFloorWriter(ReferenceOp):
    """FP8 656-byte rows without the 1e-4 floor on amax / 448: an all-zero tile gets scale 0 and e4m3 of 0 / 0."""

    name = "broken-write-no-scale-floor"

    def write(self, kv_c, k_pe, kv_cache, slot_mapping, *, kv_format):
        super().write(kv_c, k_pe, kv_cache, slot_mapping, kv_format=kv_format)
        if kv_format == "fp8-e4m3-flashmla":
            keep = slot_mapping >= 0
            slots = slot_mapping[keep]
            page = kv_cache.shape[1]
            rows = kv_cache[slots // page, slots % page, 0]
            tiles = kv_c[keep].float().unflatten(-1, (4, 128))
            zero = tiles.abs().amax(-1) == 0
            scales = rows[:, 512:528].contiguous().view(torch.float32)
            scales = torch.where(zero, 0.0, scales)
            payload = rows[:, :512].contiguous().view(torch.float8_e4m3fn).float().unflatten(-1, (4, 128))
            payload = torch.where(zero[..., None], math.nan, payload).flatten(-2).to(torch.float8_e4m3fn)
            rows[:, :512] = payload.view(torch.uint8)
            rows[:, 512:528] = scales.contiguous().view(torch.uint8)
            kv_cache[slots // page, slots % page, 0] = rows


class WrongScaleConventionWriter(ReferenceOp):
    """Declares the default power-of-two scales (write_fp8_scale_format "pow2") but writes amax / 448 as is
    (vLLM PR #49435 vs #54563: writer and reader disagree on the scale convention)."""

    name = "broken-write-scale-convention"
    write_fp8_scale_format = None

    def write(self, kv_c, k_pe, kv_cache, slot_mapping, *, kv_format):
        if kv_format != "fp8-e4m3-flashmla":
            return super().write(kv_c, k_pe, kv_cache, slot_mapping, kv_format=kv_format)
        keep = slot_mapping >= 0
        slots, page = slot_mapping[keep], kv_cache.shape[1]
        kv_cache[slots // page, slots % page, 0] = encode_flashmla_fp8(kv_c[keep], k_pe[keep], "fp32")


class KpeScaledWriter(ReferenceOp):
    """Divides k_pe by the latent's first FP8 tile scale before storing it (k_scale applied to k_pe: vLLM PR
    #42956)."""

    name = "broken-write-kpe-scaled"

    def write(self, kv_c, k_pe, kv_cache, slot_mapping, *, kv_format):
        if kv_format == "fp8-e4m3-flashmla":
            s = torch.pow(2.0, torch.log2(torch.clamp_min(kv_c[:, :128].float().abs().amax(-1) / 448, 1e-4)).ceil())
            k_pe = (k_pe.float() / s[:, None]).to(k_pe.dtype)
        super().write(kv_c, k_pe, kv_cache, slot_mapping, kv_format=kv_format)


class Model1PerTokenRows(ReferenceOp):
    """Writes MODEL1 tokens as 584-byte rows, one per token at offset * 584 (the [num_blocks, page, 1, 584] view
    read as per-token rows), not FlashMLA's block layout (the 576-byte parts, then the 8-byte scale groups)."""

    name = "broken-write-model1-per-token"

    def write(self, kv_c, k_pe, kv_cache, slot_mapping, *, kv_format):
        if kv_format != "fp8-e4m3-model1":
            return super().write(kv_c, k_pe, kv_cache, slot_mapping, kv_format=kv_format)
        keep = slot_mapping >= 0
        slots = slot_mapping[keep]
        payload, scales = model1.encode(kv_c[keep], k_pe[keep])
        page = kv_cache.shape[1]
        row = torch.cat([payload, scales, torch.zeros(len(slots), 1, dtype=torch.uint8)], dim=-1)
        kv_cache[slots // page, slots % page, 0] = row


class _Fp32Writer(ReferenceOp):
    """FlashMLA's 656-byte rows under declared fp32 scales, from ``rows(x, scale)``: (e4m3 payload values, stored
    scales) of kv_c's tiles x [T, 4, 128] float32 and amax / 448 (no floor)."""

    write_fp8_scale_format = "fp32"

    def write(self, kv_c, k_pe, kv_cache, slot_mapping, *, kv_format):
        if kv_format != "fp8-e4m3-flashmla":
            return super().write(kv_c, k_pe, kv_cache, slot_mapping, kv_format=kv_format)
        keep = slot_mapping >= 0
        slots, page = slot_mapping[keep], kv_cache.shape[1]
        x = kv_c[keep].float().unflatten(-1, (4, 128))
        payload, scale = self.rows(x, x.abs().amax(-1) / 448.0)
        kv_cache[slots // page, slots % page, 0] = torch.cat(
            [payload.flatten(-2).to(torch.float8_e4m3fn).view(torch.uint8), scale.float().contiguous().view(torch.uint8),
             k_pe[keep].to(torch.bfloat16).contiguous().view(torch.uint8)], dim=-1)


class ZeroTileTimesInfWriter(_Fp32Writer):
    """No floor and value x (1 / scale): an all-zero tile gets scale 0 and payload 0 x inf = NaN, which a reader
    decodes to NaN."""

    name = "broken-write-zero-tile-nan"

    def rows(self, x, scale):
        return x * (1.0 / scale)[..., None], scale


class Amax240Writer(_Fp32Writer):
    """Scale amax / 240 (e4m3fnuz's largest value, AMD's FP8) into e4m3fn bytes: values decode, but at 1.87 x the
    scale the contract's readers are tested with, their low bits lost."""

    name = "broken-write-amax-240"

    def rows(self, x, scale):
        s = torch.clamp_min(scale * 448.0 / 240.0, 1e-4)
        return x / s[..., None], s


class ScaleMismatchWriter(_Fp32Writer):
    """Divides the payload by the power-of-two scale and stores amax / 448: the stored scale is not the one the
    e4m3 bytes were divided by, so every value decodes off by their ratio."""

    name = "broken-write-scale-mismatch"

    def rows(self, x, scale):
        s = torch.clamp_min(scale, 1e-4)
        return x / torch.pow(2.0, torch.log2(s).ceil())[..., None], s


# --------------------------------------------------------------------------- contract violations (errors)


class NoLsePrefillUndeclared(ReferenceOp):
    """Returns (out, None) from prefill without declaring prefill_returns_lse = False: an error naming it."""

    name = "broken-prefill-no-lse-undeclared"

    def prefill(self, *args, **kwargs):
        return super().prefill(*args, **kwargs)[0], None


class PrefillLseHeadsFirst(ReferenceOp):
    """Returns prefill's lse heads first, [h_q, total_q] (decode's layout guessed for prefill): an error naming
    both layouts."""

    name = "broken-prefill-lse-heads-first"

    def prefill(self, *args, **kwargs):
        out, lse = super().prefill(*args, **kwargs)
        return out, lse.T.contiguous()


class MergeOutFloat32(ReferenceOp):
    """Returns merge's out in float32 whatever out_a's dtype (the accumulator not cast back): an error."""

    name = "broken-merge-out-float32"

    def merge(self, out_a, lse_a, out_b, lse_b):
        out, lse = super().merge(out_a, lse_a, out_b, lse_b)
        return out.float(), lse
