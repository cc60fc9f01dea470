"""A backend that runs across ranks (issue 44): opt-in, by ``distributed``, the plans it runs (a tuple of
:data:`PLANS`). The suite (suites/test_distributed.py) starts W real processes with torch's own launcher
(``torch.multiprocessing`` spawn; a gloo group on the CPU: NCCL on CUDA is not implemented), one process group over
them, and in each rank:

1. resolves the backend from its spec (as ``--mla-backend`` names it), calls ``backend.distribute(parallel)`` with a
   :class:`Parallel` (the plan, W, this rank, the group, the TP and DCP sizes and ranks, the DCP interleave);
2. hands ``attend`` this rank's shard of the weights by the backend's ``tp_plan`` (weight name -> "heads-rows",
   "heads-cols" or "replicate"; any it leaves out as in :data:`TP_PLAN`) or :data:`TP_PLAN` (Megatron / vLLM's plan for MLA: the query
   and kv_b projections split by heads -- column-parallel --, o_proj split by its input columns -- row-parallel, the
   backend all-reducing its output --, the latent projection and norms replicated), an ``MLAWeights`` whose config
   has ``num_attention_heads = H / tp_size``; the same hidden states on every rank;
3. holds every rank's output (after its own reduction) to the single-process float64 reference, and measures the
   cache bytes the rank wrote: under TP each rank's latent cache holds every token (W copies, reported as the
   redundancy DCP removes), under DCP exactly the tokens the rank owns by the interleave (token g on rank
   ``(g // S) % W``: mla_conformance.contract.dcp).

Plans: ``"tp"`` (tp_size W: heads split, latent cache whole on every rank), ``"dcp"`` (dcp_size W: every rank all
heads, the tokens sharded, partial attentions merged by lse over the group), ``"tp+dcp"`` (tp_size = dcp_size = W
over the same ranks, as vLLM runs DCP inside its TP group: heads split for the projections, the queries all-gathered
over the group to attend each rank's tokens for every head, the merge reduce-scattered back to each rank's heads).

A rank that raises, crashes or hangs is a verdict naming the rank (what it raised, its exit code or signal, where
its stack was); the other ranks' results are kept and no process is left.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mla_conformance.errors import BackendSpecError

PLANS = ("tp", "dcp", "tp+dcp")

#: weight name -> how TP splits it: "heads-rows" (rows grouped by head: column-parallel), "heads-cols" (columns
#: grouped by head: row-parallel, the output all-reduced), "replicate"
TP_PLAN: dict[str, str] = {
    "q_proj.weight": "heads-rows",
    "q_a_proj.weight": "replicate",
    "q_a_layernorm.weight": "replicate",
    "q_b_proj.weight": "heads-rows",
    "kv_a_proj_with_mqa.weight": "replicate",
    "kv_a_layernorm.weight": "replicate",
    "kv_b_proj.weight": "heads-rows",
    "o_proj.weight": "heads-cols",
}


@dataclasses.dataclass(frozen=True)
class Parallel:
    """What ``backend.distribute`` receives: the plan, the world (size, this rank, the torch.distributed group of
    every rank), the TP and DCP sizes and this rank's place in each (both groups are ``group`` where their size is
    W), and the DCP interleave S."""

    plan: str
    world_size: int
    rank: int
    group: Any
    tp_size: int
    tp_rank: int
    dcp_size: int
    dcp_rank: int
    interleave: int = 1

    @classmethod
    def of(cls, plan: str, world_size: int, rank: int, group=None, interleave: int = 1) -> "Parallel":
        if plan not in PLANS:
            raise BackendSpecError(f"distributed plan {plan!r} is not one of {', '.join(PLANS)}")
        tp = world_size if "tp" in plan else 1
        dcp = world_size if "dcp" in plan else 1
        return cls(plan, world_size, rank, group, tp, rank if tp > 1 else 0, dcp, rank if dcp > 1 else 0,
                   interleave)


def declared_plans(backend) -> tuple[str, ...]:
    """The plans the backend declares (``distributed``), () where it declares none; a value outside :data:`PLANS`
    is a BackendSpecError naming the backend."""
    value = getattr(backend, "distributed", None)
    if not value:
        return ()
    plans = (value,) if isinstance(value, str) else tuple(value)
    bad = [p for p in plans if p not in PLANS]
    if bad:
        raise BackendSpecError(f"backend {getattr(backend, 'name', backend)!r}: distributed {value!r}: {bad} not "
                               f"among {', '.join(PLANS)}")
    return plans


__all__ = ["PLANS", "TP_PLAN", "Parallel", "declared_plans"]
