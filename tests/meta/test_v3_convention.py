"""A correct backend written like DeepSeek-V3's reference inference/model.py (no YaRN cos/sin factor,
over-allocated max_seq_len cache) passes every numerics preset, and the convention test says which
RoPE convention it follows."""

import pytest
import torch

from mla_conformance import checks
from mla_conformance.checks.layer import conventions

from .impls.independent.v3_reference_backend import DeepSeekV3StyleMLA

pytestmark = pytest.mark.meta


def test_v3_style_backend_follows_the_deepseek_v3_convention():
    figures: dict = {}
    conventions.check_yarn_rope_attention_factor_convention(DeepSeekV3StyleMLA(), "cpu", figures)
    assert figures["rope_convention"] == "deepseek-v3", figures
    assert figures["rel_fro_transformers"] > 1e-3, figures  # it really differs from the transformers convention


@pytest.mark.parametrize("preset", checks.NUMERICS_PRESETS)
@pytest.mark.parametrize("scenario", list(checks.SCENARIOS))
def test_v3_style_backend_passes_numerics(preset, scenario):
    checks.numerics(DeepSeekV3StyleMLA(), preset, scenario, torch.float32)
