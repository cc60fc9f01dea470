"""Greedy generations of the embedded tiny model, with every layer's attention through each backend.

The tiny model (fixtures/models/tiny-mla) learned to copy spans and recall values from its context, so
every generated token depends on the KV cache being right. Goldens are syrupy snapshots under
golden/generation/<numerics class>/, shared by all backends: every backend must produce the same tokens.

Its DeepSeek Sparse Attention variant (fixtures/models/tiny-mla-dsa: the same weights plus a lightning indexer
per layer, index_topk 6, the indexer warm-up trained) has goldens of its own (``tiny-dsa-short``,
``tiny-dsa-long``: the tiny-short / tiny-long prompts), run by every backend that accepts its config; dense
backends skip with their own sentence. Every prompt is longer than 6 tokens (the shortest recall has 8), so
selection bites on every answer token and the answers depend on the indexer: a random one collapses them
(tests/test_dsa_golden_tools.py).
"""

import pytest

from mla_conformance.checks.layer import golden


@pytest.fixture(scope="module")
def tiny_model(mla_device):
    return golden.load_tiny_model(mla_device)


@pytest.fixture(scope="module")
def tiny_dsa_model(mla_device):
    return golden.load_tiny_model(mla_device, dsa=True)


@pytest.mark.mla_section("golden")
@pytest.mark.parametrize("prompt_set", [*golden.PROMPT_SETS, *golden.DSA_GOLDENS])
def test_golden_generation(mla_backend, prompt_set, snapshot, request, mla_device, mla_figures):
    """The dense tiny model on tiny-short / tiny-long; its DSA variant on the same prompts (tiny-dsa-*), each
    backend that accepts the model's config; the config is read before the model loads, so a backend that
    declines it skips at no cost."""
    golden.check_golden_generation(mla_backend, request, snapshot, prompt_set=prompt_set, device=mla_device,
                                   figures=mla_figures,
                                   model=lambda dsa: request.getfixturevalue("tiny_dsa_model" if dsa else "tiny_model"))


#: codec -> minimum accuracy on the tiny model's expected answers (None: negative control, recorded only)
CODEC_ACCURACY = {
    "int8-g32": 0.99,
    "int8-g16-kpe-int8": 0.99,
    "int8-token": 0.99,
    "int4-asym-g32": None,
    "int4-sym-g32": None,
    "int2-asym-g32": None,
    "fp8-e4m3-flashmla": None,
}


@pytest.mark.mla_section("golden-codec")
@pytest.mark.parametrize("kv_codec", list(CODEC_ACCURACY))
def test_golden_generation_per_codec(mla_backend, kv_codec, snapshot, request, mla_device, mla_figures):
    """Generation under each quantized latent cache: accuracy measured and the tokens pinned per codec; the backend
    is asked whether it takes the codec before the model loads (a backend that declines it skips at no cost)."""
    golden.check_golden_generation_per_codec(mla_backend, kv_codec, CODEC_ACCURACY[kv_codec],
                                             lambda: request.getfixturevalue("tiny_model"), request, snapshot,
                                             mla_device, mla_figures)
