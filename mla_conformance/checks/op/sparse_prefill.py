"""Checks of the op contract's ``sparse_prefill`` (FlashMLA's ``flash_mla_sparse_fwd``, as its tests/ref.py
defines it) for suites/test_op_sparse_prefill.py.

Inputs (:func:`build`, cached per :class:`SparseSpec`): q and kv of scale 1/10 in the case's dtype, as FlashMLA's
tests generate them, each a strided view (NaN in its padding) with a canary after it; indices drawn without
repeats from the s_kv keys, then a share of them replaced by FlashMLA's invalid candidates (-2^31, -123456, -1,
s_kv, 114514, 2^31 - 1), rows of every index invalid, topk_length, attention sinks with +-inf. The float64 oracle
(mla_conformance.model.attention_oracles.sparse_prefill) is computed once per spec; out and lse are held to
the decode bounds (OP_TOLERANCES), max_logits to the score bound dot x A_max of its query.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from mla_conformance.checks import op as op_checks
from mla_conformance.checks.op import methods as method_checks
from mla_conformance.checks.op.compare import compare_attention
from mla_conformance.contract.op import MethodCase, declared
from mla_conformance.messages import failure
from mla_conformance.model import attention_oracles

METHOD = "sparse_prefill"
#: FlashMLA's tests/lib.py invalid index candidates (its 1919810 and 2147480000 are more of the same)
INVALID = (-2 ** 31, -123456, -1, None, 114514, 2 ** 31 - 1)   # None: s_kv, one past the last key
#: FlashMLA's test softmax scale (tests/lib.py: "sm_scale=0.5"); with q, kv of scale 1/10 the logits have a
#: standard deviation of ~1.2 at d_qk 576
SOFTMAX_SCALE = 0.5


@dataclasses.dataclass(frozen=True)
class SparseSpec:
    s_q: int = 6
    s_kv: int = 96
    topk: int = 64
    h_q: int = 64
    d_qk: int = 576
    d_v: int = 512
    dtype: str = "bfloat16"
    invalid_share: float = 0.0
    all_invalid_rows: tuple[int, ...] = ()
    topk_length: bool = False
    attn_sink: bool = False
    seed: int = 0
    device: str = "cpu"

    def case(self) -> MethodCase:
        return MethodCase(METHOD, getattr(torch, self.dtype), h_q=self.h_q, h_k=1, d_qk=self.d_qk, d_v=self.d_v,
                          tokens=self.s_q, topk=self.topk, topk_length=self.topk_length, attn_sink=self.attn_sink,
                          zero_length_rows=bool(self.all_invalid_rows), strided=True, device=self.device)


@functools.lru_cache(maxsize=32)
def build(spec: SparseSpec) -> dict[str, method_checks.Buffer]:
    g = torch.Generator().manual_seed(4000 + spec.seed)
    dt = getattr(torch, spec.dtype)
    q = (torch.randn(spec.s_q, spec.h_q, spec.d_qk, generator=g, dtype=torch.float64) / 10).to(dt)
    kv = (torch.randn(spec.s_kv, 1, spec.d_qk, generator=g, dtype=torch.float64) / 10).to(dt)
    idx = torch.stack([torch.randperm(spec.s_kv, generator=g)[:spec.topk] for _ in range(spec.s_q)])
    if spec.invalid_share:
        bad = torch.rand(spec.s_q, spec.topk, generator=g) < spec.invalid_share
        bad[:, 0], bad[:, 1] = True, False                  # some invalid entry per row, never all of them
        pick = torch.randint(len(INVALID), (spec.s_q, spec.topk), generator=g)
        values = torch.tensor([spec.s_kv if v is None else v for v in INVALID], dtype=torch.int64)[pick]
        idx = torch.where(bad, values, idx)
    for s in spec.all_invalid_rows:
        idx[s] = torch.tensor([spec.s_kv if v is None else v for v in INVALID])[torch.arange(spec.topk) % len(INVALID)]
    tensors = dict(q=(q, {"pad_last": 64}), kv=(kv, {"pad_last": 64}), indices=(idx.to(torch.int32)[:, None, :], {}))
    if spec.topk_length:
        tl = torch.randint(1, spec.topk + 1, (spec.s_q,), generator=g)
        tl[0], tl[-1] = spec.topk, 1                        # one row uses every entry, one a single entry
        tensors["topk_length"] = tl.to(torch.int32)
    if spec.attn_sink:
        values = (0.0, 2.0, math.inf, -math.inf, -1.0, 4.0)
        tensors["attn_sink"] = torch.tensor([values[h % len(values)] for h in range(spec.h_q)], dtype=torch.float32)
    return method_checks.buffers(spec.device, **tensors)


def _kwargs(bufs) -> dict:
    return {n: bufs[n] for n in ("topk_length", "attn_sink") if n in bufs}


@functools.lru_cache(maxsize=32)
def oracle_of(spec: SparseSpec):
    """(out, max_logits, lse natural, magnitudes) of the float64 oracle over the values the op is handed."""
    t = {n: b.view.detach().cpu() for n, b in build(spec).items()}
    return attention_oracles.sparse_prefill(t["q"], t["kv"], t["indices"], softmax_scale=SOFTMAX_SCALE, d_v=spec.d_v,
                             topk_length=t.get("topk_length"), attn_sink=t.get("attn_sink"), magnitudes=True)


def check_against_oracle(op, spec: SparseSpec, *, check: str, figures: dict):
    """Run op.sparse_prefill; check out / lse (compare_attention) and max_logits (-inf where no index is valid,
    else within dot x A_max of the oracle's)."""
    __tracebackhide__ = True
    method_checks.require_method(op, METHOD)
    case = method_checks.require(op, spec.case())
    figures.update(case=case.describe(), check=check, op=op.name)
    bufs = build(spec)
    result = method_checks.call(op, METHOD, case, check, bufs, ("q", "kv", "indices"), softmax_scale=SOFTMAX_SCALE,
                     d_v=spec.d_v, **_kwargs(bufs))
    out, max_logits, lse = method_checks.tuple_out(op, case, check, METHOD, result, 3, "out, max_logits, lse")
    method_checks.tensor_out(op, case, check, METHOD, "out", out, (spec.s_q, spec.h_q, spec.d_v))
    method_checks.tensor_out(op, case, check, METHOD, "max_logits", max_logits, (spec.s_q, spec.h_q), torch.float32)
    method_checks.tensor_out(op, case, check, METHOD, "lse", lse, (spec.s_q, spec.h_q), torch.float32)
    o_out, o_max, o_lse, mags = oracle_of(spec)
    valid = _valid_count(bufs, spec)

    def locate(s: int) -> str:
        return f"query {s}, {valid[s]} valid of its top-{spec.topk} indices"

    compare_attention(op, case, out, lse, (o_out, o_lse, mags), check=check, figures=figures,
                      base=declared(op, "sparse_prefill_lse_base"), base_key="sparse_prefill_lse_base",
                      empty_lse=math.inf, empty_key=None, locate=locate)
    _check_max_logits(op, case, check, max_logits, o_max, mags, figures, locate)
    return out, max_logits, lse


def _valid_count(bufs, spec: SparseSpec) -> list[int]:
    idx = bufs["indices"].view.detach().cpu().long()[:, 0]
    ok = (idx >= 0) & (idx < spec.s_kv)
    if "topk_length" in bufs:
        ok &= torch.arange(spec.topk) < bufs["topk_length"].view.detach().cpu().long()[:, None]
    return ok.sum(-1).tolist()


def _check_max_logits(op, case, check, got, ref, mags, figures, locate) -> None:
    __tracebackhide__ = True
    w = method_checks.where(op, case, check)
    _, tol = op_checks.tolerance_for(case)
    got = got.detach().cpu().to(torch.float64)
    empty = torch.isneginf(ref)
    wrong = empty & (got != -math.inf)
    if bool(wrong.any()):
        s, h = (int(i) for i in wrong.nonzero()[0])
        raise AssertionError(failure(f"{w}: query {s} ({locate(s)}) has no valid index, so max_logits must be -inf (FlashMLA's "
                             f"ref.py); got {float(got[s, h])} at head {h}"))
    # a max of float32 scores: each off by at most dot x A_t <= dot x A_max; stored in float32 (2^-24 x |max|)
    bound = tol.dot * mags["score_max"] + 2 ** -24 * torch.where(empty, 0.0, ref).abs()
    err = torch.where(empty, torch.zeros_like(got), (got - ref).abs()).nan_to_num(nan=math.inf)
    figures["max_logits_max_abs"] = float(err.max()) if err.numel() else 0.0
    over = err > bound
    if bool(over.any()):
        s, h = divmod(int((err / bound.clamp_min(1e-300)).flatten().argmax()), err.shape[1])
        raise AssertionError(failure(f"{w}: max_logits differ from the float64 oracle at (s, h) = ({s}, {h}) ({locate(s)}): "
                             f"got {float(got[s, h]):.6g}, expected {float(ref[s, h]):.6g}, error "
                             f"{float(err[s, h]):.3e} over the bound {float(bound[s, h]):.3e} (dot {tol.dot:.3g} x A_max "
                             f"{float(mags['score_max'][s, h]):.3g} + 2^-24 |max|); {int(over.sum())} of "
                             f"{int((~empty).sum())} over"))


__all__ = ["SparseSpec", "build", "oracle_of", "check_against_oracle", "INVALID", "SOFTMAX_SCALE"]
