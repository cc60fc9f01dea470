"""Prefill over cached context in "MHA mode" through an op's ``prefill`` and ``merge``, and cache fills through its
``write``, as serving engines run them (vLLM's MLA backends: ``_compute_prefill_context`` and
``_forward_prefill`` in vllm/v1/attention/backends/mla/common.py; SGLang's chunked-KV MHA path), for
:class:`mla_conformance.impl.ops.layer.OpBackend`.

For the rows of one layer call that append more than one token (the prefill rows; one-token rows are decode),
row b with C_b cached tokens and n_b new ones::

    kv      = c kv_b_proj^T viewed [n, H, nope + v]      k_nope = kv[..., :nope], v = kv[..., nope:] (a strided view)
    k       = [k_nope | k_pe broadcast over the H heads]    [n, H, nope + rope], in the model dtype
    chunk j = positions j W .. (j + 1) W - 1 of every prefill row's context (kv_len 0 for a row whose context
              has ended, or that has none, while another row's goes on), read from the cache (the suite's gather
              and dequantization, as vLLM's gather_cache), up-projected as above;
              part j = op.prefill(q_new, k_j, v_j, cu_seqlens_q, cu_seqlens_k_j, causal=False)
    suffix  = op.prefill(q_new, k_new, v_new, cu_q, cu_q, causal=True)    the new tokens' own K / V (the fresh
              latent, not the cache: vLLM's suffix)
    out     = merge(... merge(merge(part 0, part 1), part 2) ..., suffix)  (lse converted from prefill_lse_base to
              merge_lse_base, as an engine's glue must); no context: out = suffix

W is :data:`CONTEXT_CHUNK` (24: not a multiple of the 16- or 64-token pages, so chunks hold parts of pages; the
suite's 160-token context runs in 7 chunks). q_new = [q_nope | q_pe] per head. The up-projection runs in float32
(float64 for float64 weights) and is rounded once to the model dtype, as a GEMM with a float32 accumulator does.

The cache fill (:func:`write_reason`, :func:`write_latent`): every token of the call through one ``op.write``,
slot = block * page + offset of its position, -1 for the padding tokens of shorter rows (vLLM's padded
``slot_mapping``).
"""

from __future__ import annotations

import math

import torch

from mla_conformance.contract.op import D_QK, D_V, MethodCase, declared, has_method, takes_head_dims

#: context tokens per chunk (per row) of the MHA-mode prefill
CONTEXT_CHUNK = 24
#: how many queries the gating cases of prefill / merge name
GATING_TOKENS = 2


def prefill_dims(config) -> tuple[int, int]:
    """(d_qk, d_v) of the layer's per-head q / k and v in MHA mode: qk_nope + qk_rope, v_head_dim."""
    return int(config.qk_nope_head_dim) + int(config.qk_rope_head_dim), int(config.v_head_dim)


def gating_cases(config, *, dtype, device, merge_lse_base: str = "e") -> list[MethodCase]:
    """What the MHA-mode prefill hands the op: the causal pass over the new tokens, a context chunk (rows without
    keys: a row whose context ended; v a strided view) and a merge with empty sides."""
    d_qk, d_v = prefill_dims(config)
    h = int(config.num_attention_heads)
    common = dict(h_q=h, h_k=h, d_qk=d_qk, d_v=d_v, tokens=GATING_TOKENS, batch=1, strided=True, device=str(device))
    return [MethodCase("prefill", dtype, causal=True, **common),
            MethodCase("prefill", dtype, causal=False, rows_without_keys=True, **common),
            MethodCase("merge", dtype, h_q=h, d_v=d_v, tokens=GATING_TOKENS, rows_without_keys=True,
                       lse_base=merge_lse_base, device=str(device))]


def prefill_reason(op, config, *, dtype, device) -> str | None:
    """Why the layer's prefill rows cannot go through the op's prefill and merge (None: they do)."""
    missing = [m for m in ("prefill", "merge") if not has_method(op, m)]
    if missing:
        return f"op {op.name} has no {' and no '.join(m + '()' for m in missing)}"
    d_qk, d_v = prefill_dims(config)
    dims = declared(op, "prefill_head_dims")
    if dims != "any" and (d_qk, d_v) not in dims:
        return (f"op {op.name} declares prefill_head_dims {dims}, not this config's {d_qk} / {d_v} "
                f"(qk_nope {config.qk_nope_head_dim} + rope {config.qk_rope_head_dim}, v {config.v_head_dim})")
    for case in gating_cases(config, dtype=dtype, device=device, merge_lse_base=declared(op, "merge_lse_base")):
        reason = op.unsupported_reason(case)
        if reason:
            return reason
    return None


def write_reason(op, config, *, dtype, device, kv_format: str, page_block_size: int) -> str | None:
    """Why the layer's cache cannot be filled by the op's write (None: it is). The FP8 656-byte cache is the layer
    codec's (power-of-two tile scales, which every FP8 decode reads): an op writing plain float32 scales
    (``write_fp8_scale_format = "fp32"``) leaves the cache to the suite."""
    if not has_method(op, "write"):
        return f"op {op.name} has no write()"
    formats = declared(op, "write_kv_formats")
    if kv_format not in formats:
        return f"op {op.name} writes kv formats {', '.join(formats)}, not {kv_format!r}"
    pages = declared(op, "write_page_block_sizes")
    if page_block_size not in pages:
        return f"op {op.name} writes pages of {', '.join(map(str, pages))} tokens, not {page_block_size}"
    if kv_format == "fp8-e4m3-flashmla" and declared(op, "write_fp8_scale_format") != "pow2":
        return (f"op {op.name} writes fp32 tile scales (write_fp8_scale_format 'fp32'); the layer's FP8 cache holds "
                "power-of-two scales (the fp8-e4m3-flashmla codec's)")
    d_qk, d_v = int(config.kv_lora_rank) + int(config.qk_rope_head_dim), int(config.kv_lora_rank)
    if (d_qk, d_v) != (D_QK, D_V) and not takes_head_dims(op, d_qk, d_v):
        return f"op {op.name} is handed latents of {D_V} + {D_QK - D_V} only (head_dims), not {d_v} + {d_qk - d_v}"
    return op.unsupported_reason(MethodCase("write", dtype, d_qk=d_qk, d_v=d_v, tokens=GATING_TOKENS,
                                            kv_format=kv_format, page_block_size=page_block_size,
                                            device=str(device)))


# --------------------------------------------------------------------------- write


def write_latent(op, cache, c: torch.Tensor, k_pe: torch.Tensor, lengths: torch.Tensor, kv_format: str) -> None:
    """Write row b's first lengths[b] tokens of c [B, S, kv_lora] / k_pe [B, S, rope] at positions seq_lens[b] + i
    of the paged cache with one ``op.write`` (padding tokens: slot -1; left out for an op that declares
    ``write_padding_slot = "dummy-slot-0"``, which is never handed a negative slot and whose dummy slot this cache
    does not reserve); the cache's written lengths follow."""
    B, S = c.shape[:2]
    dev = cache.block_table.device
    lengths = lengths.to(dev, torch.int64)
    i = torch.arange(S, device=dev)
    valid = i[None, :] < lengths[:, None]
    pos = (cache.seq_lens.to(dev)[:, None] + i[None, :]).clamp(max=max(cache.capacity - 1, 0))
    rows = torch.arange(B, device=dev)[:, None].expand(B, S)
    slots = torch.where(valid, cache.slot_index(rows, pos), torch.full_like(pos, -1)).reshape(-1).to(torch.int64)
    c, k_pe = c.reshape(B * S, -1), k_pe.reshape(B * S, -1)
    if declared(op, "write_padding_slot") != "negative":
        keep = valid.reshape(-1).to(c.device)
        c, k_pe, slots = c[keep], k_pe[keep], slots[valid.reshape(-1)]
    if slots.numel():
        op.write(c, k_pe, cache.kv_pages, slots, kv_format=kv_format)
    cache.written = torch.maximum(cache.written, cache.seq_lens + lengths.to(cache.seq_lens.device))


# --------------------------------------------------------------------------- prefill


def _checked(op, method: str, result, n: int, shapes: list[tuple], dtypes: list) -> tuple:
    if not (isinstance(result, tuple) and len(result) == n):
        raise TypeError(f"op {op.name}: {method}() returned {type(result).__name__}, not a tuple of {n}")
    for k, (t, shape, dt) in enumerate(zip(result, shapes, dtypes)):
        name = ("out", "lse")[k]
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"op {op.name}: {method}() returned {name} {got}, expected {shape}")
        if dt is not None and t.dtype != dt:
            raise TypeError(f"op {op.name}: {method}() returned {name} in {t.dtype}, expected {dt}")
    return result


def _to_base(lse: torch.Tensor, src: str, dst: str) -> torch.Tensor:
    if src == dst:
        return lse
    return lse * math.log(2.0) if src == "2" else lse / math.log(2.0)


def up_project(weights, latent_c: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """c [n, kv_lora], k_pe [n, rope] (model dtype) -> k [n, H, nope + rope], v [n, H, v] (a strided view of the
    kv_b_proj output), in the model dtype."""
    cfg = weights.config
    H, nope = int(cfg.num_attention_heads), int(cfg.qk_nope_head_dim)
    dt = weights.dtype
    acc = torch.float64 if dt == torch.float64 else torch.float32
    wkv_b = weights["kv_b_proj.weight"].view(H, -1, cfg.kv_lora_rank)                 # [H, nope + v, c]
    kv = torch.einsum("nc,hdc->nhd", latent_c.to(acc), wkv_b.to(acc)).to(dt)            # [n, H, nope + v]
    k = torch.cat([kv[..., :nope], k_pe.to(dt)[:, None, :].expand(-1, H, -1)], dim=-1)
    return k, kv[..., nope:]


def _cu(lens) -> torch.Tensor:
    out = [0]
    for n in lens:
        out.append(out[-1] + int(n))
    return torch.tensor(out, dtype=torch.int32)


def mha_prefill(op, weights, q: torch.Tensor, new_c: torch.Tensor, new_kpe: torch.Tensor, new_lens: list[int],
                context, context_lens: list[int], *, chunk: int = CONTEXT_CHUNK) -> torch.Tensor:
    """The module docstring's steps for the prefill rows of one call: q [T, H, nope + rope] (the rows' new tokens
    one after another, ``new_lens`` each), new_c [T, kv_lora] / new_kpe [T, rope] their latents; ``context(r, a,
    e)`` -> (c [e - a, kv_lora], k_pe [e - a, rope]), positions a..e-1 of prefill row r's cached context
    (``context_lens`` tokens each). Returns out [T, H, v] in q's dtype."""
    cfg = weights.config
    H, d_v = int(cfg.num_attention_heads), int(cfg.v_head_dim)
    T = int(q.shape[0])
    dev = q.device
    scale = float(cfg.softmax_scale)
    cu_q = _cu(new_lens).to(dev)
    p_base, m_base = declared(op, "prefill_lse_base"), declared(op, "merge_lse_base")

    def prefill(k, v, cu_k, causal):
        result = op.prefill(q, k, v, cu_q, cu_k, softmax_scale=scale, causal=causal)
        out, lse = _checked(op, "prefill", result, 2, [(T, H, d_v), (T, H)], [None, torch.float32])
        return out, _to_base(lse, p_base, m_base)

    def merge(a, b):
        result = op.merge(a[0], a[1], b[0], b[1])
        return _checked(op, "merge", result, 2, [(T, H, d_v), (T, H)], [None, torch.float32])

    acc = None
    for j in range(-(-max(context_lens, default=0) // chunk)):
        spans = [(j * chunk, min(C, (j + 1) * chunk)) for C in context_lens]
        lens = [max(0, e - a) for a, e in spans]
        parts = [context(r, a, e) for r, (a, e) in enumerate(spans) if e > a]
        k, v = up_project(weights, torch.cat([p[0] for p in parts]).to(dev), torch.cat([p[1] for p in parts]).to(dev))
        part = prefill(k, v, _cu(lens).to(dev), False)
        acc = part if acc is None else merge(acc, part)
    k, v = up_project(weights, new_c, new_kpe)
    suffix = prefill(k, v, cu_q, True)
    out = suffix[0] if acc is None else merge(acc, suffix)[0]
    return out.to(q.dtype)


__all__ = ["CONTEXT_CHUNK", "prefill_dims", "gating_cases", "prefill_reason", "write_reason", "write_latent",
           "up_project", "mha_prefill"]
