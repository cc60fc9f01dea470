"""The ``bench`` measurement: every backend at every context, each decode step checked, then timed side by side.

How the pieces fit (one job per module)::

    perf/fill.py     a cache filled to ``context`` real tokens per row without a quadratic prefill
    perf/step.py     Prepared: one decode step ready to time; prepare() fills, then runs the gate
    perf/gate.py     the correctness gate: the step against the float64 oracle, the suite's bounds
    perf/score_rounding.py  the term those bounds gain per row: the error of rounding the scores to the dtype
    perf/timing.py   the timing loop, the device's copy bandwidth, ratios held to a floor
    perf/flops.py    bytes and FLOPs a decode step must move and compute
    perf/sparse.py   DeepSeek Sparse Attention's bytes per decode step, dense vs sparse (measured B/token)
    perf/table.py    the terminal table
    perf/cases.py    what the pytest benchmarks time

A backend whose decode step fails the gate gets no figure: its row says "not timed: wrong output (<measured>
vs <bound>, <where>)" with ``gb_per_s`` None, and ``bench`` exits 1. Every row carries ``correctness``: the
configuration checked (the one timed), the oracle, the bound and the measured errors.
"""

from __future__ import annotations

import datetime
import json
import statistics
import time
from typing import Any, Callable

import torch

from mla_conformance.arch.device import device_description
from mla_conformance.errors import MLAInputError
from mla_conformance.model.config import MLAConfig
from mla_conformance.perf.cases import cache_byte_ratio
from mla_conformance.perf.cpu_wait import wait_policy
from mla_conformance.perf.sparse import SPARSE_CONTEXTS, SPARSE_PRESET, sparse_decode_bytes
from mla_conformance.perf.step import NotSupported, Prepared, prepare, resolve_dtype, say_stderr
from mla_conformance.perf.timing import BANDWIDTH_PROBE_BYTES, default_rounds, measure_bandwidth, time_interleaved
from mla_conformance.specs import get_backend

#: The ``schema`` of the JSON ``bench --out`` writes; an existing file is overwritten only if it has it.
BENCH_SCHEMA = "mla-conformance/bench"


def ratio_pairs(results: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(key, naive row, absorbed row) per context (and batch/codec when not 1/"none"), where both were timed."""
    out = []
    index = {(r["backend"], r["context"], r["batch"], r["kv_codec"]): r for r in results
             if r.get("median_s")}
    for (name, ctx, batch, codec), r in index.items():
        if name != "reference-absorbed":
            continue
        naive = index.get(("reference-naive", ctx, batch, "none"))
        if naive is None:
            continue
        key = str(ctx) + ("" if batch == 1 else f"/b{batch}") + ("" if codec == "none" else f"/{codec}")
        out.append((key, naive, r))
    return out


def speed_ratios(results: list[dict[str, Any]]) -> dict[str, float]:
    """naive median / absorbed median per context (and batch/codec when not 1/"none"), where both were timed."""
    return {key: naive["median_s"] / absorbed["median_s"] for key, naive, absorbed in ratio_pairs(results)}


_NO_FIGURES = {"median_s": None, "gb_per_s": None, "bytes_per_step": None, "flops": None, "bandwidth_fraction": None}


def not_timed(p: Prepared) -> dict[str, Any]:
    """The row of a step that failed the gate: its configuration and the check, no figure."""
    return {**p.describe(), **_NO_FIGURES, "not_timed": p.correctness.refusal()}


def any_not_timed(report: dict[str, Any]) -> bool:
    return any(r.get("not_timed") for r in report["results"])


def run_bench(specs: list[str], preset: str, contexts: list[int], dtype: str, *, batch: int = 1,
              kv_codec: str = "none", rounds: int | None = None, warmup: int = 1, device: str | None = None,
              seed: int = 0, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The ``bench`` command's measurement: every backend at every context, each checked first, the correct
    ones timed interleaved per context."""
    say = progress or say_stderr
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    resolve_dtype(dtype)  # an unknown dtype -> MLAInputError before any work
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
                p = prepare(b, preset, dtype, ctx, batch, device, kv_codec, seed=seed, progress=say,
                            steps=(rounds or default_rounds(ctx)) + warmup)
            except NotSupported as exc:
                say(f"{b.name} ctx={ctx}: skipped: {exc}")
                results.append({"backend": b.name, "kv_codec": kv_codec, "context": ctx, "batch": batch,
                                "dtype": dtype, "preset": preset, "device": device, "skipped": str(exc),
                                **_NO_FIGURES})
                continue
            if p.correctness.passed:
                prepared.append(p)
            else:
                results.append(not_timed(p))
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
            "results": results, "device": device_description(device), "measured_bandwidth_gb_per_s": bw / 1e9,
            "naive_over_absorbed": speed_ratios(results), "cache_byte_ratio": cache_byte_ratio(preset),
            "cpu_wait_policy": wait_policy(),
            "command": {"preset": preset, "contexts": contexts, "dtype": dtype, "backends": specs, "batch": batch,
                        "kv_codec": kv_codec, "rounds": rounds, "warmup": warmup, "seed": seed},
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def to_json(report: dict[str, Any]) -> str:
    return json.dumps(report, sort_keys=True, indent=2)
