"""Glue the prefill adapters share: a ragged prefill's queries that have no key, set to what the op contract
says (out 0, lse the declared infinity) whatever the kernel left there."""

from __future__ import annotations

import torch


def queries_without_keys(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, causal: bool) -> torch.Tensor:
    """bool [total_q]: a query of a row with no keys, or (causal, aligned bottom-right: query i of a row with m
    queries and n keys sees keys j <= n - m + i) one before its row's first key."""
    dev = cu_seqlens_q.device
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    k_lens = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).long().to(dev)
    total_q = int(q_lens.sum())
    row = torch.repeat_interleave(torch.arange(q_lens.numel(), device=dev), q_lens, output_size=total_q)
    empty = k_lens[row] == 0
    if causal:
        i = torch.arange(total_q, device=dev) - cu_seqlens_q.long()[row]
        empty |= i < (q_lens - k_lens)[row]
    return empty


def with_empty_queries(out: torch.Tensor, lse: torch.Tensor, empty: torch.Tensor, empty_lse: float):
    """``out`` [total_q, h, d] 0 and ``lse`` [total_q, h] ``empty_lse`` at the queries ``empty`` marks."""
    if not bool(empty.any()):
        return out, lse
    out = torch.where(empty[:, None, None], torch.zeros((), dtype=out.dtype, device=out.device), out)
    return out, torch.where(empty[:, None], torch.full((), empty_lse, device=lse.device), lse)
