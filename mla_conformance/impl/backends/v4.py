"""``reference-v4``: DeepSeek-V4 attention over a V4 cache, as DeepSeek's inference code lays it out.

The cache (per layer, per row; DeepSeek's ``Attention.kv_cache`` / ``Indexer.kv_cache`` / ``Compressor`` state):

* ``window``     [B, sliding_window, head_dim]: a ring of the last sliding_window KV vectors (token t at slot
  t % sliding_window), K = V: one tensor, in the cache dtype;
* ``compressed`` [B, capacity // ratio, head_dim]: one entry per closed window of ``ratio`` tokens (CSA, HCA);
* ``indexer``    [B, capacity // ratio, index_head_dim]: the lightning indexer's compressed keys (CSA);
* ``kv_state`` / ``score_state`` (and the indexer's ``index_kv_state`` / ``index_score_state``) float32
  [B, 2 * ratio, coff * dim]: the compressor's projections of the previous window (slots 0..ratio-1, CSA's
  overlap reads them) and of the window still open (slots ratio..2 ratio-1), as DeepSeek's ``Compressor`` keeps
  them between decode steps. A call may end anywhere inside a window; the entry is written when its window closes.

Projections in the weights' dtype, everything after them in float32 (float64 for float64 weights); the KV
vectors and entries are rounded to the cache dtype when stored and read back from it, so a decode step sees what
a prefill saw. The cache exposes ``last_topk_indices`` (the CSA selection of the last call, entry indices per
query, -1 unused) for inspection.
"""

from __future__ import annotations

import math

import torch

from mla_conformance.contract.layer import is_v4
from mla_conformance.kv import model1
from mla_conformance.model.v4_config import CSA, V4Config
from mla_conformance.model.v4_reference import inv_freq

def stored_as(cache, rows: torch.Tensor, dtype) -> torch.Tensor:
    """KV rows as the cache's window holds them, read back in ``dtype`` (rounded to the cache dtype, or MODEL1)."""
    if cache.kv_codec == model1.NAME:
        return model1.decode_rows(model1.encode_rows(rows), dtype)
    return rows.to(cache.dtype).to(dtype)


NOT_V4 = ("reference-v4 implements DeepSeek-V4 attention only; this config is MLA (reference-absorbed and "
          "reference-dsa implement that)")


class V4Cache:
    """A V4 layer's cache for ``batch_size`` rows of up to ``capacity`` tokens (see the module docstring)."""

    def __init__(self, config: V4Config, *, batch_size: int, capacity: int, dtype, device, kv_codec: str = "none"):
        self.config, self.batch_size, self.capacity, self.dtype = config, batch_size, capacity, dtype
        self.kv_codec = kv_codec
        B, D, W, m = batch_size, config.head_dim, config.sliding_window, config.compress_ratio
        #: a KV row: head_dim values in the cache dtype, or MODEL1's 584 bytes (kv_codec fp8-e4m3-model1)
        row = dict(size=(model1.TOKEN_BYTES,), dtype=torch.uint8) if kv_codec == model1.NAME else \
            dict(size=(D,), dtype=dtype)
        self.seq_lens = torch.zeros(B, dtype=torch.int64, device=device)
        self._t = {"window": torch.zeros(B, W, *row["size"], dtype=row["dtype"], device=device)}
        self.v4_layout = {"window": "window"}
        if m:
            self._t["compressed"] = torch.zeros(B, max(capacity // m, 1), *row["size"], dtype=row["dtype"],
                                                device=device)
            self.v4_layout["compressed"] = "compressed"
            add_compressor_buffers(self, config, capacity=capacity, dtype=dtype, device=device)
        self.last_topk_indices = None

    def put(self, name: str, b: int, slots, rows: torch.Tensor) -> None:
        """Store KV rows [n, head_dim] (window / compressed: MODEL1-encoded under its codec) or indexer keys."""
        if self.kv_codec == model1.NAME and name in ("window", "compressed"):
            self._t[name][b, slots] = model1.encode_rows(rows)
        else:
            self._t[name][b, slots] = rows.to(self._t[name].dtype)

    def get(self, name: str, b: int, slots, dtype) -> torch.Tensor:
        """Stored rows back as values [n, dim] in ``dtype`` (MODEL1 rows decoded: e4m3 x 2^k in bf16, bf16 rope)."""
        t = self._t[name][b, slots]
        if self.kv_codec == model1.NAME and name in ("window", "compressed"):
            return model1.decode_rows(t, dtype)
        return t.to(dtype)

    def tensors(self) -> dict[str, torch.Tensor]:
        return dict(self._t)

    def allocated_nbytes(self) -> int:
        return sum(t.nbytes for t in self._t.values())

    def active_nbytes(self) -> int:
        return v4_active_nbytes(self, self._t["window"][0, 0].nbytes)


def add_compressor_buffers(cache, config: V4Config, *, capacity: int, dtype, device) -> None:
    """A compressed layer's compressor state (float32 kv_state / score_state [B, 2 ratio, coff x head_dim]: the
    previous window, then the open one) and, for CSA, the indexer's keys [B, capacity // ratio, index_head_dim] in
    the cache dtype and its compressor's state, added to ``cache._t`` / ``cache.v4_layout``."""
    B, D, m = cache.batch_size, config.head_dim, config.compress_ratio
    coff = 2 if config.overlap else 1
    state = lambda width: torch.zeros(B, 2 * m, width, dtype=torch.float32, device=device)
    cache._t.update(kv_state=state(coff * D), score_state=state(coff * D))
    cache.v4_layout.update(kv_state="state", score_state="state")
    if config.layer_type == CSA:
        Di = config.index_head_dim
        cache._t["indexer"] = torch.zeros(B, max(capacity // m, 1), Di, dtype=dtype, device=device)
        cache._t.update(index_kv_state=state(2 * Di), index_score_state=state(2 * Di))
        cache.v4_layout.update(indexer="indexer", index_kv_state="state", index_score_state="state")


def v4_active_nbytes(cache, row_bytes: int) -> int:
    """The bytes holding a V4 cache's stored tokens: per row of n tokens, min(n, window) KV rows, n // ratio entries
    (and CSA indexer keys), plus the compressor state of each started row (``cache._t``, ``cache.v4_layout``)."""
    cfg, total = cache.config, 0
    for n in cache.seq_lens.tolist():
        total += min(n, cfg.sliding_window) * row_bytes
        if cfg.compress_ratio and n:
            total += (n // cfg.compress_ratio) * row_bytes
            total += sum(cache._t[k][0].nbytes for k, v in cache.v4_layout.items() if v == "state")
            if "indexer" in cache._t:
                total += (n // cfg.compress_ratio) * cache._t["indexer"][0, 0].nbytes
    return total


class ReferenceV4:
    """DeepSeek-V4 attention (window, CSA, HCA; sink; inverse RoPE; grouped output) over :class:`V4Cache`."""

    name = "reference-v4"
    deepseek_v4 = True

    def unsupported_reason(self, config, *, dtype, device, kv_codec="none"):
        if not is_v4(config):
            return NOT_V4
        if kv_codec == model1.NAME:
            if (config.head_dim, config.qk_rope_head_dim) != (model1.D_QK, model1.D_ROPE):
                return (f"reference-v4's {model1.NAME} cache is FlashMLA's MODEL1 row: head_dim {model1.D_QK} = "
                        f"{model1.D_NOPE} e4m3 + {model1.D_ROPE} bf16 rope; this config has head_dim "
                        f"{config.head_dim}, rope {config.qk_rope_head_dim}")
            return None
        if kv_codec != "none":
            return (f"reference-v4 stores the KV vectors in the cache dtype or as MODEL1 FP8 rows "
                    f"({model1.NAME}); kv_codec {kv_codec!r} is not supported")
        return None

    def new_cache(self, config, *, batch_size, capacity, dtype, device, kv_codec="none"):
        return V4Cache(config, batch_size=batch_size, capacity=capacity, dtype=dtype, device=device,
                       kv_codec=kv_codec)

    # ------------------------------------------------------------------ pieces
    @staticmethod
    def _rope(x, positions, freqs, inverse=False):
        rd = 2 * freqs.numel()
        ang = positions.to(freqs.dtype)[:, None] * freqs[None, :]
        if x.ndim == 3:
            ang = ang[:, None, :]
        cos, sin = ang.cos(), ang.sin() * (-1 if inverse else 1)
        a, b = x[..., -rd:][..., 0::2], x[..., -rd:][..., 1::2]
        return torch.cat([x[..., :-rd], torch.stack((a * cos - b * sin, a * sin + b * cos), -1).flatten(-2)], -1)

    @staticmethod
    def _rms(x, eps, weight=None):
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return y if weight is None else y * weight.to(x.dtype)

    def _compress(self, cache, b, proj_kv, proj_score, names, ape, norm, overlap, start, n, out_name, freqs, wd):
        """Feed row b's n new tokens (positions start..start+n-1; their projections [n, coff*d]) to a compressor
        whose state lives in ``names`` (kv_state, score_state); write each entry whose window closes to
        ``out_name``. Returns nothing: the entries are read back from the cache."""
        cfg = cache.config
        m = cfg.compress_ratio
        kv_state, score_state = cache._t[names[0]], cache._t[names[1]]
        d = norm.numel()
        open_from = (start // m) * m                         # first token of the window open before this call
        r = start - open_from                                # its tokens already in the state
        seq_kv = torch.cat([kv_state[b, :m + r].to(wd), proj_kv], 0)          # positions open_from - m ..
        ape = self._position_bias(ape)
        seq_sc = torch.cat([score_state[b, :m + r].to(wd), proj_score + ape[(torch.arange(n) + start) % m]], 0)
        end = start + n
        first_new_window = open_from // m
        closed = end // m                                    # windows 0..closed-1 are closed after this call
        for j in range(first_new_window, closed):
            lo = j * m - (open_from - m)                     # index of window j's first token in seq_*
            cur_kv, cur_sc = seq_kv[lo:lo + m], seq_sc[lo:lo + m]
            if overlap:
                first, second = self._overlap_halves(d)
                if not self._has_previous_window(j):
                    prev_kv = cur_kv.new_zeros(m, d)
                    prev_sc = cur_sc.new_full((m, d), -math.inf)
                else:
                    prev_kv, prev_sc = seq_kv[lo - m:lo, first], seq_sc[lo - m:lo, first]
                kv_w = torch.cat([prev_kv, cur_kv[:, second]], 0)
                sc_w = torch.cat([prev_sc, cur_sc[:, second]], 0)
            else:
                kv_w, sc_w = cur_kv, cur_sc
            entry = self._rms((kv_w * sc_w.softmax(0)).sum(0), cfg.rms_norm_eps, norm)
            entry = self._rope(entry[None], torch.tensor([self._entry_position(j, m)]),
                               self._entry_freqs(cfg, freqs))[0]
            cache.put(out_name, b, j, entry[None])
        # the state after the call: the last closed window (slots 0..m-1) and the open one (slots m..)
        new_open = (end // m) * m
        keep_from = new_open - m - (open_from - m)           # index in seq_* of the window before the open one
        tail_kv, tail_sc = seq_kv[max(keep_from, 0):], seq_sc[max(keep_from, 0):]
        pad = max(-keep_from, 0)                             # before window 0: nothing (never read)
        if pad:
            tail_kv = torch.cat([tail_kv.new_zeros(pad, tail_kv.shape[1]), tail_kv], 0)
            tail_sc = torch.cat([tail_sc.new_full((pad, tail_sc.shape[1]), -math.inf), tail_sc], 0)
        kv_state[b, :tail_kv.shape[0]] = tail_kv.to(kv_state.dtype)
        score_state[b, :tail_sc.shape[0]] = tail_sc.to(score_state.dtype)

    # ------------------------------------------------------------------ the rules, one method each
    @staticmethod
    def _window_visible(win_pos, pos, W):
        """Query p sees window tokens t with p - W < t <= p (the last W tokens, itself included)."""
        return (win_pos[None, :] <= pos[:, None]) & (win_pos[None, :] > pos[:, None] - W)

    @staticmethod
    def _entry_visible(j, pos, m):
        """Entry j (tokens j*m .. j*m+m-1) is visible to query p once its window closed: (j+1)*m <= p+1."""
        return (j[None, :] + 1) * m <= pos[:, None] + 1

    @staticmethod
    def _overlap_halves(d):
        """CSA: the previous window contributes its first d projections (Ca), the entry's own its second (Cb)."""
        return slice(0, d), slice(d, 2 * d)

    @staticmethod
    def _entry_position(j, m):
        """Entry j is rotated at its window's first token."""
        return j * m

    @staticmethod
    def _entry_freqs(cfg, freqs):
        """Entries use the layer's (compressed) RoPE: compress_rope_theta with YaRN."""
        return freqs

    @staticmethod
    def _index_scores(wts, dots):
        """sum_i w_i ReLU(q_i . k): [S, Hi] weights, [S, Hi, N] dots -> [S, N]."""
        return torch.einsum("si,sij->sj", wts, dots.clamp(min=0))

    @staticmethod
    def _probabilities(z, sink):
        """softmax over the visible keys with the per-head sink in the denominator only."""
        zmax = torch.maximum(z.amax(-1, keepdim=True), sink)
        e = (z - zmax).exp()
        return e / (e.sum(-1, keepdim=True) + (sink - zmax).exp())

    @staticmethod
    def _q_head_norm(q, eps):
        """The query's per-head RMSNorm, unweighted."""
        return q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + eps)

    @staticmethod
    def _softmax_scale(cfg):
        """head_dim^-0.5: no YaRN mscale^2 in V4."""
        return cfg.softmax_scale

    @staticmethod
    def _groups(o, g):
        """[S, H, D] -> [S, g, H/g x D]: group i holds heads i*H/g .. (i+1)*H/g - 1 (contiguous)."""
        return o.reshape(o.shape[0], g, -1)

    @staticmethod
    def _has_previous_window(j):
        """CSA: every entry but the first also takes the previous window's first halves."""
        return j > 0

    @staticmethod
    def _position_bias(ape):
        """The compressor's gate bias per slot of the window (ape)."""
        return ape

    def _rotate_back(self, o, pos, freqs):
        """The conjugate rotation of the output's rope slice at the query's position."""
        return self._rope(o, pos, freqs, inverse=True)

    # ------------------------------------------------------------------ attend
    def attend(self, weights, hidden_states, positions, cache: V4Cache, lengths=None):
        cfg: V4Config = weights.config
        x, dt = hidden_states, hidden_states.dtype
        wd = torch.float64 if weights.dtype == torch.float64 else torch.float32
        B, S, _ = x.shape
        H, D, rd, eps = cfg.num_attention_heads, cfg.head_dim, cfg.qk_rope_head_dim, cfg.rms_norm_eps
        W, m = cfg.sliding_window, cfg.compress_ratio
        lengths = torch.full((B,), S) if lengths is None else lengths.to("cpu")
        theta, yarn = cfg.rope()
        freqs = inv_freq(rd, theta, yarn).to(device=x.device, dtype=wd)
        lin = lambda t, name: t.to(weights[name].dtype) @ weights[name].T
        out = torch.zeros(B, S, cfg.hidden_size, dtype=dt, device=x.device)
        topk_all = torch.full((B, S, cfg.index_topk), -1, dtype=torch.int64)
        for b in range(B):
            n, start = int(lengths[b]), int(cache.seq_lens[b])
            if n == 0:
                continue
            xb = x[b, :n]
            pos = torch.arange(start, start + n, device=x.device)
            qr = self._rms(lin(xb, "q_a_proj.weight").to(wd), eps, weights["q_a_norm.weight"])
            q = self._q_head_norm(lin(qr, "q_b_proj.weight").to(wd).view(n, H, D), eps)
            q = self._rope(q, pos, freqs)
            kv = self._rope(self._rms(lin(xb, "kv_proj.weight").to(wd), eps, weights["kv_norm.weight"]), pos, freqs)
            # window keys: the ring's stored tokens still in some query's window, then the new ones (as stored)
            old_lo = max(0, start - W + 1)
            old_pos = torch.arange(old_lo, start, device=x.device)
            old = cache.get("window", b, old_pos % W, wd)
            keep = pos[-min(n, W):]
            cache.put("window", b, keep % W, kv[-min(n, W):])
            win_keys = torch.cat([old, stored_as(cache, kv, wd)], 0)
            win_pos = torch.cat([old_pos, pos])
            visible = self._window_visible(win_pos, pos, W)
            keys = win_keys
            if m:
                pre = "compressor."
                coff_kv = lin(xb, pre + "kv_proj.weight").to(wd)
                coff_sc = lin(xb, pre + "gate_proj.weight").to(wd)
                self._compress(cache, b, coff_kv, coff_sc, ("kv_state", "score_state"),
                               weights[pre + "position_bias"].to(wd), weights[pre + "kv_norm.weight"].to(wd),
                               cfg.overlap, start, n, "compressed", freqs, wd)
                N = (start + n) // m
                entries = cache.get("compressed", b, slice(0, N), wd)
                closed = self._entry_visible(torch.arange(N, device=x.device), pos, m)
                attended = closed
                if cfg.layer_type == CSA:
                    ip = "compressor.indexer."
                    self._compress(cache, b, lin(xb, ip + "kv_proj.weight").to(wd),
                                   lin(xb, ip + "gate_proj.weight").to(wd), ("index_kv_state", "index_score_state"),
                                   weights[ip + "position_bias"].to(wd), weights[ip + "kv_norm.weight"].to(wd), True,
                                   start, n, "indexer", freqs, wd)
                if cfg.layer_type == CSA and N:
                    ikeys = cache.get("indexer", b, slice(0, N), wd)
                    Hi, Di = cfg.index_n_heads, cfg.index_head_dim
                    qi = self._rope(lin(qr, ip + "q_b_proj.weight").to(wd).view(n, Hi, Di), pos, freqs)
                    wts = lin(xb, ip + "scorer.weights_proj.weight").to(wd) * (Di ** -0.5 * Hi ** -0.5)
                    scores = self._index_scores(wts, torch.einsum("sic,jc->sij", qi, ikeys))
                    scores = scores.masked_fill(~closed, -math.inf)
                    k = min(cfg.index_topk, N)
                    top = scores.topk(k, dim=-1).indices
                    attended = torch.zeros_like(closed).scatter_(1, top, True) & closed
                    topk_all[b, :n, :k] = torch.where(closed.gather(1, top), top, -1).cpu()
                keys = torch.cat([win_keys, entries], 0)
                visible = torch.cat([visible, attended], 1)
            z = torch.einsum("shd,td->hst", q, keys) * self._softmax_scale(cfg)
            z = z.masked_fill(~visible[None], -math.inf)
            p = self._probabilities(z, weights["sinks"].to(wd).view(H, 1, 1))
            o = self._rotate_back(torch.einsum("hst,td->shd", p, keys), pos, freqs)
            g = cfg.o_groups
            w_oa = weights["o_a_proj.weight"].view(g, cfg.o_lora_rank, -1)
            y = torch.einsum("sgd,grd->sgr", self._groups(o, g).to(w_oa.dtype), w_oa)
            out[b, :n] = lin(y.flatten(1), "o_b_proj.weight").to(dt)
        cache.seq_lens += lengths.to(cache.seq_lens.device)
        cache.last_topk_indices = topk_all
        return out
