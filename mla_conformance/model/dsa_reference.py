"""Oracles of DeepSeek Sparse Attention's lightning indexer for the DSA checks (mla_conformance.checks.dsa): the
float64 scores of every (query, key) pair, and the magnitudes their rounding errors scale with.

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

from mla_conformance.model.reference import FP8_BLOCK, indexer_project, indexer_scores_f64
from mla_conformance.model.weights import MLAWeights


def e4m3_half_subnormal_step(v: torch.Tensor) -> torch.Tensor:
    """Per element of ``v`` [..., D]: 2 x its block's power-of-two scale x 2^-10 (e4m3's subnormal half-step at
    that scale; blocks of FP8_BLOCK values, the scale 2^ceil(log2(amax / 448)) with amax at least 1e-4)."""
    blk = min(FP8_BLOCK, v.shape[-1])
    amax = v.unflatten(-1, (-1, blk)).abs().amax(-1, keepdim=True).clamp_min(1e-4)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
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
