"""Checks of the op contract's ``merge`` (two partial attentions merged by their lse: vLLM's
``merge_attn_states``, FlashInfer's ``merge_state``) for suites/test_op_merge.py and the composition.

Inputs (:func:`build`, cached per :class:`MergeSpec`): out_a / out_b [T, h, d] of unit scale in the case's
dtype, lse float32 [T, h] in the op's declared ``merge_lse_base`` (finite values spread over +-24 so that the
weights differ by up to e^48, some pairs within 1e-3 of each other), empty sides marked +inf or -inf per
token (an empty side's out is 0, as the prefill contract returns it); ``strided``: out_a padded (NaN in the
padding), lse_a laid out [h, T] as vLLM keeps it. Canaries after every buffer.

Bounds, per element, of a merge computed in float32 (every production merge: vLLM's CUDA and Triton kernels,
FlashInfer's ``merge_state``): each weight w = exp(lse - max) errs relatively by at most
E = 2^-24 (8 + 4 (|lse_a| + |lse_b|)) -- the subtraction and a base conversion round the exponent by 2^-24 of
|lse| each (an absolute error there is a relative one in w), exp itself (or ex2.approx) by a few ulp; the
normalised weights by 2E + 2^-23; so ``|out - ref| <= u_out |ref| + (2E + 2^-22) (a_a |out_a| + a_b |out_b|)`` and
``|lse - ref| <= E + 2^-23 + 2^-23 |lse|`` (natural log). Any base mix-up (an error of ln 2 per unit of lse
difference) or an infinity taken as a value is orders of magnitude past these.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from mla_conformance.checks.op import methods as method_checks
from mla_conformance.checks.op.compare import Bounds, compare_attention
from mla_conformance.checks.tolerances import unit_roundoff
from mla_conformance.contract.op import MethodCase, declared
from mla_conformance.messages import with_cause
from mla_conformance.model import attention_oracles

METHOD = "merge"
U32 = unit_roundoff(torch.float32)
#: per token: (lse_a, lse_b) markers, None for a finite value
ONE_SIDED = (("+inf", None), (None, "-inf"), ("-inf", None), (None, "+inf"))
BOTH_EMPTY = (("+inf", "+inf"), ("-inf", "-inf"), ("+inf", "-inf"), ("-inf", "+inf"))


#: Why merge's out is in out_a's dtype, unlike decode's (any floating dtype): the merged partial takes the partials'
#: place in the caller's buffer -- vLLM's merge_attn_states writes into an output of the partials' dtype, FlashInfer's
#: merge_state returns v_a's.
OUT_DTYPE_RULE = ("a merge returns out in out_a's dtype: the merged partial takes the partials' place in the "
                  "caller's buffer, as vLLM's merge_attn_states and FlashInfer's merge_state return it")


@dataclasses.dataclass(frozen=True)
class MergeSpec:
    tokens: int = 8
    heads: int = 5
    d: int = 64
    dtype: str = "float32"
    base: str = "e"
    empties: tuple[tuple[str | None, str | None], ...] = ()   # the first tokens' markers
    strided: bool = False
    seed: int = 0
    device: str = "cpu"

    def case(self) -> MethodCase:
        return MethodCase(METHOD, getattr(torch, self.dtype), h_q=self.heads, d_v=self.d, tokens=self.tokens,
                          rows_without_keys=bool(self.empties), lse_base=self.base, strided=self.strided,
                          device=self.device)

    def locate(self, t: int) -> str:
        a, b = self.empties[t] if t < len(self.empties) else (None, None)
        side = lambda m: "finite" if m is None else f"{m} (empty)"  # noqa: E731
        return f"token {t}: lse_a {side(a)}, lse_b {side(b)}"


@functools.lru_cache(maxsize=32)
def build(spec: MergeSpec) -> dict[str, method_checks.Buffer]:
    g = torch.Generator().manual_seed(5000 + spec.seed)
    dt = getattr(torch, spec.dtype)
    T, h, d = spec.tokens, spec.heads, spec.d
    out_a = torch.randn(T, h, d, generator=g, dtype=torch.float64)
    out_b = torch.randn(T, h, d, generator=g, dtype=torch.float64)
    lse_a = (torch.rand(T, h, generator=g, dtype=torch.float64) - 0.5) * 48
    lse_b = lse_a + torch.randn(T, h, generator=g, dtype=torch.float64) * 4
    lse_b[:, 0] = lse_a[:, 0] + 1e-3                        # nearly equal weights
    for t, (a, b) in enumerate(spec.empties):
        for lse, out, mark in ((lse_a, out_a, a), (lse_b, out_b, b)):
            if mark is not None:
                lse[t] = math.inf if mark == "+inf" else -math.inf
                out[t] = 0.0
    to_base = (lambda x: x / math.log(2.0)) if spec.base == "2" else (lambda x: x)
    strided = spec.strided
    return method_checks.buffers(spec.device, out_a=(out_a.to(dt), {"pad_last": 16} if strided else {}),
                      lse_a=(to_base(lse_a).to(torch.float32), {"order": (1, 0)} if strided else {}),
                      out_b=(out_b.to(dt), {}), lse_b=(to_base(lse_b).to(torch.float32), {}))


@functools.lru_cache(maxsize=32)
def oracle_of(spec: MergeSpec):
    t = {n: b.view.detach().cpu() for n, b in build(spec).items()}
    return attention_oracles.merge(t["out_a"], t["lse_a"], t["out_b"], t["lse_b"], base=spec.base, magnitudes=True)


def empty_input(op) -> str:
    """The op's merge_empty_input: "either" (the default: +inf and -inf both mark an empty side), "+inf" or "-inf"."""
    return declared(op, "merge_empty_input")


def marked(op, lse: torch.Tensor) -> torch.Tensor:
    """An lse whose empty sides (either infinity) carry the marker the op's merge_empty_input takes (as an engine's
    glue hands them); unchanged under "either"."""
    mark = empty_input(op)
    if mark == "either":
        return lse
    return torch.where(torch.isinf(lse), math.inf if mark == "+inf" else -math.inf, lse)


def spec_for(op, empties=(), **kw) -> MergeSpec:
    """A MergeSpec in the op's declared merge_lse_base, its empty sides marked by the infinities the op's
    merge_empty_input takes (both, by default: opt-in, an op that declares one is handed only that one)."""
    mark = empty_input(op)
    if mark != "either":
        empties = tuple(tuple(m if m is None else mark for m in pair) for pair in empties)
    return MergeSpec(base=declared(op, "merge_lse_base"), empties=tuple(empties), **kw)


def _marker_hint(op, spec: MergeSpec, out, lse) -> str:
    """Where the op declares no merge_empty_input and fails exactly the tokens one infinity marks empty: that the
    op takes only the other one, and the declaration that says so."""
    if empty_input(op) != "either" or not spec.empties:
        return ""
    o = out.detach().cpu().to(torch.float64)
    l = lse.detach().cpu().to(torch.float64)
    bad = {t: bool((~torch.isfinite(o[t])).any() or (None in pair and (~torch.isfinite(l[t])).any()))
           for t, pair in enumerate(spec.empties)}
    for wrong, right in (("+inf", "-inf"), ("-inf", "+inf")):
        if all(bad[t] == (wrong in pair) for t, pair in enumerate(spec.empties) if wrong in pair or right in pair) \
                and any(bad.values()):
            return (f"; likely cause: the op takes only {right} as an empty side's marker ({wrong} read as a value: "
                    f"FlashInfer's merge_state marks an empty side -inf); if that is its contract, declare "
                    f"merge_empty_input = {right!r} (the suite then hands it {right} sides only, as an engine's glue "
                    "must)")
    return ""


def run(op, case, check: str, bufs: dict, tokens: int, heads: int, d: int):
    """op.merge on the buffers (out_a, lse_a, out_b, lse_b): (out, lse) after the type / shape / dtype checks."""
    __tracebackhide__ = True
    result = method_checks.call(op, METHOD, case, check, bufs, ("out_a", "lse_a", "out_b", "lse_b"))
    out, lse = method_checks.tuple_out(op, case, check, METHOD, result, 2, "out, lse")
    method_checks.tensor_out(op, case, check, METHOD, "out", out, (tokens, heads, d), bufs["out_a"].view.dtype,
                  why_dtype=OUT_DTYPE_RULE)
    method_checks.tensor_out(op, case, check, METHOD, "lse", lse, (tokens, heads), torch.float32)
    return out, lse


def merge_bounds(mags: dict, ref_out, ref_lse, out_dtype) -> Bounds:
    """The bounds of a float32 merge (module docstring)."""
    e = U32 * (8.0 + 4.0 * 2.0 * mags["lse_abs"])                          # |lse_a| + |lse_b| <= 2 max
    finite = torch.where(torch.isfinite(ref_lse), ref_lse.abs(), torch.zeros_like(ref_lse))
    u_out = unit_roundoff(out_dtype)
    out_b = u_out * ref_out.abs() + (2 * e + 4 * U32)[..., None] * mags["abs_mix"]
    lse_b = e + 2 * U32 + 2 * U32 * finite
    return Bounds(out_b, lse_b, "merge float32", lambda i: "", lambda i: "", {"tolerance_u_out": u_out})


def empty_lse(op) -> float:
    return math.inf if declared(op, "merge_empty_row") == "+inf" else -math.inf


def check_against_oracle(op, spec: MergeSpec, *, check: str, figures: dict):
    """Run op.merge; out / lse against the float64 merge of the same inputs, within :func:`merge_bounds`."""
    __tracebackhide__ = True
    method_checks.require_method(op, METHOD)
    case = method_checks.require(op, spec.case())
    figures.update(case=case.describe(), check=check, op=op.name)
    out, lse = run(op, case, check, build(spec), spec.tokens, spec.heads, spec.d)
    ref_out, ref_lse, mags = oracle_of(spec)
    bounds = merge_bounds(mags, ref_out, ref_lse, out.dtype)
    try:
        compare(op, case, out, lse, (ref_out, ref_lse, mags), bounds, check=check, figures=figures, locate=spec.locate)
    except AssertionError as exc:
        hint = _marker_hint(op, spec, out, lse)
        if not hint:
            raise
        figures["likely_cause"] = "one infinity taken as an empty side's marker"
        raise AssertionError(with_cause(str(exc), hint)) from None
    return out, lse


def compare(op, case, out, lse, oracle, bounds, *, check: str, figures: dict, locate, against="the float64 merge"):
    """out / lse of a merge against (ref out, ref lse natural with +inf for both empty, magnitudes) within
    ``bounds`` (:class:`~mla_conformance.checks.op.compare.Bounds`); the lse in the op's merge_lse_base,
    both-empty tokens the declared merge_empty_row."""
    __tracebackhide__ = True
    ref_out, ref_lse, mags = oracle
    compare_attention(op, case, out, lse, (ref_out, ref_lse, mags), check=check, figures=figures,
                      base=declared(op, "merge_lse_base"), base_key="merge_lse_base", empty_lse=empty_lse(op),
                      empty_key="merge_empty_row", locate=locate, against=against, bounds=bounds)


__all__ = ["MergeSpec", "build", "oracle_of", "spec_for", "empty_input", "marked", "run", "merge_bounds",
           "check_against_oracle", "compare",
           "ONE_SIDED", "BOTH_EMPTY", "empty_lse"]
