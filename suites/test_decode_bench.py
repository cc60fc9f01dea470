"""Decode-step benchmarks: one new token per row over a long cached context, per backend.

Run with::

    pytest suites/test_decode_bench.py -m benchmark --benchmark-only -n 0

Everything here is marked ``benchmark`` and deselected in a default run (the plugin deselects it unless
``-m benchmark`` or ``--benchmark-only`` is given). pytest-xdist disables pytest-benchmark (its
fixture then runs the target once and records no statistics), hence ``-n 0``; timings are
only meaningful one test at a time anyway.

``test_decode_step`` times ``backend.attend`` on a single new token with pytest-benchmark's
``pedantic`` (setup rewinds the cache before every round, so each round sees exactly ``context``
cached tokens; see :mod:`mla_conformance.perf.fill` for how caches are filled without a quadratic
prefill), at DeepSeek-V2-Lite dims in BF16, for every backend under test x kv_codec x context x
batch. ``extra_info`` carries bytes per step, achieved GB/s, FLOPs (with the formula's model) and the
fraction of the memory bandwidth measured in the same run.

No timing without correctness: ``perf.step.prepare`` checks the decode step of the exact configuration it then
times (backend, dtype, preset, context, batch, page size, kv codec) against the float64 oracle with the suite's
bounds plus each row's score-rounding term (:mod:`mla_conformance.perf.gate`,
:mod:`mla_conformance.perf.score_rounding`: at these contexts rounding the scores to bf16 alone exceeds TOLERANCES'
bf16 rel_fro), and a test whose step fails it fails with "not timed: wrong output (<measured> vs <bound>,
<where>)" before anything is timed; ``correctness`` in its ``extra_info`` says which
configuration was checked and the outcome. Past that gate, timings are figures, not verdicts:
``test_decode_step`` records median, GB/s and FLOPs and asserts only properties of the measurement that a
broken cache or backend breaks: the timed step saw exactly ``context`` cached tokens per row (the cache was
rewound and appended one token), and the bytes a step must move exceed the weights'.

``test_sparse_decode_step`` times a DeepSeek Sparse Attention backend's decode (v3.2-mini, contexts 256 and
1016, far above its index_topk 16) against reference-absorbed's dense decode (v3-mini, the same MLA dims),
interleaved, and records the bytes a step must read dense vs sparse (``perf.sparse.sparse_decode_bytes``).

The configurations timed here, and the absorbed speed-up claim (``CLAIM_FLOOR``) that
tests/test_decode_timing_claim.py holds the two references to, are :mod:`mla_conformance.perf.cases`'.
"""

from __future__ import annotations

import statistics

import pytest

from mla_conformance import MLAConfig, checks
from mla_conformance.perf.cases import (CASES, DENSE_PRESET, DTYPE, KV_CODECS, PRESET, ROUNDS,
                                        SPARSE_CONTEXTS, SPARSE_PRESET, SPARSE_ROUNDS, WARMUP, ctx_id)
from mla_conformance.perf.sparse import sparse_decode_bytes
from mla_conformance.perf.step import prepare
from mla_conformance.perf.timing import measure_bandwidth, time_interleaved, time_steps
from mla_conformance.specs import get_backend

pytestmark = pytest.mark.benchmark


def _gated(prepared, benchmark):
    """The prepared step, after recording its correctness check (pytest-benchmark's ``extra_info``: the
    configuration checked, the bound, what was measured); fails "not timed: wrong output (...)" if it failed."""
    __tracebackhide__ = True
    benchmark.extra_info.setdefault("correctness", {})[prepared.backend.name] = prepared.correctness.record()
    if not prepared.correctness.passed:
        pytest.fail(prepared.correctness.refusal(), pytrace=False)
    return prepared


@pytest.mark.mla_section("decode-timing")
@pytest.mark.parametrize("kv_codec", KV_CODECS)
@pytest.mark.parametrize("context,batch", CASES, ids=[f"{ctx_id(c)}-b{b}" for c, b in CASES])
def test_decode_step(benchmark, mla_backend, kv_codec, context, batch, mla_device, mla_figures):
    """One decode step over ``context`` cached tokens, timed by pytest-benchmark."""
    config = MLAConfig.preset(PRESET)
    checks.require_support(mla_backend, config, dtype=DTYPE, device=mla_device, kv_codec=kv_codec)
    rounds = ROUNDS[context]
    prepared = _gated(prepare(mla_backend, PRESET, DTYPE, context, batch, mla_device, kv_codec,
                              steps=rounds + WARMUP + 1), benchmark)
    benchmark.group = f"decode {PRESET} bf16 {ctx_id(context)} batch {batch}"
    benchmark.pedantic(prepared.step, setup=prepared.setup, rounds=rounds, warmup_rounds=WARMUP, iterations=1)
    stats = getattr(benchmark, "stats", None)
    if stats is not None and getattr(stats, "stats", None) is not None:
        median = stats.stats.median
    else:  # benchmark fixture disabled (--benchmark-disable, xdist): time the step here
        median = statistics.median(time_steps(prepared, rounds, WARMUP))
    got = prepared.figures(median, measure_bandwidth(mla_device))
    info = {k: got[k] for k in ("bytes_per_step", "cache_bytes", "weight_bytes", "gb_per_s", "flops",
                                "gflop_per_s", "flop_model", "bandwidth_fraction", "median_s", "fill",
                                "resets_context")}
    info["measured_bandwidth_gb_per_s"] = measure_bandwidth(mla_device) / 1e9
    benchmark.extra_info.update(info)
    mla_figures.update(info)
    # properties of the measurement, not of the clock: each timed step saw `context` tokens per row
    if prepared.resets:
        prepared.reset()
        prepared.step()
        seen = prepared.cache.seq_lens.tolist()
        assert seen == [context + 1] * batch, (
            f"{mla_backend.name}: a rewound decode step left {seen} tokens per row, expected {context + 1}: the timed "
            f"steps did not see exactly {context} cached tokens")
    assert info["bytes_per_step"] > info["weight_bytes"], (
        f"{mla_backend.name}: the cache holds no bytes at {context} tokens ({info['cache_bytes']} B)")


@pytest.mark.mla_section("decode-timing")
@pytest.mark.parametrize("context", SPARSE_CONTEXTS, ids=[f"ctx{c}" for c in SPARSE_CONTEXTS])
def test_sparse_decode_step(benchmark, mla_backend, context, mla_device, mla_figures):
    """A DSA backend's decode step above index_topk vs reference-absorbed's dense step, both timed in one run,
    interleaved round by round (medians), with the bytes a step must read: dense = N x latent B/token, sparse
    = index_topk x latent + N x indexer B/token (perf.sparse.sparse_decode_bytes, measured from reference-dsa's
    cache tensors). Both steps pass the correctness gate first; past it, figures, not a verdict: it asserts only
    that each timed step saw ``context`` cached tokens and (where the backend exposes last_topk_indices)
    selected index_topk keys. Requests the ``benchmark`` fixture only so that ``--benchmark-only`` does not skip
    it."""
    config = MLAConfig.preset(SPARSE_PRESET)
    checks.require_support(mla_backend, config, dtype=DTYPE, device=mla_device)
    sparse = _gated(prepare(mla_backend, SPARSE_PRESET, DTYPE, context, 1, mla_device,
                            steps=SPARSE_ROUNDS + WARMUP + 1), benchmark)
    dense = _gated(prepare(get_backend("reference-absorbed"), DENSE_PRESET, DTYPE, context, 1, mla_device,
                           steps=SPARSE_ROUNDS + WARMUP + 1), benchmark)
    t_sparse, t_dense = time_interleaved([sparse, dense], SPARSE_ROUNDS, WARMUP)
    model = sparse_decode_bytes(SPARSE_PRESET, [context], forms=(("bfloat16", "none"),))
    row = model["forms"]["bfloat16"]["contexts"][0]
    med_s, med_d = statistics.median(t_sparse), statistics.median(t_dense)
    mla_figures.update(context=context, index_topk=config.index_topk, sparse_median_s=med_s, dense_median_s=med_d,
                       dense_over_sparse_time=med_d / med_s, sparse_fill=sparse.fill, flop_model=sparse.flop_model,
                       sparse_flops=sparse.flops(), dense_flops=dense.flops(),
                       bytes_per_token=model["forms"]["bfloat16"]["bytes_per_token"],
                       dense_bytes=row["dense_bytes"], sparse_bytes=row["sparse_bytes"],
                       dense_over_sparse_bytes=row["dense_over_sparse"])
    benchmark.extra_info.update(mla_figures)
    if sparse.resets:
        sparse.reset()
        sparse.step()
        seen = sparse.cache.seq_lens.tolist()
        assert seen == [context + 1], (f"{mla_backend.name}: a rewound decode step left {seen} tokens, expected "
                                       f"{context + 1}: the timed steps did not see exactly {context} cached tokens")
        idx = getattr(sparse.cache, "last_topk_indices", None)
        if idx is not None:
            n = int((idx >= 0).sum())
            assert n == config.index_topk, (f"{mla_backend.name}: the decode step at context {context} selected {n} "
                                            f"keys, expected index_topk = {config.index_topk}")
