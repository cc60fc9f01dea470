"""The Triton kernels of the ``triton`` op (:mod:`mla_conformance.impl.ops.triton_mla`): absorbed MLA decode over a
paged latent cache in two launches, flash-decoding style.

1. :func:`mla_decode_partial`, grid (B * s_q, head blocks, splits): one query position, a block of heads and one
   split of its keys; it gathers each tile of keys through the block table (dense) or the flat indices (sparse),
   decodes the 656-byte FP8 rows in the kernel when the cache holds them, and keeps an online softmax in float32
   (base 2: logits are pre-multiplied by log2 e). It writes the split's float32 partial output and its lse.
2. :func:`mla_decode_combine`, grid (B * s_q, head blocks): merges the splits by their lse, applies the attention
   sink, and writes the float32 output and the natural-log lse (+inf and out 0 for a query with no key).

Every load of a key is masked by its validity and every invalid key's slot is replaced by 0 before its address is
formed, so a poisoned page, an unused block-table entry or an invalid index is never dereferenced.

Numbers, as a production MLA decode computes them: q and the keys enter ``tl.dot`` in q's dtype -- bfloat16 /
float16 operands on the tensor cores with float32 accumulation, the FP8 rows' e4m3 x float32 tile scale converted
to q's dtype first (exact in bfloat16 for the power-of-two scales the op declares) -- and P is rounded to that dtype
before P.V (``acc += tl.dot(p.to(v.dtype), v)``, as vLLM's and SGLang's Triton decode); a float32 q and cache dot
with ``DOT_PRECISION`` = ``"ieee"`` (the op's ``float32_dot_precision``: no TF32). Softmax state, partials and
the merge are float32; the merge kernel stores out in the out buffer's dtype (rounded to nearest even). On CPU
CI these run under Triton's interpreter with the faithful tier (:mod:`mla_conformance.impl.ops.triton_faithful`),
which gives its ``tl.dot`` and casts a GPU's arithmetic.

This module imports triton; :mod:`~mla_conformance.impl.ops.triton_mla` imports it only when the op runs.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _e4m3_to_float(byte):
    """float8 e4m3fn bits (uint8, as int32) -> float32, exactly, by bit manipulation: 1 sign, 4 exponent bits
    (bias 7), 3 mantissa bits; exponent 0 is subnormal (m * 2^-9); 0x7F / 0xFF are NaN; no infinity."""
    bits = byte.to(tl.int32)
    sign = (bits >> 7) & 1
    exp = (bits >> 3) & 15
    man = bits & 7
    normal = ((sign << 31) | ((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
    sub = man.to(tl.float32) * 0.001953125
    sub = tl.where(sign == 1, -sub, sub)
    value = tl.where(exp == 0, sub, normal)
    return tl.where((exp == 15) & (man == 7), float("nan"), value)


@triton.jit
def mla_decode_partial(
    q_ptr, stride_qb, stride_qs, stride_qh,
    kv_ptr, stride_kv,            # latent: rows [N, d_qk] in q's dtype; FP8: rows [N, 656] as uint8
    scale_ptr, stride_scale,      # FP8: the same rows as float32 [N, 164] (tile scales at 128..131)
    rope_ptr, stride_rope,        # FP8: the same rows as bfloat16 [N, 328] (k_pe at 264..327)
    bt_ptr, stride_bt,            # dense: block_table [B, max_blocks]
    idx_ptr, stride_ib, stride_is,  # sparse: indices [B, s_q, topk] into the flat slots
    nvis_ptr,                     # int32 [B * s_q]: how many keys (dense) or index entries (sparse) query sees
    o_ptr, lse_ptr,               # float32 [B * s_q, splits, h, d_v], [B * s_q, splits, h]
    sm_scale_log2, H, S_Q, N_SLOTS, SPLIT_LEN, N_SPLITS,
    PAGE: tl.constexpr, D_V: tl.constexpr, D_PE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    SPARSE: tl.constexpr, FP8: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    bs = tl.program_id(0)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    b = bs // S_Q
    i = bs % S_Q
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < H
    dv = tl.arange(0, D_V)
    dpe = tl.arange(0, D_PE)
    q_row = q_ptr + b.to(tl.int64) * stride_qb + i * stride_qs + heads[:, None] * stride_qh
    q_nope = tl.load(q_row + dv[None, :], mask=h_ok[:, None], other=0.0)                         # [BH, D_V] q's dtype
    q_pe = tl.load(q_row + D_V + dpe[None, :], mask=h_ok[:, None], other=0.0)                    # [BH, D_PE]

    n_vis = tl.load(nvis_ptr + bs)
    start = split * SPLIT_LEN
    end = tl.minimum(start + SPLIT_LEN, n_vis)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D_V], tl.float32)
    for t0 in range(start, end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        in_range = t < end
        if SPARSE:
            slot = tl.load(idx_ptr + b.to(tl.int64) * stride_ib + i * stride_is + t, mask=in_range, other=-1)
            slot = slot.to(tl.int64)
            valid = in_range & (slot >= 0) & (slot < N_SLOTS)
        else:
            block = tl.load(bt_ptr + b.to(tl.int64) * stride_bt + t // PAGE, mask=in_range, other=0)
            slot = block.to(tl.int64) * PAGE + t % PAGE
            valid = in_range
        slot = tl.where(valid, slot, 0)
        if FP8:
            raw = tl.load(kv_ptr + slot[:, None] * stride_kv + dv[None, :], mask=valid[:, None], other=0)
            tile_scale = tl.load(scale_ptr + slot[:, None] * stride_scale + 128 + dv[None, :] // 128,
                                 mask=valid[:, None], other=0.0)
            k_nope = (_e4m3_to_float(raw) * tile_scale).to(q_nope.dtype)                          # [BN, D_V]
            k_pe = tl.load(rope_ptr + slot[:, None] * stride_rope + 264 + dpe[None, :], mask=valid[:, None],
                           other=0.0).to(q_nope.dtype)
        else:  # the cache holds q's dtype (the conversion is then none)
            row = kv_ptr + slot[:, None] * stride_kv
            k_nope = tl.load(row + dv[None, :], mask=valid[:, None], other=0.0).to(q_nope.dtype)
            k_pe = tl.load(row + D_V + dpe[None, :], mask=valid[:, None], other=0.0).to(q_nope.dtype)
        s = tl.dot(q_nope, tl.trans(k_nope), input_precision=DOT_PRECISION)                    # [BH, BN] float32
        s = tl.dot(q_pe, tl.trans(k_pe), s, input_precision=DOT_PRECISION)
        s = tl.where(valid[None, :], s * sm_scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)   # a head that has seen no key yet: nothing to scale
        alpha = tl.exp2(m - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(k_nope.dtype), k_nope, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m = m_new
    has = l > 0.0
    out = acc / tl.where(has, l, 1.0)[:, None]
    lse = tl.where(has, (m + tl.log2(tl.where(has, l, 1.0))) * 0.6931471805599453, float("-inf"))
    part = bs.to(tl.int64) * N_SPLITS + split
    tl.store(o_ptr + (part * H + heads[:, None]) * D_V + dv[None, :], out, mask=h_ok[:, None])
    tl.store(lse_ptr + part * H + heads, lse, mask=h_ok)


@triton.jit
def mla_decode_combine(
    o_part_ptr, lse_part_ptr,     # float32 [B * s_q, splits, h, d_v], [B * s_q, splits, h] (natural log)
    sink_ptr,                     # float32 [h] (HAS_SINK)
    o_ptr, lse_ptr,               # [B, s_q, h, d_v] contiguous in out's dtype; float32 [B, h, s_q] contiguous
    H, S_Q, N_SPLITS,
    D_V: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, HAS_SINK: tl.constexpr,
):
    bs = tl.program_id(0)
    hb = tl.program_id(1)
    b = bs // S_Q
    i = bs % S_Q
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < H
    splits = tl.arange(0, BLOCK_S)
    s_ok = splits < N_SPLITS
    part = bs.to(tl.int64) * N_SPLITS + splits                                                   # [BS]
    lse_s = tl.load(lse_part_ptr + part[:, None] * H + heads[None, :], mask=s_ok[:, None] & h_ok[None, :],
                    other=float("-inf"))                                                          # [BS, BH]
    m = tl.max(lse_s, axis=0)                                                                     # [BH]
    m_ref = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse_s - m_ref[None, :])                                                            # 0 for an empty split
    total = tl.sum(w, axis=0)
    has = total > 0.0
    dv = tl.arange(0, D_V)
    acc = tl.zeros([BLOCK_H, D_V], tl.float32)
    for s in range(0, N_SPLITS):
        lse_one = tl.load(lse_part_ptr + (bs.to(tl.int64) * N_SPLITS + s) * H + heads, mask=h_ok,
                          other=float("-inf"))
        w_one = tl.exp(lse_one - m_ref)
        o_one = tl.load(o_part_ptr + ((bs.to(tl.int64) * N_SPLITS + s) * H + heads[:, None]) * D_V + dv[None, :],
                        mask=h_ok[:, None] & (w_one > 0.0)[:, None], other=0.0)
        acc += w_one[:, None] * o_one
    out = acc / tl.where(has, total, 1.0)[:, None]
    lse = tl.where(has, m_ref + tl.log(tl.where(has, total, 1.0)), float("inf"))
    if HAS_SINK:  # out * exp(lse) / (exp(lse) + exp(sink)); lse unchanged
        sink = tl.load(sink_ptr + heads, mask=h_ok, other=float("-inf"))
        factor = 1.0 / (1.0 + tl.exp(sink - tl.where(has, lse, 0.0)))  # (a query with no key: out is 0 anyway)
        out = out * tl.where(has, factor, 0.0)[:, None]
    tl.store(o_ptr + (bs.to(tl.int64) * H + heads[:, None]) * D_V + dv[None, :], out, mask=h_ok[:, None])
    tl.store(lse_ptr + (b.to(tl.int64) * H + heads) * S_Q + i, lse, mask=h_ok)
