"""The tolerance tables, each number with its reason: the layer tests' (TOLERANCES, against the float64 expanded
reference), the float64 anchor's, and the op tests' derived per-element bounds (OP_TOLERANCES)."""

from __future__ import annotations

import dataclasses

import torch


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



def tolerance_figures(tol: Tolerance) -> dict[str, float]:
    return {"tolerance_rel_fro": tol.rel_fro, "tolerance_max_rel": tol.max_rel}
