"""Op contract: FlashMLA's 656-byte FP8 cache (512 e4m3, 4 float32 tile scales, 64 bf16 rope) written in the
op's declared fp8_scale_format, against the float64 oracle of the dequantized cache. Every test runs once per
op (--mla-op) that declares kv_formats "fp8-e4m3-flashmla"; q is bfloat16."""

import pytest

from mla_conformance.checks import op as op_checks
from mla_conformance.contract.op import declared

FP8 = ("fp8-e4m3-flashmla",)
LENS = (37, 100, 5)


@pytest.mark.mla_section("op-fp8")
def test_fp8_vs_dequantized_oracle(mla_op, mla_device, mla_figures):
    """Quantize, then the op against the oracle of what the cache holds (2 causal queries per row)."""
    case = op_checks.make_case(mla_op, lens=LENS, kv_formats=FP8, device=mla_device, s_q=2, h_q=16, causal=True)
    spec = op_checks.Spec(case, LENS, seed=10, scale_format=declared(mla_op, "fp8_scale_format"))
    op_checks.check_against_oracle(mla_op, spec, check="FP8 cache vs dequantized oracle", figures=mla_figures)


@pytest.mark.mla_section("op-fp8")
def test_fp8_scale_probe(mla_op, mla_device, mla_figures):
    """Every tile's max |c| is 336: its scale is 1.0 under pow2 and 0.75 under fp32 (an op reading the scale in
    another format sees other values); every other token has an all-zero tile (scale at the 1e-4 floor)."""
    fmt = declared(mla_op, "fp8_scale_format")
    case = op_checks.make_case(mla_op, lens=LENS, kv_formats=FP8, device=mla_device, s_q=1, h_q=8)
    spec = op_checks.Spec(case, LENS, seed=11, content="probe-336", scale_format=fmt)
    expected = op_checks.check_fp8_probe_scales(op_checks.build(spec), fmt, mla_figures)
    op_checks.check_against_oracle(mla_op, spec, check=f"FP8 scale probe (amax 336: scale {expected} under declared {fmt})",
                            figures=mla_figures)


@pytest.mark.mla_section("op-fp8")
def test_fp8_all_zero_kv(mla_op, mla_device, mla_figures):
    """An all-zero cache gives out exactly 0 (and lse log(number of keys))."""
    case = op_checks.make_case(mla_op, lens=LENS, kv_formats=FP8, device=mla_device, s_q=1, h_q=8)
    spec = op_checks.Spec(case, LENS, seed=12, content="zeros", scale_format=declared(mla_op, "fp8_scale_format"))
    op_checks.check_against_oracle(mla_op, spec, check="FP8 all-zero KV gives all-zero out", figures=mla_figures)


@pytest.mark.mla_section("op-fp8")
@pytest.mark.parametrize("magnitude", [1 / 16, 16.0, 256.0], ids=["x1_16", "x16", "x256"])
def test_fp8_magnitude_sweep(mla_op, magnitude, mla_device, mla_figures):
    """The latent scaled by 1/16 (nearly uniform softmax), 16 and 256 (peaky: logits of standard deviation ~440):
    scales far from 1 in both directions."""
    case = op_checks.make_case(mla_op, lens=LENS, kv_formats=FP8, device=mla_device, s_q=1, h_q=8)
    spec = op_checks.Spec(case, LENS, seed=13, magnitude=magnitude, scale_format=declared(mla_op, "fp8_scale_format"))
    mla_figures["magnitude"] = magnitude
    op_checks.check_against_oracle(mla_op, spec, check=f"FP8 magnitude x{magnitude:g}", figures=mla_figures)
