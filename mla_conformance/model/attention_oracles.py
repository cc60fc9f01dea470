"""float64 oracles of the op contract's methods (mla_conformance.contract.op): paged decode (dense and sparse),
varlen prefill, FlashMLA's sparse prefill, the merge of two partial attentions by their log-sum-exp, and the lse
base conversions. Each is the contract's equation, row by row in float64 with plain indexing; none shares code
with reference-op (mla_conformance.impl.ops.reference). The decode oracle reads keys already decoded to float64
(the cache's storage formats belong to mla_conformance.kv, above this package:
mla_conformance.impl.ops.reference.oracle decodes a cache, then calls :func:`decode`).

Conventions, as FlashMLA's tests/ref.py writes them: a query with no key has out 0 and lse +inf (max_logits
-inf); every lse returned here is a natural log. ``magnitudes=True`` also returns what the op tests' error
bounds scale with (as :func:`decode`'s), per query and head:

* ``abs_v`` [T, h, d_v] = sum_t p_t |v_t| (times the sink factor), ``score_v`` [T, h, d_v] =
  sum_t p_t (A_t + A_max) |v_t|, with A_t = |scale| sum_d |q_d| |k_td|;
* ``score_abs`` [T, h] = sum_t p_t A_t, ``score_max`` [T, h] = A_max, ``sink_rel`` [T, h] = 1 - sink factor.
"""

from __future__ import annotations

import math

import torch

from mla_conformance.contract.op import D_V

F64 = torch.float64


def _attend(q, k, v, scale, sink=None):
    """q [h, d_qk], k [n, h_k, d_qk], v [n, h_k, d_v] (query head h reads kv head h // (h / h_k)) -> out [h, d_v],
    lse [h] (+inf when n = 0), max logit [h] (-inf), magnitudes."""
    h, h_k, d_v = q.shape[0], k.shape[1], v.shape[-1]
    if k.shape[0] == 0:
        zeros = torch.zeros(h, dtype=F64)
        return (torch.zeros(h, d_v, dtype=F64), torch.full((h,), math.inf, dtype=F64),
                torch.full((h,), -math.inf, dtype=F64),
                dict(abs_v=torch.zeros(h, d_v, dtype=F64), score_v=torch.zeros(h, d_v, dtype=F64), score_abs=zeros,
                     score_max=zeros, sink_rel=zeros))
    qg = q.reshape(h_k, h // h_k, -1)                                    # [h_k, group, d_qk]
    logits = torch.einsum("kgd,nkd->kgn", qg, k).reshape(h, -1) * scale   # [h, n]
    lse = torch.logsumexp(logits, dim=-1)
    p = torch.softmax(logits, dim=-1)
    mix = lambda w, x: torch.einsum("kgn,nkd->kgd", w.reshape(h_k, h // h_k, -1), x).reshape(h, -1)  # noqa: E731
    out = mix(p, v)
    factor = torch.ones_like(lse) if sink is None else 1.0 / (1.0 + torch.exp(sink - lse))
    a = torch.einsum("kgd,nkd->kgn", qg.abs(), k.abs()).reshape(h, -1) * abs(scale)   # A_t
    a_max = a.amax(-1)
    pv = mix(p, v.abs())
    mags = dict(abs_v=pv * factor[:, None], score_v=(mix(p * a, v.abs()) + a_max[:, None] * pv) * factor[:, None],
                score_abs=(p * a).sum(-1), score_max=a_max, sink_rel=1.0 - factor)
    return out * factor[:, None], lse, logits.amax(-1), mags


def decode(q, keys, block_table, cache_seqlens, *, page, softmax_scale, causal, indices=None, topk_length=None,
           attn_sink=None, head_dim_v=None, magnitudes=False, align="bottom-right"):
    """The op contract's decode computed in float64, row by row, over ``keys`` [num_blocks * page, d_qk] (the paged
    cache's rows decoded to float64; flat slot = block * page + offset): (out [B, s_q, h_q, d_v] float64, lse
    [B, h_q, s_q] float64, natural log, +inf for a query with no keys); d_v = ``head_dim_v`` (512 by default),
    d_qk = q's last dim.

    ``magnitudes=True`` also returns, as a third element, what the op tests' error bounds scale with (one
    pass, the same softmax), a dict of float64 tensors:

    * ``abs_v`` [B, s_q, h_q, d_v]: ``softmax @ |V|``, sum_t p_t |v_t| per element (times the sink factor):
      the error of rounding each p_t (or v_t) by a relative u is at most u times this;
    * ``score_v`` [B, s_q, h_q, d_v]: sum_t p_t (A_t + A_max) |v_t| (times the sink factor), A_t = scale *
      sum_d |q_d| |k_td| (what a dot product's rounding error scales with), A_max its maximum over the
      query's keys: score errors |e_t| <= c A_t move out by at most c times this, for the whole key set or
      any split of it;
    * ``score_abs`` / ``score_max`` [B, h_q, s_q]: sum_t p_t A_t and A_max (lse moves by at most c times the
      first);
    * ``sink_rel`` [B, h_q, s_q]: 1 - the sink factor (how much an lse error moves the sink's scaling).

    ``align="top-left"`` computes causal decode aligned top-left (query i sees keys 0..i): not the contract,
    the likely cause a failure message names when the op matches it."""
    B, s_q, h_q, d_qk = q.shape
    d_v = D_V if head_dim_v is None else int(head_dim_v)
    flat = keys.detach().cpu().to(torch.float64)
    n_slots = flat.shape[0]
    qd = q.detach().cpu().to(torch.float64)
    out = torch.zeros(B, s_q, h_q, d_v, dtype=torch.float64)
    lse = torch.full((B, h_q, s_q), math.inf, dtype=torch.float64)
    bt = block_table.detach().cpu().long()
    lens = cache_seqlens.detach().cpu().long()
    sink = None if attn_sink is None else attn_sink.detach().cpu().to(torch.float64)
    if magnitudes:
        abs_v, score_v = torch.zeros_like(out), torch.zeros_like(out)
        score_abs, score_max, sink_rel = (torch.zeros_like(lse) for _ in range(3))
    for b in range(B):
        L = int(lens[b])
        for i in range(s_q):
            if indices is not None:
                row = indices[b, i].detach().cpu().long()
                n = row.numel() if topk_length is None else max(0, min(int(topk_length[b]), row.numel()))
                keys = [int(t) for t in row[:n] if 0 <= int(t) < n_slots]
                slots = torch.tensor(keys, dtype=torch.long)
            else:
                visible = (L - s_q + i + 1 if align == "bottom-right" else i + 1) if causal else L
                visible = max(0, min(visible, L))
                pos = torch.arange(visible)
                slots = bt[b, pos // page] * page + pos % page if visible else torch.zeros(0, dtype=torch.long)
            if slots.numel() == 0:
                continue
            k = flat[slots]                                     # [n, d_qk]
            logits = (qd[b, i] @ k.T) * softmax_scale           # [h, n]
            l = torch.logsumexp(logits, dim=-1)                 # [h]
            p = torch.softmax(logits, dim=-1)                   # [h, n]
            o = p @ k[:, :d_v]                                  # [h, d_v]
            factor = 1.0 / (1.0 + torch.exp(sink - l)) if sink is not None else torch.ones_like(l)
            out[b, i] = o * factor[:, None]
            lse[b, :, i] = l
            if magnitudes:
                a = (qd[b, i].abs() @ k.abs().T) * abs(softmax_scale)    # [h, n]: A_t
                a_max = a.amax(dim=-1)
                v = k[:, :d_v].abs()
                abs_v[b, i] = (p @ v) * factor[:, None]
                score_v[b, i] = ((p * a) @ v + a_max[:, None] * (p @ v)) * factor[:, None]
                score_abs[b, :, i] = (p * a).sum(-1)
                score_max[b, :, i] = a_max
                sink_rel[b, :, i] = 1.0 - factor
    if magnitudes:
        return out, lse, {"abs_v": abs_v, "score_v": score_v, "score_abs": score_abs, "score_max": score_max,
                          "sink_rel": sink_rel}
    return out, lse


def _stack(rows: list[dict], keys) -> dict:
    return {key: torch.stack([r[key] for r in rows]) for key in keys}


def prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, *, softmax_scale, causal, magnitudes=False, align="bottom-right"):
    """Varlen attention, float64: (out [total_q, h_q, d_v], lse [total_q, h_q] natural, +inf for a query with no
    key[, magnitudes]). Query head h reads kv head h // (h_q / h_k); causal aligns bottom-right (query i of a row
    of m queries and n keys sees keys j <= n - m + i), or top-left (j <= i: not the contract, the likely cause a
    failure names) with ``align="top-left"``."""
    qd, kd, vd = (x.detach().cpu().to(F64) for x in (q, k, v))
    h_q = qd.shape[1]
    cq, ck = cu_seqlens_q.detach().cpu().long().tolist(), cu_seqlens_k.detach().cpu().long().tolist()
    results = []
    for b in range(len(cq) - 1):
        m, n = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        keys, values = kd[ck[b]:ck[b + 1]], vd[ck[b]:ck[b + 1]]             # [n, h_k, d]
        for i in range(m):
            seen = (n - m + i + 1 if align == "bottom-right" else i + 1) if causal else n
            seen = max(0, min(seen, n))
            results.append(_attend(qd[cq[b] + i], keys[:seen], values[:seen], softmax_scale))
    out = torch.stack([r[0] for r in results]) if results else torch.zeros(0, h_q, vd.shape[-1], dtype=F64)
    lse = torch.stack([r[1] for r in results]) if results else torch.zeros(0, h_q, dtype=F64)
    if not magnitudes:
        return out, lse
    return out, lse, _stack([r[3] for r in results], ("abs_v", "score_v", "score_abs", "score_max", "sink_rel"))


def sparse_prefill(q, kv, indices, *, softmax_scale, d_v, topk_length=None, attn_sink=None, magnitudes=False):
    """FlashMLA's ``flash_mla_sparse_fwd`` (its tests/ref.py ``ref_sparse_attn_fwd``), float64: (out [s_q, h_q,
    d_v], max_logits [s_q, h_q], lse [s_q, h_q] natural[, magnitudes]). An index < 0 or >= s_kv is invalid, as is
    every entry past topk_length[s]; query head h reads kv head h // (h_q / h_kv); the value is kv[..., :d_v];
    attn_sink scales out by exp(lse) / (exp(lse) + exp(sink)) and leaves lse as it is; a row with no valid index:
    out 0, max_logits -inf, lse +inf."""
    qd, kvd = q.detach().cpu().to(F64), kv.detach().cpu().to(F64)
    idx = indices.detach().cpu().long()
    s_q, h_q = qd.shape[:2]
    s_kv, h_kv = kvd.shape[:2]
    group = h_q // h_kv
    sink = None if attn_sink is None else attn_sink.detach().cpu().to(F64)
    outs, maxes, lses, mags = [], [], [], []
    for s in range(s_q):
        parts = []
        for g in range(h_kv):
            row = idx[s, g]
            n = row.numel() if topk_length is None else max(0, min(int(topk_length[s]), row.numel()))
            keep = [int(t) for t in row[:n] if 0 <= int(t) < s_kv]
            keys = kvd[keep, g][:, None]                                        # [n, 1, d_qk]
            heads = slice(g * group, (g + 1) * group)
            parts.append(_attend(qd[s, heads], keys, keys[..., :d_v], softmax_scale,
                                 None if sink is None else sink[heads]))
        outs.append(torch.cat([p[0] for p in parts]))
        lses.append(torch.cat([p[1] for p in parts]))
        maxes.append(torch.cat([p[2] for p in parts]))
        mags.append({key: torch.cat([p[3][key] for p in parts]) for key in parts[0][3]})
    out, max_logits, lse = torch.stack(outs), torch.stack(maxes), torch.stack(lses)
    if not magnitudes:
        return out, max_logits, lse
    return out, max_logits, lse, _stack(mags, ("abs_v", "score_v", "score_abs", "score_max", "sink_rel"))


def lse_to_natural(lse: torch.Tensor, base: str) -> torch.Tensor:
    """An lse in ``base`` ("e" or "2") as a natural log (infinities kept; its dtype and device kept)."""
    return lse * math.log(2.0) if base == "2" else lse


def natural_to_base(lse: torch.Tensor, base: str) -> torch.Tensor:
    """A natural-log lse in ``base`` ("e" or "2")."""
    return lse / math.log(2.0) if base == "2" else lse


def to_natural(lse: torch.Tensor, base: str) -> torch.Tensor:
    """An lse in ``base`` ("e" or "2") as a float64 natural log on the CPU (infinities kept)."""
    return lse_to_natural(lse.detach().cpu().to(F64), base)


def merge(out_a, lse_a, out_b, lse_b, *, base="e", magnitudes=False):
    """Two partial attentions over disjoint key sets merged by their lse, float64: out [T, h, d] =
    (w_a out_a + w_b out_b) / (w_a + w_b), w = exp(lse) (lse in ``base``), lse [T, h] natural = log(w_a + w_b).
    An lse of +inf or -inf is an empty side (weight 0, its out not read); both empty: out 0, lse +inf.
    ``magnitudes=True`` adds ``abs_mix`` [T, h, d] = a_a |out_a| + a_b |out_b| (a = the normalised weights) and
    ``lse_abs`` [T, h] = the largest finite |lse| in natural units (what the merge's float32 rounding scales
    with)."""
    la, lb = to_natural(lse_a, base), to_natural(lse_b, base)
    out, lse, parts = _merge_natural(out_a.detach().cpu().to(F64), la, out_b.detach().cpu().to(F64), lb)
    if not magnitudes:
        return out, lse
    (aa, oa, la0), (ab, ob, lb0) = parts
    lse_abs = torch.maximum(la0.abs(), lb0.abs())
    return out, lse, {"abs_mix": aa[..., None] * oa.abs() + ab[..., None] * ob.abs(), "lse_abs": lse_abs}


def _merge_natural(out_a, la, out_b, lb, *, read_zero_weight: bool = True):
    """:func:`merge` on float64 tensors on any device, lse natural: (out, lse, ((a_a, read out_a, la with 0 for an
    empty side), (the same for b))). An empty side (lse +-inf) has weight 0 and its out is not read; with
    ``read_zero_weight=False`` neither is the out of a side whose weight underflows to 0."""
    ea, eb = torch.isinf(la), torch.isinf(lb)
    la0, lb0 = torch.where(ea, 0.0, la), torch.where(eb, 0.0, lb)
    m = torch.where(ea, lb0, torch.where(eb, la0, torch.maximum(la0, lb0)))
    wa = torch.where(ea, 0.0, torch.exp(la0 - m))
    wb = torch.where(eb, 0.0, torch.exp(lb0 - m))
    total = wa + wb
    both = ea & eb
    aa = torch.where(both, 0.0, wa / torch.where(both, 1.0, total))
    ab = torch.where(both, 0.0, wb / torch.where(both, 1.0, total))
    skip_a, skip_b = (ea, eb) if read_zero_weight else (ea | (aa == 0), eb | (ab == 0))
    oa = torch.where(skip_a[..., None], 0.0, out_a)   # an empty side is never read
    ob = torch.where(skip_b[..., None], 0.0, out_b)
    out = aa[..., None] * oa + ab[..., None] * ob
    lse = torch.where(both, math.inf, m + torch.log(torch.where(both, 1.0, total)))
    return out, lse, ((aa, oa, la0), (ab, ob, lb0))


def merge_by_lse(out1, lse1, out2, lse2, base: str = "e"):
    """:func:`merge` in the decode layout, on the tensors' own device: two partial attentions over disjoint key sets
    (split-KV), out [B, s_q, h, D], lse [B, h, s_q] in ``base``; a part with no keys (lse +inf or -inf) counts as
    empty. Returns (out float64, lse float64 natural, [B, h, s_q]). Stricter than :func:`merge` where a suite
    merges an implementation's own parts: a part whose weight underflows to 0 is not read either (its out may hold
    anything), while NaN in a part that has keys stays NaN and a NaN lse gives NaN (never zeroed: the merge must
    not hide a broken part)."""
    l1 = lse_to_natural(lse1.to(F64), base).transpose(1, 2)          # [B, s_q, h]
    l2 = lse_to_natural(lse2.to(F64), base).transpose(1, 2)
    out, lse, _ = _merge_natural(out1.to(F64), l1, out2.to(F64), l2, read_zero_weight=False)
    nan = torch.isnan(l1) | torch.isnan(l2)                          # a NaN lse is not a part without keys
    lse = torch.where(nan, math.nan, lse)
    out = torch.where(nan[..., None], math.nan, out)
    return out, lse.transpose(1, 2)


__all__ = ["decode", "prefill", "sparse_prefill", "merge", "merge_by_lse", "lse_to_natural", "natural_to_base", "to_natural"]
