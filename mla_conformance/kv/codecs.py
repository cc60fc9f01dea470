"""Quantized layouts ("KV codecs") of the absorbed latent cache, their byte formulas and error bounds.

A latent cache stores, per token and layer, the normed latent c (``kv_lora_rank`` values, 512 at DeepSeek
dims) and the rotated RoPE key k_pe (``qk_rope_head_dim``, 64). A codec says how those two are stored:
which buffers per token (``storage``), how values become bytes (``encode``) and back (``decode``), and how
many bytes that takes (``bytes_per_token``: payload = the stored values, quantized or not; metadata =
scales and zero points). The cache that stores them is :class:`mla_conformance.kv.caches.QuantizedLatentCache`;
the measured byte table and the ``codecs`` command are in :mod:`mla_conformance.kv.codec_table`.

Names follow ``<bits>-<kind>-<granularity>[-kpe-<k_pe bits>]``:

* granularity ``tensor`` (one scale for the whole cache), ``token`` (one scale per token over all of c),
  ``gN`` (one scale per group of N consecutive channels of one token: kv_lora / N groups per token);
* kind ``sym`` (q = round(x / s), s = amax / qmax) or ``asym`` (q = round((x - min) / s),
  s = (max - min) / (2^bits - 1); the group's min is stored as the zero point); int8 codecs are symmetric;
* without ``-kpe-...`` the RoPE key is kept in the cache dtype (it carries position; DeepSeek's own FP8
  layout keeps it in BF16 too); ``-kpe-int8`` / ``-kpe-int4`` quantize it symmetrically in 8-channel
  groups (seed 001's "k_pe INT8 (8 blocks)" / "k_pe symmetric INT4 (8 blocks)").

Every scale and zero point is float32 (4 bytes), as FlashMLA stores its FP8 scales; float16 metadata
would halve the metadata column. int4 and int2 values are packed little-end first: element 2j of a
group in the low nibble of byte j (int2: element 4j in bits 0-1). Symmetric int4 stores q + 8.

Seed 001 (DeepSeek-V2-Lite, L40S) counted 576 B/token/layer for its "per-channel INT8" production
scheme and 288 B for its "asymmetric INT4" one: all 576 values of c and k_pe at 8 or 4 bits, and no
scale or zero-point bytes. Its "32 blocks" over the 512 latent channels reads literally as 32 groups
of 16 channels (``-g16``); the common "group size 32" reading is ``-g32``; both are registered and
measured (:data:`QUANT_STUDY_SCHEMES`). A third reading, per-channel scales over blocks of 32 *tokens*
(KIVI's key quantization), cannot be written one token at a time and is not implemented.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import Any

import torch

from mla_conformance.dtypes import FP8_E4M3_MAX
from mla_conformance.model.config import MLAConfig

Storage = dict[str, tuple[tuple[int, ...], torch.dtype]]

#: FlashMLA's floor on amax / 448 before rounding the scale up to a power of two (its FP8_AMAX_MARGIN).
FLASHMLA_SCALE_FLOOR = 1e-4


FLASHMLA_TILE = 128
FLASHMLA_ROW_BYTES = 656


def flashmla_fp8_scales(c: torch.Tensor, scale_format: str = "pow2") -> torch.Tensor:
    """FlashMLA's tile scales [..., tiles] float32 of a latent [..., 512]: max(amax / 448, 1e-4) per 128 values,
    rounded up to a power of two under ``"pow2"`` (FlashMLA's ue8m0, what its kernels are tested with), kept
    as is under ``"fp32"`` (arbitrary float32 scales, a layout some writers use)."""
    amax = c.to(torch.float32).unflatten(-1, (-1, FLASHMLA_TILE)).abs().amax(-1)
    s = torch.clamp_min(amax / FP8_E4M3_MAX, FLASHMLA_SCALE_FLOOR)
    if scale_format == "pow2":
        return torch.pow(2.0, torch.log2(s).ceil())
    if scale_format == "fp32":
        return s
    raise ValueError(f"fp8 scale format {scale_format!r}: expected 'pow2' or 'fp32'")


def encode_flashmla_fp8(c: torch.Tensor, k_pe: torch.Tensor, scale_format: str = "pow2") -> torch.Tensor:
    """c [..., 512], k_pe [..., 64] -> FlashMLA's 656-byte rows, uint8 [..., 656]: 512 e4m3 (c / its tile's
    scale), 4 float32 scales, 64 bf16 rope (little-endian whatever the host)."""
    scale = flashmla_fp8_scales(c, scale_format)
    q = (c.to(torch.float32).unflatten(-1, (-1, FLASHMLA_TILE)) / scale[..., None]).flatten(-2)
    q = q.to(torch.float8_e4m3fn).view(torch.uint8)
    s = scale.to(torch.float32).contiguous().view(torch.uint8)
    if sys.byteorder != "little":
        s = s.unflatten(-1, (-1, 4)).flip(-1).flatten(-2)
    rope = k_pe.to(torch.bfloat16).contiguous().view(torch.uint8)
    return torch.cat([q, s, rope], dim=-1)


def decode_flashmla_fp8(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA's 656-byte rows -> (c [..., 512], k_pe [..., 64]) in ``dtype``. The e4m3 values are multiplied
    by their float32 scale in float32 at least (FlashMLA's dequantize: nope.float() * scale), so a bfloat16
    result never rounds the scale first."""
    if rows.dtype != torch.uint8 or rows.shape[-1] != FLASHMLA_ROW_BYTES:
        raise ValueError(f"expected uint8 [..., {FLASHMLA_ROW_BYTES}] rows, got {rows.dtype} {tuple(rows.shape)}")
    n = rows.shape[-1] - 16 - 128
    compute = torch.promote_types(dtype, torch.float32)
    q = rows[..., :n].contiguous().view(torch.float8_e4m3fn).to(compute)
    s = rows[..., n:n + 16].contiguous()
    if sys.byteorder != "little":
        s = s.unflatten(-1, (-1, 4)).flip(-1).flatten(-2).contiguous()
    scale = s.view(torch.float32).to(compute)
    c = (q.unflatten(-1, (-1, FLASHMLA_TILE)) * scale[..., None]).flatten(-2).to(dtype)
    k_pe = rows[..., n + 16:].contiguous().view(torch.bfloat16).to(dtype)
    return c, k_pe


def _elem(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _nbytes(storage: Storage) -> int:
    return sum(math.prod(shape) * _elem(dt) for shape, dt in storage.values())


# --------------------------------------------------------------------------- integer quantization


def _pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes [..., n] (each < 2^bits) -> bytes [..., n * bits / 8]; element i*per + k at bits k*bits."""
    if bits == 8:
        return q.to(torch.uint8)
    per = 8 // bits
    q = q.to(torch.int32).unflatten(-1, (-1, per))
    shifts = torch.arange(per, device=q.device, dtype=torch.int32) * bits
    return (q << shifts).sum(-1).to(torch.uint8)


def _unpack(b: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 8:
        return b.to(torch.int32)
    per = 8 // bits
    shifts = torch.arange(per, device=b.device, dtype=torch.int32) * bits
    return ((b.to(torch.int32)[..., None] >> shifts) & ((1 << bits) - 1)).flatten(-2)


def _safe(scale: torch.Tensor) -> torch.Tensor:
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def _sym_encode(x: torch.Tensor, group: int, bits: int, scale: torch.Tensor | None = None):
    """x [..., n] -> (stored codes, scale [..., n / group] float32). int8 codes are int8, narrower packed uint8."""
    qmax = (1 << (bits - 1)) - 1
    xg = x.to(torch.float32).unflatten(-1, (-1, group))
    if scale is None:
        scale = xg.abs().amax(-1) / qmax
    q = torch.round(xg / _safe(scale)[..., None]).clamp(-qmax, qmax).flatten(-2)
    if bits == 8:
        return q.to(torch.int8), scale
    return _pack((q + (1 << (bits - 1))).to(torch.int32), bits), scale


def _sym_decode(stored: torch.Tensor, scale: torch.Tensor, group: int, bits: int) -> torch.Tensor:
    q = stored.to(torch.float32) if bits == 8 else (_unpack(stored, bits) - (1 << (bits - 1))).to(torch.float32)
    return (q.unflatten(-1, (-1, group)) * scale[..., None]).flatten(-2)


def _asym_encode(x: torch.Tensor, group: int, bits: int):
    """x [..., n] -> (packed codes, scale, min) with x ~ q * scale + min, q in [0, 2^bits - 1]."""
    levels = (1 << bits) - 1
    xg = x.to(torch.float32).unflatten(-1, (-1, group))
    lo, hi = xg.amin(-1), xg.amax(-1)
    scale = (hi - lo) / levels
    q = torch.round((xg - lo[..., None]) / _safe(scale)[..., None]).clamp(0, levels).flatten(-2)
    return _pack(q.to(torch.int32), bits), scale, lo


def _asym_decode(stored, scale, lo, group: int, bits: int) -> torch.Tensor:
    q = _unpack(stored, bits).to(torch.float32).unflatten(-1, (-1, group))
    return (q * scale[..., None] + lo[..., None]).flatten(-2)


# --------------------------------------------------------------------------- codecs


class Codec:
    """One cache layout. Subclasses set ``name``, ``description``, ``kpe`` and implement the layout."""

    name: str = ""
    description: str = ""
    kpe: str = "kept in cache dtype"
    #: seed 001 scheme(s) this codec implements, for the markers table and the CLI.
    quant_study: str = ""

    # ---- layout
    def storage(self, config: MLAConfig, cache_dtype: torch.dtype) -> Storage:
        """Buffers stored per token: name -> (shape of one token's entry, dtype)."""
        raise NotImplementedError

    def global_storage(self, config: MLAConfig) -> Storage:
        """Buffers stored once per cache (not per token), e.g. a per-tensor scale."""
        return {}

    def bytes_per_token(self, config: MLAConfig, cache_dtype: torch.dtype) -> dict[str, int]:
        """The layout's formula, per token and layer: payload (values) + metadata (scales, zero points)."""
        raise NotImplementedError

    def global_nbytes(self, config: MLAConfig) -> int:
        return _nbytes(self.global_storage(config))

    def unsupported_reason(self, config: MLAConfig, cache_dtype: torch.dtype) -> str | None:
        if not torch.empty(0, dtype=cache_dtype).is_floating_point():
            return f"kv_codec {self.name} needs a floating-point cache dtype, got {cache_dtype}"
        return None

    # ---- values
    def calibrate(self, c: torch.Tensor, k_pe: torch.Tensor) -> dict[str, torch.Tensor]:
        """Values of the global buffers from a first write (c [N, kv_lora], k_pe [N, rope])."""
        return {}

    def encode(self, c: torch.Tensor, k_pe: torch.Tensor, cache_dtype: torch.dtype,
               globals: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """c [..., kv_lora], k_pe [..., rope] -> {buffer: [..., *shape per token]} in the buffers' dtypes."""
        raise NotImplementedError

    def decode(self, parts: dict[str, torch.Tensor], cache_dtype: torch.dtype,
               globals: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored buffers [..., *shape] -> (c [..., kv_lora], k_pe [..., rope]) in cache_dtype."""
        raise NotImplementedError

    def roundtrip(self, c: torch.Tensor, k_pe: torch.Tensor, cache_dtype: torch.dtype):
        """decode(encode(x)) with global buffers calibrated on this input (as a cache's first write)."""
        c, k_pe = c.to(cache_dtype), k_pe.to(cache_dtype)
        g = self.calibrate(c.reshape(-1, c.shape[-1]), k_pe.reshape(-1, k_pe.shape[-1]))
        return self.decode(self.encode(c, k_pe, cache_dtype, g), cache_dtype, g)

    def __repr__(self) -> str:
        return f"<codec {self.name}: {self.description}>"


class Unquantized(Codec):
    name = "none"
    description = "c and k_pe in the cache dtype (the plain absorbed cache)"
    quant_study = "absorbed MLA (30.4 KB/token)"

    def storage(self, config, cache_dtype):
        return {"kv_latent": ((config.kv_lora_rank,), cache_dtype), "k_pe": ((config.qk_rope_head_dim,), cache_dtype)}

    def bytes_per_token(self, config, cache_dtype):
        payload = config.latent_dim * _elem(cache_dtype)
        return {"payload": payload, "metadata": 0, "total": payload}

    def encode(self, c, k_pe, cache_dtype, globals=None):
        return {"kv_latent": c.to(cache_dtype), "k_pe": k_pe.to(cache_dtype)}

    def decode(self, parts, cache_dtype, globals=None):
        return parts["kv_latent"].to(cache_dtype), parts["k_pe"].to(cache_dtype)


class IntCodec(Codec):
    """Integer quantization of c per token-group (``group`` channels; None = the whole token), with
    k_pe kept in the cache dtype or quantized symmetrically in groups of ``kpe_group`` channels."""

    def __init__(self, name: str, *, bits: int, symmetric: bool, group: int | None,
                 kpe_bits: int | None = None, kpe_group: int = 8, quant_study: str = ""):
        self.name, self.bits, self.symmetric, self.group = name, bits, symmetric, group
        self.kpe_bits, self.kpe_group, self.quant_study = kpe_bits, kpe_group, quant_study
        gran = "per token (one scale over all kv_lora channels)" if group is None else \
            f"per {group}-channel group of each token"
        zp = "symmetric, float32 scale" if symmetric else "asymmetric, float32 scale + float32 min (zero point)"
        self.description = f"c INT{bits} {gran}, {zp}" + ("" if bits == 8 else f", {8 // bits} values per byte")
        self.kpe = ("kept in cache dtype" if kpe_bits is None else
                    f"quantized: symmetric INT{kpe_bits} per {kpe_group}-channel group, float32 scale")

    def _g(self, config) -> int:
        return config.kv_lora_rank if self.group is None else self.group

    def unsupported_reason(self, config, cache_dtype):
        base = super().unsupported_reason(config, cache_dtype)
        if base:
            return base
        g = self._g(config)
        if config.kv_lora_rank % g or (g * self.bits) % 8:
            return (f"kv_codec {self.name}: kv_lora_rank {config.kv_lora_rank} is not a whole number of "
                    f"{g}-channel groups of whole bytes")
        if self.kpe_bits is not None and (config.qk_rope_head_dim % self.kpe_group
                                          or (self.kpe_group * self.kpe_bits) % 8):
            return (f"kv_codec {self.name}: qk_rope_head_dim {config.qk_rope_head_dim} is not a whole number "
                    f"of {self.kpe_group}-channel groups")
        return None

    def storage(self, config, cache_dtype):
        n, r = config.kv_lora_rank, config.qk_rope_head_dim
        groups = n // self._g(config)
        out: Storage = {"c_q": ((n * self.bits // 8,), torch.int8 if self.bits == 8 else torch.uint8),
                        "c_scale": ((groups,), torch.float32)}
        if not self.symmetric:
            out["c_min"] = ((groups,), torch.float32)
        if self.kpe_bits is None:
            out["k_pe"] = ((r,), cache_dtype)
        else:
            out["kpe_q"] = ((r * self.kpe_bits // 8,), torch.int8 if self.kpe_bits == 8 else torch.uint8)
            out["kpe_scale"] = ((r // self.kpe_group,), torch.float32)
        return out

    def bytes_per_token(self, config, cache_dtype):
        n, r = config.kv_lora_rank, config.qk_rope_head_dim
        groups = n // self._g(config)
        payload = n * self.bits // 8
        metadata = groups * 4 * (1 if self.symmetric else 2)
        if self.kpe_bits is None:
            payload += r * _elem(cache_dtype)
        else:
            payload += r * self.kpe_bits // 8
            metadata += (r // self.kpe_group) * 4
        return {"payload": payload, "metadata": metadata, "total": payload + metadata}

    def encode(self, c, k_pe, cache_dtype, globals=None):
        g = c.shape[-1] if self.group is None else self.group
        if self.symmetric:
            c_q, scale = _sym_encode(c, g, self.bits)
            out = {"c_q": c_q, "c_scale": scale}
        else:
            c_q, scale, lo = _asym_encode(c, g, self.bits)
            out = {"c_q": c_q, "c_scale": scale, "c_min": lo}
        out.update(self._encode_kpe(k_pe, cache_dtype))
        return out

    def decode(self, parts, cache_dtype, globals=None):
        n = parts["c_q"].shape[-1] * 8 // self.bits
        g = n if self.group is None else self.group
        if self.symmetric:
            c = _sym_decode(parts["c_q"], parts["c_scale"], g, self.bits)
        else:
            c = _asym_decode(parts["c_q"], parts["c_scale"], parts["c_min"], g, self.bits)
        return c.to(cache_dtype), self._decode_kpe(parts, cache_dtype)

    # ---- k_pe, shared with the per-tensor codec
    def _encode_kpe(self, k_pe, cache_dtype):
        if self.kpe_bits is None:
            return {"k_pe": k_pe.to(cache_dtype)}
        q, s = _sym_encode(k_pe, self.kpe_group, self.kpe_bits)
        return {"kpe_q": q, "kpe_scale": s}

    def _decode_kpe(self, parts, cache_dtype):
        if self.kpe_bits is None:
            return parts["k_pe"].to(cache_dtype)
        return _sym_decode(parts["kpe_q"], parts["kpe_scale"], self.kpe_group, self.kpe_bits).to(cache_dtype)


class PerTensorInt8(IntCodec):
    """One float32 scale for the whole cache (per layer): amax of the first write / 127, then frozen.

    Later tokens larger than the first write's amax are clipped to +-127 steps: that is what a static
    per-tensor scale does, and why seed 001 found it "broken by outliers". The scale is a cache buffer of
    shape (1,) (``global_storage``), counted once in ``active_nbytes`` and ``allocated_nbytes``.
    """

    def __init__(self, name="int8-tensor", quant_study="per-tensor INT8"):
        super().__init__(name, bits=8, symmetric=True, group=None, quant_study=quant_study)
        self.description = ("c INT8 with one float32 scale for the whole cache, calibrated on the first write "
                            "(amax / 127) and kept; later values beyond it clip")

    def storage(self, config, cache_dtype):
        return {"c_q": ((config.kv_lora_rank,), torch.int8), "k_pe": ((config.qk_rope_head_dim,), cache_dtype)}

    def global_storage(self, config):
        return {"c_scale_tensor": ((1,), torch.float32)}

    def bytes_per_token(self, config, cache_dtype):
        payload = config.kv_lora_rank + config.qk_rope_head_dim * _elem(cache_dtype)
        return {"payload": payload, "metadata": 0, "total": payload}

    def calibrate(self, c, k_pe):
        amax = c.to(torch.float32).abs().amax() if c.numel() else torch.zeros((), device=c.device)
        return {"c_scale_tensor": (amax / 127).reshape(1)}

    def _scale(self, globals):
        if not globals or "c_scale_tensor" not in globals:
            raise ValueError(f"kv_codec {self.name}: encode/decode need the calibrated per-tensor scale "
                             "(globals={'c_scale_tensor': ...} from calibrate())")
        return globals["c_scale_tensor"].to(torch.float32)

    def encode(self, c, k_pe, cache_dtype, globals=None):
        scale = self._scale(globals)
        lead = c.shape[:-1]
        q, _ = _sym_encode(c, c.shape[-1], 8, scale.expand(*lead, 1) if lead else scale)
        return {"c_q": q, "k_pe": k_pe.to(cache_dtype)}

    def decode(self, parts, cache_dtype, globals=None):
        scale = self._scale(globals)
        q = parts["c_q"]
        c = _sym_decode(q, scale.expand(*q.shape[:-1], 1), q.shape[-1], 8)
        return c.to(cache_dtype), parts["k_pe"].to(cache_dtype)


class FlashMLAFP8(Codec):
    """FlashMLA's FP8 KV cache for DeepSeek-V3.2 (``FP8KVCacheLayout.V32_FP8Sparse``), 656 bytes per token.

    bytes 0..511   the 512 latent values as float8_e4m3fn, x / scale of their 128-value tile
    bytes 512..527 four float32 scales (native little-endian), one per 128-value tile
    bytes 528..655 the 64 RoPE values as bfloat16, copied unquantized

    Scale convention, read from FlashMLA ``tests/quant.py`` (``quantize_k_cache`` and
    ``_cast_scale_inv_to_ue8m0``, commit 520fec6a): scale = 2^ceil(log2(max(amax / 448, 1e-4))), i.e.
    amax / 448 rounded *up to a power of two* (a UE8M0-representable value, stored as float32), so
    x / scale never exceeds 448 and the division is exact; decode is fp8 * scale. A zero tile gets
    scale 2^-13.
    """

    name = "fp8-e4m3-flashmla"
    description = ("FlashMLA V3.2 FP8 layout: 512 x float8_e4m3fn + 4 x float32 tile scales (128 values each, "
                   "amax/448 rounded up to 2^k) + 64 x bf16 RoPE, one 656-byte row per token")
    kpe = "kept in bfloat16 (bytes 528..655, unquantized)"
    quant_study = ""
    TILE = 128

    def unsupported_reason(self, config, cache_dtype):
        if cache_dtype != torch.bfloat16:
            return f"kv_codec {self.name} is FlashMLA's BF16-model layout: it needs cache dtype bfloat16, got {cache_dtype}"
        if (config.kv_lora_rank, config.qk_rope_head_dim) != (512, 64):
            return (f"kv_codec {self.name} is laid out for kv_lora_rank 512 and qk_rope_head_dim 64; this config "
                    f"has {config.kv_lora_rank} and {config.qk_rope_head_dim}")
        return None

    def storage(self, config, cache_dtype):
        return {"kv": ((656,), torch.uint8)}

    def bytes_per_token(self, config, cache_dtype):
        return {"payload": 512 + 64 * 2, "metadata": 4 * 4, "total": 656}

    @classmethod
    def scales(cls, c: torch.Tensor) -> torch.Tensor:
        return flashmla_fp8_scales(c, "pow2")

    def encode(self, c, k_pe, cache_dtype, globals=None):
        return {"kv": encode_flashmla_fp8(c, k_pe, "pow2")}

    def decode(self, parts, cache_dtype, globals=None):
        return decode_flashmla_fp8(parts["kv"], cache_dtype)


def _registry() -> dict[str, Codec]:
    codecs: list[Codec] = [
        Unquantized(),
        PerTensorInt8(),
        IntCodec("int8-token", bits=8, symmetric=True, group=None, quant_study="per-token INT8"),
        IntCodec("int8-g16", bits=8, symmetric=True, group=16, quant_study="per-channel INT8 (32 blocks)"),
        IntCodec("int8-g32", bits=8, symmetric=True, group=32,
                 quant_study="per-channel INT8 (32 blocks), read as groups of 32"),
        IntCodec("int8-g16-kpe-int8", bits=8, symmetric=True, group=16, kpe_bits=8,
                 quant_study="production: absorbed + per-channel INT8 + k_pe INT8 (8 blocks) = 15.2 KB/token"),
        IntCodec("int8-g32-kpe-int8", bits=8, symmetric=True, group=32, kpe_bits=8,
                 quant_study="production scheme, read as groups of 32"),
        IntCodec("int4-sym-g16", bits=4, symmetric=True, group=16, quant_study="symmetric INT4 (32 blocks)"),
        IntCodec("int4-sym-g32", bits=4, symmetric=True, group=32,
                 quant_study="symmetric INT4 (32 blocks), read as groups of 32"),
        IntCodec("int4-asym-g16", bits=4, symmetric=False, group=16, quant_study="asymmetric INT4 (32 blocks)"),
        IntCodec("int4-asym-g32", bits=4, symmetric=False, group=32,
                 quant_study="asymmetric INT4 (32 blocks), read as groups of 32"),
        IntCodec("int4-asym-g16-kpe-int4", bits=4, symmetric=False, group=16, kpe_bits=4,
                 quant_study="extreme: absorbed + asymmetric INT4 + k_pe symmetric INT4 (8 blocks) = 7.6 KB/token"),
        IntCodec("int4-asym-g32-kpe-int4", bits=4, symmetric=False, group=32, kpe_bits=4,
                 quant_study="extreme scheme, read as groups of 32"),
        IntCodec("int2-asym-g32", bits=2, symmetric=False, group=32,
                 quant_study="INT2 (error 0.496, 'precision collapse'): the negative control"),
        FlashMLAFP8(),
    ]
    return {c.name: c for c in codecs}


#: Every codec by name, in the order the CLI and markers.md list them.
CODECS: dict[str, Codec] = _registry()


def get_codec(name: str) -> Codec:
    try:
        return CODECS[name]
    except KeyError:
        raise ValueError(f"unknown kv_codec {name!r}; known codecs: {', '.join(CODECS)}") from None


# --------------------------------------------------------------------------- seed 001 and error bounds

#: Seed 001's schemes -> our codecs, with the errors it reported (mean / max abs of the latent round
#: trip on real V2-Lite latents, as far as its table says) and, for its two headline schemes, its sizes.
QUANT_STUDY_SCHEMES: dict[str, dict[str, Any]] = {
    "per-tensor INT8": {"codec": "int8-tensor", "mean_err": 0.2979, "max_err": 0.7833},
    "per-channel INT8 (32 blocks)": {"codec": "int8-g16", "alt_codec": "int8-g32", "mean_err": 0.0109,
                                     "max_err": 0.0125},
    "per-token INT8": {"codec": "int8-token", "mean_err": 0.0636, "max_err": 0.0881},
    "symmetric INT4 (32 blocks)": {"codec": "int4-sym-g16", "alt_codec": "int4-sym-g32", "mean_err": 0.1116},
    "asymmetric INT4 (32 blocks)": {"codec": "int4-asym-g16", "alt_codec": "int4-asym-g32", "mean_err": 0.0786},
    "k_pe INT8 (8 blocks)": {"codec": "int8-g16-kpe-int8", "part": "k_pe", "mean_err": 0.0051},
    "k_pe symmetric INT4 (8 blocks)": {"codec": "int4-asym-g16-kpe-int4", "part": "k_pe", "mean_err": 0.0917},
    "INT2": {"codec": "int2-asym-g32", "mean_err": 0.496},
    "production: absorbed + per-channel INT8": {"codec": "int8-g16-kpe-int8", "alt_codec": "int8-g32-kpe-int8",
                                                "mean_err": 0.011, "bytes_per_token_layer": 576,
                                                "reported": "15.2 KB/token (17.8x)"},
    "extreme: absorbed + asymmetric INT4": {"codec": "int4-asym-g16-kpe-int4", "alt_codec": "int4-asym-g32-kpe-int4",
                                            "mean_err": 0.079, "bytes_per_token_layer": 288,
                                            "reported": "7.6 KB/token (35.6x)"},
}
#: Short form: seed 001 scheme name -> codec name.
CODEC_FOR_QUANT_STUDY: dict[str, str] = {k: v["codec"] for k, v in QUANT_STUDY_SCHEMES.items()}

#: Seed 001's ratio base: the expanded BF16 cache of V2-Lite, 10,240 B/layer x 27 layers.
QUANT_STUDY_EXPANDED_BYTES = 276_480
QUANT_STUDY_LAYERS = 27


@dataclasses.dataclass(frozen=True)
class ErrorBound:
    """Bounds on one codec's error (relative Frobenius, ||x_hat - x|| / ||x||).

    latent: decode(encode(c)) against c, on N(0, 1) latents and on the tiny trained model's latents;
    attention: the attention output with this codec against the same backend with kv_codec "none"
    (same weights, inputs and dtype), so only the cache's rounding differs.
    """

    latent: float
    attention: float
    reason: str


#: The one table of codec error bounds (markers.md's codec table is generated from it and CODECS:
#: `python tools/docs.py`); tests/test_quantized_kv.py holds every codec to it. Uniform rounding with step s has
#: rms error s / sqrt(12); the bounds follow the step each layout gives a group of values, at about 2x the worst
#: relative Frobenius error of N(0, 1) latents [2 x 128 x 512] in BF16, of the attention output of V2-Lite random
#: weights in BF16 (varlen prefill 13/6 + 1 decode step) and of both layers of the tiny trained model
#: (fixtures/models/tiny-mla, float32, its pinned prompts). The errors themselves are measured where they are
#: shown: the report's codec sections (suites/test_quantized_kv.py's figures) and tests/test_codecs.py.
ERROR_BOUNDS: dict[str, ErrorBound] = {
    "none": ErrorBound(0.0, 0.0, "the cache stores the values it is given: exact"),
    "int8-tensor": ErrorBound(3e-2, 3e-2, "one step (amax of the first write / 127) for every value, however small "
                                          "its channel"),
    "int8-token": ErrorBound(2e-2, 2.5e-2, "step = token amax over all kv_lora channels / 127"),
    "int8-g16": ErrorBound(1.2e-2, 2e-2, "step = amax of 16 channels / 127"),
    "int8-g32": ErrorBound(1.5e-2, 2e-2, "step = amax of 32 channels / 127"),
    "int8-g16-kpe-int8": ErrorBound(1.2e-2, 2e-2, "int8-g16, plus k_pe INT8 per 8 channels"),
    "int8-g32-kpe-int8": ErrorBound(1.5e-2, 2e-2, "int8-g32, plus k_pe INT8 per 8 channels"),
    "int4-sym-g16": ErrorBound(2e-1, 2.5e-1, "7 steps each side of 0 per 16 channels (amax / 7)"),
    "int4-sym-g32": ErrorBound(2.5e-1, 2.8e-1, "7 steps each side of 0 per 32 channels"),
    "int4-asym-g16": ErrorBound(1.4e-1, 1.8e-1, "15 steps over [min, max] of 16 channels: no level is wasted on "
                                                "the side a group does not reach"),
    "int4-asym-g32": ErrorBound(1.8e-1, 2.2e-1, "15 steps over [min, max] of 32 channels"),
    "int4-asym-g16-kpe-int4": ErrorBound(1.5e-1, 2e-1, "int4-asym-g16, plus k_pe symmetric INT4 per 8 channels: "
                                                       "every score moves"),
    "int4-asym-g32-kpe-int4": ErrorBound(1.8e-1, 2.3e-1, "int4-asym-g32, plus k_pe symmetric INT4 per 8 channels"),
    "int2-asym-g32": ErrorBound(8e-1, 9e-1, "negative control: 4 levels per 32 channels; it must land over 5x "
                                            "beyond every INT8 bound"),
    "fp8-e4m3-flashmla": ErrorBound(5e-2, 7e-2, "e4m3 keeps 3 mantissa bits (relative step 2^-3 within a binade); "
                                                "the power-of-two tile scale costs no precision"),
}
