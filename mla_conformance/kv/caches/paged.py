"""A paged latent cache in FlashMLA's page layout, and its conversions.

Layout (FlashMLA's ``k_cache``, ``flash_mla_with_kvcache``)::

    kv_pages     [num_pages, page_block_size, 1, 576]   the pool: latent c (kv_lora) then rotated k_pe (rope)
    block_table  [B, max_pages_per_row] int32           row b's j-th page holds its tokens j*block .. j*block+block-1
    seq_lens     [B] int64                              tokens stored per row

Token t of row b lives at ``kv_pages[block_table[b, t // block], t % block, 0]``. The axis of size 1 is
FlashMLA's h_kv, kept so that :func:`to_flashmla_layout` hands the pool itself (no copy) to the kernel.
With a quantized codec (``mla_conformance.kv.codecs``: ``storage``, ``encode``/``decode`` with the codec's
calibrated ``global_storage`` buffers, which the cache holds once, unpaged) each per-token buffer gets
such a pool (``{buffer}_pages``); FlashMLA's FP8 format is one uint8 pool of 656 bytes per token.

Every row owns ``ceil(capacity / page_block_size)`` pages, handed out at construction in a shuffled
order (a seeded generator, so runs repeat); the pool keeps spare pages that no row owns. Every slot
starts as NaN (uint8 storage: 0xFF bytes, NaN once decoded as FP8 e4m3, float32 scales or bfloat16
rope; other integer storage: -1). A slot a row has not written therefore holds NaN, and
:meth:`PagedLatentCache.read_latent` *selects* (``torch.where``) zeros for every slot at or beyond a
row's written length, after decoding: masking by multiplication would not do, 0 * NaN is NaN in a
matmul. With the zeros in place the gathered operands equal the contiguous cache's slices value for
value, so reference-absorbed computes bit-identical outputs on either cache.
"""

from __future__ import annotations

import math
import types

import torch

from mla_conformance.kv.caches.quantized import write_encoded
from mla_conformance.kv.caches.slots import LatentSlotCache, SlotCache
from mla_conformance.kv.codecs import get_codec

DEFAULT_PAGE_BLOCK_SIZE = 64
DEFAULT_SEED = 0


def _codec(kv_codec: str):
    """The codec object for a non-"none" kv_codec, or ValueError naming the known ones."""
    return get_codec(kv_codec)


def _poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill with NaN (floating) or 0xFF bytes (integer storage: NaN once decoded as fp8/fp32/bf16)."""
    if t.is_floating_point():
        return t.fill_(float("nan"))
    if t.dtype == torch.uint8:
        return t.fill_(0xFF)
    return t.fill_(-1)


class PagedLatentCache(LatentSlotCache):
    """The absorbed path's latent cache, stored in shuffled pages of ``page_block_size`` tokens.

    Same interface as :class:`~mla_conformance.kv.caches.LatentSlotCache` (``write_plan``,
    ``write_latent``, ``read_latent``, ``allowed``, byte accounting); ``kv_pages``/``block_table`` are
    FlashMLA's layout. Every row owns ``max_pages_per_row = ceil(capacity / page_block_size)`` pages
    from construction on; ``spare_pages`` more stay unowned (NaN) in the pool.
    """

    def __init__(self, config, *, batch_size: int, capacity: int, dtype: torch.dtype, device="cpu",
                 kv_codec: str = "none", page_block_size: int = DEFAULT_PAGE_BLOCK_SIZE,
                 spare_pages: int | None = None, seed: int = DEFAULT_SEED):
        if not isinstance(page_block_size, int) or page_block_size <= 0:
            raise ValueError(f"page_block_size must be a positive integer, got {page_block_size!r}")
        if batch_size < 0 or capacity < 0:
            raise ValueError(f"batch_size {batch_size} and capacity {capacity} must be >= 0")
        self.dtype = dtype
        self.device = torch.device(device)
        self.page_block_size = page_block_size
        self.kv_lora_rank = int(config.kv_lora_rank)
        self.rope_dim = int(config.qk_rope_head_dim)
        self.codec = None if kv_codec == "none" else _codec(kv_codec)
        if self.codec is not None:
            reason = self.codec.unsupported_reason(config, dtype)
            if reason:
                raise ValueError(reason)
        self.max_pages_per_row = math.ceil(capacity / page_block_size)
        used = batch_size * self.max_pages_per_row
        self.spare_pages = max(2, used // 4) if spare_pages is None else int(spare_pages)
        self.num_pages = used + self.spare_pages

        if self.codec is None:
            storage = {"kv": ((self.kv_lora_rank + self.rope_dim,), dtype)}
        else:
            storage = {name: (tuple(shape), dt) for name, (shape, dt) in self.codec.storage(config, dtype).items()}
        self._storage = storage
        pools = {f"{name}_pages": _poison_(torch.empty(self.num_pages, page_block_size, 1, *shape, dtype=dt,
                                                       device=self.device))
                 for name, (shape, dt) in storage.items()}
        # shuffled page order, from a seeded CPU generator so every run (and device) sees the same order
        gen = torch.Generator().manual_seed(seed)
        order = torch.randperm(self.num_pages, generator=gen)[:used].to(torch.int32)
        block_table = order.view(batch_size, self.max_pages_per_row).to(self.device)
        super().__init__({**pools, "block_table": block_table}, batch_size=batch_size, capacity=capacity,
                         device=self.device, config=config, kv_codec=kv_codec)
        # tokens written per row: seq_lens plus what write_latent stored during the current attend call
        self.written = torch.zeros(batch_size, dtype=torch.int64, device=self.device)
        # a codec's per-cache buffers (e.g. int8-tensor's scale): calibrated on the first write, as in
        # mla_conformance.kv.caches.QuantizedLatentCache
        global_storage = self.codec.global_storage(config) if self.codec is not None else {}
        self._globals = {name: torch.zeros(*shape, dtype=dt, device=self.device)
                         for name, (shape, dt) in global_storage.items()}
        self.calibrated = not self._globals

    # ------------------------------------------------------------------ layout
    @property
    def kv_pages(self) -> torch.Tensor:
        """The page pool of the first (for codec "none": the only) storage buffer."""
        return self._buffers[f"{next(iter(self._storage))}_pages"]

    @property
    def block_table(self) -> torch.Tensor:
        return self._buffers["block_table"]

    def pools(self) -> dict[str, torch.Tensor]:
        """Storage buffer name -> its page pool [num_pages, block, 1, *shape]."""
        return {name: self._buffers[f"{name}_pages"] for name in self._storage}

    def slot_index(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat slot (page * block + offset) of token ``positions`` of row ``rows`` (broadcasting)."""
        blk = self.page_block_size
        pages = self.block_table[rows, torch.div(positions, blk, rounding_mode="floor")].to(torch.int64)
        return pages * blk + positions % blk

    # ------------------------------------------------------------------ bytes
    def tensors(self) -> dict[str, torch.Tensor]:
        """The page pools, the block table and a codec's global buffers, if any."""
        return {**self._buffers, **self._globals}

    def allocated_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def token_nbytes(self) -> int:
        """Bytes one stored token takes in the pools (576 x element size; 656 for FlashMLA's FP8)."""
        return sum(math.prod(shape) * torch.empty(0, dtype=dt).element_size()
                   for shape, dt in self._storage.values())

    def slot_nbytes(self) -> int:
        return self.token_nbytes()

    def global_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._globals.values())

    def active_nbytes(self) -> int:
        tokens = int(self.seq_lens.sum())
        return tokens * self.token_nbytes() + (self.global_nbytes() if tokens else 0)

    # ------------------------------------------------------------------ write / read
    def write_plan(self, positions: torch.Tensor, lengths: torch.Tensor | None):
        lengths, new = super().write_plan(positions, lengths)
        self.written = self.seq_lens.clone()
        return lengths, new

    def write(self, name: str, values: torch.Tensor, lengths: torch.Tensor) -> None:
        """Scatter values [B, S, *shape] of the valid tokens into pool ``name`` at seq_lens[b] + i."""
        pool = self._buffers[f"{name}_pages"]
        B, S = values.shape[:2]
        dev = pool.device
        lengths = lengths.to(dev, torch.int64)
        i = torch.arange(S, device=dev)
        valid = i[None, :] < lengths[:, None]
        if not bool(valid.any()):
            return
        rows = torch.arange(B, device=dev)[:, None].expand(B, S)[valid]
        pos = (self.seq_lens.to(dev)[:, None] + i[None, :])[valid]
        flat = pool.view(-1, *pool.shape[2:])
        flat[self.slot_index(rows, pos)] = values.to(dev)[valid].to(pool.dtype).reshape(-1, *pool.shape[2:])

    def write_latent(self, c: torch.Tensor, k_pe: torch.Tensor, lengths: torch.Tensor) -> None:
        if self.codec is None:
            self.write("kv", torch.cat([c.to(self.dtype), k_pe.to(self.dtype)], dim=-1), lengths)
        else:
            write_encoded(self, c, k_pe, lengths)
        self.written = torch.maximum(self.written, self.seq_lens + lengths.to(self.seq_lens.device, torch.int64))

    def gather(self, T: int) -> dict[str, torch.Tensor]:
        """The raw first T slots of every row, per storage buffer: [B, T, *shape] (NaN where unwritten)."""
        dev = self.block_table.device
        t = torch.arange(T, device=dev)
        rows = torch.arange(self.batch_size, device=dev)[:, None]
        idx = self.slot_index(rows, t[None, :]) if T else torch.zeros(self.batch_size, 0, dtype=torch.int64,
                                                                         device=dev)
        out = {}
        for name, pool in self.pools().items():
            flat = pool.view(-1, *pool.shape[3:])  # drop the h_kv axis
            out[name] = flat[idx]
        return out

    def read_latent(self, T: int, new_lens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(c [B, T, kv_lora], k_pe [B, T, rope]) in the cache dtype; zeros at slots a row has not written."""
        if T > self.capacity:
            raise ValueError(f"read of {T} slots from a cache of capacity {self.capacity}")
        parts = self.gather(T)
        if self.codec is None:
            kv = parts["kv"]
            c, k_pe = kv[..., : self.kv_lora_rank], kv[..., self.kv_lora_rank:]
        else:
            c, k_pe = self.codec.decode(parts, self.dtype, self._globals)
        lens = self.written if new_lens is None else torch.maximum(self.written, new_lens.to(self.written.device))
        valid = (torch.arange(T, device=c.device)[None, :] < lens.to(c.device)[:, None])[..., None]
        zero = torch.zeros((), dtype=c.dtype, device=c.device)
        # select, never multiply: NaN * 0 is NaN
        return torch.where(valid, c, zero), torch.where(valid, k_pe, zero.to(k_pe.dtype))


# ---------------------------------------------------------------------- conversions


def to_flashmla_layout(cache, cache_seqlens: torch.Tensor | None = None, *,
                       page_block_size: int = DEFAULT_PAGE_BLOCK_SIZE):
    """FlashMLA's paged inputs for a cache: (k_cache [num_blocks, block, 1, D], block_table int32 [B, max_blocks],
    cache_seqlens int32 [B]).

    For a :class:`PagedLatentCache` k_cache *is* its pool (no copy; D = 576, or 656 uint8 for the FP8
    codec's single buffer). A contiguous :class:`LatentSlotCache` (``kv_latent`` + ``k_pe``) is copied
    into fresh pages of ``page_block_size`` (:func:`from_contiguous`). ``cache_seqlens`` defaults to
    ``cache.seq_lens``; pass the new lengths when calling a kernel between write and commit.
    """
    if not isinstance(cache, PagedLatentCache):
        if not isinstance(cache, SlotCache) or not {"kv_latent", "k_pe"} <= set(cache.tensors()):
            raise TypeError(f"to_flashmla_layout: {type(cache).__name__} is neither a PagedLatentCache nor a "
                            "contiguous latent cache with kv_latent and k_pe")
        bufs = cache.tensors()
        cache = from_contiguous(bufs["kv_latent"], bufs["k_pe"], cache.seq_lens, page_block_size,
                                config=cache.config, capacity=cache.capacity)
    pools = cache.pools()
    if len(pools) != 1:
        raise ValueError(f"to_flashmla_layout: codec {cache.kv_codec!r} stores {len(pools)} buffers "
                         f"({', '.join(pools)}); FlashMLA reads one k_cache")
    seqlens = cache.seq_lens if cache_seqlens is None else cache_seqlens
    return (next(iter(pools.values())), cache.block_table.to(torch.int32).contiguous(),
            seqlens.to(device=cache.block_table.device, dtype=torch.int32).contiguous())


def from_contiguous(c: torch.Tensor, k_pe: torch.Tensor, lengths: torch.Tensor | None = None,
                    page_block_size: int = DEFAULT_PAGE_BLOCK_SIZE, *, config=None, capacity: int | None = None,
                    kv_codec: str = "none", spare_pages: int | None = None,
                    seed: int = DEFAULT_SEED) -> PagedLatentCache:
    """A paged cache holding the first ``lengths[b]`` tokens of c [B, T, kv_lora] and k_pe [B, T, rope].

    ``config`` (needed for quantized codecs) defaults to the two widths read off the tensors; the cache
    dtype is c's; ``capacity`` defaults to T.
    """
    B, T = c.shape[:2]
    if k_pe.shape[:2] != (B, T):
        raise ValueError(f"c {tuple(c.shape)} and k_pe {tuple(k_pe.shape)} disagree on [B, T]")
    if config is None:
        config = types.SimpleNamespace(kv_lora_rank=c.shape[-1], qk_rope_head_dim=k_pe.shape[-1])
    lengths = (torch.full((B,), T, dtype=torch.int64) if lengths is None
               else lengths.to(device="cpu", dtype=torch.int64))
    cache = PagedLatentCache(config, batch_size=B, capacity=T if capacity is None else capacity, dtype=c.dtype,
                             device=c.device, kv_codec=kv_codec, page_block_size=page_block_size,
                             spare_pages=spare_pages, seed=seed)
    positions = torch.arange(T, device=c.device).expand(B, T)
    lengths = lengths.to(c.device)
    _, new = cache.write_plan(positions, lengths)
    cache.write_latent(c, k_pe, lengths)
    cache.commit(new)
    return cache
