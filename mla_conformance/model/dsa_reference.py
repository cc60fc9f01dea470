"""DeepSeek Sparse Attention (V3.2): the lightning indexer, its top-k selection and their float64 oracles
(``indexer_scores_f64``, ``select_topk_f64``, ``sparse_attention_f64``: absorbed MLA over the selected tokens, from
mla_conformance.model.reference), and for the DSA checks (mla_conformance.checks.layer.dsa) the magnitudes the indexer
scores' rounding errors scale with.

The indexer score of query s and key t is I[s, t] = sum_h w_sh ReLU(q_sh . k_t) (``indexer_scores_f64``). ReLU
cancels, so an error bound relative to |I| means nothing; what a score's rounding error scales with is

    M[s, t] = sum_h |w_sh| sum_i |q_shi| |k_ti|

(q and k after the Hadamard rotation, as the oracle computes them). An indexer stored in float8 e4m3 with
power-of-two block scales also errs, below e4m3's normal range, by up to half a subnormal step per element:

    U[s, t] = sum_h |w_sh| sum_i (uq_shi (|k_ti| (1 + e) + uk_ti) + |q_shi| (1 + e) uk_ti)

with uq, uk that half-step per element (:func:`e4m3_half_subnormal_step`) and e the relative error of an e4m3
product in the normal range (``product_error``, the caller's: mla_conformance.checks.FP8_E4M3_PRODUCT_ERROR).
"""

from __future__ import annotations

import torch

from mla_conformance.dtypes import FP8_E4M3_MAX
from mla_conformance.model.config import MLAConfig
from mla_conformance.model.reference import (absorbed_scores_and_mix, apply_rope, project, rms_norm, rope_cos_sin,
                                             rope_factor)
from mla_conformance.model.weights import MLAWeights

# --------------------------------------------------------------------------- DeepSeek Sparse Attention (V3.2)
#
# The lightning indexer and top-k selection of DeepSeek-V3.2 (DeepSeek-V3.2-Exp inference/model.py
# ``Indexer``; transformers' ``DeepseekV32Indexer``), then MLA over the selected tokens only::
#
#     q^I_{s,h} = W^I_Q,h  RMSNorm(W_DQ x_s)                 from the same q_lora latent as MLA's query
#     k^I_t     = LayerNorm(W^I_K x_t)                        one key per token, shared by the heads, cached
#     RoPE on the first qk_rope_head_dim dims of q^I and k^I, rotate-half (NON-interleaved) layout in
#     DeepSeek-V3.2; interleaved where the config says indexer_rope_interleave (GLM-5's DSA)
#     (q^I, k^I) <- (H q^I, H k^I),  H = Hadamard / sqrt(d)   orthonormal: q.k unchanged before FP8
#     [optional] FP8 e4m3 per block of 128 (per head vector), power-of-two (ue8m0) scales
#     w_{s,h}   = (W^I_w x_s)_h * n_heads^-1/2 * d^-1/2
#     I_{s,t}   = sum_h w_{s,h} ReLU(q^I_{s,h} . k^I_t)       for t <= s (causal), else -inf
#     S_s       = top-min(index_topk, #allowed) of I_{s,.}
#     o_s       = MLA(q_s; c_t, k^R_t for t in S_s)           absorbed attention over the selection
#
# Scaling, as the sources write it: DeepSeek multiplies the weights by n^-1/2 * d^-1/2 (and the FP8 q
# scale) outside the ReLU; transformers applies d^-1/2 to q.k inside the ReLU and n^-1/2 to the weights.
# ReLU is positively homogeneous, so the two are the same number.

#: ``k_norm`` epsilon: a LayerNorm with eps 1e-6 in DeepSeek's LayerNorm class and transformers' module.
INDEXER_K_NORM_EPS = 1e-6

#: RoPE layouts of the indexer's rotated dims. "half" is DeepSeek-V3.2's (and transformers'): the first
#: r/2 dims pair with the last r/2. "interleaved" pairs (x[2i], x[2i+1]) -- MLA's own layout, which the
#: V3.2-Exp inference demo applied to the indexer too until DeepSeek's correction of 2025-11-18, and which
#: GLM-5's DSA models declare (``indexer_rope_interleave``). Which one a model uses is its config's
#: ``indexer_rope_interleave`` (:func:`indexer_rope_layout`); the oracles follow it unless told otherwise.
INDEXER_ROPE_LAYOUTS = ("half", "interleaved")


def indexer_rope_layout(config: MLAConfig) -> str:
    """The indexer RoPE layout a config declares: "interleaved" when ``indexer_rope_interleave``, else "half"."""
    return "interleaved" if getattr(config, "indexer_rope_interleave", False) else "half"


def other_rope_layout(layout: str) -> str:
    """The layout a backend that mixes them up would use: the other one."""
    return "half" if layout == "interleaved" else "interleaved"

#: DeepSeek-V3.2's FP8 indexer key (and act_quant's block): e4m3 values with one float32 scale per block of
#: this many values along the head dim, 128 + 4 = 132 B per token at index_head_dim 128.
FP8_INDEXER_BLOCK = 128


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) * w + b; statistics in fp32 (float64 stays float64), as DeepSeek."""
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    out = torch.nn.functional.layer_norm(x.to(work), (x.shape[-1],), weight.to(work), bias.to(work), eps)
    return out.to(x.dtype)


def apply_rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (x[i], x[i + r/2]) pairs -- the rotate-half layout. x: [B, S, (H,) r], cos/sin [B, S, r/2]."""
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    if x.dim() == 4:
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    x1, x2 = x.to(work).chunk(2, dim=-1)
    cos, sin = cos.to(work), sin.to(work)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def hadamard_matrix(d: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The Sylvester Hadamard matrix of order d (a power of two) times d^-1/2: orthonormal, symmetric."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"the indexer's Hadamard rotation needs a power-of-two head dim, got {d}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h * d ** -0.5).to(dtype)


def fp8_block_dequant(x: torch.Tensor, *, block: int = FP8_INDEXER_BLOCK, scale_fmt: str | None = "ue8m0") -> torch.Tensor:
    """x after DeepSeek's act_quant and back: per block of ``min(block, d)`` along the last dim,
    s = amax / 448 (amax floored at 1e-4), rounded up to a power of two when ``scale_fmt == "ue8m0"``;
    e4m3 = clamp(x / s, +-448) cast to float8_e4m3fn; returns e4m3 * s in x's dtype."""
    d = x.shape[-1]
    block = min(block, d)
    if d % block:
        raise ValueError(f"FP8 block quantization needs the last dim ({d}) divisible by the block ({block})")
    xb = x.unflatten(-1, (d // block, block)).to(torch.float64)
    amax = xb.abs().amax(-1, keepdim=True).clamp_min(1e-4)
    s = amax / FP8_E4M3_MAX
    if scale_fmt == "ue8m0":
        s = torch.exp2(torch.ceil(torch.log2(s)))
    elif scale_fmt is not None:
        raise ValueError(f"unknown FP8 scale format {scale_fmt!r}; known: 'ue8m0', None")
    q = (xb / s).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return (q.to(torch.float64) * s).flatten(-2).to(x.dtype)


def q_latent(weights: MLAWeights, x: torch.Tensor) -> torch.Tensor:
    """RMSNorm(W_DQ x): the q_lora latent MLA's query and the DSA indexer's query both read."""
    cfg = weights.config
    if cfg.q_lora_rank is None:
        raise ValueError("the DSA indexer needs q_lora (its query is projected from the q_lora latent)")
    return rms_norm(x @ weights["q_a_proj.weight"].T, weights["q_a_layernorm.weight"], cfg.rms_norm_eps)


def indexer_project(weights: MLAWeights, x: torch.Tensor, positions: torch.Tensor, *,
                    rope_layout: str | None = None, hadamard: bool = True, fp8: bool = False,
                    rope_convention: str = "transformers"):
    """The indexer's per-token projections: q [B,S,n,d], k [B,S,d] (what a DSA cache stores per token,
    rotated, Hadamard-transformed, FP8-rounded when ``fp8``) and the head weights w [B,S,n], which
    carry n^-1/2 * d^-1/2. RoPE uses MLA's cos/sin (YaRN included) in ``rope_layout`` (default: the
    config's, :func:`indexer_rope_layout`)."""
    cfg = weights.config
    if not cfg.dsa:
        raise ValueError(f"no DSA indexer in this config ({cfg.describe()}): index_topk is None")
    rope_layout = indexer_rope_layout(cfg) if rope_layout is None else rope_layout
    if rope_layout not in INDEXER_ROPE_LAYOUTS:
        raise ValueError(f"unknown indexer rope_layout {rope_layout!r}; known: {', '.join(INDEXER_ROPE_LAYOUTS)}")
    n, d, r = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
    q = (q_latent(weights, x) @ weights["indexer.wq_b.weight"].T).unflatten(-1, (n, d))
    k = layer_norm(x @ weights["indexer.wk.weight"].T, weights["indexer.k_norm.weight"],
                   weights["indexer.k_norm.bias"], INDEXER_K_NORM_EPS)
    cos, sin = rope_cos_sin(cfg, positions, rope_convention=rope_convention)
    rope = apply_rope_half if rope_layout == "half" else apply_rope
    q = torch.cat([rope(q[..., :r], cos, sin), q[..., r:]], dim=-1)   # rotated dims first, as DeepSeek
    k = torch.cat([rope(k[..., :r], cos, sin), k[..., r:]], dim=-1)
    if hadamard:
        h = hadamard_matrix(d, q.dtype).to(q.device)
        q, k = q @ h, k @ h  # h symmetric: x @ h == h x per vector
    if fp8:
        q, k = fp8_block_dequant(q), fp8_block_dequant(k)
    w = (x @ weights["indexer.weights_proj.weight"].T) * (n ** -0.5 * d ** -0.5)
    return q, k, w


def indexer_scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """I[b,s,t] = sum_h w[b,s,h] ReLU(q[b,s,h] . k[b,t]) where allowed [B,S,T], -inf elsewhere."""
    logits = torch.relu(torch.einsum("bshd,btd->bsht", q, k))
    scores = torch.einsum("bsh,bsht->bst", w, logits)
    return scores.masked_fill(~allowed, float("-inf"))


def select_topk(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """Top-min(topk, T) key indices per query [B,S,K] (int64, by descending score); a query with fewer
    allowed (finite-score) keys than K has its unused slots set to -1."""
    K = min(int(topk), scores.shape[-1])
    values, idx = scores.topk(K, dim=-1)
    return idx.masked_fill(values == float("-inf"), -1)


def selection_mask(indices: torch.Tensor, T: int) -> torch.Tensor:
    """Boolean [B,S,T]: True at the selected keys of indices [B,S,K] (-1 = unused slot)."""
    mask = torch.zeros(*indices.shape[:-1], T + 1, dtype=torch.bool, device=indices.device)
    mask.scatter_(-1, torch.where(indices < 0, T, indices), True)
    return mask[..., :T]


def _causal_allowed(B: int, T: int, lengths: torch.Tensor) -> torch.Tensor:
    t = torch.arange(T)
    return (t[None, None, :] <= t[None, :, None]) & (t[None, None, :] < lengths[:, None, None]).expand(B, T, T)


def _f64_inputs(weights: MLAWeights, hidden_states: torch.Tensor, lengths):
    w = weights.to(torch.float64, device="cpu")
    x = hidden_states.to(device="cpu", dtype=torch.float64)
    B, T, _ = x.shape
    lengths = torch.full((B,), T) if lengths is None else lengths.to("cpu")
    return w, x, lengths, torch.arange(T).expand(B, T)


def indexer_scores_f64(weights: MLAWeights, hidden_states: torch.Tensor, lengths: torch.Tensor | None = None, *,
                       rope_layout: str | None = None, hadamard: bool = True, fp8: bool = False,
                       rope_convention: str = "transformers") -> torch.Tensor:
    """Float64 indexer scores [B, T, T] of each row's whole sequence (positions 0..L-1): -inf where the
    key is in the query's future or past the row's length. ``rope_layout`` None: the config's."""
    w, x, lengths, positions = _f64_inputs(weights, hidden_states, lengths)
    q, k, hw = indexer_project(w, x, positions, rope_layout=rope_layout, hadamard=hadamard, fp8=fp8,
                               rope_convention=rope_convention)
    return indexer_scores(q, k, hw, _causal_allowed(x.shape[0], x.shape[1], lengths))


def select_topk_f64(weights: MLAWeights, hidden_states: torch.Tensor, lengths: torch.Tensor | None = None,
                    **indexer_kwargs) -> torch.Tensor:
    """The oracle's selection [B, T, min(index_topk, T)] (int64, -1 = unused slot): top-k of
    ``indexer_scores_f64`` (same keywords)."""
    scores = indexer_scores_f64(weights, hidden_states, lengths, **indexer_kwargs)
    return select_topk(scores, weights.config.index_topk)


def sparse_attention_f64(weights: MLAWeights, hidden_states: torch.Tensor, lengths: torch.Tensor | None = None, *,
                         indices: torch.Tensor | None = None, rope_convention: str = "transformers",
                         **indexer_kwargs) -> torch.Tensor:
    """Float64 DSA: absorbed MLA of each row's whole sequence over the selected keys only.

    ``indices`` [B, T, K] (-1 = unused slot) is the selection to attend over -- a backend's own, say;
    by default the oracle's (``select_topk_f64`` with ``indexer_kwargs``). Selected keys outside the
    causal / length mask are ignored. Returns float64 [B, T, hidden]; rows beyond their length are zero.
    With every row no longer than index_topk this is dense MLA (``reference_attention_f64``).
    """
    rope_factor(weights.config, rope_convention)
    w, x, lengths, positions = _f64_inputs(weights, hidden_states, lengths)
    B, T, _ = x.shape
    if indices is None:
        indices = select_topk(indexer_scores_f64(w, x, lengths, rope_convention=rope_convention, **indexer_kwargs),
                              w.config.index_topk)
    allowed = _causal_allowed(B, T, lengths) & selection_mask(indices.to("cpu", torch.int64), T)
    q_nope, q_pe, c, k_pe = project(w, x, positions, rope_convention=rope_convention)
    out = absorbed_scores_and_mix(w, q_nope, q_pe, c, k_pe, allowed)
    valid = (torch.arange(T)[None, :] < lengths[:, None])[..., None]
    return out * valid



def e4m3_half_subnormal_step(v: torch.Tensor) -> torch.Tensor:
    """Per element of ``v`` [..., D]: 2 x its block's power-of-two scale x 2^-10 (e4m3's subnormal half-step at
    that scale; blocks of FP8_INDEXER_BLOCK values, the scale 2^ceil(log2(amax / 448)) with amax at least 1e-4)."""
    blk = min(FP8_INDEXER_BLOCK, v.shape[-1])
    amax = v.unflatten(-1, (-1, blk)).abs().amax(-1, keepdim=True).clamp_min(1e-4)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_E4M3_MAX)))
    return (2 * scale * 2.0 ** -10).expand(*amax.shape[:-1], blk).flatten(-2)


def indexer_score_oracle(weights: MLAWeights, x: torch.Tensor, lengths: torch.Tensor, *, product_error: float,
                         rope_layout: str | None = None):
    """(scores [B, T, T] float64, M [B, T, T], U [B, T, T], allowed [B, T, T] bool) of float64 layer inputs x
    [B, T, hidden] with row lengths ``lengths``: the indexer scores, the magnitude M and the e4m3 subnormal term U
    above, and which (query, key) pairs a causal row allows (key <= query < length). ``rope_layout`` None: the
    config's indexer RoPE layout."""
    B, T, _ = x.shape
    scores = indexer_scores_f64(weights, x, lengths, rope_layout=rope_layout)
    q, k, hw = indexer_project(weights, x, torch.arange(T).expand(B, T), rope_layout=rope_layout)
    M = torch.einsum("bsh,bshd,btd->bst", hw.abs(), q.abs(), k.abs())
    uq, uk = e4m3_half_subnormal_step(q), e4m3_half_subnormal_step(k)
    e = product_error
    U = torch.einsum("bsh,bshd,btd->bst", hw.abs(), uq, k.abs() * (1 + e) + uk) + \
        torch.einsum("bsh,bshd,btd->bst", hw.abs(), q.abs() * (1 + e), uk)
    t = torch.arange(T)
    valid_q = t[None, :] < lengths[:, None]
    allowed = (t[None, None, :] <= t[None, :, None]) & (t[None, None, :] < lengths[:, None, None]) & valid_q[..., None]
    return scores, M, U, allowed
