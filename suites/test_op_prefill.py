"""Op contract, optional ``prefill`` (varlen attention in "MHA mode": the latent up-projected to per-head K / V):
out and lse against the float64 oracle over varlen rows -- rows without keys, q_len > kv_len and q shorter than
k under bottom-right causal alignment, zero-length padding sequences (trailing, interleaved), h_k = h_q and h_k = 1, non-power-of-two heads, strided q / k / v, other
head dims where declared. Every test runs once per op (--mla-op) that has ``prefill``; see
mla_conformance.checks.op.prefill."""

import pytest

from mla_conformance.checks.op import prefill as prefill_checks

#: (q_len, kv_len): a self-attention row, a row with no keys, q_len > kv_len (its first causal queries see no
#: key), a one-query row, and a chunk of new tokens over a longer context
VARLEN = ((5, 5), (3, 0), (6, 4), (1, 37), (4, 20))


@pytest.mark.mla_section("op_prefill")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_prefill_varlen(mla_op, dtype, mla_device, mla_figures):
    """Causal varlen rows, kv_len = 0 and q_len > kv_len among them: queries with no key give out exactly 0 and
    the declared prefill_empty_row lse."""
    spec = prefill_checks.PrefillSpec(VARLEN, h_q=8, h_k=1, dtype=dtype, causal=True, seed=1, device=mla_device)
    prefill_checks.check_against_oracle(mla_op, spec, check="varlen causal prefill vs float64 oracle", figures=mla_figures)


@pytest.mark.mla_section("op_prefill")
def test_prefill_non_causal(mla_op, mla_device, mla_figures):
    """Non-causal: every query of a row sees all its keys (a context chunk of chunked prefill); a row with no
    keys."""
    spec = prefill_checks.PrefillSpec(VARLEN, h_q=8, h_k=1, causal=False, seed=2, device=mla_device)
    prefill_checks.check_against_oracle(mla_op, spec, check="non-causal prefill vs float64 oracle", figures=mla_figures)


@pytest.mark.mla_section("op_prefill")
def test_prefill_context_and_new_tokens(mla_op, mla_device, mla_figures):
    """q shorter than k (new tokens after cached context), causal: query i of m sees keys j <= n - m + i
    (bottom-right), not 0..i."""
    spec = prefill_checks.PrefillSpec(((4, 40), (7, 23), (1, 9)), h_q=8, h_k=1, causal=True, seed=3, device=mla_device)
    prefill_checks.check_against_oracle(mla_op, spec, check="causal prefill over context + new tokens (bottom-right)",
                            figures=mla_figures)


@pytest.mark.mla_section("op_prefill")
@pytest.mark.parametrize("h_q,h_k", [(16, 16), (16, 1), (6, 2)], ids=["hq16-hk16", "hq16-hk1", "hq6-hk2"])
def test_prefill_heads(mla_op, h_q, h_k, mla_device, mla_figures):
    """h_k = h_q (MHA), h_k = 1 (MQA) and a non-power-of-two grouped case: query head h reads kv head
    h // (h_q / h_k)."""
    spec = prefill_checks.PrefillSpec(((5, 5), (3, 12)), h_q=h_q, h_k=h_k, causal=True, seed=4, device=mla_device)
    prefill_checks.check_against_oracle(mla_op, spec, check=f"prefill h_q={h_q} h_k={h_k}", figures=mla_figures)


@pytest.mark.mla_section("op_prefill")
def test_prefill_strided(mla_op, mla_device, mla_figures):
    """q padded by 64 channels, v a slice of a buffer padded to d_qk, k stored heads-first: NaN in every padding,
    so an op that ignores a stride reads it."""
    spec = prefill_checks.PrefillSpec(((5, 5), (2, 17), (3, 0)), h_q=4, h_k=2, causal=True, seed=5, strided=True,
                          device=mla_device)
    prefill_checks.check_against_oracle(mla_op, spec, check="prefill on strided q / k / v", figures=mla_figures)


@pytest.mark.mla_section("op_prefill")
@pytest.mark.parametrize("d_qk,d_v", [(256, 256), (576, 512)], ids=["d256-256", "d576-512"])
def test_prefill_head_dims(mla_op, d_qk, d_v, mla_device, mla_figures):
    """Head dims other than DeepSeek-V3's 192 / 128, where the op declares them in prefill_head_dims: 256 / 256
    (models whose v is as wide as q / k) and 576 / 512 (prefill over the absorbed latent)."""
    spec = prefill_checks.PrefillSpec(((4, 4), (2, 9)), h_q=4, h_k=1, d_qk=d_qk, d_v=d_v, causal=True, seed=6, device=mla_device)
    prefill_checks.check_against_oracle(mla_op, spec, check=f"prefill head dims {d_qk} / {d_v}", figures=mla_figures)


#: the rows of test_prefill_varlen's kinds with zero-length padding sequences (0 queries, 0 keys: cu_seqlens_q and
#: cu_seqlens_k repeating a value, as engines pad a batch to a captured size) at the end, or between the rows too
PADDED = {"trailing": ((5, 5), (3, 12), (6, 4), (0, 0), (0, 0), (0, 0)),
          "interleaved": ((5, 5), (0, 0), (3, 12), (0, 0), (6, 4), (0, 0))}


@pytest.mark.mla_section("op_prefill")
@pytest.mark.parametrize("padding", list(PADDED))
def test_prefill_padding_sequences(mla_op, padding, mla_device, mla_figures):
    """Zero-length padding sequences at the end of cu_seqlens (and between the real ones): the real sequences' out
    and lse as the float64 oracle has them, nothing written for a padding sequence."""
    spec = prefill_checks.PrefillSpec(PADDED[padding], h_q=4, h_k=1, dtype="float32", causal=True, seed=7, device=mla_device)
    prefill_checks.check_against_oracle(mla_op, spec, check=f"causal prefill with {padding} zero-length padding sequences",
                            figures=mla_figures)
