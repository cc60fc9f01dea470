"""bench's DeepSeek Sparse Attention figures: bytes per decode step dense vs sparse from measured bytes per token,
and the DSA cache fill / FLOP model of ``bench.prepare``."""

import pytest
import torch

from mla_conformance.perf import bench


def test_sparse_decode_bytes_at_v32_dims():
    got = bench.sparse_decode_bytes()
    assert got["preset"] == "deepseek-v3.2" and got["index_topk"] == 2048
    bf16, fp8 = got["forms"]["bfloat16"], got["forms"]["fp8-e4m3-flashmla"]
    assert bf16["bytes_per_token"] == {"latent": 1152, "indexer": 256, "total": 1408,
                                       "buffers": {"kv_latent": 1024, "k_pe": 128, "index_k": 256}}
    assert (fp8["bytes_per_token"]["latent"], fp8["bytes_per_token"]["indexer"]) == (656, 132)
    rows = {r["context"]: r for r in bf16["contexts"]}
    assert sorted(rows) == [16384, 32768]
    assert rows[16384]["dense_bytes"] == 16384 * 1152
    assert rows[16384]["sparse_bytes"] == 2048 * 1152 + 16384 * 256
    assert rows[16384]["dense_over_sparse"] == pytest.approx(16384 * 1152 / (2048 * 1152 + 16384 * 256))  # 2.88
    assert rows[32768]["dense_over_sparse"] == pytest.approx(37748736 / 10747904)
    fp8_rows = {r["context"]: r for r in fp8["contexts"]}
    assert fp8_rows[16384]["dense_over_sparse"] == pytest.approx(16384 * 656 / (2048 * 656 + 16384 * 132))
    text = bench.format_table({"device": {"device": "cpu"}, "measured_bandwidth_gb_per_s": 1.0, "results": [],
                               "sparse_decode_bytes": got})
    assert f"dense/sparse {rows[16384]['dense_over_sparse']:.2f}x" in text and "latent 656 + indexer 132 B/token" in text


def test_sparse_decode_bytes_are_measured(monkeypatch):
    """A cache that stored the indexer keys in fewer bytes would change the figures: they come from its tensors."""
    from mla_conformance.kv.caches import IndexerLatentCache

    real = IndexerLatentCache.allocate.__func__

    def narrow(cls, config, **kw):  # indexer keys kept in half the width: the measurement must see 128 B, not 256
        cache = real(cls, config, **kw)
        cache._buffers["index_k"] = torch.zeros(kw["batch_size"], kw["capacity"], config.index_head_dim // 2,
                                                dtype=kw["dtype"], device=kw["device"])
        return cache

    monkeypatch.setattr(IndexerLatentCache, "allocate", classmethod(narrow))
    monkeypatch.setattr(IndexerLatentCache, "write", lambda self, name, v, lengths: type(self).__mro__[1].write(
        self, name, v[..., :self._buffers[name].shape[-1]], lengths))
    with pytest.raises(RuntimeError, match=r"measured 1280\.0 B/token.*latent\+indexer format says 1408"):
        bench.sparse_decode_bytes(forms=(("bfloat16", "none"),))


def test_prepare_fills_dsa_indexer_keys():
    p = bench.prepare("reference-dsa", "tiny-dsa", "float32", 48, 2, "cpu", steps=2, progress=lambda m: None)
    assert p.fill == "latent+indexer" and p.flop_model == "sparse"
    k = p.cache.tensors()["index_k"][:, :48]
    assert bool(torch.isfinite(k).all()) and bool((k.abs().sum(-1) > 0).all())  # real keys, not the zeros
    p.reset()
    p.step()
    idx = p.cache.last_topk_indices
    assert int((idx >= 0).sum()) == 2 * 16 and p.cache.seq_lens.tolist() == [49, 49]
    assert p.flops() == bench.decode_flops(p.config, 48, 2, "sparse")
