"""Built-in reference backends: ``reference-naive`` (expanded K/V cache) and ``reference-absorbed``.

Both preallocate ``capacity`` slots per row (hence seed 000's allocated figures) and differ only in
what they cache and in which of the two attention paths of :mod:`mla_conformance.reference` they run.
"""

from __future__ import annotations

import torch

from mla_conformance import reference as ref
from mla_conformance.config import MLAConfig
from mla_conformance.weights import MLAWeights


class SlotCache:
    """Per-row contiguous slots: slot t of row b holds the token at position t.

    ``buffers`` maps a name to a tensor [B, capacity, ...]; every buffer holds one entry per slot, so
    active bytes = stored tokens x (bytes of one slot across all buffers).
    """

    def __init__(self, buffers: dict[str, torch.Tensor], *, batch_size: int, capacity: int,
                 device, config: MLAConfig, kv_codec: str = "none"):
        self.batch_size = batch_size
        self.capacity = capacity
        self.config = config
        self.kv_codec = kv_codec
        self.seq_lens = torch.zeros(batch_size, dtype=torch.int64, device=device)
        self._buffers = buffers

    def tensors(self) -> dict[str, torch.Tensor]:
        return dict(self._buffers)

    def allocated_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._buffers.values())

    def slot_nbytes(self) -> int:
        return sum(t[0, 0].numel() * t.element_size() for t in self._buffers.values())

    def active_nbytes(self) -> int:
        return int(self.seq_lens.sum()) * self.slot_nbytes()

    def write_plan(self, positions: torch.Tensor, lengths: torch.Tensor | None):
        """Validate one attend call; return (lengths [B], new seq_lens [B])."""
        B, S = positions.shape
        if B != self.batch_size:
            raise ValueError(f"batch of {B} rows for a cache of {self.batch_size}")
        lengths = (torch.full((B,), S, dtype=torch.int64, device=positions.device)
                   if lengths is None else lengths.to(device=positions.device, dtype=torch.int64))
        if bool(((lengths < 0) | (lengths > S)).any()):
            raise ValueError(f"lengths {lengths.tolist()} outside [0, {S}]")
        new = self.seq_lens + lengths
        if int(new.max()) > self.capacity:
            raise ValueError(f"cache overflow: {new.tolist()} tokens for capacity {self.capacity}")
        expect = self.seq_lens[:, None] + torch.arange(S, device=positions.device)
        valid = torch.arange(S, device=positions.device)[None, :] < lengths[:, None]
        if bool((positions.ne(expect) & valid).any()):
            raise ValueError("positions must equal cache.seq_lens[b] + i for valid tokens")
        return lengths, new

    def write(self, name: str, values: torch.Tensor, lengths: torch.Tensor) -> None:
        """Store values [B, S, ...] of the valid tokens at slots seq_lens[b] + i."""
        buf = self._buffers[name]
        for b in range(self.batch_size):
            n, start = int(lengths[b]), int(self.seq_lens[b])
            if n:
                buf[b, start:start + n] = values[b, :n].to(buf.dtype)

    def allowed(self, lengths: torch.Tensor, new_lens: torch.Tensor, S: int, T: int) -> torch.Tensor:
        """[B, S, T] mask: query i of row b sees slots <= its position and < the row's new length."""
        dev = self.seq_lens.device
        qpos = self.seq_lens[:, None] + torch.arange(S, device=dev)[None, :]
        t = torch.arange(T, device=dev)
        return (t[None, None, :] <= qpos[:, :, None]) & (t[None, None, :] < new_lens[:, None, None])


class _ReferenceBackend:
    cache_format = "latent"
    kv_codecs: tuple[str, ...] = ("none",)

    def unsupported_reason(self, config, *, dtype, device, kv_codec="none"):
        if kv_codec not in self.kv_codecs:
            return (f"{self.name} stores an unquantized cache; kv_codec {kv_codec!r} is not supported "
                    "(reference-absorbed implements the quantized codecs)")
        if not torch.empty(0, dtype=dtype).is_floating_point():
            return f"{self.name} needs a floating-point dtype, got {dtype}"
        return None

    def _check(self, weights: MLAWeights, hidden_states: torch.Tensor):
        if hidden_states.dtype != weights.dtype:
            raise ValueError(f"hidden_states are {hidden_states.dtype} but weights are {weights.dtype}")


class ReferenceNaive(_ReferenceBackend):
    """Caches the expanded per-head K [nope + rope] and V: H x (qk_head + v) elements per token."""

    name = "reference-naive"
    cache_format = "expanded"

    def new_cache(self, config, *, batch_size, capacity, dtype, device, kv_codec="none"):
        H = config.num_attention_heads
        bufs = {
            "k": torch.zeros(batch_size, capacity, H, config.qk_head_dim, dtype=dtype, device=device),
            "v": torch.zeros(batch_size, capacity, H, config.v_head_dim, dtype=dtype, device=device),
        }
        return SlotCache(bufs, batch_size=batch_size, capacity=capacity, device=device, config=config)

    def attend(self, weights, hidden_states, positions, cache, lengths=None):
        self._check(weights, hidden_states)
        lengths, new_lens = cache.write_plan(positions, lengths)
        q_nope, q_pe, c, k_pe = ref.project(weights, hidden_states, positions)
        k, v = ref.expand_kv(weights, c, k_pe)
        cache.write("k", k, lengths)
        cache.write("v", v, lengths)
        T = int(new_lens.max())
        allowed = cache.allowed(lengths, new_lens, hidden_states.shape[1], T)
        kv = cache.tensors()
        out = ref.naive_scores_and_mix(weights, q_nope, q_pe, kv["k"][:, :T], kv["v"][:, :T], allowed)
        cache.seq_lens = new_lens
        return out.to(hidden_states.dtype)


class LatentSlotCache(SlotCache):
    """The absorbed path's cache: ``kv_latent`` [B, capacity, kv_lora] and ``k_pe`` [B, capacity, rope].

    Quantized (mla_conformance.codecs) and paged (mla_conformance.paged) caches implement the same two
    methods, so the attention code does not change with the storage.
    """

    def write_latent(self, c: torch.Tensor, k_pe: torch.Tensor, lengths: torch.Tensor) -> None:
        self.write("kv_latent", c, lengths)
        self.write("k_pe", k_pe, lengths)

    def read_latent(self, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first T slots of every row, in the cache dtype: (c [B, T, kv_lora], k_pe [B, T, rope])."""
        return self._buffers["kv_latent"][:, :T], self._buffers["k_pe"][:, :T]


class ReferenceAbsorbed(_ReferenceBackend):
    """Caches the normed latent c (kv_lora) and the rotated k_pe (rope): 576 elements per token.

    Optional parts it opts into: every codec of mla_conformance.codecs (quantize on write, dequantize on
    read), and a paged cache (``new_cache(..., page_block_size=N)``).
    """

    name = "reference-absorbed"

    @property
    def supports_paging(self) -> bool:
        import importlib.util

        return importlib.util.find_spec("mla_conformance.paged") is not None

    def unsupported_reason(self, config, *, dtype, device, kv_codec="none"):
        if not torch.empty(0, dtype=dtype).is_floating_point():
            return f"{self.name} needs a floating-point dtype, got {dtype}"
        if kv_codec == "none":
            return None
        try:
            from mla_conformance.codecs import get_codec
        except ImportError:
            return f"{self.name}: no quantized codecs in this installation (kv_codec {kv_codec!r})"
        try:
            codec = get_codec(kv_codec)
        except Exception as exc:  # unknown codec name: say which ones exist
            return f"{self.name}: {exc}"
        return codec.unsupported_reason(config, dtype) if hasattr(codec, "unsupported_reason") else None

    def new_cache(self, config, *, batch_size, capacity, dtype, device, kv_codec="none", page_block_size=None):
        if page_block_size is not None:
            from mla_conformance.paged import PagedLatentCache

            return PagedLatentCache(config, batch_size=batch_size, capacity=capacity, dtype=dtype, device=device,
                                    kv_codec=kv_codec, page_block_size=page_block_size)
        if kv_codec != "none":
            from mla_conformance.codecs import QuantizedLatentCache

            return QuantizedLatentCache(config, batch_size=batch_size, capacity=capacity, dtype=dtype,
                                        device=device, kv_codec=kv_codec)
        bufs = {
            "kv_latent": torch.zeros(batch_size, capacity, config.kv_lora_rank, dtype=dtype, device=device),
            "k_pe": torch.zeros(batch_size, capacity, config.qk_rope_head_dim, dtype=dtype, device=device),
        }
        return LatentSlotCache(bufs, batch_size=batch_size, capacity=capacity, device=device, config=config)

    def attend(self, weights, hidden_states, positions, cache, lengths=None):
        self._check(weights, hidden_states)
        lengths, new_lens = cache.write_plan(positions, lengths)
        q_nope, q_pe, c, k_pe = ref.project(weights, hidden_states, positions)
        cache.write_latent(c, k_pe, lengths)
        T = int(new_lens.max())
        allowed = cache.allowed(lengths, new_lens, hidden_states.shape[1], T)
        c_all, kpe_all = cache.read_latent(T)
        out = ref.absorbed_scores_and_mix(weights, q_nope, q_pe, c_all, kpe_all, allowed)
        cache.seq_lens = new_lens
        return out.to(hidden_states.dtype)
