"""The bound terms generated cases needed (mla_conformance.checks.tolerances: ``underflow``, ``op_acc_roundings``,
``row_tolerance``), each accepting the correct computation it was derived for and rejecting a wrong one by a wide
margin. Cheap (about 1 s): the float16 case is the shrunk one the generated pages property found (h = 3), the
row rule is checked on simulated errors of its own model."""

import math

import pytest
import torch

from mla_conformance.checks import generated
from mla_conformance.checks import op as op_checks
from mla_conformance.checks.strategies import parse_case
from mla_conformance.checks.tolerances import (OP_ACC_ROUNDINGS, OP_TOLERANCES, TOLERANCES, op_acc_roundings,
                                               row_tolerance, underflow)

from .impls.kernel_style.kernel_ops import PRoundingFp16Op

#: the default profile's case where a correct float16 kernel's out lies in float16's subnormal range (attn_sink
#: scales it below 2^-14): 2.7 x the bound before the underflow term
SUBNORMAL_CASE = "pages B=2 lens=0,1 s_q=1 h=3 page=64 float16 latent sink seed=0"


class FlushesFp16Subnormals(PRoundingFp16Op):
    """Broken: flushes float16 subnormal outputs to zero (an error up to 2^-14 = 6.1e-5, not half a step)."""

    name = "broken-fp16-out-flushed"

    def decode(self, *args, **kwargs):
        out, lse = super().decode(*args, **kwargs)
        tiny = torch.finfo(torch.float16).smallest_normal
        return torch.where(out.abs() < tiny, torch.zeros_like(out), out), lse


def _spec(op):
    return generated.op_spec(op, parse_case(SUBNORMAL_CASE), "cpu")


def test_float16_subnormal_out_is_bounded_by_half_its_step():
    """The correct P-rounding float16 kernel passes the case (its out errs by up to 2^-25 there); one that flushes
    those outs to zero fails it by far more than the bound."""
    assert underflow(torch.float16) == 2.0 ** -25 and underflow(torch.bfloat16) == 2.0 ** -126
    good: dict = {}
    op_checks.check_against_oracle(PRoundingFp16Op(), _spec(PRoundingFp16Op()), check="subnormal out", figures=good)
    assert 0.05 < good["out_error_over_bound"] <= 1.0, good["out_error_over_bound"]
    bad: dict = {}
    with pytest.raises(AssertionError, match="out differs from the float64 oracle"):
        op_checks.check_against_oracle(FlushesFp16Subnormals(), _spec(FlushesFp16Subnormals()), check="subnormal out",
                                figures=bad)
    assert bad["out_error_over_bound"] > 20, bad["out_error_over_bound"]


def test_accumulation_term_grows_with_the_keys():
    """256 roundings up to 1024 keys (the hand-written tests' bound unchanged), then 4 per further 16 keys."""
    assert op_acc_roundings(1) == op_acc_roundings(1024) == OP_ACC_ROUNDINGS
    assert op_acc_roundings(1025) == OP_ACC_ROUNDINGS + 4 and op_acc_roundings(2600) == 652
    counts = torch.tensor([[[1.0, 1024.0, 32769.0]]])
    tol = OP_TOLERANCES["float32"]
    assert torch.equal(tol.acc_at(counts) / tol.acc, op_acc_roundings(counts) / OP_ACC_ROUNDINGS)
    assert float(tol.acc_at(counts)[0, 0, 2]) == tol.acc * 8196 / 256


@pytest.mark.parametrize("elements", [3072, 37_632])
def test_row_max_rel_is_the_largest_of_n_relative_errors(elements):
    """row_tolerance's max_rel = rel_fro x ln N: an output whose every element errs by a relative error
    (value x Gaussian, rms at the rel_fro bound) exceeds it about one time in four (simulated with 200 draws: 20 to 25 %), at half of rel_fro never;
    a single token wrong by 0.5 rms still fails it at 10^7 values."""
    tol = row_tolerance("bfloat16", elements=elements, keys=64)
    g = torch.Generator().manual_seed(0)
    over, over_half = 0, 0
    draws = 16
    for _ in range(draws):
        ref = torch.randn(elements, generator=g, dtype=torch.float64)
        err = ref * torch.randn(elements, generator=g, dtype=torch.float64)
        err = err * tol.rel_fro * float(ref.pow(2).mean().sqrt() / err.pow(2).mean().sqrt())   # rel_fro at the bound
        max_rel = float(err.abs().max() / ref.pow(2).mean().sqrt())
        over += max_rel > tol.max_rel
        over_half += max_rel / 2 > tol.max_rel
    assert 1 <= over <= draws // 2 and over_half == 0, (over, over_half)  # measured: 5 and 6 of 16
    assert row_tolerance("bfloat16", elements=10 ** 7, keys=64).max_rel < 0.5
    assert tol.max_rel == pytest.approx(TOLERANCES["bfloat16"].rel_fro * math.log(elements))


def test_row_rel_fro_grows_past_2048_positions():
    """The table's rel_fro up to 2048 positions; past that its float32 budget (1e-5) again per 2048 positions."""
    f32 = TOLERANCES["float32"].rel_fro
    assert row_tolerance("float32", elements=10, keys=2048).rel_fro == f32
    assert row_tolerance("float32", elements=10, keys=4096).rel_fro == pytest.approx(2 * f32)
    assert row_tolerance("bfloat16", elements=10, keys=4096).rel_fro == pytest.approx(TOLERANCES["bfloat16"].rel_fro
                                                                                         + f32)
