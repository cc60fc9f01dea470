"""Layer contract, generated cases (hypothesis): batch, ragged prefill lengths, chunk sizes (rows with no new
tokens in a call), decode steps, the configs the backend accepts (tiny, GLM-style dims: v_head_dim above
qk_nope_head_dim and an odd head count; the DSA configs within index_topk) and a row past 2048 tokens. Each
row against the float64 expanded reference within TOLERANCES, as suites/test_numerics.py; a failure is shrunk
and prints the command replaying it (``--mla-case``). Strata: mla_conformance.checks.strategies."""

import pytest

from mla_conformance.checks import generated


@pytest.mark.mla_section("layer_generated")
@pytest.mark.mla_generated("layer")
def test_generated_layer(mla_backend, mla_device, mla_figures, mla_generation):
    """One row (chunked or not), ragged rows with chunked prefill, a row past 2048 tokens; then decode steps."""
    generated.check_layer_property(mla_backend, "layer", device=mla_device, figures=mla_figures,
                                   generation=mla_generation)
