"""Ops declaring the wide support a Triton kernel would (page_block_sizes up to 256 with sizes that are not powers
of two, any head count, sparse decode with any top-k), written from the op contract with torch and math only
(nothing of mla_conformance: not its reference-op, not its oracle), for tests/meta/test_generated_meta.py:

* :class:`WideOp` is correct: each row's keys read through the block table, one softmax per query in float32
  (float64 for a float64 q), out rounded once to q's dtype. It must pass every generated op test;
* each ``Broken*`` op is :class:`WideOp` wrong on one geometry class only, each from the public record, and
  right on every shape the hand-written op suite uses (h_q 1, 3, 8, 16, 64, 128; pages 1, 16, 64; s_q 1, 2, 4,
  8; rows of at most a few hundred keys; batches of a few rows; top-32). The default run of
  suites/test_op_generated.py must fail each, with a shrunk case that shows the class.
"""

from __future__ import annotations

import math

import torch

NOPE = 512
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class WideOp:
    name = "wide-geometry-op"
    sparse_decode = True
    invalid_index = "out-of-range"
    attn_sink = True
    page_block_sizes = (1, 16, 48, 64, 100, 256)

    def unsupported_reason(self, case):
        if case.kv_format != "latent":
            return "reads a latent cache in q's dtype only"
        if case.page_block_size not in self.page_block_sizes:
            return f"reads pages of {', '.join(map(str, self.page_block_sizes))} tokens"
        if case.dtype not in FLOATS:
            return f"takes a float16, bfloat16, float32 or float64 q, not {case.dtype}"
        return None

    # ---- the geometry a kernel gets wrong: each broken op overrides one of these

    def rows_computed(self, batch: int) -> range:
        """The rows the launch grid covers."""
        return range(batch)

    def positions_read(self, length: int, page: int) -> torch.Tensor:
        """The positions of a row's keys the op reads (all of them)."""
        return torch.arange(length)

    def causal_limits(self, length: int, s_q: int, causal: bool) -> torch.Tensor:
        """Per query: keys at positions below this are visible (bottom-right aligned)."""
        i = torch.arange(s_q)
        return length - s_q + i + 1 if causal else torch.full((s_q,), length)

    def entries_read(self, k: int) -> int:
        """How many of a sparse query's first k index entries are read."""
        return k

    def heads_written(self, out: torch.Tensor, lse: torch.Tensor) -> None:
        """out [s_q, h, 512] and lse [s_q, h] of one row, as the head tiles leave them (all written)."""

    # ---- the computation

    @staticmethod
    def _attend(q: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor, scale: float):
        """q [s_q, h, 576], keys [n, 576], allowed [s_q, n]: out [s_q, h, 512], natural lse [s_q, h] (+inf for a
        query with no key, whose out is 0)."""
        scores = torch.einsum("shd,nd->shn", q, keys) * scale
        ok = allowed[:, None, :]
        scores = torch.where(ok, scores, torch.full_like(scores, -math.inf))
        m = scores.amax(-1) if scores.shape[-1] else torch.full(scores.shape[:2], -math.inf, dtype=q.dtype)
        safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        p = torch.where(ok, torch.exp(scores - safe[..., None]), torch.zeros_like(scores))
        total = p.sum(-1)
        empty = total == 0
        out = torch.einsum("shn,nd->shd", p, keys[:, :NOPE]) / torch.where(empty, 1.0, total)[..., None]
        lse = torch.where(empty, torch.full_like(total, math.inf), safe + torch.log(torch.where(empty, 1.0, total)))
        return torch.where(empty[..., None], torch.zeros_like(out), out), lse

    def decode(self, q, kv_cache, block_table, cache_seqlens, *, softmax_scale, causal, indices=None,
               topk_length=None, attn_sink=None):
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        B, s_q, h, _ = q.shape
        page = kv_cache.shape[1]
        flat = kv_cache.reshape(kv_cache.shape[0] * page, kv_cache.shape[-1])
        out = torch.zeros(B, s_q, h, NOPE, dtype=acc, device=q.device)
        lse = torch.full((B, s_q, h), math.inf, dtype=acc, device=q.device)
        for b in self.rows_computed(B):
            qb = q[b].to(acc)
            if indices is None:
                length = int(cache_seqlens[b])
                pos = self.positions_read(length, page).to(q.device)
                slots = block_table[b].long()[pos // page] * page + pos % page
                keys = flat[slots].to(acc)
                limits = self.causal_limits(length, s_q, causal).to(q.device)
                out[b], lse[b] = self._attend(qb, keys, pos[None, :] < limits[:, None], softmax_scale)
            else:
                for i in range(s_q):
                    row = indices[b, i].long()
                    n = row.numel() if topk_length is None else min(int(topk_length[b]), row.numel())
                    row = row[:self.entries_read(n)]
                    row = row[(row >= 0) & (row < flat.shape[0])]
                    keys = flat[row].to(acc)
                    o, l = self._attend(qb[i:i + 1], keys, torch.ones(1, row.numel(), dtype=torch.bool,
                                                                       device=q.device), softmax_scale)
                    out[b, i], lse[b, i] = o[0], l[0]
            self.heads_written(out[b], lse[b])
        if attn_sink is not None:
            factor = 1.0 / (1.0 + torch.exp(attn_sink.to(acc).view(1, 1, h) - lse))   # 0 for an empty query
            out = out * torch.where(torch.isinf(lse) & (lse > 0), torch.zeros_like(factor), factor)[..., None]
        return out.to(q.dtype), lse.transpose(1, 2).contiguous().to(torch.float32)


class BrokenPageBitmask(WideOp):
    """Finds the offset in a page with a bit mask (``pos & (P' - 1)``, P' = 2^floor(log2 P)) and loops over P'
    tokens per page: of a page of a size that is not a power of two it reads only the first P' tokens (aiter:
    page_block_size > 1 silently wrong)."""

    name = "broken-page-bitmask"

    def positions_read(self, length, page):
        pos = torch.arange(length)
        return pos[pos % page < 2 ** int(math.floor(math.log2(page)))]


class BrokenTailHeadTile(WideOp):
    """Heads in tiles of 64: the last, partial tile (h_q > 64, h_q % 64 != 0, e.g. 126 heads after TP) is never
    written (FlashMLA tests 63 and 126 heads)."""

    name = "broken-tail-head-tile"

    def heads_written(self, out, lse):
        h = out.shape[1]
        if h > 64 and h % 64:
            out[:, 64 * (h // 64):] = 0
            lse[:, 64 * (h // 64):] = 0


class BrokenOddHeads(WideOp):
    """Heads in pairs above 8 heads: of an odd count (9, 63) the last head gets its neighbour's result."""

    name = "broken-odd-heads"

    def heads_written(self, out, lse):
        h = out.shape[1]
        if h > 8 and h % 2:
            out[:, -1] = out[:, -2]
            lse[:, -1] = lse[:, -2]


class BrokenCausalNonPow2(WideOp):
    """Causal multi-token decode with s_q not a power of two (3, 5, 6 draft tokens) masked as if non-causal:
    every query sees every key (aiter: q_len 6 gives the same output at every position)."""

    name = "broken-causal-non-pow2"

    def causal_limits(self, length, s_q, causal):
        if causal and s_q & (s_q - 1):
            return torch.full((s_q,), length)
        return super().causal_limits(length, s_q, causal)


class BrokenRowsCapped(WideOp):
    """Reads at most 2048 keys of a row (a block-table walk capped at 32 pages of 64)."""

    name = "broken-rows-capped-2048"

    def positions_read(self, length, page):
        return torch.arange(min(length, 2048))


class BrokenBatchCapped(WideOp):
    """Launches at most 32 rows: rows 32 and up are never computed (a capped grid; FlashInfer tests 1,024 rows)."""

    name = "broken-batch-capped-32"

    def rows_computed(self, batch):
        return range(min(batch, 32))


class BrokenTopkTail(WideOp):
    """Sparse top-k read in blocks of 64: above 64, the entries past the last whole block are dropped."""

    name = "broken-topk-tail-dropped"

    def entries_read(self, k):
        return k // 64 * 64 if k > 64 and k % 64 else k
