"""Filling a backend's cache with ``context`` real tokens per row, without a quadratic prefill.

Prefilling 16k-32k tokens through ``attend()`` is quadratic and infeasible on a CPU, so the built-in caches
are filled directly with *real* latents: random hidden states (RMS ~1, like a normed layer input,
:func:`hidden_chunk`) go through :func:`mla_conformance.model.reference.project` in chunks, giving the
normed latent ``c`` and the rotated ``k_pe`` of positions ``0..context-1``; then

* ``SlotCache`` with buffers ``k``/``v`` (reference-naive): ``expand_kv(c, k_pe)`` written with ``write``;
* ``LatentSlotCache`` and the quantized caches of :mod:`mla_conformance.kv.codecs`: ``write_latent`` (the
  codec encodes, as in a real prefill);
* a "latent+indexer" cache (reference-dsa): the indexer keys of the same hidden states
  (``dsa_reference.indexer_project``) next to the latents;
* ``HFCache`` (hf-transformers): one ``DynamicCache.update`` with the tensors in the layout this
  transformers stores, found by a one-token probe ``attend`` on a scratch cache (5.x: the latent,
  keys ``[B,1,T,kv_lora]`` / values ``[B,1,T,rope]``; 4.x: expanded per-head K/V ``[B,H,T,d]``), then
  ``slot_pos``/``seq_lens`` set to match;
* any other backend: chunked ``attend()`` prefill of the same hidden states (slow, a note goes to stderr).

The hidden states of every token are a function of (seed, position) only (:func:`hidden_chunk`), so the
correctness gate (:mod:`mla_conformance.perf.gate`) recomputes exactly what the cache was filled from.
"""

from __future__ import annotations

from typing import Any

import torch

from mla_conformance.contract.layer import cache_format_of
from mla_conformance.impl.backends.hf import HFCache
from mla_conformance.kv.caches import LatentSlotCache, SlotCache
from mla_conformance.model import reference
from mla_conformance.model import dsa_reference as dsa_ref

#: Tokens per projection chunk while filling a cache.
FILL_CHUNK = 2048
#: Tokens per attend() call of the slow fill (a backend whose cache bench cannot fill directly).
ATTEND_CHUNK = 512


def hidden_chunk(cfg, start: int, n: int, batch: int, seed: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states [B, n, hidden] and positions [B, n] of tokens start..start+n-1 (start a multiple of
    FILL_CHUNK): the same for latents, indexer keys, the slow fill and the gate's oracle."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + start)
    x = torch.randn(batch, n, cfg.hidden_size, generator=gen).to(device=device, dtype=dtype)
    return x, torch.arange(start, start + n, device=device).expand(batch, n)


def chunk_starts(context: int):
    """(start, n) of each FILL_CHUNK-token chunk of positions 0..context-1."""
    return [(start, min(FILL_CHUNK, context - start)) for start in range(0, context, FILL_CHUNK)]


def indexer_chunks(weights, context: int, batch: int, seed: int, device) -> list[torch.Tensor]:
    """The indexer keys [B, n, index_head_dim] of the hidden states :func:`latent_chunks` projects, chunk by chunk."""
    out = []
    with torch.no_grad():
        for start, n in chunk_starts(context):
            x, pos = hidden_chunk(weights.config, start, n, batch, seed, device, weights.dtype)
            out.append(dsa_ref.indexer_project(weights, x, pos)[1])
    return out


_LATENTS: dict[tuple, tuple[Any, list]] = {}


def latent_chunks(weights, context: int, batch: int, seed: int, device) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """[(start, c [B,n,kv_lora], k_pe [B,n,rope])] for positions 0..context-1 of random hidden states.

    Cached (a few entries) per weights/context/batch/seed/device: the suite fills many caches alike.
    """
    key = (id(weights), context, batch, seed, str(device))
    hit = _LATENTS.get(key)
    if hit is not None and hit[0] is weights:
        return hit[1]
    chunks = []
    with torch.no_grad():
        for start, n in chunk_starts(context):
            x, pos = hidden_chunk(weights.config, start, n, batch, seed, device, weights.dtype)
            _, _, c, k_pe = reference.project(weights, x, pos)
            chunks.append((start, c, k_pe))
    while len(_LATENTS) >= 3:
        _LATENTS.pop(next(iter(_LATENTS)))
    _LATENTS[key] = (weights, chunks)
    return chunks


def fill_kind(backend, cache) -> str:
    """How ``prepare`` fills this cache: "expanded", "latent", "latent+indexer", "hf" or "attend"."""
    if isinstance(cache, HFCache):
        # a DSA DynamicCache also holds indexer keys, which DynamicCache.update does not fill: through attend()
        return "attend" if getattr(cache.config, "dsa", False) else "hf"
    if not type(cache).__module__.startswith("mla_conformance."):
        return "attend"
    if isinstance(cache, LatentSlotCache) and cache_format_of(backend, cache) == "latent+indexer":
        return "latent+indexer" if hasattr(cache, "write_index_k") or "index_k" in cache.tensors() else "attend"
    if isinstance(cache, LatentSlotCache) or (isinstance(cache, SlotCache) and hasattr(cache, "write_latent")):
        return "latent"
    if isinstance(cache, SlotCache) and set(cache.tensors()) == {"k", "v"}:
        return "expanded"
    return "attend"


def hf_layout(backend, weights, device) -> str:
    """"latent" or "expanded": what this transformers stores, from a one-token probe on a scratch cache."""
    cfg = weights.config
    probe = backend.new_cache(cfg, batch_size=1, capacity=2, dtype=weights.dtype, device=device)
    x = torch.zeros(1, 1, cfg.hidden_size, dtype=weights.dtype, device=device)
    pos = torch.zeros(1, 1, dtype=torch.int64, device=device)
    backend.attend(weights, x, pos, probe)
    kv = probe.tensors()
    if not kv:
        raise RuntimeError("hf-transformers stored nothing in its DynamicCache after one token")
    k, v = kv["layers.0.keys"], kv["layers.0.values"]
    if k.shape[1] == 1 and k.shape[-1] == cfg.kv_lora_rank and v.shape[-1] == cfg.qk_rope_head_dim:
        return "latent"
    if k.shape[1] == cfg.num_attention_heads and k.shape[-1] == cfg.qk_head_dim and v.shape[-1] == cfg.v_head_dim:
        return "expanded"
    raise RuntimeError(f"unrecognised transformers cache layout: keys {tuple(k.shape)}, values {tuple(v.shape)}")


def fill(backend, weights, cache, kind: str, context: int, batch: int, seed: int, device, say) -> None:
    """Put tokens 0..context-1 of every row into ``cache`` the way ``kind`` (:func:`fill_kind`) says."""
    dev = torch.device(device)
    if kind == "attend":
        say(f"{backend.name}: no direct fill for {type(cache).__name__}; prefilling {context} tokens through "
            "attend() in chunks (slow: quadratic in the context)")
        with torch.no_grad():
            for start, n in chunk_starts(context):
                x, _ = hidden_chunk(weights.config, start, n, batch, seed, dev, weights.dtype)
                for off in range(0, n, ATTEND_CHUNK):
                    h = x[:, off:off + ATTEND_CHUNK]
                    pos = cache.seq_lens.to(dev)[:, None] + torch.arange(h.shape[1], device=dev)
                    backend.attend(weights, h, pos, cache)
        return
    chunks = latent_chunks(weights, context, batch, seed, dev)
    if kind == "hf":
        layout = hf_layout(backend, weights, dev)
        with torch.no_grad():
            if layout == "latent":
                keys = torch.cat([c for _, c, _ in chunks], dim=1)[:, None]
                values = torch.cat([k for _, _, k in chunks], dim=1)[:, None]
            else:
                ks, vs = zip(*(reference.expand_kv(weights, c, k) for _, c, k in chunks))
                keys = torch.cat(ks, dim=1).transpose(1, 2)
                values = torch.cat(vs, dim=1).transpose(1, 2)
            cache.fill(keys, values)
        return
    index_keys = indexer_chunks(weights, context, batch, seed, dev) if kind == "latent+indexer" else None
    with torch.no_grad():
        for i, (_, c, k_pe) in enumerate(chunks):
            n = c.shape[1]
            if kind == "latent+indexer":  # the indexer keys at the slots append_latent then fills and commits
                every = torch.full((batch,), n, dtype=torch.int64, device=dev)
                if hasattr(cache, "write_index_k"):
                    cache.write_index_k(index_keys[i], every)
                else:
                    cache.write("index_k", index_keys[i], every)
                cache.append_latent(c, k_pe)
            elif kind == "latent":
                cache.append_latent(c, k_pe)
            else:
                k, v = reference.expand_kv(weights, c, k_pe)
                cache.append({"k": k, "v": v})
