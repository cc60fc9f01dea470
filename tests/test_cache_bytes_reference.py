"""The tool's own tests of suites/test_cache_bytes.py's machinery (no backend under test): moved out of the
conformance suite, which keeps only tests that judge a backend."""

import pytest

from mla_conformance import MLAConfig, checks
from mla_conformance.specs import get_backend


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


def test_per_token_formulas():
    """The formulas themselves, at V2-Lite and V3 dims (576 latent vs 5,120 / 40,960 expanded elements)."""
    lite, v3 = MLAConfig.preset("deepseek-v2-lite"), MLAConfig.preset("deepseek-v3")
    assert (lite.latent_dim, lite.expanded_dim) == (576, 5_120)
    assert (v3.latent_dim, v3.expanded_dim * 2) == (576, 81_920)
