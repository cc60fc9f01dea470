"""The absorbed speed-up claim's floor and its verdict (no timing here: fake measurements).

CLAIM_FLOOR is derived from the config, the expanded cache's bytes per token over the latent cache's (as
`mla-conformance budget` counts them), and tests/test_decode_timing_claim.py -- a benchmark, deselected in the
default run -- fails when its measured 16k ratio is under it with the machine's copy bandwidth steady: it is run
here on fake steps and fake timings, at the ratio issue 31 measured (1.28x) and at a passing one."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest

import tests.test_decode_timing_claim as claim_test
from mla_conformance.kv.budget import kv_rows
from mla_conformance.model.config import MLAConfig
from mla_conformance.perf import cases


def test_floor_is_the_cache_byte_ratio():
    rows = {r.key: r.bytes_per_token_per_layer for r in kv_rows(MLAConfig.preset(cases.PRESET), "bfloat16")}
    assert cases.cache_byte_ratio() == rows["mla_expanded_naive"] / rows["mla_latent"]
    assert cases.CLAIM_FLOOR == cases.cache_byte_ratio() * cases.CLAIM_MARGIN


@pytest.mark.parametrize("ratio, readings, verdict", [
    (1.28, [20e9, 19e9], "below floor"), (1.28, [20e9, 9e9], "inconclusive"), (12.0, [20e9, 9e9], "ok")])
def test_verdict(ratio, readings, verdict):
    got, sentence = cases.claim_verdict(ratio, readings)
    assert got == verdict and f"{ratio:.2f}x" in sentence and "cache byte ratio" in sentence


class _Benchmark:
    extra_info: dict = {}

    def pedantic(self, fn, **_):
        return fn()


def _fake_run(monkeypatch, ratio_at_claim: float):
    """The timing test's own code over fake prepared steps: naive takes ``ratio`` x absorbed's time at 16k."""
    def prepare(backend, *a, **k):
        return SimpleNamespace(backend=backend, correctness=SimpleNamespace(record=dict), bytes_per_step=lambda: 1e6)

    def time_interleaved(pair, rounds, warmup):
        ctx = claim_test.CONTEXTS[len(calls)]
        calls.append(ctx)
        r = ratio_at_claim if ctx == cases.CLAIM_CONTEXT else 10.0
        return [[r * 1e-3] * rounds, [1e-3] * rounds]

    calls: list = []
    monkeypatch.setattr(claim_test, "prepare", prepare)
    monkeypatch.setattr(claim_test, "time_interleaved", time_interleaved)
    monkeypatch.setattr(claim_test, "measure_bandwidth", lambda *a, **k: 20e9)
    capsys = SimpleNamespace(disabled=contextlib.nullcontext)
    claim_test.test_absorbed_faster_than_naive(_Benchmark(), capsys, {})


def test_the_timing_test_fails_under_the_floor(monkeypatch):
    with pytest.raises(AssertionError, match=r"1\.28x < stated floor .* steady"):
        _fake_run(monkeypatch, 1.28)


def test_the_timing_test_passes_over_the_floor(monkeypatch):
    _fake_run(monkeypatch, cases.CLAIM_FLOOR * 1.5)
