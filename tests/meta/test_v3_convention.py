"""A correct backend written like DeepSeek-V3's reference inference/model.py (no YaRN cos/sin factor,
over-allocated max_seq_len cache) passes every numerics preset, and the convention test says which
RoPE convention it follows."""

import importlib.util
from pathlib import Path

import pytest
import torch

from mla_conformance import checks

from .v3_reference_backend import DeepSeekV3StyleMLA

pytestmark = pytest.mark.meta
SUITES = Path(__file__).resolve().parents[2] / "suites"


def _load(name: str):
    """A suite module by file, under a private name (so its tests are not collected a second time here)."""
    spec = importlib.util.spec_from_file_location(f"_mla_meta_{name}", SUITES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_numerics = _load("test_numerics")
_conventions = _load("test_conventions")


def test_v3_style_backend_follows_the_deepseek_v3_convention():
    figures: dict = {}
    _conventions.test_yarn_rope_attention_factor_convention(DeepSeekV3StyleMLA(), "cpu", figures)
    assert figures["rope_convention"] == "deepseek-v3", figures
    assert figures["rel_fro_transformers"] > 1e-3, figures  # it really differs from the transformers convention


@pytest.mark.parametrize("preset", _numerics.PRESETS)
@pytest.mark.parametrize("scenario", list(checks.SCENARIOS))
def test_v3_style_backend_passes_numerics(preset, scenario):
    checks.numerics(DeepSeekV3StyleMLA(), preset, scenario, torch.float32)
