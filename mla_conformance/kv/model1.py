"""FlashMLA's MODEL1 FP8 KV cache (``FP8KVCacheLayout.MODEL1_FP8Sparse`` in its tests/quant.py), 584 bytes per
token: d_qk 512 = 448 nope + 64 rope, the nope part in seven 64-value tiles of float8_e4m3fn, each with a UE8M0
scale (a power of two stored as one float8_e8m0fnu byte), the rope part in bfloat16, never quantized.

Laid out per page block, not per token (quant.py's ``quantize_k_cache``)::

    bytes [0, page * 576)                  token o at o * 576: 448 e4m3 (nope / its tile's scale), 64 bf16 rope
    bytes [page * 576, page * 584)         token o at page * 576 + o * 8: 7 e8m0 scales, 1 byte of padding
    then padding up to a multiple of 576   (block_bytes)

The cache a kernel is handed is that block memory viewed as uint8 [num_blocks, page, 1, 584] (block stride
``block_bytes(page)``): its "rows" are a shape, not tokens -- token o's bytes are the two spans above.
Scale = 2^ceil(log2(max(amax / 448, 1e-4))) per tile (quant.py's ``_cast_scale_inv_to_ue8m0``); dequantize =
e4m3.to(bf16) * scale.to(bf16) (exact: 3 mantissa bits times a power of two).
"""

from __future__ import annotations

import torch

from mla_conformance.dtypes import FP8_E4M3_MAX
from mla_conformance.kv.codecs import FLASHMLA_SCALE_FLOOR

NAME = "fp8-e4m3-model1"
D_NOPE = 448
D_ROPE = 64
D_QK = D_NOPE + D_ROPE
TILE = 64
TILES = D_NOPE // TILE
#: per token: 448 e4m3 + 64 x 2 bf16 rope (the 576-byte part), 7 scale bytes + 1 padding byte
PART_BYTES = D_NOPE + 2 * D_ROPE
SCALE_BYTES = TILES + 1
TOKEN_BYTES = PART_BYTES + SCALE_BYTES
#: a block is padded to a multiple of this many bytes
BLOCK_ALIGN = 576


def block_bytes(page: int) -> int:
    """Bytes per page block: page x 584, rounded up to a multiple of 576."""
    return -(-page * TOKEN_BYTES // BLOCK_ALIGN) * BLOCK_ALIGN


def cache_view(blocks: torch.Tensor, page: int) -> torch.Tensor:
    """uint8 [num_blocks, block_bytes(page)] block memory -> the [num_blocks, page, 1, 584] view a kernel takes."""
    return blocks[:, :page * TOKEN_BYTES].unflatten(1, (page, 1, TOKEN_BYTES))


def block_memory(cache: torch.Tensor) -> torch.Tensor:
    """The [num_blocks, page, 1, 584] view -> its block memory [num_blocks, page * 584] (a view, strided)."""
    num_blocks, page = cache.shape[:2]
    return torch.as_strided(cache, (num_blocks, page * TOKEN_BYTES), (cache.stride(0), 1), cache.storage_offset())


def spans(page: int, offset: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(start, length) of token ``offset``'s two parts within its block: 576 payload bytes, then its 7 scales
    (its eighth scale byte is padding: not written)."""
    return (offset * PART_BYTES, PART_BYTES), (page * PART_BYTES + offset * SCALE_BYTES, TILES)


def scales(nope: torch.Tensor) -> torch.Tensor:
    """[..., 448] -> [..., 7] float32 power-of-two tile scales, 2^ceil(log2(max(amax / 448, 1e-4)))."""
    amax = nope.to(torch.float32).unflatten(-1, (TILES, TILE)).abs().amax(-1)
    return torch.pow(2.0, torch.clamp_min(amax / FP8_E4M3_MAX, FLASHMLA_SCALE_FLOOR).log2().ceil())


def encode(kv_c: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_c [T, 448], k_pe [T, 64] -> (payload uint8 [T, 576]: e4m3 nope then bf16 rope, scales uint8 [T, 7]:
    e8m0 bytes), as quant.py's quantize_k_cache writes them."""
    if kv_c.shape[-1] != D_NOPE or k_pe.shape[-1] != D_ROPE:
        raise ValueError(f"{NAME}: expected kv_c [..., {D_NOPE}] and k_pe [..., {D_ROPE}], got "
                         f"{tuple(kv_c.shape)} and {tuple(k_pe.shape)}")
    s = scales(kv_c)
    q = (kv_c.to(torch.float32).unflatten(-1, (TILES, TILE)) / s[..., None]).flatten(-2).to(torch.float8_e4m3fn)
    rope = k_pe.to(torch.bfloat16).contiguous().view(torch.uint8)
    return torch.cat([q.view(torch.uint8), rope], dim=-1), s.to(torch.float8_e8m0fnu).view(torch.uint8)


def decode(cache: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The [num_blocks, page, 1, 584] view -> [num_blocks, page, 1, 512] in ``dtype`` (e4m3 x e8m0 scale in
    bfloat16, as quant.py's dequantize_k_cache; then the bf16 rope)."""
    num_blocks, page = cache.shape[:2]
    mem = block_memory(cache)
    part = mem[:, :page * PART_BYTES].unflatten(1, (page, PART_BYTES))
    scale = mem[:, page * PART_BYTES:page * TOKEN_BYTES].unflatten(1, (page, SCALE_BYTES))[..., :TILES]
    nope = part[..., :D_NOPE].contiguous().view(torch.float8_e4m3fn).to(torch.bfloat16).unflatten(-1, (TILES, TILE))
    s = scale.contiguous().view(torch.float8_e8m0fnu).to(torch.bfloat16)
    rope = part[..., D_NOPE:].contiguous().view(torch.bfloat16)
    row = torch.cat([(nope * s[..., None]).flatten(-2), rope], dim=-1)
    return row.to(dtype).unsqueeze(2)


def encode_rows(rows: torch.Tensor) -> torch.Tensor:
    """KV rows [n, 512] -> unpaged MODEL1 rows uint8 [n, 584]: the token's 576-byte part, its 7 scale bytes and
    one zero padding byte (a V4 cache's window rows and compressed entries, one row per slot)."""
    payload, s = encode(rows[:, :D_NOPE], rows[:, D_NOPE:])
    return torch.cat([payload, s, s.new_zeros(s.shape[0], 1)], -1)


def decode_rows(rows: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Unpaged MODEL1 rows uint8 [n, 584] -> values [n, 512] (e4m3 x e8m0 scale in bfloat16, exact; the bf16
    rope), in ``dtype``."""
    nope = rows[:, :D_NOPE].contiguous().view(torch.float8_e4m3fn).to(torch.bfloat16)
    s = rows[:, PART_BYTES:PART_BYTES + TILES].contiguous().view(torch.float8_e8m0fnu).to(torch.bfloat16)
    nope = (nope.unflatten(-1, (TILES, TILE)) * s[..., None]).flatten(-2)
    rope = rows[:, D_NOPE:PART_BYTES].contiguous().view(torch.bfloat16)
    return torch.cat([nope, rope], -1).to(dtype)


def stored_f64(rows: torch.Tensor) -> torch.Tensor:
    """KV rows [n, 512] as MODEL1 stores them, read back in float64 (the float64 V4 oracle's ``store``)."""
    if rows.shape[0] == 0:
        return rows
    return decode_rows(encode_rows(rows), torch.float64)


def bytes_per_token() -> dict[str, int]:
    """payload (448 e4m3 + 64 bf16) + metadata (7 scales + 1 padding byte) = 584."""
    return {"payload": D_NOPE + 2 * D_ROPE, "metadata": SCALE_BYTES, "total": TOKEN_BYTES}


DESCRIPTION = ("FlashMLA MODEL1 FP8 layout (tests/quant.py MODEL1_FP8Sparse): d_qk 512 = 448 nope + 64 rope; per "
               "token 448 x float8_e4m3fn (7 tiles of 64, UE8M0 scales) + 64 x bf16 rope + 7 e8m0 scale bytes + 1 "
               "padding byte; per page block the 576-byte parts, then the 8-byte scale groups, padded to 576 B")


def layout_row(page: int = 64) -> dict:
    """The layout's bytes (``budget`` and ``codecs`` list it): per token, the bytes a write sets (its two spans),
    and a page block's size with its padding."""
    return {"name": NAME, "description": DESCRIPTION, "dims": f"d_qk {D_QK} = {D_NOPE} + {D_ROPE}",
            **bytes_per_token(), "written_bytes_per_token": sum(n for _, n in spans(page, 0)),
            "page_block_size": page, "block_bytes": block_bytes(page),
            "kpe": "kept in bfloat16 (the last 128 bytes of each token's 576-byte part, unquantized)"}


__all__ = ["NAME", "D_NOPE", "D_ROPE", "D_QK", "TILE", "TILES", "TOKEN_BYTES", "block_bytes", "cache_view",
           "block_memory", "spans", "scales", "encode", "decode", "bytes_per_token", "layout_row", "DESCRIPTION"]
