"""``QuantizedLatentCache``: reference-absorbed's latent cache for ``kv_codec != "none"``.

The layout (which buffers per token, how values become bytes and back) is the codec's
(:mod:`mla_conformance.kv.codecs`); this class only stores it in [B, capacity, *shape] buffers, plus the
codec's global buffers (e.g. int8-tensor's scale, shape (1,)).
"""

from __future__ import annotations

import torch

from mla_conformance.dtypes import FP8_E4M3_MAX
from mla_conformance.kv.caches.slots import LatentSlotCache
from mla_conformance.kv.codecs import get_codec
from mla_conformance.model.dsa_reference import FP8_INDEXER_BLOCK


def write_encoded(cache, c: torch.Tensor, k_pe: torch.Tensor, lengths: torch.Tensor) -> None:
    """Encode c / k_pe with ``cache.codec`` and store each part with ``cache.write``; the first write with a
    valid token calibrates the codec's global buffers (``cache._globals``). Shared by the contiguous and
    the paged quantized caches."""
    if int(lengths.sum()) == 0:
        return
    if not cache.calibrated:
        valid = torch.arange(c.shape[1], device=c.device)[None, :] < lengths.to(c.device)[:, None]
        for name, value in cache.codec.calibrate(c[valid], k_pe[valid]).items():
            cache._globals[name].copy_(value)
        cache.calibrated = True
    for name, values in cache.codec.encode(c, k_pe, cache.dtype, cache._globals).items():
        cache.write(name, values, lengths)


class QuantizedLatentCache(LatentSlotCache):
    """``write_latent`` encodes on write (the first write with a valid token calibrates the global
    buffers); ``read_latent`` decodes the first T slots into the cache dtype, zeros where a row holds
    no token."""

    def __init__(self, config, *, batch_size: int, capacity: int, dtype: torch.dtype, device, kv_codec: str):
        codec = get_codec(kv_codec)
        reason = codec.unsupported_reason(config, dtype)
        if reason:
            raise ValueError(reason)
        bufs = {name: torch.zeros(batch_size, capacity, *shape, dtype=dt, device=device)
                for name, (shape, dt) in codec.storage(config, dtype).items()}
        super().__init__(bufs, batch_size=batch_size, capacity=capacity, device=device, config=config,
                         kv_codec=kv_codec)
        self.codec = codec
        self.dtype = dtype
        self._globals = {name: torch.zeros(*shape, dtype=dt, device=device)
                         for name, (shape, dt) in codec.global_storage(config).items()}
        self.calibrated = not self._globals

    def tensors(self) -> dict[str, torch.Tensor]:
        return {**self._buffers, **self._globals}

    def global_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._globals.values())

    def active_nbytes(self) -> int:
        tokens = int(self.seq_lens.sum())
        return tokens * self.slot_nbytes() + (self.global_nbytes() if tokens else 0)

    def write_latent(self, c: torch.Tensor, k_pe: torch.Tensor, lengths: torch.Tensor) -> None:
        write_encoded(self, c, k_pe, lengths)

    def read_latent(self, T: int, new_lens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        lens = self.seq_lens if new_lens is None else new_lens
        parts = {name: buf[:, :T] for name, buf in self._buffers.items()}
        c, k_pe = self.codec.decode(parts, self.dtype, self._globals)
        valid = self.valid_slots(T, lens)[..., None]
        zero = torch.zeros((), dtype=c.dtype, device=c.device)
        return torch.where(valid, c, zero), torch.where(valid, k_pe, zero.to(k_pe.dtype))




class FP8IndexerLatentCache(QuantizedLatentCache):
    """DSA's FP8 cache (``kv_codec="fp8-e4m3-flashmla"`` with ``cache_format="latent+indexer"``): the codec's
    656-byte latent row plus ``index_k``, one packed uint8 row per token as DeepSeek's indexer cache holds it:
    index_head_dim float8_e4m3fn values, then one float32 power-of-two scale per block of 128 values
    (128 + 4 = 132 B at V3.2 dims): 788 B per token."""

    last_topk_indices = None
    #: the indexer key's storage, declared (mla_conformance.checks.INDEXER_FORMATS)
    indexer_format = "fp8-e4m3-block128"

    def __init__(self, config, *, batch_size: int, capacity: int, dtype: torch.dtype, device, kv_codec: str):
        super().__init__(config, batch_size=batch_size, capacity=capacity, dtype=dtype, device=device,
                         kv_codec=kv_codec)
        d = config.index_head_dim
        self.index_dim = d
        self.index_block = min(FP8_INDEXER_BLOCK, d)
        if d % self.index_block:
            raise ValueError(f"index_head_dim {d} is not a multiple of the FP8 block {self.index_block}")
        self._buffers["index_k"] = torch.zeros(batch_size, capacity, d + 4 * (d // self.index_block),
                                               dtype=torch.uint8, device=device)

    def write_index_k(self, k: torch.Tensor, lengths: torch.Tensor) -> None:
        kb = k.to(torch.float32).unflatten(-1, (-1, self.index_block))
        amax = kb.abs().amax(-1, keepdim=True).clamp_min(1e-4)
        scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_E4M3_MAX)))
        q = (kb / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).flatten(-2).to(torch.float8_e4m3fn)
        row = torch.cat([q.view(torch.uint8), scale.squeeze(-1).contiguous().view(torch.uint8)], dim=-1)
        self.write("index_k", row, lengths)

    def read_index_k(self, T: int, new_lens: torch.Tensor) -> torch.Tensor:
        """Dequantized keys [B, T, d] in float32, zeros (selected) where a row holds no token."""
        row = self._buffers["index_k"][:, :T]
        d = self.index_dim
        q = row[..., :d].contiguous().view(torch.float8_e4m3fn).to(torch.float32).unflatten(-1, (-1, self.index_block))
        scale = row[..., d:].contiguous().view(torch.float32)
        k = (q * scale[..., None]).flatten(-2)
        valid = self.valid_slots(T, new_lens)[..., None]
        return torch.where(valid, k, torch.zeros((), dtype=k.dtype, device=k.device))
