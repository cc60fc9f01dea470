"""A correct MLA backend in the style of DeepSeek-V3's reference ``inference/model.py`` (absorb mode).

Written for this suite's meta tests after reading DeepSeek-V3's ``inference/model.py``; the code is
our own, kept close to that file's structure and names so it behaves as the reference does where the
published conventions differ:

* ``precompute_freqs_cis`` gives complex ``freqs_cis`` with YaRN's frequency ramp and **no cos/sin
  factor** (the reference has a single ``mscale``; transformers / DeepSeek-V2 modeling multiply cos/sin
  by mscale(factor, mscale) / mscale(factor, mscale_all_dim), which is 1 whenever the two are equal, as
  in every published DeepSeek config);
* ``apply_rotary_emb`` rotates interleaved pairs through ``torch.view_as_complex``;
* ``softmax_scale = qk_head_dim ** -0.5 * mscale ** 2`` when YaRN is on, with mscale =
  0.1 * mscale_all_dim * ln(factor) + 1 (the config's ``mscale_all_dim`` plays the reference's single
  ``mscale``);
* YaRN is on when ``max_seq_len > original_seq_len``, so, like the reference, the cache over-allocates:
  ``kv_cache`` [B, max_seq_len, kv_lora_rank] (the kv_norm-ed latent) and ``pe_cache``
  [B, max_seq_len, qk_rope_head_dim] (the rotated k_pe), max_seq_len = max(4 x capacity,
  original_max_position_embeddings + 1).

Unlike the reference (one ``start_pos`` for the whole batch), rows advance independently here (the
suite's contract: varlen batches, right padding), so attention runs row by row over exactly the slots
each row has written; slots past a row's ``seq_lens`` are never read. The RoPE table is computed in
float64 and cast to the working precision (the reference computes it in float32).

Base contract only; depends on torch and the standard library, nothing from ``mla_conformance``.
"""

from __future__ import annotations

import math
from typing import Mapping, Optional

import torch


def _yarn(config) -> Optional[dict]:
    rs = getattr(config, "rope_scaling", None)
    if not rs:
        return None
    rs = dict(rs)
    return rs if rs.get("rope_type", rs.get("type")) == "yarn" else None


def precompute_freqs_cis(config, max_seq_len: int, device=None) -> torch.Tensor:
    """Complex exponentials [max_seq_len, qk_rope_head_dim / 2] (complex128), YaRN ramp, no magnitude."""
    dim = config.qk_rope_head_dim
    base = float(config.rope_theta)
    yarn = _yarn(config)

    def find_correction_dim(num_rotations, dim, base, max_seq_len):
        return dim * math.log(max_seq_len / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    def find_correction_range(low_rot, high_rot, dim, base, max_seq_len):
        low = math.floor(find_correction_dim(low_rot, dim, base, max_seq_len))
        high = math.ceil(find_correction_dim(high_rot, dim, base, max_seq_len))
        return max(low, 0), min(high, dim - 1)

    def linear_ramp_factor(min, max, dim):
        if min == max:
            max += 0.001
        linear_func = (torch.arange(dim, dtype=torch.float64) - min) / (max - min)
        return torch.clamp(linear_func, 0, 1)

    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if yarn is not None:
        original_seq_len = int(yarn["original_max_position_embeddings"])
        if max_seq_len > original_seq_len:
            factor = float(yarn["factor"])
            low, high = find_correction_range(float(yarn.get("beta_fast") or 32), float(yarn.get("beta_slow") or 1),
                                              dim, base, original_seq_len)
            smooth = 1 - linear_ramp_factor(low, high, dim // 2)
            freqs = freqs / factor * (1 - smooth) + freqs * smooth
    t = torch.arange(max_seq_len, dtype=torch.float64)
    freqs = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(freqs), freqs).to(device)


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """x [S, H, rope] rotated by freqs_cis [S, rope/2], interleaved pairs as complex numbers."""
    dtype = x.dtype
    work = torch.float64 if dtype == torch.float64 else torch.float32
    x = torch.view_as_complex(x.to(work).reshape(*x.shape[:-1], -1, 2).contiguous())
    freqs_cis = freqs_cis.to(x.dtype).view(x.size(0), 1, x.size(-1))
    y = torch.view_as_real(x * freqs_cis).flatten(-2)
    return y.to(dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(work)
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class V3Cache:
    """kv_cache [B, max_seq_len, kv_lora_rank] and pe_cache [B, max_seq_len, rope], as the reference's MLA."""

    cache_format = "latent"

    def __init__(self, config, batch_size: int, capacity: int, dtype, device):
        self.config = config
        self.batch_size, self.capacity = int(batch_size), int(capacity)
        yarn = _yarn(config)
        original = int(yarn["original_max_position_embeddings"]) if yarn else 0
        self.max_seq_len = max(4 * self.capacity, original + 1)
        self.kv_cache = torch.zeros(batch_size, self.max_seq_len, config.kv_lora_rank, dtype=dtype, device=device)
        self.pe_cache = torch.zeros(batch_size, self.max_seq_len, config.qk_rope_head_dim, dtype=dtype,
                                    device=device)
        self.seq_lens = torch.zeros(batch_size, dtype=torch.int64, device=device)

    def tensors(self) -> dict:
        return {"kv_cache": self.kv_cache, "pe_cache": self.pe_cache}

    def allocated_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def active_nbytes(self) -> int:
        per_token = (self.kv_cache.shape[-1] + self.pe_cache.shape[-1]) * self.kv_cache.element_size()
        return int(self.seq_lens.sum()) * per_token


class DeepSeekV3StyleMLA:
    """DeepSeek-V3 reference MLA (absorb mode) behind the suite's base contract."""

    name = "deepseek-v3-style"
    cache_format = "latent"

    def __init__(self) -> None:
        self._freqs: dict = {}

    def unsupported_reason(self, config, *, dtype, device, kv_codec) -> Optional[str]:
        if getattr(config, "index_topk", None) is not None:
            return ("the DeepSeek-V3-style backend implements dense MLA, not DeepSeek Sparse Attention "
                    f"(index_topk {config.index_topk})")
        if kv_codec != "none":
            return f"the DeepSeek-V3-style cache stores the plain latent only (kv_codec {kv_codec!r})"
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            return f"needs a floating-point dtype, got {dtype!r}"
        rs = getattr(config, "rope_scaling", None)
        if rs and _yarn(config) is None:
            return "only YaRN rope_scaling is implemented (as in DeepSeek-V3's reference)"
        return None

    def new_cache(self, config, *, batch_size, capacity, dtype, device, kv_codec="none"):
        reason = self.unsupported_reason(config, dtype=dtype, device=device, kv_codec=kv_codec)
        if reason:
            raise ValueError(reason)
        return V3Cache(config, batch_size, capacity, dtype, device)

    # -------------------------------------------------------------------------------------------
    def _freqs_cis(self, cache: V3Cache) -> torch.Tensor:
        cfg = cache.config
        yarn = _yarn(cfg)
        key = (cfg.qk_rope_head_dim, float(cfg.rope_theta), tuple(sorted((yarn or {}).items())),
               cache.max_seq_len, str(cache.kv_cache.device))
        if key not in self._freqs:
            self._freqs[key] = precompute_freqs_cis(cfg, cache.max_seq_len, cache.kv_cache.device)
        return self._freqs[key]

    @staticmethod
    def _softmax_scale(cfg, max_seq_len: int) -> float:
        qk_head_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        softmax_scale = qk_head_dim ** -0.5
        yarn = _yarn(cfg)
        if yarn is not None and max_seq_len > int(yarn["original_max_position_embeddings"]):
            mscale = 0.1 * float(yarn.get("mscale_all_dim") or 0.0) * math.log(float(yarn["factor"])) + 1.0
            softmax_scale = softmax_scale * mscale * mscale
        return softmax_scale

    def attend(self, weights: Mapping[str, torch.Tensor], hidden_states: torch.Tensor, positions: torch.Tensor,
               cache: V3Cache, lengths: Optional[torch.Tensor] = None) -> torch.Tensor:
        cfg = cache.config
        x = hidden_states
        bsz, seqlen, _ = x.shape
        if bsz != cache.batch_size:
            raise ValueError(f"batch {bsz} != cache batch_size {cache.batch_size}")
        n_heads, kv_lora_rank = cfg.num_attention_heads, cfg.kv_lora_rank
        qk_nope_head_dim, qk_rope_head_dim, v_head_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        lengths = (torch.full((bsz,), seqlen, dtype=torch.int64) if lengths is None
                   else lengths.to("cpu", torch.int64))
        start = cache.seq_lens.to("cpu")
        if bool(((start + lengths) > cache.max_seq_len).any()):
            raise ValueError(f"writing {lengths.tolist()} tokens onto {start.tolist()} exceeds max_seq_len "
                             f"{cache.max_seq_len}")
        freqs_cis = self._freqs_cis(cache)
        softmax_scale = self._softmax_scale(cfg, cache.max_seq_len)
        sm_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32

        if "q_proj.weight" in weights:
            q = x @ weights["q_proj.weight"].T
        else:
            q = rms_norm(x @ weights["q_a_proj.weight"].T, weights["q_a_layernorm.weight"], cfg.rms_norm_eps)
            q = q @ weights["q_b_proj.weight"].T
        q = q.view(bsz, seqlen, n_heads, qk_head_dim)
        q_nope_all, q_pe_all = torch.split(q, [qk_nope_head_dim, qk_rope_head_dim], dim=-1)
        kv_all = x @ weights["kv_a_proj_with_mqa.weight"].T
        kv_all, k_pe_all = torch.split(kv_all, [kv_lora_rank, qk_rope_head_dim], dim=-1)
        wkv_b = weights["kv_b_proj.weight"].view(n_heads, -1, kv_lora_rank)

        out = torch.zeros(bsz, seqlen, n_heads * v_head_dim, dtype=x.dtype, device=x.device)
        for b in range(bsz):  # rows advance independently: one reference forward per row
            n, start_pos = int(lengths[b]), int(start[b])
            if n == 0:
                continue
            end_pos = start_pos + n
            pos = positions[b, :n].to(torch.int64)
            if pos.tolist() != list(range(start_pos, end_pos)):
                raise ValueError(f"row {b}: positions {pos.tolist()} != cache.seq_lens + i ({start_pos}..)")
            fc = freqs_cis[start_pos:end_pos]
            q_pe = apply_rotary_emb(q_pe_all[b, :n], fc)                                 # [n, H, rope]
            k_pe = apply_rotary_emb(k_pe_all[b, :n].unsqueeze(1), fc).squeeze(1)          # [n, rope]
            q_nope = torch.einsum("shd,hdc->shc", q_nope_all[b, :n], wkv_b[:, :qk_nope_head_dim])
            cache.kv_cache[b, start_pos:end_pos] = rms_norm(kv_all[b, :n], weights["kv_a_layernorm.weight"],
                                                            cfg.rms_norm_eps).to(cache.kv_cache.dtype)
            cache.pe_cache[b, start_pos:end_pos] = k_pe.to(cache.pe_cache.dtype)
            kv = cache.kv_cache[b, :end_pos].to(x.dtype)   # only this row's written slots
            pe = cache.pe_cache[b, :end_pos].to(x.dtype)
            scores = (torch.einsum("shc,tc->sht", q_nope, kv) +
                      torch.einsum("shr,tr->sht", q_pe, pe)) * softmax_scale
            if n > 1:
                mask = torch.full((n, end_pos), float("-inf"), device=x.device).triu_(start_pos + 1)
                scores = scores + mask.unsqueeze(1).to(scores.dtype)
            scores = scores.softmax(dim=-1, dtype=sm_dtype).type_as(x)
            o = torch.einsum("sht,tc->shc", scores, kv)
            o = torch.einsum("shc,hdc->shd", o, wkv_b[:, -v_head_dim:])
            out[b, :n] = o.flatten(1)
        cache.seq_lens += lengths.to(cache.seq_lens.device)
        return out @ weights["o_proj.weight"].T
