"""The suite's own broken backends: one per bug class seen in real MLA implementations.

Each is the reference backend with exactly one thing wrong, and ``CAUGHT_BY`` names the conformance
check that must *fail* it (an AssertionError verdict; tests/meta/test_meta.py asserts it does);
``ERRORS_BY`` the checks that must report a crash as an error. Cache, byte and contract bugs are in
tests/meta/impls/broken/caches.py; tests/meta/test_kill_matrix.py runs every conformance test on a backend
that must fail it.
"""

from __future__ import annotations

import dataclasses

import torch

from mla_conformance.model import reference as ref
from mla_conformance.impl.backends.reference import ReferenceAbsorbed, ReferenceDSA, ReferenceNaive
from mla_conformance.kv.caches import LatentSlotCache


class _Absorbed(ReferenceAbsorbed):
    """Reference absorbed path with overridable pieces (projection, mixing, cache reads)."""

    def project(self, weights, x, positions, decode: bool):
        return ref.project(weights, x, positions)

    def mix(self, weights, q_nope, q_pe, c, k_pe, allowed):
        return ref.absorbed_scores_and_mix(weights, q_nope, q_pe, c, k_pe, allowed)

    def attend(self, weights, hidden_states, positions, cache, lengths=None):
        lengths, new_lens = cache.write_plan(positions, lengths)
        q_nope, q_pe, c, k_pe = self.project(weights, hidden_states, positions, hidden_states.shape[1] == 1)
        cache.write_latent(c, k_pe, lengths)
        T = int(new_lens.max())
        allowed = self.allowed(cache, lengths, new_lens, hidden_states.shape[1], T)
        c_all, kpe_all = cache.read_latent(T, new_lens)
        out = self.mix(weights, q_nope, q_pe, c_all, kpe_all, allowed)
        cache.commit(new_lens)
        return out.to(hidden_states.dtype)

    def allowed(self, cache, lengths, new_lens, S, T):
        return cache.allowed(lengths, new_lens, S, T)


class WrongSoftmaxScale(_Absorbed):
    """Scales scores by 1/sqrt(qk_nope_head_dim) instead of 1/sqrt(qk_nope + qk_rope) (times mscale^2)."""

    name = "broken-softmax-scale"

    def mix(self, weights, q_nope, q_pe, c, k_pe, allowed):
        cfg = weights.config
        factor = (cfg.qk_head_dim / cfg.qk_nope_head_dim) ** 0.5
        return super().mix(weights, q_nope * factor, q_pe * factor, c, k_pe, allowed)


class MissingMscale(_Absorbed):
    """Forgets YaRN's mscale(factor, mscale_all_dim)^2 on the softmax scale (vLLM/SGLang bug class)."""

    name = "broken-missing-mscale"

    def mix(self, weights, q_nope, q_pe, c, k_pe, allowed):
        cfg = weights.config
        undo = (cfg.qk_head_dim ** -0.5 / cfg.softmax_scale) ** 0.5
        return super().mix(weights, q_nope * undo, q_pe * undo, c, k_pe, allowed)


def _rope_half_split(x, cos, sin):
    """rotate_half layout (pairs i and i + r/2) applied to DeepSeek's interleaved weights."""
    if x.dim() == 4:
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos.float(), sin.float()
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


class RopeLayoutMixup(_Absorbed):
    """Rotates (x[i], x[i + r/2]) pairs (Llama's rotate_half) instead of DeepSeek's interleaved pairs."""

    name = "broken-rope-layout"

    def project(self, weights, x, positions, decode):
        original = ref.apply_rope  # the one pair-layout function project() calls for q_pe and k_pe
        ref.apply_rope = _rope_half_split
        try:
            return ref.project(weights, x, positions)
        finally:
            ref.apply_rope = original


class UnrotatedKpe(_Absorbed):
    """Caches k_pe before RoPE (and never rotates it later)."""

    name = "broken-unrotated-kpe"

    def project(self, weights, x, positions, decode):
        q_nope, q_pe, c, _ = ref.project(weights, x, positions)
        k_pe = (x @ weights["kv_a_proj_with_mqa.weight"].T)[..., weights.config.kv_lora_rank:]
        return q_nope, q_pe, c, k_pe


class LatentBeforeNorm(_Absorbed):
    """Caches the latent before kv_a_layernorm."""

    name = "broken-latent-before-norm"

    def project(self, weights, x, positions, decode):
        q_nope, q_pe, _, k_pe = ref.project(weights, x, positions)
        c = (x @ weights["kv_a_proj_with_mqa.weight"].T)[..., : weights.config.kv_lora_rank]
        return q_nope, q_pe, c, k_pe


class ShiftedDecodePosition(_Absorbed):
    """Rotates decode tokens at position - 1 (off by one between prefill and decode)."""

    name = "broken-decode-position"

    def project(self, weights, x, positions, decode):
        return ref.project(weights, x, positions - 1 if decode else positions)


class NoCausalMask(_Absorbed):
    """Prefill tokens attend to later tokens of the same call."""

    name = "broken-no-causal-mask"

    def allowed(self, cache, lengths, new_lens, S, T):
        t = torch.arange(T, device=new_lens.device)
        return (t[None, None, :] < new_lens[:, None, None]).expand(-1, S, -1)


class CausalExcludesSelf(_Absorbed):
    """The causal mask off by one (key < query, not <=): a query does not see its own token, so position 0 of a
    prefill sees no key and gives exactly 0."""

    name = "broken-causal-excludes-self"

    def allowed(self, cache, lengths, new_lens, S, T):
        allowed = super().allowed(cache, lengths, new_lens, S, T)
        qpos = cache.seq_lens[:, None] + torch.arange(S, device=cache.seq_lens.device)[None, :]
        return allowed & (torch.arange(T, device=qpos.device)[None, None, :] != qpos[:, :, None])


class WrongKvBSlice(_Absorbed):
    """Views kv_b_proj as [nope + v, heads, kv_lora] (wrong axis order), mixing heads' W_UK / W_UV."""

    name = "broken-kv-b-slice"

    def mix(self, weights, q_nope, q_pe, c, k_pe, allowed):
        cfg = weights.config
        w = weights["kv_b_proj.weight"]
        wrong = w.view(-1, cfg.num_attention_heads, cfg.kv_lora_rank).transpose(0, 1).reshape(w.shape)
        tensors = dict(weights)
        tensors["kv_b_proj.weight"] = wrong.contiguous()
        return super().mix(type(weights)(cfg, tensors), q_nope, q_pe, c, k_pe, allowed)


class RowsShareCache(_Absorbed):
    """Every row attends over row 0's cache (a batch-indexing bug)."""

    name = "broken-rows-share-cache"

    def mix(self, weights, q_nope, q_pe, c, k_pe, allowed):
        return super().mix(weights, q_nope, q_pe, c[:1].expand_as(c), k_pe[:1].expand_as(k_pe), allowed)


class RecentWindowOnly(_Absorbed):
    """Reads only the most recent 128 cached tokens (a split-KV / paging bug)."""

    name = "broken-recent-window"

    def allowed(self, cache, lengths, new_lens, S, T):
        allowed = cache.allowed(lengths, new_lens, S, T)
        t = torch.arange(T, device=new_lens.device)
        return allowed & (t[None, None, :] >= new_lens[:, None, None] - 128)


class YarnRampIgnored(_Absorbed):
    """Uses plain RoPE frequencies (theta^-2i/d) where YaRN's interpolation ramp should apply."""

    name = "broken-yarn-ramp"

    def project(self, weights, x, positions, decode):
        plain = dataclasses.replace(weights.config, rope_scaling=None)  # project() reads only RoPE and dims
        return ref.project(type(weights)(plain, dict(weights)), x, positions)


class WideBuffers(ReferenceAbsorbed):
    """Stores fp32 buffers whatever cache dtype was asked for (and reports them honestly)."""

    name = "broken-wide-buffers"

    def new_cache(self, config, *, batch_size, capacity, dtype, device, kv_codec="none"):
        return super().new_cache(config, batch_size=batch_size, capacity=capacity, dtype=torch.float32,
                                 device=device)

    def attend(self, weights, hidden_states, positions, cache, lengths=None):
        w32 = weights.to(torch.float32)
        return super().attend(w32, hidden_states.float(), positions, cache, lengths).to(hidden_states.dtype)


class _LyingCache(LatentSlotCache):
    def active_nbytes(self):
        """Counts the latent but forgets the k_pe bytes."""
        kv = self.tensors()["kv_latent"]
        return int(self.seq_lens.sum()) * kv.shape[-1] * kv.element_size()


class LyingBytes(ReferenceAbsorbed):
    """Byte accounting that lies: active_nbytes() leaves out the rope part."""

    name = "broken-lying-bytes"

    def new_cache(self, config, **kw):
        cache = super().new_cache(config, **kw)
        cache.__class__ = _LyingCache
        return cache


class ExpandedClaimsLatent(ReferenceNaive):
    """Stores the expanded per-head K/V but declares a latent cache (the 'silently expanded' bug)."""

    name = "broken-expanded-claims-latent"
    cache_format = "latent"


class NaNOutput(_Absorbed):
    """Returns NaN in one channel of the first decode step."""

    name = "broken-nan-output"

    def attend(self, weights, hidden_states, positions, cache, lengths=None):
        out = super().attend(weights, hidden_states, positions, cache, lengths)
        if hidden_states.shape[1] == 1:
            out = out.clone()
            out[0, 0, 3] = float("nan")
        return out


class RaisesOnDecode(_Absorbed):
    """Raises inside attend on decode steps."""

    name = "broken-raises"

    def attend(self, weights, hidden_states, positions, cache, lengths=None):
        if hidden_states.shape[1] == 1:
            raise RuntimeError("kernel launch failed: invalid configuration argument")
        return super().attend(weights, hidden_states, positions, cache, lengths)


class WrongShape(_Absorbed):
    """Returns only the last token's output, [B, hidden] instead of [B, S, hidden]."""

    name = "broken-wrong-shape"

    def attend(self, weights, hidden_states, positions, cache, lengths=None):
        return super().attend(weights, hidden_states, positions, cache, lengths)[:, -1]


class WrongDtype(_Absorbed):
    """Returns float32 whatever the input dtype (a kernel's accumulator leaking out)."""

    name = "broken-wrong-dtype"

    def attend(self, weights, hidden_states, positions, cache, lengths=None):
        return super().attend(weights, hidden_states, positions, cache, lengths).float()


#: broken backend class -> the checks (ids in test_meta.CHECKS) that must fail on it
CAUGHT_BY = {
    WrongSoftmaxScale: ["numerics-fp32-tiny-prefill"],
    MissingMscale: ["numerics-fp32-tiny-prefill", "numerics-fp32-lite-prefill_decode"],
    RopeLayoutMixup: ["numerics-fp32-tiny-prefill"],
    UnrotatedKpe: ["numerics-fp32-tiny-prefill"],
    LatentBeforeNorm: ["numerics-fp32-tiny-prefill"],
    ShiftedDecodePosition: ["numerics-fp32-tiny-prefill_decode", "incremental-fp32-tiny"],
    NoCausalMask: ["numerics-fp32-tiny-prefill", "incremental-fp32-tiny"],
    WrongKvBSlice: ["numerics-fp32-tiny-prefill"],
    RowsShareCache: ["numerics-fp32-tiny-varlen_batch", "numerics-bf16-lite-varlen_batch"],
    RecentWindowOnly: ["numerics-fp32-tiny-long_context"],
    YarnRampIgnored: ["numerics-fp32-lite-prefill_decode", "numerics-fp32-tiny-long_context"],
    WideBuffers: ["bytes-bf16-lite"],
    LyingBytes: ["bytes-bf16-lite", "bytes-f32-tiny-batch3"],
    ExpandedClaimsLatent: ["bytes-bf16-lite"],
    NaNOutput: ["numerics-fp32-tiny-prefill_decode"],
}

#: broken backends that crash or break the contract's types: the checks must report an *error*
#: (mla_conformance.errors.BackendError), never a failure verdict about numbers they never got
ERRORS_BY = {
    RaisesOnDecode: ["numerics-fp32-tiny-prefill_decode"],
    WrongShape: ["numerics-fp32-tiny-prefill"],
    WrongDtype: ["numerics-bf16-lite-varlen_batch"],
}


# --- bug classes of mla_conformance.checks.layer.diagnose

from mla_conformance.model.config import yarn_get_mscale  # noqa: E402


class ChunkMaskTopLeft(_Absorbed):
    """Aligns each call's causal mask top-left: query i of a call sees slots <= i, not <= start + i
    (vLLM #24045); a decode step then sees only slot 0. Shows on chunks after the first and on decode."""

    name = "broken-chunk-mask-top-left"

    def allowed(self, cache, lengths, new_lens, S, T):
        dev = new_lens.device
        i = torch.arange(S, device=dev)
        t = torch.arange(T, device=dev)
        return (t[None, None, :] <= i[None, :, None]) & (t[None, None, :] < new_lens[:, None, None])


class SoftmaxScaleFrom576(_Absorbed):
    """Takes the softmax scale from the absorbed width: 1/sqrt(kv_lora + rope) (576 at DeepSeek dims),
    times mscale², instead of 1/sqrt(qk_nope + qk_rope)."""

    name = "broken-softmax-scale-576"

    def mix(self, weights, q_nope, q_pe, c, k_pe, allowed):
        cfg = weights.config
        factor = (cfg.qk_head_dim / cfg.latent_dim) ** 0.5  # scores scale linearly with q
        return super().mix(weights, q_nope * factor, q_pe * factor, c, k_pe, allowed)


class KvBSwapped(_Absorbed):
    """Exchanges W_UK and W_UV (kv_b_proj's first qk_nope rows used as values, the last v rows as keys);
    needs qk_nope_head_dim == v_head_dim, as in every DeepSeek config."""

    name = "broken-kv-b-swapped"

    def mix(self, weights, q_nope, q_pe, c, k_pe, allowed):
        cfg = weights.config
        w = weights["kv_b_proj.weight"]
        wkv = w.view(cfg.num_attention_heads, -1, cfg.kv_lora_rank)
        n = cfg.qk_nope_head_dim
        tensors = dict(weights)
        tensors["kv_b_proj.weight"] = torch.cat([wkv[:, n:], wkv[:, :n]], dim=1).reshape(w.shape)
        return super().mix(type(weights)(cfg, tensors), q_nope, q_pe, c, k_pe, allowed)


class MscaleNotAllDim(_Absorbed):
    """Squares YaRN's mscale(factor, mscale) into the softmax scale where mscale(factor, mscale_all_dim)
    belongs (differs only when a config has mscale != mscale_all_dim)."""

    name = "broken-mscale-not-all-dim"

    def mix(self, weights, q_nope, q_pe, c, k_pe, allowed):
        cfg = weights.config
        y = cfg.yarn or {}
        m = yarn_get_mscale(float(y.get("factor", 1.0)), float(y.get("mscale") or 1.0))
        factor = cfg.qk_head_dim ** -0.5 * m * m / cfg.softmax_scale  # scores scale linearly with q
        return super().mix(weights, q_nope * factor, q_pe * factor, c, k_pe, allowed)


class MissingMscaleSquared(_Absorbed):
    """Leaves YaRN's whole mscale(factor, mscale_all_dim)² out of the softmax scale: 1/sqrt(qk_head_dim)."""

    name = "broken-missing-mscale-squared"

    def mix(self, weights, q_nope, q_pe, c, k_pe, allowed):
        cfg = weights.config
        factor = cfg.qk_head_dim ** -0.5 / cfg.softmax_scale  # scores scale linearly with q
        return super().mix(weights, q_nope * factor, q_pe * factor, c, k_pe, allowed)


# --------------------------------------------------------------------------- DeepSeek Sparse Attention


class InterleavedIndexerRope(ReferenceDSA):
    """The indexer's RoPE in MLA's interleaved layout -- the first V3.2-Exp inference demo's code, corrected by
    DeepSeek on 2025-11-18 (SGLang #13530, vLLM #28968): the indexer must rotate non-interleaved halves."""

    name = "broken-dsa-interleaved-indexer-rope"
    indexer_rope_layout = "interleaved"


class TopkOffByOne(ReferenceDSA):
    """Keeps index_topk - 1 keys once a query sees index_topk or more (an off-by-one at the top-k boundary,
    the class of mlx-lm #1443's collapse exactly at index_topk)."""

    name = "broken-dsa-topk-off-by-one"

    def topk(self, scores, topk):
        idx = super().topk(scores, topk)
        full = (idx >= 0).sum(-1, keepdim=True) >= topk
        return torch.where(full & (torch.arange(idx.shape[-1]) == topk - 1), torch.full_like(idx, -1), idx)


class IndexerKeysHidden(ReferenceDSA):
    """Declares latent+indexer but leaves the indexer keys out of tensors(): 22 % of the cache unreported."""

    name = "broken-dsa-indexer-keys-hidden"

    def new_cache(self, config, *, batch_size, capacity, dtype, device, kv_codec="none", page_block_size=None):
        cache = super().new_cache(config, batch_size=batch_size, capacity=capacity, dtype=dtype, device=device,
                                  kv_codec=kv_codec)
        everything = cache.tensors
        cache.tensors = lambda: {k: v for k, v in everything().items() if not k.startswith("index_k")}
        return cache
