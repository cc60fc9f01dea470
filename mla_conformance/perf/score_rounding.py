"""What rounding the attention scores to the run's dtype adds to a decode step's error, derived from the step itself.

``checks.TOLERANCES`` counts ~12 roundings of relative size u between a layer's input and its output, independent
of the row's length. One of them is not of that kind: a backend that rounds the scores to its dtype before the
float32 softmax (transformers' eager attention: ``matmul(q, k^T) * scaling`` in the model dtype, then
``softmax(dtype=float32)``; reference-naive and reference-absorbed alike) moves each *logit* by a relative u of
the scores it is summed from, so by ~u |logit| absolutely, and through the softmax the output by an amount that
grows with the logits' magnitude: at long rows it alone exceeds TOLERANCES' bf16 rel_fro (tests/test_bench_gate.py
simulates it at 1016 keys). This module bounds
that error for one decode step from the float64 oracle's own quantities; the gate (:mod:`mla_conformance.perf.gate`)
adds it to the suite's bound of every layer backend. A backend whose scores are float32 (FlashMLA, reference-op) has
that much margin; the term scales with u (2^-8 bfloat16, 2^-11 float16, 2^-24 float32, 2^-53 float64).

**The perturbation, exactly.** The absorbed path rounds each logit four times (PARTIALS, AFTER): l_A = scale q_lat.c_t
and l_B = scale q_pe.k_pe_t each to the dtype, their sum, then the product with the scale, so
l~_t = (l_t + l_A d_A + l_B d_B)(1 + d_s)(1 + d_c) = l_t + eps_t, eps_t = lin_t + eta_t with the first-order part
lin_t = l_A d_A + l_B d_B + l_t (d_s + d_c) (an expanded q.k has one rounding fewer), |eps_t| <= E_t =
u (|l_A| + |l_B|)(1 + u)^2 + |l_t| ((1 + u)^2 - 1) and |eta_t| <= u (|l_A| + |l_B|)((1 + u)^2 - 1) + |l_t| u^2.
With p the float64 softmax, v_t = W_UV,h c_t, a_h = sum_t p_t v_t and Z_h = sum_t p_t e^{eps_t} >= e^{-max E}, the
head's output moves by exactly

    Delta a_h = (A1_h + A2_h) / Z_h,   A1_h = sum_t p_t eps_t (v_t - a_h),   A2_h = sum_t p_t rho_t (v_t - a_h)

(rho_t = e^{eps_t} - 1 - eps_t, using sum_t p_t (v_t - a_h) = 0), and the layer output y = W_O concat_h a_h by
W_O concat_h Delta a_h. Its first-order part dy = W_O concat_h A1lin_h (A1lin: lin in place of eps) is linear in the
independent d's; the rest is R_h = (1/Z_h - 1) A1lin_h + (A1eta_h + A2_h) / Z_h.

**The probabilistic model of rounding** (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., sec.
2.8; Higham and Mary 2019, "A new approach to probabilistic rounding error analysis", SIAM J. Sci. Comput. 41(5),
Model 4.1; Connolly, Higham and Mary 2021, "Stochastic rounding and its probabilistic backward error analysis",
SIAM J. Sci. Comput. 43(1), where it holds exactly): rounding errors are independent mean-zero random variables;
here each absolute error is uniform over its half-ulp interval, so d is uniform on [-u', u'], u' <= u. A uniform
variable is strictly sub-Gaussian, E exp(x d) = sinh(x u') / (x u') <= exp(x^2 u'^2 / 6): its variance proxy is
its variance u'^2/3 <= s2 = u^2/3. dy is then a linear image of a sub-Gaussian vector with covariance proxy

    K = s2 sum_h W_O,h C_h W_O,h^T,   C_h = sum_t lam_t^2 p_t^2 (v_t - a_h)(v_t - a_h)^T,   lam^2 = l_A^2 + l_B^2 + 2l^2

(d_v x d_v per head, float64).

**The concentration factor is derived, not chosen.** Hsu, Kakade and Zhang 2012, "A tail inequality for quadratic
forms of subgaussian random vectors", Electron. Commun. Probab. 17(52), Theorem 1 (mu = 0): with probability at
least 1 - e^{-x}, ||dy||^2 <= tr K + 2 sqrt(x) ||K||_F + 2 x ||K||_2 (here ||K||_2 <= ||K||_F); per output
element, a scalar sub-Gaussian: |dy_i| <= sqrt(2 x K_ii), both signs and every i in the union bound. The recorded
k = bound / sqrt(tr K) (sqrt(tr K) = sqrt(E||dy||^2)) is ~3 where the error spreads over many output directions and
at most sqrt(1 + 2 sqrt(x) + 2x) (one direction). The row's failure probability FAILURE_PROBABILITY = 1e-6 is split
over every event used: ||dy|| 1/4, the elements 1/4, the normalisers 1/16 per head and 1/16 as a vector, three norms
1/32 each, two per-head element sets 1/16 each.

**The rest**, each piece bounded under the same model: |1/Z_h - 1| <= gamma_h = e^{max E} min(sum_t p_t (e^{E_t}
- 1), |sum_t p_t lin_t| + sum_t p_t (|eta_t| + E_t^2 e^{E_t} / 2)), the sum sub-Gaussian with proxy
s2 sum_t p_t^2 lam_t^2; ||sum_h (1/Z_h - 1) W_O,h A1lin_h|| <= ||gamma||_2 sqrt(sum_h ||W_O,h A1lin_h||^2) (the
heads' outputs concatenated: Hsu-Kakade-Zhang again); rho_t = eps_t^2 / 2 + r_t, |r_t| <= E_t^3 e^{E_t} / 6, and
eps_t^2 is its mean (<= (sqrt(s2) lam_t + |eta_t|)^2 by Minkowski, bounded per key, no cancellation assumed) plus a
fluctuation of range E_t^2 (Hoeffding's lemma: proxy E_t^4 / 4, then Hsu-Kakade-Zhang); the eta and mean parts
bounded key by key through ||W_O,h (v_t - a_h)||. Not bounded: the difference between the oracle's logits, where
the term is evaluated, and the backend's own (its other roundings): a product of two small errors.

The term per row: rel_fro <= (||dy|| bound + ||W_O R|| bound) / ||y||, max_abs/rms <= max_i (|dy_i| bound +
|(W_O R)_i| bound) / rms(y); ``score_rounding`` returns both with their parts.

Cost: every key's per-head values in float64 (T kv_lora H d_v per row, in chunks of CHUNK keys) and C_h, D_h
and ||W_O,h (v_t - a_h)|| (3 H T d_v^2): 2 kv_lora H d_v + 6 H d_v^2 = 3.7 MFLOP per key and row at V2-Lite dims;
||K||_F through the blocks W_O,h^T W_O,k (once per weights: n (H d_v)^2) in 4 H^2 d_v^3 per row. The gate computes
it once per configuration for every backend (perf.gate.oracle_and_score_rounding).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mla_conformance.checks.tolerances import unit_roundoff
from mla_conformance.model import reference

#: How each logit is rounded to the model dtype, as the absorbed path computes it (the most roundings among the
#: built-ins): the latent and rope partial scores (q_lat . c_t, q_pe . k_pe_t) each rounded to the dtype (relative to
#: its own magnitude), their sum rounded, then sum x softmax_scale. A backend that rounds less (one q . k matmul
#: and the scale: reference-naive, transformers' eager attention) has margin.
PARTIALS = ("q_lat . c", "q_pe . k_pe")
AFTER = ("the sum", "x softmax_scale")
#: Probability, under the model, that a correct backend's score rounding alone exceeds the term on one row (per
#: statistic: rel_fro, max_abs/rms).
FAILURE_PROBABILITY = 1e-6
#: Keys per chunk of the float64 value expansion.
CHUNK = 2048

MODEL = ("scores rounded to the run's dtype before a float32 softmax (transformers' eager attention): "
         f"the partial scores ({', '.join(PARTIALS)}) each rounded, then {' and '.join(AFTER)}; each error "
         "independent and uniform over its half-ulp interval "
         "(Higham-Mary 2019 Model 4.1), through the softmax; concentration by Hsu-Kakade-Zhang 2012 Thm 1 and "
         f"sub-Gaussian union bounds, failing a correct backend with probability at most {FAILURE_PROBABILITY:g} "
         "per row (mla_conformance.perf.score_rounding)")

_GRAM: dict[Any, tuple[torch.Tensor, torch.Tensor]] = {}


def _o_proj_parts(w64, key) -> tuple[torch.Tensor, torch.Tensor]:
    """W_O per head [H, n, d_v] and the blocks W_O,h^T W_O,k [H, H, d_v, d_v], cached per key (the preset's float64
    master weights)."""
    if key in _GRAM:
        return _GRAM[key]
    cfg = w64.config
    H, dv, n = cfg.num_attention_heads, cfg.v_head_dim, cfg.hidden_size
    wo = w64["o_proj.weight"]
    per_head = wo.view(n, H, dv).permute(1, 0, 2).contiguous()
    gram = (wo.T @ wo).view(H, dv, H, dv).permute(0, 2, 1, 3).contiguous()
    if len(_GRAM) >= 4:
        _GRAM.pop(next(iter(_GRAM)))
    _GRAM[key] = (per_head, gram)
    return _GRAM[key]


def _hkz(trace, frob, x: float):
    """sqrt(tr K + 2 sqrt(x) ||K||_F + 2 x ||K||_F): a bound on the norm of a sub-Gaussian vector with covariance
    proxy K that fails with probability at most e^{-x} (Hsu-Kakade-Zhang 2012 Thm 1, with ||K||_2 <= ||K||_F)."""
    return (trace + (2 * math.sqrt(x) + 2 * x) * frob).clamp_min(0).sqrt()


def _k_norms(C: torch.Tensor, gram: torch.Tensor, per_head: torch.Tensor) -> tuple:
    """For K = sum_h W_O,h C_h W_O,h^T (C [B, H, dv, dv]): tr K, ||K||_F, the block-diagonal ||.||_F (the
    covariance of the heads' outputs concatenated, sqrt(sum_h ||W_O,h C_h W_O,h^T||_F^2)) and diag per head
    [B, H, n]; through the blocks W_O,h^T W_O,k (tr K^2 = sum_hk tr(C_h G_hk C_k G_kh))."""
    B, H = C.shape[:2]
    trace = torch.einsum("bhde,hed->b", C, gram[torch.arange(H), torch.arange(H)])
    frob, frob_bd = torch.zeros_like(trace), torch.zeros_like(trace)
    for b in range(B):
        U = C[b][:, None] @ gram                                                  # C_h G_hk [H, H, dv, dv]
        UU = U * U.permute(1, 0, 3, 2)
        frob[b] = UU.sum().clamp_min(0).sqrt()
        frob_bd[b] = torch.diagonal(UU, dim1=0, dim2=1).sum().clamp_min(0).sqrt()
    diag = ((per_head[None] @ C) * per_head[None]).sum(-1)                        # [B, H, n]
    return trace, frob, frob_bd, diag.clamp_min(0)


def score_rounding(w64, q_nope: torch.Tensor, q_pe: torch.Tensor, c: torch.Tensor, k_pe: torch.Tensor,
                   allowed: torch.Tensor, out: torch.Tensor, dtype: torch.dtype, *, weights_key=None) -> list[dict]:
    """Per row of a decode step (s_q = 1): the terms the score rounding adds to the rel_fro and max_abs/rms bounds,
    with their parts. Inputs in float64 as the oracle computed them: q_nope/q_pe [B,1,H,*], c [B,T,kv_lora],
    k_pe [B,T,rope], allowed [B,1,T] (the keys attended), out [B,1,hidden] the oracle's output."""
    cfg = w64.config
    B, S, H, _ = q_nope.shape
    if S != 1:
        raise ValueError(f"score_rounding bounds one decode step (s_q 1), got s_q {S}")
    dv, n, T = cfg.v_head_dim, cfg.hidden_size, c.shape[1]
    u = unit_roundoff(dtype)
    s2 = u * u / 3                             # variance proxy of one rounding's relative error
    after = (1 + u) ** len(AFTER) - 1
    # the row's failure probability, split over the events used (module docstring)
    alpha = FAILURE_PROBABILITY
    x_fro, x_elem = math.log(4 / alpha), math.log(2 * n * 4 / alpha)
    x_bar, x_bars = math.log(2 * H * 16 / alpha), math.log(16 / alpha)
    x_norm, x_head_elem = math.log(32 / alpha), math.log(2 * n * H * 16 / alpha)
    per_head, gram = _o_proj_parts(w64, weights_key if weights_key is not None else id(w64))
    M = gram[torch.arange(H), torch.arange(H)]                                    # W_O,h^T W_O,h [H, dv, dv]
    row_norms = per_head.norm(dim=-1)                                             # ||W_O,h[i]|| [H, n]
    w_uk, w_uv = reference.split_kv_b(w64)
    f64 = dict(dtype=torch.float64, device=c.device)
    with torch.no_grad():
        q_lat = torch.einsum("bshd,hdc->bshc", q_nope, w_uk)
        mask = allowed[:, 0, None, :]                                              # [B, 1, T]
        parts = [(q_lat[:, 0] @ c.transpose(1, 2)) * cfg.softmax_scale,          # l_A, l_B [B, H, T]
                 (q_pe[:, 0] @ k_pe.transpose(1, 2)) * cfg.softmax_scale]
        parts = [x.masked_fill(~mask, 0.0) for x in parts]
        logits = parts[0] + parts[1]
        p = torch.softmax(logits.masked_fill(~mask, float("-inf")), -1)           # [B, H, T]
        a = torch.einsum("bhc,hdc->bhd", torch.einsum("bht,btc->bhc", p, c), w_uv)  # [B, H, d_v]
        # per key: eps = l~ - l = lin + eta, lin = sum_j L_j d_j (L: the partials, then l for each rounding after)
        lam = (parts[0] ** 2 + parts[1] ** 2 + len(AFTER) * logits ** 2).sqrt()  # sqrt(sum_j L_j^2)
        partial = parts[0].abs() + parts[1].abs()
        err = u * partial * (1 + after) + logits.abs() * after                   # E_t >= |eps_t|
        eta = u * partial * after + logits.abs() * (after - len(AFTER) * u)      # >= |eps_t - lin_t|
        mean_sq = (math.sqrt(s2) * lam + eta) ** 2                               # >= E eps_t^2 (Minkowski)
        # per key: eta (A1's part outside lin) and rho's mean part + third order (times p ||.||, summed)
        det = eta + mean_sq / 2 + err ** 3 * torch.exp(err) / 6
        C = torch.zeros(B, H, dv, dv, **f64)   # sum_t g g^T, g = p lam (v - a): the first order
        D = torch.zeros(B, H, dv, dv, **f64)   # sum_t h h^T, h = p E^2/2 (v - a): rho's fluctuation (proxy 1/4)
        det_lat, det_out = torch.zeros(B, H, **f64), torch.zeros(B, H, **f64)
        w_uv_flat = w_uv.reshape(H * dv, -1)
        for t0 in range(0, T, CHUNK):
            sl = slice(t0, t0 + CHUNK)
            dev = (c[:, sl] @ w_uv_flat.T).unflatten(-1, (H, dv)).transpose(1, 2) - a[:, :, None, :]  # v - a_h
            g, h = (p * lam)[:, :, sl, None] * dev, (p * err * err / 2)[:, :, sl, None] * dev
            C += g.transpose(-1, -2) @ g
            D += h.transpose(-1, -2) @ h
            pd = p[:, :, sl] * det[:, :, sl]
            det_lat += (pd * dev.norm(dim=-1)).sum(-1)
            det_out += (pd * ((dev @ M) * dev).sum(-1).clamp_min(0).sqrt()).sum(-1)
        tr_c, fro_c, bd_c, diag_c = _k_norms(C, gram, per_head)
        tr_d, fro_d, bd_d, diag_d = _k_norms(D, gram, per_head)
        # first order: ||dy|| (Hsu-Kakade-Zhang) and each |dy_i| (sub-Gaussian, union over i)
        first = _hkz(s2 * tr_c, s2 * fro_c, x_fro)
        first_elem = (2 * x_elem * s2 * diag_c.sum(1)).sqrt()                     # [B, n]
        # the rest, per head: R_h = (1/Z_h - 1) A1lin_h + (A1eta_h + A2_h)/Z_h, |1/Z_h - 1| <= gamma_h
        inv_z = torch.exp(err.amax(-1))                                           # >= 1/Z_h [B, H]
        # |Z_h - 1| <= |sum_t p_t lin_t| + sum_t p_t (eta_t + |rho_t|), the sum sub-Gaussian (proxy s2 sum p^2 lam^2),
        # or <= sum_t p_t (e^{E_t} - 1): per head (union over the heads) and as a vector over the heads
        var_bar, rest = s2 * (p * p * lam * lam).sum(-1), (p * (eta + err * err * torch.exp(err) / 2)).sum(-1)
        z_det = (p * torch.expm1(err)).sum(-1)
        gamma = inv_z * torch.minimum(z_det, (2 * x_bar * var_bar).sqrt() + rest)  # >= |1/Z_h - 1| [B, H]
        gamma_norm = inv_z.amax(-1) * torch.minimum(
            z_det.norm(dim=-1), _hkz(var_bar.sum(-1), var_bar.norm(dim=-1), x_bars) + rest.norm(dim=-1))
        second = (inv_z * det_out).sum(-1) + gamma_norm * _hkz(s2 * tr_c, s2 * bd_c, x_norm) \
            + _hkz(tr_d / 4, fro_d / 4, x_norm) + gamma_norm * _hkz(tr_d / 4, bd_d / 4, x_norm)
        second_elem = (inv_z[:, :, None] * det_lat[:, :, None] * row_norms[None]).sum(1) \
            + (gamma[:, :, None] * (2 * x_head_elem * s2 * diag_c).sqrt()).sum(1) \
            + (inv_z[:, :, None] * (2 * x_head_elem * diag_d / 4).sqrt()).sum(1)  # >= |(W_O R)_i| [B, n]
    rows = []
    for b in range(B):
        y = out[b].to(torch.float64)
        norm, rms = float(y.norm()), float(y.pow(2).mean().sqrt())
        sigma = math.sqrt(max(s2 * float(tr_c[b]), 0.0))
        rows.append({
            "rel_fro": (float(first[b]) + float(second[b])) / norm if norm else 0.0,
            "max_rel": float((first_elem[b] + second_elem[b]).max()) / rms if rms else 0.0,
            "sigma_rel": sigma / norm if norm else 0.0,                    # sqrt(E||dy||^2) / ||y||
            "k": float(first[b]) / sigma if sigma else 0.0,
            "second_order_rel": float(second[b]) / norm if norm else 0.0,
            "max_abs_logit": float(logits[b].abs().max()),
        })
    return rows


def describe(dtype: torch.dtype) -> dict[str, Any]:
    """The model's constants for the record."""
    return {"model": MODEL, "unit_roundoff": unit_roundoff(dtype), "partials": list(PARTIALS), "after": list(AFTER),
            "failure_probability": FAILURE_PROBABILITY}
