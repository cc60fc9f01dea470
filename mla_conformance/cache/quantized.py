"""``QuantizedLatentCache``: reference-absorbed's latent cache for ``kv_codec != "none"``.

The layout (which buffers per token, how values become bytes and back) is the codec's
(:mod:`mla_conformance.codecs`); this class only stores it in [B, capacity, *shape] buffers, plus the
codec's global buffers (e.g. int8-tensor's scale, shape (1,)).
"""

from __future__ import annotations

import torch

from mla_conformance.cache.slots import LatentSlotCache
from mla_conformance.codecs import get_codec


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
        if int(lengths.sum()) == 0:
            return
        if not self.calibrated:
            valid = torch.arange(c.shape[1], device=c.device)[None, :] < lengths.to(c.device)[:, None]
            for name, value in self.codec.calibrate(c[valid], k_pe[valid]).items():
                self._globals[name].copy_(value)
            self.calibrated = True
        for name, values in self.codec.encode(c, k_pe, self.dtype, self._globals).items():
            self.write(name, values, lengths)

    def read_latent(self, T: int, new_lens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        lens = self.seq_lens if new_lens is None else new_lens
        parts = {name: buf[:, :T] for name, buf in self._buffers.items()}
        c, k_pe = self.codec.decode(parts, self.dtype, self._globals)
        valid = self.valid_slots(T, lens)[..., None]
        zero = torch.zeros((), dtype=c.dtype, device=c.device)
        return torch.where(valid, c, zero), torch.where(valid, k_pe, zero.to(k_pe.dtype))
