"""Layer contract, padded batches as engines run them: rows with ``lengths = 0`` in a running batch (idle
sequences: not started yet, prompt done while another row's prefill goes on, paused mid-decode, never started),
and multi-token steps after the prefill (speculative verify: S = 4 and 3, right padded, 1..S valid per row).
Every call: seq_lens advances by exactly lengths, active_nbytes() covers the stored tokens, a preallocated cache's
token storage changes only by the call's new tokens; every row against the float64 reference; idle rows'
neighbours against the same rows in a batch without idle rows. Tiny preset, float32; see
mla_conformance.checks.layer.padding."""

import pytest

from mla_conformance.checks.layer import padding as layer_padding


@pytest.mark.mla_section("layer_padding")
def test_idle_rows(mla_backend, mla_device, mla_figures):
    """Rows with lengths 0 in prefill and decode calls: their caches do not change, their neighbours' outputs do
    not either (against the same rows without idle rows, and against the float64 reference)."""
    layer_padding.idle_rows(mla_backend, device=mla_device, figures=mla_figures)


@pytest.mark.mla_section("layer_padding")
def test_multi_token_steps(mla_backend, mla_device, mla_figures):
    """After the prefill, steps of 4 and 3 new tokens with right-padded lengths (rows with 1..S valid), as a
    speculative verify step: each row against the float64 reference, each call appending lengths[b] tokens."""
    layer_padding.multi_token_steps(mla_backend, device=mla_device, figures=mla_figures)
