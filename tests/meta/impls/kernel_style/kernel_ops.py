"""Ops that compute as production MLA decode kernels do, written from the op contract and the kernels'
arithmetic (torch and math only: nothing of mla_conformance, its reference-op or its oracle), for the op
suite's half-precision bounds (tests/meta/test_op_meta.py):

* :class:`PRoundingOp` (bfloat16) and :class:`PRoundingFp16Op` (float16): scores in float32 from the q /
  cache dtype's values, an online softmax over blocks of 64 keys (running max and sum in float32), P rounded
  to the cache dtype before P.V with a float32 accumulator -- vLLM's triton_decode_attention.py
  ``acc += tl.dot(p.to(v.dtype), v)``, SGLang's decode_attention.py, FlashMLA and FlashInfer alike -- and out
  rounded once (into the caller's out / lse where handed them: ``out_buffers``). Correct: they must pass every
  op test;
* :class:`SplitKVOp`: the same, with each query's keys split into 3 chunks computed apart (float32 partial
  out and lse, as FlashMLA's split-KV ``oaccum`` / ``lseaccum``) and merged by LSE. Correct;
* :class:`CoarsePOp` (broken): P kept to 3 significant bits fewer than the cache dtype (5 for bfloat16, 8 for
  float16: u 8x the dtype's): an error about 4x the bound (3.5x in bfloat16, 3.7x in float16 on
  ``test_out_lse_vs_oracle``), which that test must fail;
* :class:`NoLseTritonOp`: SGLang-style: returns no lse (``returns_lse = False``), leaves a query with no keys
  undefined (``acc / e_sum`` = 0/0) and so declines such cases, takes no attention sink, keeps the default
  ``invalid_index`` ("minus-one"): passes with skips;
* :class:`HalfLseOp` (broken): returns its lse in bfloat16 (vLLM's ``forward_mqa`` allocated lse in q's
  dtype): an error naming the dtype.
"""

from __future__ import annotations

import math

import torch

NOPE, ROW, FP8_ROW = 512, 576, 656
BLOCK = 64


def _rows(flat: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[n, 576] keys in ``dtype`` from the flattened cache: q-dtype rows as they are, or 656-byte FP8 rows
    dequantized (e4m3 x float32 tile scale, then bf16 rope) into ``dtype`` -- exact in bfloat16 for power-of-two
    scales, as FlashMLA's sparse FP8 decode dequantizes into bfloat16 for its MMA."""
    rows = flat[slots]
    if rows.dtype != torch.uint8:
        return rows
    nope = rows[:, :NOPE].contiguous().view(torch.float8_e4m3fn).to(torch.float32).reshape(-1, 4, 128)
    scale = rows[:, NOPE:NOPE + 16].contiguous().view(torch.float32)
    rope = rows[:, NOPE + 16:].contiguous().view(torch.bfloat16).to(torch.float32)
    return torch.cat([(nope * scale[:, :, None]).reshape(-1, NOPE), rope], dim=1).to(dtype)


def _round_bits(p: torch.Tensor, bits: int) -> torch.Tensor:
    """p rounded to ``bits`` significant bits (round to nearest), in float32."""
    mant, exp = torch.frexp(p)                                  # p = mant x 2^exp, mant in [0.5, 1)
    return torch.ldexp(torch.round(mant * 2.0 ** bits) / 2.0 ** bits, exp)


class PRoundingOp:
    """Dense and sparse decode, latent and FP8 caches, pages of 1, 16, 64, attn_sink; P in bfloat16."""

    name = "p-rounding-op"
    dtype = torch.bfloat16
    sparse_decode = True
    sparse_decode_extra_cache = True
    invalid_index = "out-of-range"
    attn_sink = True
    page_block_sizes = (1, 16, 64)
    kv_formats = ("latent", "fp8-e4m3-flashmla")
    deterministic = True
    batch_invariant = True
    out_buffers = True
    splits = 1

    def unsupported_reason(self, case):
        if case.dtype != self.dtype:
            return f"computes with a {str(self.dtype).removeprefix('torch.')} q and cache only, not {case.dtype}"
        if case.page_block_size not in self.page_block_sizes:
            return f"reads pages of {self.page_block_sizes} tokens only"
        return None

    def round_p(self, p: torch.Tensor) -> torch.Tensor:
        return p.to(self.dtype).to(torch.float32)             # acc += tl.dot(p.to(v.dtype), v)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor, scale: float):
        """q [h, 576], keys [n, 576], allowed [n] bool: (out [h, 512] float32, lse [h] float32; -inf when empty),
        an online softmax over blocks of BLOCK keys with P rounded before P.V."""
        h = q.shape[0]
        m = torch.full((h,), -math.inf)
        l = torch.zeros(h)
        acc = torch.zeros(h, NOPE)
        qf = q.to(torch.float32)
        for start in range(0, keys.shape[0], BLOCK):
            k = keys[start:start + BLOCK]
            ok = allowed[start:start + BLOCK]
            s = (qf @ k.to(torch.float32).T) * scale              # [h, n] float32 scores
            s = torch.where(ok[None, :], s, torch.full_like(s, -math.inf))
            m_new = torch.maximum(m, s.amax(-1))
            safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            alpha = torch.exp(m - safe)
            p = torch.where(ok[None, :], torch.exp(s - safe[:, None]), torch.zeros_like(s))
            l = l * alpha + p.sum(-1)                             # the normaliser from float32 p
            v = torch.where(ok[:, None], k[:, :NOPE], torch.zeros((), dtype=k.dtype)).to(torch.float32)
            acc = acc * alpha[:, None] + self.round_p(p) @ v
            m = m_new
        empty = l == 0
        out = torch.where(empty[:, None], torch.zeros_like(acc), acc / torch.where(empty, 1.0, l)[:, None])
        lse = torch.where(empty, torch.full_like(l, -math.inf), m + torch.log(torch.where(empty, 1.0, l)))
        return out, lse

    def _query(self, q, keys, allowed, scale):
        """One query over its keys, in ``splits`` chunks merged by LSE (float32 partials)."""
        n = keys.shape[0]
        if self.splits == 1 or n < self.splits:
            return self._attend(q, keys, allowed, scale)
        bounds = [round(j * n / self.splits) for j in range(self.splits + 1)]
        parts = [self._attend(q, keys[a:b], allowed[a:b], scale) for a, b in zip(bounds, bounds[1:])]
        lses = torch.stack([l for _, l in parts])                 # [splits, h]
        lse = torch.logsumexp(lses, dim=0)                        # -inf when every part is empty
        safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
        w = torch.exp(lses - safe)                                # 0 for an empty part
        out = sum(w[j][:, None] * parts[j][0] for j in range(self.splits))
        return out, lse

    def decode(self, q, kv_cache, block_table, cache_seqlens, *, softmax_scale, causal, indices=None,
               topk_length=None, attn_sink=None, extra_k_cache=None, extra_indices=None, extra_topk_length=None,
               out=None, lse=None):
        B, s_q, h, _ = q.shape
        page = kv_cache.shape[1]
        given = out, lse                                          # caller-owned buffers: out rounded once into them
        n_slots = kv_cache.shape[0] * page
        flat = kv_cache.reshape(n_slots, kv_cache.shape[-1])
        scopes = [(flat, indices, topk_length)]
        if extra_k_cache is not None:  # FlashMLA's second scope: its keys join the first's in one softmax
            scopes.append((extra_k_cache.reshape(-1, extra_k_cache.shape[-1]), extra_indices, extra_topk_length))
        out = torch.zeros(B, s_q, h, NOPE)
        lse = torch.empty(B, h, s_q)
        for b in range(B):
            L = int(cache_seqlens[b])
            if indices is None:
                pos = torch.arange(L)
                slots = block_table[b].long()[pos // page] * page + pos % page
                keys = _rows(flat, slots, self.dtype)
            for i in range(s_q):
                if indices is not None:
                    selected = []
                    for pool, idx, length in scopes:
                        row = idx[b, i].long()
                        n = row.numel() if length is None else min(int(length[b]), row.numel())
                        row = row[:n]
                        selected.append(_rows(pool, row[(row >= 0) & (row < pool.shape[0])], self.dtype))
                    keys_i = torch.cat(selected)
                    allowed = torch.ones(keys_i.shape[0], dtype=torch.bool)
                else:
                    keys_i = keys
                    visible = L - s_q + i + 1 if causal else L
                    allowed = torch.arange(L) < visible
                o, l = self._query(q[b, i], keys_i, allowed, softmax_scale)
                if attn_sink is not None:
                    factor = torch.where(torch.isinf(l) & (l < 0), torch.zeros_like(l),
                                         1.0 / (1.0 + torch.exp(attn_sink.to(torch.float32) - l)))
                    o = o * factor[:, None]
                out[b, i] = o
                lse[b, :, i] = torch.where(torch.isneginf(l), torch.full_like(l, math.inf), l)
        if given[0] is None:
            return out.to(q.dtype), lse
        return given[0].copy_(out), (lse if given[1] is None else given[1].copy_(lse))


class PRoundingFp16Op(PRoundingOp):
    name = "p-rounding-fp16-op"
    dtype = torch.float16
    kv_formats = ("latent",)


class SplitKVOp(PRoundingOp):
    name = "split-kv-op"
    splits = 3


class CoarsePOp(PRoundingOp):
    """Broken: P kept to 3 significant bits fewer than the cache dtype (5 for bfloat16, 8 for float16)."""

    name = "broken-coarse-p"
    lost_bits = 3

    def unsupported_reason(self, case):
        if case.dtype not in (torch.bfloat16, torch.float16):
            return "computes with a bfloat16 or float16 q only"
        return None

    def decode(self, q, *args, **kwargs):
        self.dtype = q.dtype
        return super().decode(q, *args, **kwargs)

    def round_p(self, p):
        return _round_bits(p, (8 if self.dtype == torch.bfloat16 else 11) - self.lost_bits)


class NoLseTritonOp(PRoundingOp):
    """SGLang-style decode: no final lse, a query with no keys undefined, no attention sink."""

    name = "no-lse-triton-op"
    returns_lse = False
    attn_sink = False
    invalid_index = None  # the default, "minus-one": FlashMLA's sparse decode rule
    kv_formats = ("latent",)

    def unsupported_reason(self, case):
        if case.rows_without_keys:
            return "leaves a query with no keys undefined (acc / e_sum = 0/0, as vLLM's and SGLang's Triton decode)"
        return super().unsupported_reason(case)

    def decode(self, *args, **kwargs):
        out, _ = super().decode(*args, **kwargs)
        return out, None


class HalfLseOp(PRoundingOp):
    """Broken: returns lse in q's dtype (bfloat16)."""

    name = "broken-half-lse"

    def decode(self, q, *args, **kwargs):
        out, lse = super().decode(q, *args, **kwargs)
        return out, lse.to(q.dtype)
