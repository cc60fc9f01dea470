"""Every backend against a float64 expanded reference of the same weights and inputs.

Presets: ``tiny`` (q_lora, YaRN from 64 positions, so long_context crosses original_max_position_embeddings),
``deepseek-v2-lite`` (plain q_proj, YaRN) and ``v3-mini`` (V3 head dims, q_lora, 2 heads, YaRN from 128
positions, so a backend that refuses ``tiny``'s small dims still gets q_lora and past-original coverage).
Tolerances: mla_conformance.checks.TOLERANCES (markers.md).
"""

import pytest

from mla_conformance import checks

PRESETS = checks.NUMERICS_PRESETS


@pytest.mark.mla_section("numerics")
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("scenario", list(checks.SCENARIOS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_against_float64(mla_backend, preset, scenario, dtype, mla_device, mla_figures):
    checks.numerics(mla_backend, preset, scenario, checks.DTYPES[dtype], device=mla_device, figures=mla_figures)


@pytest.mark.mla_section("numerics-float16")
@pytest.mark.parametrize("preset", PRESETS)
def test_float16(mla_backend, preset, mla_device, mla_figures):
    checks.numerics(mla_backend, preset, "varlen_batch", checks.DTYPES["float16"], device=mla_device, figures=mla_figures)


@pytest.mark.mla_section("incremental")
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_incremental_equals_prefill(mla_backend, preset, dtype, mla_device, mla_figures):
    checks.incremental_equals_prefill(mla_backend, preset, checks.DTYPES[dtype], device=mla_device, figures=mla_figures)
