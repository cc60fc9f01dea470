"""Bytes measured from a cache's real tensors, and the NaN poison the suite puts in unwritten slots.

The rules (the contract docstring in :mod:`mla_conformance.contract.layer` states them for users):

* **Every buffer in** ``tensors()`` **counts**, of any dtype. A buffer is *bookkeeping* (block table,
  lengths, page map, a per-cache scale) only by structure: it has at most
  ``BOOKKEEPING_FACTOR x batch_size x pages + BOOKKEEPING_SLACK`` elements, where ``pages`` is
  ``ceil(capacity / page_block_size)`` (``page_block_size`` from the cache when it declares one, else
  ``MIN_PAGE_BLOCK_SIZE`` tokens). Every other buffer is *token storage*: something with a slot axis.
* **Poison.** Right after ``new_cache`` the suite overwrites every token-storage buffer: floating point
  with NaN, integer / uint8 / float8 storage with the byte ``0xFF`` (NaN once read as float8 e4m3,
  bfloat16 or float32 scales). It then reads ``tensors()`` again and checks the poison landed: a cache
  whose ``tensors()`` returns copies fails the contract.
* **Written bytes.** After tokens went through ``attend``, a token-storage element that no longer holds
  the poison was written. Bytes per stored token = written bytes / stored tokens. Integer storage is
  measured twice, with poison ``0xFF`` and ``0x00``, and the written positions of both runs united, so
  a written byte that happens to equal one sentinel is still counted. A buffer that appears, or changes
  shape, during ``attend`` (a cache that grows, e.g. transformers' DynamicCache) counts whole.
* **Slots.** The slots a cache allocated = its token-storage bytes / bytes per stored token. More slots
  than requested is an allocation policy (pools, ``max_seq_len``): reported, never a failure. A cache
  that preallocates fewer slots than requested fails. A cache that allocates nothing up front and grows
  is reported as growing.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from mla_conformance.dtypes import dtype_name

#: A buffer with at most BOOKKEEPING_FACTOR x batch x pages + BOOKKEEPING_SLACK elements is bookkeeping.
BOOKKEEPING_FACTOR = 2
BOOKKEEPING_SLACK = 16
#: Pages assumed for a cache that declares no page_block_size: the smallest page any engine uses by default.
MIN_PAGE_BLOCK_SIZE = 16
POISON_BYTES = (0xFF, 0x00)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def bookkeeping_limit(batch_size: int, capacity: int, page_block_size: int | None = None) -> int:
    page = int(page_block_size) if page_block_size else MIN_PAGE_BLOCK_SIZE
    pages = max(1, math.ceil(capacity / max(1, page)))
    return BOOKKEEPING_FACTOR * batch_size * pages + BOOKKEEPING_SLACK


def is_bookkeeping(t: torch.Tensor, limit: int, batch_size: int | None = None, capacity: int | None = None) -> bool:
    """At most ``limit`` elements -- unless the buffer is shaped [batch_size, capacity, ...] (one entry per token
    slot: a per-token scale such as DeepSeek's indexer ``k_scale_cache`` [B, capacity, 1]), which is token storage
    whatever its size. A 2-D integer [batch_size, capacity] buffer is an index (a block table of one-token pages, or
    of a row that fits one page), judged by its size like any other bookkeeping."""
    per_token = t.dim() >= 3 or t.is_floating_point()
    if (batch_size is not None and capacity is not None and t.dim() >= 2 and per_token
            and tuple(t.shape[:2]) == (batch_size, capacity)):
        return False
    return t.numel() <= limit


@dataclasses.dataclass
class Poisoned:
    """What the suite wrote into a fresh cache: storage buffer name -> (shape, dtype, sentinel byte)."""

    storage: dict[str, tuple[tuple[int, ...], torch.dtype]]
    bookkeeping: dict[str, int]   # name -> bytes
    limit: int
    sentinel: int


class PoisonDidNotLand(AssertionError):
    """tensors() handed out copies: what the suite wrote never reached the cache."""


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.element_size() > 1 or t.dtype != torch.uint8 else t


def poison(cache, tensors: dict[str, torch.Tensor], *, batch_size: int, capacity: int, sentinel: int = 0xFF,
           name: str = "cache", zero: bool = False) -> Poisoned:
    """Fill every token-storage buffer of a fresh cache (NaN / sentinel bytes); check that it landed.
    ``zero``: fill with 0 (0.0 / 0x00 bytes) instead: the control run that tells a read of unwritten slots
    (NaN only with the poison) from NaN the backend's own arithmetic makes (NaN with zeros too)."""
    if zero:
        sentinel = 0
    limit = bookkeeping_limit(batch_size, capacity, getattr(cache, "page_block_size", None))
    storage, book = {}, {}
    for key, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise AssertionError(f"{name}: tensors()[{key!r}] is a {type(t).__name__}, not a Tensor")
        if is_bookkeeping(t, limit, batch_size, capacity):
            book[key] = _nbytes(t)
            continue
        storage[key] = (tuple(t.shape), t.dtype)
        with torch.no_grad():
            if t.is_floating_point() and t.element_size() > 1:
                t.fill_(0.0 if zero else float("nan"))
            elif t.is_contiguous():
                t.view(torch.uint8).fill_(sentinel) if t.dtype != torch.bool else t.fill_(bool(sentinel))
            else:
                raise AssertionError(f"{name}: token-storage buffer {key!r} {tuple(t.shape)} {t.dtype} is not "
                                     "contiguous; the suite cannot poison its unwritten slots")
    again = tensors_of(cache, name)
    for key, (shape, dtype) in storage.items():
        t = again.get(key)
        landed = t is not None and tuple(t.shape) == shape and (
            bool((t == 0).all() if zero else torch.isnan(t).all()) if t.is_floating_point() and t.element_size() > 1
            else bool((_as_bytes(t) == (sentinel if t.dtype != torch.bool else int(bool(sentinel)))).all()))
        if not landed:
            raise PoisonDidNotLand(
                f"{name}: the NaN/0x{sentinel:02X} poison the suite wrote into tensors()[{key!r}] is not in the "
                "buffer tensors() returns next: tensors() must return the cache's own buffers, not copies "
                "(the contract; the suite fills unwritten slots to prove they are never read)")
    return Poisoned(storage, book, limit, sentinel)


def tensors_of(cache, name: str = "cache") -> dict[str, torch.Tensor]:
    tensors = cache.tensors()
    if not isinstance(tensors, dict):
        raise AssertionError(f"{name}: tensors() returned {type(tensors).__name__}, not a dict of name -> Tensor")
    return tensors


def written_masks(tensors: dict[str, torch.Tensor], poisoned: Poisoned) -> dict[str, torch.Tensor | None]:
    """Per token-storage buffer: a bool mask (elements for floating buffers, bytes for the others) of
    what no longer holds the poison; None for a buffer that appeared or changed shape (counts whole)."""
    out: dict[str, torch.Tensor | None] = {}
    for key, t in tensors.items():
        before = poisoned.storage.get(key)
        if before is None or tuple(t.shape) != before[0] or t.dtype != before[1]:
            if key in poisoned.bookkeeping and is_bookkeeping(t, poisoned.limit):
                continue
            out[key] = None
            continue
        t = t.detach().cpu()
        if t.is_floating_point() and t.element_size() > 1:
            out[key] = ~torch.isnan(t)
        else:
            out[key] = _as_bytes(t) != (poisoned.sentinel if t.dtype != torch.bool else int(bool(poisoned.sentinel)))
    return out


def written_bytes(tensors: dict[str, torch.Tensor], masks: list[dict[str, torch.Tensor | None]]) -> dict[str, int]:
    """Bytes written per buffer, uniting the masks of one or more poisoned runs."""
    out = {}
    for key, t in tensors.items():
        per_run = [m[key] for m in masks if key in m]
        if not per_run:
            continue
        if any(m is None for m in per_run):
            out[key] = _nbytes(t)
            continue
        union = per_run[0]
        for m in per_run[1:]:
            union = union | m
        unit = t.element_size() if (t.is_floating_point() and t.element_size() > 1) else 1
        out[key] = int(union.sum()) * unit
    return out


def describe_buffers(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {k: f"{tuple(t.shape)} {dtype_name(t.dtype)}" for k, t in tensors.items()}


def slot_figures(storage_bytes: int, per_token: int, requested: int, preallocated: bool) -> dict[str, Any]:
    """allocated_slots (storage bytes / bytes per stored token), requested_slots and the overhead ratio."""
    if per_token <= 0:
        return {"requested_slots": requested, "allocated_slots": None, "slot_overhead": None}
    slots, rest = divmod(storage_bytes, per_token)
    return {"requested_slots": requested, "allocated_slots": slots,
            "slot_overhead": round(slots / requested, 4) if requested else None,
            "unattributed_storage_bytes": rest, "preallocated": preallocated}
