"""Cache bytes, measured from the real cache tensors of every backend under test.

One rule (mla_conformance.checks.cache_bytes, mla_conformance.kv.caches.measure): the suite poisons every
token-storage buffer of a fresh cache, drives tokens through attend(), and counts the bytes that no longer
hold the poison. Bytes per stored token must equal the declared format's; slots beyond the requested
capacity are an allocation policy, reported (allocated_slots, slot_overhead), never a failure.

The V2-Lite cache probe (the seed-000 experiment) measured, at DeepSeek-V2-Lite dims in BF16 after a
25-token prefill and a 1-token decode (batch 1, 32 preallocated slots): absorbed 29,952 B active (latent
26,624 + rope 3,328) and 36,864 allocated; naive 266,240 active (K 159,744 + V 106,496) and 327,680
allocated; ratio 8.888...
"""

import pytest
import torch

from mla_conformance import checks


@pytest.mark.mla_section("v2-lite-cache-probe")
def test_seed_table(mla_backend, mla_device, mla_figures):
    """The V2-Lite cache probe through the contract: the bytes per stored token measured from the cache's
    tensors equal the declared format's formula at V2-Lite dims (checks.format_bytes_per_token; the seed's own
    figures are reproduced by tests/test_cache_bytes_reference.py), and active_nbytes() covers the tokens."""
    checks.v2_lite_cache_probe(mla_backend, device=mla_device, figures=mla_figures)  # raises naming the cause


@pytest.mark.mla_section("cache-bytes")
@pytest.mark.parametrize("preset", ["tiny", "deepseek-v2-lite"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("prefill,decode,batch", [(1, 0, 1), (9, 3, 1), (6, 2, 3)])
def test_bytes_formula(mla_backend, preset, dtype, prefill, decode, batch, mla_device, mla_figures):
    """Measured bytes per stored token == the format's formula; enough slots; allocated == tensors() bytes;
    active == tokens x measured bytes per token."""
    checks.cache_bytes(mla_backend, preset, checks.DTYPES[dtype], prefill=prefill, decode=decode, batch=batch,
                       capacity=16, device=mla_device, figures=mla_figures)


@pytest.mark.mla_section("cache-bytes")
@pytest.mark.slow
@pytest.mark.parametrize("preset", ["deepseek-v3"])
def test_bytes_formula_v3_dims(mla_backend, preset, mla_device, mla_figures):
    """At DeepSeek-V3 dims (128 heads, q_lora 1536) the measured bytes per token equal the formula: 1,152 B/token
    latent, 81,920 expanded (the formula's values: tests/test_cache_bytes_reference.py)."""
    checks.cache_bytes(mla_backend, preset, torch.bfloat16, prefill=4, decode=1, batch=1, capacity=8,
                       device=mla_device, figures=mla_figures)


#: test_bytes_formula_dsa cases: (preset, dtype, kv_codec)
DSA_BYTE_CASES = {"tiny-dsa-bfloat16": ("tiny-dsa", "bfloat16", "none"),
                  "tiny-dsa-float32": ("tiny-dsa", "float32", "none"),
                  "v3.2-mini-bfloat16": ("v3.2-mini", "bfloat16", "none"),
                  "v3.2-mini-fp8-e4m3-flashmla": ("v3.2-mini", "bfloat16", "fp8-e4m3-flashmla")}


@pytest.mark.mla_section("cache-bytes")
@pytest.mark.parametrize("case", list(DSA_BYTE_CASES))
@pytest.mark.parametrize("prefill,decode,batch", [(1, 0, 1), (6, 2, 3)])
def test_bytes_formula_dsa(mla_backend, case, prefill, decode, batch, mla_device, mla_figures):
    """DeepSeek Sparse Attention (presets with index_topk): the same byte rule, the indexer keys counted: a
    "latent+indexer" cache holds kv_lora + rope latent elements plus one indexer key per token in the storage it
    declares (``indexer_format``: the cache dtype by default, "bf16", or DeepSeek's "fp8-e4m3-block128": 128 e4m3
    + one float32 scale per 128 values = 132 B). At V3.2 dims (v3.2-mini) in BF16: 1,408 B with a BF16 key, 1,284
    with the FP8 key; with kv_codec fp8-e4m3-flashmla FlashMLA's 656-byte latent row + the FP8 key, 788 B. The
    formula is checks.format_bytes_per_token's, the measurement checks.cache_bytes's."""
    preset, dtype, kv_codec = DSA_BYTE_CASES[case]
    checks.cache_bytes(mla_backend, preset, checks.DTYPES[dtype], prefill=prefill, decode=decode, batch=batch,
                       capacity=16, device=mla_device, kv_codec=kv_codec, figures=mla_figures)
