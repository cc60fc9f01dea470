"""What the checks of the op contract's optional methods (prefill, sparse_prefill, merge, write) share:

* **presence** (:func:`require_method`): a test of a method skips, naming it and its signature, on an op that
  has not got it; the case is then asked of the op (``unsupported_reason``) and of its declarations
  (:func:`require`);
* **buffers** (:class:`Buffer`): every tensor handed to a method is a view at the start of a larger allocation
  with a canary after it (mla_conformance.checks.op.Buffer), possibly strided: padded (NaN in the padding) or
  laid out in another dimension order (vLLM keeps lse as [h, T]);
* **calling** (:func:`call`): an op that raises is a BackendError, one that writes an input or past a buffer
  fails; :func:`tensor_out` checks a returned tensor's type, shape and dtype (BackendOutputError);
* **comparing** (:func:`compare_attention`): out / lse [T, h, ...] against a float64 oracle within the decode
  bounds (mla_conformance.checks.op.bounds, OP_TOLERANCES: scores in float32, P rounded to the input dtype,
  float32 accumulation, lse float32), the declared lse base and empty-row infinity.

Failure messages name the op, the case (MethodCase.describe), the check, the measured numbers and the bound.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import pytest
import torch

from mla_conformance.checks import op as oc
from mla_conformance.checks.op import inputs as op_inputs
from mla_conformance.checks.op.compare import empty_row_sentences, lse_base_hint
from mla_conformance.checks.op.inputs import declared_otherwise, not_declared, op_reason, where
from mla_conformance.checks.op.run import permuted, raised
from mla_conformance.contract.methods import FLAG, METHOD_SPECS, method_spec
from mla_conformance.contract.op import declared, has_method, layout_of
from mla_conformance.errors import BackendOutputError
from mla_conformance.model.attention_oracles import to_natural
from mla_conformance.dtypes import dtype_name

#: The suites of compositions of methods, not of one method (no MethodSpec lists them): test_op_composition.py runs
#: an op's prefill, merge and write together as chunked prefill does (mla_conformance.checks.op.composition).
COMPOSITION_SUITES = ("test_op_composition.py",)
#: The suite files of the optional methods (each MethodSpec's but the base method's), then the compositions' (the
#: decode op meta test, tests/meta/test_op_meta.py, covers the others; tests/meta/test_op_methods_meta.py covers
#: these).
METHOD_SUITES = tuple(s for spec in METHOD_SPECS if not spec.base for s in spec.suites) + COMPOSITION_SUITES


def missing_method_reason(op, method: str) -> str:
    return (f"op {op.name} has no {method} method (optional: {method_spec(method).signature}; define it to have "
            f"{method} tested)")


def require_method(op, *methods: str) -> None:
    """Skip, naming the first missing method, unless the op has every one of ``methods``."""
    __tracebackhide__ = True
    for method in methods:
        if not has_method(op, method):
            pytest.skip(missing_method_reason(op, method))


def unsupported(op, case) -> str | None:
    """The op's sentence for a case it declines (a raising unsupported_reason is a BackendError), else the
    sentence of the first declaration of the case's method (its MethodSpec's, in order) that gates the case
    (``Declaration.gate``) and does not admit it: a flag the op does not declare, a value it does not list."""
    __tracebackhide__ = True
    reason = op_reason(op, case)
    if reason:
        return reason
    for decl in method_spec(case.method).declarations:
        if not decl.gate:
            continue
        needed = decl.needed(case)
        if not decl.admits(declared(op, decl.name), needed):
            return (not_declared(decl.name, decl.needed_for) if decl.kind == FLAG else
                    declared_otherwise(op, decl.name, needed, decl.needed_for))
    return None


def require(op, case):
    __tracebackhide__ = True
    return op_inputs.require(op, case, unsupported)


def first_supported(op, cases):
    """The first of ``cases`` the op accepts, else skip with the op's sentences."""
    __tracebackhide__ = True
    return op_inputs.first_supported(op, cases, unsupported)


# --------------------------------------------------------------------------- buffers


class Buffer(oc.Buffer):
    """A canaried view (mla_conformance.checks.op.Buffer) allocated in dimension order ``order`` (a permutation:
    the view is the allocation permuted back) and padded by ``pad_last`` elements (NaN / 0xFF) in its last dim."""

    def __init__(self, name: str, value: torch.Tensor, *, device, pad_last: int = 0, order: tuple[int, ...] | None = None):
        if order is None:
            super().__init__(name, value, device=device, pad_last=pad_last)
            return
        self.name = name
        shape = list(value.shape)
        alloc = [shape[i] for i in order]
        alloc[-1] += pad_last
        n = math.prod(alloc) * value.element_size()
        self.base = torch.full((n + oc.CANARY_BYTES,), oc.CANARY_BYTE, dtype=torch.uint8, device=device)
        typed = self.base[:n].view(value.dtype).view(alloc)
        if pad_last:
            if value.is_floating_point():
                typed[..., alloc[-1] - pad_last:] = float("nan")
            else:
                typed[..., alloc[-1] - pad_last:].view(torch.uint8).fill_(0xFF)
        typed = typed[..., :alloc[-1] - pad_last]
        inverse = [order.index(i) for i in range(len(order))]
        self.view = typed.permute(*inverse)
        self.view.copy_(value.to(device))
        self.snapshot = self.base.clone()


def buffers(device, **tensors) -> dict[str, Buffer]:
    """name -> Buffer; a value may be a tensor or (tensor, dict of Buffer options)."""
    out = {}
    for name, value in tensors.items():
        if value is None:
            continue
        t, kw = value if isinstance(value, tuple) else (value, {})
        out[name] = Buffer(name, t, device=device, **kw)
    return out


# --------------------------------------------------------------------------- calling


def call(op, method: str, case, check: str, bufs: dict[str, Buffer], args: tuple[str, ...], *, views=None,
         mutable: tuple[str, ...] = (), **kwargs):
    """``op.<method>(*[bufs[a].view for a in args], **kwargs)`` (a Buffer among kwargs is passed as its view;
    ``views`` maps an argument name to the tensor passed in its place: a view into some buffer); an exception is
    a BackendError; then no input and no canary may have changed (the ``mutable`` buffers -- write's cache --
    are the caller's to check)."""
    __tracebackhide__ = True
    require(op, case)
    views = views or {}
    kw = {k: (v.view if isinstance(v, oc.Buffer) else v) for k, v in kwargs.items()}
    handed = {a: views[a] if a in views else bufs[a].view for a in args}
    try:
        result = getattr(op, method)(*handed.values(), **kw)
    except Exception as exc:
        for name, buf in bufs.items():
            if name not in mutable:
                buf.base.copy_(buf.snapshot)
        error = raised(op, case, check, method, exc, {**handed, **{k: v for k, v in kw.items()
                                                                  if isinstance(v, torch.Tensor)}})
        raise error from None
    for name, buf in bufs.items():
        if name not in mutable:
            buf.check(op, case, check)
    return result


def tensor_out(op, case, check: str, method: str, what: str, value, shape: tuple[int, ...], dtype=None, *,
               why_dtype: str = ""):
    """``value`` checked to be a floating Tensor of ``shape`` (and ``dtype``; ``why_dtype`` says why that one);
    else a one-line BackendOutputError: got and expected, the layout of ``method``'s ``what``
    (contract.op.TENSORS), and the layout it has where its axes are the expected ones in another order."""
    __tracebackhide__ = True
    w = where(op, case, check)
    if not isinstance(value, torch.Tensor):
        raise BackendOutputError(f"{w}: {method}() returned {type(value).__name__} as {what}, not a Tensor")
    want = dtype_name(dtype) if dtype is not None else "floating"
    layout = layout_of(method, what)
    expected = f"{want} {layout} = {tuple(shape)}" if layout else f"{want} {tuple(shape)}"
    got = f"{oc.dtype_name(value.dtype)} {tuple(value.shape)}"
    if tuple(value.shape) != tuple(shape):
        raise BackendOutputError(f"{w}: {method}() returned {what} {got}, expected {expected}"
                                 f"{permuted(method, what, layout, tuple(value.shape), tuple(shape))}")
    if not value.is_floating_point() or (dtype is not None and value.dtype != dtype):
        extra = f" ({why_dtype})" if why_dtype else ""
        if dtype == torch.float32 and value.is_floating_point() and value.dtype != dtype:
            extra = (f" (the op contract's {what} is float32: partial results are merged by exp(lse_i - lse), and "
                     f"{oc.dtype_name(value.dtype)} keeps {torch.finfo(value.dtype).nmant + 1} significant bits)")
        raise BackendOutputError(f"{w}: {method}() returned {what} {got}, expected {expected}{extra}")
    return value


def tuple_out(op, case, check: str, method: str, result, n: int, names: str):
    __tracebackhide__ = True
    if not isinstance(result, (tuple, list)) or len(result) != n:
        raise BackendOutputError(f"{where(op, case, check)}: {method}() returned {type(result).__name__}, not "
                                 f"({names})")
    return tuple(result)


# --------------------------------------------------------------------------- comparing


@dataclasses.dataclass
class Bounds:
    """Per-element bound on |out - ref| [T, h, d], per-query bound on |lse - ref| [T, h] (natural log), the
    name of the rule (the ``tolerance`` figure) and what a failure message says of each bound at an index."""

    out: torch.Tensor
    lse: torch.Tensor
    name: str
    explain_out: Callable[[tuple], str]
    explain_lse: Callable[[tuple], str]
    terms: dict = dataclasses.field(default_factory=dict)   # figures: the rule's terms


def attention_bounds(case, mags: dict, ref_out, ref_lse, out_dtype) -> Bounds:
    """The bounds of one attention kernel call: mla_conformance.checks.op.bounds (OP_TOLERANCES, derived for a
    kernel that scores in float32, rounds P to the input dtype, accumulates in float32) on the decode layout
    [1, T, h, d] / [1, h, T]."""
    key, tol = oc.tolerance_for(case)
    per_q = {k: mags[k].T[None] for k in ("score_abs", "score_max", "sink_rel")}
    m4 = {"abs_v": mags["abs_v"][None], "score_v": mags["score_v"][None], **per_q}
    out_b, lse_b = oc.bounds(tol, m4, ref_out[None], ref_lse.T[None], out_dtype)
    u_out = torch.finfo(out_dtype).eps / 2

    def explain_out(i):
        return (f"{key}: u_out {u_out:.3g} x |ref| + (p_round {tol.p_round:.3g} + acc {tol.acc:.3g}) x S "
                f"{float(mags['abs_v'][i]):.3g} + dot {tol.dot:.3g} x T {float(mags['score_v'][i]):.3g}; S = softmax @ "
                "|V|, T = sum_t p_t (A_t + A_max) |v_t| from the float64 oracle")

    def explain_lse(i):
        return (f"{key}: dot {tol.dot:.3g} x Abar {float(mags['score_abs'][i]):.3g} + ({tol.acc:.3g} + 2^-24) x "
                "(1 + |lse|)")

    return Bounds(out_b[0], lse_b[0].T, key, explain_out, explain_lse,
                  {"tolerance_p_round": tol.p_round, "tolerance_dot": tol.dot, "tolerance_acc": tol.acc,
                   "tolerance_u_out": u_out})


def _unravel(flat: int, shape) -> tuple[int, ...]:
    out = []
    for n in reversed(tuple(shape)):
        out.append(flat % n)
        flat //= n
    return tuple(reversed(out))


def _first(mask: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in mask.nonzero()[0])


def compare_attention(op, case, out, lse, oracle, *, check: str, figures: dict, base: str, base_key: str,
                      empty_lse: float, empty_key: str, locate: Callable[[int], str],
                      against: str = "the float64 oracle", bounds=None) -> dict:
    """out [T, h, d] and lse [T, h] (in ``base``) of an op against ``oracle`` = (out float64, lse natural with
    +inf for a query with no keys, magnitudes): NaN in a query with keys fails, a query with no keys must give
    out exactly 0 and lse ``empty_lse`` (the op's ``empty_key`` declaration; None: fixed by the contract), then lse and out
    within ``bounds`` (:class:`Bounds`; default :func:`attention_bounds`). ``locate(t)`` says where token t is
    (its row and position). ``lse`` None (a prefill that declares ``prefill_returns_lse = False``): out only. Fills
    ``figures`` first."""
    __tracebackhide__ = True
    w = where(op, case, check)
    o_out, o_lse, mags = oracle
    if bounds is None:
        bounds = attention_bounds(case, mags, o_out, o_lse, out.dtype)
    out_b, lse_b = bounds.out, bounds.lse
    got = out.detach().cpu().to(torch.float64)
    empty = torch.isinf(o_lse) & (o_lse > 0)                             # [T, h]: no keys
    raw = lse.detach().cpu().to(torch.float64) if lse is not None else torch.where(empty, empty_lse, o_lse)
    nat = to_natural(raw, base) if lse is not None else o_lse            # no lse: nothing of it is checked
    valid = ~empty[..., None].expand_as(got)
    err = torch.where(valid, (got - o_out).abs(), torch.zeros_like(got))
    ratio = torch.where(valid, err / out_b.clamp_min(1e-300), torch.zeros_like(err)).nan_to_num(nan=math.inf)
    lse_err = torch.where(empty, torch.zeros_like(nat), (nat - o_lse).abs())
    lse_ratio = (lse_err / lse_b.clamp_min(1e-300)).nan_to_num(nan=math.inf)
    ref_valid = o_out[valid]
    figures.update({
        "case": case.describe(), "check": check, "op": op.name, "tolerance": bounds.name, **bounds.terms,
        "out_max_abs": float(torch.nan_to_num(err, nan=math.inf).max()) if err.numel() else 0.0,
        "out_rel_fro": float((torch.nan_to_num(got, nan=0.0)[valid] - ref_valid).norm() / ref_valid.norm())
        if ref_valid.numel() and float(ref_valid.norm()) else 0.0,
        "out_error_over_bound": float(ratio.max()) if ratio.numel() else 0.0,
        "lse_max_abs": float(torch.nan_to_num(lse_err, nan=math.inf).max()) if lse_err.numel() else 0.0,
        "lse_error_over_bound": float(lse_ratio.max()) if lse_ratio.numel() else 0.0,
        "queries": int(empty.numel()), "queries_without_keys": int(empty.sum()), "lse_base": base,
    })
    if lse is None:
        for k in ("lse_max_abs", "lse_error_over_bound", "lse_base"):
            del figures[k]
    bad = ~torch.isfinite(got) & valid
    if bool(bad.any()):
        t, h, d = _first(bad)
        kind = "NaN" if math.isnan(float(got[t, h, d])) else "inf"
        raise AssertionError(f"{w}: out has {int(bad.sum())} non-finite value(s) in queries with keys: {kind} at "
                             f"(t, h, d) = ({t}, {h}, {d}) ({locate(t)}); NaN fills the padding of every strided "
                             "input: an op that reads it, or whose softmax overflows or divides 0 by 0, shows it here")
    bad = ~torch.isfinite(raw) & ~empty
    if bool(bad.any()):
        t, h = _first(bad)
        raise AssertionError(f"{w}: lse has {int(bad.sum())} non-finite value(s) in queries with keys: "
                             f"{float(raw[t, h])} at (t, h) = ({t}, {h}) ({locate(t)}), expected "
                             f"{float(o_lse[t, h]):.6g} (natural log)")
    if bool(empty.any()):
        nonzero = (got != 0) & ~valid
        if bool(nonzero.any()):
            t, h, d = _first(nonzero)
            raise AssertionError(f"{w}: query t={t} ({locate(t)}) has no keys, so out must be exactly 0; got "
                                 f"{float(got[t, h, d])} at head {h}, channel {d} ({int(nonzero.sum())} value(s) "
                                 "not 0)")
        wrong = (raw != empty_lse) & empty
        if bool(wrong.any()):
            t, h = _first(wrong)
            value = float(raw[t, h])
            said, hint = (("the op contract's, as FlashMLA's ref.py", "") if empty_key is None else
                          empty_row_sentences(op, empty_key, value))
            raise AssertionError(f"{w}: query t={t} ({locate(t)}) has no keys: lse must be {empty_lse} ({said}), got "
                                 f"{value} at head {h} ({int(wrong.sum())} such value(s)){hint}")
    over = (lse_err > lse_b) & ~empty
    if bool(over.any()):
        t, h = divmod(int(torch.where(~empty, lse_ratio, 0.0).flatten().argmax()), lse_err.shape[1])
        exp = float(o_lse[t, h])
        hint = lse_base_hint(float(raw[t, h]), exp, base, base_key)
        raise AssertionError(
            f"{w}: lse differs from {against}: max abs error {float(lse_err.max()):.3e} (natural log); worst against "
            f"its bound at (t, h) = ({t}, {h}) ({locate(t)}): got {float(nat[t, h]):.6g} (raw {float(raw[t, h]):.6g}, "
            f"declared base {base} by {base_key}), expected {exp:.6g}; bound {float(lse_b[t, h]):.3e} "
            f"({bounds.explain_lse((t, h))}); {int(over.sum())} of {int((~empty).sum())} queries over{hint}")
    over = (err > out_b) & valid
    if bool(over.any()):
        t, h, d = _unravel(int(ratio.flatten().argmax()), err.shape)
        raise AssertionError(
            f"{w}: out differs from {against}: max abs error {float(err.max()):.3e}; worst against its bound at "
            f"(t, h, d) = ({t}, {h}, {d}) ({locate(t)}): got {float(got[t, h, d]):.6g}, expected "
            f"{float(o_out[t, h, d]):.6g}, error {float(err[t, h, d]):.3e} = {float(ratio[t, h, d]):.3g} x the bound "
            f"{float(out_b[t, h, d]):.3e} ({bounds.explain_out((t, h, d))}); {int(over.sum())} of {int(valid.sum())} "
            f"values over, rel_fro {figures['out_rel_fro']:.3e}")
    return figures


__all__ = ["METHOD_SUITES", "COMPOSITION_SUITES", "require_method", "missing_method_reason", "unsupported", "require", "first_supported",
           "Buffer", "buffers", "call", "tensor_out", "tuple_out", "Bounds", "attention_bounds", "compare_attention", "where"]
