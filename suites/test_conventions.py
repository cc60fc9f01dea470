"""Conventions the published DeepSeek code bases disagree on: stated and recorded, not imposed.

YaRN's cos/sin factor. With ``mscale != mscale_all_dim`` in a config's rope_scaling, transformers and
DeepSeek's V2 modeling code multiply cos/sin by mscale(factor, mscale) / mscale(factor, mscale_all_dim);
DeepSeek-V3's reference ``inference/model.py`` has a single mscale and no such factor. Every published
DeepSeek config has the two equal (factor 1), and so has every numerics preset of this suite, so only
this test sees the difference: it passes when the backend matches either float64 oracle
(``mla_conformance.schema.ROPE_CONVENTIONS``) and records which one in its figures.
"""

import pytest

from mla_conformance.checks.layer import conventions


@pytest.mark.mla_section("conventions")
def test_yarn_rope_attention_factor_convention(mla_backend, mla_device, mla_figures):
    conventions.check_yarn_rope_attention_factor_convention(mla_backend, mla_device, mla_figures)
