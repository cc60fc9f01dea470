"""Op contract, preallocated outputs (the ``out_buffers`` declaration; FlashInfer's ``run(..., out=, lse=)``, vLLM's
output under a captured CUDA graph): decode writes into caller-owned out [B, s_q, h_q, 512] and lse [B, h_q, s_q]
buffers, contiguous or strided, and returns them; nothing else of their allocations changes (canaries); the values
in the buffers are held against the float64 oracle. An op that does not declare it skips, naming the declaration
(mla_conformance.checks.op.calls)."""

import pytest

from mla_conformance.checks import op as op_checks

#: rows of test_multi_token_decode (a row of 3 keys: causal s_q 4 and 6 leave its first queries without keys),
#: and rows of at least s_q keys for an op that declines queries without keys
LENS = (3, 40, 17)


def _case(op, s_q, device, multi_token=True):
    op_checks.require_declared(op, "out_buffers", "decode into caller-owned out= / lse= buffers")
    return op_checks.make_case_and_lens(op, [LENS, (max(3, s_q), 40, 17)], s_q=s_q, h_q=4, causal=True, device=device,
                                 multi_token=multi_token)


@pytest.mark.mla_section("op-out-buffers")
@pytest.mark.parametrize("s_q", [1, 2, 3, 4, 6])
def test_out_buffers(mla_op, s_q, mla_device, mla_figures):
    """Contiguous out / lse buffers at every s_q, causal (speculative verification's multi-token out: FlashInfer
    #2856 / #2876 rejected it at q_len > 1): the buffers returned, every element written, right."""
    case, lens = _case(mla_op, s_q, mla_device)
    op_checks.check_out_buffers(mla_op, op_checks.Spec(case, lens, seed=2), "contiguous",
                                check=f"out= / lse= buffers s_q={s_q}",
                         figures=mla_figures)


@pytest.mark.mla_section("op-out-buffers")
@pytest.mark.parametrize("layout", ["capacity", "tokens-first", "heads-first"])
def test_out_buffers_strided(mla_op, layout, mla_device, mla_figures):
    """Strided buffers at s_q 3 (op_checks.LAYOUTS): the first B rows of a captured batch's buffers, out with gaps between
    heads and lse tokens-first (FlashInfer), out and lse heads-first (vLLM); the gaps and the rows past B untouched.
    An op that decodes one query per row gets them at s_q 1 (the layouts are the rule, not the query count)."""
    case, lens = _case(mla_op, 3, mla_device, multi_token=False)
    op_checks.check_out_buffers(mla_op, op_checks.Spec(case, lens, seed=2), layout, check=f"out= / lse= buffers, {layout}",
                         figures=mla_figures)
