"""Correct DCP ops (issue 44): reference-op's decode with the ranks' partials combined as engines combine them, in one
process -- vLLM's all-gather of the lse then reduce-scatter of the corrected outputs over heads, and an all-to-all
over heads -- written without the suite's merge; and reference-op called as an ordinary decode per shard
(dcp = "local", the engine's glue doing the mapping). Each must pass suites/test_op_dcp.py."""

from __future__ import annotations

import math

import torch

from mla_conformance.impl.ops.reference import ReferenceOp


def _weights(lses):
    """[W, B, h, s] lse (natural) -> normalised weights and the merged lse; an infinite lse (an empty shard) weighs 0,
    as vLLM's correct_attn_out maps it to -inf."""
    lse = torch.stack(lses).double()
    lse = torch.where(torch.isinf(lse) | torch.isnan(lse), -math.inf, lse)
    m = lse.amax(0)
    m0 = torch.where(torch.isinf(m), 0.0, m)
    w = torch.exp(lse - m0)
    total = w.sum(0)
    merged = torch.where(total == 0, math.inf, m0 + torch.log(torch.where(total == 0, 1.0, total)))
    return w / torch.where(total == 0, 1.0, total), merged


def _sink(out, merged, attn_sink):
    if attn_sink is None:
        return out
    factor = torch.where(torch.isinf(merged), 0.0, torch.sigmoid(merged - attn_sink.double().view(1, -1, 1)))
    return out * factor.transpose(1, 2)[..., None]


class AllGatherReduceScatterOp(ReferenceOp):
    """vLLM's cp_lse_ag_out_rs: every rank all-gathers the W lse, scales its own out by its weight, and a
    reduce-scatter over heads sums the scaled outs, rank k keeping head chunk k."""

    name = "dcp-ag-rs"

    def dcp_combine(self, outs, lses, *, attn_sink=None):
        W, h = len(outs), outs[0].shape[2]
        a, merged = _weights(lses)                                    # all-gathered on every rank
        scaled = [outs[r].double() * a[r].transpose(1, 2)[..., None] for r in range(W)]   # each rank's own
        chunks = [sum(s[:, :, k * h // W:(k + 1) * h // W] for s in scaled) for k in range(W)]  # reduce-scatter
        out = _sink(torch.cat(chunks, dim=2), merged, attn_sink)
        return out.to(outs[0].dtype), merged.float()


class AllToAllOp(ReferenceOp):
    """An all-to-all over heads: rank k receives head chunk k of every rank's out and lse and merges the W."""

    name = "dcp-all-to-all"

    def dcp_combine(self, outs, lses, *, attn_sink=None):
        W, h = len(outs), outs[0].shape[2]
        parts, lse_parts = [], []
        for k in range(W):
            sl = slice(k * h // W, (k + 1) * h // W)
            a, merged = _weights([l[:, sl] for l in lses])
            parts.append(sum(outs[r][:, :, sl].double() * a[r].transpose(1, 2)[..., None] for r in range(W)))
            lse_parts.append(merged)
        merged = torch.cat(lse_parts, dim=1)
        return _sink(torch.cat(parts, dim=2), merged, attn_sink).to(outs[0].dtype), merged.float()


class LocalShardOp(ReferenceOp):
    """reference-op called as a plain decode on each rank's shard: local lengths, local slots (dcp = "local")."""

    name = "dcp-local"
    dcp = "local"


class Base2WithBase2CombineOp(ReferenceOp):
    """FlashInfer-like lse in base 2, declared as such for DCP too (dcp_lse_base = "2"): merged right."""

    name = "dcp-base2"
    lse_base = "2"
    dcp_lse_base = "2"

    def decode(self, *args, **kwargs):
        out, lse = super().decode(*args, **kwargs)
        return out, lse / math.log(2.0)
