"""Op contract, decode context parallelism (mla_conformance.contract.dcp), shard by shard in one process: each case's
rows sharded over W = 2, 4, 8 ranks with interleave S = 1, the page size, 64 (token g on rank (g // S) % W; rows
shorter than W, and rows within one interleave, leave ranks with nothing), the op called once per rank as its
``dcp`` declaration says a rank's call looks, the W partials merged by lse in its ``dcp_lse_base`` (and by its own
``dcp_combine`` where it has one), the merge held to the float64 oracle of the unsharded case within the op's bound
for partials merged by lse. Dense, causal multi-token (q_len 3), sparse (the indexer's global positions), padding
rows, the FP8 cache, the attention sink (applied once, after the merge), and the write (each token on its owner's
shard only). An op that does not declare ``dcp`` skips every test, naming it (opt-in). See
mla_conformance.checks.op.dcp."""

import dataclasses

import pytest
import torch

from mla_conformance.checks import op as op_checks
from mla_conformance.checks.op import dcp

WORLD = pytest.mark.parametrize("world_size", dcp.WORLD_SIZES, ids=lambda w: f"W{w}")
INTERLEAVE = pytest.mark.parametrize("interleave", dcp.INTERLEAVES, ids=lambda s: f"S{s}")
#: a long row (every rank holds some of it at S = 64, W = 8), rows shorter than W, a row of one page
LENS = (37, 600, 3, 1, 130)
CAUSAL_LENS = (37, 300, 2, 130)   # the row of 2: its first query of 3 has no key
SPARSE_LENS = (40, 300, 30)
PADDED_LENS = (37, 300, 5, 0, 0)  # two padding rows (cache_seqlens 0) after the real ones


def _case(op, lens, **kw):
    return op_checks.make_case(op, lens=lens, h_q=8, **kw)


@pytest.mark.mla_section("op-dcp")
@WORLD
@INTERLEAVE
def test_dcp_dense(mla_op, world_size, interleave, mla_device, mla_figures):
    """Dense decode, one query per row: the merge of the ranks' partials equals the unsharded oracle."""
    dcp.require_dcp(mla_op)
    case = _case(mla_op, LENS, s_q=1, device=mla_device)
    spec = op_checks.Spec(case, LENS, seed=40)
    dcp.assert_dcp_decode(mla_op, op_checks.build(spec), op_checks.oracle_of(spec),
                          dcp.sharding(case, world_size, interleave),
                          check="DCP dense decode", figures=mla_figures)


@pytest.mark.mla_section("op-dcp")
@WORLD
@INTERLEAVE
def test_dcp_causal(mla_op, world_size, interleave, mla_device, mla_figures):
    """Causal multi-token decode at q_len 3 (MTP / speculative): each query's keys are the owned ones below its
    global bound L - 3 + i + 1, mapped per rank (not a bound from the rank-local length: TokenSpeed #364)."""
    dcp.require_dcp(mla_op)
    case = _case(mla_op, CAUSAL_LENS, s_q=3, causal=True, device=mla_device, multi_token=True)
    spec = op_checks.Spec(case, CAUSAL_LENS, seed=41)
    dcp.assert_dcp_decode(mla_op, op_checks.build(spec), op_checks.oracle_of(spec),
                          dcp.sharding(case, world_size, interleave),
                          check="DCP causal decode (q_len 3)", figures=mla_figures)


@pytest.mark.mla_section("op-dcp")
@WORLD
@INTERLEAVE
def test_dcp_sparse(mla_op, world_size, interleave, mla_device, mla_figures):
    """Sparse decode: the indexer's global top-32 positions per query (a quarter -1), filtered to each rank's own
    tokens and localised (by the op under dcp = "global", by the suite's glue under "local"; vLLM #54541)."""
    dcp.require_dcp(mla_op)
    dcp.require_dcp_flag(mla_op, "dcp_sparse", "sparse decode under DCP")
    case = _case(mla_op, SPARSE_LENS, s_q=2, topk=32, device=mla_device)
    dense = op_checks.Spec(dataclasses.replace(case, topk=None), SPARSE_LENS, seed=42)
    glob, positions, oracle = dcp.sparse_oracle(dense, 32, 42)
    dcp.assert_dcp_decode(mla_op, glob, oracle, dcp.sharding(case, world_size, interleave),
                          check="DCP sparse decode (global top-32 positions)", figures=mla_figures,
                          positions=positions)


@pytest.mark.mla_section("op-dcp")
@WORLD
@INTERLEAVE
def test_dcp_padding_rows(mla_op, world_size, interleave, mla_device, mla_figures):
    """Two padding rows (cache_seqlens 0, block-table rows -1 on every rank): out 0 and lse the empty infinity
    after the merge; the real rows as the oracle."""
    dcp.require_dcp(mla_op)
    case = _case(mla_op, PADDED_LENS, s_q=1, device=mla_device, padding_rows=2)
    spec = op_checks.Spec(case, PADDED_LENS, seed=43)
    dcp.assert_dcp_decode(mla_op, op_checks.build(spec), op_checks.oracle_of(spec),
                          dcp.sharding(case, world_size, interleave),
                          check="DCP decode with padding rows", figures=mla_figures)


@pytest.mark.mla_section("op-dcp")
@WORLD
@INTERLEAVE
def test_dcp_fp8(mla_op, world_size, interleave, mla_device, mla_figures):
    """The FP8 656-byte cache (where the op reads it): each rank's shard holds its tokens' bytes as written."""
    dcp.require_dcp(mla_op)
    case = _case(mla_op, LENS, s_q=1, kv_formats=("fp8-e4m3-flashmla",), device=mla_device)
    spec = op_checks.declared_spec(mla_op, case, LENS, seed=44)
    dcp.assert_dcp_decode(mla_op, op_checks.build(spec), op_checks.oracle_of(spec),
                          dcp.sharding(case, world_size, interleave),
                          check="DCP decode over the FP8 cache", figures=mla_figures)


@pytest.mark.mla_section("op-dcp")
@WORLD
@INTERLEAVE
def test_dcp_attn_sink(mla_op, world_size, interleave, mla_device, mla_figures):
    """The attention sink (per head 0, 2, 4, +inf, -inf, 6) is not handed to the ranks: it is applied once, to the
    merged result (by the op's dcp_combine where it has one)."""
    dcp.require_dcp(mla_op)
    case = _case(mla_op, LENS, s_q=1, device=mla_device)
    spec = op_checks.Spec(case, LENS, seed=45)
    sink, oracle = dcp.sink_oracle(spec)
    dcp.assert_dcp_decode(mla_op, dcp.with_sink_case(op_checks.build(spec)), oracle,
                          dcp.sharding(case, world_size, interleave),
                          check="DCP decode, attention sink after the merge", figures=mla_figures, sink=sink)


@pytest.mark.mla_section("op-dcp")
@WORLD
@INTERLEAVE
def test_dcp_write(mla_op, world_size, interleave, mla_device, mla_figures):
    """New tokens (one per row, and chunks of 9 and 20) written under DCP: each lands on its owner's shard at its
    local slot, bit for bit, and nowhere else."""
    dcp.require_dcp(mla_op)
    dcp.require_dcp_flag(mla_op, "dcp_write", "the write under DCP")
    if not callable(getattr(mla_op, "write", None)):
        pytest.skip(f"{mla_op.name}: has no write(kv_c, k_pe, kv_cache, slot_mapping, *, kv_format)")
    page = op_checks.pick_page(mla_op)
    sh = dcp.Sharding(world_size, page if interleave == "page" else int(interleave))
    dcp.assert_dcp_write(mla_op, sh, page=page, dtype=torch.bfloat16, device=mla_device,
                         check="DCP write", figures=mla_figures)
