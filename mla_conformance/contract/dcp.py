"""Decode context parallelism (DCP) on the op contract: what one rank's decode call receives when a row's tokens are
sharded over W ranks, and how its partial results are merged. Opt-in (``dcp``; default ``"none"``): an op that does
not declare it is never called this way, and the DCP suite (suites/test_op_dcp.py) skips it with a sentence.

Ownership (vLLM's ``cp_kv_cache_interleave_size``, TokenSpeed's, ATOM's): token g of a row lives on rank
``(g // S) % W`` for an interleave S (1 in vLLM's first DCP, the page size for PD transfer); on its owner it is
local token ``(g // (S * W)) * S + g % S`` (the owned tokens in their global order). Each rank keeps its own paged
cache of the tokens it owns, its own block table over it (row b's j-th local page is ``kv_cache[block_table[b, j]]``).

What a rank's ``decode`` receives, by the op's ``dcp`` declaration:

* ``"local"``: an ordinary decode call over its shard: its cache, its block table and its local lengths (the
  number of tokens of row b it owns, 0 allowed: a row shorter than W leaves some ranks nothing). The caller (the
  engine's glue, the suite here) does the mapping: a causal multi-token case comes flattened to one query per row
  with that query's own local length (the keys it sees on this rank), non-causal; sparse indices (``dcp_sparse``)
  come as flat slots of this rank's cache (-1 for every selected token another rank owns).
* ``"global"``: its cache and block table, but ``cache_seqlens`` the rows' **global** lengths and the keywords
  ``dcp_world_size=W``, ``dcp_rank=r``, ``dcp_interleave=S``: the op maps them (the keys row b holds here:
  :func:`owned_count` of its length; causal query i of s_q sees the local keys whose global position is below
  ``L - s_q + i + 1``: :func:`owned_count` of that bound, ``ceil((bound - r) / W)`` for S = 1 -- not a bound from
  the local length, TokenSpeed #364); sparse indices (``dcp_sparse``) are the indexer's **global token positions**
  in the row (0 .. L - 1, -1 invalid), which the op filters to the ones it owns and localises through its block
  table (vLLM #54541 fed them to a converter assuming local ones).

Either way out is [B, s_q, h_q, 512] over **all** h_q query heads (DCP all-gathers the heads; vLLM #47779 sized it
from the local head count) and lse [B, h_q, s_q] in ``dcp_lse_base``; a query with no key on this rank (an empty
shard) gives out 0 and lse its ``empty_row`` infinity, and is merged as empty (weight 0), never as a real partial.
The W partials are merged by lse in ``dcp_lse_base`` (vLLM #47079: FlashInfer's lse in base 2 combined as e) by the
caller, or by the op's own ``dcp_combine(outs, lses, *, attn_sink=None) -> (out, lse)`` where it has one (a list of
the W ranks' out / lse, returning the merged out and lse in ``dcp_lse_base``: vLLM's all-gather + reduce-scatter or
an all-to-all, run here in one process). The attention sink is not handed to the ranks: it is applied once, to the
merged result (the combine's ``attn_sink``).

``write`` under DCP (``dcp_write``): under ``"local"`` each rank's write gets the caller's slot mapping (its owned
tokens' local slots, -1 for every other token, as vLLM's ``compute_slot_mapping`` masks it); under ``"global"`` it
gets for every token the slot its local index would take in this rank's cache (vLLM's mapping before its ownership
mask) plus ``dcp_positions`` (int64 [T], each token's global position in its row) and the three keywords, and writes
only the tokens it owns. Either way every token lands on its owner's shard and nowhere else.

Pure python (no torch): the report and the docs read it.
"""

from __future__ import annotations

from mla_conformance.contract.methods import Declaration, choice, flag
from mla_conformance.errors import BackendSpecError

#: dcp: how a rank's call receives the sharding (above); "none": the op is not run under DCP
CONVENTIONS = ("none", "local", "global")

DCP_DECLARATIONS: tuple[Declaration, ...] = (
    choice("dcp", "none", CONVENTIONS),
    choice("dcp_lse_base", "e", ("e", "2")),
    flag("dcp_sparse", False),
    flag("dcp_write", False),
)
_BY_NAME = {d.name: d for d in DCP_DECLARATIONS}

#: the keywords a rank's call gets under dcp = "global"
DCP_KEYWORDS = ("dcp_world_size", "dcp_rank", "dcp_interleave")


def dcp_declared(op, key: str):
    """The op's DCP declaration ``key`` (its attribute), else its default; a value outside the allowed ones is a
    BackendSpecError naming the op and the attribute."""
    decl = _BY_NAME.get(key)
    if decl is None:
        raise ValueError(f"{key!r} is not a DCP declaration (they are: {', '.join(_BY_NAME)})")
    value = getattr(op, key, None)
    return decl.default if value is None else decl.validate(getattr(op, "name", op), value)


def dcp_declarations(op) -> dict:
    """Every DCP declaration of an op that declares ``dcp`` (what the report prints), else {}."""
    if dcp_declared(op, "dcp") == "none":
        return {}
    found = {d.name: dcp_declared(op, d.name) for d in DCP_DECLARATIONS}
    found["dcp_combine"] = callable(getattr(op, "dcp_combine", None))
    return found


def owner(g: int, world_size: int, interleave: int) -> int:
    """The rank that holds global token ``g``."""
    return (g // interleave) % world_size


def local_index(g: int, world_size: int, interleave: int) -> int:
    """Global token ``g``'s index among its owner's tokens of the row."""
    return (g // (interleave * world_size)) * interleave + g % interleave


def owned_count(n: int, world_size: int, rank: int, interleave: int) -> int:
    """How many of the global tokens 0 .. n - 1 rank ``rank`` holds (``ceil((n - rank) / W)`` for S = 1)."""
    if n <= 0:
        return 0
    cycle = interleave * world_size
    full, rest = divmod(n, cycle)
    return full * interleave + min(max(rest - rank * interleave, 0), interleave)


def check_world(world_size: int, rank: int, interleave: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size or interleave < 1:
        raise BackendSpecError(f"DCP world size {world_size}, rank {rank}, interleave {interleave}: need W >= 1, "
                               "0 <= rank < W, S >= 1")


__all__ = ["CONVENTIONS", "DCP_DECLARATIONS", "DCP_KEYWORDS", "dcp_declared", "dcp_declarations", "owner",
           "local_index", "owned_count", "check_world"]
