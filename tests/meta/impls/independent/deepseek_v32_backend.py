"""DeepSeek Sparse Attention as DeepSeek ships it: a backend after DeepSeek-V3.2-Exp's reference
``inference/model.py`` (its ``Indexer``, ``act_quant`` and ``fp8_index``), used to check the suite's DSA tests.

Written from that code and the V3.2 paper, independently of ``mla_conformance``'s reference: nothing of the
suite's reference, oracle or cache classes is imported; the MLA RoPE / YaRN helpers come from the sibling
independent backend (also written without the reference). What it shares with DeepSeek's code:

* the cache: the latent c and rotated k_pe in the cache dtype (bf16), the indexer key as float8 e4m3 with one
  float32 scale per block of 128 values (``k_cache`` / ``k_scale_cache``): 1,152 + 128 + 4 = 1,284 B per token
  at V3.2 dims, declared ``indexer_format = "fp8-e4m3-block128"``;
* the indexer: q from the q_lora latent (``wq_b``), k = LayerNorm(``wk`` x), RoPE on the first
  qk_rope_head_dim dims, a Hadamard rotation (``rotate_activation``), then ``act_quant`` of q and k per block of
  128 (scale = amax / 448, rounded up to a power of two: ``scale_fmt = "ue8m0"``), and ``fp8_index``'s score
  sum_h relu(q8 . k8) x w_h x q_scale_h x d^-1/2 x k_scale, w = weights_proj(x) x n_heads^-1/2;
* the top-min(index_topk, len) selection per query, causal, and MLA over the selected keys only.

``rope_interleave = None`` follows the config's ``indexer_rope_interleave`` (DeepSeek-V3.2: half-split pairs,
as DeepSeek's code since its fix of 2025-11-18 calls ``apply_rotary_emb(..., interleaved=False)``). The
variants below fix it: the code before that fix (interleaved pairs on a V3.2 config, the realistic bug), and a
GLM-5-style backend whose indexer always rotates interleaved pairs and says so for configs declaring otherwise.
"""
from __future__ import annotations

from typing import Optional

import torch

try:
    from .backend import _rms_norm, _rope_params, _rotate
except ImportError:  # loaded by path (--mla-backend tests/meta/impls/independent/deepseek_v32_backend.py:NAME): no parent package
    import importlib.util
    import sys
    from pathlib import Path

    _name = "_mla_meta_independent_backend"
    if _name not in sys.modules:
        _spec = importlib.util.spec_from_file_location(_name, Path(__file__).with_name("backend.py"))
        sys.modules[_name] = importlib.util.module_from_spec(_spec)
        _spec.loader.exec_module(sys.modules[_name])
    _rms_norm, _rope_params, _rotate = (getattr(sys.modules[_name], n) for n in ("_rms_norm", "_rope_params", "_rotate"))

FP8_MAX = 448.0
BLOCK = 128


def _rotate_half_split(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's apply_rotary_emb(..., interleaved=False): pairs (x[i], x[i + r/2]) rotated by angle i."""
    shape = x.shape
    y = x.float().view(*shape[:-1], 2, -1).transpose(-1, -2).contiguous()   # [..., r/2, 2]: (x[i], x[i + r/2])
    y = _rotate(y.flatten(-2), cos, sin).float().view(*shape[:-1], -1, 2)
    return torch.cat([y[..., 0], y[..., 1]], dim=-1).to(x.dtype)


def _hadamard(x: torch.Tensor) -> torch.Tensor:
    """rotate_activation: the Walsh-Hadamard transform (natural order) x d^-1/2 along the last dim, in float32."""
    d = x.shape[-1]
    y = x.float()
    h = 1
    while h < d:
        y = y.view(*x.shape[:-1], d // (2 * h), 2, h)
        y = torch.cat([y[..., 0, :] + y[..., 1, :], y[..., 0, :] - y[..., 1, :]], dim=-1)
        h *= 2
    return (y.reshape(x.shape) * d ** -0.5).to(x.dtype)


def _act_quant(x: torch.Tensor):
    """act_quant(x, 128, "ue8m0"): (e4m3 values, float32 scales [..., d / 128])."""
    xb = x.float().unflatten(-1, (-1, BLOCK))
    amax = xb.abs().amax(-1, keepdim=True).clamp_min(1e-4)
    s = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
    q = (xb / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.flatten(-2), s.squeeze(-1)


class V32Cache:
    """kv [B, cap, kv_lora + rope] (cache dtype), index_k [B, cap, d] float8_e4m3fn, index_k_scale
    [B, cap, d / 128] float32 -- DeepSeek's kv_cache / pe_cache and the indexer's k_cache / k_scale_cache."""

    def __init__(self, config, batch_size, capacity, dtype, device, storage, declared):
        self.config, self.batch_size, self.capacity = config, int(batch_size), int(capacity)
        self.storage = storage            # how the indexer key is stored: "fp8-e4m3-block128" or "bf16"
        if declared is not None:
            self.indexer_format = declared  # the declaration (the suite's checks.INDEXER_FORMATS)
        d = config.index_head_dim
        self.kv = torch.zeros(batch_size, capacity, config.kv_lora_rank + config.qk_rope_head_dim, dtype=dtype,
                              device=device)
        if storage == "fp8-e4m3-block128":
            self.index = {"index_k": torch.zeros(batch_size, capacity, d, dtype=torch.float8_e4m3fn, device=device),
                          "index_k_scale": torch.zeros(batch_size, capacity, d // BLOCK, dtype=torch.float32,
                                                       device=device)}
        else:  # "bf16": the indexer key unquantized
            self.index = {"index_k": torch.zeros(batch_size, capacity, d, dtype=torch.bfloat16, device=device)}
        self.seq_lens = torch.zeros(batch_size, dtype=torch.int64, device=device)
        self.last_topk_indices = None

    def tensors(self) -> dict:
        return {"kv": self.kv, **self.index}

    def allocated_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def active_nbytes(self) -> int:
        per_token = sum(t[0, 0].numel() * t.element_size() for t in self.tensors().values())
        return int(self.seq_lens.sum()) * per_token

    def keys(self, T: int) -> torch.Tensor:
        """The indexer keys of slots 0..T-1 in float32, zeros (selected) at slots no token was written to."""
        written = (torch.arange(T, device=self.kv.device)[None, :] < self.seq_lens[:, None])[..., None]
        if self.storage == "fp8-e4m3-block128":
            k = self.index["index_k"][:, :T].float().unflatten(-1, (-1, BLOCK)) * self.index["index_k_scale"][:, :T, :, None]
            k = k.flatten(-2)
        else:
            k = self.index["index_k"][:, :T].float()
        return torch.where(written, k, torch.zeros((), device=k.device))


class DeepSeekV32Reference:
    name = "deepseek-v32-reference-style"
    sparse_attention = "dsa"
    cache_format = "latent+indexer"
    indexer_format = "fp8-e4m3-block128"   # the declaration
    storage = "fp8-e4m3-block128"          # what the code does
    #: None: the config's indexer_rope_interleave; True / False: fixed (a backend that ignores the config)
    rope_interleave: Optional[bool] = None

    def unsupported_reason(self, config, *, dtype, device, kv_codec="none") -> Optional[str]:
        if getattr(config, "index_topk", None) is None:
            return "DeepSeek-V3.2-style sparse attention only: this config is dense MLA (no index_topk)"
        if kv_codec != "none":
            return f"stores a bf16 latent next to its FP8 indexer key; kv_codec {kv_codec!r} unsupported"
        if self.storage == "fp8-e4m3-block128" and config.index_head_dim % BLOCK:
            return (f"DeepSeek's act_quant / fp8_index quantize the indexer in blocks of {BLOCK}: index_head_dim "
                    f"{config.index_head_dim} is not a multiple")
        if dtype not in (torch.bfloat16, torch.float32):
            return f"runs in bfloat16 (or float32), not {dtype}"
        return None

    def new_cache(self, config, *, batch_size, capacity, dtype, device, kv_codec="none"):
        reason = self.unsupported_reason(config, dtype=dtype, device=device, kv_codec=kv_codec)
        if reason:
            raise ValueError(reason)
        return V32Cache(config, batch_size, capacity, dtype, device, self.storage, self.indexer_format)

    def _interleaved(self, config) -> bool:
        return bool(getattr(config, "indexer_rope_interleave", False)) if self.rope_interleave is None \
            else self.rope_interleave

    def attend(self, weights, hidden_states, positions, cache, lengths=None):
        cfg, x = cache.config, hidden_states
        B, S, _ = x.shape
        H, nope, rope, v_dim = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        kv_lora, eps, dev = cfg.kv_lora_rank, cfg.rms_norm_eps, x.device
        n, d, K = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        positions = positions.to(dev, torch.int64)
        lengths = torch.full((B,), S, device=dev, dtype=torch.int64) if lengths is None else lengths.to(dev, torch.int64)
        new_lens = cache.seq_lens + lengths
        if bool((new_lens > cache.capacity).any()):
            raise ValueError(f"cache overflow: {new_lens.tolist()} for capacity {cache.capacity}")

        # MLA projections (input dtype), RoPE of the MLA query / k_pe in interleaved pairs
        qr = _rms_norm(x @ weights["q_a_proj.weight"].T, weights["q_a_layernorm.weight"], eps)
        q = (qr @ weights["q_b_proj.weight"].T).view(B, S, H, nope + rope)
        q_nope, q_pe = q[..., :nope], q[..., nope:]
        kv_a = x @ weights["kv_a_proj_with_mqa.weight"].T
        c = _rms_norm(kv_a[..., :kv_lora], weights["kv_a_layernorm.weight"], eps)
        inv_freq, attn_factor, scale = _rope_params(cfg)
        angles = positions.double()[..., None] * inv_freq.to(dev)
        cos, sin = torch.cos(angles) * attn_factor, torch.sin(angles) * attn_factor
        q_pe = _rotate(q_pe, cos[:, :, None], sin[:, :, None])
        k_pe = _rotate(kv_a[..., kv_lora:], cos, sin)

        # the indexer (DeepSeek's Indexer.forward)
        iq = (qr @ weights["indexer.wq_b.weight"].T).view(B, S, n, d)
        ik = x @ weights["indexer.wk.weight"].T
        ik = torch.nn.functional.layer_norm(ik.float(), (d,), weights["indexer.k_norm.weight"].float(),
                                            weights["indexer.k_norm.bias"].float(), 1e-6).to(x.dtype)
        rot = _rotate if self._interleaved(cfg) else _rotate_half_split
        iq = torch.cat([rot(iq[..., :rope], cos[:, :, None], sin[:, :, None]), iq[..., rope:]], dim=-1)
        ik = torch.cat([rot(ik[..., :rope], cos, sin), ik[..., rope:]], dim=-1)
        iq, ik = _hadamard(iq), _hadamard(ik)
        hw = (x.float() @ weights["indexer.weights_proj.weight"].float().T) * n ** -0.5 * d ** -0.5   # [B, S, n]
        if cache.storage == "fp8-e4m3-block128":
            q8, q_scale = _act_quant(iq)
            k8, k_scale = _act_quant(ik)
            iq_f = (q8.float().unflatten(-1, (-1, BLOCK)) * q_scale[..., None]).flatten(-2)
        else:
            iq_f = iq.float()

        # write this call's tokens (per row: its own start and length)
        for b in range(B):
            s0, m = int(cache.seq_lens[b]), int(lengths[b])
            if m:
                cache.kv[b, s0:s0 + m, :kv_lora] = c[b, :m].to(cache.kv.dtype)
                cache.kv[b, s0:s0 + m, kv_lora:] = k_pe[b, :m].to(cache.kv.dtype)
                if cache.storage == "fp8-e4m3-block128":
                    cache.index["index_k"][b, s0:s0 + m] = k8[b, :m]
                    cache.index["index_k_scale"][b, s0:s0 + m] = k_scale[b, :m]
                else:
                    cache.index["index_k"][b, s0:s0 + m] = ik[b, :m].to(torch.bfloat16)
        cache.seq_lens = new_lens
        T = int(new_lens.max())
        t = torch.arange(T, device=dev)
        mask = (t[None, None, :] <= positions[:, :, None]) & (t[None, None, :] < new_lens[:, None, None])   # [B, S, T]

        # fp8_index: sum_h relu(q . k) x w_h, -inf where masked; top-min(K, T)
        logits = torch.relu(torch.einsum("bshd,btd->bsht", iq_f, cache.keys(T)))
        index_score = torch.einsum("bsht,bsh->bst", logits, hw).masked_fill(~mask, float("-inf"))
        vals, idx = index_score.topk(min(K, T), dim=-1)
        idx = idx.masked_fill(vals == float("-inf"), -1)
        chosen = torch.zeros(B, S, T + 1, dtype=torch.bool, device=dev)
        chosen.scatter_(-1, torch.where(idx < 0, T, idx), True)
        allowed = mask & chosen[..., :T]
        cache.last_topk_indices = torch.nn.functional.pad(idx, (0, K - idx.shape[-1]), value=-1)

        # absorbed MLA over the selection, float32
        written = (t[None, :] < new_lens[:, None])[..., None]
        stored = torch.where(written, cache.kv[:, :T], torch.zeros((), dtype=cache.kv.dtype, device=dev)).float()
        c_all, kpe_all = stored[..., :kv_lora], stored[..., kv_lora:]
        w_kvb = weights["kv_b_proj.weight"].view(H, nope + v_dim, kv_lora).float()
        q_lat = torch.einsum("bshd,hdl->bshl", q_nope.float(), w_kvb[:, :nope])
        scores = (torch.einsum("bshl,btl->bsht", q_lat, c_all)
                  + torch.einsum("bshr,btr->bsht", q_pe.float(), kpe_all)) * scale
        scores = scores.masked_fill(~allowed[:, :, None, :], float("-inf"))
        p = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)
        o = torch.einsum("bshl,hvl->bshv", torch.einsum("bsht,btl->bshl", p, c_all), w_kvb[:, nope:])
        return o.to(x.dtype).reshape(B, S, H * v_dim) @ weights["o_proj.weight"].T


class DeepSeekV32PreFix(DeepSeekV32Reference):
    """DeepSeek's V3.2-Exp reference before its fix of 2025-11-18: the indexer's RoPE in MLA's interleaved
    pairs on every config (``apply_rotary_emb(q_pe, freqs_cis)``, the default interleaved=True). Wrong on a
    V3.2 config (half-split); its FP8 block-128 indexer as shipped."""

    name = "broken-dsa-v32-prefix-interleaved-fp8"
    rope_interleave = True


class DeepSeekV32PreFixBF16Key(DeepSeekV32PreFix):
    """The same pre-fix interleaved indexer RoPE with the indexer key kept in bf16 (no act_quant): the bug at
    bf16 indexer precision."""

    name = "broken-dsa-v32-prefix-interleaved-bf16"
    indexer_format = storage = "bf16"


class GLMStyleDSA(DeepSeekV32Reference):
    """A GLM-5-style DSA backend: its indexer always rotates interleaved pairs, a model property its configs
    declare (``indexer_rope_interleave``); a config declaring half-split pairs is declined with a sentence."""

    name = "glm-style-dsa"
    rope_interleave = True

    def unsupported_reason(self, config, *, dtype, device, kv_codec="none") -> Optional[str]:
        if getattr(config, "index_topk", None) is not None and not getattr(config, "indexer_rope_interleave", False):
            return ("GLM-style DSA: the indexer rotates interleaved pairs; this config declares half-split pairs "
                    "(indexer_rope_interleave false, DeepSeek-V3.2's)")
        return super().unsupported_reason(config, dtype=dtype, device=device, kv_codec=kv_codec)
