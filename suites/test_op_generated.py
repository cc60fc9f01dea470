"""Op contract, generated cases (hypothesis): the shapes kernels break on, drawn from what the op declares --
head counts in a tail tile of 64 and odd counts above 8, every declared page size (any positive size) with rows
at page boundaries +-1, causal multi-token decode with s_q not a power of two and rows shorter than s_q, rows
past 2048 keys, batches past 32 rows, sparse top-k with tails, invalid indices, topk_length, attn_sink,
non-contiguous q. Each case is checked against the float64 oracle with the hand-written op tests' bounds; a
failure is shrunk to a minimal case and prints the command replaying it (``--mla-case``). Strata and values:
mla_conformance.checks.strategies; profiles (``--mla-thorough``): mla_conformance.pytest_plugin.generated."""

import pytest

from mla_conformance.checks import generated


def _check(op, prop, device, figures, generation):
    generated.check_op_property(op, prop, device=device, figures=figures, generation=generation)


@pytest.mark.mla_section("op_generated")
@pytest.mark.mla_generated("heads")
def test_generated_heads(mla_op, mla_device, mla_figures, mla_generation):
    """h_q 1..8, odd above 8, a tail tile (h_q > 64, h_q % 64 != 0: 126 first), whole tiles of 64."""
    _check(mla_op, "heads", mla_device, mla_figures, mla_generation)


@pytest.mark.mla_section("op_generated")
@pytest.mark.mla_generated("pages")
def test_generated_pages(mla_op, mla_device, mla_figures, mla_generation):
    """Every declared page size, rows at page boundaries +-1 (P + 1 first) and anywhere up to 3 pages + 1."""
    _check(mla_op, "pages", mla_device, mla_figures, mla_generation)


@pytest.mark.mla_section("op_generated")
@pytest.mark.mla_generated("mtp")
def test_generated_mtp(mla_op, mla_device, mla_figures, mla_generation):
    """Multi-token decode: causal with s_q not a power of two (3 first), causal powers of two up to 32,
    non-causal s_q 1..9, 16, 32; rows shorter than s_q where the op takes queries without keys."""
    _check(mla_op, "mtp", mla_device, mla_figures, mla_generation)


@pytest.mark.mla_section("op_generated")
@pytest.mark.mla_generated("long_rows")
def test_generated_long_rows(mla_op, mla_device, mla_figures, mla_generation):
    """A row past 2048 keys (2049 first; 32 pages of 64), one or two heads."""
    _check(mla_op, "long_rows", mla_device, mla_figures, mla_generation)


@pytest.mark.mla_section("op_generated")
@pytest.mark.mla_generated("batch")
def test_generated_batch(mla_op, mla_device, mla_figures, mla_generation):
    """2..32 rows, 33..64 rows (past a grid of 32), one large batch; short rows."""
    _check(mla_op, "batch", mla_device, mla_figures, mla_generation)


@pytest.mark.mla_section("op_generated")
@pytest.mark.mla_generated("sparse")
def test_generated_sparse(mla_op, mla_device, mla_figures, mla_generation):
    """Sparse decode (where declared): top-k 1..64, multiples of 64, tails past a multiple of 64 (65 first),
    invalid indices of the declared kinds, rows with every index invalid, topk_length, attn_sink."""
    _check(mla_op, "sparse", mla_device, mla_figures, mla_generation)


@pytest.mark.mla_section("op_generated")
@pytest.mark.mla_generated("mixed")
def test_generated_mixed(mla_op, mla_device, mla_figures, mla_generation):
    """Every dimension at once, small: batch, lengths with 0 and 1, s_q, causal, heads, page, dtype, format,
    attn_sink, non-contiguous q."""
    _check(mla_op, "mixed", mla_device, mla_figures, mla_generation)
