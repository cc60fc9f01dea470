"""Cache bytes, measured from the real cache tensors of every backend under test.

One rule (mla_conformance.checks.cache_bytes, mla_conformance.cache.measure): the suite poisons every
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

from mla_conformance import MLAConfig, checks


@pytest.mark.mla_section("v2-lite-cache-probe")
def test_seed_table(mla_backend, mla_device, mla_figures):
    """The V2-Lite cache probe through the contract: bytes per stored token follow the declared format."""
    got = checks.v2_lite_cache_probe(mla_backend, device=mla_device, figures=mla_figures)
    per_token = 576 * 2 if got["cache_format"] == "latent" else 5120 * 2
    assert got["bytes_per_token"] == per_token
    assert got["tokens"] * per_token <= got["active_nbytes"]


@pytest.mark.mla_section("cache-bytes")
@pytest.mark.parametrize("preset", ["tiny", "deepseek-v2-lite"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("prefill,decode,batch", [(1, 0, 1), (9, 3, 1), (6, 2, 3)])
def test_bytes_formula(mla_backend, preset, dtype, prefill, decode, batch, mla_device, mla_figures):
    """Bytes per stored token == the format's; enough slots; allocated == tensors() bytes; active == tokens x
    measured bytes per token."""
    checks.cache_bytes(mla_backend, preset, checks.DTYPES[dtype], prefill=prefill, decode=decode, batch=batch,
                       capacity=16, device=mla_device, figures=mla_figures)


@pytest.mark.mla_section("cache-bytes")
@pytest.mark.slow
@pytest.mark.parametrize("preset", ["deepseek-v3"])
def test_bytes_formula_v3_dims(mla_backend, preset, mla_device, mla_figures):
    """At DeepSeek-V3 dims (128 heads, q_lora 1536): 1,152 B/token latent, 81,920 expanded."""
    got = checks.cache_bytes(mla_backend, preset, torch.bfloat16, prefill=4, decode=1, batch=1, capacity=8,
                             device=mla_device, figures=mla_figures)
    assert got["per_token_bytes"] == (1_152 if got["cache_format"] == "latent" else 81_920)


@pytest.mark.mla_section("cache-bytes")
@pytest.mark.parametrize("case", ["tiny-dsa-bfloat16", "tiny-dsa-float32", "v3.2-mini-fp8-e4m3-flashmla"])
@pytest.mark.parametrize("prefill,decode,batch", [(1, 0, 1), (6, 2, 3)])
def test_bytes_formula_dsa(mla_backend, case, prefill, decode, batch, mla_device, mla_figures):
    """DeepSeek Sparse Attention (presets with index_topk): the same byte rule; a "latent+indexer" cache holds
    kv_lora + rope + index_head_dim elements per token (the indexer keys counted: 1,408 B in BF16 at
    512/64/128), and with kv_codec fp8-e4m3-flashmla FlashMLA's 656-byte latent row plus an FP8 indexer key
    with one float32 scale per 128 values (132 B): 788 B at V3.2 dims (v3.2-mini). Backends that do not
    accept an index_topk config (or the codec) skip with their own sentence."""
    preset, dtype, kv_codec = {"tiny-dsa-bfloat16": ("tiny-dsa", "bfloat16", "none"),
                               "tiny-dsa-float32": ("tiny-dsa", "float32", "none"),
                               "v3.2-mini-fp8-e4m3-flashmla": ("v3.2-mini", "bfloat16", "fp8-e4m3-flashmla")}[case]
    got = checks.cache_bytes(mla_backend, preset, checks.DTYPES[dtype], prefill=prefill, decode=decode,
                             batch=batch, capacity=16, device=mla_device, kv_codec=kv_codec, figures=mla_figures)
    if got["cache_format"] == "latent+indexer":
        config = MLAConfig.preset(preset)
        if kv_codec != "none":  # FlashMLA's row (e4m3 latent, a float32 scale per 128, bf16 rope) + e4m3 indexer key
            tiles = -(-config.kv_lora_rank // 128), -(-config.index_head_dim // 128)
            expected = (config.kv_lora_rank + 4 * tiles[0] + 2 * config.qk_rope_head_dim
                        + config.index_head_dim + 4 * tiles[1])  # 788 at V3.2 dims
        else:
            expected = ((config.latent_dim + config.index_head_dim)
                        * torch.empty(0, dtype=checks.DTYPES[dtype]).element_size())
        assert got["bytes_per_token"] == expected
