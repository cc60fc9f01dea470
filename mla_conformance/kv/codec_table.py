"""Bytes per token of every latent codec, measured from real caches (``mla-conformance codecs`` prints them).

For each layout of :mod:`mla_conformance.kv.codecs`: payload and metadata bytes per token per layer, measured
by writing tokens into reference-absorbed caches (:class:`mla_conformance.kv.caches.QuantizedLatentCache`)
and checked against the layout formula; whole-model bytes; ratios against the plain latent and the
expanded caches; and the latent quantization study's (seed 001's) metadata-free sizes next to the
honest ones.
"""

from __future__ import annotations

from typing import Any

import torch

from mla_conformance.kv.codecs import (CODECS, QUANT_STUDY_EXPANDED_BYTES, QUANT_STUDY_LAYERS, QUANT_STUDY_SCHEMES, _elem,
                                    get_codec)
from mla_conformance.model.config import MLAConfig
from mla_conformance.kv import cache_write, model1
from mla_conformance.kv.caches import QuantizedLatentCache
from mla_conformance.dtypes import dtype_name

# --------------------------------------------------------------------------- measured bytes


def measure_bytes(codec_name: str, config: MLAConfig, dtype: torch.dtype, *, batch: int = 2, tokens: int = 5,
                  device="cpu", seed: int = 0) -> dict[str, int]:
    """Write ``tokens`` random latents per row into reference-absorbed's cache; bytes per token per layer."""
    cache = QuantizedLatentCache(config, batch_size=batch, capacity=tokens + 3, dtype=dtype, device=device,
                                 kv_codec=codec_name)
    gen = torch.Generator().manual_seed(seed)
    c = torch.randn(batch, tokens, config.kv_lora_rank, generator=gen).to(device=device, dtype=dtype)
    k_pe = torch.randn(batch, tokens, config.qk_rope_head_dim, generator=gen).to(device=device, dtype=dtype)
    cache.append_latent(c, k_pe)
    n = batch * tokens
    active = int(cache.active_nbytes())
    global_bytes = int(cache.global_nbytes())
    tensor_bytes = sum(t.numel() * t.element_size() for t in cache.tensors().values())
    return {"tokens": n, "active_nbytes": active, "global_bytes": global_bytes,
            "bytes_per_token_layer": (active - global_bytes) // n, "remainder": (active - global_bytes) % n,
            "allocated_nbytes": int(cache.allocated_nbytes()), "tensor_bytes": tensor_bytes}


def quant_study_figures(config: MLAConfig, dtype: torch.dtype) -> dict[str, Any]:
    """Seed 001's two headline sizes (metadata-free) next to the honest ones of the codecs it maps to."""
    base = QUANT_STUDY_EXPANDED_BYTES
    out: dict[str, Any] = {"source": "seed 001 (DeepSeek-V2-Lite, 27 layers; ratio base 10,240 B/layer x 27 = "
                                     "276,480 B/token expanded BF16)",
                           "expanded_bytes_per_token": base, "layers": QUANT_STUDY_LAYERS, "schemes": []}
    for scheme in ("production: absorbed + per-channel INT8", "extreme: absorbed + asymmetric INT4"):
        info = QUANT_STUDY_SCHEMES[scheme]
        seed_layer = info["bytes_per_token_layer"]
        seed_model = seed_layer * QUANT_STUDY_LAYERS
        row = {"scheme": scheme, "reported": info["reported"], "seed_bytes_per_token_layer": seed_layer,
               "seed_model_bytes_per_token": seed_model, "seed_model_kib": round(seed_model / 1024, 4),
               "seed_ratio_vs_expanded": round(base / seed_model, 4), "honest": []}
        for name in (info["codec"], info["alt_codec"]):
            b = get_codec(name).bytes_per_token(config, dtype)
            model = b["total"] * config.num_hidden_layers
            row["honest"].append({"codec": name, "payload": b["payload"], "metadata": b["metadata"],
                                  "total": b["total"], "model_bytes_per_token": model,
                                  "model_kib": round(model / 1024, 4), "ratio_vs_expanded": round(base / model, 4),
                                  "difference_bytes": model - seed_model,
                                  "difference_pct": round(100 * (model - seed_model) / seed_model, 2)})
        out["schemes"].append(row)
    return out


def kernel_layouts() -> list[dict[str, Any]]:
    """The FP8 layouts the op contract's ``write`` and ``decode`` take, at their own dims, whatever the preset:
    FlashMLA's 656-byte V3.2 row (the ``fp8-e4m3-flashmla`` codec) and its 584-byte MODEL1 layout; per token the
    layout's bytes and those a write sets (mla_conformance.kv.cache_write's spans), per page block its size."""
    v32 = get_codec("fp8-e4m3-flashmla")
    v32_row = {"name": v32.name, "description": v32.description, "dims": "d_qk 576 = 512 + 64",
               **v32.bytes_per_token(MLAConfig.preset("deepseek-v3"), torch.bfloat16),
               "written_bytes_per_token": sum(n for _, n in cache_write.spans(v32.name, 64, 0)),
               "page_block_size": 64, "block_bytes": cache_write.block_bytes(v32.name, 64), "kpe": v32.kpe}
    return [v32_row, model1.layout_row()]


def codec_table(preset: str, dtype: torch.dtype, device="cpu") -> dict[str, Any]:
    """Per codec: measured bytes per token per layer (checked against the formula), whole model, ratios."""
    config = MLAConfig.preset(preset)
    elem = _elem(dtype)
    latent, expanded = config.latent_dim * elem, config.expanded_dim * elem
    rows = []
    for name, codec in CODECS.items():
        row: dict[str, Any] = {"name": name, "description": codec.description, "kpe": codec.kpe,
                               "quant_study": codec.quant_study}
        reason = codec.unsupported_reason(config, dtype)
        if reason:
            row["unsupported"] = reason
            rows.append(row)
            continue
        formula = codec.bytes_per_token(config, dtype)
        measured = measure_bytes(name, config, dtype, device=device)
        if (measured["bytes_per_token_layer"] != formula["total"] or measured["remainder"]
                or measured["global_bytes"] != codec.global_nbytes(config)
                or measured["allocated_nbytes"] != measured["tensor_bytes"]):
            raise AssertionError(f"kv_codec {name}: measured {measured} disagrees with the formula {formula}")
        total = formula["total"]
        row.update(payload=formula["payload"], metadata=formula["metadata"], total=total,
                   measured_bytes_per_token_layer=measured["bytes_per_token_layer"],
                   global_bytes=measured["global_bytes"],
                   model_bytes_per_token=total * config.num_hidden_layers,
                   ratio_vs_latent=round(latent / total, 4), ratio_vs_expanded=round(expanded / total, 4))
        rows.append(row)
    out = {"preset": preset, "dtype": dtype_name(dtype), "layers": config.num_hidden_layers,
           "latent_bytes_per_token_layer": latent, "expanded_bytes_per_token_layer": expanded, "codecs": rows,
           "kernel_layouts": kernel_layouts()}
    if preset == "deepseek-v2-lite":
        out["quant_study"] = quant_study_figures(config, dtype)
    else:
        out["quant_study"] = {"applies": False, "reason": "seed 001 measured DeepSeek-V2-Lite; run with "
                                                       "--preset deepseek-v2-lite for its figures"}
    return out
