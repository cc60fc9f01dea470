"""A complete minimal MLA backend written to the base layer contract (the README's template, made complete).

FROZEN: written once, never edited when features land. It declares nothing beyond the base contract (no
cache_format, no paging, no sparse attention, no codecs), so it proves that code written to yesterday's
contract gets the same verdict tomorrow: it must pass the whole default suite, with explicit skips for every
optional part (tests/meta/test_frozen.py). torch only; nothing from mla_conformance.
"""
import math

import torch


def _yarn(cfg):
    """inv_freq [rope/2], the cos/sin factor and the softmax scale (DeepSeek-V2's YaRN, transformers' form)."""
    d = cfg.qk_rope_head_dim
    inv = cfg.rope_theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    scale, rs = (cfg.qk_nope_head_dim + d) ** -0.5, cfg.rope_scaling
    if not rs:
        return inv, 1.0, scale
    f, orig = float(rs["factor"]), float(rs["original_max_position_embeddings"])
    m = lambda k: 0.1 * k * math.log(f) + 1.0 if f > 1 else 1.0
    dim = lambda r: d * math.log(orig / (r * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))
    lo, hi = max(math.floor(dim(rs.get("beta_fast", 32))), 0), min(math.ceil(dim(rs.get("beta_slow", 1))), d - 1)
    ramp = ((torch.arange(d // 2, dtype=torch.float64) - lo) / max(hi - lo, 1e-3)).clamp(0, 1)
    inv = inv / f * ramp + inv * (1 - ramp)
    ms, ms_all = rs.get("mscale"), rs.get("mscale_all_dim")
    factor = m(float(ms)) / m(float(ms_all)) if ms and ms_all else m(1.0)
    return inv, factor, scale * (m(float(ms_all)) ** 2 if ms_all else 1.0)


def _rms(x, w, eps):
    xf = x.float() if x.dtype != torch.float64 else x
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope(x, cos, sin):
    """Rotate interleaved pairs (2i, 2i+1) by angle i, in float64."""
    a, b = x.double().unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((a * cos - b * sin, a * sin + b * cos), -1).flatten(-2).to(x.dtype)


class LatentCache:
    """[B, capacity, kv_lora_rank + qk_rope_head_dim]: the normed latent, then the rotated k_pe."""

    def __init__(self, config, batch_size, capacity, dtype, device):
        self.batch_size, self.capacity = batch_size, capacity
        self.kv = torch.zeros(batch_size, capacity, config.kv_lora_rank + config.qk_rope_head_dim,
                              dtype=dtype, device=device)
        self.seq_lens = torch.zeros(batch_size, dtype=torch.int64, device=device)

    def tensors(self):
        return {"kv": self.kv}

    def allocated_nbytes(self):
        return self.kv.numel() * self.kv.element_size()

    def active_nbytes(self):
        return int(self.seq_lens.sum()) * self.kv.shape[-1] * self.kv.element_size()


class MyBackend:
    name = "my-mla"

    def unsupported_reason(self, config, *, dtype, device, kv_codec):
        return None if kv_codec == "none" else f"no {kv_codec} cache in my-mla"

    def new_cache(self, config, *, batch_size, capacity, dtype, device, kv_codec="none"):
        return LatentCache(config, batch_size, capacity, dtype, device)

    def attend(self, weights, hidden_states, positions, cache, lengths=None):
        cfg, x = weights.config, hidden_states
        B, S, _ = x.shape
        H, nope, rope, L = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
        lengths = torch.full((B,), S) if lengths is None else lengths.to(torch.int64).cpu()
        if "q_proj.weight" in weights:
            q = x @ weights["q_proj.weight"].T
        else:
            q = _rms(x @ weights["q_a_proj.weight"].T, weights["q_a_layernorm.weight"], cfg.rms_norm_eps)
            q = q @ weights["q_b_proj.weight"].T
        q = q.view(B, S, H, nope + rope)
        kv = x @ weights["kv_a_proj_with_mqa.weight"].T
        c = _rms(kv[..., :L], weights["kv_a_layernorm.weight"], cfg.rms_norm_eps)
        inv, factor, scale = _yarn(cfg)
        ang = positions.double()[..., None] * inv.to(x.device)
        cos, sin = ang.cos() * factor, ang.sin() * factor
        q_pe, k_pe = _rope(q[..., nope:], cos[:, :, None], sin[:, :, None]), _rope(kv[..., L:], cos, sin)
        for b in range(B):  # append the valid new tokens
            s, n = int(cache.seq_lens[b]), int(lengths[b])
            cache.kv[b, s:s + n] = torch.cat([c[b, :n], k_pe[b, :n]], -1).to(cache.kv.dtype)
        cache.seq_lens += lengths.to(cache.seq_lens.device)
        # absorbed attention in float32 (float64 for float64) over the written slots only
        wd = torch.float64 if x.dtype == torch.float64 else torch.float32
        T = int(cache.seq_lens.max())
        t = torch.arange(T, device=x.device)
        written = t[None, :] < cache.seq_lens[:, None]
        kv_all = torch.where(written[..., None], cache.kv[:, :T], 0).to(wd)
        w_kvb = weights["kv_b_proj.weight"].view(H, nope + cfg.v_head_dim, L).to(wd)
        q_lat = torch.einsum("bshd,hdl->bshl", q[..., :nope].to(wd), w_kvb[:, :nope])
        scores = (torch.einsum("bshl,btl->bhst", q_lat, kv_all[..., :L])
                  + torch.einsum("bshr,btr->bhst", q_pe.to(wd), kv_all[..., L:])) * scale
        mask = (t[None, None, :] <= positions[:, :, None]) & written[:, None, :]
        p = torch.softmax(scores.masked_fill(~mask[:, None], -math.inf), -1).nan_to_num(0.0)
        o = torch.einsum("bhst,btl->bshl", p, kv_all[..., :L])
        o = torch.einsum("bshl,hvl->bshv", o, w_kvb[:, nope:]).to(x.dtype).reshape(B, S, -1)
        return o @ weights["o_proj.weight"].T
