"""The tolerance tables, each number with its reason: the layer tests' (TOLERANCES, against the float64 expanded
reference), the float64 anchor's, and the op tests' derived per-element bounds (OP_TOLERANCES)."""

from __future__ import annotations

import dataclasses
import math

import torch


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """Bounds on a backend's output against the float64 expanded reference.

    rel_fro: ||out - ref||_F / ||ref||_F;  max_rel: max |out - ref| / rms(ref).
    """

    rel_fro: float
    max_rel: float
    reason: str


#: The one tolerance table (markers.md's is generated from it: `python tools/docs.py`), derived from the unit
#: roundoff u of the dtype (2^-8 bfloat16, 2^-11 float16, 2^-24 float32) and the number of roundings on the way
#: from the layer input to its output: the input, five weights (q path, kv_a, kv_b, o_proj) and about six
#: intermediate results (projections, the two norms, RoPE, scores / probabilities, P.V, o_proj) are each rounded
#: once, k ~ 12 roundings of independent sign: rel_fro ~ sqrt(k) u ~ 3.5 u. The bounds allow a kernel that
#: rounds twice as often (rel_fro ~ 6 u) and, per element, the tail of that error over the output's rms
#: (max_rel ~ 40 u: the largest of ~10^5 output errors is ~4.5 sigma, times the elements' spread around rms).
#: The layer numerics hold each row to :func:`row_tolerance` instead, which grows both with the row (the max_rel
#: column stays the bound of the checks that hold a whole output to one number).
#: A rel_fro or max_rel a built-in measures is in each numerics test's figures (conformance.json), not here.
TOLERANCES: dict[str, Tolerance] = {
    "float64": Tolerance(1e-6, 1e-5, "float64 end to end, where everything errs by ~1e-15 (53-bit roundings); "
                                     "1e-6 (17 float32 unit roundoffs) leaves room for RoPE tables computed in "
                                     "float32, as transformers computes them, at the suite's positions"),
    "float32": Tolerance(1e-5, 1e-4, "~12 float32 roundings (u = 6e-8) give ~2e-7; dot products of up to 2048 "
                                     "terms add up to sqrt(2048) u ~ 3e-6: 1e-5 = 170 u; a 1e-2 relative error in "
                                     "one YaRN frequency moves late positions by far more than 1e-5; a row past "
                                     "2048 positions adds 1e-5 per 2048 more, float32 RoPE angles and sums over keys "
                                     "erring linearly with the row; per row max_rel = rel_fro x ln N, N its values "
                                     "(row_tolerance)"),
    "float16": Tolerance(5e-3, 3e-2, "float16 (u = 2^-11 = 4.9e-4) inputs, weights and intermediates: ~3.5 u = "
                                     "1.7e-3 expected, 5e-3 = 10 u allows a kernel that rounds twice as often; "
                                     "max_rel 3e-2 = 61 u; per row max_rel = rel_fro x ln N, N its values "
                                     "(row_tolerance)"),
    "bfloat16": Tolerance(2.5e-2, 1.5e-1, "bfloat16 (u = 2^-8 = 3.9e-3) inputs, weights and intermediates: ~3.5 u = "
                                          "1.4e-2 expected, 2.5e-2 = 6.4 u allows a kernel that rounds twice as "
                                          "often; max_rel 0.15 = 38 u; per row max_rel = rel_fro x ln N, N its "
                                          "values (row_tolerance: the largest of N errors relative to the values "
                                          "they round is ~ln N rms, not 4.5)"),
}

#: The row length the table's float32 terms are derived for: dot products and sums over up to 2048 keys, RoPE
#: angles at positions below 2048.
ROW_KEYS = 2048


def row_tolerance(dtype: str, *, elements: int, keys: int) -> Tolerance:
    """The bounds of one row of ``elements`` output values whose queries see up to ``keys`` keys (its length: a
    causal row's last token sees every position), for the dtype rows of :data:`TOLERANCES`:

    rel_fro(n) = rel_fro + TOLERANCES["float32"].rel_fro x max(0, n - 2048) / 2048
    max_rel(N, n) = rel_fro(n) x ln N

    rel_fro(n): the terms of a row that grow with it are float32 terms, linear in n, not sqrt(n): a sum over n
    keys errs by up to gamma_n = n u (worst case, u = 2^-24), and RoPE angles computed in float32 (as
    transformers does: ``inv_freq.float() @ positions.float()``) err by up to 2 u x position -- the same sign
    all along the row, so the output error grows with the position, linearly (measured: hf-transformers'
    relative error per token is 5.5e-7 at the first positions, 2.9e-6 at 1024..2048 and 4.6e-6 at 2048..4097,
    in float32 and float64 alike; reference-naive, with float64 tables, stays at 7e-7). The float32 row's
    1e-5 is the budget of its float32 terms for 2048 keys; each further 2048 keys adds that budget again, to
    every dtype (for bfloat16 and float16 it stays negligible).

    max_rel(N, n): the errors are relative to the values they round, so an element's error is its value times a
    relative error: a product of two near-Gaussian factors, whose tail is exponential (density K0(|z|) / pi:
    P(|z| > x) ~ e^-x / sqrt(x) in units of its rms), not Gaussian. The largest of N is ~ln N rms, not
    sqrt(2 ln N): simulated (200 draws each), its median is ln N - 1.0 and its 90th percentile ln N + 0.7 .. 0.9 for
    N = 3,072 .. 262,400; measured on reference-absorbed's bfloat16 2,050-token one-head row (N = 262,400)
    11.9 rms against ln N = 12.5, where tail probabilities 1.1e-4, 1.1e-5 and 3.8e-6 lie at 8.5, 10.7 and
    11.9 rms (an e-fold per ~1.0 rms). The bound is that largest value for an error at the rel_fro bound: an
    implementation at rel_fro(n) itself exceeds it about one time in four (simulated: 20 to 25 %); one at half
    of it (the built-ins measure 0.05 to 0.65 of rel_fro) practically never. The fixed max_rel column (6 x rel_fro for bfloat16 and
    float16, 10 x for float32) is ln N x rel_fro at about 400 and 22,000 elements: checks holding larger
    outputs to it are stricter than this derivation."""
    table = TOLERANCES[dtype]
    rel_fro = table.rel_fro + TOLERANCES["float32"].rel_fro * max(0, keys - ROW_KEYS) / ROW_KEYS
    return Tolerance(rel_fro, rel_fro * math.log(max(elements, 2)),
                     f"{dtype} row of {elements} values over up to {keys} keys: rel_fro {table.rel_fro:g}"
                     + (f" + {TOLERANCES['float32'].rel_fro:g} x ({keys} - {ROW_KEYS}) / {ROW_KEYS}"
                        if keys > ROW_KEYS else "")
                     + f", max_rel rel_fro x ln {elements} (row_tolerance)")


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
#: output element, for up to OP_ACC_KEYS keys per query in k-blocks of 16 (the hand-written op tests' longest row
#: is 130): at most 1024 / 16 (P.V) + 1024 / 16 (rescales, one per block) + 16 (within a block) + a few (exp, the
#: division): 256. A longer row: :func:`op_acc_roundings`.
OP_ACC_ROUNDINGS = 256
OP_ACC_KEYS = 1024


#: The written FP8 tile scale under ``write_fp8_scale_format = "fp32"`` (checks/op/write.py), relative to amax / 448
#: (the tile's largest value onto e4m3's largest): a writer may compute it in any arithmetic of bfloat16's
#: precision or better -- FlashMLA's earlier float32-scale quant.py divided in bfloat16, a rounding of up to 2^-8
#: relative -- so 2^-7 (two bfloat16 roundings: amax and the quotient); a scale of another rule (amax / 240,
#: e4m3fnuz's largest: 1.87 x; a power of two: up to 2 x) is far past it. The 1e-4 floor is optional there
#: (SGLang drops it). What the payload must hold at the stored scale is checks/op/write.py's (half an e4m3 step).
WRITE_FP32_SCALE_REL = 2.0 ** -7


def op_acc_roundings(keys):
    """Rounding errors of the float32 accumulation on the way to one output element of a query over ``keys`` keys
    (an int or a tensor of counts): :data:`OP_ACC_ROUNDINGS` up to :data:`OP_ACC_KEYS` keys; past that each further
    block of 16 keys adds at most 4 -- the P.V accumulator's add of the block's MMA result and its rescale by
    exp(m_old - m_new), the normaliser's add and its rescale -- so 256 + 4 ceil((n - 1024) / 16): linear in n, the
    worst case (gamma_n), as every term of the op bound is (2600 keys: 652; 32,769 keys: 8,196)."""
    if isinstance(keys, torch.Tensor):
        extra = torch.ceil((keys.to(torch.float64) - OP_ACC_KEYS).clamp_min(0.0) / 16.0)
    else:
        extra = math.ceil(max(0, keys - OP_ACC_KEYS) / 16)
    return OP_ACC_ROUNDINGS + 4 * extra


def underflow(dtype: torch.dtype) -> float:
    """The largest absolute error of rounding a value into ``dtype``'s subnormal range, where the relative bound
    (half a step, :func:`unit_roundoff`) no longer holds: float16 half its subnormal step, 2^-14 x 2^-10 / 2 =
    2^-25 (GPU conversions to float16 keep subnormals: ``cvt.rn.f16.f32``); bfloat16, float32 and float64 their
    smallest normal (2^-126, 2^-1022), which also covers a kernel that flushes subnormals to zero (GPU fast-math
    float32 arithmetic does: ``ex2.approx.ftz.f32``; bfloat16 shares float32's exponent range)."""
    info = torch.finfo(dtype)
    return info.smallest_normal * info.eps / 2 if dtype == torch.float16 else info.smallest_normal


@dataclasses.dataclass(frozen=True)
class OpTolerance:
    """Error bounds of an op's (out, lse) against the float64 op oracle (mla_conformance.model.attention_oracles.decode),
    derived per element by first-order error analysis of a kernel that computes scores in float32, rounds P
    (exp(s - m)) to the q / cache dtype before P.V, accumulates P.V in float32 and rounds out once:

    |out - ref| <= u_out |ref| + eta_out + (p_round + acc(n)) S + dot T + p_under V1 + acc_under r(n)  (per element)
    |lse - ref| <= dot Abar + acc(n) (1 + |ref|) + 2^-24 |ref| + acc_under n                        (per query)

    u_out: half a step of the dtype the op *returned* out in (mla_conformance.checks.unit_roundoff), eta_out its
    :func:`underflow` (an out in the subnormal range errs by up to eta_out, not u_out |out|: 2^-25 in float16);
    S = softmax @ |V| (sum_t p_t |v_t|): rounding each p_t by a relative p_round moves out by at most
    p_round S, and the float32 sums by at most acc S; T = sum_t p_t (A_t + A_max) |v_t| with A_t = scale
    sum_d |q_d k_td|: a score error |e_t| <= dot A_t moves p_t by p_t (e_t - sum p e) at first order, so out
    by at most dot T, lse by at most dot Abar (Abar = sum_t p_t A_t). Underflow: P = exp(s - m) <= 1 (m the
    running max) below the P dtype's smallest normal (2^-14 in float16) is rounded by up to p_under absolute, not
    p_round P; divided by the normaliser l >= 1 (the max key's P is 1) and rescaled by exp(m_old - m_new) <= 1, it
    moves out by at most p_under V1, V1 = sum_t |v_t| over the query's n keys; each of the r(n) =
    :func:`op_acc_roundings` float32 roundings of the accumulation may flush to zero (acc_under, 2^-126), the
    normaliser's n terms too (lse: acc_under n, l >= 1). acc(n) = r(n) x 2^-24 grows with the query's key count
    n (:meth:`acc_at`; ``acc`` is its value up to OP_ACC_KEYS keys). S, T, Abar, A_max, n and V1 come from the
    float64 oracle (``magnitudes=True``; n and V1: :func:`mla_conformance.checks.op.compare.key_magnitudes`), once
    per case. With an attention sink the bound on out adds (1 - factor) x the lse bound x |ref|. Split-KV merges
    and op-vs-op comparisons add the bounds of both sides (mla_conformance.checks.op.bounds).
    """

    p_round: float
    dot: float
    acc: float
    reason: str
    p_under: float = 0.0
    acc_under: float = 0.0

    def acc_at(self, keys):
        """The accumulation term of a query over ``keys`` keys (an int or a tensor of counts): ``acc`` x
        op_acc_roundings(keys) / OP_ACC_ROUNDINGS (``acc`` itself up to OP_ACC_KEYS keys)."""
        return self.acc * op_acc_roundings(keys) / OP_ACC_ROUNDINGS


def _op_row(dtype: torch.dtype, p_dtype: torch.dtype, reason: str) -> OpTolerance:
    accumulation = torch.float64 if dtype == torch.float64 else torch.float32
    u = unit_roundoff(accumulation)
    return OpTolerance(unit_roundoff(p_dtype), OP_DOT_ROUNDINGS * u, OP_ACC_ROUNDINGS * u, reason,
                       p_under=underflow(p_dtype), acc_under=underflow(accumulation))


_OP_F32 = "float32 terms as the float32 row's"

#: The op tests' error bounds, keyed by q's dtype (the FP8 656-byte cache has its own row, with a bfloat16 q,
#: against the oracle of the *dequantized* cache). Every entry is derived (OpTolerance says how); none is a
#: measurement of reference-op.
OP_TOLERANCES: dict[str, OpTolerance] = {
    "float64": _op_row(torch.float64, torch.float64,
                       "float64 end to end: P, scores and sums in float64 (p_round 2^-53, dot 52 x 2^-53, acc 256 x "
                       "2^-53, counted as for float32, 4 more per 16 keys past 1024); lse is float32 by contract "
                       "(2^-24 x |lse|); underflow 2^-1022 (out, P, each rounding)"),
    "float32": _op_row(torch.float32, torch.float32,
                       "P kept in float32 (p_round 2^-24). Float32 terms: a score is a float32 dot product of 576 "
                       "exact products (q and the cache hold their dtype's values exactly) summed in k-blocks of 16, "
                       "at most 576/16 + 16 = 52 roundings: dot 52 x 2^-24 per unit of A; the P.V sum, the "
                       "normaliser and the rescales over up to 1024 keys take at most 256 roundings: acc 256 x 2^-24, "
                       "and each further 16 keys at most 4 more (the P.V and normaliser adds and rescales: acc(n) = "
                       "(256 + 4 ceil((n - 1024) / 16)) x 2^-24, n the query's keys); a value in a subnormal range "
                       "errs absolutely: out, P and each float32 rounding by up to 2^-126 (flush to zero included)"),
    "bfloat16": _op_row(torch.bfloat16, torch.bfloat16,
                        "P rounded to bfloat16 before P.V (vLLM's and SGLang's Triton decode: acc += "
                        "tl.dot(p.to(v.dtype), v); FlashMLA and FlashInfer alike): each p_t off by up to 2^-8, so "
                        "out by up to 2^-8 x sum_t p_t |v_t| per element (p_round 2^-8); " + _OP_F32),
    "float16": _op_row(torch.float16, torch.float16,
                       "P rounded to float16 before P.V: up to 2^-11 x sum_t p_t |v_t| per element (p_round 2^-11); "
                       "float16's subnormal range (below 2^-14) rounds absolutely, by up to half its step 2^-25: an out "
                       "there errs by up to 2^-25 (not 2^-11 |out|), each P = exp(s - m) <= 1 there by up to 2^-25, "
                       "so out by up to 2^-25 x sum_t |v_t| over the query's keys; " + _OP_F32),
    "fp8-e4m3-flashmla": _op_row(torch.bfloat16, torch.bfloat16,
                                 "656-byte FP8 cache, bfloat16 q, against the oracle of the dequantized cache (e4m3 x "
                                 "float32 tile scale, bf16 rope): P rounded to bfloat16 as FlashMLA's sparse FP8 "
                                 "decode does (p_round 2^-8); the dequantized K and V must reach the products as "
                                 "stored (exact in bfloat16 under pow2 scales; an op of fp32 scales that rounds "
                                 "them to bfloat16 is not covered); " + _OP_F32),
}

#: DeepSeek Sparse Attention: a backend's indexer scores (the optional ``last_indexer_scores``) against
#: ``dsa_reference.indexer_scores_f64``, rows of the one table above (suites/test_dsa.py::test_indexer_scores).
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
