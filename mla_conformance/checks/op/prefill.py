"""Checks of the op contract's ``prefill`` (varlen attention in "MHA mode", mla_conformance.contract.op) for
suites/test_op_prefill.py and the composition.

Inputs (:func:`build`, cached per :class:`PrefillSpec`): q / k / v of unit scale in the case's dtype, rows of
the given (q_len, kv_len) pairs, canaries after every buffer; ``strided``: q and v padded (NaN in the padding;
v a slice of a buffer padded to d_qk, as engines pad v for FlashAttention) and k laid out heads-first
([h_k, total_k, d_qk] storage). The float64 oracle (mla_conformance.model.attention_oracles.prefill) is computed
once per spec from the values the op is handed; out and lse are held to the decode bounds (OP_TOLERANCES:
scores in float32, P rounded to q's dtype before P.V, float32 accumulation, lse float32).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from mla_conformance.checks.op import methods as method_checks
from mla_conformance.checks.op.compare import compare_attention
from mla_conformance.contract.op import MethodCase, declared
from mla_conformance.errors import BackendOutputError
from mla_conformance.messages import with_cause
from mla_conformance.model import attention_oracles

METHOD = "prefill"


@dataclasses.dataclass(frozen=True)
class PrefillSpec:
    """rows: (q_len, kv_len) per row; h_q, h_k; (d_qk, d_v); dtype name; causal; seed; strided views."""

    rows: tuple[tuple[int, int], ...]
    h_q: int = 8
    h_k: int = 1
    d_qk: int = 192
    d_v: int = 128
    dtype: str = "bfloat16"
    causal: bool = True
    seed: int = 0
    strided: bool = False
    device: str = "cpu"

    @property
    def softmax_scale(self) -> float:
        return self.d_qk ** -0.5

    def seen(self, i: int, m: int, n: int) -> int:
        """How many keys query i of a row of m queries and n keys sees (bottom-right causal)."""
        return max(0, min(n, n - m + i + 1)) if self.causal else n

    def case(self) -> MethodCase:
        zero = any(m and not n for m, n in self.rows)
        before = any(n and self.seen(i, m, n) == 0 for m, n in self.rows for i in range(m))
        return MethodCase(METHOD, getattr(torch, self.dtype), h_q=self.h_q, h_k=self.h_k, d_qk=self.d_qk,
                          d_v=self.d_v, tokens=sum(m for m, _ in self.rows), batch=len(self.rows), causal=self.causal,
                          zero_length_rows=zero, queries_before_first_key=before, strided=self.strided,
                          device=self.device, padding_rows=sum(1 for m, n in self.rows if m == n == 0))

    def locate(self, t: int) -> str:
        for b, (m, n) in enumerate(self.rows):
            if t < m:
                return f"row {b}, query {t} of {m}, {n} keys, sees {self.seen(t, m, n)}" + self._after_padding(b, t, m)
            t -= m
        return "past the last row"

    def _after_padding(self, b: int, i: int, m: int) -> str:
        """The likely cause when query i of row b is where a zero-length padding sequence's start offset points:
        the first query after one, or (trailing padding, an offset past the end clamped) the batch's last query."""
        before = b > 0 and self.rows[b - 1] == (0, 0)
        last = all(r == (0, 0) for r in self.rows[b + 1:]) and b + 1 < len(self.rows) and i == m - 1
        if not (i == 0 and before) and not last:
            return ""
        return ("; likely cause: a zero-length padding sequence (q_len 0, kv_len 0: cu_seqlens repeating a value) "
                "wrote its result at its start offset, which is " + ("this, the next sequence's first query" if i == 0
                                                                   and before else "past the end, clamped to this last "
                                                                   "query") + ": a sequence without queries writes "
                "nothing")


def cu_seqlens(lens) -> torch.Tensor:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


@functools.lru_cache(maxsize=32)
def build(spec: PrefillSpec) -> dict[str, method_checks.Buffer]:
    g = torch.Generator().manual_seed(3000 + spec.seed)
    dt = getattr(torch, spec.dtype)
    tq, tk = sum(m for m, _ in spec.rows), sum(n for _, n in spec.rows)
    q = torch.randn(tq, spec.h_q, spec.d_qk, generator=g, dtype=torch.float64).to(dt)
    k = torch.randn(tk, spec.h_k, spec.d_qk, generator=g, dtype=torch.float64).to(dt)
    v = torch.randn(tk, spec.h_k, spec.d_v, generator=g, dtype=torch.float64).to(dt)
    pad_v = (spec.d_qk - spec.d_v) or 32
    opts = lambda **kw: kw if spec.strided else {}  # noqa: E731
    return method_checks.buffers(spec.device, q=(q, opts(pad_last=64)), k=(k, opts(order=(1, 0, 2))),
                                 v=(v, opts(pad_last=pad_v)),
                      cu_seqlens_q=cu_seqlens(m for m, _ in spec.rows), cu_seqlens_k=cu_seqlens(n for _, n in spec.rows))


def _inputs(bufs):
    return [bufs[n].view.detach().cpu() for n in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k")]


@functools.lru_cache(maxsize=32)
def oracle_of(spec: PrefillSpec, align: str = "bottom-right"):
    """(out, lse natural, magnitudes) of the float64 oracle over the values the op is handed."""
    return attention_oracles.prefill(*_inputs(build(spec)), softmax_scale=spec.softmax_scale, causal=spec.causal,
                                     magnitudes=True,
                      align=align)


def run(op, spec: PrefillSpec, check: str, bufs=None, case=None):
    """op.prefill on the spec's inputs (or ``bufs``): (out, lse) after the type / shape / dtype checks."""
    __tracebackhide__ = True
    bufs = build(spec) if bufs is None else bufs
    case = spec.case() if case is None else case
    result = method_checks.call(op, METHOD, case, check, bufs, ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k"),
                     softmax_scale=spec.softmax_scale, causal=spec.causal)
    return outputs(op, case, check, result)


def outputs(op, case, check: str, result):
    """A prefill's (out, lse) checked for type, shape and dtype (BackendOutputError); lse None for an op that
    declares ``prefill_returns_lse = False`` (whatever it returned in its place is not looked at)."""
    __tracebackhide__ = True
    out, lse = method_checks.tuple_out(op, case, check, METHOD, result, 2, "out, lse")
    tq = case.tokens
    method_checks.tensor_out(op, case, check, METHOD, "out", out, (tq, case.h_q, case.d_v))
    if not declared(op, "prefill_returns_lse"):
        return out, None
    if lse is None:
        raise BackendOutputError(f"{method_checks.where(op, case, check)}: prefill() returned (Tensor, None), not (out, lse): "
                                    "a prefill that returns no lse declares prefill_returns_lse = False")
    method_checks.tensor_out(op, case, check, METHOD, "lse", lse, (tq, case.h_q), torch.float32)
    return out, lse


def require_lse(op, what: str) -> None:
    """Skip, naming the declaration, where the op's prefill returns no lse and ``what`` needs one."""
    __tracebackhide__ = True
    if not declared(op, "prefill_returns_lse"):
        pytest.skip(f"{op.name}: declares prefill_returns_lse = False: {what} needs the prefill's lse (the op "
                    "contract's default `prefill_returns_lse = True` opts this test in)")


def empty_lse(op) -> float:
    return float("inf") if declared(op, "prefill_empty_row") == "+inf" else float("-inf")


def check_against_oracle(op, spec: PrefillSpec, *, check: str, figures: dict):
    """Run, compare with the oracle; a failing causal case with q_len != kv_len is compared once more with the
    oracle aligned top-left, to name that as the likely cause."""
    __tracebackhide__ = True
    method_checks.require_method(op, METHOD)
    case = method_checks.require(op, spec.case())
    figures.update(case=case.describe(), check=check, op=op.name)
    out, lse = run(op, spec, check)
    kw = dict(base=declared(op, "prefill_lse_base"), base_key="prefill_lse_base", empty_lse=empty_lse(op),
              empty_key="prefill_empty_row", locate=spec.locate)
    try:
        compare_attention(op, case, out, lse, oracle_of(spec), check=check, figures=figures, **kw)
    except AssertionError as exc:
        if spec.causal and any(m != n for m, n in spec.rows):
            try:
                compare_attention(op, case, out, lse, oracle_of(spec, "top-left"), check=check, figures={}, **kw)
            except AssertionError:
                raise exc from None
            figures["likely_cause"] = "top-left causal alignment"
            raise AssertionError(with_cause(
                str(exc), "top-left causal alignment -- the op matches the oracle in which query i sees keys 0..i; the "
                "contract aligns causal prefill bottom-right (query i of a row of m queries and n keys sees keys "
                "j <= n - m + i: the queries are the row's last m tokens)")) from None
        raise
    return out, lse


__all__ = ["PrefillSpec", "build", "oracle_of", "run", "outputs", "require_lse", "check_against_oracle", "cu_seqlens",
           "empty_lse"]
