"""The float64 DeepSeek-V4 attention oracle, einsum-shaped beside the MLA one (mla_conformance.model.reference).

Written from DeepSeek's V4 inference code, ``inference/model.py`` (public mirror Nicooo-Wang/DeepSeek-V4-Pro-code,
commit 0ec3a03c2fc34f29b2e72696ceaed9ae7a373aeb: ``Attention``, ``Compressor``, ``Indexer``,
``precompute_freqs_cis``, ``apply_rotary_emb``, ``get_window_topk_idxs``, ``get_compress_topk_idxs``; the sink
from ``kernel.py``'s ``sparse_attn``), not from transformers (which the suite judges). Per token t of a row,
for query position p (subscripts: s query, t key, h head, d head dim, j compressed entry, i indexer head)::

    q_p      = RMSNorm_unweighted( W_qb RMSNorm(W_qa x_p) )_h          per head, head_dim wide
    kv_t     = RMSNorm(W_kv x_t)                                       one vector per token: key AND value
    RoPE       on the trailing qk_rope_head_dim dims, interleaved pairs (x[2i], x[2i+1]), at position p / t;
               window-only layers: rope_theta, no YaRN; CSA / HCA layers: compress_rope_theta with YaRN
    entry_j  = RMSNorm( sum_slots softmax_slots(W_gate x + ape) * (W_kv' x) )   (ratio m; per channel)
               HCA: the m tokens j*m .. j*m+m-1;  CSA (m = 4): those tokens' second half (Cb) and the previous
               window's tokens' first half (Ca): 2m slots, stride m; entry 0 has no previous window
               then RoPE at position j*m (the window's first token), compressed theta + YaRN
    visible    window: t in (p - sliding_window, p];  entry j: (j + 1) * m <= p + 1 (its window has closed)
    CSA        indexer: its own overlapping compressor at index_head_dim (entries k_j), query
               qi_p = RoPE(W_iqb RMSNorm(W_qa x_p)), weights w_p = (W_w x_p) * index_head_dim^-0.5 *
               index_n_heads^-0.5, score_pj = sum_i w_pi ReLU(qi_pi . k_j); the top-min(index_topk, visible)
               entries attended; HCA attends every visible entry
    o_p,h    = ( sum_k exp(z_k) kv_k ) / ( sum_k exp(z_k) + exp(sink_h) ),  z_k = q_p,h . kv_k * head_dim^-0.5
               over the visible window tokens and the attended entries: the sink is in the denominator only
    o_p,h   <- RoPE^-1 on its trailing rope dims at position p (conjugate rotation: V carried the keys' RoPE)
    out_p    = W_ob concat_g( W_oa,g o_p,(heads of group g) )          grouped low-rank output projection

What DeepSeek's code does that the oracle leaves out, because it does not change the exact result: the indexer's
Hadamard rotation of its query and keys (orthogonal, applied to both: dot products unchanged). What it leaves out
because it is a storage format, judged as such: the FP8 / FP4 quantisation-aware rounding of the cached vectors
(``act_quant``, ``fp4_act_quant``), which a backend's kv codec declares.

The oracle recomputes every row from its full token sequence with no cache: a causal, position-based function, so
prefill, chunked prefill and step-by-step decode must all give its outputs (each entry appears when its window
closes, whatever the calls' boundaries). ``Variant`` gives the oracle of one known bug, for the likely-cause
diagnosis of a failure (mla_conformance.checks.layer.v4).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from mla_conformance.model.config import yarn_inv_freq
from mla_conformance.model.v4_config import CSA, V4Config, V4Weights


@dataclasses.dataclass(frozen=True)
class Variant:
    """V4 attention with at most one known bug; the default is V4 as DeepSeek computes it."""

    rope_slice: str = "trailing"      # "leading": RoPE on the first qk_rope_head_dim dims
    rotate_back: bool = True          # False: the output's rope slice not rotated back
    sink: bool = True                 # False: the sink dropped (or added to every score, where it cancels)
    window_delta: int = 0             # +-1: the window one token too wide / narrow
    entry_early: bool = False         # an entry visible one window early (while its window is still open)
    overlap_swapped: bool = False     # CSA: the Ca / Cb halves of the overlapping compressor exchanged
    entry_rope: str = "first"         # "last": entry j rotated at j*m + m - 1; "main-theta": rope_theta, no YaRN
    indexer_relu: bool = True         # False: the indexer sums w * (q.k) without the ReLU
    indexer_weights: bool = True      # False: the indexer sums ReLU(q.k) without its per-head weights
    rope_mscale: bool = False         # True: cos / sin of the YaRN layers multiplied by mscale = 0.1 ln(factor) + 1
    scale_mscale: bool = False        # True: the softmax scale multiplied by mscale^2 (DeepSeek-V3's rule)
    q_head_norm: bool = True          # False: the query's per-head RMSNorm left out
    groups_interleaved: bool = False  # True: group i of the output projection takes heads i, i + g, i + 2g, ...
    ape: bool = True                  # False: the compressor's position bias (ape) left out
    csa_overlap: bool = True          # False: CSA entries without the previous window's half (no overlap)


EXACT = Variant()


# --------------------------------------------------------------------------- pieces

def inv_freq(dim: int, theta: float, yarn: dict | None) -> torch.Tensor:
    """DeepSeek's ``precompute_freqs_cis`` frequencies in float64 (mla_conformance.model.config.yarn_inv_freq: the
    same function as V3's). No mscale: V4 multiplies neither cos/sin nor the softmax scale by it."""
    return yarn_inv_freq(dim, theta, yarn)


def rope(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, *, inverse: bool = False,
         leading: bool = False, scale: float = 1.0) -> torch.Tensor:
    """Interleaved-pair RoPE of the trailing ``2 * len(freqs)`` dims of x [..., L, (heads,) dim] at positions [L]
    (the leading dims when ``leading``, a bug's variant); the conjugate rotation when ``inverse``."""
    rd = 2 * freqs.numel()
    angles = positions.to(torch.float64)[:, None] * freqs[None, :]                 # [L, rd/2]
    if x.ndim == 3:                                                                # [L, heads, dim]
        angles = angles[:, None, :]
    cos, sin = angles.cos() * scale, angles.sin() * (-scale if inverse else scale)
    part = x[..., :rd] if leading else x[..., -rd:]
    a, b = part[..., 0::2], part[..., 1::2]
    rotated = torch.stack((a * cos - b * sin, a * sin + b * cos), -1).flatten(-2)
    return torch.cat([rotated, x[..., rd:]], -1) if leading else torch.cat([x[..., :-rd], rotated], -1)


def rms(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def compress(x: torch.Tensor, w_kv: torch.Tensor, w_gate: torch.Tensor, ape: torch.Tensor, norm: torch.Tensor,
             ratio: int, overlap: bool, eps: float, *, swapped: bool = False, previous: bool = True) -> torch.Tensor:
    """The entries of a row's closed windows [N = L // ratio, d], before RoPE (DeepSeek's ``Compressor``).

    Each output channel is a softmax-gated sum over its window's slots. Without overlap (HCA) the slots are the m
    tokens of window j. With overlap (CSA) the projections are 2d wide: slots 0..m-1 hold the previous window's
    first halves (Ca, ``[:d]``), slots m..2m-1 this window's second halves (Cb, ``[d:]``); window 0 has no previous
    window (those slots' gate is -inf). ``swapped`` exchanges the halves (a bug's variant)."""
    L = x.shape[0]
    N = L // ratio
    d = norm.numel()
    if N == 0:
        return x.new_zeros(0, d)
    kv = (x[:N * ratio] @ w_kv.T).view(N, ratio, -1)
    score = (x[:N * ratio] @ w_gate.T).view(N, ratio, -1) + ape
    if overlap:
        first, second = (slice(d, 2 * d), slice(0, d)) if swapped else (slice(0, d), slice(d, 2 * d))
        kv2 = kv.new_zeros(N, 2 * ratio, d)
        sc2 = score.new_full((N, 2 * ratio, d), -math.inf)
        kv2[:, ratio:], sc2[:, ratio:] = kv[..., second], score[..., second]
        if previous:
            kv2[1:, :ratio], sc2[1:, :ratio] = kv[:-1, :, first], score[:-1, :, first]
        kv, score = kv2, sc2
    return rms((kv * score.softmax(dim=1)).sum(dim=1), eps, norm)


@dataclasses.dataclass
class RowTrace:
    """What the oracle computed for one row: the indexer's scores [L, N] (-inf where an entry is not yet visible;
    CSA only), each query's attended entries (a bool mask [L, N]) and whether its top-k selection is certain."""

    scores: torch.Tensor | None
    attended: torch.Tensor
    margin: torch.Tensor | None  # per query: the gap between the k-th and (k+1)-th visible score, over M
    scale: torch.Tensor | None = None  # per query: M, the scale of the scores' rounding errors


# --------------------------------------------------------------------------- the oracle

def v4_row_f64(w: V4Weights, x: torch.Tensor, variant: Variant = EXACT, store=None,
               selection: torch.Tensor | None = None) -> tuple[torch.Tensor, RowTrace]:
    """One row's outputs [L, hidden] (float64) for its tokens x [L, hidden] at positions 0..L-1. ``store``: how a
    cache format stores KV rows (rows [n, head_dim] -> the values read back), applied to the window rows and the
    entries (e.g. FlashMLA's MODEL1 FP8 rows: mla_conformance.kv.model1.stored_f64); None = exact. ``selection``
    (bool [L, N], CSA): the entries each query attends instead of the indexer's top-k (a backend's own choice
    among near ties), still limited to the closed entries."""
    store = store or (lambda rows: rows)
    cfg: V4Config = w.config
    f = {k: v.to(torch.float64) for k, v in w.items()}
    x = x.to(torch.float64)
    L, H, D, eps = x.shape[0], cfg.num_attention_heads, cfg.head_dim, cfg.rms_norm_eps
    rd, m, win = cfg.qk_rope_head_dim, cfg.compress_ratio, cfg.sliding_window + variant.window_delta
    pos = torch.arange(L)
    theta, yarn = cfg.rope()
    freqs = inv_freq(rd, theta, yarn)
    lead = variant.rope_slice == "leading"
    ms = (0.1 * math.log(float(yarn["factor"])) + 1.0) if yarn else 1.0                   # YaRN's mscale
    rs = ms if variant.rope_mscale else 1.0

    qr = rms(x @ f["q_a_proj.weight"].T, eps, f["q_a_norm.weight"])                       # [L, q_lora]
    q = (qr @ f["q_b_proj.weight"].T).view(L, H, D)
    q = rms(q, eps) if variant.q_head_norm else q                                        # unweighted, per head
    q = rope(q, pos, freqs, leading=lead, scale=rs)
    kv = rope(rms(x @ f["kv_proj.weight"].T, eps, f["kv_norm.weight"]), pos, freqs, leading=lead, scale=rs)
    kv = store(kv)

    s, t = pos[:, None], pos[None, :]
    visible_win = (t <= s) & (t > s - win)                                               # [L, L]
    keys, visible = kv, visible_win
    trace = RowTrace(None, torch.zeros(L, 0, dtype=torch.bool), None)
    if m:
        ape = f["compressor.position_bias"] * (1.0 if variant.ape else 0.0)
        entries = compress(x, f["compressor.kv_proj.weight"], f["compressor.gate_proj.weight"], ape,
                           f["compressor.kv_norm.weight"], m, cfg.overlap, eps, swapped=variant.overlap_swapped,
                           previous=variant.csa_overlap)                                 # [N, D]
        N = entries.shape[0]
        at = torch.arange(N) * m + (m - 1 if variant.entry_rope == "last" else 0)
        efreqs = inv_freq(rd, float(cfg.rope_theta), None) if variant.entry_rope == "main-theta" else freqs
        entries = store(rope(entries, at, efreqs, leading=lead, scale=rs)) if N else entries
        j = torch.arange(N)[None, :]
        closed = (j + 1) * m <= s + 1                                                    # [L, N]
        if variant.entry_early:
            closed = j * m <= s
        attended = closed
        if cfg.layer_type == CSA and N:
            scores, margin, scale = indexer_scores(w, x, qr, closed, variant)
            k = min(cfg.index_topk, N)
            top = scores.topk(k, dim=-1).indices
            attended = torch.zeros_like(closed).scatter_(1, top, True) & closed
            if selection is not None:
                attended = selection[:, :N] & closed
            trace = RowTrace(scores, attended, margin, scale)
        else:
            trace = RowTrace(None, attended, None)
        keys = torch.cat([kv, entries], 0)
        visible = torch.cat([visible_win, attended], 1)

    z = torch.einsum("shd,td->hst", q, keys) * cfg.softmax_scale * (ms ** 2 if variant.scale_mscale else 1.0)
    z = z.masked_fill(~visible[None], -math.inf)
    zmax = z.amax(-1, keepdim=True)
    sink = f["sinks"].view(H, 1, 1)
    if variant.sink:
        zmax = torch.maximum(zmax, sink)
    e = (z - zmax).exp()
    denom = e.sum(-1, keepdim=True) + ((sink - zmax).exp() if variant.sink else 0.0)
    o = torch.einsum("hst,td->shd", e / denom, keys)                                     # [L, H, D]
    if variant.rotate_back:
        o = rope(o, pos, freqs, inverse=True, leading=lead, scale=rs)
    g = cfg.o_groups
    w_oa = f["o_a_proj.weight"].view(g, cfg.o_lora_rank, -1)
    grouped = (o.view(L, H // g, g, D).transpose(1, 2) if variant.groups_interleaved else o).reshape(L, g, -1)
    y = torch.einsum("sgd,grd->sgr", grouped, w_oa)                                      # [L, g, o_lora]
    return y.flatten(1) @ f["o_b_proj.weight"].T, trace


def indexer_scores(w: V4Weights, x: torch.Tensor, qr: torch.Tensor, closed: torch.Tensor,
                   variant: Variant = EXACT) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The CSA lightning indexer's scores [L, N] (-inf where the entry's window has not closed) and, per query,
    its selection margin: (k-th - (k+1)-th visible score) / M, M = max_j sum_i |w_i| sum_c |qi_ic k_jc| (the
    scale the scores' rounding errors are relative to; returned too); +inf where every visible entry is selected."""
    cfg = w.config
    f = {k: v.to(torch.float64) for k, v in w.items() if k.startswith("compressor.indexer.")}
    L, Hi, Di, m, eps = x.shape[0], cfg.index_n_heads, cfg.index_head_dim, cfg.compress_ratio, cfg.rms_norm_eps
    pre = "compressor.indexer."
    theta, yarn = cfg.rope()
    freqs = inv_freq(cfg.qk_rope_head_dim, theta, yarn)
    lead = variant.rope_slice == "leading"
    keys = compress(x, f[pre + "kv_proj.weight"], f[pre + "gate_proj.weight"],
                    f[pre + "position_bias"] * (1.0 if variant.ape else 0.0), f[pre + "kv_norm.weight"], m, True, eps,
                    swapped=variant.overlap_swapped, previous=variant.csa_overlap)
    N = keys.shape[0]
    at = torch.arange(N) * m + (m - 1 if variant.entry_rope == "last" else 0)
    efreqs = inv_freq(cfg.qk_rope_head_dim, float(cfg.rope_theta), None) if variant.entry_rope == "main-theta" else freqs
    keys = rope(keys, at, efreqs, leading=lead)
    qi = rope((qr @ f[pre + "q_b_proj.weight"].T).view(L, Hi, Di), torch.arange(L), freqs, leading=lead)
    wts = (x @ f[pre + "scorer.weights_proj.weight"].T) * (Di ** -0.5 * Hi ** -0.5)       # [L, Hi]
    dots = torch.einsum("sic,jc->sij", qi, keys)                                          # [L, Hi, N]
    act = dots.clamp(min=0) if variant.indexer_relu else dots
    scores = torch.einsum("si,sij->sj", wts if variant.indexer_weights else torch.ones_like(wts), act)
    scale = torch.einsum("si,sic,jc->sj", wts.abs(), qi.abs(), keys.abs()).amax(-1)      # M per query
    scores = scores.masked_fill(~closed, -math.inf)
    k = min(cfg.index_topk, N)
    margin = torch.full((L,), math.inf, dtype=torch.float64)
    if N > k:
        top = scores.topk(k + 1, dim=-1).values
        cut = torch.isfinite(top[:, k])                                                   # more visible than k
        margin[cut] = ((top[:, k - 1] - top[:, k]) / scale.clamp(min=1e-300))[cut]
    return scores, margin, scale


def v4_attention_f64(weights: V4Weights, x: torch.Tensor, lengths: torch.Tensor | None = None,
                     variant: Variant = EXACT, store=None,
                     selections: list | None = None) -> tuple[torch.Tensor, list[RowTrace]]:
    """The oracle over a batch: x [B, T, hidden] (row b's first lengths[b] tokens at positions 0..); returns the
    outputs [B, T, hidden] float64 (zeros past each row's length) and each row's trace."""
    B, T, _ = x.shape
    lengths = torch.full((B,), T) if lengths is None else lengths
    out = torch.zeros(B, T, weights.config.hidden_size, dtype=torch.float64)
    traces = []
    for b in range(B):
        n = int(lengths[b])
        o, tr = v4_row_f64(weights, x[b, :n], variant, store, None if selections is None else selections[b])
        out[b, :n] = o
        traces.append(tr)
    return out, traces
