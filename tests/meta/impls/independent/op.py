"""Correct ops written independently of reference-op (nothing imported from mla_conformance.impl.ops.reference or
mla_conformance.model.reference): if the op suite were tuned to the reference's arithmetic or conventions, these
would fail it.

* :class:`IndependentOp` walks each row's pages with an explicit loop and an online softmax (running max, sum
  and accumulator in float32, as a kernel does; float64 for a float64 q), decodes the 656-byte FP8 rows itself,
  and declares the conventions the reference does not use: lse in base 2, empty rows with lse -inf, fp32 tile
  scales. It declares every optional part, so the whole op suite runs on it (``out_buffers``: it writes its result
  row by row into the caller's out / lse views).
* :class:`BaseContractOp` implements only the base contract: dense decode over a latent cache in pages of 64,
  no declarations; it declines sparse decode, attn_sink and FP8 caches in ``unsupported_reason``, so those tests
  skip with its sentences.
"""

from __future__ import annotations

import math

import torch

NOPE, ROPE, ROW = 512, 64, 576
LOG2E = 1.0 / math.log(2.0)
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _decode_rows(rows: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """[n, 576] latent rows in ``acc`` from [n, 576] q-dtype rows or [n, 656] FP8 bytes (512 e4m3, 4 float32
    scales, one per 128 values, 64 bfloat16 rope)."""
    if rows.dtype != torch.uint8:
        return rows.to(acc)
    nope = rows[:, :NOPE].contiguous().view(torch.float8_e4m3fn).to(acc).reshape(-1, 4, 128)
    scales = rows[:, NOPE:NOPE + 16].contiguous().view(torch.float32).to(acc)        # [n, 4]
    rope = rows[:, NOPE + 16:].contiguous().view(torch.bfloat16).to(acc)             # [n, 64]
    return torch.cat([(nope * scales[:, :, None]).reshape(-1, NOPE), rope], dim=1)


class _Online:
    """Online softmax state for [s_q, h] queries over key chunks."""

    def __init__(self, s_q: int, h: int, acc: torch.dtype, device):
        self.m = torch.full((s_q, h), -math.inf, dtype=acc, device=device)
        self.l = torch.zeros((s_q, h), dtype=acc, device=device)
        self.o = torch.zeros((s_q, h, NOPE), dtype=acc, device=device)

    def update(self, scores: torch.Tensor, allowed: torch.Tensor, values: torch.Tensor) -> None:
        """scores [s_q, h, n], allowed [s_q, 1, n] bool, values [n, 512]."""
        scores = torch.where(allowed, scores, torch.full_like(scores, -math.inf))
        m_new = torch.maximum(self.m, scores.amax(-1))
        safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        alpha = torch.exp(self.m - safe)                                      # exp(-inf) = 0 for a fresh state
        p = torch.where(allowed, torch.exp(scores - safe[..., None]), torch.zeros_like(scores))
        self.l = self.l * alpha + p.sum(-1)
        self.o = self.o * alpha[..., None] + torch.einsum("shn,nd->shd", p, values)
        self.m = m_new

    def finish(self):
        """(out [s_q, h, 512], natural lse [s_q, h] with -inf for no keys)."""
        empty = self.l == 0
        out = torch.where(empty[..., None], torch.zeros_like(self.o), self.o / torch.where(empty, 1, self.l)[..., None])
        lse = torch.where(empty, torch.full_like(self.l, -math.inf), self.m + torch.log(torch.where(empty, 1, self.l)))
        return out, lse


class IndependentOp:
    name = "independent-op"
    lse_base = "2"
    empty_row = "-inf"
    sparse_decode = True
    sparse_decode_extra_cache = True
    invalid_index = "out-of-range"
    attn_sink = True
    page_block_sizes = (1, 16, 64)
    kv_formats = ("latent", "fp8-e4m3-flashmla")
    fp8_scale_format = "fp32"
    deterministic = True
    batch_invariant = True
    out_buffers = True

    def unsupported_reason(self, case):
        if case.page_block_size not in self.page_block_sizes:
            return f"reads pages of {self.page_block_sizes} tokens only"
        if case.dtype not in FLOATS:
            return f"q must be float16, bfloat16, float32 or float64, not {case.dtype}"
        return None

    def decode(self, q, kv_cache, block_table, cache_seqlens, *, softmax_scale, causal, indices=None,
               topk_length=None, attn_sink=None, extra_k_cache=None, extra_indices=None, extra_topk_length=None,
               out=None, lse=None):
        B, s_q, h, _ = q.shape
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        page = kv_cache.shape[1]
        result_out, result_lse = out, lse                                     # the caller's buffers, if any
        n_slots = kv_cache.shape[0] * page
        flat = kv_cache.reshape(n_slots, kv_cache.shape[-1])
        scopes = [(flat, indices, topk_length)]
        if extra_k_cache is not None:                                         # a second cache, the same softmax
            scopes.append((extra_k_cache.reshape(-1, extra_k_cache.shape[-1]), extra_indices, extra_topk_length))
        out = torch.zeros(B, s_q, h, NOPE, dtype=acc, device=q.device)
        lse = torch.empty(B, s_q, h, dtype=acc, device=q.device)
        for b in range(B):
            qb = q[b].to(acc)                                                 # [s_q, h, 576]
            state = _Online(s_q, h, acc, q.device)
            for pool, idx, length in (scopes if indices is not None else ()):
                row = idx[b].long()                                           # [s_q, topk]
                keep = (row >= 0) & (row < pool.shape[0])
                if length is not None:
                    keep &= torch.arange(row.shape[1], device=row.device)[None, :] < int(length[b])
                for i in range(s_q):
                    slots = row[i][keep[i]]
                    for start in range(0, slots.numel(), 16):                 # chunks of 16 selected keys
                        keys = _decode_rows(pool[slots[start:start + 16]], acc)
                        scores = torch.einsum("hd,nd->hn", qb[i], keys)[None] * softmax_scale
                        allowed = torch.zeros(s_q, 1, keys.shape[0], dtype=torch.bool, device=q.device)
                        allowed[i] = True
                        full = torch.zeros(s_q, h, keys.shape[0], dtype=acc, device=q.device)
                        full[i] = scores[0]
                        state.update(full, allowed, keys[:, :NOPE])
            if indices is None:
                L = int(cache_seqlens[b])
                for j in range(-(-L // page)):                                # only the row's own pages
                    block = int(block_table[b, j])
                    n = min(page, L - j * page)
                    keys = _decode_rows(kv_cache[block, :n, 0], acc)          # never touches the page's tail
                    pos = j * page + torch.arange(n, device=q.device)
                    if causal:
                        last = L - s_q + torch.arange(s_q, device=q.device)   # query i sees keys <= last[i]
                        allowed = (pos[None, :] <= last[:, None])[:, None, :]
                    else:
                        allowed = torch.ones(s_q, 1, n, dtype=torch.bool, device=q.device)
                    scores = torch.einsum("shd,nd->shn", qb, keys) * softmax_scale
                    state.update(scores, allowed, keys[:, :NOPE])
            o, l = state.finish()
            if attn_sink is not None:
                sink = attn_sink.to(acc)[None, :]
                factor = torch.where(torch.isinf(l), torch.zeros_like(l), 1.0 / (1.0 + torch.exp(sink - l)))
                o = o * factor[..., None]
            out[b], lse[b] = o, l
        lse2 = torch.where(torch.isinf(lse), lse, lse * LOG2E).transpose(1, 2).to(torch.float32)
        if result_out is None:
            return out.to(q.dtype), lse2.contiguous()
        for b in range(B):                                                    # row by row into the caller's views
            result_out[b] = out[b]
            result_lse[b] = lse2[b]
        return result_out, result_lse


class BaseContractOp:
    """Dense decode over a latent cache, nothing declared (pages of 64, natural lse, +inf for no keys)."""

    name = "base-contract-op"

    def unsupported_reason(self, case):
        if case.topk is not None:
            return "implements dense decode only (no sparse indices)"
        if case.attn_sink:
            return "takes no attn_sink"
        if case.kv_format != "latent":
            return f"reads a latent cache in q's dtype only, not {case.kv_format}"
        return None

    def decode(self, q, kv_cache, block_table, cache_seqlens, *, softmax_scale, causal, indices=None,
               topk_length=None, attn_sink=None):
        if indices is not None or attn_sink is not None:
            raise NotImplementedError("dense decode only")
        B, s_q, h, _ = q.shape
        page = kv_cache.shape[1]
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        out = torch.zeros(B, s_q, h, NOPE, dtype=acc)
        lse = torch.full((B, h, s_q), math.inf, dtype=torch.float32)
        for b in range(B):
            L = int(cache_seqlens[b])
            if L == 0:
                continue
            pos = torch.arange(L)
            blocks = block_table[b].long()[pos // page]
            keys = kv_cache[blocks, pos % page, 0].to(acc)                   # [L, 576], only written slots
            for i in range(s_q):
                visible = L - s_q + i + 1 if causal else L
                if visible <= 0:
                    continue
                k = keys[:visible]
                logits = q[b, i].to(acc) @ k.T * softmax_scale                # [h, visible]
                out[b, i] = torch.softmax(logits, -1) @ k[:, :NOPE]
                lse[b, :, i] = torch.logsumexp(logits, -1).to(torch.float32)
        return out.to(q.dtype), lse
