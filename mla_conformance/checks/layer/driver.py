"""Running a backend through a scenario: the scenarios, the seeded weights and inputs they use, the calls into
the backend and the checks on every attend() result (:mod:`mla_conformance.contract.calls`), and the poison the
suite puts in a fresh cache (:mod:`mla_conformance.kv.caches.measure`)."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from mla_conformance.checks.metrics import NAN_FROM_POISON, NAN_OWN
from mla_conformance.contract.calls import NAN_HINT, NonFiniteOutput, call_backend, check_output, tensors_of_checked
from mla_conformance.contract.layer import support_reason
from mla_conformance.errors import BackendError
from mla_conformance.kv.caches.measure import poison
from mla_conformance.model.config import MLAConfig
from mla_conformance.model.weights import MLAWeights


def diagnosis(backend, weights) -> str:
    """The backend's own explanation of a failure, when it offers one (optional ``diagnose(weights)``)."""
    diagnose = getattr(backend, "diagnose", None)
    if not callable(diagnose):
        return ""
    try:
        hint = diagnose(weights)
    except Exception:
        return ""
    return f" [{backend.name} diagnosis: {hint}]" if hint else ""


def require_support(backend, config: MLAConfig, *, dtype, device, kv_codec="none") -> None:
    """Skip with :func:`mla_conformance.contract.layer.support_reason`'s sentence: an optional part the config needs
    that the backend does not declare, or the backend's own sentence for a combination it declines."""
    reason = support_reason(backend, config, dtype=dtype, device=device, kv_codec=kv_codec)
    if reason:
        pytest.skip(reason)


# --------------------------------------------------------------------------- scenarios


@dataclasses.dataclass(frozen=True)
class Scenario:
    """Per-row prefill lengths, then ``decode_steps`` one-token steps for every row; or (``schedule``, made by
    :meth:`of_calls`) the attend() calls spelled out, each call's new tokens per row (0: the row is idle in that
    call; S = the call's largest entry, the rest right padding) -- ``prefill`` then holds each row's total."""

    name: str
    prefill: tuple[int, ...]
    decode_steps: int = 0
    chunk: int | None = None  # prefill in chunks of this many tokens (None = one call)
    schedule: tuple[tuple[int, ...], ...] | None = None

    @classmethod
    def of_calls(cls, name: str, calls: tuple[tuple[int, ...], ...]) -> "Scenario":
        """A scenario of explicit attend() calls: ``calls[c][b]`` new tokens of row b in call c."""
        return cls(name, tuple(sum(c[b] for c in calls) for b in range(len(calls[0]))), schedule=tuple(calls))

    @property
    def batch(self) -> int:
        return len(self.prefill)

    def total(self, b: int) -> int:
        return self.prefill[b] + self.decode_steps

    def calls(self) -> list[tuple[tuple[int, ...], str]]:
        """Every attend() call the driver makes, in order: (new tokens per row, the call as a message names it)."""
        if self.schedule is not None:
            return [(tuple(c), f"call {i + 1} of {len(self.schedule)}, lengths {list(c)}")
                    for i, c in enumerate(self.schedule)]
        out, done = [], [0] * self.batch
        chunk = self.chunk or max(self.prefill)
        while any(d < p for d, p in zip(done, self.prefill)):
            S = min(chunk, max(p - d for d, p in zip(done, self.prefill)))
            n = [min(max(p - d, 0), S) for d, p in zip(done, self.prefill)]
            out.append((tuple(n), f"prefill tokens {done}..+{n}"))
            done = [d + k for d, k in zip(done, n)]
        return out + [((1,) * self.batch, f"decode step {step}") for step in range(self.decode_steps)]


SCENARIOS = {
    "prefill": Scenario("prefill", (24,)),
    "prefill_decode": Scenario("prefill_decode", (20,), decode_steps=6),
    "varlen_batch": Scenario("varlen_batch", (23, 16, 7), decode_steps=4),
    # long enough that reading only part of the cache shows (two prefill chunks, then decode steps over both),
    # and crossing original_max_position of tiny (64) and v3-mini (128); no longer: its DeepSeek-V2-Lite bfloat16
    # rows run per backend, and on a CPU without bf16 instructions a bfloat16 matmul is many times float32's
    "long_context": Scenario("long_context", (200,), decode_steps=4, chunk=128),
}


@functools.lru_cache(maxsize=16)  # every (preset, seed) a session draws: drawn once, the tests share the values
def master_weights(preset: str, seed: int) -> MLAWeights:
    """The float64 random weights of a preset the oracles use (drawn once per session); never handed to a
    backend (:func:`weights_for` casts a copy)."""
    return MLAWeights.random(MLAConfig.preset(preset), seed=seed, dtype=torch.float64)


@functools.lru_cache(maxsize=32)  # every preset x dtype x device a session runs
def _weights_as(preset: str, seed: int, dtype: torch.dtype, device: str) -> MLAWeights:
    return master_weights(preset, seed).to(dtype, device=device).clone()  # never the oracle's own tensors


def weights_for(preset: str, dtype: torch.dtype, device="cpu", seed: int = 0) -> MLAWeights:
    """Random weights of a preset (drawn once in float64, then cast), cached per dtype and device."""
    return _weights_as(preset, seed, dtype, str(device))


def inputs_for(config: MLAConfig, scenario: Scenario, seed: int = 1) -> torch.Tensor:
    """Hidden states [B, T, hidden] in float64 (RMS ~1, like a normed layer input)."""
    T = max(scenario.total(b) for b in range(scenario.batch))
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(scenario.batch, T, config.hidden_size, generator=gen, dtype=torch.float64)


def run_scenario(backend, weights: MLAWeights, x: torch.Tensor, scenario: Scenario, *, device="cpu",
                 capacity: int | None = None, kv_codec: str = "none", poison_sentinel: int = 0xFF,
                 trace: dict | None = None, zero_fill: bool = False, watch=None):
    """Drive a backend through the scenario; return (outputs float64 [B, T, hidden], cache).

    Outputs are placed at each token's position so they line up with the one-shot reference. What the
    suite guarantees around the backend, each a failure naming its cause:

    * the fresh cache's token-storage buffers are poisoned (NaN; ``poison_sentinel`` bytes in integer
      storage) and the poison must land (``tensors()`` are the cache's own buffers): see
      :mod:`mla_conformance.kv.caches.measure`;
    * the backend gets its own copy of the weights; a backend that changes them, or the hidden_states it
      is given, in place fails naming the tensor.

    A non-finite output is a failure whose message says which of two causes it is: the scenario is run again
    on a zero-filled cache (``zero_fill``, the control run), where a backend that reads unwritten slots gives
    finite outputs and one whose own arithmetic makes the NaN does not.

    ``trace`` (a dict), when given, receives ``calls`` (each attend call's (start [B], new tokens [B])),
    ``poisoned`` (what was poisoned) and ``preallocated`` (storage existed right after new_cache).
    ``watch(cache, lengths, where)``, when given, is called before each attend call and returns what to call
    once the call's output passed :func:`check_output` (a check of what the call did to the cache).
    """
    __tracebackhide__ = True
    mine = backend_copy(weights)  # the backend's copy: the caller's weights (and the oracle's) stay untouched
    try:
        return _run(backend, weights, mine, x, scenario, device=device, capacity=capacity, kv_codec=kv_codec,
                    poison_sentinel=poison_sentinel, trace=trace, zero_fill=zero_fill, watch=watch)
    except BaseException:
        weights.__dict__.pop("_backend_copy", None)  # not compared with the suite's: the next run gets a new copy
        raise


def backend_copy(weights: MLAWeights) -> MLAWeights:
    """The backend's copy of ``weights``: made once per weights object and handed to every scenario run on it
    (not cloned per run: a session runs hundreds of scenarios on the same weights). Each run compares it with the
    suite's weights when the backend is done, and a run that fails or raises drops it, so every run starts from
    the suite's values."""
    copy = weights.__dict__.get("_backend_copy")
    if copy is None:
        copy = weights.__dict__["_backend_copy"] = weights.clone()
    return copy


def _run(backend, weights: MLAWeights, mine: MLAWeights, x: torch.Tensor, scenario: Scenario, *, device, capacity,
         kv_codec, poison_sentinel, trace, zero_fill, watch):
    __tracebackhide__ = True
    config = weights.config
    B = scenario.batch
    T = x.shape[1]
    capacity = capacity or T
    cache = call_backend(backend, "new_cache", config, batch_size=B, capacity=capacity, dtype=weights.dtype,
                         device=device, kv_codec=kv_codec)
    where_cache = f"{backend.name} cache ({type(cache).__name__})"
    try:
        tensors = call_backend(cache, "tensors")
    except BackendError as exc:
        raise BackendError(f"{where_cache}: {exc}") from exc
    poisoned = poison(cache, tensors_of_checked(tensors, where_cache), batch_size=B, capacity=capacity,
                      sentinel=poison_sentinel, name=where_cache, zero=zero_fill)
    calls: list[tuple[torch.Tensor, torch.Tensor]] = []
    out = torch.zeros(B, T, config.hidden_size, dtype=torch.float64)
    xd = x.to(device=device, dtype=weights.dtype)
    done = torch.zeros(B, dtype=torch.int64)

    def attend(h, positions, lengths, where):
        __tracebackhide__ = True
        kept = h.clone()
        after = watch(cache, lengths, where) if watch is not None else None
        o = call_backend(backend, "attend", mine, h, positions, cache, lengths.to(device))
        if not torch.equal(h, kept):
            raise AssertionError(f"{backend.name}: attend() changed its hidden_states argument in place ({where}); "
                                 "a backend must not write to its inputs")
        calls.append((done.clone(), lengths.clone()))
        try:
            o = check_output(backend, o, h, lengths, where, positions)
        except NonFiniteOutput as exc:
            if zero_fill:
                raise
            weights.__dict__.pop("_backend_copy", None)  # the control run starts from the suite's values
            raise NonFiniteOutput(exc.where, _nan_cause(backend, weights, x, scenario, device=device, capacity=capacity,
                                                        kv_codec=kv_codec)) from None
        if after is not None:
            after()
        return o

    for new, where in scenario.calls():
        lengths = torch.tensor(new, dtype=torch.int64)
        S = max(1, int(lengths.max()))
        idx = (done[:, None] + torch.arange(S)[None, :]).clamp(max=T - 1)
        h = torch.gather(xd, 1, idx.to(device)[..., None].expand(-1, -1, xd.shape[-1]))
        positions = (done[:, None] + torch.arange(S)[None, :]).to(device)
        o = attend(h, positions, lengths, where)
        for b in range(B):
            n = int(lengths[b])
            out[b, int(done[b]):int(done[b]) + n] = o[b, :n].to("cpu", torch.float64)
        done = done + lengths
    changed = mine.changed_from(weights)
    if changed:
        raise AssertionError(f"{backend.name}: attend() changed the weights tensor(s) {changed} in place (its "
                             "copy differs from the suite's after the run); a backend must not write to its weights")
    if trace is not None:
        trace.update(calls=calls, poisoned=poisoned, preallocated=bool(poisoned.storage))
    return out, cache


def _nan_cause(backend, weights, x, scenario, **kw) -> str:
    """The control run on a zero-filled cache: NAN_FROM_POISON when its outputs are finite, NAN_OWN when they are
    not, NAN_HINT (both causes) when it cannot tell (the control run failed otherwise)."""
    try:
        run_scenario(backend, weights, x, scenario, zero_fill=True, **kw)
    except NonFiniteOutput:
        return NAN_OWN
    except Exception:
        return NAN_HINT
    return NAN_FROM_POISON


def scenario_lengths(scenario: Scenario) -> torch.Tensor:
    return torch.tensor([scenario.total(b) for b in range(scenario.batch)])


