"""hf-transformers drives transformers' own DeepseekV4Attention for DeepSeek-V4 layers (mla_conformance.impl.backends
.hf_v4), and MLA configs still take the DeepseekV2 / V32 path. Fast: v4-tiny, float32, a few dozen tokens."""

import pytest
import torch

from mla_conformance import MLAConfig, MLAWeights
from mla_conformance.impl.backends import hf_v4
from mla_conformance.impl.backends.hf import HFCache, HFTransformers
from mla_conformance.model.v4_config import CSA, HCA, LAYER_TYPES, SLIDING, V4Weights, v4_config
from mla_conformance.model.v4_reference import v4_attention_f64

pytestmark = pytest.mark.skipif(hf_v4.v4_unavailable_reason() is not None,
                                reason=hf_v4.v4_unavailable_reason() or "")


def _call(backend, w, cache, x, start, lengths):
    B, S = x.shape[:2]
    pos = cache.seq_lens[:, None] + torch.arange(S)[None]
    assert torch.equal(cache.seq_lens, start)
    return backend.attend(w, x, pos, cache, lengths)


@pytest.mark.parametrize("layer_type", LAYER_TYPES)
def test_v4_layer_runs_against_oracle(layer_type):
    """Rows of different lengths (one idle), then one decode step: transformers' module, its caches, the oracle."""
    backend = HFTransformers()
    assert backend.deepseek_v4 is True
    cfg = v4_config("v4-tiny", layer_type)
    assert backend.unsupported_reason(cfg, dtype=torch.float32, device="cpu") is None
    w64 = V4Weights.random(cfg, dtype=torch.float64, seed=1)
    w = w64.to(torch.float32)
    x = torch.randn(2, 21, cfg.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    cache = backend.new_cache(cfg, batch_size=2, capacity=32, dtype=torch.float32, device="cpu")
    assert cache.tensors() == {} and cache.allocated_nbytes() == 0

    first = torch.tensor([20, 0])
    y1 = _call(backend, w, cache, x[:, :20].float(), torch.tensor([0, 0]), first)
    assert y1.shape == (2, 20, cfg.hidden_size) and y1.dtype == torch.float32
    assert torch.equal(cache.seq_lens, first)
    assert not any(k.startswith("rows.1.") for k in cache.tensors())      # the idle row's cache was never touched
    y2 = _call(backend, w, cache, x[:, 20:21].float(), first, torch.tensor([1, 0]))
    assert torch.equal(cache.seq_lens, torch.tensor([21, 0]))

    ref, traces = v4_attention_f64(w64, x[:1])
    out = torch.cat([y1[0], y2[0]]).double()
    keep = torch.ones(21, dtype=torch.bool) if traces[0].margin is None else traces[0].margin >= 1e-4  # top-k ties
    rel = float((out - ref[0])[keep].norm() / ref[0][keep].norm())
    assert rel < 1e-5, f"{layer_type}: rel-Frobenius {rel:.2e} against the float64 oracle"

    layout = cache.v4_layout
    tensors = cache.tensors()
    assert set(layout) == set(tensors)
    assert cache.allocated_nbytes() == sum(t.nbytes for t in tensors.values()) == cache.active_nbytes()
    roles = set(layout.values())
    assert "window" in roles
    assert ("compressed" in roles) == (layer_type != SLIDING)
    assert ("indexer" in roles) == (layer_type == CSA)
    if layer_type != SLIDING:  # compressed layers store K = V once (values is keys)
        assert not any(k.endswith(".values") for k in tensors)
    if layer_type == CSA:
        assert cache.last_topk_indices.shape == (2, 1, cfg.index_topk)


def test_v4_uniform_batch_shares_one_cache_then_splits():
    """Rows fed alike share one transformers Cache (transformers' batched path); a ragged call splits it per row."""
    backend = HFTransformers()
    cfg = v4_config("v4-tiny", HCA)
    w64 = V4Weights.random(cfg, dtype=torch.float64, seed=3)
    w = w64.to(torch.float32)
    x = torch.randn(2, 22, cfg.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    cache = backend.new_cache(cfg, batch_size=2, capacity=32, dtype=torch.float32, device="cpu")
    y1 = _call(backend, w, cache, x[:, :17].float(), torch.tensor([0, 0]), None)
    assert cache.rows is None and all(not k.startswith("rows.") for k in cache.tensors())
    y2 = _call(backend, w, cache, x[:, 17:22].float(), torch.tensor([17, 17]), torch.tensor([5, 2]))
    assert cache.shared is None and len(cache.rows) == 2
    ref, _ = v4_attention_f64(w64, x)
    for b, n in ((0, 5), (1, 2)):
        out = torch.cat([y1[b], y2[b, :n]]).double()
        r = ref[b, :17 + n]
        assert float((out - r).norm() / r.norm()) < 1e-5


def test_v4_declines():
    backend = HFTransformers()
    cfg = v4_config("v4-tiny", CSA)
    reason = backend.unsupported_reason(cfg, dtype=torch.bfloat16, device="cpu", kv_codec="fp8-e4m3")
    assert reason and "kv_codec 'fp8-e4m3'" in reason


def test_mla_configs_take_the_old_path(monkeypatch):
    """An MLA config never reaches hf_v4: DeepseekV2Attention with its DynamicCache, as before."""
    def boom(*args, **kwargs):
        raise AssertionError("an MLA config reached the V4 driver")

    monkeypatch.setattr(HFTransformers, "_v4_driver", boom)
    backend = HFTransformers()
    cfg = MLAConfig.preset("tiny")
    assert backend.unsupported_reason(cfg, dtype=torch.float32, device="cpu") is None
    w = MLAWeights.random(cfg, seed=0, dtype=torch.float32)
    cache = backend.new_cache(cfg, batch_size=1, capacity=8, dtype=torch.float32, device="cpu")
    assert isinstance(cache, HFCache)
    y = backend.attend(w, torch.randn(1, 4, cfg.hidden_size), torch.arange(4)[None], cache)
    assert y.shape == (1, 4, cfg.hidden_size) and int(cache.seq_lens[0]) == 4
    assert backend.diagnose(w) is None
