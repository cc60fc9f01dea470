"""Op contract: state between calls and static shapes across calls, as a CUDA graph replays a decode step: the
same tensors (same storage, shapes sized for the largest batch) refilled in place with every step's batch, smaller
ones padded up with rows of cache_seqlens 0 (their block-table rows, queries and sparse indices as the engine left
them, indices -1). Each call's result is what a fresh call on that batch gives: the float64 oracle, and bitwise a
fresh call on copies where the op declares deterministic; nothing of an earlier batch (stale pages, lengths,
indices) leaks into a later one (mla_conformance.checks.op.replay). Every test runs once per op (--mla-op)."""

import pytest

from mla_conformance.checks import op as op_checks
from mla_conformance.checks.op.replay import Replay, check_replay
from mla_conformance.contract.op import declared

#: captured for 4 rows; the batches of 4 replays: full, 2 real rows with padding between, 2 real rows then
#: padding, full again with longer rows (every length changes, every row's pages move)
BATCHES = ((300, 45, 7, 130), (64, 0, 200, 0), (17, 90, 0, 0), (1, 400, 33, 64))
TOPK = 32


@pytest.mark.mla_section("op-replay")
@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_graph_replay(mla_op, kind, mla_device, mla_figures):
    """4 calls on one set of tensors refilled in place; dense, and sparse decode (where declared: a padding row's
    indices are -1, its topk_length 0)."""
    sparse = kind == "sparse"
    case = op_checks.make_case(mla_op, lens=BATCHES[1], s_q=1, h_q=4, topk=TOPK if sparse else None,
                        kv_formats=("latent", "fp8-e4m3-flashmla") if sparse else ("latent",), device=mla_device,
                        padding_rows=2)
    check_replay(mla_op, Replay(case, BATCHES, seed=41 if sparse else 40,
                                scale_format=declared(mla_op, "fp8_scale_format")),
                 check=f"graph replay ({kind}: one set of tensors refilled for every batch)", figures=mla_figures)
