"""Cache bytes, measured from the real cache tensors of every backend under test.

One rule (mla_conformance.checks.cache_bytes, mla_conformance.cache.measure): the suite poisons every
token-storage buffer of a fresh cache, drives tokens through attend(), and counts the bytes that no longer
hold the poison. Bytes per stored token must equal the declared format's; slots beyond the requested
capacity are an allocation policy, reported (allocated_slots, slot_overhead), never a failure.

The V2-Lite cache probe (the seed-000 experiment) measured, at DeepSeek-V2-Lite dims in BF16 after a
25-token prefill and a 1-token decode (batch 1, 32 preallocated slots): absorbed 29,952 B active (latent
26,624 + rope 3,328) and 36,864 allocated; naive 266,240 active (K 159,744 + V 106,496) and 327,680
allocated; ratio 8.888...
"""

import pytest
import torch

from mla_conformance import MLAConfig, checks
from mla_conformance.backends import get_backend


@pytest.mark.mla_section("v2-lite-cache-probe")
def test_seed_table(mla_backend, mla_device, mla_figures):
    """The V2-Lite cache probe through the contract: bytes per stored token follow the declared format."""
    got = checks.v2_lite_cache_probe(mla_backend, device=mla_device, figures=mla_figures)
    per_token = 576 * 2 if got["cache_format"] == "latent" else 5120 * 2
    assert got["bytes_per_token"] == per_token
    assert got["tokens"] * per_token <= got["active_nbytes"]


def test_seed_figures_reproduced(mla_device, mla_figures):
    """The seed's exact figures, from the two reference backends' cache objects."""
    absorbed = checks.v2_lite_cache_probe(get_backend("reference-absorbed"), device=mla_device)
    naive = checks.v2_lite_cache_probe(get_backend("reference-naive"), device=mla_device)
    t_abs, t_naive = absorbed["tensors"], naive["tensors"]
    mla_figures.update(absorbed_active=absorbed["active_nbytes"], naive_active=naive["active_nbytes"],
                   absorbed_allocated=absorbed["allocated_nbytes"], naive_allocated=naive["allocated_nbytes"])
    def active_slice(buffer_bytes: int, capacity: int = 32, tokens: int = 26) -> int:
        """Bytes of the first `tokens` slots of a [1, capacity, ...] buffer, from its measured size."""
        assert buffer_bytes % capacity == 0
        return buffer_bytes // capacity * tokens

    assert absorbed["active_nbytes"] == 29_952
    assert (active_slice(t_abs["kv_latent"]), active_slice(t_abs["k_pe"])) == (26_624, 3_328)
    assert t_abs == {"kv_latent": 32_768, "k_pe": 4_096} and absorbed["allocated_nbytes"] == 36_864
    assert naive["active_nbytes"] == 266_240
    assert (active_slice(t_naive["k"]), active_slice(t_naive["v"])) == (159_744, 106_496)
    assert t_naive == {"k": 196_608, "v": 131_072} and naive["allocated_nbytes"] == 327_680
    ratio = naive["active_nbytes"] / absorbed["active_nbytes"]
    assert ratio == pytest.approx(8.888888888888889, abs=1e-12)
    assert 1 - absorbed["active_nbytes"] / naive["active_nbytes"] == pytest.approx(0.8875, abs=1e-12)
    mla_figures.update(ratio=ratio, reduction=1 - absorbed["active_nbytes"] / naive["active_nbytes"])


@pytest.mark.mla_section("cache-bytes")
@pytest.mark.parametrize("preset", ["tiny", "deepseek-v2-lite"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("prefill,decode,batch", [(1, 0, 1), (9, 3, 1), (6, 2, 3)])
def test_bytes_formula(mla_backend, preset, dtype, prefill, decode, batch, mla_device, mla_figures):
    """Bytes per stored token == the format's; enough slots; allocated == tensors() bytes; active == tokens x
    measured bytes per token."""
    checks.cache_bytes(mla_backend, preset, checks.DTYPES[dtype], prefill=prefill, decode=decode, batch=batch,
                       capacity=16, device=mla_device, figures=mla_figures)


@pytest.mark.mla_section("cache-bytes")
@pytest.mark.slow
@pytest.mark.parametrize("preset", ["deepseek-v3"])
def test_bytes_formula_v3_dims(mla_backend, preset, mla_device, mla_figures):
    """At DeepSeek-V3 dims (128 heads, q_lora 1536): 1,152 B/token latent, 81,920 expanded."""
    got = checks.cache_bytes(mla_backend, preset, torch.bfloat16, prefill=4, decode=1, batch=1, capacity=8,
                             device=mla_device, figures=mla_figures)
    assert got["per_token_bytes"] == (1_152 if got["cache_format"] == "latent" else 81_920)


def test_per_token_formulas():
    """The formulas themselves, at V2-Lite and V3 dims (576 latent vs 5,120 / 40,960 expanded elements)."""
    lite, v3 = MLAConfig.preset("deepseek-v2-lite"), MLAConfig.preset("deepseek-v3")
    assert (lite.latent_dim, lite.expanded_dim) == (576, 5_120)
    assert (v3.latent_dim, v3.expanded_dim * 2) == (576, 81_920)
