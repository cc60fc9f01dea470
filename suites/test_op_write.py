"""Op contract, optional ``write`` (the cache writer): every byte of a canary-filled cache checked after the call
-- each written token holds exactly what the oracle encodes (bit for bit for the latent format; FP8 payload,
tile scales and bfloat16 k_pe as FlashMLA's tests/quant.py writes them under the declared
write_fp8_scale_format: bit for bit under pow2, by what a reader decodes under fp32), every other byte is
untouched, padding tokens (slot -1, or the dummy slot 0 where declared) write nothing else, k_pe is never scaled --
and the
round trip: decode over what write wrote equals the oracle over the encoded values. Every test runs once per op
(--mla-op) that has ``write``; see mla_conformance.checks.op.write."""

import pytest

from mla_conformance.checks.op import write as write_checks
from mla_conformance.checks.op.methods import first_supported, require_method

FP8 = write_checks.FP8_656
MODEL1 = "fp8-e4m3-model1"
PAGES = (16, 64, 1)


def spec_for(op, device, **kw):
    """The first page size (16, 64, 1) the op accepts for this spec (an op without write skips naming it); its
    padding tokens marked by the op's declared write_padding_slot."""
    require_method(op, "write")
    kw.setdefault("padding_slot", write_checks.padding_slot(op))
    specs = [write_checks.WriteSpec(page=p, scale_format=write_checks.scale_format(op), device=device, **kw) for p in PAGES]
    case = first_supported(op, [write_checks.build(s).case for s in specs])
    return specs[[write_checks.build(s).case for s in specs].index(case)]


@pytest.mark.mla_section("op_write")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_write_latent(mla_op, dtype, mla_device, mla_figures):
    """The latent format: [kv_c | k_pe] bit for bit into part of a page, a whole page and a page's first slots;
    nothing else of the cache changes."""
    spec = spec_for(mla_op, mla_device, dtype=dtype, seed=1)
    write_checks.check_write(mla_op, spec, check=f"write of {dtype} latent rows", figures=mla_figures)


@pytest.mark.mla_section("op_write")
def test_write_padding_slots(mla_op, mla_device, mla_figures):
    """Eight slot_mapping entries of -1 (padding tokens, first, middle, last and between) write nothing: not slot
    0, not the last slot (an op declaring write_padding_slot = "dummy-slot-0" is never handed a negative slot)."""
    require_method(mla_op, "write")
    write_checks.require_negative_slots(mla_op)
    spec = spec_for(mla_op, mla_device, padding_slots=8, seed=2)
    write_checks.check_write(mla_op, spec, check="write with -1 (padding) slots", figures=mla_figures)


@pytest.mark.mla_section("op_write")
def test_write_padded_batch(mla_op, mla_device, mla_figures):
    """A batch padded up to a captured size: 2 padding tokens between the real ones and 8 trailing, each with slot
    -1 (write_padding_slot "negative", vLLM's: they write nothing) or slot 0 ("dummy-slot-0", SGLang's: nothing
    but slot 0 and the real tokens' slots changes)."""
    spec = spec_for(mla_op, mla_device, padding_slots=10, padding_layout="batch", seed=8)
    write_checks.check_write(mla_op, spec, check=f"write of a padded batch ({spec.padding_slot} padding slots)",
                   figures=mla_figures)


@pytest.mark.mla_section("op_write")
def test_write_fp8_flashmla(mla_op, mla_device, mla_figures):
    """FlashMLA's 656-byte layout: e4m3 payload, float32 tile scales (the declared convention: pow2 bit for bit,
    the 1e-4 floor on an all-zero tile; fp32 by what a reader decodes, an all-zero tile 0, never NaN), bfloat16
    k_pe; per-token magnitudes 2^-4..2^4."""
    spec = spec_for(mla_op, mla_device, kv_format=FP8, seed=3)
    write_checks.check_write(mla_op, spec, check="write of FP8 656-byte rows", figures=mla_figures)


@pytest.mark.mla_section("op_write")
def test_write_fp8_scale_probe(mla_op, mla_device, mla_figures):
    """Every tile's amax is 336: its scale is 1.0 under pow2 and 0.75 under fp32, so a writer of the other
    convention than it declares stores other bytes."""
    spec = spec_for(mla_op, mla_device, kv_format=FP8, content="probe-336", seed=4)
    write_checks.check_write(mla_op, spec, check="write of FP8 rows, scale probe (amax 336)", figures=mla_figures)


@pytest.mark.mla_section("op_write")
def test_write_kpe_unscaled(mla_op, mla_device, mla_figures):
    """A small latent (tile scales near 2^-10) and k_pe of +-100..400: k_pe is stored as bfloat16, never
    multiplied or divided by the latent's scale (vLLM PR #42956)."""
    spec = spec_for(mla_op, mla_device, kv_format=FP8, content="kpe-large", seed=5)
    write_checks.check_write(mla_op, spec, check="write of FP8 rows, k_pe unscaled", figures=mla_figures)


@pytest.mark.mla_section("op_write")
def test_write_model1(mla_op, mla_device, mla_figures):
    """FlashMLA's MODEL1 layout (584 B/token: 448 e4m3 in 7 tiles of 64 with UE8M0 scales, 64 bf16 rope; per
    block the 576-byte parts, then the 8-byte scale groups, padded to 576): kv_c [T, 448], k_pe [T, 64]."""
    spec = spec_for(mla_op, mla_device, kv_format=MODEL1, seed=6)
    write_checks.check_write(mla_op, spec, check="write of MODEL1 584-byte tokens", figures=mla_figures)


@pytest.mark.mla_section("op_write")
@pytest.mark.parametrize("kv_format", ["latent", FP8, MODEL1])
def test_write_then_decode(mla_op, kv_format, mla_device, mla_figures):
    """Rows of 37 and 20 tokens written, then decoded (where the op has decode and reads the format; MODEL1 by
    sparse decode over 32 of the written slots, 8 of them -1): out and lse equal the float64 oracle over the
    encoded cache, within the decode bounds."""
    spec = spec_for(mla_op, mla_device, kv_format=kv_format, layout="rows", seed=7)
    write_checks.check_round_trip(mla_op, spec, h_q=8, check=f"decode over a {kv_format} cache the op wrote",
                        figures=mla_figures)
