"""Decode-step benchmarks: one new token per row over a long cached context, per backend.

Run with::

    pytest suites/test_decode_bench.py -m benchmark --benchmark-only -p no:xdist

Everything here is marked ``benchmark`` and deselected in a default run (the plugin deselects it unless
``-m benchmark`` or ``--benchmark-only`` is given). pytest-xdist disables pytest-benchmark (its
fixture then runs the target once and records no statistics), hence ``-p no:xdist``; timings are
only meaningful one test at a time anyway.

``test_decode_step`` times ``backend.attend`` on a single new token with pytest-benchmark's
``pedantic`` (setup rewinds the cache before every round, so each round sees exactly ``context``
cached tokens; see :mod:`mla_conformance.bench` for how caches are filled without a quadratic
prefill), at DeepSeek-V2-Lite dims in BF16, for every backend under test x kv_codec x context x
batch. ``extra_info`` carries bytes per step, achieved GB/s, FLOPs (with the formula's model) and the
fraction of the memory bandwidth measured in the same run.

Timings are figures, not verdicts. ``test_decode_step`` records median, GB/s and FLOPs and asserts
only properties of the measurement that a broken cache or backend breaks: the timed step saw exactly
``context`` cached tokens per row (the cache was rewound and appended one token), its output is finite
and shaped [batch, 1, hidden], and the bytes a step must move exceed the weights'.

``test_absorbed_faster_than_naive`` records reference-naive / reference-absorbed decode time at 1k, 4k,
16k and 32k (batch 1), both timed in one run, interleaved round by round (median of several rounds),
with GB/s and the machine's copy bandwidth read before every context and at the end. The seed's claim
(>= 2x at 16k) is recorded as a figure (``seed_claim_2x_met``); the test falls short only against
:data:`CLAIM_FLOOR` (1.3x at 16k, far below the 2.8x measured on the development CPU: the absorbed step
moves 8.9x fewer cache bytes), and then says "inconclusive (machine busy: N% of copy bandwidth
measured)" -- a skip, not a failure -- when the copy bandwidth dropped during the run
(:func:`mla_conformance.bench.ratio_verdict`). It requests the ``benchmark`` fixture only so that
``--benchmark-only`` does not skip it; its figures are its own medians, not pytest-benchmark's.
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


@pytest.mark.mla_section("decode-timing")
@pytest.mark.parametrize("kv_codec", KV_CODECS)
@pytest.mark.parametrize("context,batch", CASES, ids=[f"{_ctx_id(c)}-b{b}" for c, b in CASES])
def test_decode_step(benchmark, mla_backend, kv_codec, context, batch, mla_device, mla_figures):
    """One decode step over ``context`` cached tokens, timed by pytest-benchmark."""
    config = MLAConfig.preset(PRESET)
    checks.require_support(mla_backend, config, dtype=DTYPE, device=mla_device, kv_codec=kv_codec)
    rounds = ROUNDS[context]
    prepared = bench.prepare(mla_backend, PRESET, DTYPE, context, batch, mla_device, kv_codec,
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
    mla_figures.update(info)
    # properties of the measurement, not of the clock: each timed step saw `context` tokens per row
    if prepared.resets:
        prepared.reset()
        out = prepared.step()
        seen = prepared.cache.seq_lens.tolist()
        assert seen == [context + 1] * batch, (
            f"{mla_backend.name}: a rewound decode step left {seen} tokens per row, expected {context + 1}: the timed "
            f"steps did not see exactly {context} cached tokens")
        assert tuple(out.shape) == (batch, 1, prepared.config.hidden_size) and bool(torch.isfinite(out).all()), (
            f"{mla_backend.name}: decode step output {tuple(out.shape)}, finite={bool(torch.isfinite(out).all())}")
    assert info["bytes_per_step"] > info["weight_bytes"], (
        f"{mla_backend.name}: the cache holds no bytes at {context} tokens ({info['cache_bytes']} B)")


#: The seed's claim at this context (recorded as a figure) and the floor the test holds it to.
CLAIM_CONTEXT = 16384
SEED_CLAIM_RATIO = 2.0
#: Far below the 2.8x measured on the development CPU (2-core, bf16, batch 1): the absorbed step reads
#: 8.9x fewer cache bytes, so under 1.3x it is not exploiting that.
CLAIM_FLOOR = 1.3
RATIO_ROUNDS = {1024: 7, 4096: 5, 16384: 5, 32768: 3}
