"""DSA cache formats and the reference-dsa backend's own parts (the conformance side is suites/test_dsa.py)."""

import pytest
import torch

from mla_conformance import MLAConfig, checks
from mla_conformance.contract.layer import CACHE_FORMATS, cache_format_of
from mla_conformance.specs import get_backend
from mla_conformance.errors import BackendSpecError

V32 = MLAConfig.preset("deepseek-v3.2")


def test_format_bytes_per_token():
    assert checks.format_bytes_per_token(V32, "latent", torch.bfloat16) == 1_152
    assert checks.format_bytes_per_token(V32, "latent+indexer", torch.bfloat16) == 1_408  # 576 + 128 elements
    assert checks.format_bytes_per_token(V32, "latent+indexer", torch.float32) == 2_816
    assert checks.format_bytes_per_token(V32, "latent+indexer", torch.bfloat16, "fp8-e4m3-flashmla") == 656 + 132
    # the indexer key's storage, declared apart from the latent's: DeepSeek's V3.2-Exp reference keeps a bf16
    # latent next to an e4m3 key with one float32 scale per 128 values: 576 x 2 + 128 + 4
    assert checks.format_bytes_per_token(V32, "latent+indexer", torch.bfloat16,
                                         indexer_format="fp8-e4m3-block128") == 1_284
    assert checks.format_bytes_per_token(V32, "latent+indexer", torch.float32, indexer_format="bf16") == 2_304 + 256
    assert checks.format_bytes_per_token(V32, "latent+indexer", torch.bfloat16, "fp8-e4m3-flashmla",
                                         indexer_format="cache-dtype") == 656 + 256
    assert checks.indexer_bytes_per_token(V32, "latent", torch.bfloat16, indexer_format="fp8-e4m3-block128") == 0
    assert checks.format_bytes_per_token(V32, "expanded", torch.bfloat16) == 81_920
    with pytest.raises(ValueError, match="latent\\+indexer"):
        checks.format_bytes_per_token(MLAConfig.preset("deepseek-v3"), "latent+indexer", torch.bfloat16)


def test_cache_format_values():
    assert "latent+indexer" in CACHE_FORMATS
    dsa = get_backend("reference-dsa")
    assert cache_format_of(dsa) == "latent+indexer"

    class Odd:
        name, cache_format = "odd", "latent+kv"

    with pytest.raises(BackendSpecError, match="latent\\+indexer"):
        cache_format_of(Odd())


def test_dense_backends_decline_dsa_and_dsa_declines_dense():
    tiny_dsa, tiny = MLAConfig.preset("tiny-dsa"), MLAConfig.preset("tiny")
    for name in ("reference-naive", "reference-absorbed", "flashmla"):
        reason = get_backend(name).unsupported_reason(tiny_dsa, dtype=torch.bfloat16, device="cpu", kv_codec="none")
        assert reason and "Sparse Attention" in reason, (name, reason)
    # hf-transformers serves DSA through transformers' DeepseekV32Attention where the release has it
    from mla_conformance.impl.backends.hf import v32_unavailable_reason

    hf = get_backend("hf-transformers").unsupported_reason(tiny_dsa, dtype=torch.bfloat16, device="cpu", kv_codec="none")
    assert hf == v32_unavailable_reason(), hf
    dsa = get_backend("reference-dsa")
    assert "reference-absorbed" in dsa.unsupported_reason(tiny, dtype=torch.float32, device="cpu", kv_codec="none")
    assert dsa.unsupported_reason(tiny_dsa, dtype=torch.float32, device="cpu", kv_codec="none") is None
    assert "fp8-e4m3-flashmla" in dsa.unsupported_reason(tiny_dsa, dtype=torch.bfloat16, device="cpu",
                                                          kv_codec="fp8-e4m3-flashmla")


def test_reference_dsa_cache_and_selection():
    w = checks.weights_for("tiny-dsa", torch.float32)
    dsa = get_backend("reference-dsa")
    cache = dsa.new_cache(w.config, batch_size=2, capacity=40, dtype=torch.float32, device="cpu")
    assert set(cache.tensors()) == {"kv_latent", "k_pe", "index_k"}
    for t in cache.tensors().values():
        t.fill_(float("nan"))
    x = torch.randn(2, 30, w.config.hidden_size, generator=torch.Generator().manual_seed(3))
    out = dsa.attend(w, x, torch.arange(30).expand(2, 30), cache, torch.tensor([30, 10]))
    assert torch.isfinite(out[0]).all() and torch.isfinite(out[1, :10]).all()
    idx = cache.last_topk_indices
    assert idx.shape == (2, 30, 16) and idx.dtype == torch.int64
    assert (idx[0, 29] >= 0).all() and ((idx[0, 3] >= 0).sum() == 4) and (idx[0, 3, 4:] == -1).all()
    assert not torch.isnan(cache.read("index_k", 30, cache.seq_lens)).any()  # zeros selected past row 1's length


def test_fp8_indexer_cache_round_trip():
    """The packed FP8 indexer row: 128 e4m3 + one float32 power-of-two scale = 132 B; decode within e4m3's
    relative step (2^-3 of the block's scale range), zeros past a row's length."""
    from mla_conformance.kv.caches import FP8IndexerLatentCache

    config = MLAConfig.preset("v3.2-mini")
    cache = FP8IndexerLatentCache(config, batch_size=2, capacity=8, dtype=torch.bfloat16, device="cpu",
                                  kv_codec="fp8-e4m3-flashmla")
    assert cache.tensors()["index_k"].shape == (2, 8, 132) and cache.tensors()["index_k"].dtype == torch.uint8
    cache.tensors()["index_k"].fill_(0xFF)  # NaN once read as e4m3 / float32
    k = torch.randn(2, 5, 128, generator=torch.Generator().manual_seed(0))
    cache.write_index_k(k, torch.tensor([5, 3]))
    back = cache.read_index_k(8, torch.tensor([5, 3]))
    assert torch.isfinite(back).all() and (back[1, 3:] == 0).all() and (back[0, 5:] == 0).all()
    err = (back[0, :5] - k[0]).abs().max() / k[0].abs().max()
    assert err <= 2 ** -4 * 2  # half an e4m3 step at the top binade, times the power-of-two scale's headroom


def test_indexer_format_declaration():
    """indexer_format: on the cache, else the backend, else the default (the cache dtype; FP8 block-128 with the
    fp8-e4m3-flashmla codec); a value outside INDEXER_FORMATS is a bad spec naming the allowed ones."""
    from mla_conformance.kv.caches import FP8IndexerLatentCache

    class Backend:
        name = "b"

    class Cache:
        indexer_format = "bf16"

    b = Backend()
    assert checks.indexer_format_of(b) == "cache-dtype"
    assert checks.indexer_format_of(b, kv_codec="fp8-e4m3-flashmla") == "fp8-e4m3-block128"
    assert checks.indexer_format_of(b, Cache()) == "bf16"
    b.indexer_format = "fp8-e4m3-block128"
    assert checks.indexer_format_of(b) == "fp8-e4m3-block128" and checks.indexer_format_of(b, Cache()) == "bf16"
    assert FP8IndexerLatentCache.indexer_format == "fp8-e4m3-block128"
    b.indexer_format = "fp8"
    with pytest.raises(BackendSpecError, match="fp8-e4m3-block128"):
        checks.indexer_format_of(b)


def test_byte_hint_names_scales_and_the_indexer_format():
    """A bf16 latent + FP8 block-128 indexer cache that declares no indexer_format: the failure names the float32
    buffer as scales (not as 'wider than the cache') and the indexer format whose size it has."""
    from tests.meta.impls.independent.deepseek_v32_backend import DeepSeekV32Reference

    class Undeclared(DeepSeekV32Reference):
        name = "undeclared-fp8-indexer"
        indexer_format = None

    with pytest.raises(AssertionError) as info:
        checks.cache_bytes(Undeclared(), "v3.2-mini", torch.bfloat16, prefill=6, decode=2, batch=3, capacity=16)
    msg = str(info.value)
    assert "1,284 B per stored token" in msg and "needs 1,408 B" in msg, msg
    assert "scales of a quantized part" in msg and "wider than" not in msg, msg
    assert "indexer_format 'fp8-e4m3-block128'" in msg, msg


def test_config_indexer_rope_layout():
    """indexer_rope_interleave: a DSA config field (default False = DeepSeek-V3.2's half-split), read from HF
    configs where present (GLM-MoE-DSA), refused on a dense config; the oracle follows it."""
    from mla_conformance.errors import MLAInputError
    from mla_conformance.model.dsa_reference import indexer_rope_layout, indexer_scores_f64

    v32, glm = MLAConfig.preset("v3.2-mini"), MLAConfig.preset("glm-dsa-mini")
    assert (v32.indexer_rope_interleave, glm.indexer_rope_interleave) == (False, True)
    assert (indexer_rope_layout(v32), indexer_rope_layout(glm)) == ("half", "interleaved")
    hf = {**v32.to_hf_dict(), "model_type": "glm_moe_dsa", "indexer_rope_interleave": True}
    assert MLAConfig.from_hf(hf) == glm
    # transformers' GlmMoeDsa hard-codes the interleaved indexer RoPE: a glm_moe_dsa config without the field
    bare = {k: v for k, v in v32.to_hf_dict().items() if k != "indexer_rope_interleave"}
    assert MLAConfig.from_hf({**bare, "model_type": "glm_moe_dsa"}).indexer_rope_interleave
    assert not MLAConfig.from_hf({**bare, "model_type": "deepseek_v32"}).indexer_rope_interleave
    assert "indexer_rope_interleave" not in MLAConfig.preset("v3-mini").to_hf_dict()
    with pytest.raises(MLAInputError, match="indexer_rope_interleave"):
        MLAConfig(**{**MLAConfig.preset("v3-mini").to_hf_dict(), "indexer_rope_interleave": True})
    w_half, w_glm = checks.master_weights("v3.2-mini", 0), checks.master_weights("glm-dsa-mini", 0)
    x = torch.randn(1, 20, v32.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert torch.equal(indexer_scores_f64(w_glm, x), indexer_scores_f64(w_half, x, rope_layout="interleaved"))
    assert not torch.equal(indexer_scores_f64(w_glm, x), indexer_scores_f64(w_half, x))
