"""DeepSeek Sparse Attention (V3.2): the lightning indexer's selection and sparse MLA, through the contract.

A backend opts in by declaring DSA (``sparse_attention = "dsa"`` or a ``latent+indexer`` cache format; others
skip naming the declaration). On ``tiny-dsa`` (index width 32, index_topk 16) in float32 and bfloat16, and on
``v3.2-mini`` (V3.2's index width 128, the width DeepSeek's FP8 indexer code runs at) and ``glm-dsa-mini`` (the
same with the indexer RoPE in interleaved pairs, as GLM-5's DSA configs declare) in bfloat16, with contexts of
several x index_topk so that selection bites:

* the output against the float64 sparse oracle (``sparse_attention_f64``: the indexer in the RoPE layout the
  config declares, ``indexer_rope_interleave``; top-min(k, len) per query; absorbed MLA over the selection) on
  prefill, prefill + decode and varlen batches, to the dtype's tolerance of checks.TOLERANCES. Where the
  backend exposes its selection (``last_topk_indices``), its output is judged over its own selection on every
  query of every call, and against the oracle's selection on the queries whose oracle selection is certain;
  otherwise only the certain queries are compared (``tied_queries_not_compared`` counts the rest). A query's
  selection is *uncertain* when some selected key j and unselected key k have oracle scores within the bound
  the backend's indexer precision allows: s_j - s_k <= e_j + e_k, e = max_rel x M (+ e4m3's subnormal term for
  an FP8 indexer), max_rel from the ``indexer-scores`` row of checks.TOLERANCES for the indexer the backend
  declares (``indexer_format``: checks.INDEXER_FORMATS) at the run's dtype, M = sum_h |w_h| sum_i |q_hi k_ti|.
  A failure whose tokens match the oracle with the other indexer RoPE layout says so;
* len <= index_topk selects every key, so DSA equals dense MLA (``reference_attention_f64``): checked at
  index_topk - 1 and index_topk, and at index_topk + 1 against the sparse oracle (the last query drops
  one key), on prefill and on decode steps crossing the boundary;
* where the cache (or the backend) exposes ``last_topk_indices`` (optional): every call's selected set per
  query against the oracle's: a key the oracle keeps may be swapped for one it drops only when their oracle
  scores lie within the bound above (e_j + e_k); valid count min(k, len); unused slots -1;
* where the cache (or the backend) exposes ``last_indexer_scores`` (optional): the scores of every query
  against the float64 oracle (``indexer_scores_f64``), -inf exactly where the key is masked, to the
  ``indexer-scores`` row of the indexer the backend declares; a failure whose scores match the other indexer
  RoPE layout says so;
* the cache bytes at V3.2's latent dims (``v3.2-mini``: kv_lora 512, rope 64, indexer key 128) in BF16: the
  ``latent+indexer`` format with its declared indexer storage, measured from ``tensors()``: 1,408 B per stored
  token with a BF16 indexer key, 1,284 B with DeepSeek's FP8 block-128 key (128 e4m3 + one float32 scale).
"""

import pytest

from mla_conformance import checks
from mla_conformance.checks import Scenario
from mla_conformance.checks.layer import dsa

#: the V3.2-width runs: small enough for the default run (3 rows, 42 tokens at most), several x index_topk
_V32_VARLEN = Scenario("dsa_v32_varlen_batch", (40, 28, 20), decode_steps=2)

#: case -> (preset, scenario)
CASES = {
    "prefill": ("tiny-dsa", Scenario("dsa_prefill", (80,))),
    "prefill_decode": ("tiny-dsa", Scenario("dsa_prefill_decode", (64,), decode_steps=6)),
    "varlen_batch": ("tiny-dsa", Scenario("dsa_varlen_batch", (70, 40, 20), decode_steps=3)),
    "v3.2-mini-varlen_batch": ("v3.2-mini", _V32_VARLEN),
    "glm-dsa-mini-varlen_batch": ("glm-dsa-mini", _V32_VARLEN),
}
SCENARIOS = {name: sc for name, (_, sc) in CASES.items()}


@pytest.mark.mla_section("dsa")
@pytest.mark.parametrize("dtype,scenario", [("float32", "prefill"), ("float32", "prefill_decode"),
                                            ("float32", "varlen_batch"), ("bfloat16", "varlen_batch"),
                                            ("bfloat16", "v3.2-mini-varlen_batch"),
                                            ("bfloat16", "glm-dsa-mini-varlen_batch")])
def test_sparse_attention(mla_backend, scenario, dtype, mla_device, mla_figures):
    """Sparse attention output vs the float64 sparse oracle at contexts of several x index_topk: over the
    oracle's selection on the queries whose selection is certain at the backend's declared indexer precision,
    and, where the backend exposes ``last_topk_indices``, over its own selection on every query."""
    preset, sc = CASES[scenario]
    dsa.judge_sparse(mla_backend, preset, sc, checks.DTYPES[dtype], mla_device, mla_figures)


@pytest.mark.mla_section("dsa")
@pytest.mark.parametrize("precision", ["tiny-dsa-float32", "v3.2-mini-bfloat16"])
@pytest.mark.parametrize("mode", ["prefill", "decode", "varlen"])
@pytest.mark.parametrize("offset", [-1, 0, 1])
def test_short_context_is_dense(mla_backend, offset, mode, precision, mla_device, mla_figures):
    """len <= index_topk: every key is selected, DSA == dense MLA (float64 dense reference); at
    index_topk + 1 the sparse oracle (the last query drops one key)."""
    preset, dtype = precision.rsplit("-", 1)
    dsa.check_short_context_is_dense(mla_backend, preset, offset, mode, checks.DTYPES[dtype], mla_device,
                                     mla_figures)


#: test_selection cases: scenario -> dtype
SELECTION_DTYPES = {"prefill": "float32", "varlen_batch": "float32", "v3.2-mini-varlen_batch": "bfloat16",
                    "glm-dsa-mini-varlen_batch": "bfloat16"}


@pytest.mark.mla_section("dsa")
@pytest.mark.parametrize("scenario", list(SELECTION_DTYPES))
def test_selection(mla_backend, scenario, mla_device, mla_figures):
    """The backend's selection (``last_topk_indices`` of every attend call) is the oracle's top-min(k, len) set
    per query, a kept key swapped for a dropped one only where their oracle scores lie within the declared
    indexer precision's bound (e_j + e_k); unused slots -1."""
    preset, sc = CASES[scenario]
    dsa.check_selection(mla_backend, preset, sc, checks.DTYPES[SELECTION_DTYPES[scenario]], mla_device,
                        mla_figures)


@pytest.mark.mla_section("dsa")
@pytest.mark.parametrize("prefill,decode,batch", [(6, 2, 3)])
def test_cache_bytes_v32_dims(mla_backend, prefill, decode, batch, mla_device, mla_figures):
    """At V3.2's latent dims in BF16 (v3.2-mini: 512 + 64 latent, 128-wide indexer key) a DSA cache is
    'latent+indexer' and holds, measured, its declared indexer storage's bytes per stored token: (512 + 64 + 128)
    x 2 = 1,408 B with a BF16 key, 1,152 + 128 + 4 = 1,284 B with DeepSeek's FP8 block-128 key (a cache declaring
    "latent" here under-reports the indexer keys); the measurement itself is checks.cache_bytes's."""
    dsa.check_cache_bytes_v32_dims(mla_backend, prefill, decode, batch, mla_device, mla_figures)


#: test_indexer_scores cases: (preset, dtype, kv_codec, scenario); the tolerance row is the declared indexer's
SCORE_CASES = {
    "float32-prefill_decode": ("tiny-dsa", "float32", "none", SCENARIOS["prefill_decode"]),
    "bfloat16-varlen_batch": ("tiny-dsa", "bfloat16", "none", SCENARIOS["varlen_batch"]),
    "bfloat16-v3.2-mini-varlen_batch": ("v3.2-mini", "bfloat16", "none", _V32_VARLEN),
    "fp8-e4m3-flashmla-prefill_decode": ("v3.2-mini", "bfloat16", "fp8-e4m3-flashmla", SCENARIOS["prefill_decode"]),
}


@pytest.mark.mla_section("dsa")
@pytest.mark.parametrize("case", list(SCORE_CASES))
def test_indexer_scores(mla_backend, case, mla_device, mla_figures):
    """The lightning indexer's scores (``last_indexer_scores``, float32 [B, S, T], -inf where the key is masked)
    of every query of every call against the float64 oracle: -inf exactly at the masked keys, and on the rest
    rel_fro and max_rel relative to M = sum_h |w_h| sum_i |q_hi k_ti| within the ``indexer-scores`` row of
    checks.TOLERANCES of the indexer the backend declares (FP8 block-128: the e4m3 bound, plus e4m3's subnormal
    half-steps per element)."""
    preset, dtype_name, kv_codec, sc = SCORE_CASES[case]
    dsa.check_indexer_scores(mla_backend, preset, dtype_name, kv_codec, sc, mla_device, mla_figures)
