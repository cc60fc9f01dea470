"""Comparing an op's (out, lse) with a float64 oracle, the one place it is written: the decode layout (out
[B, s_q, h, d], lse [B, h, s_q]: :func:`compare`, :func:`check_against_oracle`) and the token layout of the
optional methods (out [T, h, d], lse [T, h]: :func:`compare_attention`, for prefill, sparse_prefill, merge and
their compositions) go through the same checks (:func:`_judge`), each layout naming its indices
(:class:`Layout`): lse converted from the op's declared base; a query with no keys must give out exactly 0 and
the declared empty-row infinity; NaN in a query with keys fails; every other element within its own bound
(:class:`Bounds`), derived per element from the oracle's magnitudes (:func:`bounds`, :func:`attention_bounds`,
:class:`~mla_conformance.checks.tolerances.OpTolerance`) or a method's own rule (a merge's).

Every failure message (:mod:`mla_conformance.messages`) opens with one line: the op, the case
(:meth:`OpCase.describe`), the check, what differs and where its worst element is, measured against its bound and
how many times over; then the likely cause when one is found, got / expected and how many values are over, and
the bound's key in docs/tolerances.md (its derivation is there, not in the message). ``figures`` (the test's
``mla_figures``) is filled before anything is raised."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import torch

from mla_conformance.checks.metrics import OP_NAN_HINT as NAN_HINT
from mla_conformance.checks.metrics import dtype_name
from mla_conformance.checks.op.inputs import OpInputs, Spec, build, require, where
from mla_conformance.checks.op.run import run_op
from mla_conformance.checks.tolerances import (OP_LSE_ROUNDING, OP_TOLERANCES, op_acc_roundings, underflow,
                                               unit_roundoff)
from mla_conformance.contract.op import D_V, OpCase, declared
from mla_conformance.impl.ops.reference import dequantize_cache, oracle
from mla_conformance.messages import bound_line, failure, over, split_cause, with_cause
from mla_conformance.model.attention_oracles import lse_to_natural, to_natural


def _oracle_inputs(inp: OpInputs) -> dict:
    t = {n: b.view.detach().cpu() for n, b in inp.buffers.items()}
    return dict(q=t["q"], kv_cache=t["kv_cache"], block_table=t["block_table"], cache_seqlens=t["cache_seqlens"],
                softmax_scale=inp.softmax_scale, causal=inp.case.causal, indices=t.get("indices"),
                topk_length=t.get("topk_length"), attn_sink=t.get("attn_sink"))


def key_magnitudes(count_out: torch.Tensor, count_lse: torch.Tensor) -> dict:
    """``keys`` [B, 1, s_q] (the keys each query attends) and ``abs_v_sum`` [B, s_q, 1, d_v] (sum_t |v_t| over
    them), what the bounds' key-count and underflow terms scale with, from an oracle run with softmax_scale 0,
    no attention sink, one head of zeros and the cache's |values| (every key weighs 1 / n): lse = ln n, out =
    mean_t |v_t|. A caller with its own oracle (prefill, merges) gets them the same way. (An oracle whose
    magnitudes carry ``keys`` and ``abs_v_sum`` itself -- two sums in its loop -- spares :func:`oracle_of` this
    second oracle pass over every case.)"""
    keys = torch.where(torch.isfinite(count_lse), torch.exp(count_lse).round(), torch.zeros_like(count_lse))
    return {"keys": keys, "abs_v_sum": count_out * keys.transpose(1, 2)[..., None]}


def _key_counts(inp: OpInputs, align: str) -> dict:
    kw = _oracle_inputs(inp)
    values = dequantize_cache(kw["kv_cache"], torch.float64)[..., :D_V].abs()     # V: the first 512 channels
    B, s_q = kw["q"].shape[:2]
    kw.update(q=torch.zeros(B, s_q, 1, values.shape[-1], dtype=torch.float64), kv_cache=values, softmax_scale=0.0,
              attn_sink=None)
    return key_magnitudes(*oracle(**kw, align=align))


def oracle_of_inputs(inp: OpInputs, align: str = "bottom-right") -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The float64 oracle of built inputs as they are now (not cached: inputs refilled in place between calls
    have one per call): (out [B, s_q, h_q, 512], natural lse [B, h_q, s_q] with +inf for no keys, the
    magnitudes the error bounds scale with: see ``oracle(magnitudes=True)``, and :func:`key_magnitudes`)."""
    out, lse, mags = oracle(**_oracle_inputs(inp), magnitudes=True, align=align)
    return out, lse, mags if "keys" in mags else {**mags, **_key_counts(inp, align)}


@functools.lru_cache(maxsize=64)
def oracle_of(spec: Spec) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The float64 oracle of a spec, computed once (:func:`oracle_of_inputs` of its built inputs)."""
    return oracle_of_inputs(build(spec))


@functools.lru_cache(maxsize=8)
def tf32_oracle_of(spec: Spec, mode: str) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The oracle of a float32 latent spec whose q and cache are cut to TF32 (10 mantissa bits; ``mode``:
    mla_conformance.impl.ops.triton_faithful.TF32_MODES): asked only once a float32 check has failed, to name
    TF32 inputs as the likely cause."""
    from mla_conformance.impl.ops.triton_faithful import tf32_round  # numpy only: no triton

    inp = build(spec)
    kw = _oracle_inputs(inp)
    kw.update({k: torch.from_numpy(tf32_round(kw[k].numpy(), mode)) for k in ("q", "kv_cache")})
    out, lse, mags = oracle(**kw, magnitudes=True)
    return out, lse, mags if "keys" in mags else {**mags, **_key_counts(inp, "bottom-right")}


@functools.lru_cache(maxsize=16)
def top_left_oracle_of(spec: Spec) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The oracle of a causal spec aligned top-left (query i sees keys 0..i): asked only once a causal check
    has failed, to name the likely cause."""
    return oracle_of_inputs(build(spec), align="top-left")


# --------------------------------------------------------------------------- comparing


def tolerance_for(case: OpCase):
    key = "fp8-e4m3-flashmla" if case.kv_format == "fp8-e4m3-flashmla" else dtype_name(case.dtype)
    return key, OP_TOLERANCES[key]


def bounds(tol, mags: dict, ref_out: torch.Tensor, ref_lse: torch.Tensor, out_dtype, *, merged: bool = False):
    """Per-element bound on |out - oracle| [B, s_q, h, d] and per-query bound on |lse - oracle| [B, h, s_q]
    (natural log) of one side of a comparison (:class:`mla_conformance.checks.OpTolerance` derives them).

    ``out_dtype``: the dtype that side returned out in (its rounding: half a step of it, or its underflow
    constant, whichever is larger). ``merged``: that side is two partial calls merged by LSE: each part's out
    rounding is relative to the part's |out| (sum: u_out S, not u_out |ref|; the parts' underflows, weighted by
    their shares, sum to one eta_out), the parts' lse errors move their weights (2 x the lse bound x S), and
    their score terms use A_max (T already does). ``mags`` with ``keys`` / ``abs_v_sum``
    (:func:`key_magnitudes`) makes the accumulation term grow with each query's key count and adds P's
    underflow; without them (a caller that has no counts) the accumulation is taken for up to OP_ACC_KEYS keys
    and P's underflow is left out."""
    u_out, eta_out = unit_roundoff(out_dtype), underflow(out_dtype)
    abs_v, score_v = mags["abs_v"], mags["score_v"]
    per_q = lambda x: x.transpose(1, 2)[..., None]                                   # [B, h, s] -> [B, s, h, 1]
    keys = mags.get("keys")
    acc = tol.acc if keys is None else tol.acc_at(keys)                                # scalar or [B, 1, s]
    finite = torch.where(torch.isfinite(ref_lse), ref_lse.abs(), torch.zeros_like(ref_lse))
    score = mags["score_max"] if merged else mags["score_abs"]
    lse_b = tol.dot * score + (acc + OP_LSE_ROUNDING) * (1.0 + finite + (1.0 if merged else 0.0))
    acc_q = acc if keys is None else per_q(acc)
    out_b = (tol.p_round + acc_q) * abs_v + tol.dot * score_v + per_q(mags["sink_rel"] * lse_b) * ref_out.abs()
    out_b = out_b + (u_out * abs_v + 2.0 * per_q(lse_b) * abs_v if merged else u_out * ref_out.abs()) + eta_out
    if keys is not None:
        lse_b = lse_b + tol.acc_under * keys
        out_b = out_b + tol.p_under * mags["abs_v_sum"] + tol.acc_under * per_q(op_acc_roundings(keys))
    return out_b, lse_b


@dataclasses.dataclass
class Bounds:
    """Per-element bound on |out - ref| (out's shape), per-query bound on |lse - ref| (lse's shape; natural log),
    the name of the rule (the ``tolerance`` figure; a failure message names it by :func:`bound_key`, its
    derivation being docs/tolerances.md's) and what a failure message adds of the worst element's query (its key
    count, both sides bounded): ``context_out`` at an out index, ``context_lse`` at an lse index."""

    out: torch.Tensor
    lse: torch.Tensor
    name: str
    context_out: Callable[[tuple], str]
    context_lse: Callable[[tuple], str]
    terms: dict = dataclasses.field(default_factory=dict)   # figures: the rule's terms


def bound_key(name: str) -> str:
    """The key a failure message names a bound by in docs/tolerances.md: ``OP_TOLERANCES["bfloat16"]`` for a row
    of the op table, the rule's own name (``merge float32``, ``composition of 3 parts, float32``) otherwise."""
    return f'OP_TOLERANCES["{name}"]' if name in OP_TOLERANCES else name


def _terms(tol, out_dtype) -> dict:
    return {"tolerance_p_round": tol.p_round, "tolerance_dot": tol.dot, "tolerance_acc": tol.acc,
            "tolerance_u_out": torch.finfo(out_dtype).eps / 2}


def decode_bounds(key: str, tol, mags: dict, ref_out, ref_lse, out_dtype, *, merged: bool = False,
                  ref_dtype=None) -> Bounds:
    """:func:`bounds` in the decode layout (out [B, s_q, h, d], lse [B, h, s_q]) as :class:`Bounds`; with
    ``ref_dtype`` (the reference is another result of the op) its own bound added."""
    out_b, lse_b = bounds(tol, mags, ref_out, ref_lse, out_dtype, merged=merged)
    if ref_dtype is not None:
        ref_out_b, ref_lse_b = bounds(tol, mags, ref_out, ref_lse, ref_dtype)
        out_b, lse_b = out_b + ref_out_b, lse_b + ref_lse_b
    terms = _terms(tol, out_dtype)

    both = "both sides bounded (the reference is another result of the op)" if ref_dtype is not None else ""

    def context_out(at):
        return "; ".join(x for x in (_keys_of(mags, at[0], at[1]), both) if x)

    def context_lse(i):
        return _keys_of(mags, i[0], i[2])

    return Bounds(out_b, lse_b, key, context_out, context_lse, terms)


def attention_bounds(case, mags: dict, ref_out, ref_lse, out_dtype) -> Bounds:
    """The bounds of one attention kernel call in the token layout (out [T, h, d], lse [T, h]): :func:`bounds`
    (OP_TOLERANCES, derived for a kernel that scores in float32, rounds P to the input dtype, accumulates in
    float32) on the decode layout [1, T, h, d] / [1, h, T]."""
    key, tol = tolerance_for(case)
    per_q = {k: mags[k].T[None] for k in ("score_abs", "score_max", "sink_rel")}
    m4 = {"abs_v": mags["abs_v"][None], "score_v": mags["score_v"][None], **per_q}
    out_b, lse_b = bounds(tol, m4, ref_out[None], ref_lse.T[None], out_dtype)
    return Bounds(out_b[0], lse_b[0].T, key, lambda i: "", lambda i: "", _terms(tol, out_dtype))


def compare(op, case: OpCase, out, lse, ref_out, ref_lse, *, check: str, figures: dict, oracle, lse_base=None,
            empty_lse=None, merged: bool = False, out_dtype=None, ref_dtype=None,
            against: str = "the float64 oracle") -> dict:
    """out [B, s_q, h, d] / lse [B, h, s_q] of the op against a reference (out float64, lse natural float64 with
    +inf for no keys): the checks of :func:`_judge` in the decode layout (:data:`DECODE`).

    ``oracle``: (out, lse, magnitudes) of the float64 oracle of the case (what the bounds scale with; see
    :func:`bounds`). The reference is the oracle itself, or another result of the op (``ref_dtype``: the dtype
    of its out; its own bound is added) -- ``merged``: ``out`` / ``lse`` are two partial calls merged by LSE
    (``out_dtype``: the dtype the parts returned out in; default: ``out``'s).
    ``lse`` is converted from ``lse_base`` (default: the op's declaration); None (an op that declares
    ``returns_lse = False``) compares out only. A query with no keys must return out exactly 0 and lse
    ``empty_lse`` (default: the op's ``empty_row``). Fills ``figures`` first, then raises AssertionError
    naming the op, case, check, the measured error, its bound and where."""
    __tracebackhide__ = True
    key, tol = tolerance_for(case)
    base = declared(op, "lse_base") if lse_base is None else lse_base
    if empty_lse is None:
        empty_lse = math.inf if declared(op, "empty_row") == "+inf" else -math.inf
    w = where(op, case, check)
    o_out, o_lse, mags = oracle
    out_dtype = out.dtype if out_dtype is None else out_dtype
    bnd = decode_bounds(key, tol, mags, o_out, o_lse, out_dtype, merged=merged, ref_dtype=ref_dtype)
    got = out.detach().cpu().to(torch.float64)
    ref_out = ref_out.to(torch.float64)
    ref_lse = None if ref_lse is None else ref_lse.to(torch.float64)
    raw = None if lse is None or ref_lse is None else lse.detach().cpu().to(torch.float64)
    empty = torch.isinf(o_lse) & (o_lse > 0)                      # [B, h, s_q]: the oracle says no keys
    c = _errors(got, ref_out, bnd, empty, empty.transpose(1, 2), raw, None if raw is None else
                lse_to_natural(raw, base), ref_lse)
    figures.update({
        "case": case.describe(), "check": check, "op": op.name, **c.out_figures(),
        "queries": int(empty.numel()), "queries_without_keys": int(empty.sum()),
        "tolerance": key, **bnd.terms, "lse_base": base, "lse_compared": raw is not None,
    })
    return _judge(op, w, DECODE, c, figures, late={} if raw is None else {"lse_max_abs": c.lse_max_abs()},
                  base=base, base_key="lse_base", empty_lse=empty_lse, empty_key="empty_row", against=against)


def compare_attention(op, case, out, lse, oracle, *, check: str, figures: dict, base: str, base_key: str,
                      empty_lse: float, empty_key: str | None, locate: Callable[[int], str],
                      against: str = "the float64 oracle", bounds: Bounds | None = None) -> dict:
    """out [T, h, d] and lse [T, h] (in ``base``) of an op against ``oracle`` = (out float64, lse natural with
    +inf for a query with no keys, magnitudes): the checks of :func:`_judge` in the token layout
    (:func:`tokens`): NaN in a query with keys fails, a query with no keys must give out exactly 0 and lse
    ``empty_lse`` (the op's ``empty_key`` declaration; None: fixed by the contract), then lse and out within
    ``bounds`` (:class:`Bounds`; default :func:`attention_bounds`). ``locate(t)`` says where token t is (its row
    and position). ``lse`` None (a prefill that declares ``prefill_returns_lse = False``): out only. Fills
    ``figures`` first."""
    __tracebackhide__ = True
    w = where(op, case, check)
    o_out, o_lse, mags = oracle
    if bounds is None:
        bounds = attention_bounds(case, mags, o_out, o_lse, out.dtype)
    got = out.detach().cpu().to(torch.float64)
    empty = torch.isinf(o_lse) & (o_lse > 0)                             # [T, h]: no keys
    raw = lse.detach().cpu().to(torch.float64) if lse is not None else torch.where(empty, empty_lse, o_lse)
    nat = to_natural(raw, base) if lse is not None else o_lse            # no lse: nothing of it is checked
    c = _errors(got, o_out, bounds, empty, empty, raw, nat, o_lse)
    lse_ratio = c.lse_ratio()
    figures.update({
        "case": case.describe(), "check": check, "op": op.name, "tolerance": bounds.name, **bounds.terms,
        **c.out_figures(), "lse_max_abs": c.lse_max_abs(),
        "lse_error_over_bound": float(lse_ratio.max()) if lse_ratio.numel() else 0.0,
        "queries": int(empty.numel()), "queries_without_keys": int(empty.sum()), "lse_base": base,
    })
    if lse is None:
        for k in ("lse_max_abs", "lse_error_over_bound", "lse_base"):
            del figures[k]
    return _judge(op, w, tokens(locate), c, figures, late={}, base=base, base_key=base_key, empty_lse=empty_lse,
                  empty_key=empty_key, against=against)


# --------------------------------------------------------------------------- the checks both layouts share


@dataclasses.dataclass(frozen=True)
class Layout:
    """What a failure message says of an index in one layout of out / lse (the checks, :func:`_judge`, are the
    same in both): ``out_names`` / ``lse_names`` the index's axes, ``locate`` (the token layout's) where token
    ``i[0]`` is; the decode layout's messages name the query ``(b=, s=)``, its non-finite out that the row has keys,
    its NaN hint (:data:`NAN_HINT`) for out and lse; the token layout's the NaN of the strided inputs' padding.
    ``mask_empty``: the lse over its bound is counted, and its worst ratio found, among queries with keys only
    (token layout; the decode layout counts every query whose error is over and takes the worst of error / bound
    unclamped -- the same where a query with no keys has a positive finite bound)."""

    out_names: str
    lse_names: str
    query_out: Callable[[tuple], str]               # the query of an out index, as "query {...} has no keys"
    query_lse: Callable[[tuple], str]               # the query of an lse index
    keys_exist: Callable[[tuple], str]              # after a non-finite out's index
    nan_out: str                                    # after a non-finite out's message
    nan_lse: str                                    # after a non-finite lse's message
    lse_worst: str                                  # before the lse's worst index
    names_base_key: bool                            # "declared base e by <key>"
    mask_empty: bool
    locate: Callable[[int], str] | None = None

    def at(self, names: str, i: tuple) -> str:
        text = f"({names}) = ({', '.join(str(n) for n in i)})"
        return text if self.locate is None else f"{text} ({split_cause(self.locate(i[0]))[0]})"

    def cause_at(self, i: tuple) -> str:
        """The likely cause ``locate`` names at index ``i`` (a padding sequence's offset), '' for none."""
        return "" if self.locate is None else split_cause(self.locate(i[0]))[1]


#: out [B, s_q, h, d], lse [B, h, s_q] (:func:`compare`)
DECODE = Layout("b, s, h, d", "b, h, s", lambda i: f"(b={i[0]}, s={i[1]})", lambda i: f"(b={i[0]}, s={i[2]})",
                lambda i: f" (cache_seqlens[{i[0]}] of the case: keys exist)", NAN_HINT, f"; {NAN_HINT}", " at ",
                names_base_key=False, mask_empty=False)


def tokens(locate: Callable[[int], str]) -> Layout:
    """out [T, h, d], lse [T, h] (:func:`compare_attention`); ``locate(t)``: where token t is."""
    return Layout("t, h, d", "t, h", lambda i: f"t={i[0]} ({split_cause(locate(i[0]))[0]})",
                  lambda i: f"t={i[0]} ({split_cause(locate(i[0]))[0]})",
                  lambda i: "", "NaN fills the padding of every strided input: an op that reads it, or whose softmax "
                  "overflows or divides 0 by 0, shows it here", "", "; worst against its bound at ",
                  names_base_key=True, mask_empty=True, locate=locate)


@dataclasses.dataclass
class _Compared:
    """One comparison's tensors: out side in the layout's out shape, lse side (None: not compared) in its lse shape."""

    got: torch.Tensor                   # out, float64
    ref_out: torch.Tensor
    bounds: Bounds
    empty: torch.Tensor                 # lse shape: the query has no keys
    valid: torch.Tensor                 # out shape: the element's query has keys
    err: torch.Tensor                   # |got - ref_out|, 0 where not valid
    ratio: torch.Tensor                 # err / bound, NaN as inf
    raw: torch.Tensor | None            # lse as returned, float64
    nat: torch.Tensor | None            # natural log
    ref_lse: torch.Tensor | None
    lse_err: torch.Tensor | None        # |nat - ref_lse|, 0 where no keys

    def out_figures(self) -> dict:
        err, ratio, valid = self.err, self.ratio, self.valid
        ref_valid = self.ref_out[valid]
        return {
            "out_max_abs": float(torch.nan_to_num(err, nan=math.inf).max()) if err.numel() else 0.0,
            "out_rel_fro": float((torch.nan_to_num(self.got, nan=0.0)[valid] - ref_valid).norm() / ref_valid.norm())
            if ref_valid.numel() and float(ref_valid.norm()) else 0.0,
            "out_error_over_bound": float(ratio.max()) if ratio.numel() else 0.0,
        }

    def lse_max_abs(self) -> float:
        return float(torch.nan_to_num(self.lse_err, nan=math.inf).max()) if self.lse_err.numel() else 0.0

    def lse_ratio(self) -> torch.Tensor:
        return (self.lse_err / self.bounds.lse.clamp_min(1e-300)).nan_to_num(nan=math.inf)


def _errors(got, ref_out, bounds: Bounds, empty, empty_q, raw, nat, ref_lse) -> _Compared:
    """Per-element error and error / bound of out (``empty_q``: ``empty`` in out's layout, less its last axis),
    per-query error of lse (``nat`` None: lse not compared)."""
    valid = ~empty_q[..., None].expand_as(got)
    err = torch.where(valid, (got - ref_out).abs(), torch.zeros_like(got))
    ratio = torch.where(valid, err / bounds.out.clamp_min(1e-300), torch.zeros_like(err)).nan_to_num(nan=math.inf)
    lse_err = None if nat is None else torch.where(empty, torch.zeros_like(nat), (nat - ref_lse).abs())
    return _Compared(got, ref_out, bounds, empty, valid, err, ratio, raw, nat, ref_lse, lse_err)


def _first(mask: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in mask.nonzero()[0])


def _judge(op, w: str, lay: Layout, c: _Compared, figures: dict, *, late: dict, base: str, base_key: str,
           empty_lse: float, empty_key: str | None, against: str) -> dict:
    """The checks, in order, each raising AssertionError: a non-finite out in a query with keys (then ``late``
    goes into ``figures``), a non-finite lse there; a query with no keys whose out is not exactly 0 or whose lse is
    not ``empty_lse`` (the op's ``empty_key`` declaration; None: the contract's); lse, then out, over its bound."""
    __tracebackhide__ = True
    got, valid, empty, raw = c.got, c.valid, c.empty, c.raw
    bad = ~torch.isfinite(got) & valid
    if bool(bad.any()):
        i = _first(bad)
        kind = "NaN" if math.isnan(float(got[i])) else "inf"
        raise AssertionError(failure(
            f"{w}: out has {int(bad.sum())} non-finite value(s) in queries with keys: {kind} at "
            f"{lay.at(lay.out_names, i)}", lay.keys_exist(i).strip(), cause=lay.cause_at(i) or lay.nan_out))
    figures.update(late)
    if raw is not None:
        bad = ~torch.isfinite(raw) & ~empty
        if bool(bad.any()):
            i = _first(bad)
            raise AssertionError(failure(
                f"{w}: lse has {int(bad.sum())} non-finite value(s) in queries with keys: {float(raw[i])} at "
                f"{lay.at(lay.lse_names, i)}, expected {float(c.ref_lse[i]):.6g} (natural log)",
                cause=lay.cause_at(i) or lay.nan_lse))
    if bool(empty.any()):
        nonzero = (got != 0) & ~valid
        if bool(nonzero.any()):
            i = _first(nonzero)
            raise AssertionError(failure(
                f"{w}: query {lay.query_out(i)} has no keys, so out must be exactly 0; got {float(got[i])} at head "
                f"{i[-2]}, channel {i[-1]}", f"{int(nonzero.sum()):,} value(s) not 0", cause=lay.cause_at(i)))
        wrong = (raw != empty_lse) & empty if raw is not None else torch.zeros_like(empty)
        if bool(wrong.any()):
            i = _first(wrong)
            value = float(raw[i])
            said, hint = (("the op contract's, as FlashMLA's ref.py", "") if empty_key is None else
                          empty_row_sentences(op, empty_key, value))
            raise AssertionError(failure(
                f"{w}: query {lay.query_lse(i)} has no keys: lse must be {empty_lse}, got {value} at head {i[1]}",
                f"{empty_lse} is {said}; {int(wrong.sum())} such value(s)", cause=hint or lay.cause_at(i)))
    if raw is not None:
        lse_err, lse_b, nat = c.lse_err, c.bounds.lse, c.nat
        over_b = lse_err > lse_b
        if lay.mask_empty:
            over_b = over_b & ~empty
            worst = torch.where(~empty, c.lse_ratio(), 0.0)
        else:
            worst = (lse_err / lse_b).nan_to_num(nan=math.inf)
        if bool(over_b.any()):
            i = _unravel(int(worst.flatten().argmax()), lse_err.shape)
            exp = float(c.ref_lse[i])
            by = f" by {base_key}" if lay.names_base_key else ""
            raise AssertionError(failure(
                f"{w}: lse differs from {against} at {lay.at(lay.lse_names, i)}: "
                f"error {over(float(lse_err[i]), float(lse_b[i]))}",
                f"got {float(nat[i]):.6g} (raw {float(raw[i]):.6g}, declared base {base}{by}), expected {exp:.6g} "
                f"(natural log); {int(over_b.sum()):,} of {int((~empty).sum()):,} queries over, max abs error "
                f"{float(lse_err.max()):.3e}",
                bound_line(bound_key(c.bounds.name), c.bounds.context_lse(i)),
                cause=lse_base_hint(float(raw[i]), exp, base, base_key) or lay.cause_at(i)))
    err, ratio, out_b = c.err, c.ratio, c.bounds.out
    over_b = (err > out_b) & valid
    if bool(over_b.any()):
        i = _unravel(int(ratio.flatten().argmax()), err.shape)
        raise AssertionError(failure(
            f"{w}: out differs from {against} at {lay.at(lay.out_names, i)}: error {over(float(err[i]), float(out_b[i]))}",
            f"got {float(got[i]):.6g}, expected {float(c.ref_out[i]):.6g}; {int(over_b.sum()):,} of {int(valid.sum()):,} "
            f"values over, max abs error {float(err.max()):.3e}, rel_fro {figures['out_rel_fro']:.3e}",
            bound_line(bound_key(c.bounds.name), c.bounds.context_out(i)), cause=lay.cause_at(i)))
    return figures


def lse_base_hint(raw: float, expected: float, base: str, key: str) -> str:
    """The likely cause of a wrong lse read in the declared ``base`` (the op's ``key`` declaration): ``raw``, as the
    op returned it, is the natural-log ``expected`` in the other base (declared e, raw x ln 2 equals it: base 2;
    declared 2, raw itself equals it: the natural log), else ''."""
    close = lambda value: abs(value - expected) <= 1e-3 * (1 + abs(expected))  # noqa: E731
    if not expected:
        return ""
    if base == "e" and close(raw * math.log(2.0)):
        return f"the lse matches base 2 (lse x ln 2 equals the oracle): declare {key} = '2'"
    if base == "2" and close(raw):
        return (f"the lse matches the natural log (the raw lse equals the oracle; declared base 2, it was read "
                f"as raw x ln 2): declare {key} = 'e' (or return base 2)")
    return ""


def empty_row_sentences(op, key: str, got: float) -> tuple[str, str]:
    """For a query with no keys whose lse is ``got``: what the op declared (``key``: empty_row or a method's), and a
    hint to declare the other infinity when ``got`` is that one."""
    said = f"{key} = {declared(op, key)!r}, " + ("declared" if getattr(op, key, None) is not None else
                                                 "the default: not declared")
    other = {math.inf: "+inf", -math.inf: "-inf"}.get(got)
    hint = (f"{other} is the op's convention for a query with no keys: declare {key} = {other!r}"
            if other and other != declared(op, key) else "")
    return said, hint


def _keys_of(mags: dict, b: int, s: int) -> str:
    keys = mags.get("keys")
    return "" if keys is None else f"the query has {int(keys[b, 0, s])} keys"


def _unravel(flat: int, shape) -> tuple[int, ...]:
    out = []
    for n in reversed(tuple(shape)):
        out.append(flat % n)
        flat //= n
    return tuple(reversed(out))


def check_against_oracle(op, spec: Spec, *, check: str, figures: dict, inp: OpInputs | None = None,
                         hints=()) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Build (cached), run, compare with the oracle (cached); returns the op's (out, lse). A causal case that
    fails is compared once more with the oracle aligned top-left, to name that as the likely cause. ``inp``:
    inputs derived from the spec's (the same keys in other tensors: the spec's oracle holds); ``hints``: more
    ``(out, lse) -> (likely cause, '; likely cause: ...') or None`` asked in turn after a failure."""
    __tracebackhide__ = True
    require(op, spec.case)
    figures.update(case=spec.case.describe(), check=check, op=op.name)
    inp = build(spec) if inp is None else inp
    out, lse = run_op(op, inp, check)
    ref = oracle_of(spec)
    try:
        compare(op, spec.case, out, lse, ref[0], ref[1], check=check, figures=figures, oracle=ref)
    except AssertionError as exc:
        top_left = _top_left_hint(op, spec, out, lse)
        for hint_of in (lambda o, l: top_left and ("top-left causal alignment", top_left), *hints,
                        lambda o, l: _tf32_hint(op, spec, o, l)):
            found = hint_of(out, lse)
            if found:
                figures["likely_cause"] = found[0]
                raise AssertionError(with_cause(str(exc), found[1])) from None
        raise
    return out, lse


def _top_left_hint(op, spec: Spec, out, lse) -> str:
    """'; likely cause: top-left causal alignment ...' when a failing causal multi-token case matches the
    oracle aligned top-left within the bounds."""
    case = spec.case
    if not case.causal or case.s_q < 2 or case.sparse:
        return ""
    tl = top_left_oracle_of(spec)
    try:
        compare(op, case, out, lse, tl[0], tl[1], check="top-left", figures={}, oracle=tl)
    except AssertionError:
        return ""
    return ("; likely cause: top-left causal alignment -- the op matches the oracle in which query i sees keys 0..i; "
            "the contract aligns multi-token decode bottom-right (the s_q queries are the row's last s_q tokens: "
            "query i attends keys < cache_seqlens[b] - s_q + i + 1)")


def _tf32_hint(op, spec: Spec, out, lse) -> tuple[str, str] | None:
    """("TF32 inputs", '; likely cause: TF32 inputs ...') when a failing float32 latent case matches the oracle of
    q and the cache cut to TF32 (truncated, as a GPU's tensor cores take a float32 register; or rounded to nearest)
    within float16's bounds (TF32 keeps float16's 10 mantissa bits: exact products, P kept to 10 bits), else None.
    Asked only after a float32 failure."""
    case = spec.case
    if case.dtype != torch.float32 or case.kv_format != "latent" or out.dtype != torch.float32:
        return None
    as_tf32 = dataclasses.replace(case, dtype=torch.float16)  # float16's bounds: 10 mantissa bits
    for mode, how in (("truncate", "truncated, as a tensor core reads a float32 register"),
                      ("rna", "rounded to nearest")):
        ref = tf32_oracle_of(spec, mode)
        try:
            compare(op, as_tf32, out, lse, ref[0], ref[1], check="TF32 inputs", figures={}, oracle=ref)
        except AssertionError:
            continue
        return ("TF32 inputs",
                f"; likely cause: TF32 inputs -- the op matches, within float16's bounds, the oracle of q and the "
                f"cache cut to TF32 (10 mantissa bits, {how}): float32 operands multiplied on TF32 tensor cores, as "
                "triton's tl.dot does by default on NVIDIA GPUs (input_precision='tf32'); pass "
                "input_precision='ieee' for float32 (or torch.backends.cuda.matmul.allow_tf32 = False for torch "
                "matmuls)")
    return None


def bitwise_equal(op, case: OpCase, a, b, *, check: str, what: str, figures: dict) -> None:
    """Two (out, lse) pairs bitwise equal (NaN equal to NaN of the same bits)."""
    __tracebackhide__ = True
    figures.setdefault("check", check)
    figures.setdefault("case", case.describe())
    for name, x, y in (("out", a[0], b[0]), ("lse", a[1], b[1])):
        if x is None or y is None:  # an op that declares returns_lse = False
            continue
        x, y = x.detach().cpu(), y.detach().cpu()
        same = x.shape == y.shape and x.dtype == y.dtype and torch.equal(
            x.contiguous().reshape(-1).view(torch.uint8), y.contiguous().reshape(-1).view(torch.uint8))
        if not same:
            diff = (x.to(torch.float64) - y.to(torch.float64)).abs()
            n = int((x != y).sum()) if x.shape == y.shape else -1
            figures.update({f"{name}_differing_values": n, f"{name}_max_abs_difference": float(diff.max())})
            raise AssertionError(failure(f"{where(op, case, check)}: {what}: {name} is not bitwise the same: {n} of {x.numel()} "
                                 f"values differ, max abs difference {float(diff.max()):.3e}"))
    figures.update({"out_differing_values": 0, "lse_differing_values": 0})



def as_reference(out: torch.Tensor, lse: torch.Tensor | None, base: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """An op's (out, lse) as a comparison reference: float64 out, natural lse with +inf for no keys."""
    if lse is None:
        return out.detach().cpu().to(torch.float64), None
    nat = lse_to_natural(lse.detach().cpu().to(torch.float64), base)
    nat = torch.where(torch.isinf(nat), torch.full_like(nat, math.inf), nat)
    return out.detach().cpu().to(torch.float64), nat
