"""Decode-step timing: one new token per row attending to ``context`` cached tokens.

What one measurement is::

    prepared = prepare(backend, "deepseek-v2-lite", "bfloat16", context=16384, batch=1, device="cpu")
    prepared.reset(); prepared.step()          # one timed decode step
    r = measure(prepared, rounds=5, warmup=1)  # median seconds, GB/s, FLOPs, bandwidth fraction

**Filling the cache.** Prefilling 16k-32k tokens through ``attend()`` is quadratic and infeasible on a
CPU, so the built-in caches are filled directly with *real* latents: random hidden states (RMS ~1, like
a normed layer input) go through :func:`mla_conformance.model.reference.project` in chunks, giving the normed
latent ``c`` and the rotated ``k_pe`` of positions ``0..context-1``; then

* ``SlotCache`` with buffers ``k``/``v`` (reference-naive): ``expand_kv(c, k_pe)`` written with ``write``;
* ``LatentSlotCache`` and the quantized caches of :mod:`mla_conformance.kv.codecs`: ``write_latent`` (the
  codec encodes, as in a real prefill);
* ``HFCache`` (hf-transformers): one ``DynamicCache.update`` with the tensors in the layout this
  transformers stores, found by a one-token probe ``attend`` on a scratch cache (5.x: the latent,
  keys ``[B,1,T,kv_lora]`` / values ``[B,1,T,rope]``; 4.x: expanded per-head K/V ``[B,H,T,d]``), then
  ``slot_pos``/``seq_lens`` set to match;
* any other backend: chunked ``attend()`` prefill (slow, a note goes to stderr).

**Every timed step sees exactly ``context`` cached tokens.** A decode step appends a token, so before
each timed call :meth:`Prepared.reset` puts the cache back: ``seq_lens = context`` (the appended slot
``context`` is simply overwritten by the next step; capacity is ``context + 1``), and for ``HFCache``
the DynamicCache's tensors are truncated back to ``context`` tokens and ``slot_pos`` likewise. A cache
of another backend cannot be rewound safely: it gets capacity for every step and grows by one token a
step (``Prepared.resets`` is False; ``context_drift`` in the figures says how many extra tokens the
last step saw, and its cache bytes are those at the end).

**Bytes per step** = ``cache.active_nbytes()`` at ``context`` tokens + the bytes of every attention
weight of the layer (all of them are read by a decode step): the minimum a step must move; achieved
GB/s = bytes / median time. Backends that also materialise intermediates (transformers 5.x expands the
whole latent cache into per-head K/V on every call; a quantized cache is dequantized on read) move more
than this, so their GB/s is an *effective* figure.

**FLOPs of one step** (B rows, one query token each, N = context + 1 keys including the new token,
H heads, d_qk = nope + rope, d_c = kv_lora, d_r = rope; multiply-adds count 2; softmax, norms and RoPE
are O(H N) and left out)::

    projections   2 B [hidden (H d_qk)  or  hidden q_lora + q_lora H d_qk]      query
                + 2 B hidden (d_c + d_r)                                          kv_a
                + 2 B H d_v hidden                                                o_proj
    "absorbed"    + 2 B H (nope d_c + d_c d_v)         absorb W_UK into q, W_UV into the output
                  + 2 B H N (2 d_c + d_r)               scores on the 576-wide latent + mix on c
    "expanded"    + 2 B d_c H (nope + d_v)             expand the new token
                  + 2 B H N (d_qk + d_v)                scores + mix on per-head K/V
    "expand-per-call" (a latent cache expanded on every call, transformers 5.x)
                  + 2 B N d_c H (nope + d_v) + 2 B H N (d_qk + d_v)

    "sparse" (DeepSeek Sparse Attention, a "latent+indexer" cache; K = min(index_topk, N), n indexer heads
              of width d_i)
                  + 2 B H (nope d_c + d_c d_v) + 2 B H K (2 d_c + d_r)   absorbed MLA over the K selected
                  + 2 B (q_lora n d_i + hidden d_i + hidden n)           indexer q, k and head weights
                  + 2 B n d_i N                                         indexer scores over every key

The model follows the backend's declared ``cache_format`` ("latent" -> absorbed, "expanded" ->
expanded, "latent+indexer" -> sparse), except ``HFCache`` holding the latent, which transformers expands
per call. A "latent+indexer" cache of the built-in reference-dsa is filled with the indexer keys of the
same hidden states (``reference.indexer_project``) next to the latents.

**Sparse decode bytes** (:func:`sparse_decode_bytes`, in every ``bench --json`` as
``sparse_decode_bytes``): bytes one DSA decode step reads per row and layer, dense vs sparse, at
deepseek-v3.2 dims (contexts 16k and 32k, and the command's own above index_topk when its preset is a
DSA one). Dense MLA reads every cached latent row: N x latent B/token. A sparse step reads the indexer
key of every cached token (to score them) and the latent rows of the selection only:
min(index_topk, N) x latent + N x indexer B/token. Bytes per token are *measured*: reference-dsa's cache
(BF16, and the FP8 form with kv_codec fp8-e4m3-flashmla) is allocated at those dims, poisoned, written
with a few tokens, and the bytes that no longer hold the poison are counted per buffer (latent buffers
apart from the indexer key buffer), then checked against ``checks.format_bytes_per_token``.

**Bandwidth of this device** is measured in the same run: the median time of ``dst.copy_(src)`` over a
256 MiB buffer, bandwidth = 2 x bytes / time (read + write); ``bandwidth_fraction`` = achieved GB/s
over it. On CUDA the timer synchronizes the device around each call.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from mla_conformance.model import reference as ref
from mla_conformance.contract.layer import cache_format_of, support_reason
from mla_conformance.specs import get_backend
from mla_conformance.model.config import MLAConfig
from mla_conformance.errors import MLAInputError
from mla_conformance.report import write_file_atomically

#: Tokens per projection chunk while filling a cache.
FILL_CHUNK = 2048

#: Bytes of the buffer the bandwidth probe copies.
BANDWIDTH_PROBE_BYTES = 256 * 1024 * 1024


# --------------------------------------------------------------------------- device helpers


def synchronize(device) -> None:
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def time_call(fn: Callable[[], Any], device) -> float:
    """Wall seconds of one call, the device synchronized before and after."""
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - t0


_BANDWIDTH: dict[str, float] = {}


def measure_bandwidth(device="cpu", nbytes: int = BANDWIDTH_PROBE_BYTES, reps: int = 7, *,
                      refresh: bool = False) -> float:
    """Bytes/s of ``dst.copy_(src)`` over ``nbytes`` (2 x nbytes moved per copy), median of ``reps``.

    Measured once per device and process unless ``refresh``.
    """
    key = str(torch.device(device))
    if key in _BANDWIDTH and not refresh:
        return _BANDWIDTH[key]
    n = nbytes // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch the pages
    times = [time_call(lambda: dst.copy_(src), device) for _ in range(reps)]
    bw = 2 * n * 4 / statistics.median(times)
    del src, dst
    _BANDWIDTH[key] = bw
    return bw


def device_info(device) -> dict[str, Any]:
    dev = torch.device(device)
    info: dict[str, Any] = {"device": str(dev), "torch": torch.__version__}
    if dev.type == "cuda":
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        cap = torch.cuda.get_device_capability(idx)
        info.update(name=torch.cuda.get_device_name(idx), capability=f"{cap[0]}.{cap[1]}",
                    cuda=torch.version.cuda)
    else:
        info.update(name=_cpu_name(), cores=os.cpu_count(), threads=torch.get_num_threads())
    return info


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# --------------------------------------------------------------------------- formulas


def weight_nbytes(weights) -> int:
    """Bytes of every attention weight of the layer (all read by one decode step)."""
    return sum(t.numel() * t.element_size() for t in weights.values())


def decode_flops(config: MLAConfig, context: int, batch: int, model: str) -> int:
    """FLOPs of one decode step over ``context`` cached tokens (see the module docstring)."""
    c = config
    H, d_c, d_r, nope, d_v = (c.num_attention_heads, c.kv_lora_rank, c.qk_rope_head_dim,
                              c.qk_nope_head_dim, c.v_head_dim)
    d_qk = nope + d_r
    N = context + 1
    if c.q_lora_rank is None:
        q = c.hidden_size * H * d_qk
    else:
        q = c.hidden_size * c.q_lora_rank + c.q_lora_rank * H * d_qk
    per_row = 2 * (q + c.hidden_size * (d_c + d_r) + H * d_v * c.hidden_size)
    if model == "absorbed":
        per_row += 2 * H * (nope * d_c + d_c * d_v) + 2 * H * N * (2 * d_c + d_r)
    elif model == "expanded":
        per_row += 2 * d_c * H * (nope + d_v) + 2 * H * N * (d_qk + d_v)
    elif model == "expand-per-call":
        per_row += 2 * N * d_c * H * (nope + d_v) + 2 * H * N * (d_qk + d_v)
    elif model == "sparse":
        if not c.dsa:
            raise ValueError("the sparse FLOP model needs a DeepSeek Sparse Attention config (index_topk set)")
        K = min(c.index_topk, N)
        n, d_i = c.index_n_heads, c.index_head_dim
        per_row += 2 * H * (nope * d_c + d_c * d_v) + 2 * H * K * (2 * d_c + d_r)
        per_row += 2 * ((c.q_lora_rank or 0) * n * d_i + c.hidden_size * d_i + c.hidden_size * n) + 2 * n * d_i * N
    else:
        raise ValueError(f"unknown FLOP model {model!r}")
    return batch * per_row


def flop_model(backend, cache) -> str:
    from mla_conformance.impl.backends.hf import HFCache

    fmt = cache_format_of(backend, cache)
    if isinstance(cache, HFCache) and fmt in ("latent", "latent+indexer"):
        return "expand-per-call"  # transformers' eager DeepseekV32Attention masks the dense scores to its top-k
    if fmt == "latent+indexer":
        return "sparse"
    return "absorbed" if fmt == "latent" else "expanded"


# --------------------------------------------------------------------------- filling a cache

_LATENTS: dict[tuple, tuple[Any, list]] = {}


def _chunk_inputs(cfg, start: int, n: int, batch: int, seed: int, device, dtype):
    """Hidden states and positions of tokens start..start+n-1 (the same for latents and indexer keys)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + start)
    x = torch.randn(batch, n, cfg.hidden_size, generator=gen).to(device=device, dtype=dtype)
    return x, torch.arange(start, start + n, device=device).expand(batch, n)


def _indexer_chunks(weights, context: int, batch: int, seed: int, device) -> list[torch.Tensor]:
    """The indexer keys [B, n, index_head_dim] of the hidden states ``_latent_chunks`` projects, chunk by chunk."""
    out = []
    with torch.no_grad():
        for start in range(0, context, FILL_CHUNK):
            x, pos = _chunk_inputs(weights.config, start, min(FILL_CHUNK, context - start), batch, seed, device,
                                   weights.dtype)
            out.append(ref.indexer_project(weights, x, pos)[1])
    return out


def _latent_chunks(weights, context: int, batch: int, seed: int, device) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """[(start, c [B,n,kv_lora], k_pe [B,n,rope])] for positions 0..context-1 of random hidden states.

    Cached (a few entries) per weights/context/batch/seed/device: the suite fills many caches alike.
    """
    key = (id(weights), context, batch, seed, str(device))
    hit = _LATENTS.get(key)
    if hit is not None and hit[0] is weights:
        return hit[1]
    cfg = weights.config
    chunks = []
    with torch.no_grad():
        for start in range(0, context, FILL_CHUNK):
            x, pos = _chunk_inputs(cfg, start, min(FILL_CHUNK, context - start), batch, seed, device, weights.dtype)
            _, _, c, k_pe = ref.project(weights, x, pos)
            chunks.append((start, c, k_pe))
    while len(_LATENTS) >= 3:
        _LATENTS.pop(next(iter(_LATENTS)))
    _LATENTS[key] = (weights, chunks)
    return chunks


def _fill_kind(backend, cache) -> str:
    """How ``prepare`` fills this cache: "expanded", "latent", "latent+indexer", "hf" or "attend"."""
    from mla_conformance.impl.backends.hf import HFCache
    from mla_conformance.kv.caches import LatentSlotCache, SlotCache

    if isinstance(cache, HFCache):
        # a DSA DynamicCache also holds indexer keys, which DynamicCache.update does not fill: through attend()
        return "attend" if getattr(cache.config, "dsa", False) else "hf"
    if not type(cache).__module__.startswith("mla_conformance."):
        return "attend"
    if isinstance(cache, LatentSlotCache) and cache_format_of(backend, cache) == "latent+indexer":
        return "latent+indexer" if hasattr(cache, "write_index_k") or "index_k" in cache.tensors() else "attend"
    if isinstance(cache, LatentSlotCache) or (isinstance(cache, SlotCache) and hasattr(cache, "write_latent")):
        return "latent"
    if isinstance(cache, SlotCache) and set(cache.tensors()) == {"k", "v"}:
        return "expanded"
    return "attend"


def _hf_layout(backend, weights, device) -> str:
    """"latent" or "expanded": what this transformers stores, from a one-token probe on a scratch cache."""
    cfg = weights.config
    probe = backend.new_cache(cfg, batch_size=1, capacity=2, dtype=weights.dtype, device=device)
    x = torch.zeros(1, 1, cfg.hidden_size, dtype=weights.dtype, device=device)
    pos = torch.zeros(1, 1, dtype=torch.int64, device=device)
    backend.attend(weights, x, pos, probe)
    kv = probe.tensors()
    if not kv:
        raise RuntimeError("hf-transformers stored nothing in its DynamicCache after one token")
    k, v = kv["layers.0.keys"], kv["layers.0.values"]
    if k.shape[1] == 1 and k.shape[-1] == cfg.kv_lora_rank and v.shape[-1] == cfg.qk_rope_head_dim:
        return "latent"
    if k.shape[1] == cfg.num_attention_heads and k.shape[-1] == cfg.qk_head_dim and v.shape[-1] == cfg.v_head_dim:
        return "expanded"
    raise RuntimeError(f"unrecognised transformers cache layout: keys {tuple(k.shape)}, values {tuple(v.shape)}")


def _fill(backend, weights, cache, kind: str, context: int, batch: int, seed: int, device, say) -> None:
    dev = torch.device(device)
    if kind == "attend":
        say(f"{backend.name}: no direct fill for {type(cache).__name__}; prefilling {context} tokens through "
            "attend() in chunks (slow: quadratic in the context)")
        cfg = weights.config
        with torch.no_grad():
            for start in range(0, context, 512):
                n = min(512, context - start)
                gen = torch.Generator().manual_seed(seed * 1_000_003 + start)
                x = torch.randn(batch, n, cfg.hidden_size, generator=gen).to(device=dev, dtype=weights.dtype)
                pos = cache.seq_lens.to(dev)[:, None] + torch.arange(n, device=dev)
                backend.attend(weights, x, pos, cache)
        return
    chunks = _latent_chunks(weights, context, batch, seed, dev)
    if kind == "hf":
        layout = _hf_layout(backend, weights, dev)
        with torch.no_grad():
            if layout == "latent":
                keys = torch.cat([c for _, c, _ in chunks], dim=1)[:, None]
                values = torch.cat([k for _, _, k in chunks], dim=1)[:, None]
            else:
                ks, vs = zip(*(ref.expand_kv(weights, c, k) for _, c, k in chunks))
                keys = torch.cat(ks, dim=1).transpose(1, 2)
                values = torch.cat(vs, dim=1).transpose(1, 2)
            cache.fill(keys, values)
        return
    index_keys = _indexer_chunks(weights, context, batch, seed, dev) if kind == "latent+indexer" else None
    with torch.no_grad():
        for i, (_, c, k_pe) in enumerate(chunks):
            n = c.shape[1]
            if kind == "latent+indexer":  # the indexer keys at the slots append_latent then fills and commits
                every = torch.full((batch,), n, dtype=torch.int64, device=dev)
                if hasattr(cache, "write_index_k"):
                    cache.write_index_k(index_keys[i], every)
                else:
                    cache.write("index_k", index_keys[i], every)
                cache.append_latent(c, k_pe)
            elif kind == "latent":
                cache.append_latent(c, k_pe)
            else:
                k, v = ref.expand_kv(weights, c, k_pe)
                cache.append({"k": k, "v": v})


# --------------------------------------------------------------------------- one prepared decode step


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
    positions: torch.Tensor | None = None
    steps_taken: int = 0

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

    def step(self) -> torch.Tensor:
        """One decode step (one new token per row), the device synchronized at the end."""
        if self.positions is None:
            self.reset()
        with torch.no_grad():
            out = self.backend.attend(self.weights, self.hidden, self.positions, self.cache, lengths=self.lengths)
        synchronize(self.device)
        self.steps_taken += 1
        self.positions = None if not self.resets else self.positions
        return out

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

    def figures(self, median_s: float, bandwidth: float | None = None) -> dict[str, Any]:
        """Bytes per step, GB/s, FLOPs and the fraction of ``bandwidth`` (bytes/s) for a median time."""
        nbytes = self.bytes_per_step()
        flops = self.flops()
        gbps = nbytes / median_s / 1e9
        return {
            "backend": self.backend.name, "kv_codec": self.kv_codec, "context": self.context, "batch": self.batch,
            "dtype": str(self.dtype).removeprefix("torch."), "preset": self.preset, "device": self.device,
            "median_s": median_s, "bytes_per_step": nbytes, "cache_bytes": self.cache_nbytes(),
            "weight_bytes": weight_nbytes(self.weights), "gb_per_s": gbps, "flops": flops,
            "gflop_per_s": flops / median_s / 1e9, "flop_model": self.flop_model,
            "cache_format": cache_format_of(self.backend, self.cache), "fill": self.fill,
            "resets_context": self.resets, "context_drift": 0 if self.resets else max(self.steps_taken - 1, 0),
            "bandwidth_fraction": (gbps * 1e9 / bandwidth) if bandwidth else None,
        }


def _resolve_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    from mla_conformance.checks import DTYPES

    try:
        return DTYPES[dtype]
    except KeyError:
        raise MLAInputError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPES)}") from None


def _say_stderr(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def prepare(backend, preset: str, dtype, context: int, batch: int, device="cpu", kv_codec: str = "none", *,
            seed: int = 0, steps: int = 64, progress: Callable[[str], None] | None = None) -> Prepared:
    """Weights of ``preset``, a cache filled to ``context`` tokens per row, and one decode step's inputs.

    ``backend``: a backend object or spec; ``dtype``: torch dtype or name. Capacity is ``context + 1``
    for caches that :meth:`Prepared.reset` rewinds, ``context + 1 + steps`` otherwise. Raises
    ``MLAInputError`` for bad sizes and ``ValueError`` with the backend's sentence when it does not
    support the combination.
    """
    from mla_conformance.checks import check_output, weights_for

    say = progress or _say_stderr
    for name, value in (("context", context), ("batch", batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise MLAInputError(f"{name} must be a positive integer, got {value!r}")
    if isinstance(backend, str):
        backend = get_backend(backend)
    dtype = _resolve_dtype(dtype)
    config = MLAConfig.preset(preset)
    if context + 1 > config.max_position_embeddings:
        raise MLAInputError(f"context {context} exceeds {preset}'s max_position_embeddings "
                            f"{config.max_position_embeddings}")
    reason = support_reason(backend, config, dtype=dtype, device=str(device), kv_codec=kv_codec)
    if reason:
        raise ValueError(reason)
    weights = weights_for(preset, dtype, device, seed=seed)
    probe = backend.new_cache(config, batch_size=batch, capacity=1, dtype=dtype, device=device, kv_codec=kv_codec)
    kind = _fill_kind(backend, probe)
    del probe
    resets = kind != "attend"
    capacity = context + 1 if resets else context + 1 + steps
    cache = backend.new_cache(config, batch_size=batch, capacity=capacity, dtype=dtype, device=device,
                              kv_codec=kv_codec)
    t0 = time.perf_counter()
    _fill(backend, weights, cache, kind, context, batch, seed, device, say)
    synchronize(device)
    got = cache.seq_lens.tolist()
    if got != [context] * batch:
        raise RuntimeError(f"{backend.name}: cache holds {got} tokens after filling to {context}")
    gen = torch.Generator().manual_seed(seed * 1_000_003 + 999_983)
    hidden = torch.randn(batch, 1, config.hidden_size, generator=gen).to(device=device, dtype=dtype)
    lengths = torch.ones(batch, dtype=torch.int64, device=device)
    p = Prepared(backend=backend, weights=weights, cache=cache, preset=preset, dtype=dtype, context=context,
                 batch=batch, device=str(device), kv_codec=kv_codec, fill=kind, resets=resets, hidden=hidden,
                 lengths=lengths)
    if resets:  # one checked step: the filled cache must give a finite, well-shaped output
        p.reset()
        out = p.step()
        check_output(backend, out, hidden, lengths, f"decode step at context {context}", p.positions)
        p.reset()
    say(f"{backend.name} ctx={context} batch={batch}: cache filled ({kind}) in {time.perf_counter() - t0:.1f}s")
    return p


# --------------------------------------------------------------------------- timing


def default_rounds(context: int) -> int:
    """Few rounds for long contexts: 10 up to 4k, 5 up to 16k, 3 beyond."""
    return 10 if context <= 4096 else 5 if context <= 16384 else 3


def time_steps(prepared: Prepared, rounds: int, warmup: int = 1) -> list[float]:
    """Seconds of ``rounds`` decode steps (after ``warmup``), each after a reset (not timed)."""
    for _ in range(warmup):
        prepared.reset()
        prepared.step()
    times = []
    for _ in range(rounds):
        prepared.reset()
        times.append(time_call(prepared.step, prepared.device))
    return times


def time_interleaved(prepared: list[Prepared], rounds: int, warmup: int = 1,
                     progress: Callable[[str], None] | None = None) -> list[list[float]]:
    """Like :func:`time_steps` for several prepared steps, round-robin so noise hits all alike."""
    for _ in range(warmup):
        for p in prepared:
            p.reset()
            p.step()
    times: list[list[float]] = [[] for _ in prepared]
    for r in range(rounds):
        for i, p in enumerate(prepared):
            p.reset()
            times[i].append(time_call(p.step, p.device))
        if progress is not None:
            progress(f"round {r + 1}/{rounds}: " + ", ".join(
                f"{p.backend.name} {t[-1] * 1e3:.1f} ms" for p, t in zip(prepared, times)))
    return times


def measure(prepared: Prepared, rounds: int | None = None, warmup: int = 1, *,
            bandwidth: float | None = None) -> dict[str, Any]:
    """Median time of one decode step and its figures (bandwidth measured unless given)."""
    rounds = rounds or default_rounds(prepared.context)
    times = time_steps(prepared, rounds, warmup)
    bw = bandwidth if bandwidth is not None else measure_bandwidth(prepared.device)
    fig = prepared.figures(statistics.median(times), bw)
    fig.update(rounds=rounds, warmup=warmup, times_s=times)
    return fig


#: A copy-bandwidth reading below this fraction of the run's best one means the machine was busy.
BUSY_FRACTION = 0.8


def bandwidth_fraction(readings: list[float]) -> float:
    """The worst copy-bandwidth reading of a run over its best (1.0: the machine stayed as fast)."""
    readings = [r for r in readings if r and r > 0]
    return min(readings) / max(readings) if readings else 1.0


def ratio_verdict(ratio: float, floor: float, fraction: float, *, what: str = "ratio") -> tuple[str, str]:
    """A timing ratio against a stated floor: ("ok" | "inconclusive" | "below floor", one sentence).

    Below the floor is "inconclusive (machine busy: N% of copy bandwidth measured)" when the machine's
    own copy bandwidth dropped under :data:`BUSY_FRACTION` of its best reading in the same run: a load
    spike is not a property of the code under test.
    """
    if ratio >= floor:
        return "ok", f"{what} {ratio:.2f}x >= stated floor {floor:g}x"
    if fraction < BUSY_FRACTION:
        return "inconclusive", (f"{what} {ratio:.2f}x < stated floor {floor:g}x: inconclusive (machine busy: "
                                f"{fraction:.0%} of copy bandwidth measured)")
    return "below floor", (f"{what} {ratio:.2f}x < stated floor {floor:g}x with the machine's copy bandwidth "
                           f"steady ({fraction:.0%} of its best reading)")


def speed_ratios(results: list[dict[str, Any]]) -> dict[str, float]:
    """naive median / absorbed median per context (and batch/codec when not 1/"none"), where both exist."""
    out: dict[str, float] = {}
    index = {(r["backend"], r["context"], r["batch"], r["kv_codec"]): r for r in results
             if r.get("median_s")}
    for (name, ctx, batch, codec), r in index.items():
        if name != "reference-absorbed":
            continue
        naive = index.get(("reference-naive", ctx, batch, "none"))
        if naive is None:
            continue
        key = str(ctx) + ("" if batch == 1 else f"/b{batch}") + ("" if codec == "none" else f"/{codec}")
        out[key] = naive["median_s"] / r["median_s"]
    return out


# --------------------------------------------------------------------------- sparse decode bytes

#: Preset and contexts of ``sparse_decode_bytes`` in every ``bench`` report.
SPARSE_PRESET = "deepseek-v3.2"
SPARSE_CONTEXTS = (16384, 32768)
#: The cache forms compared: (dtype, kv_codec) of reference-dsa's latent + indexer cache.
SPARSE_FORMS = (("bfloat16", "none"), ("bfloat16", "fp8-e4m3-flashmla"))


def measured_dsa_bytes_per_token(preset: str, dtype, kv_codec: str = "none", device="cpu") -> dict[str, Any]:
    """Bytes per token of reference-dsa's "latent+indexer" cache at ``preset``'s dims, measured from its tensors
    (the rule of :mod:`mla_conformance.kv.caches.measure`): allocated, poisoned (0xFF and 0x00 runs, united),
    written with 4 tokens through the cache's own write methods, written bytes counted per buffer.
    Returns latent (every buffer but the indexer key's), indexer and total bytes per token, per buffer too,
    checked against ``checks.format_bytes_per_token``."""
    from mla_conformance.impl.backends.reference import ReferenceDSA
    from mla_conformance.kv.caches.measure import poison, written_bytes, written_masks
    from mla_conformance.checks import format_bytes_per_token

    dtype = _resolve_dtype(dtype)
    config = MLAConfig.preset(preset)
    backend = ReferenceDSA()
    reason = backend.unsupported_reason(config, dtype=dtype, device=str(device), kv_codec=kv_codec)
    if reason:
        raise ValueError(reason)
    n = 4
    gen = torch.Generator().manual_seed(0)
    c, k_pe, k_i = (torch.randn(1, n, width, generator=gen).to(device=device, dtype=dtype)
                    for width in (config.kv_lora_rank, config.qk_rope_head_dim, config.index_head_dim))
    masks, tensors = [], None
    for sentinel in (0xFF, 0x00):
        cache = backend.new_cache(config, batch_size=1, capacity=n, dtype=dtype, device=device, kv_codec=kv_codec)
        poisoned = poison(cache, cache.tensors(), batch_size=1, capacity=n, sentinel=sentinel, name="reference-dsa cache")
        every = torch.full((1,), n, dtype=torch.int64, device=device)
        if hasattr(cache, "write_index_k"):
            cache.write_index_k(k_i, every)
        else:
            cache.write("index_k", k_i, every)
        cache.append_latent(c, k_pe)
        tensors = cache.tensors()
        masks.append(written_masks(tensors, poisoned))
    per_buffer = {k: v / n for k, v in written_bytes(tensors, masks).items() if v}
    indexer = per_buffer.get("index_k", 0)
    total = sum(per_buffer.values())
    want = format_bytes_per_token(config, "latent+indexer", dtype, kv_codec)
    if total != want:
        raise RuntimeError(f"reference-dsa {preset} {kv_codec}: measured {total} B/token ({per_buffer}), the "
                           f"latent+indexer format says {want}")
    return {"latent": int(total - indexer), "indexer": int(indexer), "total": int(total),
            "buffers": {k: int(v) for k, v in per_buffer.items()}}


def sparse_decode_bytes(preset: str = SPARSE_PRESET, contexts=SPARSE_CONTEXTS, forms=SPARSE_FORMS,
                        device="cpu") -> dict[str, Any]:
    """Bytes one decode step reads per row and layer, dense MLA vs DeepSeek Sparse Attention, from the measured
    bytes per token (:func:`measured_dsa_bytes_per_token`): dense = N x latent; sparse = min(index_topk, N) x
    latent + N x indexer (every indexer key is scored, only the selection's latent rows are read)."""
    config = MLAConfig.preset(preset)
    if not config.dsa:
        raise MLAInputError(f"{preset} has no DeepSeek Sparse Attention (index_topk None)")
    out: dict[str, Any] = {"preset": preset, "index_topk": config.index_topk, "forms": {},
                           "what": "bytes read per decode step, per row and layer: dense = N x latent B/token; sparse = "
                                   "min(index_topk, N) x latent + N x indexer B/token (measured from reference-dsa's "
                                   "cache tensors)"}
    for dtype, kv_codec in forms:
        name = dtype if kv_codec == "none" else kv_codec
        try:
            per_token = measured_dsa_bytes_per_token(preset, dtype, kv_codec, device)
        except ValueError as exc:  # a form this preset's dims do not have (FP8's 656-byte row needs 512/64)
            out["forms"][name] = {"dtype": dtype, "kv_codec": kv_codec, "skipped": str(exc)}
            continue
        rows = []
        for N in contexts:
            dense = N * per_token["latent"]
            sparse = min(config.index_topk, N) * per_token["latent"] + N * per_token["indexer"]
            rows.append({"context": N, "dense_bytes": dense, "sparse_bytes": sparse,
                         "sparse_latent_bytes": min(config.index_topk, N) * per_token["latent"],
                         "sparse_indexer_bytes": N * per_token["indexer"], "dense_over_sparse": dense / sparse})
        out["forms"][name] = {"dtype": dtype, "kv_codec": kv_codec, "bytes_per_token": per_token, "contexts": rows}
    return out


# --------------------------------------------------------------------------- the CLI


def run_bench(specs: list[str], preset: str, contexts: list[int], dtype: str, *, batch: int = 1,
              kv_codec: str = "none", rounds: int | None = None, warmup: int = 1, device: str | None = None,
              seed: int = 0, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The ``bench`` command's measurement: every backend at every context, interleaved per context."""
    say = progress or _say_stderr
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    tdtype = _resolve_dtype(dtype)
    config = MLAConfig.preset(preset)  # unknown preset -> MLAInputError before any work
    too_long = [c for c in contexts if c + 1 > config.max_position_embeddings]
    if too_long:
        raise MLAInputError(f"context {too_long[0]} exceeds {preset}'s max_position_embeddings "
                            f"{config.max_position_embeddings}")
    backends = [get_backend(s) for s in specs]
    t_start = time.perf_counter()
    say(f"measuring {device} memory bandwidth (copy of {BANDWIDTH_PROBE_BYTES >> 20} MiB)")
    bw = measure_bandwidth(device)
    say(f"bandwidth {bw / 1e9:.1f} GB/s")
    results: list[dict[str, Any]] = []
    for ctx in contexts:
        prepared: list[Prepared] = []
        for b in backends:
            say(f"{b.name} ctx={ctx} batch={batch}: filling the cache (elapsed {time.perf_counter() - t_start:.1f}s)")
            try:
                prepared.append(prepare(b, preset, tdtype, ctx, batch, device, kv_codec, seed=seed, progress=say,
                                        steps=(rounds or default_rounds(ctx)) + warmup))
            except ValueError as exc:
                say(f"{b.name} ctx={ctx}: skipped: {exc}")
                results.append({"backend": b.name, "kv_codec": kv_codec, "context": ctx, "batch": batch,
                                "dtype": dtype, "preset": preset, "device": device, "skipped": str(exc),
                                "median_s": None, "gb_per_s": None, "bytes_per_step": None, "flops": None,
                                "bandwidth_fraction": None})
        if not prepared:
            continue
        n = rounds or default_rounds(ctx)
        say(f"ctx={ctx}: timing {n} rounds x {len(prepared)} backend(s), interleaved "
            f"(elapsed {time.perf_counter() - t_start:.1f}s)")
        times = time_interleaved(prepared, n, warmup,
                                 progress=lambda m, c=ctx: say(f"ctx={c} {m} (elapsed {time.perf_counter() - t_start:.1f}s)"))
        for p, ts in zip(prepared, times):
            fig = p.figures(statistics.median(ts), bw)
            fig.update(rounds=n, warmup=warmup, times_s=ts)
            results.append(fig)
            say(f"{p.backend.name} ctx={ctx}: {fig['median_s'] * 1e3:.2f} ms/step, {fig['gb_per_s']:.1f} GB/s "
                f"(elapsed {time.perf_counter() - t_start:.1f}s)")
        del prepared, times
    if results and all(r.get("skipped") for r in results):
        raise MLAInputError("no backend supports this combination: " + "; ".join(r["skipped"] for r in results))
    # deepseek-v3.2 at 16k and 32k always (plus the command's contexts when it ran that preset); the command's
    # own DSA preset at its contexts as well
    sparse = {"sparse_decode_bytes": sparse_decode_bytes(
        SPARSE_PRESET, sorted(set(SPARSE_CONTEXTS) | (set(contexts) if preset == SPARSE_PRESET else set())))}
    if config.dsa and preset != SPARSE_PRESET:
        sparse["sparse_decode_bytes_preset"] = sparse_decode_bytes(preset, sorted(set(contexts)))
    return {"schema": BENCH_SCHEMA, "schema_version": 1, **sparse,
            "results": results, "device": device_info(device), "measured_bandwidth_gb_per_s": bw / 1e9,
            "naive_over_absorbed": speed_ratios(results),
            "command": {"preset": preset, "contexts": contexts, "dtype": dtype, "backends": specs, "batch": batch,
                        "kv_codec": kv_codec, "rounds": rounds, "warmup": warmup, "seed": seed},
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def to_json(report: dict[str, Any]) -> str:
    return json.dumps(report, sort_keys=True, indent=2)


def format_table(report: dict[str, Any]) -> str:
    d = report["device"]
    lines = [f"decode step on {d['device']} ({d.get('name', '?')}), measured bandwidth "
             f"{report['measured_bandwidth_gb_per_s']:.1f} GB/s", ""]
    head = (f"{'backend':<22} {'codec':<10} {'context':>8} {'batch':>5} {'ms/step':>9} {'MB/step':>9} "
            f"{'GB/s':>7} {'of bw':>6} {'MFLOP':>9} {'GFLOP/s':>8}  flop model")
    lines += [head, "-" * len(head)]
    for r in report["results"]:
        if r.get("skipped"):
            lines.append(f"{r['backend']:<22} {r['kv_codec']:<10} {r['context']:>8} {r['batch']:>5}  "
                         f"skipped: {r['skipped']}")
            continue
        lines.append(f"{r['backend']:<22} {r['kv_codec']:<10} {r['context']:>8} {r['batch']:>5} "
                     f"{r['median_s'] * 1e3:>9.3f} {r['bytes_per_step'] / 1e6:>9.2f} {r['gb_per_s']:>7.2f} "
                     f"{r['bandwidth_fraction']:>6.1%} {r['flops'] / 1e6:>9.1f} {r['gflop_per_s']:>8.2f}  "
                     f"{r['flop_model']}")
    ratios = report.get("naive_over_absorbed") or {}
    if ratios:
        lines += ["", "reference-naive / reference-absorbed time per step (absorbed speed-up):"]
        lines += [f"  context {k}: {v:.2f}x" for k, v in ratios.items()]
    for key in ("sparse_decode_bytes", "sparse_decode_bytes_preset"):
        sparse = report.get(key)
        if not sparse:
            continue
        lines += ["", f"DeepSeek Sparse Attention decode, bytes read per step per row and layer at {sparse['preset']} "
                      f"dims (index_topk {sparse['index_topk']}; measured B/token):"]
        for form, f in sparse["forms"].items():
            if f.get("skipped"):
                lines.append(f"  {form:<18} skipped: {f['skipped']}")
                continue
            bpt = f["bytes_per_token"]
            for r in f["contexts"]:
                lines.append(f"  {form:<18} latent {bpt['latent']} + indexer {bpt['indexer']} B/token, context "
                             f"{r['context']:>6}: dense {r['dense_bytes'] / 1e6:8.2f} MB, sparse "
                             f"{r['sparse_bytes'] / 1e6:8.2f} MB, dense/sparse {r['dense_over_sparse']:.2f}x")
    return "\n".join(lines)


#: The ``schema`` of the JSON ``bench --out`` writes; an existing file is overwritten only if it has it.
BENCH_SCHEMA = "mla-conformance/bench"


def add_cli(subparsers) -> None:
    from mla_conformance.checks import DTYPES
    from mla_conformance.cli import DEFAULT_PRESET, positive_int, preset_help

    p = subparsers.add_parser(
        "bench", help="time one decode step per backend at long contexts (GB/s, FLOPs, bandwidth fraction)",
        description="Time one decode step (one new token per row over CONTEXT cached tokens) for each backend, "
                    "side by side, with bytes per step, achieved GB/s, FLOPs and the fraction of this device's "
                    "memory bandwidth measured in the same run. Caches of the built-in backends are filled "
                    "directly with real latents; every timed step sees exactly CONTEXT cached tokens.")
    p.add_argument("--preset", default=DEFAULT_PRESET, help=preset_help())
    p.add_argument("--context", type=positive_int, nargs="+", required=True, metavar="N", help="cached tokens per row")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="dtype (default: bfloat16)")
    p.add_argument("--backend", action="append", default=None, metavar="SPEC",
                   help="backend spec (repeatable; default: reference-naive and reference-absorbed)")
    p.add_argument("--batch", type=int, default=1, help="rows (default: 1)")
    p.add_argument("--kv-codec", default="none", help="cache codec (default: none)")
    p.add_argument("--rounds", type=int, default=None,
                   help="timed rounds per backend (default: 10 up to 4k, 5 up to 16k, 3 beyond)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default: 1)")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's; 1 is steadier on a loaded machine)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and hidden states (default: 0)")
    p.add_argument("--json", action="store_true", help="print the results as JSON (sorted keys)")
    p.add_argument("--out", metavar="FILE", default=None,
                   help="write the JSON here (default: reports/bench/bench-<preset>-<dtype>-<time>.json); checked "
                        "before measuring: a new file, or one an earlier `bench` wrote")
    p.set_defaults(func=run_cli)


def run_cli(args) -> int:
    from mla_conformance.cli import UserError

    if any(c <= 0 for c in args.context):
        raise UserError(f"--context must be positive integers, got {args.context}")
    if args.batch <= 0:
        raise UserError(f"--batch must be a positive integer, got {args.batch}")
    if args.rounds is not None and args.rounds <= 0:
        raise UserError(f"--rounds must be a positive integer, got {args.rounds}")
    if args.warmup < 0:
        raise UserError(f"--warmup must be >= 0, got {args.warmup}")
    if args.threads is not None:
        if args.threads <= 0:
            raise UserError(f"--threads must be a positive integer, got {args.threads}")
        torch.set_num_threads(args.threads)
    from mla_conformance.cli import check_device
    from mla_conformance.report import check_out_file

    device = check_device(args.device) if args.device is not None else None
    MLAConfig.preset(args.preset)  # unknown preset -> one line, before any work
    if args.kv_codec != "none":
        try:
            from mla_conformance.kv.codecs import get_codec
        except ImportError:
            raise UserError(f"--kv-codec {args.kv_codec!r}: no quantized codecs in this installation") from None
        try:
            get_codec(args.kv_codec)
        except ValueError as exc:
            raise UserError(f"--kv-codec: {exc}") from None
    specs = args.backend or ["reference-naive", "reference-absorbed"]
    for spec in specs:
        get_backend(spec)  # an unknown spec is named before any work
    if args.out:
        out = Path(args.out)
    else:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        out = Path("reports") / "bench" / f"bench-{args.preset}-{args.dtype}-{stamp}.json"
    out = check_out_file(out, BENCH_SCHEMA)  # before measuring: results are never lost to a bad path
    report = run_bench(specs, args.preset, list(args.context), args.dtype, batch=args.batch,
                       kv_codec=args.kv_codec, rounds=args.rounds, warmup=args.warmup, device=device,
                       seed=args.seed)
    text = to_json(report)
    check_out_file(out, BENCH_SCHEMA)
    write_file_atomically(out, text + "\n")
    print(text if args.json else format_table(report))
    print(f"[bench] results written to {out}", file=sys.stderr)
    return 0
