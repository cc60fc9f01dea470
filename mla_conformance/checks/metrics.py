"""The error metrics every check reports (one definition each), dtype names, the margin, and the sentences that
explain a NaN in an output (the one said before the control run, ``NAN_HINT``, is the contract's:
:mod:`mla_conformance.contract.calls`)."""

from __future__ import annotations

import math

import torch

from mla_conformance.dtypes import dtype_name  # noqa: F401  (re-exported: the checks name dtypes through here)

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16}


def error_metrics(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """max / mean / p99 absolute error, exact fraction, cosine difference and relative Frobenius."""
    out = out.to(torch.float64).flatten()
    ref = ref.to(torch.float64).flatten()
    diff = (out - ref).abs()
    ref_rms = float(ref.pow(2).mean().sqrt()) if ref.numel() else 0.0
    cos = torch.nn.functional.cosine_similarity(out, ref, dim=0) if ref.numel() else torch.tensor(1.0)
    return {
        "max_abs": float(diff.max()) if diff.numel() else 0.0,
        "mean_abs": float(diff.mean()) if diff.numel() else 0.0,
        "p99_abs": float(diff.kthvalue(max(1, math.ceil(0.99 * diff.numel())))[0]) if diff.numel() else 0.0,
        "exact_fraction": float((diff == 0).double().mean()) if diff.numel() else 1.0,
        "cosine_diff": float(1 - cos),
        "rel_fro": float((out - ref).norm() / ref.norm()) if ref.numel() and float(ref.norm()) else 0.0,
        "ref_rms": ref_rms,
        "max_rel": float(diff.max()) / ref_rms if diff.numel() and ref_rms else 0.0,
    }


def format_metrics(m: dict[str, float]) -> str:
    return (f"rel_fro={m['rel_fro']:.3e} max_abs={m['max_abs']:.3e} mean_abs={m['mean_abs']:.3e} "
            f"p99_abs={m['p99_abs']:.3e} exact={m['exact_fraction']:.4f} cos_diff={m['cosine_diff']:.3e} "
            f"(ref rms {m['ref_rms']:.3f})")


#: the NaN message's last clause, once the zero-filled control run has told the two causes apart
NAN_FROM_POISON = ("the same run on a zero-filled cache gives finite outputs: the backend reads cache slots no token "
                   "was written to (the suite fills them with NaN, as a reused or torch.empty pool may hold) and masks "
                   "them by multiplying with 0 (0 * NaN = NaN) or by adding a large negative number to scores computed "
                   "from them (NaN + -inf = NaN); select with torch.where or read only the written slots")
NAN_OWN = ("the same run on a zero-filled cache gives non-finite outputs too: not a read of unwritten slots -- the "
           "backend's own arithmetic makes it (0/0 in a softmax over no keys, exp without the running max, a NaN "
           "constant, an overflow in the dtype)")

#: the op tests' NaN sentence (the op contract's poison: unused pages, page tails, a strided q's padding)
OP_NAN_HINT = ("either poison was read -- the suite fills unused pages, the unfilled tail of each row's last page "
               "(0xFF bytes in the FP8 layout) and a non-contiguous q's padding with NaN, as a reused pool may hold: "
               "an op that reads keys past cache_seqlens and masks them by multiplying with 0 or adding -inf to their "
               "scores gets NaN; select with torch.where or read only the row's keys -- or the op's own arithmetic "
               "overflowed (exp without the running max, 0/0)")


def row_metrics(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """rel_fro and max_abs / rms(ref) of one row (what the tolerance bounds)."""
    diff = (out - ref).abs()
    rms = float(ref.pow(2).mean().sqrt()) if ref.numel() else 0.0
    norm = float(ref.norm())
    return {"rel_fro": float(diff.norm()) / norm if norm else 0.0,
            "max_rel": float(diff.max()) / rms if diff.numel() and rms else 0.0}


def margin(measured: float | None, tolerance: float | None) -> float | None:
    """tolerance / measured: how many times the error could grow before it fails (below 1 fails); None when
    either is missing, inf when nothing was measured to err (measured 0)."""
    if measured is None or tolerance is None:
        return None
    if measured == 0:
        return math.inf
    return tolerance / measured
