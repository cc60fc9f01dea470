"""Contiguous slot caches: slot t of row b holds the token at position t.

``SlotCache`` is the reference backends' storage; ``LatentSlotCache`` is the absorbed path's (latent c
and rotated k_pe). Reads *select* zeros (``torch.where``) at every slot at or beyond a row's written
length: those slots hold whatever the allocation left there (the suite fills them with NaN), and
masking by multiplication would not do, because 0 * NaN is NaN.
"""

from __future__ import annotations

import torch


class SlotCache:
    """Per-row contiguous slots.

    ``buffers`` maps a name to a tensor [B, capacity, ...]; every buffer holds one entry per slot, so
    active bytes = stored tokens x (bytes of one slot across all buffers).
    """

    def __init__(self, buffers: dict[str, torch.Tensor], *, batch_size: int, capacity: int,
                 device, config, kv_codec: str = "none"):
        self.batch_size = batch_size
        self.capacity = capacity
        self.config = config
        self.kv_codec = kv_codec
        self.seq_lens = torch.zeros(batch_size, dtype=torch.int64, device=device)
        self._buffers = buffers

    # ------------------------------------------------------------------ bytes
    def tensors(self) -> dict[str, torch.Tensor]:
        """The cache's own buffers (not copies), by name."""
        return dict(self._buffers)

    def allocated_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def slot_nbytes(self) -> int:
        return sum(t[0, 0].numel() * t.element_size() for t in self._buffers.values())

    def active_nbytes(self) -> int:
        return int(self.seq_lens.sum()) * self.slot_nbytes()

    # ------------------------------------------------------------------ write
    def write_plan(self, positions: torch.Tensor, lengths: torch.Tensor | None):
        """Validate one attend call; return (lengths [B], new seq_lens [B])."""
        B, S = positions.shape
        if B != self.batch_size:
            raise ValueError(f"batch of {B} rows for a cache of {self.batch_size}")
        lengths = (torch.full((B,), S, dtype=torch.int64, device=positions.device)
                   if lengths is None else lengths.to(device=positions.device, dtype=torch.int64))
        if bool(((lengths < 0) | (lengths > S)).any()):
            raise ValueError(f"lengths {lengths.tolist()} outside [0, {S}]")
        new = self.seq_lens.to(positions.device) + lengths
        if int(new.max()) > self.capacity:
            raise ValueError(f"cache overflow: {new.tolist()} tokens for capacity {self.capacity}")
        expect = self.seq_lens.to(positions.device)[:, None] + torch.arange(S, device=positions.device)
        valid = torch.arange(S, device=positions.device)[None, :] < lengths[:, None]
        if bool((positions.ne(expect) & valid).any()):
            raise ValueError("positions must equal cache.seq_lens[b] + i for valid tokens")
        return lengths, new

    def write(self, name: str, values: torch.Tensor, lengths: torch.Tensor) -> None:
        """Store values [B, S, ...] of the valid tokens at slots seq_lens[b] + i (seq_lens unchanged)."""
        buf = self._buffers[name]
        for b in range(self.batch_size):
            n, start = int(lengths[b]), int(self.seq_lens[b])
            if n:
                buf[b, start:start + n] = values[b, :n].to(buf.dtype)

    def commit(self, new_lens: torch.Tensor) -> None:
        """End of an attend call: the written tokens become part of the rows."""
        self.seq_lens = new_lens.to(self.seq_lens.device, torch.int64)

    def append(self, values: dict[str, torch.Tensor], lengths: torch.Tensor | None = None) -> None:
        """Public fill API (benchmarks, tools): write values {buffer: [B, n, ...]} after each row's tokens
        and advance seq_lens -- what attend does, without attention."""
        B, n = next(iter(values.values())).shape[:2]
        dev = self.seq_lens.device
        positions = self.seq_lens[:, None] + torch.arange(n, device=dev)[None, :]
        lengths, new = self.write_plan(positions, lengths)
        for name, v in values.items():
            self.write(name, v, lengths)
        self.commit(new)

    def rewind(self, length: int) -> None:
        """Public API for benchmarks: forget every token past ``length`` per row (slots are reused)."""
        self.commit(torch.clamp(self.seq_lens, max=int(length)))

    # ------------------------------------------------------------------ read
    def valid_slots(self, T: int, new_lens: torch.Tensor) -> torch.Tensor:
        """[B, T] bool: slot t of row b holds a token (t < new_lens[b])."""
        dev = self.seq_lens.device
        return torch.arange(T, device=dev)[None, :] < new_lens.to(dev)[:, None]

    def read(self, name: str, T: int, new_lens: torch.Tensor) -> torch.Tensor:
        """The first T slots of every row of buffer ``name``; zeros (selected, never multiplied) where a
        row holds no token.

        When every row holds all T slots (a decode step of equal rows, the benchmarks') there is nothing to
        select: the buffer's own slots are returned as a view, read in place by the attention that follows
        (a ``torch.where`` over them would copy the whole cache every step: one more read and one write of
        every cached byte). Callers only read what this returns.
        """
        buf = self._buffers[name][:, :T]
        if bool((new_lens >= T).all()):
            return buf
        valid = self.valid_slots(T, new_lens).reshape(self.batch_size, T, *([1] * (buf.dim() - 2)))
        return torch.where(valid, buf, torch.zeros((), dtype=buf.dtype, device=buf.device))

    def allowed(self, lengths: torch.Tensor, new_lens: torch.Tensor, S: int, T: int) -> torch.Tensor:
        """[B, S, T] mask: query i of row b sees slots <= its position and < the row's new length."""
        dev = self.seq_lens.device
        qpos = self.seq_lens[:, None] + torch.arange(S, device=dev)[None, :]
        t = torch.arange(T, device=dev)
        return (t[None, None, :] <= qpos[:, :, None]) & (t[None, None, :] < new_lens.to(dev)[:, None, None])


class LatentSlotCache(SlotCache):
    """The absorbed path's cache: ``kv_latent`` [B, capacity, kv_lora] and ``k_pe`` [B, capacity, rope].

    Quantized (:class:`~mla_conformance.kv.caches.QuantizedLatentCache`) and paged
    (:class:`~mla_conformance.kv.caches.PagedLatentCache`) caches implement the same ``write_latent`` /
    ``read_latent``, so the attention code does not change with the storage.
    """

    @classmethod
    def allocate(cls, config, *, batch_size: int, capacity: int, dtype, device) -> "LatentSlotCache":
        bufs = {
            "kv_latent": torch.zeros(batch_size, capacity, config.kv_lora_rank, dtype=dtype, device=device),
            "k_pe": torch.zeros(batch_size, capacity, config.qk_rope_head_dim, dtype=dtype, device=device),
        }
        return cls(bufs, batch_size=batch_size, capacity=capacity, device=device, config=config)

    def write_latent(self, c: torch.Tensor, k_pe: torch.Tensor, lengths: torch.Tensor) -> None:
        self.write("kv_latent", c, lengths)
        self.write("k_pe", k_pe, lengths)

    def append_latent(self, c: torch.Tensor, k_pe: torch.Tensor, lengths: torch.Tensor | None = None) -> None:
        """Public fill API: append c [B, n, kv_lora] and rotated k_pe [B, n, rope] and advance seq_lens."""
        dev = self.seq_lens.device
        positions = self.seq_lens[:, None] + torch.arange(c.shape[1], device=dev)[None, :]
        lengths, new = self.write_plan(positions, lengths)
        self.write_latent(c, k_pe, lengths)
        self.commit(new)

    def read_latent(self, T: int, new_lens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The first T slots of every row, in the cache dtype: (c [B, T, kv_lora], k_pe [B, T, rope]),
        zeros where a row holds no token (``new_lens``: the rows' lengths including this call's tokens;
        default seq_lens)."""
        lens = self.seq_lens if new_lens is None else new_lens
        return self.read("kv_latent", T, lens), self.read("k_pe", T, lens)


class IndexerLatentCache(LatentSlotCache):
    """DeepSeek Sparse Attention's cache (``cache_format = "latent+indexer"``): the latent buffers plus
    ``index_k`` [B, capacity, index_head_dim], the lightning indexer's key per token (rotated and
    Hadamard-transformed, in the cache dtype). Reads select zeros past each row's length like the others.

    ``last_topk_indices``: the last attend call's selection, [B, S, index_topk] int64, -1 padded (None
    before the first call).
    """

    last_topk_indices = None

    @classmethod
    def allocate(cls, config, *, batch_size: int, capacity: int, dtype, device) -> "IndexerLatentCache":
        if not getattr(config, "dsa", False):
            raise ValueError("an indexer cache needs a DeepSeek Sparse Attention config (index_topk set)")
        cache = super().allocate(config, batch_size=batch_size, capacity=capacity, dtype=dtype, device=device)
        cache._buffers["index_k"] = torch.zeros(batch_size, capacity, config.index_head_dim, dtype=dtype,
                                                device=device)
        return cache
