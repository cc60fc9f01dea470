"""One prepared decode step: a backend, its weights and a cache of ``context`` tokens per row, checked, ready to time.

What one measurement is::

    prepared = prepare(backend, "deepseek-v2-lite", "bfloat16", context=16384, batch=1, device="cpu")
    prepared.correctness                       # the gate's outcome (mla_conformance.perf.gate)
    prepared.reset(); prepared.step()          # one timed decode step (refused unless the gate passed)
    r = measure(prepared, rounds=5, warmup=1)  # median seconds, GB/s, FLOPs, bandwidth fraction

**Every timed step sees exactly ``context`` cached tokens.** A decode step appends a token, so before
each timed call :meth:`Prepared.reset` puts the cache back: ``seq_lens = context`` (the appended slot
``context`` is simply overwritten by the next step; capacity is ``context + 1``), and for ``HFCache``
the DynamicCache's tensors are truncated back to ``context`` tokens and ``slot_pos`` likewise. A cache
of another backend cannot be rewound safely: it gets capacity for every step and grows by one token a
step (``Prepared.resets`` is False; ``context_drift`` in the figures says how many extra tokens the
last step saw, and its cache bytes are those at the end). The gate checks the first step after the fill,
the one at exactly ``context`` tokens.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any, Callable

import torch

from mla_conformance.checks.layer.driver import weights_for
from mla_conformance.checks.metrics import DTYPES
from mla_conformance.contract.layer import cache_format_of, support_reason
from mla_conformance.dtypes import dtype_name
from mla_conformance.errors import MLAInputError
from mla_conformance.model.config import MLAConfig
from mla_conformance.perf import gate
from mla_conformance.perf.fill import fill, fill_kind
from mla_conformance.perf.flops import decode_flops, flop_model, weight_nbytes
from mla_conformance.perf.timing import synchronize
from mla_conformance.specs import get_backend


class NotSupported(ValueError):
    """The backend declines this combination (its own sentence, or the declaration it lacks)."""


@dataclasses.dataclass
class Prepared:
    """A backend, its weights and a cache holding ``context`` tokens per row, ready to time a decode step."""

    backend: Any
    weights: Any
    cache: Any
    preset: str
    dtype: torch.dtype
    context: int
    batch: int
    device: str
    kv_codec: str
    fill: str
    resets: bool
    hidden: torch.Tensor
    lengths: torch.Tensor
    seed: int = 0
    positions: torch.Tensor | None = None
    steps_taken: int = 0
    correctness: gate.Correctness | None = None

    def reset(self) -> None:
        """Put the cache back to exactly ``context`` tokens per row (no-op when it cannot be rewound)."""
        cache = self.cache
        if self.resets:
            cache.rewind(self.context)
        self.positions = cache.seq_lens.to(self.hidden.device)[:, None].clone()

    def setup(self):
        """pytest-benchmark ``pedantic`` setup: reset, no arguments."""
        self.reset()
        return None

    def require_correct(self) -> None:
        """Raise :class:`~mla_conformance.perf.gate.NotTimed` unless the gate ran on this step and passed."""
        if self.correctness is None:
            raise gate.NotTimed(f"not timed: {self.backend.name} context {self.context}: no correctness check ran")
        if not self.correctness.passed:
            raise gate.NotTimed(self.correctness.refusal())

    def step(self) -> torch.Tensor:
        """One decode step (one new token per row), the device synchronized at the end; refused unless the
        gate passed."""
        self.require_correct()
        return self._attend()

    def _attend(self) -> torch.Tensor:
        if self.positions is None:
            self.reset()
        with torch.no_grad():
            out = self.backend.attend(self.weights, self.hidden, self.positions, self.cache, lengths=self.lengths)
        synchronize(self.device)
        self.steps_taken += 1
        self.positions = None if not self.resets else self.positions
        return out

    def check(self) -> gate.Correctness:
        """Run the gate: the step at exactly ``context`` tokens against the float64 oracle (sets ``correctness``)."""
        self.reset()
        positions = self.positions
        out = self._attend()
        self.positions = positions  # what the gated step saw (check_output names positions)
        self.correctness = gate.check_step(self, out)
        if self.resets:
            self.reset()
        else:
            self.positions = None
        return self.correctness

    @property
    def config(self) -> MLAConfig:
        return self.weights.config

    @property
    def flop_model(self) -> str:
        return flop_model(self.backend, self.cache)

    def cache_nbytes(self) -> int:
        """Active cache bytes at ``context`` tokens per row."""
        if self.resets:
            self.reset()
        return int(self.cache.active_nbytes())

    def bytes_per_step(self) -> int:
        return self.cache_nbytes() + weight_nbytes(self.weights)

    def flops(self) -> int:
        return decode_flops(self.config, self.context, self.batch, self.flop_model)

    def describe(self) -> dict[str, Any]:
        """The configuration, without timings."""
        return {"backend": self.backend.name, "kv_codec": self.kv_codec, "context": self.context, "batch": self.batch,
                "dtype": dtype_name(self.dtype), "preset": self.preset, "device": self.device,
                "cache_format": cache_format_of(self.backend, self.cache), "fill": self.fill,
                "correctness": self.correctness.record() if self.correctness else None}

    def figures(self, median_s: float, bandwidth: float | None = None) -> dict[str, Any]:
        """Bytes per step, GB/s, FLOPs and the fraction of ``bandwidth`` (bytes/s) for a median time."""
        self.require_correct()
        nbytes = self.bytes_per_step()
        flops = self.flops()
        gbps = nbytes / median_s / 1e9
        return {
            **self.describe(), "median_s": median_s, "bytes_per_step": nbytes, "cache_bytes": self.cache_nbytes(),
            "weight_bytes": weight_nbytes(self.weights), "gb_per_s": gbps, "flops": flops,
            "gflop_per_s": flops / median_s / 1e9, "flop_model": self.flop_model,
            "resets_context": self.resets, "context_drift": 0 if self.resets else max(self.steps_taken - 1, 0),
            "bandwidth_fraction": (gbps * 1e9 / bandwidth) if bandwidth else None,
        }


def resolve_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError:
        raise MLAInputError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPES)}") from None


def say_stderr(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def prepare(backend, preset: str, dtype, context: int, batch: int, device="cpu", kv_codec: str = "none", *,
            seed: int = 0, steps: int = 64, progress: Callable[[str], None] | None = None) -> Prepared:
    """Weights of ``preset``, a cache filled to ``context`` tokens per row, one decode step's inputs, and the
    gate's outcome on that step (``correctness``; a step that failed it cannot be timed).

    ``backend``: a backend object or spec; ``dtype``: torch dtype or name. Capacity is ``context + 1``
    for caches that :meth:`Prepared.reset` rewinds, ``context + 1 + steps`` otherwise. Raises
    ``MLAInputError`` for bad sizes and :class:`NotSupported` with the backend's sentence when it does not
    support the combination.
    """
    say = progress or say_stderr
    for name, value in (("context", context), ("batch", batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise MLAInputError(f"{name} must be a positive integer, got {value!r}")
    if isinstance(backend, str):
        backend = get_backend(backend)
    dtype = resolve_dtype(dtype)
    config = MLAConfig.preset(preset)
    if context + 1 > config.max_position_embeddings:
        raise MLAInputError(f"context {context} exceeds {preset}'s max_position_embeddings "
                            f"{config.max_position_embeddings}")
    reason = support_reason(backend, config, dtype=dtype, device=str(device), kv_codec=kv_codec)
    if reason:
        raise NotSupported(reason)
    weights = weights_for(preset, dtype, device, seed=seed)
    probe = backend.new_cache(config, batch_size=batch, capacity=1, dtype=dtype, device=device, kv_codec=kv_codec)
    kind = fill_kind(backend, probe)
    del probe
    resets = kind != "attend"
    capacity = context + 1 if resets else context + 1 + steps
    cache = backend.new_cache(config, batch_size=batch, capacity=capacity, dtype=dtype, device=device,
                              kv_codec=kv_codec)
    t0 = time.perf_counter()
    fill(backend, weights, cache, kind, context, batch, seed, device, say)
    synchronize(device)
    got = cache.seq_lens.tolist()
    if got != [context] * batch:
        raise RuntimeError(f"{backend.name}: cache holds {got} tokens after filling to {context}")
    gen = torch.Generator().manual_seed(seed * 1_000_003 + 999_983)
    hidden = torch.randn(batch, 1, config.hidden_size, generator=gen).to(device=device, dtype=dtype)
    lengths = torch.ones(batch, dtype=torch.int64, device=device)
    p = Prepared(backend=backend, weights=weights, cache=cache, preset=preset, dtype=dtype, context=context,
                 batch=batch, device=str(device), kv_codec=kv_codec, fill=kind, resets=resets, hidden=hidden,
                 lengths=lengths, seed=seed)
    filled = time.perf_counter() - t0
    result = p.check()
    verdict = "correct" if result.passed else result.refusal()
    say(f"{backend.name} ctx={context} batch={batch}: cache filled ({kind}) in {filled:.1f}s; decode step checked "
        f"against the float64 oracle: {verdict}")
    return p
