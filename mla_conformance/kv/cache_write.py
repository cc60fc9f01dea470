"""What a cache writer (the op contract's ``write``, vLLM's ``concat_and_cache_mla``) must leave in a paged
cache, byte for byte, for each format it may write (mla_conformance.contract.op.WRITE_KV_FORMATS):

* ``"latent"``: token t's row [kv_c | k_pe] in the cache dtype, at slot s = block * page + offset;
* ``"fp8-e4m3-flashmla"``: the 656-byte row of mla_conformance.kv.codecs.encode_flashmla_fp8 (FlashMLA's
  tests/quant.py V32_FP8Sparse; the tile-scale convention "pow2" or "fp32");
* ``"fp8-e4m3-model1"``: the two spans of mla_conformance.kv.model1 (UE8M0 scales only).

A negative slot writes nothing; every byte outside the written tokens' spans is unchanged. Caches are handled
as their block memory, uint8 [num_blocks, block_bytes].
"""

from __future__ import annotations

import torch

from mla_conformance.kv import model1
from mla_conformance.kv.codecs import FLASHMLA_ROW_BYTES, encode_flashmla_fp8


def row_bytes(kv_format: str, elem_size: int, width: int) -> int:
    """Bytes of one token's row in a per-token layout (latent: width values of elem_size bytes; 656)."""
    return width * elem_size if kv_format == "latent" else FLASHMLA_ROW_BYTES


def block_bytes(kv_format: str, page: int, elem_size: int = 2, width: int = 576) -> int:
    """Bytes of one page block of the format."""
    if kv_format == model1.NAME:
        return model1.block_bytes(page)
    return page * row_bytes(kv_format, elem_size, width)


def spans(kv_format: str, page: int, offset: int, elem_size: int = 2, width: int = 576) -> list[tuple[int, int]]:
    """(start, length) of the bytes of token ``offset`` within its block."""
    if kv_format == model1.NAME:
        return list(model1.spans(page, offset))
    n = row_bytes(kv_format, elem_size, width)
    return [(offset * n, n)]


def encode(kv_format: str, kv_c: torch.Tensor, k_pe: torch.Tensor, *, cache_dtype: torch.dtype,
           scale_format: str = "pow2") -> list[torch.Tensor]:
    """Per span of :func:`spans`, uint8 [T, length]: what token t's spans must hold."""
    if kv_format == "latent":
        row = torch.cat([kv_c, k_pe], dim=-1).to(cache_dtype).contiguous()
        return [row.view(torch.uint8)]
    if kv_format == "fp8-e4m3-flashmla":
        return [encode_flashmla_fp8(kv_c, k_pe, scale_format)]
    if kv_format == model1.NAME:
        return list(model1.encode(kv_c, k_pe))
    raise ValueError(f"kv_format {kv_format!r}: not a format a writer writes")


def expected(kv_format: str, blocks: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
             slot_mapping: torch.Tensor, *, page: int, cache_dtype: torch.dtype, scale_format: str = "pow2",
             width: int = 576) -> tuple[torch.Tensor, torch.Tensor]:
    """(the block memory after the write, a bool mask of the bytes the write sets) from ``blocks`` (uint8
    [num_blocks, block_bytes], the memory before) and the write's inputs."""
    elem = torch.empty(0, dtype=cache_dtype).element_size()
    out = blocks.clone()
    mask = torch.zeros_like(blocks, dtype=torch.bool)
    parts = encode(kv_format, kv_c.detach().cpu(), k_pe.detach().cpu(), cache_dtype=cache_dtype,
                   scale_format=scale_format)
    for t, slot in enumerate(slot_mapping.detach().cpu().long().tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, page)
        for (start, length), part in zip(spans(kv_format, page, offset, elem, width), parts):
            out[block, start:start + length] = part[t]
            mask[block, start:start + length] = True
    return out, mask


__all__ = ["row_bytes", "block_bytes", "spans", "encode", "expected"]
