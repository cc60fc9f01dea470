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

DeepSeek Sparse Attention (V3.2), at the end of this module: the lightning indexer
(``indexer_project``, ``indexer_scores``, ``select_topk``) and its float64 oracles
``indexer_scores_f64``, ``select_topk_f64`` and ``sparse_attention_f64`` (absorbed MLA over the
selected tokens).
"""

from __future__ import annotations

import torch

from mla_conformance.dtypes import FP8_E4M3_MAX
from mla_conformance.model.config import MLAConfig, rope_inv_freq
from mla_conformance.model.weights import MLAWeights

# --------------------------------------------------------------------------- shared pieces


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """w * x / sqrt(mean(x^2) + eps); statistics in fp32 (float64 stays float64), as transformers."""
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(work)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


#: The YaRN RoPE conventions the oracle implements. They differ only when a config's ``mscale`` !=
#: ``mscale_all_dim`` (every published DeepSeek config has the two equal, so the factor is 1 there); the
#: softmax scale, 1/sqrt(qk_head_dim) x mscale(factor, mscale_all_dim)^2, is the same in both.
ROPE_CONVENTIONS: dict[str, str] = {
    "transformers": "transformers / DeepSeek-V2 modeling: cos/sin x mscale(factor, mscale) / "
                    "mscale(factor, mscale_all_dim)",
    "deepseek-v3": "DeepSeek-V3 reference inference/model.py: no cos/sin factor",
}


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
        q = x @ weights["q_proj.weight"].T
    else:
        q_a = rms_norm(x @ weights["q_a_proj.weight"].T, weights["q_a_layernorm.weight"], cfg.rms_norm_eps)
        q = q_a @ weights["q_b_proj.weight"].T
    q = q.unflatten(-1, (cfg.num_attention_heads, cfg.qk_head_dim))
    q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
    kv = x @ weights["kv_a_proj_with_mqa.weight"].T
    c, k_pe = kv.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
    c = rms_norm(c, weights["kv_a_layernorm.weight"], cfg.rms_norm_eps)
    cos, sin = rope_cos_sin(cfg, positions, rope_convention=rope_convention)
    return q_nope, apply_rope(q_pe, cos, sin), c, apply_rope(k_pe, cos, sin)


def split_kv_b(weights: MLAWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """W_UK [H, nope, c] and W_UV [H, v, c] from kv_b_proj.weight viewed as [H, nope + v, c]."""
    cfg = weights.config
    wkv_b = weights["kv_b_proj.weight"].view(cfg.num_attention_heads, -1, cfg.kv_lora_rank)
    return wkv_b[:, : cfg.qk_nope_head_dim], wkv_b[:, cfg.qk_nope_head_dim:]


def absorbed_kv_b(weights: MLAWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`split_kv_b`'s W_UK and W_UV, each made contiguous once per weights object (again after an in-place
    change of ``kv_b_proj.weight``) instead of at every call: einsum copies a strided half on each use, which at
    DeepSeek-V2-Lite dims was ~15 % of an absorbed decode step on CPU. The einsums below give bit-identical
    results on the contiguous halves (tests/test_reference_einsum.py holds it)."""
    wkv_b = weights["kv_b_proj.weight"]
    key = (wkv_b.data_ptr(), wkv_b._version, wkv_b.dtype, wkv_b.device, tuple(wkv_b.shape))
    memo = getattr(weights, "_absorbed_kv_b", None)
    if memo is None or memo[0] != key:
        w_uk, w_uv = split_kv_b(weights)
        memo = (key, w_uk.contiguous(), w_uv.contiguous())
        try:
            weights._absorbed_kv_b = memo
        except AttributeError:  # a mapping that takes no attribute: no memo, the same numbers
            pass
    return memo[1], memo[2]


def softmax_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def masked_softmax(scores: torch.Tensor, allowed: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Softmax over t of scores [B,S,H,T] where allowed [B,S,T]; a row with no key gives zeros."""
    work = softmax_dtype(out_dtype)
    # in place on a contiguous copy of our own (never on the caller's scores; softmax would make a strided one
    # contiguous itself): the same values, three score-sized copies fewer
    scores = scores.to(work, copy=True, memory_format=torch.contiguous_format)
    scores.masked_fill_(~allowed[:, :, None, :], float("-inf"))
    p = torch.softmax(scores, dim=-1)
    return torch.nan_to_num_(p, nan=0.0).to(out_dtype)


# --------------------------------------------------------------------------- the two paths

#: The score equations, as einsum specs. The functions below compute exactly these (tests/test_reference_einsum.py
#: ties each to ``torch.einsum(spec, ...)``) in a form that reads the cache in place: each head's K [T, d] (or the
#: latent [T, c]) is the untransposed left operand of one matmul instead of a transposed copy, 6-7x faster at 16k
#: tokens in bf16 on CPU.
NAIVE_SCORES = "bshd,bthd->bsht"                        # q . k per head
ABSORBED_SCORES = ("bshc,btc->bsht", "bshr,btr->bsht")  # q_lat . c  +  q_pe . k_pe, shared by the heads


def naive_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """einsum(NAIVE_SCORES, q [B,S,H,d], k [B,T,H,d]) -> [B,S,H,T]."""
    return (k.transpose(1, 2) @ q.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


def absorbed_scores(q_lat: torch.Tensor, q_pe: torch.Tensor, c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """einsum(ABSORBED_SCORES[0], q_lat, c) + einsum(ABSORBED_SCORES[1], q_pe, k_pe) -> [B,S,H,T]."""
    B, S, H, _ = q_lat.shape
    s = c @ q_lat.flatten(1, 2).transpose(1, 2) + k_pe @ q_pe.flatten(1, 2).transpose(1, 2)  # [B, T, S*H]
    return s.transpose(1, 2).unflatten(1, (S, H))



def naive_scores_and_mix(weights: MLAWeights, q_nope, q_pe, k, v, allowed):
    """Expanded attention: k [B,T,H,nope+rope], v [B,T,H,v] as a naive cache stores them."""
    cfg = weights.config
    q = torch.cat([q_nope, q_pe], dim=-1)
    scores = naive_scores(q, k) * cfg.softmax_scale
    p = masked_softmax(scores, allowed, q.dtype)
    o = torch.einsum("bsht,bthd->bshd", p, v)
    return o.flatten(-2) @ weights["o_proj.weight"].T


def absorbed_scores_and_mix(weights: MLAWeights, q_nope, q_pe, c, k_pe, allowed):
    """Absorbed attention over the latent cache: c [B,T,kv_lora], k_pe [B,T,rope]."""
    cfg = weights.config
    w_uk, w_uv = absorbed_kv_b(weights)
    q_lat = torch.einsum("bshd,hdc->bshc", q_nope, w_uk)               # query absorbs W_UK
    scores = absorbed_scores(q_lat, q_pe, c, k_pe) * cfg.softmax_scale
    p = masked_softmax(scores, allowed, q_nope.dtype)
    o_lat = torch.einsum("bsht,btc->bshc", p, c)
    o = torch.einsum("bshc,hdc->bshd", o_lat, w_uv)                      # output absorbs W_UV
    return o.flatten(-2) @ weights["o_proj.weight"].T


def expand_kv(weights: MLAWeights, c: torch.Tensor, k_pe: torch.Tensor):
    """What a naive cache stores for latent c [B,T,c] and rotated k_pe [B,T,r]: per-head K and V."""
    cfg = weights.config
    w_uk, w_uv = split_kv_b(weights)
    k_nope = torch.einsum("btc,hdc->bthd", c, w_uk)
    v = torch.einsum("btc,hdc->bthd", c, w_uv)
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
#: Elements per FP8 scale in DeepSeek's act_quant (a block of at most this many along the head dim).
FP8_BLOCK = FP8_INDEXER_BLOCK


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


def fp8_block_dequant(x: torch.Tensor, *, block: int = FP8_BLOCK, scale_fmt: str | None = "ue8m0") -> torch.Tensor:
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
