"""Seed 000's experiment on a checkpoint: the real layer-1 attention input and weights, 25-token prefill
plus 1-token decode through each backend, byte and error tables (BF16 and the FP32 audit).

CI proves the path on the embedded tiny model (same tensor names as DeepSeek-V2-Lite); a real
checkpoint runs with ``--mla-checkpoint DIR``.
"""

import pytest

from mla_conformance.checks.layer import checkpoint


@pytest.fixture(params=checkpoint.PROBE_SOURCES)
def probe(request):
    return checkpoint.probe_source(request)


@pytest.mark.mla_section("checkpoint")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_prefill_decode_on_checkpoint(mla_backend, probe, dtype, mla_device, mla_figures):
    checkpoint.check_prefill_decode_on_checkpoint(mla_backend, probe, dtype, mla_device, mla_figures)
