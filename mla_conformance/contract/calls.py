"""The layer contract's call boundary (:mod:`mla_conformance.contract.layer`, "Failed vs error"): a backend's
method called through :func:`call_backend` (whatever it raises is a :class:`~mla_conformance.errors.BackendError`,
an *error*), what it returns checked by :func:`check_output` (``attend()``) and :func:`tensors_of_checked`
(a cache's ``tensors()``): a wrong type, shape or dtype is a BackendOutputError (an *error*), a non-finite value
on a valid slot a :class:`NonFiniteOutput` (an AssertionError: a *failure*, the output is wrong).

The checks (:mod:`mla_conformance.checks.layer.driver`), greedy generation (:mod:`mla_conformance.generation`) and the
bench's gate call backends through here alike.
"""

from __future__ import annotations

from typing import Any

import torch

from mla_conformance.errors import BackendError, BackendOutputError
from mla_conformance.messages import failure

NAN_HINT = ("the suite fills every cache slot no token was written to with NaN (and 0xFF bytes in integer "
            "storage), as a reused or torch.empty pool may hold: a backend that reads slots past seq_lens and "
            "masks them by multiplying with 0 (0 * NaN = NaN) or by adding a large negative number to scores "
            "computed from them (NaN + -inf = NaN) gets NaN; select with torch.where or read only the written slots")


class NonFiniteOutput(AssertionError):
    """attend() returned NaN/inf on a valid slot; ``where`` is the message without its cause clause."""

    def __init__(self, where: str, hint: str = NAN_HINT):
        super().__init__(failure(where, cause=hint))
        self.where = where


def check_output(backend, out: Any, hidden_states: torch.Tensor, lengths: torch.Tensor, where: str,
                 positions: torch.Tensor | None = None) -> torch.Tensor:
    """Type, shape and dtype of one attend() result (a BackendOutputError: an *error*), then finiteness
    on valid slots (an AssertionError: a *failure*, the output is wrong)."""
    __tracebackhide__ = True
    name = getattr(backend, "name", backend)
    if not isinstance(out, torch.Tensor):
        raise BackendOutputError(f"{name}: attend() returned {type(out).__name__}, not a Tensor ({where})")
    if tuple(out.shape) != tuple(hidden_states.shape):
        raise BackendOutputError(f"{name}: attend() returned shape {tuple(out.shape)}, expected "
                                 f"{tuple(hidden_states.shape)} ({where})")
    if out.dtype != hidden_states.dtype:
        raise BackendOutputError(f"{name}: attend() returned {out.dtype}, expected hidden_states' "
                                 f"{hidden_states.dtype} ({where})")
    valid = torch.arange(out.shape[1], device=out.device)[None, :] < lengths.to(out.device)[:, None]
    bad = ~torch.isfinite(out) & valid[..., None]
    if bool(bad.any()):
        b, s, h = (int(i) for i in bad.nonzero()[0])
        kind = "NaN" if bool(torch.isnan(out[b, s, h])) else "inf"
        pos = int(positions[b, s]) if positions is not None else s
        raise NonFiniteOutput(f"{name}: attend() output has {int(bad.sum())} non-finite value(s): {kind} "
                              f"at row {b}, position {pos}, channel {h} ({where})")
    return out


def call_backend(backend, method: str, *args, **kwargs):
    """Call a backend method; any exception it raises (AssertionError included: it comes from the
    backend's code, not from a check) becomes a BackendError naming the backend and the method."""
    __tracebackhide__ = True
    try:
        return getattr(backend, method)(*args, **kwargs)
    except Exception as exc:
        raise BackendError(f"{getattr(backend, 'name', backend)}: {method}() raised "
                           f"{type(exc).__name__}: {exc}") from exc


def tensors_of_checked(tensors, where: str) -> dict[str, torch.Tensor]:
    __tracebackhide__ = True
    if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
        raise BackendOutputError(f"{where}: tensors() must return a dict of name -> Tensor, got "
                                 f"{type(tensors).__name__}")
    return tensors
