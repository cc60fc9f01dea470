"""Broken DeepSeek-V4 backends: reference-v4 with one known bug each (tests/meta/test_v4_meta.py holds each to
failing its named test with its cause). Each overrides the one method of ReferenceV4 that owns the rule."""

from __future__ import annotations

import math

import torch

from mla_conformance.impl.backends.v4 import ReferenceV4, V4Cache
from mla_conformance.model.v4_reference import inv_freq


class RopeLeading(ReferenceV4):
    """RoPE on the leading qk_rope_head_dim dims (what transformers' DeepseekV4Attention docstring says)."""

    name = "broken-v4-rope-leading"

    @staticmethod
    def _rope(x, positions, freqs, inverse=False):
        rd = 2 * freqs.numel()
        ang = positions.to(freqs.dtype)[:, None] * freqs[None, :]
        if x.ndim == 3:
            ang = ang[:, None, :]
        cos, sin = ang.cos(), ang.sin() * (-1 if inverse else 1)
        a, b = x[..., :rd][..., 0::2], x[..., :rd][..., 1::2]
        return torch.cat([torch.stack((a * cos - b * sin, a * sin + b * cos), -1).flatten(-2), x[..., rd:]], -1)


class NoRotateBack(ReferenceV4):
    name = "broken-v4-no-rotate-back"

    def _rotate_back(self, o, pos, freqs):
        return o


class SinkInNumerator(ReferenceV4):
    """The sink added to every score (exp(z + sink)): it cancels in the softmax, as if there were none."""

    name = "broken-v4-sink-in-numerator"

    @staticmethod
    def _probabilities(z, sink):
        return (z + sink).softmax(-1).nan_to_num(0.0)


class WindowOffByOne(ReferenceV4):
    """sliding_window + 1 tokens: t >= p - W instead of t > p - W."""

    name = "broken-v4-window-off-by-one"

    @staticmethod
    def _window_visible(win_pos, pos, W):
        return (win_pos[None, :] <= pos[:, None]) & (win_pos[None, :] >= pos[:, None] - W)


class EntryEarly(ReferenceV4):
    """A compressed entry visible once its window started (j*m <= p), before it closed."""

    name = "broken-v4-entry-early"

    @staticmethod
    def _entry_visible(j, pos, m):
        return j[None, :] * m <= pos[:, None]


class OverlapSwapped(ReferenceV4):
    """CSA's overlapping compressor with the Ca / Cb halves exchanged."""

    name = "broken-v4-overlap-swapped"

    @staticmethod
    def _overlap_halves(d):
        return slice(d, 2 * d), slice(0, d)


class EntryRopeLast(ReferenceV4):
    """Compressed entries rotated at their window's last token."""

    name = "broken-v4-entry-rope-last"

    @staticmethod
    def _entry_position(j, m):
        return j * m + m - 1


class EntryRopeMainTheta(ReferenceV4):
    """Compressed entries rotated with rope_theta and no YaRN."""

    name = "broken-v4-entry-rope-main-theta"

    @staticmethod
    def _entry_freqs(cfg, freqs):
        return inv_freq(cfg.qk_rope_head_dim, float(cfg.rope_theta), None).to(freqs.dtype)


class IndexerNoRelu(ReferenceV4):
    name = "broken-v4-indexer-no-relu"

    @staticmethod
    def _index_scores(wts, dots):
        return torch.einsum("si,sij->sj", wts, dots)


class IndexerNoWeights(ReferenceV4):
    name = "broken-v4-indexer-no-weights"

    @staticmethod
    def _index_scores(wts, dots):
        return dots.clamp(min=0).sum(1)


class RopeMscale(ReferenceV4):
    """cos / sin of the YaRN layers times YaRN's mscale (transformers' yarn default attention_factor)."""

    name = "broken-v4-rope-mscale"

    def attend(self, weights, hidden_states, positions, cache, lengths=None):
        yarn = weights.config.rope()[1]
        self._scale = (0.1 * math.log(float(yarn["factor"])) + 1.0) if yarn else 1.0
        return super().attend(weights, hidden_states, positions, cache, lengths)

    def _rope(self, x, positions, freqs, inverse=False):
        rd = 2 * freqs.numel()
        ang = positions.to(freqs.dtype)[:, None] * freqs[None, :]
        if x.ndim == 3:
            ang = ang[:, None, :]
        cos, sin = ang.cos() * self._scale, ang.sin() * (-self._scale if inverse else self._scale)
        a, b = x[..., -rd:][..., 0::2], x[..., -rd:][..., 1::2]
        return torch.cat([x[..., :-rd], torch.stack((a * cos - b * sin, a * sin + b * cos), -1).flatten(-2)], -1)


class ScaleMscale(ReferenceV4):
    name = "broken-v4-scale-mscale"

    @staticmethod
    def _softmax_scale(cfg):
        yarn = cfg.rope()[1]
        ms = (0.1 * math.log(float(yarn["factor"])) + 1.0) if yarn else 1.0
        return cfg.softmax_scale * ms ** 2


class NoQHeadNorm(ReferenceV4):
    name = "broken-v4-no-q-head-norm"

    @staticmethod
    def _q_head_norm(q, eps):
        return q


class GroupsInterleaved(ReferenceV4):
    name = "broken-v4-groups-interleaved"

    @staticmethod
    def _groups(o, g):
        S, H, D = o.shape
        return o.view(S, H // g, g, D).transpose(1, 2).reshape(S, g, -1)


class NoApe(ReferenceV4):
    name = "broken-v4-no-ape"

    @staticmethod
    def _position_bias(ape):
        return torch.zeros_like(ape)


class CsaNoOverlap(ReferenceV4):
    name = "broken-v4-csa-no-overlap"

    @staticmethod
    def _has_previous_window(j):
        return False


class _KeyAndValueCache(V4Cache):
    """The window kept twice: a key ring and a value ring of the same vectors."""

    def __init__(self, config, **kw):
        super().__init__(config, **kw)
        self._t["window_v"] = torch.zeros_like(self._t["window"])
        self.v4_layout["window_v"] = "window"


class KeyAndValueCopy(ReferenceV4):
    name = "broken-v4-key-and-value-copy"

    def new_cache(self, config, *, batch_size, capacity, dtype, device, kv_codec="none"):
        return _KeyAndValueCache(config, batch_size=batch_size, capacity=capacity, dtype=dtype, device=device,
                                 kv_codec=kv_codec)

    def attend(self, weights, hidden_states, positions, cache, lengths=None):
        out = super().attend(weights, hidden_states, positions, cache, lengths)
        cache._t["window_v"].copy_(cache._t["window"])  # the value ring: the same rows again
        return out


BROKEN = [RopeLeading, NoRotateBack, SinkInNumerator, WindowOffByOne, EntryEarly, OverlapSwapped, EntryRopeLast,
          EntryRopeMainTheta, IndexerNoRelu, IndexerNoWeights, KeyAndValueCopy, RopeMscale, ScaleMscale, NoQHeadNorm,
          GroupsInterleaved, NoApe, CsaNoOverlap]
