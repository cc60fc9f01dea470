"""DeepSeek-V4 attention (docs/deepseek-v4.md), for backends that declare it (``deepseek_v4 = True``; others skip,
naming the declaration).

On ``v4-tiny`` (one model holding every layer type: layer 0 window only, 1 CSA, 2 HCA; window 8, CSA every 4
tokens with top-3 of the entries, HCA every 16) so that tens of tokens cross the window, several compressed
entries and the indexer's choice on CPU:

* the output against the float64 V4 oracle (``mla_conformance.model.v4_reference``, written from DeepSeek's V4
  inference code) per layer type and dtype: one prefill, prefill + decode (entries closing during decode),
  chunked prefill whose chunk boundaries fall inside compression windows, varlen batches (right padding) and
  rows that start late and idle between calls, a long row past the window and several entries of each kind.
  Row by row within the dtype's row tolerance (checks.tolerances.row_tolerance); queries whose indexer top-k is
  a near tie at the dtype's precision are not compared (counted: tied_queries_not_compared). A failure names
  the likely cause when one known bug's oracle matches (checks.layer.v4.LIKELY_CAUSES);
* prefill + single-token decode steps equal one prefill of the same tokens;
* the cache bytes per component at V4's widths (``v4-mini``: head_dim 512, window 128, ratios 4 / 128):
  the window a ring of 128 rows (constant in the context), one entry per 4 (CSA) or 128 (HCA) tokens, the CSA
  indexer's keys, measured from the cache's tensors (``v4_layout`` names each tensor's component).
"""

import pytest

from mla_conformance import checks
from mla_conformance.checks.layer import v4

LAYERS = ["swa", "csa", "hca"]


@pytest.mark.mla_section("deepseek-v4")
@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("scenario", list(v4.V4_SCENARIOS))
def test_v4_float32(mla_backend, layer, scenario, mla_device, mla_figures):
    """Output against the float64 V4 oracle in float32, every scenario and layer type."""
    v4.judge(mla_backend, layer, scenario, checks.DTYPES["float32"], mla_device, mla_figures)


@pytest.mark.mla_section("deepseek-v4")
@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_v4_low_precision(mla_backend, layer, dtype, mla_device, mla_figures):
    """Output against the float64 V4 oracle in bfloat16 / float16 on the varlen batch (with decode steps)."""
    v4.judge(mla_backend, layer, "varlen_batch", checks.DTYPES[dtype], mla_device, mla_figures)


@pytest.mark.mla_section("deepseek-v4")
@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_v4_decode_equals_prefill(mla_backend, layer, dtype, mla_device, mla_figures):
    """Prefill 21 + 12 single-token steps == one 33-token prefill (entries close during the steps)."""
    v4.decode_equals_prefill(mla_backend, layer, checks.DTYPES[dtype], mla_device, figures=mla_figures)


@pytest.mark.mla_section("deepseek-v4")
@pytest.mark.parametrize("layer_type", ["sliding_attention", "compressed_sparse_attention",
                                        "heavily_compressed_attention"])
def test_v4_cache_bytes(mla_backend, layer_type, mla_device, mla_figures):
    """At V4's widths in BF16, 140 tokens (past the 128-token window and one HCA entry): window 128 x 512 x 2 B,
    140 // 4 CSA entries (+ as many 128-wide indexer keys) or 140 // 128 HCA entries of 512 x 2 B."""
    v4.check_cache_bytes(mla_backend, layer_type, checks.DTYPES["bfloat16"], mla_device, tokens=140,
                         figures=mla_figures)


@pytest.mark.mla_section("deepseek-v4")
@pytest.mark.parametrize("layer_type", ["sliding_attention", "compressed_sparse_attention",
                                        "heavily_compressed_attention"])
def test_v4_cache_bytes_model1_fp8(mla_backend, layer_type, mla_device, mla_figures):
    """kv_codec fp8-e4m3-model1 (FlashMLA's MODEL1 row: 448 e4m3 + 7 UE8M0 scales + 64 bf16 rope + 1 pad = 584
    B): window 128 x 584 B, entries 584 B each; the indexer keys stay in the cache dtype (DeepSeek's V4 code)."""
    v4.check_cache_bytes(mla_backend, layer_type, checks.DTYPES["bfloat16"], mla_device, tokens=140,
                         kv_codec="fp8-e4m3-model1", figures=mla_figures)


@pytest.mark.mla_section("deepseek-v4")
@pytest.mark.parametrize("layer_type", ["sliding_attention", "compressed_sparse_attention",
                                        "heavily_compressed_attention"])
def test_v4_model1_fp8(mla_backend, layer_type, mla_device, mla_figures):
    """Under the MODEL1 FP8 cache at V4's widths (v4-mini, bfloat16, 150 tokens + 3 decode steps): the output
    against the float64 oracle over MODEL1-rounded window rows and entries, to the bfloat16 row tolerance."""
    v4.judge_fp8(mla_backend, layer_type, checks.DTYPES["bfloat16"], mla_device, mla_figures)
