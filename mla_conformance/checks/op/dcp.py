"""Decode context parallelism, shard by shard, in one process (mla_conformance.contract.dcp): a case's rows are
sharded over W ranks with interleave S, the op is called once per rank on its shard (as its ``dcp`` declaration says
a rank's call looks), the W partials are merged by lse in the op's ``dcp_lse_base`` (by the suite in float64, and
by the op's own ``dcp_combine`` where it has one), and the merge is held to the float64 oracle of the unsharded case
within the op's bound for two partial calls merged by lse (``compare(merged=True)``: the same bound as the split-KV
merge; each part's lse error moves its weight, whatever the number of parts).

The rules, each an ``assert_*``: :func:`assert_dcp_decode` (dense, sparse, causal, padding, FP8, sink),
:func:`assert_dcp_write` (each token on its owner's shard only). A failure names the op, the case, W, S, the
check, the measured error against its bound and, where the suite can tell, the likely cause: which rank's partial
is wrong and what it computed instead (a bound from the local length, ownership for S = 1, a shard read in another
base, an empty shard merged as a real partial, out sized by the local head count).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch

from mla_conformance.checks.op.compare import compare, oracle_of_inputs
from mla_conformance.checks.op.inputs import INVALID_BLOCK, Buffer, OpInputs, Spec, build, op_reason, require, where
from mla_conformance.checks.op.run import raised, validate
from mla_conformance.contract.dcp import dcp_declared, local_index, owned_count, owner
from mla_conformance.contract.op import D_V, MethodCase, OpCase, declared
from mla_conformance.impl.ops.reference import oracle as cache_oracle
from mla_conformance.model.attention_oracles import lse_to_natural

#: the world sizes and interleaves of the suite ("page": the case's page size)
WORLD_SIZES = (2, 4, 8)
INTERLEAVES = (1, "page", 64)


@dataclasses.dataclass(frozen=True)
class Sharding:
    world_size: int
    interleave: int

    def label(self) -> str:
        return f"DCP W={self.world_size} S={self.interleave}"


def require_dcp(op, what: str = "decode context parallelism") -> str:
    """The op's ``dcp`` convention, else skip with the sentence that would opt it in."""
    __tracebackhide__ = True
    conv = dcp_declared(op, "dcp")
    if conv == "none":
        pytest.skip(f"{op.name}: does not declare dcp (the op contract's optional declaration `dcp = \"local\"` or "
                    f"`\"global\"`: mla_conformance.contract.dcp), so {what} is not tested")
    return conv


def require_dcp_flag(op, key: str, what: str) -> None:
    __tracebackhide__ = True
    if not dcp_declared(op, key):
        pytest.skip(f"{op.name}: does not declare {key} (the op contract's optional DCP declaration `{key} = True`), "
                    f"so {what} is not tested")


# --------------------------------------------------------------------------- shards


@dataclasses.dataclass
class Shard:
    """One rank's inputs: its OpInputs (case, canaried buffers), the extra keywords of its call, and how its result
    maps back (``flat``: a causal case flattened to one query per row under the "local" convention)."""

    rank: int
    inputs: OpInputs
    kwargs: dict
    local_lens: tuple[int, ...]
    query_keys: torch.Tensor            # [B, s_q]: the keys each query sees on this rank
    flat: bool = False


def _owned_positions(L: int, sh: Sharding, rank: int) -> torch.Tensor:
    g = torch.arange(L)
    return g[(g // sh.interleave) % sh.world_size == rank]


def shard_cache(inp: OpInputs, sh: Sharding, rank: int, *, seed: int, extra_local: int = 0):
    """Rank ``rank``'s paged cache of the tokens it owns, copied byte for byte from the case's cache in their local
    order into a new shuffled cache (NaN / 0xFF in every unused slot; unused block-table entries INVALID_BLOCK; a
    padding row's entries -1, as vLLM leaves them). ``extra_local``: pages for that many more local tokens per row
    (a write's). Returns (cache, block_table, local lengths)."""
    case = inp.case
    page = case.page_block_size
    kv = inp.tensor("kv_cache").cpu()
    width = kv.shape[-1]
    flat = kv.reshape(-1, width)
    g = torch.Generator().manual_seed(5000 + seed * 97 + rank)
    owned = [_owned_positions(L, sh, rank) for L in inp.spec.lens]
    lens = [int(o.numel()) for o in owned]
    n_pages = [-(-(L + extra_local) // page) for L in lens]
    num_blocks = sum(n_pages) + 2
    perm = torch.randperm(num_blocks, generator=g)
    fill = 0xFF if kv.dtype == torch.uint8 else float("nan")
    cache = torch.full((num_blocks, page, 1, width), fill, dtype=kv.dtype)
    bt = torch.full((case.batch, max(n_pages) + 1), INVALID_BLOCK, dtype=torch.int32)
    used = 0
    for b, pos in enumerate(owned):
        if b >= case.batch - case.padding_rows and not lens[b]:
            bt[b] = -1
        ids = perm[used:used + n_pages[b]]
        used += n_pages[b]
        bt[b, :n_pages[b]] = ids.to(torch.int32)
        local = torch.arange(pos.numel())
        cache.view(-1, width)[ids[local // page] * page + local % page] = flat[inp.slots[b][pos]]
    return cache, bt, lens


def _query_keys(lens, s_q: int, causal: bool, sh: Sharding, rank: int) -> torch.Tensor:
    """[B, s_q]: the keys each query sees on this rank (causal: the owned ones below its global bound)."""
    rows = []
    for L in lens:
        bounds = [L - s_q + i + 1 if causal else L for i in range(s_q)]
        rows.append([owned_count(max(0, min(n, L)), sh.world_size, rank, sh.interleave) for n in bounds])
    return torch.tensor(rows, dtype=torch.int64)


def _local_case(case: OpCase, lens, query_keys: torch.Tensor, *, batch=None, s_q=None, causal=None) -> OpCase:
    """The case a rank's call is: its own rows without keys (an empty shard is a zero-length row)."""
    zero = any(L == 0 for L in lens)
    before = bool(((query_keys == 0) & (torch.tensor(lens)[:, None] > 0)).any()) if query_keys.numel() else False
    if case.sparse:  # a sparse query none of whose selected tokens is here: a row with no valid index
        zero, before = zero or bool((query_keys == 0).any()), False
    return dataclasses.replace(case, batch=case.batch if batch is None else batch, s_q=case.s_q if s_q is None else s_q,
                               causal=case.causal if causal is None else causal, attn_sink=False,
                               rows_without_keys=zero or before, zero_length_rows=zero,
                               queries_before_first_key=before)


def make_shard(op, inp: OpInputs, sh: Sharding, rank: int, *, positions: torch.Tensor | None = None,
               seed: int = 0) -> Shard:
    """Rank ``rank``'s call, by the op's ``dcp`` convention (mla_conformance.contract.dcp). ``positions``: sparse
    global token positions [B, s_q, k] (-1 invalid)."""
    conv = dcp_declared(op, "dcp")
    case = inp.case
    cache, bt, lens = shard_cache(inp, sh, rank, seed=seed)
    qk = _query_keys(inp.spec.lens, case.s_q, case.causal, sh, rank)
    q = inp.tensor("q").cpu()
    dev = case.device
    buf = lambda name, t: Buffer(name, t, device=dev)  # noqa: E731
    kwargs: dict = {}
    if conv == "global":
        buffers = {"q": buf("q", q), "kv_cache": buf("kv_cache", cache), "block_table": buf("block_table", bt),
                   "cache_seqlens": buf("cache_seqlens", torch.tensor(inp.spec.lens, dtype=torch.int32))}
        kwargs = {"dcp_world_size": sh.world_size, "dcp_rank": rank, "dcp_interleave": sh.interleave}
        if positions is not None:
            buffers["indices"] = buf("indices", positions)
        local = _local_case(case, lens, qk if positions is None else _sparse_keys(positions, inp.spec.lens, sh, rank))
        flat = False
    elif case.causal and case.s_q > 1 and positions is None:
        # the engine's glue: one query per row, each with its own local length, non-causal
        B, s_q = case.batch, case.s_q
        per_query = qk.reshape(-1)
        buffers = {"q": buf("q", q.reshape(B * s_q, 1, *q.shape[2:])), "kv_cache": buf("kv_cache", cache),
                   "block_table": buf("block_table", bt.repeat_interleave(s_q, 0)),
                   "cache_seqlens": buf("cache_seqlens", per_query.to(torch.int32))}
        local = _local_case(case, per_query.tolist(), per_query[:, None], batch=B * s_q, s_q=1, causal=False)
        flat = True
    else:
        buffers = {"q": buf("q", q), "kv_cache": buf("kv_cache", cache), "block_table": buf("block_table", bt),
                   "cache_seqlens": buf("cache_seqlens", torch.tensor(lens, dtype=torch.int32))}
        if positions is not None:  # the suite's glue: this rank's flat slots, -1 for another rank's tokens
            buffers["indices"] = buf("indices", _localise(positions, bt, inp.spec.lens, case.page_block_size, sh, rank))
            local = _local_case(case, lens, _sparse_keys(positions, inp.spec.lens, sh, rank))
        else:
            local = _local_case(case, lens, qk)
        flat = False
    if positions is not None and "topk_length" in inp.buffers:
        buffers["topk_length"] = buf("topk_length", inp.tensor("topk_length").cpu())
    spec = dataclasses.replace(inp.spec, case=local, lens=tuple(buffers["cache_seqlens"].view.tolist()))
    shard_inp = OpInputs(spec, buffers, inp.softmax_scale, [], [], cache.shape[0])
    return Shard(rank, shard_inp, kwargs, tuple(lens), qk, flat)


def _sparse_keys(positions, lens, sh: Sharding, rank: int) -> torch.Tensor:
    """[B, s_q]: the valid selected positions this rank owns."""
    pos = positions.long()
    L = torch.tensor(lens).view(-1, 1, 1)
    ok = (pos >= 0) & (pos < L) & ((pos // sh.interleave) % sh.world_size == rank)
    return ok.sum(-1)


def _localise(positions, bt, lens, page: int, sh: Sharding, rank: int) -> torch.Tensor:
    """The suite's glue under "local": global positions -> this rank's flat slots, -1 for another rank's."""
    out = torch.full(positions.shape, -1, dtype=torch.int32)
    for b in range(positions.shape[0]):
        for i in range(positions.shape[1]):
            for j, g in enumerate(positions[b, i].tolist()):
                if 0 <= g < lens[b] and owner(g, sh.world_size, sh.interleave) == rank:
                    li = local_index(g, sh.world_size, sh.interleave)
                    out[b, i, j] = int(bt[b, li // page]) * page + li % page
    return out


# --------------------------------------------------------------------------- running and merging


def run_rank(op, shard: Shard, check: str, *, h_q: int, world_size: int):
    """One rank's decode: declined -> skip; raised -> BackendError; out sized by another head count than the
    gathered h_q -> a failure naming it; inputs and canaries unchanged. Returns (out, lse) in the case's layout."""
    __tracebackhide__ = True
    inp = shard.inputs
    case = inp.case
    require(op, case)
    w = f"{where(op, case, check)} (rank {shard.rank})"
    try:
        result = op.decode(*inp.args(), **inp.kwargs(), **shard.kwargs)
    except Exception as exc:
        raise raised(op, case, f"{check} (rank {shard.rank})", "decode", exc,
                     {n: b.view for n, b in inp.buffers.items()}) from None
    for buf in inp.buffers.values():
        buf.check(op, case, f"{check} (rank {shard.rank})")
    if isinstance(result, (tuple, list)) and len(result) == 2 and isinstance(result[0], torch.Tensor):
        heads = result[0].shape[2] if result[0].dim() == 4 else None
        if heads is not None and heads != case.h_q:
            cause = (f"; likely cause: out sized by the local head count h_q / W = {h_q} / {world_size} (vLLM "
                     "#47779): under DCP every rank attends all the gathered heads" if heads * world_size == h_q
                     else "")
            raise AssertionError(f"{w}: out has {heads} heads, expected all {case.h_q} query heads "
                                 f"{tuple(result[0].shape)}{cause}")
    out, lse = validate(op, case, result, f"{check} (rank {shard.rank})")
    if shard.flat:  # back to [B, s_q, ...]
        B = len(shard.query_keys)
        out = out.reshape(B, -1, *out.shape[2:])
        lse = None if lse is None else lse.reshape(B, -1, lse.shape[1]).transpose(1, 2)
    return out, lse


def merge_partials(outs, lses, base: str):
    """W partials (out [B, s_q, h, d], lse [B, h, s_q] in ``base``) merged by lse in float64: (out, natural lse).
    An lse of +-inf is an empty shard (weight 0, its out not read), as is a part whose weight underflows to 0; a NaN
    lse stays NaN (a broken part is never hidden)."""
    nat = torch.stack([lse_to_natural(l.detach().cpu().to(torch.float64), base).transpose(1, 2) for l in lses])
    o = torch.stack([x.detach().cpu().to(torch.float64) for x in outs])           # [W, B, s_q, h, d]
    empty = torch.isinf(nat)
    finite = torch.where(empty, -math.inf, nat)
    m = finite.amax(0)
    none = torch.isinf(m)
    w = torch.where(empty, 0.0, torch.exp(finite - torch.where(none, 0.0, m)))
    total = w.sum(0)
    a = w / torch.where(none, 1.0, total)
    o = torch.where((a == 0)[..., None], 0.0, o)
    out = (a[..., None] * o).sum(0)
    lse = torch.where(none, math.inf, m + torch.log(torch.where(none, 1.0, total)))
    bad = torch.isnan(nat).any(0)
    out = torch.where(bad[..., None], math.nan, out)
    lse = torch.where(bad, math.nan, lse)
    return out, lse.transpose(1, 2)


def apply_sink(out, lse_nat, sink):
    """The attention sink applied once, to the merged result: out x exp(lse) / (exp(lse) + exp(sink))."""
    s = sink.detach().cpu().to(torch.float64).view(1, -1, 1)
    factor = torch.where(torch.isinf(lse_nat) & (lse_nat > 0), 0.0, torch.sigmoid(lse_nat - s))
    return out * factor.transpose(1, 2)[..., None]


# --------------------------------------------------------------------------- the rule


@dataclasses.dataclass
class DcpRun:
    shards: list
    parts: list             # (out, lse) per rank


def assert_dcp_decode(op, inp: OpInputs, oracle, sh: Sharding, *, check: str, figures: dict,
                      positions: torch.Tensor | None = None, sink: torch.Tensor | None = None,
                      real_rows: int | None = None) -> DcpRun:
    """The case's rows sharded over ``sh``; the op called once per rank; the partials merged by lse in the op's
    ``dcp_lse_base`` (and by its ``dcp_combine`` where it has one), the sink applied once after the merge; the merge
    held to ``oracle`` (the unsharded case's float64 oracle) within the op's bound. ``real_rows``: a padded case's
    real rows (the rest are padding: out 0 and lse the empty infinity, as the oracle has them)."""
    __tracebackhide__ = True
    case = inp.case
    base = dcp_declared(op, "dcp_lse_base")
    label = f"{check}, {sh.label()}"
    figures.update(case=case.describe(), check=label, op=op.name, dcp=dcp_declared(op, "dcp"),
                   dcp_world_size=sh.world_size, dcp_interleave=sh.interleave, dcp_lse_base=base)
    shards = [make_shard(op, inp, sh, r, positions=positions, seed=case.batch) for r in range(sh.world_size)]
    for s in shards:
        require(op, s.inputs.case)
    parts = [run_rank(op, s, label, h_q=case.h_q, world_size=sh.world_size) for s in shards]
    figures["dcp_keys_per_rank"] = [int(sum(s.local_lens)) for s in shards]
    figures["dcp_empty_shards"] = sum(1 for s in shards for L in s.local_lens if L == 0)
    run = DcpRun(shards, parts)
    if any(l is None for _, l in parts):
        pytest.skip(f"{op.name}: declares returns_lse = False: DCP partials cannot be merged without their lse")
    out, lse = merge_partials([p[0] for p in parts], [p[1] for p in parts], base)
    if sink is not None:
        out = apply_sink(out, lse, sink)
    w = f"{label} (the suite's merge of the {sh.world_size} ranks' partials in base {base})"
    try:
        compare(op, case, out, lse, oracle[0], oracle[1], check=w, figures=figures, oracle=oracle, lse_base="e",
                empty_lse=math.inf, merged=True, out_dtype=parts[0][0].dtype)
    except AssertionError as exc:
        cause = _likely_cause(op, inp, run, sh, oracle, base, sink)
        if cause:
            figures["likely_cause"] = cause[0]
        raise AssertionError(with_cause(exc, cause[1] if cause else "")) from None
    combine = getattr(op, "dcp_combine", None)
    if callable(combine):
        _assert_combine(op, case, run, sh, oracle, base, sink, label, figures)
    return run


def _assert_combine(op, case, run: DcpRun, sh: Sharding, oracle, base: str, sink, label: str, figures: dict) -> None:
    """The op's own combine of the same partials, held to the oracle as the suite's merge is."""
    __tracebackhide__ = True
    outs, lses = [p[0] for p in run.parts], [p[1] for p in run.parts]
    w = f"{label} (the op's dcp_combine of the {sh.world_size} ranks' partials)"
    try:
        result = op.dcp_combine([o.clone() for o in outs], [l.clone() for l in lses],
                                **({"attn_sink": sink} if sink is not None else {}))
    except Exception as exc:
        raise raised(op, case, label, "dcp_combine", exc) from None
    out, lse = validate(op, case, result, label)
    empty = math.inf if declared(op, "empty_row") == "+inf" else -math.inf
    try:
        compare(op, case, out, lse, oracle[0], oracle[1], check=w, figures={}, oracle=oracle, lse_base=base,
                empty_lse=empty, merged=True, out_dtype=outs[0].dtype)
    except AssertionError as exc:
        raise AssertionError(with_cause(exc, _combine_cause(op, case, run, sh, out, lse, base, oracle, sink))) from None
    figures["dcp_combine_checked"] = True


def with_cause(exc: BaseException, cause: str) -> str:
    """The failure's message with ``cause`` ('; likely cause: ...') at the end of its first line."""
    first, nl, rest = str(exc).partition("\n")
    return f"{first}{cause}{nl}{rest}"


def _passes(op, case, out, lse, oracle, base="e") -> bool:
    try:
        compare(op, case, out, lse, oracle[0], oracle[1], check="hint", figures={}, oracle=oracle, lse_base=base,
                empty_lse=math.inf, merged=True)
    except AssertionError:
        return False
    return True


def _combine_cause(op, case, run: DcpRun, sh: Sharding, out, lse, base: str, oracle, sink) -> str:
    """Why the op's combine of correct partials is wrong: an empty shard merged as a real partial, or the partials'
    lse read in the other base."""
    got = out.detach().cpu().to(torch.float64)
    lses = [p[1] for p in run.parts]
    empties = [torch.isinf(l.detach().cpu()).transpose(1, 2) for l in lses]       # [B, s_q, h] per rank
    any_empty = torch.stack(empties).any(0)
    nonfinite = ~torch.isfinite(got).all(-1)                                      # [B, s_q, h]
    if bool((nonfinite & any_empty).any()):
        b, i, h = (int(x) for x in (nonfinite & any_empty).nonzero()[0])
        ranks = [r for r, e in enumerate(empties) if bool(e[b, i, h])]
        return (f"; likely cause: an empty shard merged as a real partial -- rank(s) {ranks} hold no key of row {b} "
                f"(query {i}, head {h}) and returned lse {float(lses[ranks[0]][b, h, i])} (the empty-row marker), "
                "which the combine weighed as exp(lse - max) (inf - inf = NaN); an empty shard has weight 0")
    other = "2" if base == "e" else "e"
    # the combine read the partials in the other base: its result is the merge in that base
    wrong_out, wrong_lse = merge_partials([p[0] for p in run.parts], lses, other)
    if sink is not None:
        wrong_out = apply_sink(wrong_out, wrong_lse, sink)
    rtol = 4 * torch.finfo(out.dtype).eps + 1e-3
    if torch.allclose(got, wrong_out, rtol=rtol, atol=1e-5, equal_nan=True):
        return (f"; likely cause: the partials' lse are base {base} (dcp_lse_base) but the combine merged them as "
                f"base {other} (vLLM #47079: FlashInfer's base-2 lse combined as e)")
    return ""


def _likely_cause(op, inp: OpInputs, run: DcpRun, sh: Sharding, oracle, base: str, sink):
    """(short name, '; likely cause: ...') for a failing merge, from what the ranks returned."""
    other = "2" if base == "e" else "e"
    outs, lses = [p[0] for p in run.parts], [p[1] for p in run.parts]
    out, lse = merge_partials(outs, lses, other)
    if sink is not None:
        out = apply_sink(out, lse, sink)
    if _passes(op, inp.case, out, lse, oracle):
        return ("lse base", f"; likely cause: the ranks' lse are base {other}, merged here as the declared "
                            f"dcp_lse_base = {base!r} (vLLM #47079: FlashInfer's base-2 lse combined as e)")
    return _rank_cause(op, inp, run, sh, base)


def _rank_cause(op, inp: OpInputs, run: DcpRun, sh: Sharding, base: str):
    """The first rank whose partial is not the float64 attention over the keys it should see, what it should see
    and, where its lse matches the attention over another number of its local keys, which rule gives that number."""
    case = inp.case
    if case.sparse:
        return _sparse_rank_cause(op, inp, run, sh, base)
    s_q = case.s_q
    for shard, (out, lse) in zip(run.shards, run.parts):
        r = shard.rank
        keys_for = {"right": shard.query_keys}
        local = torch.tensor(shard.local_lens)[:, None]
        if case.causal:
            keys_for["a causal bound from the rank-local length (L_local - s_q + i + 1, TokenSpeed #364; the "
                     "global bound L - s_q + i + 1 mapped to the rank is the rule)"] = (
                local - s_q + torch.arange(s_q) + 1).clamp(0)
        if sh.interleave > 1:
            keys_for[f"ownership computed for S = 1 at S = {sh.interleave} (ATOM #2087: the rank counted "
                     f"ceil((n - rank) / W) of a row's n tokens)"] = torch.tensor(
                [[owned_count(int(n), sh.world_size, r, 1) for n in
                  ([L - s_q + i + 1 for i in range(s_q)] if case.causal else [L] * s_q)] for L in inp.spec.lens])
        got = lse_to_natural(lse.detach().cpu().to(torch.float64), base)      # [B, h, s_q]
        ref = {name: _local_lse(inp, shard, k) for name, k in keys_for.items()}
        if _close(got, ref["right"]):
            continue
        for name, k in keys_for.items():
            if name == "right" or torch.equal(k, shard.query_keys):
                continue
            past = (k > local) & ~torch.isfinite(got).all(1)          # [B, s_q]: it read past its shard's keys
            if bool(past.any()):
                b, i = (int(x) for x in past.nonzero()[0])
                return (name.split(" (")[0], f"; likely cause: {name}: rank {r} holds {shard.local_lens[b]} keys of "
                                             f"row {b} and read {int(k[b, i])} (its lse at query {i} is not finite: "
                                             "the slots past its keys are poisoned)")
            if _close(got, ref[name]):
                return (name.split(" (")[0], f"; likely cause: {name}: rank {r}'s lse matches the attention over "
                                             f"{_first_diff(k, shard.query_keys)}")
        b, i = _first_bad(got, ref["right"])
        return ("rank partial", f"; likely cause: rank {r}'s partial: row {b} query {i} should attend its "
                                f"{int(shard.query_keys[b, i])} local keys (of {shard.local_lens[b]} it holds; "
                                f"global length {inp.spec.lens[b]}), its lse is {float(got[b, 0, i]):.6g}, expected "
                                f"{float(ref['right'][b, 0, i]):.6g}")
    return None


def _sparse_rank_cause(op, inp: OpInputs, run: DcpRun, sh: Sharding, base: str):
    """The first rank whose sparse partial is not the attention over the selected positions it owns, and which
    misreading of the global positions gives what it returned."""
    pos = run.shards[0].inputs.tensor("indices") if dcp_declared(op, "dcp") == "global" else None
    if pos is None:
        return None
    pos = pos.cpu()
    page = inp.case.page_block_size
    for shard, (out, lse) in zip(run.shards, run.parts):
        t = {n: b.view.detach().cpu() for n, b in shard.inputs.buffers.items()}
        got = lse_to_natural(lse.detach().cpu().to(torch.float64), base)
        def lse_of(slots):
            return cache_oracle(t["q"], t["kv_cache"], t["block_table"], t["cache_seqlens"],
                                softmax_scale=inp.softmax_scale, causal=False, indices=slots,
                                topk_length=t.get("topk_length"))[1]
        right = _localise(pos, t["block_table"], inp.spec.lens, page, sh, shard.rank)
        if _close(got, lse_of(right)):
            continue
        bt = t["block_table"].long()
        col = torch.where(pos >= 0, pos.long() // page, 0).clamp(max=bt.shape[1] - 1)
        blocks = torch.gather(bt, 1, col.reshape(pos.shape[0], -1)).reshape(pos.shape)
        raw = torch.where(pos >= 0, blocks * page + pos.long() % page, -1).to(torch.int32)
        candidates = {"the indexer's global positions used as this rank's local ones, neither filtered to the tokens "
                      "it owns nor localised (vLLM #54541 / #46514)": raw}
        if sh.interleave > 1:
            candidates[f"ownership computed for S = 1 at S = {sh.interleave} (ATOM #2087)"] = _localise(
                pos, t["block_table"], inp.spec.lens, page, Sharding(sh.world_size, 1), shard.rank)
        for name, slots in candidates.items():
            if _close(got, lse_of(slots)):
                return (name.split(" (")[0], f"; likely cause: {name}: rank {shard.rank}'s partial is the attention "
                                             "over the slots that reading gives")
        return ("rank partial", f"; likely cause: rank {shard.rank}'s partial is not the attention over the selected "
                                "positions it owns (filtered to (g // S) % W == rank, localised through its block "
                                "table)")
    return None


def _first_diff(k, right) -> str:
    b, i = (int(x) for x in (k != right).nonzero()[0])
    return f"{int(k[b, i])} local keys at row {b} query {i} instead of {int(right[b, i])}"


def _first_bad(got, ref):
    d = ~_close_mask(got, ref)
    b, _, i = (int(x) for x in d.nonzero()[0]) if bool(d.any()) else (0, 0, 0)
    return b, i


def _close_mask(a, b):
    both = (torch.isinf(a) & torch.isinf(b)) | (torch.isnan(a) & torch.isnan(b))
    return both | ((a - b).abs() <= 1e-3 * (1 + b.abs()))


def _close(a, b) -> bool:
    return bool(_close_mask(a, b).all())


def _local_lse(inp: OpInputs, shard: Shard, keys: torch.Tensor) -> torch.Tensor:
    """[B, h, s_q] natural lse of the float64 attention of each query over the first ``keys[b, i]`` tokens of its
    row's shard (read through the shard's cache; at most the tokens the shard holds)."""
    t = {n: b.view.detach().cpu() for n, b in shard.inputs.buffers.items()}
    B, s_q = keys.shape
    q = inp.tensor("q").cpu().reshape(B * s_q, 1, *inp.tensor("q").shape[2:])
    bt = t["block_table"][:B] if not shard.flat else t["block_table"][::s_q]
    lens = keys.clamp(max=torch.tensor(shard.local_lens)[:, None]).reshape(-1)
    _, lse = cache_oracle(q, t["kv_cache"], bt.repeat_interleave(s_q, 0), lens, softmax_scale=inp.softmax_scale,
                          causal=False)
    return lse.reshape(B, s_q, -1).transpose(1, 2)


# --------------------------------------------------------------------------- building cases


def sharding(case: OpCase, world_size: int, interleave) -> Sharding:
    return Sharding(world_size, case.page_block_size if interleave == "page" else int(interleave))


def sparse_positions(lens, s_q: int, topk: int, seed: int, *, invalid: bool = True) -> torch.Tensor:
    """The indexer's global token positions [B, s_q, topk] (distinct, within each row; a quarter -1)."""
    g = torch.Generator().manual_seed(300 + seed)
    out = torch.full((len(lens), s_q, topk), -1, dtype=torch.int32)
    for b, L in enumerate(lens):
        for i in range(s_q):
            n = min(L, topk)
            out[b, i, :n] = torch.randperm(L, generator=g)[:n].to(torch.int32)
            if invalid and n > 2:
                drop = torch.rand(n, generator=g) < 0.25
                drop[1] = False
                out[b, i, :n][drop] = -1
    return out


@functools.lru_cache(maxsize=16)
def sparse_oracle(spec: Spec, topk: int, seed: int):
    """(global inputs with flat-slot indices, oracle): the unsharded sparse case the positions select."""
    inp = build(spec)
    pos = sparse_positions(spec.lens, spec.case.s_q, topk, seed)
    slots = torch.full_like(pos, -1)
    for b in range(pos.shape[0]):
        ok = pos[b] >= 0
        slots[b][ok] = inp.slots[b][pos[b][ok].long()].to(torch.int32)
    sparse_case = dataclasses.replace(spec.case, topk=topk)
    glob = inp.derive(indices=slots)
    glob = dataclasses.replace(glob, spec=dataclasses.replace(spec, case=sparse_case))
    return glob, pos, oracle_of_inputs(glob)


def sink_values(h_q: int) -> torch.Tensor:
    values = (0.0, 2.0, 4.0, math.inf, -math.inf, 6.0)
    return torch.tensor([values[h % len(values)] for h in range(h_q)], dtype=torch.float32)


def with_sink_case(inp: OpInputs) -> OpInputs:
    """The inputs described as a case with a sink (the ranks are called without it)."""
    return dataclasses.replace(inp, spec=dataclasses.replace(inp.spec, case=dataclasses.replace(inp.case,
                                                                                              attn_sink=True)))


@functools.lru_cache(maxsize=8)
def sink_oracle(spec: Spec):
    inp = build(spec)
    sink = sink_values(spec.case.h_q)
    glob = inp.derive(attn_sink=sink)
    return sink, oracle_of_inputs(glob)


# --------------------------------------------------------------------------- write


def assert_dcp_write(op, sh: Sharding, *, page: int, dtype, device: str, check: str, figures: dict,
                     seed: int = 0) -> None:
    """New tokens of several rows (a decode step of one token per row, a chunk of several) written under DCP: each
    rank's write gets the tokens as its ``dcp`` convention says; afterwards every rank's cache holds exactly the
    tokens it owns at their local slots, bit for bit, and every other byte is what it was."""
    __tracebackhide__ = True
    conv = dcp_declared(op, "dcp")
    g = torch.Generator().manual_seed(700 + seed)
    starts = (0, 5, 37, 3)                  # tokens already in each row
    news = (9, 1, 20, 1)                    # new tokens per row
    rows = [b for b, n in enumerate(news) for _ in range(n)]
    positions = torch.tensor([starts[b] + k for b, n in enumerate(news) for k in range(n)], dtype=torch.int64)
    T = len(rows)
    kv_c = torch.randn(T, D_V, generator=g, dtype=torch.float64).to(dtype)
    k_pe = torch.randn(T, 64, generator=g, dtype=torch.float64).to(dtype)
    mcase = MethodCase(method="write", dtype=dtype, tokens=T, d_qk=D_V + 64, d_v=D_V, kv_format="latent",
                       page_block_size=page, device=device)
    reason = op_reason(op, mcase)
    if reason:
        pytest.skip(f"{op.name}: {reason}")
    if "latent" not in declared(op, "write_kv_formats") or page not in declared(op, "write_page_block_sizes"):
        pytest.skip(f"{op.name}: write_kv_formats {declared(op, 'write_kv_formats')} / write_page_block_sizes "
                    f"{declared(op, 'write_page_block_sizes')} do not take latent pages of {page}")
    label = f"{check}, {sh.label()}"
    figures.update(case=mcase.describe(), check=label, op=op.name, dcp_world_size=sh.world_size,
                   dcp_interleave=sh.interleave)
    per_rank = []
    for r in range(sh.world_size):
        gr = torch.Generator().manual_seed(900 + 31 * seed + r)
        li = torch.tensor([local_index(int(p), sh.world_size, sh.interleave) for p in positions])
        n_pages = [int(li[[t for t in range(T) if rows[t] == b]].max()) // page + 1 for b in range(len(news))]
        num_blocks = sum(n_pages) + 2
        perm = torch.randperm(num_blocks, generator=gr)
        bt = torch.full((len(news), max(n_pages)), INVALID_BLOCK, dtype=torch.int64)
        used = 0
        for b, n in enumerate(n_pages):
            bt[b, :n] = perm[used:used + n]
            used += n
        cache = torch.full((num_blocks, page, 1, D_V + 64), float("nan"), dtype=dtype)
        slot = bt[torch.tensor(rows), li // page] * page + li % page                     # as if this rank owned it
        own = torch.tensor([owner(int(p), sh.world_size, sh.interleave) == r for p in positions])
        before = cache.clone()
        kwargs = {}
        if conv == "global":
            mapping = slot.clone()
            kwargs = {"dcp_world_size": sh.world_size, "dcp_rank": r, "dcp_interleave": sh.interleave,
                      "dcp_positions": positions.clone().to(device)}
        else:
            mapping = torch.where(own, slot, -1)
        cache_dev = cache.to(device)
        try:
            op.write(kv_c.to(device), k_pe.to(device), cache_dev, mapping.to(device), kv_format="latent", **kwargs)
        except Exception as exc:
            raise raised(op, mcase, f"{label} (rank {r})", "write", exc) from None
        got = cache_dev.cpu()
        want = before.clone()
        want.view(-1, D_V + 64)[slot[own]] = torch.cat([kv_c, k_pe], -1)[own]
        per_rank.append(int(own.sum()))
        gb = got.reshape(-1, D_V + 64).contiguous().view(torch.uint8).reshape(-1, (D_V + 64) * got.element_size())
        wb = want.reshape(-1, D_V + 64).contiguous().view(torch.uint8).reshape(-1, (D_V + 64) * got.element_size())
        diff = (gb != wb).any(-1)
        if bool(diff.any()):
            s = int(diff.nonzero()[0])
            owned_here = {int(x): t for t, x in enumerate(slot.tolist()) if bool(own[t])}
            strays = [t for t in range(T) if not bool(own[t]) and int(slot[t]) == s]
            if s in owned_here:
                t = owned_here[s]
                what = (f"the slot of token {t} (row {rows[t]}, position {int(positions[t])}, owned by rank {r}) does "
                        "not hold it")
                if strays:
                    what += (f"; token {strays[0]} (position {int(positions[strays[0]])}, owned by rank "
                             f"{owner(int(positions[strays[0]]), sh.world_size, sh.interleave)}) maps to the same "
                             "local slot")
            else:
                what = f"slot {s}, which holds none of its tokens, changed"
                if strays:
                    what += (f": token {strays[0]} (row {rows[strays[0]]}, position {int(positions[strays[0]])}) "
                             f"is owned by rank {owner(int(positions[strays[0]]), sh.world_size, sh.interleave)}")
            rows_got = {bytes(r.numpy()) for r in gb}
            mine = torch.cat([kv_c, k_pe], -1).reshape(T, -1).contiguous().view(torch.uint8)
            found = {t for t in range(T) if bytes(mine[t].numpy()) in rows_got}
            s1 = {t for t in range(T) if owner(int(positions[t]), sh.world_size, 1) == r}
            owned_set = {t for t in range(T) if bool(own[t])}
            # S = 1's ownership: every token g with g % W == r written, or some of them where the rank owns none
            # (a subset of its own tokens is a dropped write, not this)
            if sh.interleave > 1 and found and found <= s1 and (found == s1 or not found <= owned_set):
                strays, what = [], what + ("; likely cause: ownership computed for S = 1 at S = "
                                           f"{sh.interleave} (ATOM #2087): the rank wrote tokens g with g % W == {r}"
                                           f"{' (every one)' if found == s1 else ''}, not the tokens it owns")
            nstray = int((diff).sum())
            raise AssertionError(f"{where(op, mcase, label)}: rank {r}'s cache after the write: {what}; {nstray} slot(s) "
                                 f"differ; likely cause: a rank writing tokens it does not own -- under DCP token g "
                                 f"lives only on rank (g // S) % W (vLLM masks every other token's slot to -1)"
                                 if strays else
                                 f"{where(op, mcase, label)}: rank {r}'s cache after the write: {what}; {nstray} "
                                 "slot(s) differ from its owned tokens at their local slots")
    figures.update(dcp_tokens_per_rank=per_rank, tokens=T)
    assert sum(per_rank) == T
