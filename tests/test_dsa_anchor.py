"""The DSA (DeepSeek-V3.2) float64 oracle anchored to transformers' DeepseekV32 modules.

On ``tiny-dsa`` (index_topk 16) with random weights, over 48 tokens (selection bites from the 17th):

* ``indexer_scores_f64`` against the scores transformers' ``DeepseekV32Indexer`` feeds its top-k
  (captured at the ``topk`` call), and ``select_topk_f64`` against its indices (swaps allowed only among
  keys whose scores tie, e.g. the exact zeros of an all-negative ReLU);
* ``sparse_attention_f64`` against ``DeepseekV32Attention`` run whole-sequence with a causal mask (eager);
* conventions, with numbers: transformers rotates the indexer's first qk_rope_head_dim dims in the
  rotate-half layout (the interleaved layout of the first V3.2-Exp demo differs by O(1)); it skips the
  Hadamard rotation and FP8 (an orthonormal rotation leaves q.k unchanged: 1e-16 in float64; FP8 does not);
* len <= index_topk: sparse == dense ``reference_attention_f64`` to 1e-12.
"""

import pytest
import torch

from mla_conformance import MLAConfig, MLAWeights, checks
from mla_conformance.model.reference import reference_attention_f64
from mla_conformance.model.dsa_reference import indexer_scores_f64, select_topk, select_topk_f64, selection_mask, sparse_attention_f64

PRESET = "tiny-dsa"
T = 48


def _modeling():
    try:
        from transformers.models.deepseek_v32 import modeling_deepseek_v32 as m
    except ImportError:
        import transformers

        pytest.skip(f"transformers {transformers.__version__} has no DeepseekV32 (DeepSeek-V3.2 sparse attention "
                    f"arrived in transformers 5.x); the DSA oracle is not anchored here")
    return m


def _hf_v32_config(config: MLAConfig):
    """transformers' DeepseekV32Config for the config, built as the hf-transformers backend builds it."""
    from mla_conformance.impl.backends.hf import _hf_v32_config as build

    cfg = build(config)
    cfg._attn_implementation = "eager"
    return cfg


class _TopkInputs(torch.overrides.TorchFunctionMode):
    """Records the tensor every ``topk`` is called on (transformers' index scores, before selection)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.topk, torch.topk):
            self.seen.append(args[0].detach().clone())
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def run():
    m = _modeling()
    w = MLAWeights.random(MLAConfig.preset(PRESET), seed=0, dtype=torch.float64)
    cfg = _hf_v32_config(w.config)
    attn = m.DeepseekV32Attention(cfg, layer_idx=0).to(torch.float64)
    missing, unexpected = attn.load_state_dict(dict(w), strict=True)
    x = torch.randn(1, T, w.config.hidden_size, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    pos = torch.arange(T)[None]
    pos_emb = m.DeepseekV32RotaryEmbedding(cfg)(x, pos)
    mask = torch.full((T, T), torch.finfo(torch.float64).min, dtype=torch.float64).triu(1)[None, None]
    with torch.no_grad(), _TopkInputs() as rec:
        out = attn(x, attention_mask=mask, position_embeddings=pos_emb, position_ids=pos)[0]
    (hf_scores,) = rec.seen
    with torch.no_grad():
        q_resid = attn.q_a_layernorm(attn.q_a_proj(x))
        hf_idx = attn.indexer(x, q_resid, pos_emb, mask[:, 0], pos).long()
    return w, x, hf_scores, hf_idx, out


def _score_metrics(ours, theirs):
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None]
    return checks.error_metrics(ours[causal], theirs[causal])


def test_indexer_scores_against_transformers(run, mla_figures):
    w, x, hf_scores, _, _ = run
    ours = indexer_scores_f64(w, x)
    m = _score_metrics(ours, hf_scores)
    mla_figures["scores_rel_fro"] = m["rel_fro"]
    assert m["rel_fro"] <= 1e-5, checks.format_metrics(m)  # transformers' cos/sin are computed in float32


def _selection_mismatch(ours_idx, hf_idx, scores, tol):
    """Queries whose selected sets differ other than by swaps among keys tied (within tol) at the k-th score."""
    bad = []
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None]
    a = selection_mask(ours_idx, T) & causal
    b = selection_mask(hf_idx, T) & causal
    for s in range(T):
        diff = (a[0, s] ^ b[0, s]).nonzero().flatten()
        if len(diff):
            kth = scores[0, s][a[0, s]].min()
            if (scores[0, s, diff] - kth).abs().max() > tol:
                bad.append(s)
    return bad, int((a ^ b).sum())


def test_selection_against_transformers(run, mla_figures):
    w, x, hf_scores, hf_idx, _ = run
    scores = indexer_scores_f64(w, x)
    ours = select_topk_f64(w, x)
    assert ours.shape == (1, T, 16) and (ours[0, 3, 4:] == -1).all() and (ours[0, 3, :4] >= 0).all()
    assert (ours >= 0).sum(-1).flatten().tolist() == [min(16, s + 1) for s in range(T)]
    bad, swaps = _selection_mismatch(ours, hf_idx, scores, 1e-9)
    mla_figures["tie_swaps"] = swaps
    assert not bad, f"selected sets differ beyond score ties at queries {bad}"


def test_sparse_attention_against_transformers(run, mla_figures):
    w, x, _, hf_idx, theirs = run
    ours = sparse_attention_f64(w, x)
    m = checks.error_metrics(ours, theirs)
    mla_figures["rel_fro"] = m["rel_fro"]
    assert m["rel_fro"] <= 1e-5, checks.format_metrics(m)
    own = checks.error_metrics(sparse_attention_f64(w, x, indices=hf_idx), theirs)["rel_fro"]
    assert own <= 1e-5, f"sparse oracle over transformers' own selection: rel_fro={own:.3e}"
    dense = checks.error_metrics(reference_attention_f64(w, x), theirs)["rel_fro"]
    mla_figures["dense_vs_sparse_rel_fro"] = dense
    assert dense > 1e-2, f"selection does not bite at {T} tokens > index_topk 16: dense differs by {dense:.3e}"


def test_conventions_with_numbers(run, mla_figures):
    """Interleaved indexer RoPE is not transformers' convention; Hadamard is a no-op in float64; FP8 is not."""
    w, x, hf_scores, hf_idx, _ = run
    scores = indexer_scores_f64(w, x)
    inter = indexer_scores_f64(w, x, rope_layout="interleaved")
    m_inter = _score_metrics(inter, hf_scores)["rel_fro"]
    bad_inter, swaps_inter = _selection_mismatch(select_topk(inter, 16), hf_idx, scores, 1e-9)
    no_h = _score_metrics(indexer_scores_f64(w, x, hadamard=False), scores)["rel_fro"]
    fp8 = indexer_scores_f64(w, x, fp8=True)
    m_fp8 = _score_metrics(fp8, scores)["rel_fro"]
    _, swaps_fp8 = _selection_mismatch(select_topk(fp8, 16), select_topk(scores, 16), scores, 1e-9)
    mla_figures.update(interleaved_rel_fro=m_inter, interleaved_queries_differing=len(bad_inter),
                       interleaved_swaps=swaps_inter, no_hadamard_rel_fro=no_h, fp8_rel_fro=m_fp8, fp8_swaps=swaps_fp8)
    assert m_inter > 1e-2 and bad_inter, f"interleaved indexer RoPE matches transformers: {m_inter:.3e}"
    assert no_h <= 1e-13, f"the Hadamard rotation changed float64 scores by {no_h:.3e}"
    assert 1e-4 < m_fp8 < 0.2, f"FP8 (ue8m0) scores vs exact: rel_fro={m_fp8:.3e}"


@pytest.mark.parametrize("length", [15, 16])
def test_sparse_equals_dense_up_to_topk(length):
    w = MLAWeights.random(MLAConfig.preset(PRESET), seed=0, dtype=torch.float64)
    x = torch.randn(2, length, w.config.hidden_size, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    lengths = torch.tensor([length, length - 6])
    sparse, dense = sparse_attention_f64(w, x, lengths), reference_attention_f64(w, x, lengths)
    err = ((sparse - dense).norm() / dense.norm()).item()
    assert err <= 1e-12, f"len {length} <= index_topk 16: sparse differs from dense by rel_fro={err:.3e}"
