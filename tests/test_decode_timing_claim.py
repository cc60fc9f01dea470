"""The absorbed path's speed-up claim, on the two references (no backend under test): moved out of the
conformance suite, which keeps only tests that judge a backend.

``test_absorbed_faster_than_naive`` records reference-naive / reference-absorbed decode time at 1k, 4k,
16k and 32k (batch 1), both timed in one run, interleaved round by round (median of several rounds),
with GB/s and the machine's copy bandwidth read before every context and at the end. Both steps pass the
correctness gate first (:mod:`mla_conformance.perf.gate`: no timing without correctness). The seed's claim
(>= 2x at 16k) is recorded as a figure (``seed_claim_2x_met``); the 16k ratio is held to
:data:`~mla_conformance.perf.cases.CLAIM_FLOOR`, derived from the config: the expanded cache's bytes per token over
the latent cache's (:func:`~mla_conformance.perf.cases.cache_byte_ratio`, no margin). Under it the test fails, or
says "inconclusive (machine busy: N% of copy bandwidth measured)" -- a skip -- when the copy bandwidth dropped
during the run (:func:`mla_conformance.perf.cases.claim_verdict`; tests/test_claim_floor.py holds that verdict to
failing a measurement under the floor). It requests the ``benchmark`` fixture only so that ``--benchmark-only``
does not skip it; its figures are its own medians, not pytest-benchmark's. This checkout's conftest.py has the
CPU threads wait passively (:mod:`mla_conformance.perf.cpu_wait`), as ``bench`` does.
"""

import statistics

import pytest
import torch

from mla_conformance.perf.cases import (CLAIM_CONTEXT, CLAIM_FLOOR, CONTEXTS, DTYPE, PRESET, RATIO_ROUNDS,
                                        SEED_CLAIM_RATIO, WARMUP, cache_byte_ratio, claim_verdict, ctx_id)
from mla_conformance.perf.cpu_wait import wait_policy
from mla_conformance.perf.step import prepare
from mla_conformance.perf.timing import bandwidth_fraction, measure_bandwidth, time_interleaved
from mla_conformance.specs import get_backend

pytestmark = pytest.mark.benchmark


@pytest.mark.mla_section("decode-timing")
def test_absorbed_faster_than_naive(benchmark, capsys, mla_figures):
    """reference-naive / reference-absorbed decode time per context (figures); 16k held to CLAIM_FLOOR."""
    naive, absorbed = get_backend("reference-naive"), get_backend("reference-absorbed")
    readings = [measure_bandwidth("cpu", refresh=True)]
    correctness: dict = {}  # the gate's record of each timed step

    def compare() -> dict:
        rows = {}
        for ctx in CONTEXTS:
            pair = [prepare(b, PRESET, DTYPE, ctx, 1, "cpu", progress=lambda _m: None) for b in (naive, absorbed)]
            for p in pair:
                correctness[f"{p.backend.name} {ctx_id(ctx)}"] = p.correctness.record()
            t_naive, t_abs = time_interleaved(pair, RATIO_ROUNDS[ctx], WARMUP)  # NotTimed unless both are correct
            m_naive, m_abs = statistics.median(t_naive), statistics.median(t_abs)
            rows[ctx] = {"naive_s": m_naive, "absorbed_s": m_abs, "ratio": m_naive / m_abs,
                         "naive_gb_per_s": pair[0].bytes_per_step() / m_naive / 1e9,
                         "absorbed_gb_per_s": pair[1].bytes_per_step() / m_abs / 1e9,
                         "rounds": RATIO_ROUNDS[ctx]}
            del pair
            readings.append(measure_bandwidth("cpu", refresh=True))
        return rows

    rows = benchmark.pedantic(compare, rounds=1, iterations=1, warmup_rounds=0)
    fraction = bandwidth_fraction(readings)
    ratios = {ctx_id(ctx): r["ratio"] for ctx, r in rows.items()}
    got = rows[CLAIM_CONTEXT]["ratio"]
    verdict, sentence = claim_verdict(got, readings)
    info = dict(ratios=ratios, measured_bandwidth_gb_per_s=[r / 1e9 for r in readings],
                bandwidth_fraction=fraction, floor=CLAIM_FLOOR, cache_byte_ratio=cache_byte_ratio(PRESET),
                verdict=verdict, seed_claim_2x_met=got >= SEED_CLAIM_RATIO, threads=torch.get_num_threads(),
                omp_wait_policy=wait_policy())
    benchmark.extra_info.update(info)
    benchmark.extra_info["correctness"] = correctness
    mla_figures.update(info, rows={str(k): v for k, v in rows.items()})
    with capsys.disabled():
        print(f"\nreference-naive / reference-absorbed decode time, {PRESET} bf16, batch 1, cpu "
              f"({torch.get_num_threads()} threads), copy bandwidth {min(readings) / 1e9:.1f}-{max(readings) / 1e9:.1f} GB/s:")
        for ctx, r in rows.items():
            print(f"  {ctx_id(ctx):>7}: naive {r['naive_s'] * 1e3:8.1f} ms ({r['naive_gb_per_s']:.2f} GB/s)  "
                  f"absorbed {r['absorbed_s'] * 1e3:8.1f} ms ({r['absorbed_gb_per_s']:.2f} GB/s)  "
                  f"ratio {r['ratio']:.2f}x (naive time / absorbed time)  [median of {r['rounds']}]")
        print(f"  {sentence}; seed 000's claim (>= {SEED_CLAIM_RATIO}x) {'met' if got >= SEED_CLAIM_RATIO else 'not met'}")
    if verdict == "inconclusive":
        pytest.skip(sentence)
    assert verdict == "ok", (
        f"{sentence} (naive {rows[CLAIM_CONTEXT]['naive_s'] * 1e3:.1f} ms, absorbed "
        f"{rows[CLAIM_CONTEXT]['absorbed_s'] * 1e3:.1f} ms per step)")
