"""Reference MLA: the naive (expanded K/V) and absorbed (latent) paths side by side.

Reads as the equations of DeepSeek-V2 section 2.1 and DeepSeek-V3 ``inference/model.py``::

    c_t      = RMSNorm(W_DKV x_t)                          the latent, kv_lora_rank wide, cached
    k^R_t    = RoPE(W_KR x_t)                              one rotated key shared by all heads, cached
    q_t      = W_UQ RMSNorm(W_DQ x_t)   (or W_Q x_t)       split per head into q^C (nope) and q^R (rope)
    naive:     k^C_{t,h} = W_UK,h c_t,  v_{t,h} = W_UV,h c_t    expanded and cached per head
    absorbed:  q^C_h W_UK,h . c_t  ==  q^C_h . W_UK,h c_t       the query absorbs W_UK,
               sum_t p_t W_UV,h c_t == W_UV,h sum_t p_t c_t     the output absorbs W_UV
    o_t      = W_O concat_h( sum_t softmax(scale * (q^C.k^C + q^R.k^R))_t v_{t,h} )

``kv_b_proj.weight`` viewed as ``[heads, qk_nope + v, kv_lora]`` holds W_UK in its first
``qk_nope_head_dim`` rows and W_UV in its last ``v_head_dim`` rows. Softmax runs in fp32 (in float64
for float64 inputs). Einsum subscripts name the axes: b batch, s query, t key, h head, d per-head
dim, c latent, r rope.

``reference_attention_f64`` is the one-shot float64 oracle the conformance checks compare with: it
recomputes every row from its full token sequence in expanded form, with no cache at all.

DeepSeek Sparse Attention (V3.2) -- the lightning indexer, its selection and their float64 oracles -- is
mla_conformance.model.dsa_reference.
"""

from __future__ import annotations

import torch

from mla_conformance.model.config import MLAConfig, rope_inv_freq
from mla_conformance.model.weights import MLAWeights
from mla_conformance.schema import ROPE_CONVENTIONS

# --------------------------------------------------------------------------- shared pieces


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """w * x / sqrt(mean(x^2) + eps); statistics in fp32 (float64 stays float64), as transformers."""
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(work)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


#: The half-precision dtypes whose products :func:`matmul` and :func:`einsum` compute as a GPU GEMM does.
HALF_DTYPES = (torch.bfloat16, torch.float16)


def gemm_operand(t: torch.Tensor) -> torch.Tensor:
    """``t`` as :func:`matmul` multiplies it: a half-precision CPU tensor in float32 (exact), else ``t``."""
    return t.float() if t.dtype in HALF_DTYPES and t.device.type == "cpu" else t


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b``; half-precision operands multiplied as a GPU GEMM multiplies them (cuBLAS with float32 compute,
    FlashMLA's and FlashInfer's tensor-core MMAs): each product exact, the sum in float32, the result rounded once
    to ``a``'s dtype. On a CPU that is computed in float32 (a product of two bfloat16 or float16 values is exact
    there): torch's CPU half-precision GEMM also sums in float32, in another order, and on CPUs without native
    bfloat16 instructions is many times slower. On a GPU the dtype's own GEMM is that GEMM."""
    return (gemm_operand(a) @ gemm_operand(b)).to(a.dtype)


def einsum(spec: str, *operands: torch.Tensor) -> torch.Tensor:
    """``torch.einsum(spec, *operands)`` with :func:`matmul`'s arithmetic, rounded once to the first operand's
    dtype."""
    return torch.einsum(spec, *map(gemm_operand, operands)).to(operands[0].dtype)


def rope_factor(config: MLAConfig, rope_convention: str = "transformers") -> float:
    """The factor cos/sin carry under ``rope_convention`` (see ROPE_CONVENTIONS)."""
    if rope_convention == "transformers":
        return config.rope_attention_factor
    if rope_convention == "deepseek-v3":
        return 1.0
    raise ValueError(f"unknown rope_convention {rope_convention!r}; known: {', '.join(ROPE_CONVENTIONS)}")


def rope_cos_sin(config: MLAConfig, positions: torch.Tensor, *,
                 rope_convention: str = "transformers") -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [B, S, rope/2] in float64 for integer positions, times the convention's YaRN factor."""
    m = rope_factor(config, rope_convention)
    inv_freq = rope_inv_freq(config, torch.float64).to(positions.device)
    angles = positions.to(torch.float64)[..., None] * inv_freq
    return torch.cos(angles) * m, torch.sin(angles) * m


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]) -- DeepSeek's complex layout. x: [B, S, (H,) r]."""
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    if x.dim() == 4:  # per-head query: broadcast over heads
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    pairs = x.to(work).unflatten(-1, (-1, 2))
    re, im = pairs[..., 0], pairs[..., 1]
    cos, sin = cos.to(work), sin.to(work)
    out = torch.stack((re * cos - im * sin, re * sin + im * cos), dim=-1).flatten(-2)
    return out.to(x.dtype)


def project(weights: MLAWeights, x: torch.Tensor, positions: torch.Tensor, *,
            rope_convention: str = "transformers"):
    """The per-token projections both paths share (RoPE under ``rope_convention``, ROPE_CONVENTIONS).

    Returns q_nope [B,S,H,nope], q_pe [B,S,H,rope] (rotated), c [B,S,kv_lora] (normed latent) and
    k_pe [B,S,rope] (rotated) -- the last two are what a latent cache stores.
    """
    cfg = weights.config
    if cfg.q_lora_rank is None:
        q = matmul(x, weight_t(weights, "q_proj.weight"))
    else:
        q_a = rms_norm(matmul(x, weight_t(weights, "q_a_proj.weight")), weights["q_a_layernorm.weight"],
                       cfg.rms_norm_eps)
        q = matmul(q_a, weight_t(weights, "q_b_proj.weight"))
    q = q.unflatten(-1, (cfg.num_attention_heads, cfg.qk_head_dim))
    q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
    kv = matmul(x, weight_t(weights, "kv_a_proj_with_mqa.weight"))
    c, k_pe = kv.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
    c = rms_norm(c, weights["kv_a_layernorm.weight"], cfg.rms_norm_eps)
    cos, sin = rope_cos_sin(cfg, positions, rope_convention=rope_convention)
    return q_nope, apply_rope(q_pe, cos, sin), c, apply_rope(k_pe, cos, sin)


def split_kv_b(weights: MLAWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """W_UK [H, nope, c] and W_UV [H, v, c] from kv_b_proj.weight viewed as [H, nope + v, c]."""
    cfg = weights.config
    wkv_b = weights["kv_b_proj.weight"].view(cfg.num_attention_heads, -1, cfg.kv_lora_rank)
    return wkv_b[:, : cfg.qk_nope_head_dim], wkv_b[:, cfg.qk_nope_head_dim:]


def _made_once(weights: MLAWeights, slot: str, source: torch.Tensor, make):
    """``make(source)``, kept on ``weights`` under ``slot`` (with ``source`` itself, so that no other tensor can
    take its place at its address) and made again only for another tensor or after an in-place change (its
    version counter), instead of at every call: every decode step."""
    memo = weights.__dict__.setdefault("_made_once", {})
    hit = memo.get(slot)
    if hit is None or hit[0] is not source or hit[1] != source._version:
        hit = memo[slot] = (source, source._version, make(source))
    return hit[2]


def weight_t(weights: MLAWeights, name: str) -> torch.Tensor:
    """``weights[name].T`` as :func:`matmul` multiplies it (:func:`gemm_operand`), made once per weights object."""
    return _made_once(weights, name, weights[name], lambda w: gemm_operand(w.T))


def absorbed_kv_b(weights: MLAWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`split_kv_b`'s W_UK and W_UV as the absorbed einsums read them (contiguous, :func:`gemm_operand`), made
    once per weights object (again after an in-place change of ``kv_b_proj.weight``) instead of at every call:
    einsum copies a strided half on each use, at every decode step. The einsums below give bit-identical results
    on the contiguous halves (tests/test_reference_einsum.py holds it)."""
    return _made_once(weights, "absorbed_kv_b", weights["kv_b_proj.weight"],
                      lambda _: tuple(gemm_operand(half.contiguous()) for half in split_kv_b(weights)))


def softmax_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def masked_softmax(scores: torch.Tensor, allowed: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Softmax over t of scores [B,S,H,T] where allowed [B,S,T]; a row with no key gives zeros."""
    work = softmax_dtype(out_dtype)
    # in place on one contiguous copy of our own (never on the caller's scores): the same values without the
    # copies an out-of-place masked_fill and nan_to_num make, nor softmax's own copy of a strided input
    scores = scores.to(work, copy=True, memory_format=torch.contiguous_format)
    scores.masked_fill_(~allowed[:, :, None, :], float("-inf"))
    p = torch.softmax(scores, dim=-1)
    return torch.nan_to_num_(p, nan=0.0).to(out_dtype)


# --------------------------------------------------------------------------- the two paths

#: The score equations, as einsum specs. The functions below compute exactly these (tests/test_reference_einsum.py
#: ties each to ``torch.einsum(spec, ...)``) in a form that reads the cache in place: each head's K [T, d] (or the
#: latent [T, c]) is the untransposed left operand of one matmul instead of a transposed copy (a half-precision
#: cache on a CPU is read once, into float32: :func:`matmul`).
NAIVE_SCORES = "bshd,bthd->bsht"                        # q . k per head
ABSORBED_SCORES = ("bshc,btc->bsht", "bshr,btr->bsht")  # q_lat . c  +  q_pe . k_pe, shared by the heads


def naive_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """einsum(NAIVE_SCORES, q [B,S,H,d], k [B,T,H,d]) -> [B,S,H,T]."""
    return matmul(k.transpose(1, 2), q.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


def absorbed_scores(q_lat: torch.Tensor, q_pe: torch.Tensor, c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """einsum(ABSORBED_SCORES[0], q_lat, c) + einsum(ABSORBED_SCORES[1], q_pe, k_pe) -> [B,S,H,T]."""
    B, S, H, _ = q_lat.shape
    s = matmul(c, q_lat.flatten(1, 2).transpose(1, 2)) + matmul(k_pe, q_pe.flatten(1, 2).transpose(1, 2))  # [B,T,SH]
    return s.transpose(1, 2).unflatten(1, (S, H))



def naive_scores_and_mix(weights: MLAWeights, q_nope, q_pe, k, v, allowed):
    """Expanded attention: k [B,T,H,nope+rope], v [B,T,H,v] as a naive cache stores them."""
    cfg = weights.config
    q = torch.cat([q_nope, q_pe], dim=-1)
    scores = naive_scores(q, k) * cfg.softmax_scale
    p = masked_softmax(scores, allowed, q.dtype)
    o = einsum("bsht,bthd->bshd", p, v)
    return matmul(o.flatten(-2), weight_t(weights, "o_proj.weight"))


def absorbed_scores_and_mix(weights: MLAWeights, q_nope, q_pe, c, k_pe, allowed):
    """Absorbed attention over the latent cache: c [B,T,kv_lora], k_pe [B,T,rope]."""
    cfg = weights.config
    w_uk, w_uv = absorbed_kv_b(weights)
    q_lat = einsum("bshd,hdc->bshc", q_nope, w_uk)                     # query absorbs W_UK
    scores = absorbed_scores(q_lat, q_pe, c, k_pe) * cfg.softmax_scale
    p = masked_softmax(scores, allowed, q_nope.dtype)
    o_lat = einsum("bsht,btc->bshc", p, c)
    o = einsum("bshc,hdc->bshd", o_lat, w_uv)                            # output absorbs W_UV
    return matmul(o.flatten(-2), weight_t(weights, "o_proj.weight"))


def expand_kv(weights: MLAWeights, c: torch.Tensor, k_pe: torch.Tensor):
    """What a naive cache stores for latent c [B,T,c] and rotated k_pe [B,T,r]: per-head K and V."""
    cfg = weights.config
    w_uk, w_uv = split_kv_b(weights)
    k_nope = einsum("btc,hdc->bthd", c, w_uk)
    v = einsum("btc,hdc->bthd", c, w_uv)
    k_pe = k_pe[:, :, None, :].expand(-1, -1, cfg.num_attention_heads, -1)
    return torch.cat([k_nope, k_pe], dim=-1), v


# --------------------------------------------------------------------------- float64 oracle


def reference_attention_f64(weights: MLAWeights, hidden_states: torch.Tensor,
                            lengths: torch.Tensor | None = None, *,
                            rope_convention: str = "transformers") -> torch.Tensor:
    """One-shot float64 expanded attention of each row's whole sequence (positions 0..L-1).

    hidden_states [B, T, hidden]; lengths [B] valid tokens per row (right padding). Returns float64
    [B, T, hidden]; rows beyond their length are zero. ``rope_convention`` (a key of ROPE_CONVENTIONS)
    picks YaRN's cos/sin factor; the two agree whenever mscale == mscale_all_dim.
    """
    rope_factor(weights.config, rope_convention)  # reject an unknown name before any work
    w = weights.to(torch.float64, device="cpu")
    x = hidden_states.to(device="cpu", dtype=torch.float64)
    B, T, _ = x.shape
    lengths = torch.full((B,), T) if lengths is None else lengths.to("cpu")
    positions = torch.arange(T).expand(B, T)
    q_nope, q_pe, c, k_pe = project(w, x, positions, rope_convention=rope_convention)
    k, v = expand_kv(w, c, k_pe)
    t = torch.arange(T)
    allowed = (t[None, None, :] <= t[None, :, None]) & (t[None, None, :] < lengths[:, None, None])
    out = naive_scores_and_mix(w, q_nope, q_pe, k, v, allowed)
    valid = (t[None, :] < lengths[:, None])[..., None]
    return out * valid
