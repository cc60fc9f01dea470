"""Conformance checks shared by the suites, the meta tests and the ``run`` command.

Each check takes a backend and raises ``AssertionError`` (with a message naming the backend, the
scenario and the measured numbers) when the backend does not conform; ``pytest.skip`` is raised
through :func:`require_support` with the backend's own sentence when it opts out.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import torch

from mla_conformance.contract.layer import cache_format_of, declared_on, support_reason
from mla_conformance.kv.codecs import FP8_INDEXER_BLOCK
from mla_conformance.model.config import MLAConfig
from mla_conformance.kv.caches.measure import (bookkeeping_limit, describe_buffers, is_bookkeeping, poison, slot_figures,
                                            written_bytes, written_masks)
from mla_conformance.errors import BackendError, BackendOutputError
from mla_conformance.model.reference import reference_attention_f64
from mla_conformance.model.weights import MLAWeights

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --------------------------------------------------------------------------- tolerances


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """Bounds on a backend's output against the float64 expanded reference.

    rel_fro: ||out - ref||_F / ||ref||_F;  max_rel: max |out - ref| / rms(ref).
    """

    rel_fro: float
    max_rel: float
    reason: str


#: The one tolerance table (markers.md's is generated from it: `mla-conformance docs`), derived from the unit
#: roundoff u of the dtype (2^-8 bfloat16, 2^-11 float16, 2^-24 float32) and the number of roundings on the way
#: from the layer input to its output: the input, five weights (q path, kv_a, kv_b, o_proj) and about six
#: intermediate results (projections, the two norms, RoPE, scores / probabilities, P.V, o_proj) are each rounded
#: once, k ~ 12 roundings of independent sign: rel_fro ~ sqrt(k) u ~ 3.5 u. The bounds allow a kernel that
#: rounds twice as often (rel_fro ~ 6 u) and, per element, the tail of that error over the output's rms
#: (max_rel ~ 40 u: the largest of ~10^5 output errors is ~4.5 sigma, times the elements' spread around rms).
#: A rel_fro or max_rel a built-in measures is in each numerics test's figures (conformance.json), not here.
TOLERANCES: dict[str, Tolerance] = {
    "float64": Tolerance(1e-6, 1e-5, "float64 end to end, where everything errs by ~1e-15 (53-bit roundings); "
                                     "1e-6 (17 float32 unit roundoffs) leaves room for RoPE tables computed in "
                                     "float32, as transformers computes them, at the suite's positions"),
    "float32": Tolerance(1e-5, 1e-4, "~12 float32 roundings (u = 6e-8) give ~2e-7; dot products of up to 2048 "
                                     "terms add up to sqrt(2048) u ~ 3e-6: 1e-5 = 170 u; a 1e-2 relative error in "
                                     "one YaRN frequency moves late positions by far more than 1e-5"),
    "float16": Tolerance(5e-3, 3e-2, "float16 (u = 2^-11 = 4.9e-4) inputs, weights and intermediates: ~3.5 u = "
                                     "1.7e-3 expected, 5e-3 = 10 u allows a kernel that rounds twice as often; "
                                     "max_rel 3e-2 = 61 u"),
    "bfloat16": Tolerance(2.5e-2, 1.5e-1, "bfloat16 (u = 2^-8 = 3.9e-3) inputs, weights and intermediates: ~3.5 u = "
                                          "1.4e-2 expected, 2.5e-2 = 6.4 u allows a kernel that rounds twice as "
                                          "often; max_rel 0.15 = 38 u"),
}

#: Tighter bounds the float64 anchor test (tests/test_reference_anchor.py) holds each built-in to.
ANCHOR_TOLERANCES = {"reference-naive": 1e-8, "reference-absorbed": 1e-8, "hf-transformers": 1e-5}


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half a step of ``dtype`` at 1 (the largest relative error of rounding to it): 2^-8 bfloat16, 2^-11
    float16, 2^-24 float32, 2^-53 float64."""
    return torch.finfo(dtype).eps / 2


#: The op contract's lse is float32 whatever q's dtype: storing it errs by up to this times |lse|.
OP_LSE_ROUNDING = unit_roundoff(torch.float32)
#: Rounding errors of one float32 dot product of 576 terms (q . k) summed in k-blocks of 16, as tensor-core
#: MMA and SIMD GEMMs do: at most 576 / 16 + 16 = 52 roundings on the way to each score.
OP_DOT_ROUNDINGS = 576 // 16 + 16
#: Rounding errors of the float32 P.V accumulation, the normaliser sum and the online-softmax rescales per
#: output element, for up to 1024 keys per query in k-blocks of 16 (the op suite's longest row is 130): at most
#: 1024 / 16 (P.V) + 1024 / 16 (rescales, one per block) + 16 (within a block) + a few (exp, the division): 256.
OP_ACC_ROUNDINGS = 256


@dataclasses.dataclass(frozen=True)
class OpTolerance:
    """Error bounds of an op's (out, lse) against the float64 op oracle (mla_conformance.impl.ops.reference.oracle),
    derived per element by first-order error analysis of a kernel that computes scores in float32, rounds P
    (exp(s - m)) to the q / cache dtype before P.V, accumulates P.V in float32 and rounds out once:

    |out - ref| <= u_out |ref| + (p_round + acc) S + dot T        (per element)
    |lse - ref| <= dot Abar + acc (1 + |ref|) + 2^-24 |ref|       (per query, natural log)

    u_out: half a step of the dtype the op *returned* out in (mla_conformance.checks.unit_roundoff);
    S = softmax @ |V| (sum_t p_t |v_t|): rounding each p_t by a relative p_round moves out by at most
    p_round S, and the float32 sums by at most acc S; T = sum_t p_t (A_t + A_max) |v_t| with A_t = scale
    sum_d |q_d k_td|: a score error |e_t| <= dot A_t moves p_t by p_t (e_t - sum p e) at first order, so out
    by at most dot T, lse by at most dot Abar (Abar = sum_t p_t A_t). S, T, Abar and A_max come from the
    float64 oracle (``magnitudes=True``), once per case. With an attention sink the bound on out adds
    (1 - factor) x the lse bound x |ref|. Split-KV merges and op-vs-op comparisons add the bounds of both
    sides (mla_conformance.checks.op.bounds).
    """

    p_round: float
    dot: float
    acc: float
    reason: str


def _op_row(dtype: torch.dtype, p_dtype: torch.dtype, reason: str) -> OpTolerance:
    u = unit_roundoff(torch.float64 if dtype == torch.float64 else torch.float32)  # the accumulation's
    return OpTolerance(unit_roundoff(p_dtype), OP_DOT_ROUNDINGS * u, OP_ACC_ROUNDINGS * u, reason)


_OP_F32 = "float32 terms as the float32 row's"

#: The op tests' error bounds, keyed by q's dtype (the FP8 656-byte cache has its own row, with a bfloat16 q,
#: against the oracle of the *dequantized* cache). Every entry is derived (OpTolerance says how); none is a
#: measurement of reference-op.
OP_TOLERANCES: dict[str, OpTolerance] = {
    "float64": _op_row(torch.float64, torch.float64,
                       "float64 end to end: P, scores and sums in float64 (p_round 2^-53, dot 52 x 2^-53, acc 256 x "
                       "2^-53, counted as for float32); lse is float32 by contract (2^-24 x |lse|)"),
    "float32": _op_row(torch.float32, torch.float32,
                       "P kept in float32 (p_round 2^-24). Float32 terms: a score is a float32 dot product of 576 "
                       "exact products (q and the cache hold their dtype's values exactly) summed in k-blocks of 16, "
                       "at most 576/16 + 16 = 52 roundings: dot 52 x 2^-24 per unit of A; the P.V sum, the "
                       "normaliser and the rescales over up to 1024 keys take at most 256 roundings: acc 256 x 2^-24"),
    "bfloat16": _op_row(torch.bfloat16, torch.bfloat16,
                        "P rounded to bfloat16 before P.V (vLLM's and SGLang's Triton decode: acc += "
                        "tl.dot(p.to(v.dtype), v); FlashMLA and FlashInfer alike): each p_t off by up to 2^-8, so "
                        "out by up to 2^-8 x sum_t p_t |v_t| per element (p_round 2^-8); " + _OP_F32),
    "float16": _op_row(torch.float16, torch.float16,
                       "P rounded to float16 before P.V: up to 2^-11 x sum_t p_t |v_t| per element (p_round 2^-11); "
                       + _OP_F32),
    "fp8-e4m3-flashmla": _op_row(torch.bfloat16, torch.bfloat16,
                                 "656-byte FP8 cache, bfloat16 q, against the oracle of the dequantized cache (e4m3 x "
                                 "float32 tile scale, bf16 rope): P rounded to bfloat16 as FlashMLA's sparse FP8 "
                                 "decode does (p_round 2^-8); the dequantized K and V must reach the products as "
                                 "stored (exact in bfloat16 under pow2 scales; an op of fp32 scales that rounds "
                                 "them to bfloat16 is not covered); " + _OP_F32),
}

#: DeepSeek Sparse Attention: a backend's indexer scores (the optional ``last_indexer_scores``) against
#: ``reference.indexer_scores_f64``, rows of the one table above (suites/test_dsa.py::test_indexer_scores).
#: Here both bounds are relative to M[s,t] = sum_h |w_sh| sum_i |q_shi| |k_ti| (the float64 oracle's q, k after
#: the Hadamard rotation): what a score's rounding error scales with, since ReLU(q.k) cancels. rel_fro =
#: ||got - oracle||_F / ||M||_F, max_rel = max |got - oracle| / M over the causal entries.
FP8_E4M3_PRODUCT_ERROR = (1 + 2 ** -4) ** 2 - 1  # e4m3 keeps 3 mantissa bits: |x - fp8(x)| <= 2^-4 |x| (normal range)
TOLERANCES.update({
    "indexer-scores float32": Tolerance(1e-6, 1e-5, "DSA indexer scores vs indexer_scores_f64, errors relative "
                                        "to M = sum_h |w_h| sum_i |q_hi k_ti| (test_dsa.py::test_indexer_scores, "
                                        "every indexer-scores row): a 128-term fp32 dot product's worst-case error is "
                                        "128 x 2^-24 = 7.6e-6 of M (max_rel 1e-5); reference-dsa measures "
                                        "rel_fro 4.5e-8, max_rel 2.6e-7 on tiny-dsa"),
    "indexer-scores bfloat16": Tolerance(4e-3, 2e-2, "q, k and w are rounded to bf16 (2^-9 each) about 10 times "
                                         "on their way (projection, LayerNorm, RoPE, Hadamard): 10 x 2^-9 = 2e-2 of "
                                         "M; reference-dsa measures rel_fro 7.8e-4, max_rel 6.5e-3 on tiny-dsa"),
    "indexer-scores fp8-e4m3": Tolerance(
        FP8_E4M3_PRODUCT_ERROR + 2e-2, FP8_E4M3_PRODUCT_ERROR + 2e-2,
        "derived: q and k quantized to e4m3 with power-of-two block scales err by <= 2^-4 each (the block max "
        "lands in [224, 448], normal range), so each product q_i k_i by <= (1 + 2^-4)^2 - 1 = 0.1289 of |q_i k_i|, "
        "hence of M; plus the bf16 row's 2e-2 (the FP8 path computes in bf16); values in e4m3's subnormal range add "
        "<= scale x 2^-10 each, added to the bound per element; reference-dsa measures rel_fro 2.2e-3, max_rel "
        "1.2e-2 on v3.2-mini"),
})


# --------------------------------------------------------------------------- metrics


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


NAN_HINT = ("the suite fills every cache slot no token was written to with NaN (and 0xFF bytes in integer "
            "storage), as a reused or torch.empty pool may hold: a backend that reads slots past seq_lens and "
            "masks them by multiplying with 0 (0 * NaN = NaN) or by adding a large negative number to scores "
            "computed from them (NaN + -inf = NaN) gets NaN; select with torch.where or read only the written slots")


#: the NaN message's last clause, once the zero-filled control run has told the two causes apart
NAN_FROM_POISON = ("the same run on a zero-filled cache gives finite outputs: the backend reads cache slots no token "
                   "was written to (the suite fills them with NaN, as a reused or torch.empty pool may hold) and masks "
                   "them by multiplying with 0 (0 * NaN = NaN) or by adding a large negative number to scores computed "
                   "from them (NaN + -inf = NaN); select with torch.where or read only the written slots")
NAN_OWN = ("the same run on a zero-filled cache gives non-finite outputs too: not a read of unwritten slots -- the "
           "backend's own arithmetic makes it (0/0 in a softmax over no keys, exp without the running max, a NaN "
           "constant, an overflow in the dtype)")


class NonFiniteOutput(AssertionError):
    """attend() returned NaN/inf on a valid slot; ``where`` is the message without its cause clause."""

    def __init__(self, where: str, hint: str = NAN_HINT):
        super().__init__(f"{where}; {hint}")
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


def diagnosis(backend, weights) -> str:
    """The backend's own explanation of a failure, when it offers one (optional ``diagnose(weights)``)."""
    diagnose = getattr(backend, "diagnose", None)
    if not callable(diagnose):
        return ""
    try:
        hint = diagnose(weights)
    except Exception:
        return ""
    return f" [{backend.name} diagnosis: {hint}]" if hint else ""


def require_support(backend, config: MLAConfig, *, dtype, device, kv_codec="none") -> None:
    """Skip with :func:`mla_conformance.contract.layer.support_reason`'s sentence: an optional part the config needs
    that the backend does not declare, or the backend's own sentence for a combination it declines."""
    import pytest

    reason = support_reason(backend, config, dtype=dtype, device=device, kv_codec=kv_codec)
    if reason:
        pytest.skip(reason)


# --------------------------------------------------------------------------- scenarios


@dataclasses.dataclass(frozen=True)
class Scenario:
    """Per-row prefill lengths, then ``decode_steps`` one-token steps for every row."""

    name: str
    prefill: tuple[int, ...]
    decode_steps: int = 0
    chunk: int | None = None  # prefill in chunks of this many tokens (None = one call)

    @property
    def batch(self) -> int:
        return len(self.prefill)

    def total(self, b: int) -> int:
        return self.prefill[b] + self.decode_steps


SCENARIOS = {
    "prefill": Scenario("prefill", (24,)),
    "prefill_decode": Scenario("prefill_decode", (20,), decode_steps=6),
    "varlen_batch": Scenario("varlen_batch", (23, 16, 7), decode_steps=4),
    # long enough that reading only part of the cache shows, and (tiny) crossing original_max_position
    "long_context": Scenario("long_context", (290,), decode_steps=4, chunk=160),
}


@functools.lru_cache(maxsize=4)
def _weights(preset: str, seed: int) -> MLAWeights:
    return MLAWeights.random(MLAConfig.preset(preset), seed=seed, dtype=torch.float64)


@functools.lru_cache(maxsize=8)
def _weights_as(preset: str, seed: int, dtype: torch.dtype, device: str) -> MLAWeights:
    return _weights(preset, seed).to(dtype, device=device).clone()  # never the oracle's own tensors


@functools.lru_cache(maxsize=2)
def _bytes_weights(preset: str, dtype: torch.dtype, device: str) -> MLAWeights:
    """Weights for byte checks: no float64 master kept (at DeepSeek-V3 dims that would be 1.5 GB)."""
    return MLAWeights.random(MLAConfig.preset(preset), seed=0, dtype=dtype, device=device, draw_dtype=torch.float32)


def weights_for(preset: str, dtype: torch.dtype, device="cpu", seed: int = 0) -> MLAWeights:
    """Random weights of a preset (drawn once in float64, then cast), cached per dtype and device."""
    return _weights_as(preset, seed, dtype, str(device))


def inputs_for(config: MLAConfig, scenario: Scenario, seed: int = 1) -> torch.Tensor:
    """Hidden states [B, T, hidden] in float64 (RMS ~1, like a normed layer input)."""
    T = max(scenario.total(b) for b in range(scenario.batch))
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(scenario.batch, T, config.hidden_size, generator=gen, dtype=torch.float64)


def run_scenario(backend, weights: MLAWeights, x: torch.Tensor, scenario: Scenario, *, device="cpu",
                 capacity: int | None = None, kv_codec: str = "none", poison_sentinel: int = 0xFF,
                 trace: dict | None = None, zero_fill: bool = False):
    """Drive a backend through the scenario; return (outputs float64 [B, T, hidden], cache).

    Outputs are placed at each token's position so they line up with the one-shot reference. What the
    suite guarantees around the backend, each a failure naming its cause:

    * the fresh cache's token-storage buffers are poisoned (NaN; ``poison_sentinel`` bytes in integer
      storage) and the poison must land (``tensors()`` are the cache's own buffers): see
      :mod:`mla_conformance.kv.caches.measure`;
    * the backend gets its own copy of the weights; a backend that changes them, or the hidden_states it
      is given, in place fails naming the tensor.

    A non-finite output is a failure whose message says which of two causes it is: the scenario is run again
    on a zero-filled cache (``zero_fill``, the control run), where a backend that reads unwritten slots gives
    finite outputs and one whose own arithmetic makes the NaN does not.

    ``trace`` (a dict), when given, receives ``calls`` (each attend call's (start [B], new tokens [B])),
    ``poisoned`` (what was poisoned) and ``preallocated`` (storage existed right after new_cache).
    """
    __tracebackhide__ = True
    config = weights.config
    B = scenario.batch
    T = x.shape[1]
    capacity = capacity or T
    mine = weights.clone()  # the backend's copy: the caller's weights (and the oracle's) stay untouched
    cache = call_backend(backend, "new_cache", config, batch_size=B, capacity=capacity, dtype=weights.dtype,
                         device=device, kv_codec=kv_codec)
    where_cache = f"{backend.name} cache ({type(cache).__name__})"
    try:
        tensors = call_backend(cache, "tensors")
    except BackendError as exc:
        raise BackendError(f"{where_cache}: {exc}") from exc
    poisoned = poison(cache, tensors_of_checked(tensors, where_cache), batch_size=B, capacity=capacity,
                      sentinel=poison_sentinel, name=where_cache, zero=zero_fill)
    calls: list[tuple[torch.Tensor, torch.Tensor]] = []
    out = torch.zeros(B, T, config.hidden_size, dtype=torch.float64)
    xd = x.to(device=device, dtype=weights.dtype)
    prefill = torch.tensor(scenario.prefill)
    chunk = scenario.chunk or int(prefill.max())
    done = torch.zeros(B, dtype=torch.int64)

    def attend(h, positions, lengths, where):
        __tracebackhide__ = True
        kept = h.clone()
        o = call_backend(backend, "attend", mine, h, positions, cache, lengths.to(device))
        if not torch.equal(h, kept):
            raise AssertionError(f"{backend.name}: attend() changed its hidden_states argument in place ({where}); "
                                 "a backend must not write to its inputs")
        calls.append((done.clone(), lengths.clone()))
        try:
            return check_output(backend, o, h, lengths, where, positions)
        except NonFiniteOutput as exc:
            if zero_fill:
                raise
            raise NonFiniteOutput(exc.where, _nan_cause(backend, weights, x, scenario, device=device, capacity=capacity,
                                                        kv_codec=kv_codec)) from None

    while bool((done < prefill).any()):
        S = int(min(chunk, int((prefill - done).max())))
        lengths = torch.clamp(prefill - done, 0, S)
        idx = (done[:, None] + torch.arange(S)[None, :]).clamp(max=T - 1)
        h = torch.gather(xd, 1, idx.to(device)[..., None].expand(-1, -1, xd.shape[-1]))
        positions = (done[:, None] + torch.arange(S)[None, :]).to(device)
        o = attend(h, positions, lengths, f"prefill tokens {done.tolist()}..+{lengths.tolist()}")
        for b in range(B):
            n = int(lengths[b])
            out[b, int(done[b]):int(done[b]) + n] = o[b, :n].to("cpu", torch.float64)
        done = done + lengths
    for step in range(scenario.decode_steps):
        pos = done.clone()
        h = xd[torch.arange(B), pos.clamp(max=T - 1).to(device)][:, None]
        lengths = torch.ones(B, dtype=torch.int64)
        o = attend(h, pos[:, None].to(device), lengths, f"decode step {step}")
        out[torch.arange(B), pos] = o[:, 0].to("cpu", torch.float64)
        done = done + 1
    changed = mine.changed_from(weights)
    if changed:
        raise AssertionError(f"{backend.name}: attend() changed the weights tensor(s) {changed} in place (its "
                             "copy differs from the suite's after the run); a backend must not write to its weights")
    if trace is not None:
        trace.update(calls=calls, poisoned=poisoned, preallocated=bool(poisoned.storage))
    return out, cache


def _nan_cause(backend, weights, x, scenario, **kw) -> str:
    """The control run on a zero-filled cache: NAN_FROM_POISON when its outputs are finite, NAN_OWN when they are
    not, NAN_HINT (both causes) when it cannot tell (the control run failed otherwise)."""
    try:
        run_scenario(backend, weights, x, scenario, zero_fill=True, **kw)
    except NonFiniteOutput:
        return NAN_OWN
    except Exception:
        return NAN_HINT
    return NAN_FROM_POISON


def tensors_of_checked(tensors, where: str) -> dict[str, torch.Tensor]:
    __tracebackhide__ = True
    if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
        raise BackendOutputError(f"{where}: tensors() must return a dict of name -> Tensor, got "
                                 f"{type(tensors).__name__}")
    return tensors


def scenario_lengths(scenario: Scenario) -> torch.Tensor:
    return torch.tensor([scenario.total(b) for b in range(scenario.batch)])


def tolerance_figures(tol: Tolerance) -> dict[str, float]:
    return {"tolerance_rel_fro": tol.rel_fro, "tolerance_max_rel": tol.max_rel}


def numerics(backend, preset: str, scenario_name: str, dtype: torch.dtype, device="cpu",
             tolerance: Tolerance | None = None, figures: dict | None = None) -> dict[str, float]:
    """Backend output vs the float64 expanded reference; returns the metrics, raises on violation.

    ``figures`` (a dict) receives the metrics and the tolerance before any failure is raised, so a
    failing test still reports what it measured."""
    __tracebackhide__ = True
    figures = {} if figures is None else figures
    scenario = SCENARIOS[scenario_name]
    w = weights_for(preset, dtype, device)
    x = inputs_for(w.config, scenario)
    require_support(backend, w.config, dtype=dtype, device=device)
    trace: dict = {}
    out, _ = run_scenario(backend, w, x, scenario, device=device, trace=trace)
    lengths = scenario_lengths(scenario)
    x64 = x.to(dtype).to(torch.float64)
    ref = _oracle(preset, scenario_name, dtype)
    valid = torch.arange(x.shape[1])[None, :] < lengths[:, None]
    m = error_metrics(out[valid], ref[valid])
    tol = tolerance or TOLERANCES[dtype_name(dtype)]
    figures.update(m)
    figures.update(tolerance_figures(tol), margin_rel_fro=tol.rel_fro / m["rel_fro"] if m["rel_fro"] else None)
    where = f"{backend.name} {preset} {scenario_name} {dtype_name(dtype)}"
    # per-row check too, so a bug confined to one row cannot hide in the batch average
    for b in range(scenario.batch):
        mb = _row_metrics(out[b, : lengths[b]], ref[b, : lengths[b]])
        if not (mb["rel_fro"] <= tol.rel_fro and mb["max_rel"] <= tol.max_rel):
            worst = int((out[b, : lengths[b]] - ref[b, : lengths[b]]).abs().amax(-1).argmax())
            cause = likely_cause_message(out, _weights(preset, 0), x64, lengths, trace["calls"],
                                         correct=m["rel_fro"], tol=tol, figures=figures)
            raise AssertionError(
                f"{where}: row {b} differs from the float64 reference beyond the {dtype_name(dtype)} tolerance: "
                f"rel_fro {mb['rel_fro']:.3e} (tolerance {tol.rel_fro:g}), max_abs/rms {mb['max_rel']:.3e} "
                f"(tolerance {tol.max_rel:g}); worst token at position {worst} of {int(lengths[b])}"
                f"{cause}{diagnosis(backend, w)}")
    return m


@functools.lru_cache(maxsize=32)
def _oracle(preset: str, scenario_name: str, dtype: torch.dtype) -> torch.Tensor:
    """The float64 reference of a scenario's inputs rounded to ``dtype``: computed once per session."""
    scenario = SCENARIOS[scenario_name]
    w = _weights(preset, 0)
    x = inputs_for(w.config, scenario).to(dtype).to(torch.float64)
    return reference_attention_f64(w, x, scenario_lengths(scenario))


def _row_metrics(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """rel_fro and max_abs / rms(ref) of one row (what the tolerance bounds)."""
    diff = (out - ref).abs()
    rms = float(ref.pow(2).mean().sqrt()) if ref.numel() else 0.0
    norm = float(ref.norm())
    return {"rel_fro": float(diff.norm()) / norm if norm else 0.0,
            "max_rel": float(diff.max()) / rms if diff.numel() and rms else 0.0}


def likely_cause_message(out, weights64, x64, lengths, calls, *, correct: float, tol: Tolerance,
                         figures: dict) -> str:
    """'; likely cause: ...' when an oracle of a known bug class matches the output far better."""
    from mla_conformance.checks import diagnose

    found = diagnose.likely_cause(out, weights64, x64, lengths, calls, correct_rel_fro=correct,
                                  tolerance_rel_fro=tol.rel_fro)
    if not found:
        return ""
    figures["likely_cause"] = diagnose.format_cause(found)
    return "; " + figures["likely_cause"]


# --------------------------------------------------------------------------- bytes


def indexer_elements(config: MLAConfig, cache_format: str) -> int:
    """Indexer-key elements per token of a format: index_head_dim for "latent+indexer", else 0."""
    if cache_format != "latent+indexer":
        return 0
    if not config.dsa:
        raise ValueError(f"cache_format 'latent+indexer' needs a DeepSeek Sparse Attention config (index_topk set); "
                         f"this one is dense ({config.describe()})")
    return config.index_head_dim


def per_token_elements(config: MLAConfig, cache_format: str) -> int:
    """Elements per stored token: latent (kv_lora + rope), expanded (H x (qk + v)), latent+indexer
    (kv_lora + rope + index_head_dim)."""
    if cache_format == "expanded":
        return config.expanded_dim
    return config.latent_dim + indexer_elements(config, cache_format)



#: How a "latent+indexer" cache stores its indexer key, declared apart from the latent's storage as
#: ``indexer_format`` on the cache or the backend (:func:`indexer_format_of`); each has its own bytes per token
#: (:func:`indexer_bytes_per_token`) and its own indexer precision (the ``indexer-scores`` row of TOLERANCES the
#: DSA score and selection tests hold it to).
INDEXER_FORMATS: dict[str, str] = {
    "cache-dtype": "index_head_dim values in the cache dtype (the default, but with kv_codec fp8-e4m3-flashmla)",
    "bf16": "index_head_dim bfloat16 values (2 B each) whatever the latent's storage",
    "fp8-e4m3-block128": "index_head_dim float8 e4m3 values plus one float32 scale per block of 128 values "
                         "(DeepSeek-V3.2-Exp inference/model.py: act_quant's block 128, fp8_index; 128 + 4 = 132 B "
                         "at index_head_dim 128); the default with kv_codec fp8-e4m3-flashmla, whose FlashMLA layout "
                         "pairs the 656-byte latent with it",
}


def default_indexer_format(kv_codec: str = "none") -> str:
    """The indexer format of a cache that declares none: FP8 block-128 with kv_codec fp8-e4m3-flashmla (DeepSeek's
    FP8 cache), else the cache dtype."""
    return "fp8-e4m3-block128" if kv_codec == "fp8-e4m3-flashmla" else "cache-dtype"


def indexer_format_of(backend, cache=None, kv_codec: str = "none") -> str:
    """The indexer format declared on the cache, else on the backend, else :func:`default_indexer_format`;
    a value outside INDEXER_FORMATS is a bad spec (BackendSpecError) naming the allowed values."""
    return declared_on(backend, cache, "indexer_format", INDEXER_FORMATS, default_indexer_format(kv_codec))


def indexer_bytes_per_token(config: MLAConfig, cache_format: str, dtype: torch.dtype, kv_codec: str = "none",
                            indexer_format: str | None = None) -> int:
    """Bytes of the indexer key per token: 0 unless "latent+indexer"; else by ``indexer_format`` (None: the
    default for ``kv_codec``): index_head_dim elements in the cache dtype ("cache-dtype"), x 2 B ("bf16"), or
    index_head_dim e4m3 bytes + 4 B per block of 128 ("fp8-e4m3-block128": 132 B at 128)."""
    n = indexer_elements(config, cache_format)
    if not n:
        return 0
    indexer_format = default_indexer_format(kv_codec) if indexer_format is None else indexer_format
    if indexer_format == "fp8-e4m3-block128":
        return n + 4 * math.ceil(n / FP8_INDEXER_BLOCK)
    if indexer_format == "bf16":
        return 2 * n
    if indexer_format == "cache-dtype":
        return n * torch.empty(0, dtype=dtype).element_size()
    raise ValueError(f"unknown indexer_format {indexer_format!r}; known: {', '.join(INDEXER_FORMATS)}")


def format_bytes_per_token(config: MLAConfig, cache_format: str, dtype: torch.dtype, kv_codec: str = "none",
                           indexer_format: str | None = None) -> int:
    """Bytes one stored token takes in the declared format (a codec's payload + metadata), the indexer
    key included for "latent+indexer" in its ``indexer_format`` (:func:`indexer_bytes_per_token`). At V3.2 dims
    (512 + 64, indexer 128): 1,408 B with a BF16 indexer key, 1,284 B (1,152 + 128 + 4) with a BF16 latent and
    the FP8 block-128 key of DeepSeek's V3.2 reference, 788 B (656 + 132) with kv_codec fp8-e4m3-flashmla; other
    codecs quantize the latent only."""
    indexer = indexer_bytes_per_token(config, cache_format, dtype, kv_codec, indexer_format)
    if kv_codec != "none":
        from mla_conformance.kv.codecs import get_codec

        return get_codec(kv_codec).bytes_per_token(config, dtype)["total"] + indexer
    return config.expanded_dim * torch.empty(0, dtype=dtype).element_size() if cache_format == "expanded" else \
        config.latent_dim * torch.empty(0, dtype=dtype).element_size() + indexer


def _scale_like(tensor: torch.Tensor, per_token_bytes: float, config: MLAConfig) -> bool:
    """A float32-or-wider buffer holding at most one value per 32 of the per-token elements: scales (metadata of
    a quantized part), not values stored wider than the cache dtype."""
    return per_token_bytes / tensor.element_size() <= (config.latent_dim + (config.index_head_dim or 0)) / 32


def _byte_hints(config: MLAConfig, fmt: str, indexer_format: str | None, kv_codec: str, dtype: torch.dtype,
                tensors: dict, written: dict, tokens: int) -> list[str]:
    """Likely causes of a per-token byte mismatch, each naming what it saw."""
    elem = torch.empty(0, dtype=dtype).element_size()
    total = sum(written.values())
    hints = []
    wide = [k for k, v in written.items() if v and tensors[k].is_floating_point() and tensors[k].element_size() > elem]
    scales = [k for k in wide if _scale_like(tensors[k], written[k] / tokens, config)]
    if scales:
        hints.append(f"buffer(s) {scales} ({[str(tensors[k].dtype) for k in scales]}, "
                     f"{[round(written[k] / tokens, 3) for k in scales]} B/token) hold one value per 32 or more "
                     "stored values: scales of a quantized part, counted as the format's metadata")
    wider = [k for k in wide if k not in scales]
    if wider:
        hints.append(f"buffer(s) {wider} are {[str(tensors[k].dtype) for k in wider]}, wider than the "
                     f"{dtype_name(dtype)} cache asked for")
    if fmt == "latent+indexer":
        other = [f for f in INDEXER_FORMATS if f != indexer_format
                 and total == tokens * format_bytes_per_token(config, fmt, dtype, kv_codec, f)]
        if other:
            hints.append(f"that is the size with indexer_format {other[0]!r} ({INDEXER_FORMATS[other[0]]}), not "
                         f"the cache's {indexer_format!r} (declared, or the default when neither the cache nor the "
                         f"backend declares one): declare indexer_format = {other[0]!r} if that is how the cache "
                         "stores the indexer key")
    if fmt == "latent" and kv_codec == "none" and total == tokens * config.expanded_dim * elem:
        hints.append(f"that is the expanded per-head K/V size (H x (qk + v) = {config.expanded_dim:,} "
                     "elements per token): the cache stores the expanded K/V, not the latent")
    if fmt == "latent" and config.dsa and kv_codec == "none" and \
            total > tokens * config.latent_dim * elem:
        hints.append("a DeepSeek Sparse Attention cache also stores one indexer key per token: declare "
                     "cache_format 'latent+indexer' (and its indexer_format)")
    return hints


def cache_bytes(backend, preset: str, dtype: torch.dtype, *, prefill: int, decode: int, batch: int,
                capacity: int, device="cpu", kv_codec: str = "none", figures: dict | None = None) -> dict[str, Any]:
    """Write tokens through attend() and measure the cache from its tensors; raise when the bytes break
    the contract. One rule for every format and codec (mla_conformance.kv.caches.measure):

    * bytes per stored token = bytes of token storage that no longer hold the suite's poison / tokens,
      must equal the declared format's bytes per token -- else the *format* is wrong;
    * a cache that preallocates must have room for batch x capacity tokens -- else the *slot count* is
      wrong; more slots are an allocation policy, reported (allocated_slots, slot_overhead);
    * the self-reports: allocated_nbytes() == bytes of tensors(); active_nbytes() == stored tokens x the
      measured bytes per token (plus at most the bookkeeping buffers).
    """
    __tracebackhide__ = True
    figures = {} if figures is None else figures
    config = MLAConfig.preset(preset)
    require_support(backend, config, dtype=dtype, device=device, kv_codec=kv_codec)
    w = _bytes_weights(preset, dtype, str(device))
    scenario = Scenario("bytes", (prefill,) * batch, decode_steps=decode)
    x = inputs_for(config, scenario)
    trace: dict = {}
    _, cache = run_scenario(backend, w, x, scenario, device=device, capacity=capacity, kv_codec=kv_codec,
                            trace=trace)
    where_cache = f"{backend.name} cache"
    tensors = tensors_of_checked(call_backend(cache, "tensors"), where_cache)
    masks = [written_masks(tensors, trace["poisoned"])]
    integer_storage = [k for k, (shape, dt) in trace["poisoned"].storage.items()
                       if not (dt.is_floating_point and torch.empty(0, dtype=dt).element_size() > 1)]
    if integer_storage:  # a written byte may equal the 0xFF poison: a second run poisoned with 0x00
        trace2: dict = {}
        _, cache2 = run_scenario(backend, w, x, scenario, device=device, capacity=capacity, kv_codec=kv_codec,
                                 poison_sentinel=0x00, trace=trace2)
        masks.append(written_masks(tensors_of_checked(call_backend(cache2, "tensors"), where_cache),
                                   trace2["poisoned"]))
    fmt = cache_format_of(backend, cache)
    ifmt = indexer_format_of(backend, cache, kv_codec) if fmt == "latent+indexer" else None
    tokens = batch * (prefill + decode)
    expected = format_bytes_per_token(config, fmt, dtype, kv_codec, ifmt)
    tensor_bytes = {k: t.numel() * t.element_size() for k, t in tensors.items()}
    limit = bookkeeping_limit(batch, capacity, getattr(cache, "page_block_size", None))
    written = written_bytes(tensors, masks)
    # bookkeeping by structure (small); a buffer the tokens were written into is token storage whatever
    # its size (a cache that grows holds one token in a buffer smaller than a block table)
    book = {k: b for k, b in tensor_bytes.items()
            if is_bookkeeping(tensors[k], limit, batch, capacity) and not written.get(k)}
    storage = {k: b for k, b in tensor_bytes.items() if k not in book}
    total_written = sum(written.values())
    measured = total_written // tokens if tokens else 0
    active = int(call_backend(cache, "active_nbytes"))
    allocated = int(call_backend(cache, "allocated_nbytes"))
    requested = batch * capacity
    slots = slot_figures(sum(storage.values()), measured, requested, trace["preallocated"])
    # formula and measurement under labelled keys: formula_bytes_per_token is the declared format's per-token
    # formula (format_bytes_per_token), measured_bytes_per_token what the tensors showed (written bytes / tokens);
    # bytes_per_token (measured) and format_bytes_per_token (formula) are the same figures under the keys the
    # report reads
    figures.update({"backend": backend.name, "preset": preset, "dtype": dtype_name(dtype), "cache_format": fmt,
                    "kv_codec": kv_codec, "tokens": tokens, "batch": batch, "capacity": capacity,
                    "formula_bytes_per_token": expected, "measured_bytes_per_token": measured,
                    "format_bytes_per_token": expected, "bytes_per_token": measured,
                    "measured_bytes_per_buffer": {k: v / tokens for k, v in sorted(written.items()) if v},
                    "written_nbytes": total_written, "active_nbytes": active, "allocated_nbytes": allocated,
                    "tensors": tensor_bytes, "bookkeeping": sorted(book), **slots})
    if ifmt is not None:
        figures["indexer_format"] = ifmt
        figures["formula_indexer_bytes_per_token"] = indexer_bytes_per_token(config, fmt, dtype, kv_codec, ifmt)
    where = f"{backend.name} {preset} {dtype_name(dtype)}{'' if kv_codec == 'none' else ' kv_codec ' + kv_codec} " \
            f"{tokens} tokens (batch {batch})"
    seq_lens = [int(v) for v in cache.seq_lens.tolist()]
    if seq_lens != [prefill + decode] * batch:
        raise AssertionError(f"{where}: cache.seq_lens is {seq_lens}, expected {[prefill + decode] * batch}")
    if allocated != sum(tensor_bytes.values()):
        raise AssertionError(f"{where}: allocated_nbytes() = {allocated:,} B but the tensors() it lists hold "
                             f"{sum(tensor_bytes.values()):,} B ({tensor_bytes})")
    per_buffer = ", ".join(f"{k!r} {describe_buffers({k: tensors[k]})[k]}: "
                           f"{v / tokens:,.6g} B/token" for k, v in sorted(written.items()) if v)
    if total_written != measured * tokens or measured != expected:
        hints = _byte_hints(config, fmt, ifmt, kv_codec, dtype, tensors, written, tokens)
        raise AssertionError(
            f"{where}: the cache holds {total_written / tokens:,.6g} B per stored token ({per_buffer or 'nothing written'}; "
            f"measured as the token-storage bytes that no longer hold the suite's poison) but the declared format "
            f"{fmt!r}{'' if kv_codec == 'none' else ' with kv_codec ' + kv_codec}"
            f"{'' if ifmt is None else f' (indexer_format {ifmt!r})'} needs {expected:,} B per token: "
            f"the format is wrong, not the slot count" + "".join(f"; {h}" for h in hints))
    if slots["preallocated"] and slots["allocated_slots"] < requested:
        raise AssertionError(
            f"{where}: the cache preallocated room for {slots['allocated_slots']:,} tokens "
            f"({sum(storage.values()):,} B of token storage / {measured:,} B per token) but batch x capacity = "
            f"{batch} x {capacity} = {requested:,} were requested: the slot count is wrong, not the format")
    book_bytes = sum(book.values())
    if not tokens * measured <= active <= tokens * measured + book_bytes:
        raise AssertionError(
            f"{where}: active_nbytes() says {active:,} B but the {tokens} stored tokens occupy {tokens * measured:,} B "
            f"({measured:,} B per token, measured from tensors(): {per_buffer})"
            + (f" plus at most {book_bytes:,} B of bookkeeping/per-cache buffers {sorted(book)}" if book else "")
            + ": the self-report is wrong")
    return figures


# --------------------------------------------------------------------------- incremental


def incremental_equals_prefill(backend, preset: str, dtype: torch.dtype, device="cpu", *, prefill=12,
                               decode=8, figures: dict | None = None) -> dict[str, float]:
    """Prefill P then D single-token steps == one prefill of P + D tokens (same tokens)."""
    __tracebackhide__ = True
    figures = {} if figures is None else figures
    w = weights_for(preset, dtype, device)
    require_support(backend, w.config, dtype=dtype, device=device)
    inc = Scenario("incremental", (prefill,), decode_steps=decode)
    one = Scenario("one-shot", (prefill + decode,))
    x = inputs_for(w.config, one)
    out_inc, _ = run_scenario(backend, w, x, inc, device=device)
    out_one, _ = run_scenario(backend, w, x, one, device=device)
    m = error_metrics(out_inc, out_one)
    tol = TOLERANCES[dtype_name(dtype)]
    figures.update(m)
    figures.update(tolerance_figures(tol))
    if not (m["rel_fro"] <= tol.rel_fro and m["max_rel"] <= tol.max_rel):
        worst = int((out_inc[0] - out_one[0]).abs().amax(-1).argmax())
        raise AssertionError(f"{backend.name} {preset} {dtype_name(dtype)}: prefill {prefill} + {decode} decode "
                             f"steps differs from one {prefill + decode}-token prefill: rel_fro {m['rel_fro']:.3e} "
                             f"(tolerance {tol.rel_fro:g}), max_abs/rms {m['max_rel']:.3e} (tolerance "
                             f"{tol.max_rel:g}); worst at position {worst}")
    return m


def v2_lite_cache_probe(backend, device="cpu", figures: dict | None = None) -> dict[str, Any]:
    """The V2-Lite cache probe (seed 000's measurement): V2-Lite dims, bf16, 25-token prefill + 1 decode,
    batch 1, capacity 32."""
    __tracebackhide__ = True
    return cache_bytes(backend, "deepseek-v2-lite", torch.bfloat16, prefill=25, decode=1, batch=1,
                       capacity=32, device=device, figures=figures)

