"""What the checks of the op contract's optional methods (every method but decode: contract/methods.py) share:

* **presence** (:func:`require_method`): a test of a method skips, naming it and its signature, on an op that
  has not got it; the case is then asked of the op (``unsupported_reason``) and of its declarations
  (:func:`require`);
* **buffers** (:class:`Buffer`): every tensor handed to a method is a view at the start of a larger allocation
  with a canary after it (mla_conformance.checks.op.Buffer), possibly strided: padded (NaN in the padding) or
  laid out in another dimension order (vLLM keeps lse as [h, T]);
* **calling** (:func:`call`): an op that raises is a BackendError, one that writes an input or past a buffer
  fails; :func:`tensor_out` checks a returned tensor's type, shape and dtype (BackendOutputError);
* **comparing**: out / lse [T, h, ...] against a float64 oracle is
  :func:`mla_conformance.checks.op.compare.compare_attention` (the decode comparison's checks in the token layout,
  within :func:`~mla_conformance.checks.op.compare.attention_bounds` or a method's own
  :class:`~mla_conformance.checks.op.compare.Bounds`).

Failure messages name the op, the case (MethodCase.describe), the check, the measured numbers and the bound.
"""

from __future__ import annotations

import math

import pytest
import torch

from mla_conformance.checks import op as op_checks
from mla_conformance.checks.op import inputs as op_inputs
from mla_conformance.checks.op.inputs import declared_otherwise, not_declared, op_reason, where
from mla_conformance.checks.op.run import permuted, raised
from mla_conformance.contract.methods import FLAG, method_spec
from mla_conformance.contract.op import declared, has_method, layout_of
from mla_conformance.errors import BackendOutputError
from mla_conformance.dtypes import dtype_name

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


class Buffer(op_checks.Buffer):
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
        self.base = torch.full((n + op_checks.CANARY_BYTES,), op_checks.CANARY_BYTE, dtype=torch.uint8, device=device)
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
    kw = {k: (v.view if isinstance(v, op_checks.Buffer) else v) for k, v in kwargs.items()}
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
    got = f"{op_checks.dtype_name(value.dtype)} {tuple(value.shape)}"
    if tuple(value.shape) != tuple(shape):
        raise BackendOutputError(f"{w}: {method}() returned {what} {got}, expected {expected}"
                                 f"{permuted(method, what, layout, tuple(value.shape), tuple(shape))}")
    if not value.is_floating_point() or (dtype is not None and value.dtype != dtype):
        extra = f" ({why_dtype})" if why_dtype else ""
        if dtype == torch.float32 and value.is_floating_point() and value.dtype != dtype:
            extra = (f" (the op contract's {what} is float32: partial results are merged by exp(lse_i - lse), and "
                     f"{op_checks.dtype_name(value.dtype)} keeps {torch.finfo(value.dtype).nmant + 1} significant bits)")
        raise BackendOutputError(f"{w}: {method}() returned {what} {got}, expected {expected}{extra}")
    return value


def tuple_out(op, case, check: str, method: str, result, n: int, names: str):
    __tracebackhide__ = True
    if not isinstance(result, (tuple, list)) or len(result) != n:
        raise BackendOutputError(f"{where(op, case, check)}: {method}() returned {type(result).__name__}, not "
                                 f"({names})")
    return tuple(result)


__all__ = ["require_method", "missing_method_reason", "unsupported", "require", "first_supported",
           "Buffer", "buffers", "call", "tensor_out", "tuple_out", "where"]
