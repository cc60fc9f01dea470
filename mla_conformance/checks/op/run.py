"""Running an op on built inputs (:func:`run_op`): the op declines a case with ``unsupported_reason`` (the test
skips with its sentence); an op that raises or returns the wrong type, shape or dtype is a
:class:`~mla_conformance.errors.BackendError` / ``BackendOutputError`` (an *error*, not a failure); an op that
writes its inputs or past them (the canaries) fails."""

from __future__ import annotations

import math
import os
import traceback

import torch

from mla_conformance.checks.metrics import dtype_name
from mla_conformance.checks.op.inputs import OpInputs, require, where
from mla_conformance.contract.op import D_V, OpCase, declared, layout_of
from mla_conformance.errors import BackendError, BackendOutputError


def run_op(op, inp: OpInputs, check: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Call ``op.decode`` on the inputs (the test skips with the op's sentence when it declines the case);
    returns (out, lse) after checking their types, shapes and dtypes (BackendOutputError) and that no input
    and no canary changed (AssertionError)."""
    __tracebackhide__ = True
    case = inp.case
    require(op, case)
    try:
        result = op.decode(*inp.args(), **inp.kwargs())
    except Exception as exc:
        for buf in inp.buffers.values():
            buf.base.copy_(buf.snapshot)
        error = raised(op, case, check, "decode", exc, {n: b.view for n, b in inp.buffers.items()})
        raise error from None
    for buf in inp.buffers.values():
        buf.check(op, case, check)
    return validate(op, case, result, check)


def validate(op, case: OpCase, result, check: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out, lse) checked for type, shape and dtype (BackendOutputError); lse is None for an op that declares
    ``returns_lse = False`` (whatever it returned in its place is not looked at)."""
    __tracebackhide__ = True
    w = where(op, case, check)
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise BackendOutputError(f"{w}: decode() returned {type(result).__name__}, not (out, lse)")
    out, lse = result
    B, s_q, h_q = case.batch, case.s_q, case.h_q
    returns_lse = declared(op, "returns_lse")
    if not returns_lse:
        lse = None
    if not isinstance(out, torch.Tensor) or (returns_lse and not isinstance(lse, torch.Tensor)):
        hint = ("; an op that returns no lse declares returns_lse = False" if returns_lse and lse is None else "")
        raise BackendOutputError(f"{w}: decode() returned ({type(out).__name__}, {type(lse).__name__}), not two "
                                 f"Tensors{hint}")
    if tuple(out.shape) != (B, s_q, h_q, D_V) or not out.is_floating_point():
        raise BackendOutputError(f"{w}: out is {dtype_name(out.dtype)} {tuple(out.shape)}, expected a floating "
                                 f"[B, s_q, h_q, 512] = {(B, s_q, h_q, D_V)}")
    if lse is None:
        return out, None
    if tuple(lse.shape) != (B, h_q, s_q):
        raise BackendOutputError(f"{w}: lse is {dtype_name(lse.dtype)} {tuple(lse.shape)}, expected float32 "
                                 f"[B, h_q, s_q] = {(B, h_q, s_q)}"
                                 f"{permuted('decode', 'lse', '[B, h_q, s_q]', tuple(lse.shape), (B, h_q, s_q))}")
    if lse.dtype != torch.float32:
        raise BackendOutputError(f"{w}: lse is {dtype_name(lse.dtype)}, not float32: {_lse_precision_loss(lse)}")
    return out, lse


def permuted(method: str, what: str, layout: str, got: tuple, want: tuple) -> str:
    """'; it is laid out [h, T]...' where ``got`` is ``want`` with its axes in another order ('' otherwise)."""
    names = [n.strip() for n in layout.strip("[]").split(",")] if layout.startswith("[") else []
    if len(names) != len(want) or sorted(got) != sorted(want):
        return ""
    left, order = list(range(len(want))), []
    for n in got:
        i = next(i for i in left if want[i] == n)
        left.remove(i)
        order.append(names[i])
    said = f"; it is laid out [{', '.join(order)}]: {method}'s {what} is {layout}"
    if what == "lse" and method != "decode":
        said += f" (tokens first; decode's lse is {layout_of('decode', 'lse')}, heads first)"
    return said


def raised(op, case, check: str, method: str, exc: BaseException, shapes: dict | None = None) -> BackendError:
    """The one-line BackendError of an op's ``method`` that raised ``exc``: the exception, where in the op's code
    (its deepest frame outside torch and the suite's checks) and, for a size or shape mismatch, the layout and shape of
    each tensor it was handed (``shapes``: name -> tensor). The caller raises it ``from None``: pytest then prints
    no frame of the op with its tensor arguments dumped (``exc`` stays the error's __context__)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if "/torch/" not in f.filename and "/mla_conformance/checks/" not in f.filename]
    at = (f" (at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno} in {frames[-1].name}: "
          f"{(frames[-1].line or '').strip()})" if frames else "")
    text = str(exc).splitlines()[0] if str(exc) else ""
    hint = ""
    if shapes and any(k in str(exc).lower() for k in ("size of tensor", "shape", "dimension", "size mismatch")):
        hint = (f"; {method}'s inputs: " + ", ".join(f"{n} {layout_of(method, n)} = {tuple(t.shape)}"
                                                      for n, t in shapes.items() if isinstance(t, torch.Tensor)))
        if method != "decode":
            hint += f" (its lse tokens first; decode's is {layout_of('decode', 'lse')})"
    return BackendError(f"{where(op, case, check)}: {method}() raised {type(exc).__name__}: {text}{at}{hint}")


def _lse_precision_loss(lse: torch.Tensor) -> str:
    """What an lse held in a narrower dtype than float32 costs where it is merged (a sentence with numbers)."""
    if not lse.is_floating_point():
        return "the op contract's lse is float32 (the log-sum-exp, in the declared base)"
    finite = lse.detach().cpu().to(torch.float64)
    finite = finite[torch.isfinite(finite)]
    top = float(finite.abs().max()) if finite.numel() else 0.0
    info = torch.finfo(lse.dtype)
    if info.bits >= 32:
        return "the op contract's lse is float32 (a float64 lse is converted by the op, not by the caller)"
    half_step = (2.0 ** math.floor(math.log2(top)) * info.eps / 2) if top > 0 else info.eps / 2
    return (f"{dtype_name(lse.dtype)} keeps {-round(math.log2(info.eps)) + 1} significant bits, so this lse (|lse| "
            f"up to {top:.3g}) is off by up to {half_step:.2g}, and a split-KV partial merged with it (weight "
            f"exp(lse_i - lse)) by up to {math.expm1(half_step) * 100:.2g}%; keep lse in float32 (vLLM's forward_mqa "
            "allocated it in q's dtype)")

