"""Checks of the optional paged-cache extension (``supports_paging = True``, ``new_cache(...,
page_block_size=N)``), for suites/test_paged_cache.py (its docstring states the rules): a varlen call schedule
(:data:`CALLS`) driven through the contiguous and the paged cache (:func:`drive`, every unwritten slot NaN),
the two compared bit for bit (or to the dtype's tolerance where the backend declares ``paged_bit_exact =
False``) and each row anchored to the float64 reference; NaN in unused pages never reaching an output; the
paged cache's byte self-reports.
"""

from __future__ import annotations

import functools

import pytest
import torch

from mla_conformance.checks.layer.driver import Scenario, require_support, run_scenario, weights_for
from mla_conformance.checks.metrics import DTYPES, error_metrics, format_metrics
from mla_conformance.checks.tolerances import TOLERANCES
from mla_conformance.contract.layer import supports_paging
from mla_conformance.kv.caches import PagedLatentCache
from mla_conformance.model.config import MLAConfig
from mla_conformance.model.reference import reference_attention_f64
from mla_conformance.model.weights import MLAWeights

#: the page sizes every paged check runs at
PAGE_SIZES = [16, 64]
CAPACITY = 40  # not a multiple of either page size: every row's last page is partial

#: per-row token counts of each attend call: row 1 is empty during prefill, rows sit out decode
#: steps, and a 5-token chunk follows decoding (rows reach 31, 4, 10 and 22 tokens).
CALLS = [(23, 0, 7, 16), (1, 1, 0, 1), (1, 1, 1, 1), (0, 1, 1, 1), (5, 0, 0, 2), (1, 1, 1, 1)]
TOTALS = tuple(sum(c[b] for c in CALLS) for b in range(4))

#: FlashMLA's head dims (kv_lora 512 + rope 64 = 576) and V2-Lite's 16 heads on a narrow layer: pages 576 wide,
#: projections cheap on a CPU (V2-Lite's own dims run in suites/test_flashmla.py)
DIMS_576 = MLAConfig(hidden_size=256, num_attention_heads=16, q_lora_rank=None, kv_lora_rank=512,
                     qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32,
                     rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                   "beta_fast": 32, "beta_slow": 1, "mscale": 0.8, "mscale_all_dim": 0.8},
                     max_position_embeddings=64)


@functools.lru_cache(maxsize=4)
def paged_weights(preset: str, dtype: torch.dtype, device: str = "cpu") -> MLAWeights:
    """Random weights of a preset, or of "dims-576" (:data:`DIMS_576`), cached per dtype and device."""
    if preset == "dims-576":
        return MLAWeights.random(DIMS_576, seed=0, dtype=torch.float64).to(dtype, device=device)
    return weights_for(preset, dtype, device)


def require_paging(backend, page_block_size: int | None = None) -> None:
    """Skip unless the backend opts in to paging (and, when it lists them, to this page size)."""
    if not supports_paging(backend):
        pytest.skip(f"{backend.name} does not implement the optional paged-cache extension (supports_paging)")
    sizes = getattr(backend, "page_block_sizes", None)
    if page_block_size is not None and sizes is not None and page_block_size not in tuple(sizes):
        pytest.skip(f"{backend.name} pages the cache in blocks of {', '.join(map(str, sizes))} tokens, "
                    f"not {page_block_size}")


class Paged:
    """A backend seen through new_cache(..., page_block_size=N) (drive() poisons every fresh cache)."""

    def __init__(self, backend, page_block_size: int):
        self.backend, self.page_block_size = backend, page_block_size
        self.name = backend.name

    def unsupported_reason(self, *args, **kwargs):
        return self.backend.unsupported_reason(*args, **kwargs)

    def new_cache(self, *args, **kwargs):
        return self.backend.new_cache(*args, page_block_size=self.page_block_size, **kwargs)

    def attend(self, *args, **kwargs):
        return self.backend.attend(*args, **kwargs)


def drive(backend, weights, x, calls, *, capacity=CAPACITY, device="cpu", kv_codec="none"):
    """Run attend() per ``calls`` (per-row new-token counts) through
    :func:`mla_conformance.checks.layer.driver.run_scenario` (every unwritten slot NaN, on the contiguous cache too);
    returns (outputs [B, T, hidden] float64 by position, cache)."""
    __tracebackhide__ = True
    scenario = Scenario.of_calls("paged", tuple(tuple(c) for c in calls))
    return run_scenario(backend, weights, x, scenario, capacity=capacity, device=device, kv_codec=kv_codec)


def paged_inputs(config, seed=1):
    """Hidden states [4, max(TOTALS), hidden] float64 for the rows of :data:`CALLS`."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(len(TOTALS), max(TOTALS), config.hidden_size, generator=gen, dtype=torch.float64)


@functools.lru_cache(maxsize=4)
def _oracle(preset: str, dtype: str) -> torch.Tensor:
    """The float64 reference of every row's whole sequence (the calls' split does not change it), on the
    inputs as the backend sees them (rounded to ``dtype``)."""
    w = paged_weights(preset, torch.float64)
    x = paged_inputs(w.config).to(DTYPES[dtype]).to(torch.float64)
    return reference_attention_f64(w, x, torch.tensor(TOTALS))


def valid_mask():
    """[4, max(TOTALS)] bool: the positions each row of :data:`CALLS` stores."""
    return torch.arange(max(TOTALS))[None, :] < torch.tensor(TOTALS)[:, None]


def check_paged_equals_contiguous(backend, preset: str, dtype: str, page_block_size: int, device,
                                  figures: dict) -> None:
    """Shuffled pages, varlen batch with empty rows, decode steps: the same outputs as the contiguous cache."""
    __tracebackhide__ = True
    w = paged_weights(preset, DTYPES[dtype], str(device))
    require_support(backend, w.config, dtype=w.dtype, device=device)
    require_paging(backend, page_block_size)
    x = paged_inputs(w.config)
    contiguous, _ = drive(backend, w, x, CALLS, device=device)
    paged, cache = drive(Paged(backend, page_block_size), w, x, CALLS, device=device)
    valid = valid_mask()
    m = error_metrics(paged[valid], contiguous[valid])
    figures.update(page_block_size=page_block_size, **m)
    assert [int(v) for v in cache.seq_lens.tolist()] == list(TOTALS)
    # anchored, not only self-consistent: a backend that always pages compares two paged runs above
    tol = TOLERANCES[dtype]
    oracle = _oracle(preset, dtype)
    for b in range(len(TOTALS)):
        mb = error_metrics(paged[b, :TOTALS[b]], oracle[b, :TOTALS[b]])
        figures[f"row{b}_vs_float64"] = mb["rel_fro"]
        assert mb["rel_fro"] <= tol.rel_fro and mb["max_rel"] <= tol.max_rel, (
            f"{backend.name} {preset} {dtype} page {page_block_size}: row {b} of the paged run differs from the "
            f"float64 reference: rel_fro {mb['rel_fro']:.3e} (tolerance {tol.rel_fro:g}), max_abs/rms "
            f"{mb['max_rel']:.3e} (tolerance {tol.max_rel:g})")
    if getattr(backend, "paged_bit_exact", True):
        assert torch.equal(paged, contiguous), (
            f"{backend.name} {preset} {dtype} page {page_block_size}: the paged cache changes the outputs "
            f"({format_metrics(m)}); storage in pages should not change the arithmetic")
    else:
        tol = TOLERANCES[dtype]
        assert m["rel_fro"] <= tol.rel_fro and m["max_rel"] <= tol.max_rel, format_metrics(m)


def check_nan_in_unused_pages(backend, device, figures: dict) -> None:
    """Every slot of the paged cache starts as NaN; outputs stay finite and equal the contiguous run."""
    __tracebackhide__ = True
    w = weights_for("tiny", torch.float32, device)
    require_support(backend, w.config, dtype=w.dtype, device=device)
    require_paging(backend, 16)
    x = paged_inputs(w.config, seed=7)
    contiguous, _ = drive(backend, w, x, CALLS, device=device)
    paged, cache = drive(Paged(backend, 16), w, x, CALLS, device=device)  # check_output: finite
    assert bool(torch.isfinite(paged[valid_mask()]).all())
    assert torch.equal(paged, contiguous) or not getattr(backend, "paged_bit_exact", True)
    nan_slots = sum(int(torch.isnan(t).sum()) for t in cache.tensors().values() if t.is_floating_point())
    figures.update(nan_elements_left_in_cache=nan_slots)
    if isinstance(cache, PagedLatentCache):  # the poison is really there: every slot but the stored tokens
        assert nan_slots == (cache.num_pages * cache.page_block_size - sum(TOTALS)) * cache.kv_pages.shape[-1]


def check_paged_cache_bytes(backend, device, figures: dict) -> None:
    """active = stored tokens x 576 x element size; allocated = the bytes of tensors() (pool + block table)."""
    __tracebackhide__ = True
    w = paged_weights("dims-576", torch.bfloat16, str(device))
    require_support(backend, w.config, dtype=w.dtype, device=device)
    require_paging(backend, 64)
    _, cache = drive(Paged(backend, 64), w, paged_inputs(w.config), CALLS, device=device)
    active, allocated = int(cache.active_nbytes()), int(cache.allocated_nbytes())
    tensors = {k: t.numel() * t.element_size() for k, t in cache.tensors().items()}
    figures.update(active_nbytes=active, allocated_nbytes=allocated, tensors=tensors)
    where = f"{backend.name} paged (64) dims-576 bfloat16, {sum(TOTALS)} tokens"
    assert active == sum(TOTALS) * 576 * 2, (f"{where}: active_nbytes() = {active:,} B, but {sum(TOTALS)} tokens x "
                                              f"576 x 2 B = {sum(TOTALS) * 576 * 2:,} B")
    assert allocated == sum(tensors.values()), (f"{where}: allocated_nbytes() = {allocated:,} B but the tensors() "
                                                f"it lists hold {sum(tensors.values()):,} B ({tensors})")
    assert allocated >= active, f"{where}: allocated_nbytes() {allocated:,} B < active {active:,} B"
