"""An independent MLA backend, used to cross-check the project's reference.

This module was written from the published DeepSeek-V2 Multi-head Latent
Attention equations (absorbed form: queries are projected into the latent
space, the cache holds only the normalised KV latent plus the rotated shared
RoPE key), independently of ``mla_conformance``'s reference implementation;
nothing from that package is read or imported here.  It depends only on torch
and the standard library.

Precision policy:
  * projections (q / kv_a / o_proj) run in the input dtype; RMSNorm in float32
    and cast back before the weight multiply (Hugging Face convention);
  * RoPE rotation runs in float32 (float64 for float64 inputs) with angles
    computed in float64, and is cast back to the input dtype;
  * the attention core (absorption, score matmuls, p @ latent, W_UV) runs in
    float32 for half types (float16 / bfloat16) and in the input dtype
    otherwise; softmax runs in float32, or float64 for float64 inputs.

Run ``python independent_backend.py`` for a self-check against a
straightforward expanded-K/V float64 computation.
"""
from __future__ import annotations

import math
from typing import Mapping, Optional

import torch


def _m(scale: float, k: float) -> float:
    """YaRN magnitude correction m(s, k) = 0.1 k ln s + 1 (1 when s <= 1)."""
    return 0.1 * k * math.log(scale) + 1.0 if scale > 1 else 1.0


def _rope_type(rs) -> Optional[str]:
    return None if not rs else rs.get("rope_type", rs.get("type"))


def _rope_params(config):
    """Return (inv_freq float64 [rope/2], attention_factor, softmax_scale)."""
    rope, theta = config.qk_rope_head_dim, float(config.rope_theta)
    base = theta ** (-torch.arange(0, rope, 2, dtype=torch.float64) / rope)
    scale = (config.qk_nope_head_dim + rope) ** -0.5
    rs = config.rope_scaling
    if not rs:
        return base, 1.0, scale
    if _rope_type(rs) != "yarn":
        raise ValueError(f"rope_scaling type {_rope_type(rs)!r} is not supported (only 'yarn')")
    factor = float(rs["factor"])
    orig = float(rs["original_max_position_embeddings"])

    def d(r: float) -> float:  # dimension index whose wavelength makes r turns in orig
        return rope * math.log(orig / (r * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(d(float(rs.get("beta_fast", 32)))), 0)
    high = min(math.ceil(d(float(rs.get("beta_slow", 1)))), rope - 1)
    if low == high:
        high += 0.001
    i = torch.arange(rope // 2, dtype=torch.float64)
    ramp = ((i - low) / (high - low)).clamp(0.0, 1.0)
    inv_freq = (base / factor) * ramp + base * (1.0 - ramp)
    mscale, mscale_all = rs.get("mscale"), rs.get("mscale_all_dim")
    if mscale and mscale_all:
        attention_factor = _m(factor, float(mscale)) / _m(factor, float(mscale_all))
    else:
        attention_factor = _m(factor, 1.0)
    if mscale_all:
        scale *= _m(factor, float(mscale_all)) ** 2
    return inv_freq, attention_factor, scale


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float() if x.dtype != torch.float64 else x
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE: pair (2i, 2i+1) rotated by angle i. cos/sin broadcast to [..., rope/2]."""
    wd = torch.float64 if x.dtype == torch.float64 else torch.float32
    pairs = x.to(wd).unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    cos, sin = cos.to(wd), sin.to(wd)
    out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1)
    return out.flatten(-2).to(x.dtype)


class LatentCache:
    """One preallocated buffer [B, capacity, kv_lora_rank + rope]: latent c, then rotated k_pe."""

    def __init__(self, config, batch_size: int, capacity: int, dtype, device):
        if batch_size < 1 or capacity < 0:
            raise ValueError(f"invalid cache shape batch_size={batch_size}, capacity={capacity}")
        self.config = config
        self.batch_size, self.capacity = int(batch_size), int(capacity)
        self.kv_lora_rank = config.kv_lora_rank
        width = config.kv_lora_rank + config.qk_rope_head_dim
        self.kv = torch.zeros(batch_size, capacity, width, dtype=dtype, device=device)
        self.seq_lens = torch.zeros(batch_size, dtype=torch.int64, device=device)

    def tensors(self) -> dict:
        return {"latent_kv": self.kv}

    def allocated_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def active_nbytes(self) -> int:
        return int(self.seq_lens.sum()) * self.kv.shape[-1] * self.kv.element_size()

    def append(self, c: torch.Tensor, k_pe: torch.Tensor, lengths: torch.Tensor) -> None:
        """Append the first lengths[b] tokens of c [B,S,kv_lora] / k_pe [B,S,rope] to each row."""
        new_lens = self.seq_lens + lengths
        if bool((new_lens > self.capacity).any()):
            raise ValueError(
                f"cache capacity exceeded: writing {lengths.tolist()} tokens onto "
                f"{self.seq_lens.tolist()} stored would exceed capacity {self.capacity}")
        for b in range(self.batch_size):
            s, n = int(self.seq_lens[b]), int(lengths[b])
            self.kv[b, s:s + n, :self.kv_lora_rank] = c[b, :n].to(self.kv.dtype)
            self.kv[b, s:s + n, self.kv_lora_rank:] = k_pe[b, :n].to(self.kv.dtype)
        self.seq_lens.copy_(new_lens)


class IndependentMLA:
    name = "independent-absorbed"
    cache_format = "latent"

    def unsupported_reason(self, config, *, dtype, device, kv_codec) -> Optional[str]:
        if getattr(config, "index_topk", None) is not None:
            return ("this backend implements dense MLA, not DeepSeek Sparse Attention "
                    f"(index_topk {config.index_topk})")
        if kv_codec != "none":
            return (f"this backend only stores the uncompressed latent "
                    f"(kv_codec {kv_codec!r} unsupported)")
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            return f"this backend needs a floating-point dtype, got {dtype!r}"
        if config.rope_scaling and _rope_type(config.rope_scaling) != "yarn":
            return f"rope_scaling type {_rope_type(config.rope_scaling)!r} unsupported (only 'yarn')"
        return None

    def new_cache(self, config, *, batch_size, capacity, dtype, device, kv_codec="none"):
        reason = self.unsupported_reason(config, dtype=dtype, device=device, kv_codec=kv_codec)
        if reason is not None:
            raise ValueError(reason)
        return LatentCache(config, batch_size, capacity, dtype, device)

    def attend(self, weights: Mapping[str, torch.Tensor], hidden_states: torch.Tensor,
               positions: torch.Tensor, cache: LatentCache,
               lengths: Optional[torch.Tensor] = None) -> torch.Tensor:
        cfg, x = cache.config, hidden_states
        B, S, _ = x.shape
        H, nope, rope = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        v_dim, kv_lora, eps = cfg.v_head_dim, cfg.kv_lora_rank, cfg.rms_norm_eps
        dtype, dev = x.dtype, x.device
        if B != cache.batch_size:
            raise ValueError(f"batch {B} does not match cache batch_size {cache.batch_size}")
        positions = positions.to(device=dev, dtype=torch.int64)
        if lengths is None:
            lengths = torch.full((B,), S, dtype=torch.int64, device=dev)
        lengths = lengths.to(device=dev, dtype=torch.int64)
        if bool(((lengths < 0) | (lengths > S)).any()):
            raise ValueError(f"lengths {lengths.tolist()} must lie in [0, {S}]")
        idx = torch.arange(S, device=dev)
        valid = idx[None, :] < lengths[:, None]                             # [B, S]
        expected = cache.seq_lens[:, None] + idx[None, :]
        if bool((valid & (positions != expected)).any()):
            raise ValueError("positions must equal cache.seq_lens[b] + i for valid tokens")

        # --- projections (input dtype) ---
        if "q_proj.weight" in weights:
            q = x @ weights["q_proj.weight"].T
        else:
            q_a = _rms_norm(x @ weights["q_a_proj.weight"].T, weights["q_a_layernorm.weight"], eps)
            q = q_a @ weights["q_b_proj.weight"].T
        q = q.view(B, S, H, nope + rope)
        q_nope, q_pe = q[..., :nope], q[..., nope:]
        kv_a = x @ weights["kv_a_proj_with_mqa.weight"].T
        c = _rms_norm(kv_a[..., :kv_lora], weights["kv_a_layernorm.weight"], eps)
        k_pe = kv_a[..., kv_lora:]

        # --- RoPE (interleaved pairs, YaRN-aware) ---
        inv_freq, attn_factor, scale = _rope_params(cfg)
        angles = positions.to(torch.float64)[..., None] * inv_freq.to(dev)   # [B, S, rope/2]
        cos, sin = torch.cos(angles) * attn_factor, torch.sin(angles) * attn_factor
        q_pe = _rotate(q_pe, cos[:, :, None, :], sin[:, :, None, :])
        k_pe = _rotate(k_pe, cos, sin)

        cache.append(c, k_pe, lengths)   # raises before mutating when over capacity

        # --- absorbed attention over the cache ---
        cd = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        sd = torch.float64 if dtype == torch.float64 else torch.float32
        T = int(cache.seq_lens.max())
        # slots past a row's length were never written by this row: select zeros there (whatever the
        # allocation left in them, NaN included, must not reach a product)
        written = torch.arange(T, device=dev)[None, :, None] < cache.seq_lens[:, None, None]
        stored = torch.where(written, cache.kv[:, :T], torch.zeros((), dtype=cache.kv.dtype, device=dev)).to(cd)
        c_all, kpe_all = stored[..., :kv_lora], stored[..., kv_lora:]
        w_kvb = weights["kv_b_proj.weight"].view(H, nope + v_dim, kv_lora).to(cd)
        w_uk, w_uv = w_kvb[:, :nope], w_kvb[:, nope:]                        # [H,nope,L],[H,v,L]
        q_lat = torch.einsum("bshd,hdl->bshl", q_nope.to(cd), w_uk)
        scores = (torch.einsum("bshl,btl->bhst", q_lat, c_all)
                  + torch.einsum("bshr,btr->bhst", q_pe.to(cd), kpe_all))
        t = torch.arange(T, device=dev)
        mask = (t[None, None, :] <= positions[:, :, None]) & (t[None, None, :] < cache.seq_lens[:, None, None])
        scores = scores.to(sd) * scale
        scores = scores.masked_fill(~mask[:, None], float("-inf"))
        p = torch.softmax(scores, dim=-1)
        p = torch.where(mask.any(-1)[:, None, :, None], p, torch.zeros_like(p))  # rows with no key
        o_lat = torch.einsum("bhst,btl->bshl", p.to(cd), c_all)
        o = torch.einsum("bshl,hvl->bshv", o_lat, w_uv).to(dtype).reshape(B, S, H * v_dim)
        return o @ weights["o_proj.weight"].T


BACKEND = IndependentMLA()


if __name__ == "__main__":
    from types import SimpleNamespace

    # YaRN correction range for DeepSeek-V2's published settings: low = 10, high = 23.
    ds = SimpleNamespace(qk_rope_head_dim=64, qk_nope_head_dim=128, rope_theta=10000.0, rope_scaling=dict(
        rope_type="yarn", factor=40, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
        mscale=0.707, mscale_all_dim=0.707))
    inv, af, _ = _rope_params(ds)
    base = 10000.0 ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    assert torch.equal(inv[:10], base[:10]) and torch.allclose(inv[23:], base[23:] / 40) and abs(af - 1) < 1e-12

    def make(q_lora, rope_scaling, seed):
        g = torch.Generator().manual_seed(seed)
        cfg = SimpleNamespace(hidden_size=48, num_attention_heads=3, q_lora_rank=q_lora, kv_lora_rank=20,
                              qk_nope_head_dim=8, qk_rope_head_dim=6, v_head_dim=10, rms_norm_eps=1e-6,
                              rope_theta=10000.0, rope_scaling=rope_scaling, max_position_embeddings=256)
        hid, Hn, dqk = 48, 3, 14

        def lin(o, i):
            return torch.randn(o, i, generator=g, dtype=torch.float64) / math.sqrt(i)
        w = {"kv_a_proj_with_mqa.weight": lin(20 + 6, hid),
             "kv_a_layernorm.weight": 1 + 0.1 * torch.randn(20, generator=g, dtype=torch.float64),
             "kv_b_proj.weight": lin(Hn * (8 + 10), 20), "o_proj.weight": lin(hid, Hn * 10)}
        if q_lora is None:
            w["q_proj.weight"] = lin(Hn * dqk, hid)
        else:
            w.update({"q_a_proj.weight": lin(q_lora, hid), "q_b_proj.weight": lin(Hn * dqk, q_lora),
                      "q_a_layernorm.weight": 1 + 0.1 * torch.randn(q_lora, generator=g, dtype=torch.float64)})
        return cfg, w, g

    def expanded(cfg, w, xs):
        """Straightforward float64 MLA on one row's full token sequence xs [N, hidden]."""
        N, Hn, nope, r, vd, L = xs.shape[0], cfg.num_attention_heads, 8, 6, 10, 20
        rms = lambda a, ww: ww * a / torch.sqrt(a.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)
        if "q_proj.weight" in w:
            q = xs @ w["q_proj.weight"].T
        else:
            q = rms(xs @ w["q_a_proj.weight"].T, w["q_a_layernorm.weight"]) @ w["q_b_proj.weight"].T
        q = q.view(N, Hn, nope + r)
        kv = xs @ w["kv_a_proj_with_mqa.weight"].T
        c, kpe = rms(kv[:, :L], w["kv_a_layernorm.weight"]), kv[:, L:]
        inv_freq, af, scale = _rope_params(cfg)
        rot = torch.polar(torch.full((N, r // 2), af, dtype=torch.float64),
                          torch.arange(N, dtype=torch.float64)[:, None] * inv_freq)
        cplx = lambda a, f: torch.view_as_real(torch.view_as_complex(a.reshape(*a.shape[:-1], -1, 2).contiguous()) * f).flatten(-2)
        qpe, kpe = cplx(q[..., nope:], rot[:, None]), cplx(kpe, rot)
        wkv = w["kv_b_proj.weight"].view(Hn, nope + vd, L)
        k_nope = torch.einsum("nl,hdl->nhd", c, wkv[:, :nope])
        v = torch.einsum("nl,hvl->nhv", c, wkv[:, nope:])
        k = torch.cat([k_nope, kpe[:, None].expand(N, Hn, r)], -1)
        qf = torch.cat([q[..., :nope], qpe], -1)
        s = torch.einsum("qhd,khd->hqk", qf, k) * scale
        s = s.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), float("-inf"))
        o = torch.einsum("hqk,khv->qhv", torch.softmax(s, -1), v).reshape(N, Hn * vd)
        return o @ w["o_proj.weight"].T

    yarn = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=8, beta_fast=32, beta_slow=1,
                mscale=1.0, mscale_all_dim=0.8)
    cases = [("q_lora+yarn", 16, yarn), ("q_proj+plain", None, None),
             ("q_lora+yarn(no mscale)", 12, dict(yarn, mscale=None, mscale_all_dim=None))]
    for label, q_lora, rs in cases:
        cfg, w, g = make(q_lora, rs, seed=len(label))
        # row 0 gets 5 prefill + 4 decode tokens; row 1 gets 3 prefill, then decodes with one skipped step.
        steps = [(torch.tensor([5, 3]), 5), (torch.tensor([1, 1]), 1), (torch.tensor([1, 0]), 1),
                 (torch.tensor([1, 1]), 1), (torch.tensor([2, 2]), 2)]
        total = [int(sum(l[b] for l, _ in steps)) for b in range(2)]
        xs = torch.randn(2, max(total), 48, generator=g, dtype=torch.float64)
        refs = [expanded(cfg, w, xs[b, :total[b]]) for b in range(2)]
        for dt in (torch.float64, torch.float32, torch.bfloat16):
            wd = {k: t.to(dt) for k, t in w.items()}
            cache = BACKEND.new_cache(cfg, batch_size=2, capacity=max(total), dtype=dt, device="cpu")
            assert cache.allocated_nbytes() == 2 * max(total) * 26 * cache.kv.element_size()
            err, outs = 0.0, [[], []]
            for lens, S in steps:
                pos = cache.seq_lens[:, None] + torch.arange(S)[None]
                xb = torch.stack([torch.cat([xs[b, int(cache.seq_lens[b]):int(cache.seq_lens[b]) + int(lens[b])],
                                             torch.randn(S - int(lens[b]), 48, dtype=torch.float64)]) for b in range(2)])
                start = cache.seq_lens.clone()
                out = BACKEND.attend(wd, xb.to(dt), pos, cache, lens)
                assert out.dtype == dt and bool(torch.isfinite(out).all())
                for b in range(2):
                    n, s0 = int(lens[b]), int(start[b])
                    outs[b].append(out[b, :n])
                    err = max(err, (out[b, :n].double() - refs[b][s0:s0 + n]).abs().max().item() if n else 0.0)
            assert cache.seq_lens.tolist() == total
            assert cache.active_nbytes() == sum(total) * 26 * cache.kv.element_size()
            try:
                BACKEND.attend(wd, xs[:, :1].to(dt), cache.seq_lens[:, None].clone(), cache)
                raise AssertionError("capacity overflow not detected")
            except ValueError:
                assert cache.seq_lens.tolist() == total
            # One-shot prefill of the whole (right-padded) sequences must match the incremental run.
            one = BACKEND.new_cache(cfg, batch_size=2, capacity=max(total), dtype=dt, device="cpu")
            full = BACKEND.attend(wd, xs.to(dt), torch.arange(max(total))[None].repeat(2, 1), one, torch.tensor(total))
            inc = max((full[b, :total[b]].double() - torch.cat(outs[b]).double()).abs().max().item() for b in range(2))
            print(f"{label:24s} {str(dt):15s} max|absorbed - expanded f64| = {err:.3e}   "
                  f"max|incremental - one-shot| = {inc:.3e}")
            bound = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 0.1}[dt]
            assert err < bound and inc < bound, (label, dt, err, inc)
    print("reason:", BACKEND.unsupported_reason(cfg, dtype=torch.float32, device="cpu", kv_codec="fp8"))
    print("self-check passed")
