"""Broken DCP ops (issue 44): each is reference-op with one bug a public report found in decode context parallelism,
and each must be *failed* (an AssertionError naming the cause, not an error) by the test of suites/test_op_dcp.py
named for it in tests/meta/test_dcp_meta.py. reference-op's DCP form is dcp = "global": global lengths / positions
and (W, rank, S), mapped per rank; the bug is the only difference."""

from __future__ import annotations

import math

import torch

from mla_conformance.impl.ops.reference import ReferenceOp


def _owned(n, W, r, S):
    n = n.clamp_min(0)
    return (n // (S * W)) * S + (n % (S * W) - r * S).clamp(0, S)


class Base2CombinedAsE(ReferenceOp):
    """FlashInfer-like: its decode returns lse in base 2 (declared, lse_base = dcp_lse_base = "2"), and its DCP
    combine weighs the ranks by exp(lse - max), as if base e (vLLM #47079: Kimi-K2.5 under DCP 4)."""

    name = "broken-dcp-base2-combined-as-e"
    lse_base = "2"
    dcp_lse_base = "2"

    def decode(self, *args, **kwargs):
        out, lse = super().decode(*args, **kwargs)
        return out, lse / math.log(2.0)

    def dcp_combine(self, outs, lses, *, attn_sink=None):
        lse = torch.stack(lses).double()                          # [W, B, h, s] -- read as natural logs
        m = torch.where(torch.isinf(lse), -math.inf, lse).amax(0)
        m = torch.where(torch.isinf(m), 0.0, m)
        w = torch.where(torch.isinf(lse), 0.0, torch.exp(lse - m))
        total = w.sum(0)
        a = (w / torch.where(total == 0, 1.0, total)).transpose(2, 3)[..., None]
        out = (a * torch.stack(outs).double()).sum(0)
        merged = torch.where(total == 0, math.inf, m + torch.log(torch.where(total == 0, 1.0, total)))
        if attn_sink is not None:
            factor = torch.where(torch.isinf(merged), 0.0, torch.sigmoid(merged - attn_sink.double().view(1, -1, 1)))
            out = out * factor.transpose(1, 2)[..., None]
        return out.to(outs[0].dtype), merged.float()


class Base2MergedAsE(ReferenceOp):
    """The same kernel (lse in base 2, lse_base = "2"), its DCP partials declared natural (dcp_lse_base left "e"):
    the engine's combine reads them as e."""

    name = "broken-dcp-base2-merged-as-e"
    lse_base = "2"

    def decode(self, *args, **kwargs):
        out, lse = super().decode(*args, **kwargs)
        return out, lse / math.log(2.0)


class GlobalIndicesNotLocalised(ReferenceOp):
    """Sparse decode under DCP: the indexer's global positions used as this rank's local positions -- neither
    filtered to the tokens it owns nor localised (vLLM #54541 / #46514: each rank read unrelated cache slots)."""

    name = "broken-dcp-global-indices"

    def decode(self, q, kv_cache, block_table, cache_seqlens, *, indices=None, dcp_world_size=None, dcp_rank=None,
               dcp_interleave=None, **kw):
        if indices is None or dcp_world_size is None:
            return super().decode(q, kv_cache, block_table, cache_seqlens, indices=indices,
                                  dcp_world_size=dcp_world_size, dcp_rank=dcp_rank, dcp_interleave=dcp_interleave, **kw)
        page = kv_cache.shape[1]
        pos = indices.long()
        B = pos.shape[0]
        col = torch.where(pos >= 0, pos // page, 0).clamp(max=block_table.shape[1] - 1)
        blocks = torch.gather(block_table.long(), 1, col.reshape(B, -1)).reshape(pos.shape)
        slots = torch.where(pos >= 0, blocks * page + pos % page, -1).to(torch.int32)
        return super().decode(q, kv_cache, block_table, cache_seqlens, indices=slots, **kw)


class LocalLengthCausalBound(ReferenceOp):
    """Causal multi-token decode under DCP with the bound taken from the rank-local length: query i sees local keys
    < L_local - s_q + i + 1 (TokenSpeed #364)."""

    name = "broken-dcp-local-causal-bound"

    def decode(self, q, kv_cache, block_table, cache_seqlens, *, dcp_world_size=None, dcp_rank=None,
               dcp_interleave=None, **kw):
        if dcp_world_size is None or not kw.get("causal") or kw.get("indices") is not None:
            return super().decode(q, kv_cache, block_table, cache_seqlens, dcp_world_size=dcp_world_size,
                                  dcp_rank=dcp_rank, dcp_interleave=dcp_interleave, **kw)
        local = _owned(cache_seqlens.long(), dcp_world_size, dcp_rank, dcp_interleave).to(cache_seqlens.dtype)
        return super().decode(q, kv_cache, block_table, local, **kw)   # bottom-right on the local length


class OwnershipForS1(ReferenceOp):
    """Ownership written for S = 1 (token g on rank g % W) whatever the interleave (ROCm ATOM #2087)."""

    name = "broken-dcp-ownership-s1"

    def decode(self, *args, dcp_interleave=None, **kw):
        return super().decode(*args, dcp_interleave=None if dcp_interleave is None else 1, **kw)

    def write(self, *args, dcp_interleave=None, **kw):
        return super().write(*args, dcp_interleave=None if dcp_interleave is None else 1, **kw)


class EmptyShardAsRealPartial(ReferenceOp):
    """Its DCP combine takes the max over the ranks' lse as they are: a rank holding none of a row's keys returns
    lse +inf (its empty-row marker), the max is +inf and exp(inf - inf) is NaN."""

    name = "broken-dcp-empty-shard-merged"

    def dcp_combine(self, outs, lses, *, attn_sink=None):
        lse = torch.stack(lses).double()                          # [W, B, h, s]
        m = lse.amax(0)
        w = torch.exp(lse - m)
        total = w.sum(0)
        a = (w / total).transpose(2, 3)[..., None]
        out = (a * torch.stack(outs).double()).sum(0)
        merged = m + torch.log(total)
        if attn_sink is not None:
            out = out * torch.sigmoid(merged - attn_sink.double().view(1, -1, 1)).transpose(1, 2)[..., None]
        return out.to(outs[0].dtype), merged.float()


class WritesUnownedTokens(ReferenceOp):
    """Its DCP write puts every token of the step into this rank's cache, owned or not."""

    name = "broken-dcp-writes-unowned"

    def write(self, kv_c, k_pe, kv_cache, slot_mapping, *, kv_format, dcp_world_size=None, dcp_rank=None,
              dcp_interleave=None, dcp_positions=None):
        return super().write(kv_c, k_pe, kv_cache, slot_mapping, kv_format=kv_format)


class OutputSizedByLocalHeads(ReferenceOp):
    """Under DCP its out (and lse) are sized from the local head count h_q / W instead of the gathered h_q
    (vLLM #47779)."""

    name = "broken-dcp-local-heads"

    def decode(self, *args, dcp_world_size=None, **kw):
        out, lse = super().decode(*args, dcp_world_size=dcp_world_size, **kw)
        if dcp_world_size is None:
            return out, lse
        h = out.shape[2] // int(dcp_world_size)
        return out[:, :, :h].contiguous(), lse[:, :h].contiguous()
