"""Ops implementing the op contract's optional methods as production kernels compute them, written from the
contract's words (mla_conformance/contract/op.py) and the kernels' arithmetic -- torch and math only: nothing
of mla_conformance, its reference-op or its oracles. tests/meta/test_op_methods_meta.py requires them to pass
every method test (and the frozen decode-only op to skip them by name):

* :class:`IndependentMethodsOp`: every method, kernel-style --
  ``prefill`` FlashAttention-2-like: float32 scores from the inputs' values, an online softmax over key blocks
  of 32 (running max and sum in float32), P rounded to q's dtype before P.V, a float32 accumulator, out rounded
  once; lse in base 2 and -inf for a query with no keys (FA3's convention), both declared;
  ``sparse_prefill`` FlashMLA-like: the valid indexed keys, float32 scores, P rounded to q's dtype, natural
  lse computed through exp2 / log2 (base 2 inside, as FlashMLA), attention sink, topk_length, d_qk 576 / 512;
  ``merge`` FlashInfer ``merge_state``-like: lse in base 2 (declared), float32 weights exp2(lse - max), an
  infinite lse of either sign an empty side, both empty -inf (declared);
  ``write`` vLLM ``concat_and_cache_mla``-like: the latent row as is; FlashMLA's 656-byte row with *fp32*
  scales (declared) computed as amax x (1 / 448) and payload x x (1 / scale) -- multiplications, not the
  oracle's divisions, as a kernel would; MODEL1's block layout;
  ``decode`` dense, latent and 656-byte caches, P rounded to q's dtype (for the write / decode round trip);
* :class:`MergeOnlyOp`: only ``merge`` (natural lse, +inf for two empty sides): an op with one method is an op.
* :class:`DummySlotWriterOp`: only ``write``, SGLang ``set_mla_kv_buffer``-like: the latent row stored at
  ``cache[loc]`` of the flat token pool (any page size is a view of it), the caller padding its batch to the dummy
  slot 0 (declared: ``write_padding_slot = "dummy-slot-0"``), so it never sees a negative slot.
"""

from __future__ import annotations

import math

import torch

LN2 = math.log(2.0)
BLOCK = 32


def _online_softmax(q, k, v, allowed, scale, p_dtype):
    """q [h, d], k [n, h, d], v [n, h, dv] (per query head), allowed [h, n] bool -> (out [h, dv] float32,
    lse2 [h]: base 2, -inf when no key): blocks of BLOCK keys, P rounded to p_dtype before P.V."""
    h = q.shape[0]
    m = torch.full((h,), -math.inf)
    l = torch.zeros(h)
    acc = torch.zeros(h, v.shape[-1])
    qf = q.float()
    s2 = scale / LN2                                                    # scores in log2 units (exp2)
    for a in range(0, k.shape[0], BLOCK):
        kb, vb = k[a:a + BLOCK].float(), v[a:a + BLOCK].float()
        ok = allowed[..., a:a + BLOCK]
        s = torch.einsum("hd,nhd->hn", qf, kb) * s2
        s = torch.where(ok, s, torch.full_like(s, -math.inf))
        m_new = torch.maximum(m, s.amax(-1))
        safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.where(ok, torch.exp2(s - safe[:, None]), torch.zeros_like(s))
        alpha = torch.exp2(m - safe)
        l = l * alpha + p.sum(-1)
        vb = torch.where(ok.T[..., None], vb, torch.zeros(()))                 # [n, h, dv]: no poison read
        acc = acc * alpha[:, None] + torch.einsum("hn,nhd->hd", p.to(p_dtype).float(), vb)
        m = m_new
    empty = l == 0
    out = torch.where(empty[:, None], 0.0, acc / torch.where(empty, 1.0, l)[:, None])
    lse2 = torch.where(empty, -math.inf, m + torch.log2(torch.where(empty, 1.0, l)))
    return out, lse2


class IndependentMethodsOp:
    name = "independent-methods-op"
    # prefill: FA3's -inf for no keys, base-2 lse (FlashInfer's ragged prefill)
    prefill_head_dims = ((192, 128), (256, 256), (576, 512))
    prefill_lse_base = "2"
    prefill_empty_row = "-inf"
    sparse_prefill_head_dims = ((576, 512), (512, 512))
    sparse_prefill_lse_base = "e"
    sparse_prefill_topk_length = True
    sparse_prefill_attn_sink = True
    merge_lse_base = "2"
    merge_empty_row = "-inf"
    write_kv_formats = ("latent", "fp8-e4m3-flashmla", "fp8-e4m3-model1")
    write_fp8_scale_format = "fp32"
    write_page_block_sizes = (16, 64)
    # decode: dense over latent and 656-byte caches, sparse over MODEL1 (for the round trip through write)
    page_block_sizes = (16, 64)
    kv_formats = ("latent", "fp8-e4m3-flashmla", "fp8-e4m3-model1")
    fp8_scale_format = "fp32"
    sparse_decode = True

    def unsupported_reason(self, case):
        if getattr(case, "method", "decode") == "decode":
            if case.attn_sink or (case.topk is not None) != (case.kv_format == "fp8-e4m3-model1"):
                return "decodes latent and 656-byte caches dense, MODEL1 caches sparse, without an attention sink"
        return None

    # ------------------------------------------------------------------ prefill

    def prefill(self, q, k, v, cu_seqlens_q, cu_seqlens_k, *, softmax_scale, causal):
        total_q, h_q, _ = q.shape
        group = h_q // k.shape[1]
        out = torch.zeros(total_q, h_q, v.shape[-1])
        lse = torch.full((total_q, h_q), -math.inf)
        cq, ck = [int(x) for x in cu_seqlens_q], [int(x) for x in cu_seqlens_k]
        for b in range(len(cq) - 1):
            m, n = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
            keys = k[ck[b]:ck[b + 1]].repeat_interleave(group, dim=1)
            vals = v[ck[b]:ck[b + 1]].repeat_interleave(group, dim=1)
            for i in range(m):
                seen = min(n, max(0, n - m + i + 1)) if causal else n
                allowed = (torch.arange(n) < seen)[None, :].expand(h_q, n)
                o, l2 = _online_softmax(q[cq[b] + i], keys, vals, allowed, softmax_scale, q.dtype)
                out[cq[b] + i], lse[cq[b] + i] = o, l2
        return out.to(q.dtype), lse

    # ------------------------------------------------------------------ sparse prefill

    def sparse_prefill(self, q, kv, indices, *, softmax_scale, d_v, topk_length=None, attn_sink=None):
        s_q, h_q, _ = q.shape
        s_kv = kv.shape[0]
        out = torch.zeros(s_q, h_q, d_v)
        max_logits = torch.full((s_q, h_q), -math.inf)
        lse = torch.full((s_q, h_q), math.inf)
        for s in range(s_q):
            row = indices[s, 0].long()
            if topk_length is not None:
                row = row[:int(topk_length[s])]
            row = row[(row >= 0) & (row < s_kv)]
            if row.numel() == 0:
                continue
            keys = kv[row, 0].float()                                      # [n, d_qk]
            logits = (q[s].float() @ keys.T) * softmax_scale               # [h, n] float32
            mx = logits.amax(-1)
            p = torch.exp2((logits - mx[:, None]) / LN2)
            total = p.sum(-1)
            o = (p.to(q.dtype).float() @ keys[:, :d_v]) / total[:, None]
            l = mx + torch.log2(total) * LN2
            if attn_sink is not None:
                o = o * torch.sigmoid(l - attn_sink.float())[:, None]
            out[s], max_logits[s], lse[s] = o, mx, l
        return out.to(q.dtype), max_logits, lse

    # ------------------------------------------------------------------ merge (base 2)

    def merge(self, out_a, lse_a, out_b, lse_b):
        la, lb = lse_a.float(), lse_b.float()
        ea, eb = ~torch.isfinite(la), ~torch.isfinite(lb)
        la, lb = torch.where(ea, -math.inf, la), torch.where(eb, -math.inf, lb)
        m = torch.maximum(la, lb)
        both = ea & eb
        m = torch.where(both, 0.0, m)
        wa, wb = torch.exp2(la - m), torch.exp2(lb - m)
        total = torch.where(both, 1.0, wa + wb)
        oa = torch.where(ea[..., None], 0.0, out_a.float())
        ob = torch.where(eb[..., None], 0.0, out_b.float())
        out = (oa * (wa / total)[..., None] + ob * (wb / total)[..., None]).to(out_a.dtype)
        return out, torch.where(both, -math.inf, m + torch.log2(total))

    # ------------------------------------------------------------------ write

    def write(self, kv_c, k_pe, kv_cache, slot_mapping, *, kv_format):
        page = kv_cache.shape[1]
        for t in range(kv_c.shape[0]):
            slot = int(slot_mapping[t])
            if slot < 0:
                continue
            block, off = slot // page, slot % page
            if kv_format == "latent":
                kv_cache[block, off, 0, :kv_c.shape[1]] = kv_c[t].to(kv_cache.dtype)
                kv_cache[block, off, 0, kv_c.shape[1]:] = k_pe[t].to(kv_cache.dtype)
            elif kv_format == "fp8-e4m3-flashmla":
                x = kv_c[t].float().reshape(4, 128)
                scale = torch.clamp(x.abs().amax(-1) * (1.0 / 448.0), min=1e-4)          # float32, as written
                q8 = (x * (1.0 / scale)[:, None]).reshape(-1).to(torch.float8_e4m3fn)
                row = kv_cache[block, off, 0]
                row[:512] = q8.view(torch.uint8)
                row[512:528] = scale.contiguous().view(torch.uint8)
                row[528:] = k_pe[t].to(torch.bfloat16).contiguous().view(torch.uint8)
            else:                                                                      # MODEL1 block layout
                mem = torch.as_strided(kv_cache, (kv_cache.shape[0], page * 584), (kv_cache.stride(0), 1),
                                       kv_cache.storage_offset())
                x = kv_c[t].float().reshape(7, 64)
                exp = torch.ceil(torch.log2(torch.clamp(x.abs().amax(-1) / 448.0, min=1e-4)))
                q8 = (x * torch.exp2(-exp)[:, None]).reshape(-1).to(torch.float8_e4m3fn)
                mem[block, off * 576:off * 576 + 448] = q8.view(torch.uint8)
                mem[block, off * 576 + 448:off * 576 + 576] = k_pe[t].to(torch.bfloat16).contiguous().view(torch.uint8)
                mem[block, page * 576 + off * 8:page * 576 + off * 8 + 7] = (exp + 127).to(torch.uint8)  # e8m0

    # ------------------------------------------------------------------ decode (dense)

    def decode(self, q, kv_cache, block_table, cache_seqlens, *, softmax_scale, causal, indices=None,
               topk_length=None, attn_sink=None):
        B, s_q, h, _ = q.shape
        page = kv_cache.shape[1]
        out = torch.zeros(B, s_q, h, 512)
        lse = torch.full((B, h, s_q), math.inf)
        if indices is not None:                                               # MODEL1, sparse
            return self._decode_model1(q, kv_cache, indices, softmax_scale)
        for b in range(B):
            n = int(cache_seqlens[b])
            pos = torch.arange(n)
            rows = kv_cache[block_table[b].long()[pos // page], pos % page, 0]
            if rows.dtype == torch.uint8:                                     # the 656-byte layout
                vals = rows[:, :512].contiguous().view(torch.float8_e4m3fn).float().reshape(n, 4, 128)
                scale = rows[:, 512:528].contiguous().view(torch.float32)
                rope = rows[:, 528:].contiguous().view(torch.bfloat16).float()
                keys = torch.cat([(vals * scale[:, :, None]).reshape(n, 512), rope], dim=1)  # float32: exact
            else:
                keys = rows
            for i in range(s_q):
                seen = min(n, max(0, n - s_q + i + 1)) if causal else n
                allowed = (torch.arange(n) < seen)[None, :].expand(h, n)
                o, l2 = _online_softmax(q[b, i], keys[:, None].expand(n, h, keys.shape[-1]),
                                        keys[:, None, :512].expand(n, h, 512), allowed, softmax_scale, q.dtype)
                out[b, i] = o
                lse[b, :, i] = torch.where(torch.isinf(l2), math.inf, l2 * LN2)
        return out.to(q.dtype), lse


    def _decode_model1(self, q, kv_cache, indices, scale):
        """MODEL1 blocks dequantized (e4m3 x 2^(e8m0 - 127), bf16 rope), the valid indexed tokens attended; the
        value is the whole 512-wide key."""
        nb, page = kv_cache.shape[:2]
        mem = torch.as_strided(kv_cache, (nb, page * 584), (kv_cache.stride(0), 1), kv_cache.storage_offset())
        part = mem[:, :page * 576].reshape(nb * page, 576)
        exps = mem[:, page * 576:].reshape(nb * page, 8)[:, :7].float() - 127
        nope = part[:, :448].contiguous().view(torch.float8_e4m3fn).float().reshape(-1, 7, 64)
        keys = torch.cat([(nope * torch.exp2(exps)[:, :, None]).reshape(-1, 448),
                          part[:, 448:].contiguous().view(torch.bfloat16).float()], dim=1)   # [slots, 512]
        B, s_q, h, _ = q.shape
        out = torch.zeros(B, s_q, h, 512)
        lse = torch.full((B, h, s_q), math.inf)
        for b in range(B):
            for i in range(s_q):
                row = indices[b, i].long()
                row = row[(row >= 0) & (row < nb * page)]
                k = keys[row]
                allowed = torch.ones(h, row.numel(), dtype=torch.bool)
                o, l2 = _online_softmax(q[b, i], k[:, None].expand(-1, h, 512), k[:, None].expand(-1, h, 512),
                                        allowed, scale, q.dtype)
                out[b, i] = o
                lse[b, :, i] = torch.where(torch.isinf(l2), math.inf, l2 * LN2)
        return out.to(q.dtype), lse


class MergeOnlyOp:
    """Only merge: natural lse, +inf for two empty sides (the defaults: it declares nothing)."""

    name = "merge-only-op"

    def unsupported_reason(self, case):
        return None

    def merge(self, out_a, lse_a, out_b, lse_b):
        la = torch.where(torch.isinf(lse_a), -math.inf, lse_a.float())
        lb = torch.where(torch.isinf(lse_b), -math.inf, lse_b.float())
        top = torch.maximum(la, lb)
        none = torch.isneginf(top)
        top = torch.where(none, 0.0, top)
        wa, wb = torch.exp(la - top), torch.exp(lb - top)                  # exp(-inf) = 0: an empty side
        total = torch.where(none, 1.0, wa + wb)
        out = (out_a.float() * wa[..., None] + out_b.float() * wb[..., None]) / total[..., None]
        return out.to(out_a.dtype), torch.where(none, math.inf, top + torch.log(total))


class DummySlotWriterOp:
    """Only write, SGLang-style: the flat pool written at ``loc`` as given (padding tokens come with the dummy slot
    0, declared), the latent format at any page size."""

    name = "dummy-slot-writer-op"
    write_padding_slot = "dummy-slot-0"
    write_page_block_sizes = (1, 16, 64)

    def unsupported_reason(self, case):
        return None

    def write(self, kv_c, k_pe, kv_cache, slot_mapping, *, kv_format):
        pool = kv_cache.view(-1, kv_cache.shape[-1])                      # [num_blocks * page, 576]: one row a token
        pool[slot_mapping.long()] = torch.cat([kv_c, k_pe], dim=-1).to(pool.dtype)


class _Fp32ScaleWriter:
    """FlashMLA's 656-byte rows with float32 tile scales as other writers compute them (:meth:`scales`): e4m3 of
    value / scale (0 where the scale is 0), the bfloat16 rope unscaled. Only ``write``, only this format."""

    write_kv_formats = ("fp8-e4m3-flashmla",)
    write_fp8_scale_format = "fp32"
    write_page_block_sizes = (16, 64)

    def unsupported_reason(self, case):
        return None

    def scales(self, tiles):
        raise NotImplementedError

    def write(self, kv_c, k_pe, kv_cache, slot_mapping, *, kv_format):
        keep = slot_mapping >= 0
        slots, page = slot_mapping[keep].long(), kv_cache.shape[1]
        x = kv_c[keep].float().unflatten(-1, (4, 128))
        scale = self.scales(x).float()
        q8 = torch.where(scale[..., None] > 0, x / torch.where(scale > 0, scale, 1.0)[..., None], 0.0)
        rows = torch.cat([q8.flatten(-2).to(torch.float8_e4m3fn).view(torch.uint8),
                          scale.contiguous().view(torch.uint8),
                          k_pe[keep].to(torch.bfloat16).contiguous().view(torch.uint8)], dim=-1)
        kv_cache[slots // page, slots % page, 0] = rows


class NoFloorFp32Writer(_Fp32ScaleWriter):
    """SGLang-style: scale amax / 448 in float32 with no floor (an all-zero tile: scale 0, payload 0)."""

    name = "no-floor-fp32-writer"

    def scales(self, tiles):
        return tiles.abs().amax(-1) / 448.0


class Bf16ScaleWriter(_Fp32ScaleWriter):
    """FlashMLA's earlier float32-scale quant.py: amax / 448 computed in bfloat16 (up to a few 2^-9 off the
    float32 quotient), no floor, stored as float32."""

    name = "bf16-scale-writer"

    def scales(self, tiles):
        return tiles.abs().amax(-1).to(torch.bfloat16) / torch.tensor(448.0, dtype=torch.bfloat16)


class MinusInfMergeOp:
    """Only merge, as FlashInfer's merge_state computes it: lse in base 2, s_max = max(s_a, s_b), weights
    exp2(s - s_max): an empty side is -inf (exp2(-inf) = 0), and a +inf side would make every weight NaN, so it
    declares merge_empty_input = "-inf"; two empty sides guarded: out 0, lse -inf (declared)."""

    name = "minus-inf-merge-op"
    merge_lse_base = "2"
    merge_empty_row = "-inf"
    merge_empty_input = "-inf"

    def unsupported_reason(self, case):
        return None

    def merge(self, out_a, lse_a, out_b, lse_b):
        la, lb = lse_a.float(), lse_b.float()
        top = torch.maximum(la, lb)
        none = torch.isneginf(top)
        top = torch.where(none, 0.0, top)
        wa, wb = torch.exp2(la - top), torch.exp2(lb - top)
        total = torch.where(none, 1.0, wa + wb)
        out = (out_a.float() * wa[..., None] + out_b.float() * wb[..., None]) / total[..., None]
        return out.to(out_a.dtype), torch.where(none, -math.inf, top + torch.log2(total))


class NoLsePrefillOp(MergeOnlyOp):
    """vLLM's and SGLang's Triton prefill (``context_attention_fwd``) as they compute it: no lse written (declared
    prefill_returns_lse = False; it returns (out, None)), an online softmax over key blocks in float32, P rounded to
    q's dtype before P.V, bottom-right causal; and MergeOnlyOp's merge, so the composition asks for the lse by
    name."""

    name = "no-lse-prefill-op"
    prefill_returns_lse = False
    prefill_head_dims = ((192, 128), (256, 256), (576, 512))

    def prefill(self, q, k, v, cu_seqlens_q, cu_seqlens_k, *, softmax_scale, causal):
        out, _ = IndependentMethodsOp.prefill(self, q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale=softmax_scale,
                                              causal=causal)
        return out, None
