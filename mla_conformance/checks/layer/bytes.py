"""Cache bytes: what a declared format should hold per token (the formulas), what a cache holds (THE byte
measurement: poison -> sentinels -> written mask, :func:`measure_written_bytes`), and the check that ties them
(:func:`cache_bytes`).

The rule itself (what counts as token storage, the poison, why integer storage is measured twice) is
:mod:`mla_conformance.kv.caches.measure`'s; this module runs it once, for the suites and the benchmark alike.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import torch

from mla_conformance.checks.layer.driver import Scenario, inputs_for, require_support, run_scenario
from mla_conformance.checks.metrics import dtype_name
from mla_conformance.contract.calls import call_backend, tensors_of_checked
from mla_conformance.contract.layer import cache_format_of, declared_on
from mla_conformance.kv.caches.measure import (POISON_BYTES, Poisoned, bookkeeping_limit, describe_buffers,
                                               is_bookkeeping, slot_figures, written_bytes, written_masks)
from mla_conformance.kv.codecs import get_codec
from mla_conformance.messages import failure, times
from mla_conformance.model.config import MLAConfig
from mla_conformance.model.dsa_reference import FP8_INDEXER_BLOCK
from mla_conformance.model.weights import MLAWeights


# --------------------------------------------------------------------------- the formulas


def indexer_elements(config: MLAConfig, cache_format: str) -> int:
    """Indexer-key elements per token of a format: index_head_dim for "latent+indexer", else 0."""
    if cache_format != "latent+indexer":
        return 0
    if not config.dsa:
        raise ValueError(f"cache_format 'latent+indexer' needs a DeepSeek Sparse Attention config (index_topk set); "
                         f"this one is dense ({config.describe()})")
    return config.index_head_dim


def per_token_elements(config: MLAConfig, cache_format: str) -> int:
    """Elements per stored token: latent (kv_lora + rope), expanded (H x (qk + v)), latent+indexer
    (kv_lora + rope + index_head_dim)."""
    if cache_format == "expanded":
        return config.expanded_dim
    return config.latent_dim + indexer_elements(config, cache_format)



#: How a "latent+indexer" cache stores its indexer key, declared apart from the latent's storage as
#: ``indexer_format`` on the cache or the backend (:func:`indexer_format_of`); each has its own bytes per token
#: (:func:`indexer_bytes_per_token`) and its own indexer precision (the ``indexer-scores`` row of TOLERANCES the
#: DSA score and selection tests hold it to).
INDEXER_FORMATS: dict[str, str] = {
    "cache-dtype": "index_head_dim values in the cache dtype (the default, but with kv_codec fp8-e4m3-flashmla)",
    "bf16": "index_head_dim bfloat16 values (2 B each) whatever the latent's storage",
    "fp8-e4m3-block128": "index_head_dim float8 e4m3 values plus one float32 scale per block of 128 values "
                         "(DeepSeek-V3.2-Exp inference/model.py: act_quant's block 128, fp8_index; 128 + 4 = 132 B "
                         "at index_head_dim 128); the default with kv_codec fp8-e4m3-flashmla, whose FlashMLA layout "
                         "pairs the 656-byte latent with it",
}


def default_indexer_format(kv_codec: str = "none") -> str:
    """The indexer format of a cache that declares none: FP8 block-128 with kv_codec fp8-e4m3-flashmla (DeepSeek's
    FP8 cache), else the cache dtype."""
    return "fp8-e4m3-block128" if kv_codec == "fp8-e4m3-flashmla" else "cache-dtype"


def indexer_format_of(backend, cache=None, kv_codec: str = "none") -> str:
    """The indexer format declared on the cache, else on the backend, else :func:`default_indexer_format`;
    a value outside INDEXER_FORMATS is a bad spec (BackendSpecError) naming the allowed values."""
    return declared_on(backend, cache, "indexer_format", INDEXER_FORMATS, default_indexer_format(kv_codec))


def indexer_bytes_per_token(config: MLAConfig, cache_format: str, dtype: torch.dtype, kv_codec: str = "none",
                            indexer_format: str | None = None) -> int:
    """Bytes of the indexer key per token: 0 unless "latent+indexer"; else by ``indexer_format`` (None: the
    default for ``kv_codec``): index_head_dim elements in the cache dtype ("cache-dtype"), x 2 B ("bf16"), or
    index_head_dim e4m3 bytes + 4 B per block of 128 ("fp8-e4m3-block128": 132 B at 128)."""
    n = indexer_elements(config, cache_format)
    if not n:
        return 0
    indexer_format = default_indexer_format(kv_codec) if indexer_format is None else indexer_format
    if indexer_format == "fp8-e4m3-block128":
        return n + 4 * math.ceil(n / FP8_INDEXER_BLOCK)
    if indexer_format == "bf16":
        return 2 * n
    if indexer_format == "cache-dtype":
        return n * torch.empty(0, dtype=dtype).element_size()
    raise ValueError(f"unknown indexer_format {indexer_format!r}; known: {', '.join(INDEXER_FORMATS)}")


def format_bytes_per_token(config: MLAConfig, cache_format: str, dtype: torch.dtype, kv_codec: str = "none",
                           indexer_format: str | None = None) -> int:
    """Bytes one stored token takes in the declared format (a codec's payload + metadata), the indexer
    key included for "latent+indexer" in its ``indexer_format`` (:func:`indexer_bytes_per_token`). At V3.2 dims
    (512 + 64, indexer 128): 1,408 B with a BF16 indexer key, 1,284 B (1,152 + 128 + 4) with a BF16 latent and
    the FP8 block-128 key of DeepSeek's V3.2 reference, 788 B (656 + 132) with kv_codec fp8-e4m3-flashmla; other
    codecs quantize the latent only."""
    indexer = indexer_bytes_per_token(config, cache_format, dtype, kv_codec, indexer_format)
    if kv_codec != "none":
        return get_codec(kv_codec).bytes_per_token(config, dtype)["total"] + indexer
    return config.expanded_dim * torch.empty(0, dtype=dtype).element_size() if cache_format == "expanded" else \
        config.latent_dim * torch.empty(0, dtype=dtype).element_size() + indexer


# --------------------------------------------------------------------------- the measurement


@dataclasses.dataclass
class WrittenBytes:
    """What :func:`measure_written_bytes` measured: the first run's cache, its ``tensors()`` and what was poisoned
    in it, and the bytes written per buffer (the runs' written positions united)."""

    cache: Any
    tensors: dict[str, torch.Tensor]
    poisoned: Poisoned
    written: dict[str, int]          # token-storage buffer name -> bytes that no longer hold the poison
    sentinels: tuple[int, ...]       # the poison bytes of the runs made (0xFF, then 0x00 where needed)

    @property
    def total(self) -> int:
        return sum(self.written.values())


def has_byte_storage(poisoned: Poisoned) -> bool:
    """Whether a poisoned cache holds integer / uint8 / float8 token storage, poisoned with a byte (a written
    byte may equal that sentinel: the measurement needs a second run with the other one)."""
    return any(not (dt.is_floating_point and torch.empty(0, dtype=dt).element_size() > 1)
               for _, dt in poisoned.storage.values())


def measure_written_bytes(fill: Callable[[int], tuple[Any, Poisoned]], where: str) -> WrittenBytes:
    """The bytes a cache's tokens occupy, measured from its tensors: THE byte measurement of the suites and the
    benchmark (the rule: :mod:`mla_conformance.kv.caches.measure`).

    ``fill(sentinel)`` makes a fresh cache, poisons its token storage with
    :func:`mla_conformance.kv.caches.measure.poison` (``sentinel=sentinel``: NaN in floating storage, that byte
    in integer / uint8 / float8 storage), writes the tokens (through ``attend`` or the cache's own methods) and
    returns ``(cache, poisoned)``. It runs with 0xFF; when the cache has byte storage (:func:`has_byte_storage`)
    once more with 0x00, and the written positions of both runs are united, so that a written byte equal to
    one sentinel still counts. ``tensors()`` of each filled cache must be a dict of name -> Tensor (else a
    BackendOutputError naming ``where``)."""
    __tracebackhide__ = True
    cache, poisoned = fill(POISON_BYTES[0])
    tensors = tensors_of_checked(call_backend(cache, "tensors"), where)
    masks = [written_masks(tensors, poisoned)]
    sentinels = [POISON_BYTES[0]]
    if has_byte_storage(poisoned):
        again, poisoned_again = fill(POISON_BYTES[1])
        masks.append(written_masks(tensors_of_checked(call_backend(again, "tensors"), where), poisoned_again))
        sentinels.append(POISON_BYTES[1])
    return WrittenBytes(cache, tensors, poisoned, written_bytes(tensors, masks), tuple(sentinels))


# --------------------------------------------------------------------------- the check


def _scale_like(tensor: torch.Tensor, per_token_bytes: float, config: MLAConfig) -> bool:
    """A float32-or-wider buffer holding at most one value per 32 of the per-token elements: scales (metadata of
    a quantized part), not values stored wider than the cache dtype."""
    return per_token_bytes / tensor.element_size() <= (config.latent_dim + (config.index_head_dim or 0)) / 32


def _byte_hints(config: MLAConfig, fmt: str, indexer_format: str | None, kv_codec: str, dtype: torch.dtype,
                tensors: dict, written: dict, tokens: int) -> list[str]:
    """Likely causes of a per-token byte mismatch, each naming what it saw."""
    elem = torch.empty(0, dtype=dtype).element_size()
    total = sum(written.values())
    hints = []
    wide = [k for k, v in written.items() if v and tensors[k].is_floating_point() and tensors[k].element_size() > elem]
    scales = [k for k in wide if _scale_like(tensors[k], written[k] / tokens, config)]
    if scales:
        hints.append(f"buffer(s) {scales} ({[str(tensors[k].dtype) for k in scales]}, "
                     f"{[round(written[k] / tokens, 3) for k in scales]} B/token) hold one value per 32 or more "
                     "stored values: scales of a quantized part, counted as the format's metadata")
    wider = [k for k in wide if k not in scales]
    if wider:
        hints.append(f"buffer(s) {wider} are {[str(tensors[k].dtype) for k in wider]}, wider than the "
                     f"{dtype_name(dtype)} cache asked for")
    if fmt == "latent+indexer":
        other = [f for f in INDEXER_FORMATS if f != indexer_format
                 and total == tokens * format_bytes_per_token(config, fmt, dtype, kv_codec, f)]
        if other:
            hints.append(f"that is the size with indexer_format {other[0]!r} ({INDEXER_FORMATS[other[0]]}), not "
                         f"the cache's {indexer_format!r} (declared, or the default when neither the cache nor the "
                         f"backend declares one): declare indexer_format = {other[0]!r} if that is how the cache "
                         "stores the indexer key")
    if fmt == "latent" and kv_codec == "none" and total == tokens * config.expanded_dim * elem:
        hints.append(f"that is the expanded per-head K/V size (H x (qk + v) = {config.expanded_dim:,} "
                     "elements per token): the cache stores the expanded K/V, not the latent")
    if fmt == "latent" and config.dsa and kv_codec == "none" and \
            total > tokens * config.latent_dim * elem:
        hints.append("a DeepSeek Sparse Attention cache also stores one indexer key per token: declare "
                     "cache_format 'latent+indexer' (and its indexer_format)")
    return hints


@functools.lru_cache(maxsize=16)  # every preset and dtype the byte tests use (V3 dims: bf16 only, 0.4 GB)
def _bytes_weights(preset: str, dtype: torch.dtype, device: str) -> MLAWeights:
    """Weights for byte checks: finite and well-scaled is all they need (a period-64 draw: MLAWeights.random), and
    no float64 master kept (at DeepSeek-V3 dims that would be 1.5 GB)."""
    return MLAWeights.random(MLAConfig.preset(preset), seed=0, dtype=dtype, device=device, draw_dtype=torch.float32,
                             period=64)


def cache_bytes(backend, preset: str, dtype: torch.dtype, *, prefill: int, decode: int, batch: int,
                capacity: int, device="cpu", kv_codec: str = "none", figures: dict | None = None) -> dict[str, Any]:
    """Write tokens through attend() and measure the cache from its tensors; raise when the bytes break
    the contract. One rule for every format and codec (mla_conformance.kv.caches.measure):

    * bytes per stored token = bytes of token storage that no longer hold the suite's poison / tokens,
      must equal the declared format's bytes per token -- else the *format* is wrong;
    * a cache that preallocates must have room for batch x capacity tokens -- else the *slot count* is
      wrong; more slots are an allocation policy, reported (allocated_slots, slot_overhead);
    * the self-reports: allocated_nbytes() == bytes of tensors(); active_nbytes() == stored tokens x the
      measured bytes per token (plus at most the bookkeeping buffers).
    """
    __tracebackhide__ = True
    figures = {} if figures is None else figures
    config = MLAConfig.preset(preset)
    require_support(backend, config, dtype=dtype, device=device, kv_codec=kv_codec)
    w = _bytes_weights(preset, dtype, str(device))
    scenario = Scenario("bytes", (prefill,) * batch, decode_steps=decode)
    x = inputs_for(config, scenario)
    traces: list[dict] = []

    def fill(sentinel: int):
        trace: dict = {}
        _, filled = run_scenario(backend, w, x, scenario, device=device, capacity=capacity, kv_codec=kv_codec,
                                 poison_sentinel=sentinel, trace=trace)
        traces.append(trace)
        return filled, trace["poisoned"]

    measured_run = measure_written_bytes(fill, f"{backend.name} cache")
    cache, tensors, trace = measured_run.cache, measured_run.tensors, traces[0]
    fmt = cache_format_of(backend, cache)
    ifmt = indexer_format_of(backend, cache, kv_codec) if fmt == "latent+indexer" else None
    tokens = batch * (prefill + decode)
    expected = format_bytes_per_token(config, fmt, dtype, kv_codec, ifmt)
    tensor_bytes = {k: t.numel() * t.element_size() for k, t in tensors.items()}
    limit = bookkeeping_limit(batch, capacity, getattr(cache, "page_block_size", None))
    written = measured_run.written
    # bookkeeping by structure (small); a buffer the tokens were written into is token storage whatever
    # its size (a cache that grows holds one token in a buffer smaller than a block table)
    book = {k: b for k, b in tensor_bytes.items()
            if is_bookkeeping(tensors[k], limit, batch, capacity) and not written.get(k)}
    storage = {k: b for k, b in tensor_bytes.items() if k not in book}
    total_written = sum(written.values())
    measured = total_written // tokens if tokens else 0
    active = int(call_backend(cache, "active_nbytes"))
    allocated = int(call_backend(cache, "allocated_nbytes"))
    requested = batch * capacity
    slots = slot_figures(sum(storage.values()), measured, requested, trace["preallocated"])
    # formula and measurement under labelled keys: formula_bytes_per_token is the declared format's per-token
    # formula (format_bytes_per_token), measured_bytes_per_token what the tensors showed (written bytes / tokens);
    # bytes_per_token (measured) and format_bytes_per_token (formula) are the same figures under the keys the
    # report reads
    figures.update({"backend": backend.name, "preset": preset, "dtype": dtype_name(dtype), "cache_format": fmt,
                    "kv_codec": kv_codec, "tokens": tokens, "batch": batch, "capacity": capacity,
                    "formula_bytes_per_token": expected, "measured_bytes_per_token": measured,
                    "format_bytes_per_token": expected, "bytes_per_token": measured,
                    "measured_bytes_per_buffer": {k: v / tokens for k, v in sorted(written.items()) if v},
                    "written_nbytes": total_written, "active_nbytes": active, "allocated_nbytes": allocated,
                    "tensors": tensor_bytes, "bookkeeping": sorted(book), **slots})
    if ifmt is not None:
        figures["indexer_format"] = ifmt
        figures["formula_indexer_bytes_per_token"] = indexer_bytes_per_token(config, fmt, dtype, kv_codec, ifmt)
    where = f"{backend.name} {preset} {dtype_name(dtype)}{'' if kv_codec == 'none' else ' kv_codec ' + kv_codec} " \
            f"{tokens} tokens (batch {batch})"
    seq_lens = [int(v) for v in cache.seq_lens.tolist()]
    if seq_lens != [prefill + decode] * batch:
        raise AssertionError(f"{where}: cache.seq_lens is {seq_lens}, expected {[prefill + decode] * batch}")
    if allocated != sum(tensor_bytes.values()):
        raise AssertionError(failure(f"{where}: allocated_nbytes() = {allocated:,} B but the tensors() it lists hold "
                                     f"{sum(tensor_bytes.values()):,} B", f"tensors(): {tensor_bytes}"))
    per_buffer = ", ".join(f"{k!r} {describe_buffers({k: tensors[k]})[k]}: "
                           f"{v / tokens:,.6g} B/token" for k, v in sorted(written.items()) if v)
    if total_written != measured * tokens or measured != expected:
        hints = _byte_hints(config, fmt, ifmt, kv_codec, dtype, tensors, written, tokens)
        raise AssertionError(failure(
            f"{where}: the cache holds {total_written / tokens:,.6g} B per stored token, the declared format "
            f"{fmt!r} needs {expected:,} B: {times(total_written / tokens / expected) if expected else 'inf x'} "
            "the format's",
            f"written: {per_buffer or 'nothing'} (the token-storage bytes that no longer hold the suite's poison)",
            f"format: {fmt!r}{'' if kv_codec == 'none' else ' with kv_codec ' + kv_codec}"
            f"{'' if ifmt is None else f', indexer_format {ifmt!r}'}; the format is wrong, not the slot count "
            "(docs/cache-bytes.md)", cause="; ".join(hints)))
    if slots["preallocated"] and slots["allocated_slots"] < requested:
        raise AssertionError(failure(
            f"{where}: the cache preallocated room for {slots['allocated_slots']:,} tokens, {requested:,} were "
            "requested: the slot count is wrong, not the format",
            f"{sum(storage.values()):,} B of token storage / {measured:,} B per token; batch x capacity = "
            f"{batch} x {capacity}"))
    book_bytes = sum(book.values())
    if not tokens * measured <= active <= tokens * measured + book_bytes:
        raise AssertionError(failure(
            f"{where}: active_nbytes() says {active:,} B but the {tokens} stored tokens occupy {tokens * measured:,} B"
            + (f" (+ at most {book_bytes:,} B of bookkeeping)" if book else "") + ": the self-report is wrong",
            f"{measured:,} B per token, measured from tensors(): {per_buffer}"
            + (f"; bookkeeping / per-cache buffers {sorted(book)}" if book else "")))
    return figures


def v2_lite_cache_probe(backend, device="cpu", figures: dict | None = None) -> dict[str, Any]:
    """The V2-Lite cache probe (seed 000's measurement): V2-Lite dims, bf16, 25-token prefill + 1 decode,
    batch 1, capacity 32."""
    __tracebackhide__ = True
    return cache_bytes(backend, "deepseek-v2-lite", torch.bfloat16, prefill=25, decode=1, batch=1,
                       capacity=32, device=device, figures=figures)

