"""Decode-step benchmarks: one new token per row over a long cached context, per backend.

Run with::

    pytest suites/test_decode_bench.py -m benchmark --benchmark-only -p no:xdist

Everything here is marked ``benchmark`` and skipped in a default run (the plugin adds the skip unless
``-m benchmark`` or ``--benchmark-only`` is given). pytest-xdist disables pytest-benchmark (its
fixture then runs the target once and records no statistics), hence ``-p no:xdist``; timings are
only meaningful one test at a time anyway.

``test_decode_step`` times ``backend.attend`` on a single new token with pytest-benchmark's
``pedantic`` (setup rewinds the cache before every round, so each round sees exactly ``context``
cached tokens; see :mod:`mla_conformance.bench` for how caches are filled without a quadratic
prefill), at DeepSeek-V2-Lite dims in BF16, for every backend under test x kv_codec x context x
batch. ``extra_info`` carries bytes per step, achieved GB/s, FLOPs (with the formula's model) and the
fraction of the memory bandwidth measured in the same run.

``test_absorbed_faster_than_naive`` is the seed's claim on this CPU: reference-absorbed's decode step
is at least 2x faster than reference-naive's at 16k context (batch 1), both timed in one run,
interleaved round by round (median of several rounds each). It prints the ratios at 1k, 4k, 16k and
32k. It requests the ``benchmark`` fixture only so that ``--benchmark-only`` does not skip it; its
figures are its own medians, not pytest-benchmark's statistics.
"""

from __future__ import annotations

import importlib.util
import statistics

import pytest
import torch

from mla_conformance import MLAConfig, bench, checks
from mla_conformance.backends import get_backend

pytestmark = pytest.mark.benchmark

PRESET = "deepseek-v2-lite"
DTYPE = torch.bfloat16
CONTEXTS = (1024, 4096, 16384, 32768)
#: Timed rounds per context (few for long contexts: a naive 32k step takes seconds on a CPU).
ROUNDS = {1024: 10, 4096: 5, 16384: 3, 32768: 3}
WARMUP = 1
#: (context, batch): batch 1 everywhere, batch 4 at 1k and 4k.
CASES = [(ctx, b) for ctx in CONTEXTS for b in (1, 4) if b == 1 or ctx <= 4096]
KV_CODECS = ("none", "int8-g32") if importlib.util.find_spec("mla_conformance.codecs") else ("none",)


def _ctx_id(ctx: int) -> str:
    return f"ctx{ctx // 1024}k" if ctx % 1024 == 0 else f"ctx{ctx}"


@pytest.mark.parametrize("kv_codec", KV_CODECS)
@pytest.mark.parametrize("context,batch", CASES, ids=[f"{_ctx_id(c)}-b{b}" for c, b in CASES])
def test_decode_step(benchmark, backend, kv_codec, context, batch, mla_device, figures):
    """One decode step over ``context`` cached tokens, timed by pytest-benchmark."""
    config = MLAConfig.preset(PRESET)
    checks.require_support(backend, config, dtype=DTYPE, device=mla_device, kv_codec=kv_codec)
    rounds = ROUNDS[context]
    prepared = bench.prepare(backend, PRESET, DTYPE, context, batch, mla_device, kv_codec,
                             steps=rounds + WARMUP + 1)
    benchmark.group = f"decode {PRESET} bf16 {_ctx_id(context)} batch {batch}"
    benchmark.pedantic(prepared.step, setup=prepared.setup, rounds=rounds, warmup_rounds=WARMUP, iterations=1)
    stats = getattr(benchmark, "stats", None)
    if stats is not None and getattr(stats, "stats", None) is not None:
        median = stats.stats.median
    else:  # benchmark fixture disabled (--benchmark-disable, xdist): time the step here
        median = statistics.median(bench.time_steps(prepared, rounds, WARMUP))
    got = prepared.figures(median, bench.measure_bandwidth(mla_device))
    info = {k: got[k] for k in ("bytes_per_step", "cache_bytes", "weight_bytes", "gb_per_s", "flops",
                                "gflop_per_s", "flop_model", "bandwidth_fraction", "median_s", "fill",
                                "resets_context")}
    info["measured_bandwidth_gb_per_s"] = bench.measure_bandwidth(mla_device) / 1e9
    benchmark.extra_info.update(info)
    figures.update(info)
    assert median > 0 and info["bytes_per_step"] > info["weight_bytes"]


#: The seed's claim, checked at this context.
CLAIM_CONTEXT = 16384
CLAIM_RATIO = 2.0
RATIO_ROUNDS = {1024: 7, 4096: 5, 16384: 5, 32768: 3}


def test_absorbed_faster_than_naive(benchmark, capsys, figures):
    """reference-absorbed decode >= 2x faster than reference-naive at 16k, V2-Lite bf16, batch 1, CPU."""
    naive, absorbed = get_backend("reference-naive"), get_backend("reference-absorbed")
    bw = bench.measure_bandwidth("cpu")

    def compare() -> dict:
        rows = {}
        for ctx in CONTEXTS:
            pair = [bench.prepare(b, PRESET, DTYPE, ctx, 1, "cpu", progress=lambda _m: None)
                    for b in (naive, absorbed)]
            t_naive, t_abs = bench.time_interleaved(pair, RATIO_ROUNDS[ctx], WARMUP)
            m_naive, m_abs = statistics.median(t_naive), statistics.median(t_abs)
            rows[ctx] = {"naive_s": m_naive, "absorbed_s": m_abs, "ratio": m_naive / m_abs,
                         "naive_gb_per_s": pair[0].bytes_per_step() / m_naive / 1e9,
                         "absorbed_gb_per_s": pair[1].bytes_per_step() / m_abs / 1e9,
                         "rounds": RATIO_ROUNDS[ctx]}
            del pair
        return rows

    rows = benchmark.pedantic(compare, rounds=1, iterations=1, warmup_rounds=0)
    ratios = {_ctx_id(ctx): r["ratio"] for ctx, r in rows.items()}
    benchmark.extra_info.update(ratios=ratios, measured_bandwidth_gb_per_s=bw / 1e9, threads=torch.get_num_threads())
    figures.update(ratios=ratios, rows={str(k): v for k, v in rows.items()}, measured_bandwidth_gb_per_s=bw / 1e9)
    with capsys.disabled():
        print(f"\nreference-naive / reference-absorbed decode time, {PRESET} bf16, batch 1, cpu "
              f"({torch.get_num_threads()} threads), bandwidth {bw / 1e9:.1f} GB/s:")
        for ctx, r in rows.items():
            print(f"  {_ctx_id(ctx):>7}: naive {r['naive_s'] * 1e3:8.1f} ms ({r['naive_gb_per_s']:.2f} GB/s)  "
                  f"absorbed {r['absorbed_s'] * 1e3:8.1f} ms ({r['absorbed_gb_per_s']:.2f} GB/s)  "
                  f"ratio {r['ratio']:.2f}x  [median of {r['rounds']}]")
    got = rows[CLAIM_CONTEXT]["ratio"]
    assert got >= CLAIM_RATIO, (
        f"reference-absorbed decode is only {got:.2f}x faster than reference-naive at {CLAIM_CONTEXT} tokens "
        f"(naive {rows[CLAIM_CONTEXT]['naive_s'] * 1e3:.1f} ms, absorbed {rows[CLAIM_CONTEXT]['absorbed_s'] * 1e3:.1f} "
        f"ms per step); expected >= {CLAIM_RATIO}x")
