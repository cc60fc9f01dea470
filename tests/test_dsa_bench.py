"""bench's DeepSeek Sparse Attention figures: bytes per decode step dense vs sparse from measured bytes per token,
the DSA cache fill / FLOP model of ``perf.step.prepare``, and its correctness gate on a sparse decode step."""

import pytest
import torch

from mla_conformance.arch.device import device_description
from mla_conformance.checks.layer.driver import master_weights
from mla_conformance.model.dsa_reference import sparse_attention_f64
from mla_conformance.perf import gate
from mla_conformance.perf.fill import hidden_chunk
from mla_conformance.perf.flops import decode_flops
from mla_conformance.perf.sparse import sparse_decode_bytes
from mla_conformance.perf.step import prepare
from mla_conformance.perf.table import format_table


def test_sparse_decode_bytes_at_v32_dims():
    got = sparse_decode_bytes()
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
    text = format_table({"device": device_description("cpu"), "measured_bandwidth_gb_per_s": 1.0, "results": [],
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
        sparse_decode_bytes(forms=(("bfloat16", "none"),))


@pytest.fixture(scope="module")
def dsa_step():
    """reference-dsa's decode step prepared at 48 tokens (3 x index_topk) per row, 2 rows."""
    return prepare("reference-dsa", "tiny-dsa", "float32", 48, 2, "cpu", steps=2, progress=lambda m: None)


def test_prepare_fills_dsa_indexer_keys(dsa_step):
    p = dsa_step
    assert p.fill == "latent+indexer" and p.flop_model == "sparse"
    k = p.cache.tensors()["index_k"][:, :48]
    assert bool(torch.isfinite(k).all()) and bool((k.abs().sum(-1) > 0).all())  # real keys, not the zeros
    p.reset()
    p.step()
    idx = p.cache.last_topk_indices
    assert int((idx >= 0).sum()) == 2 * 16 and p.cache.seq_lens.tolist() == [49, 49]
    assert p.flops() == decode_flops(p.config, 48, 2, "sparse")
    # the gate judged the step over the backend's own selection, and passed
    c = p.correctness
    assert c.passed and c.checked["context"] == 48 and c.checked["cache_format"] == "latent+indexer"
    assert "own selection" in c.measured["keys"] and c.bound["source"] == "checks.TOLERANCES['float32']"


def test_sparse_decode_oracle_is_the_sparse_reference(dsa_step):
    """The gate's decode-step oracle over a selection equals ``dsa_reference.sparse_attention_f64``'s last position over
    the same selection (the whole sequence recomputed, per query), to float64 rounding; over no given selection it
    is the float64 indexer's own top-k, as sparse_attention_f64's default."""
    p = dsa_step
    p.reset()
    p.step()
    own = gate.selection_of(p)
    x = torch.cat([hidden_chunk(p.config, 0, 48, 2, 0, "cpu", p.dtype)[0], p.hidden], 1).to(torch.float64)
    indices = torch.full((2, 49, own.shape[-1]), -1, dtype=torch.int64)
    indices[:, 48] = own[:, 0]
    w64 = master_weights("tiny-dsa", 0)
    got, keys = gate.decode_oracle(p, own)
    want = sparse_attention_f64(w64, x, indices=indices)[:, 48:]
    assert "own selection" in keys and (got - want).abs().max() <= 1e-12 * want.abs().max()
    got, keys = gate.decode_oracle(p)
    want = sparse_attention_f64(w64, x)[:, 48:]
    assert "float64 indexer's top-16" in keys and (got - want).abs().max() <= 1e-12 * want.abs().max()
