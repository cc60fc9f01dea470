"""Op contract, speculative verification: causal multi-token decode at q_lens that are not powers of two, rows
shorter than q_len (their first queries have no key) and of exactly q_len, over ``block_table`` / ``cache_seqlens``
handed as the first B rows of an engine's larger persistent tables (their later rows name NaN pages), held against
the bottom-right oracle; a failure names the likely cause: every position given one output (ROCm aiter #2720), rows
past B read (vLLM #51848 / #51065), top-left alignment. q_len 1, 2, 4 and 8 are test_op_paging.py's
test_multi_token_decode (mla_conformance.checks.op.calls)."""

import pytest

from mla_conformance.checks import op as op_checks


@pytest.mark.mla_section("op-speculative")
@pytest.mark.parametrize("q_len", [3, 5, 6, 7])
def test_speculative_verify(mla_op, q_len, mla_device, mla_figures):
    """Rows of q_len - 2, q_len, 40 + q_len and 17 keys (an op that declines queries without keys: q_len, q_len + 1,
    40 + q_len, 17), q_len causal queries each: each position attends its own keys."""
    case, lens = op_checks.make_case_and_lens(mla_op,
                                              [(q_len - 2, q_len, 40 + q_len, 17), (q_len, q_len + 1, 40 + q_len, 17)],
                                       s_q=q_len, h_q=4, causal=True, device=mla_device,
                                       multi_token=True)
    op_checks.check_speculative(mla_op, op_checks.Spec(case, lens, seed=11, spare_pages=3),
                         check=f"speculative verification q_len={q_len} (causal, bottom-right)", figures=mla_figures)
