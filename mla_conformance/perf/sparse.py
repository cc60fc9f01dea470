"""Bytes one DeepSeek Sparse Attention decode step reads, dense vs sparse, from bytes per token measured on a cache.

**Sparse decode bytes** (:func:`sparse_decode_bytes`, in every ``bench --json`` as ``sparse_decode_bytes``):
bytes one DSA decode step reads per row and layer, dense vs sparse, at deepseek-v3.2 dims (contexts 16k and
32k, and the command's own above index_topk when its preset is a DSA one). Dense MLA reads every cached latent
row: N x latent B/token. A sparse step reads the indexer key of every cached token (to score them) and the
latent rows of the selection only: min(index_topk, N) x latent + N x indexer B/token. Bytes per token are
*measured*: reference-dsa's cache (BF16, and the FP8 form with kv_codec fp8-e4m3-flashmla) is allocated at
those dims, poisoned, written with a few tokens, and the bytes that no longer hold the poison are counted per
buffer (latent buffers apart from the indexer key buffer), then checked against
``checks.format_bytes_per_token``.
"""

from __future__ import annotations

from typing import Any

import torch

from mla_conformance.checks.layer.bytes import format_bytes_per_token, measure_written_bytes
from mla_conformance.contract.calls import call_backend, tensors_of_checked
from mla_conformance.errors import MLAInputError
from mla_conformance.impl.backends.reference import ReferenceDSA
from mla_conformance.kv.caches.measure import poison
from mla_conformance.model.config import MLAConfig
from mla_conformance.perf.step import resolve_dtype


#: Preset and contexts of ``sparse_decode_bytes`` in every ``bench`` report.
SPARSE_PRESET = "deepseek-v3.2"
SPARSE_CONTEXTS = (16384, 32768)
#: The cache forms compared: (dtype, kv_codec) of reference-dsa's latent + indexer cache.
SPARSE_FORMS = (("bfloat16", "none"), ("bfloat16", "fp8-e4m3-flashmla"))


def measured_dsa_bytes_per_token(preset: str, dtype, kv_codec: str = "none", device="cpu") -> dict[str, Any]:
    """Bytes per token of reference-dsa's "latent+indexer" cache at ``preset``'s dims, measured from its tensors
    (``checks.layer.bytes.measure_written_bytes``, the suites' measurement): allocated, poisoned (0xFF, and a 0x00 run
    united with it where the cache has byte storage), written with 4 tokens through the cache's own write methods,
    written bytes counted per buffer.
    Returns latent (every buffer but the indexer key's), indexer and total bytes per token, per buffer too,
    checked against ``checks.format_bytes_per_token``."""
    dtype = resolve_dtype(dtype)
    config = MLAConfig.preset(preset)
    backend = ReferenceDSA()
    reason = backend.unsupported_reason(config, dtype=dtype, device=str(device), kv_codec=kv_codec)
    if reason:
        raise ValueError(reason)
    n = 4
    gen = torch.Generator().manual_seed(0)
    c, k_pe, k_i = (torch.randn(1, n, width, generator=gen).to(device=device, dtype=dtype)
                    for width in (config.kv_lora_rank, config.qk_rope_head_dim, config.index_head_dim))
    where = f"reference-dsa cache ({preset} {kv_codec})"

    def fill(sentinel: int):
        cache = backend.new_cache(config, batch_size=1, capacity=n, dtype=dtype, device=device, kv_codec=kv_codec)
        poisoned = poison(cache, tensors_of_checked(call_backend(cache, "tensors"), where), batch_size=1, capacity=n,
                          sentinel=sentinel, name=where)
        every = torch.full((1,), n, dtype=torch.int64, device=device)
        if hasattr(cache, "write_index_k"):
            cache.write_index_k(k_i, every)
        else:
            cache.write("index_k", k_i, every)
        cache.append_latent(c, k_pe)
        return cache, poisoned

    per_buffer = {k: v / n for k, v in measure_written_bytes(fill, where).written.items() if v}
    indexer = per_buffer.get("index_k", 0)
    total = sum(per_buffer.values())
    want = format_bytes_per_token(config, "latent+indexer", dtype, kv_codec)
    if total != want:
        raise RuntimeError(f"reference-dsa {preset} {kv_codec}: measured {total} B/token ({per_buffer}), the "
                           f"latent+indexer format says {want}")
    return {"latent": int(total - indexer), "indexer": int(indexer), "total": int(total),
            "buffers": {k: int(v) for k, v in per_buffer.items()}}


def sparse_decode_bytes(preset: str = SPARSE_PRESET, contexts=SPARSE_CONTEXTS, forms=SPARSE_FORMS,
                        device="cpu") -> dict[str, Any]:
    """Bytes one decode step reads per row and layer, dense MLA vs DeepSeek Sparse Attention, from the measured
    bytes per token (:func:`measured_dsa_bytes_per_token`): dense = N x latent; sparse = min(index_topk, N) x
    latent + N x indexer (every indexer key is scored, only the selection's latent rows are read)."""
    config = MLAConfig.preset(preset)
    if not config.dsa:
        raise MLAInputError(f"{preset} has no DeepSeek Sparse Attention (index_topk None)")
    out: dict[str, Any] = {"preset": preset, "index_topk": config.index_topk, "forms": {},
                           "what": "bytes read per decode step, per row and layer: dense = N x latent B/token; sparse = "
                                   "min(index_topk, N) x latent + N x indexer B/token (measured from reference-dsa's "
                                   "cache tensors)"}
    for dtype, kv_codec in forms:
        name = dtype if kv_codec == "none" else kv_codec
        try:
            per_token = measured_dsa_bytes_per_token(preset, dtype, kv_codec, device)
        except ValueError as exc:  # a form this preset's dims do not have (FP8's 656-byte row needs 512/64)
            out["forms"][name] = {"dtype": dtype, "kv_codec": kv_codec, "skipped": str(exc)}
            continue
        rows = []
        for N in contexts:
            dense = N * per_token["latent"]
            sparse = min(config.index_topk, N) * per_token["latent"] + N * per_token["indexer"]
            rows.append({"context": N, "dense_bytes": dense, "sparse_bytes": sparse,
                         "sparse_latent_bytes": min(config.index_topk, N) * per_token["latent"],
                         "sparse_indexer_bytes": N * per_token["indexer"], "dense_over_sparse": dense / sparse})
        out["forms"][name] = {"dtype": dtype, "kv_codec": kv_codec, "bytes_per_token": per_token, "contexts": rows}
    return out
