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

A backend that does not take the tiny model's latent (kv_lora_rank 64 + qk_rope_head_dim 16: 80 / 64) but takes
DeepSeek's own (512 + 64: 576 / 512, e.g. ``--mla-backend op:vllm-cpu``, or any op declaring only those head dims)
runs the dense goldens, per codec included, on fixtures/models/tiny-mla-576 instead (the same tasks, trained by
fixtures/train_tiny.py --variant tiny-mla-576; goldens ``tiny576-*``); every backend that takes the tiny model
runs it as before (mla_conformance.checks.layer.golden.golden_model).
"""

import pytest

from mla_conformance.checks.layer import golden


@pytest.fixture(scope="module")
def tiny_model(mla_device):
    return golden.load_tiny_model(mla_device)


@pytest.fixture(scope="module")
def tiny_dsa_model(mla_device):
    return golden.load_tiny_model(mla_device, dsa=True)


@pytest.fixture(scope="module")
def tiny_576_model(mla_device):
    return golden.load_tiny_model(mla_device, model=golden.TINY_576)


#: model name -> its module-scoped fixture (loaded only by a test whose backend takes it)
MODEL_FIXTURES = {golden.TINY.name: "tiny_model", golden.TINY_576.name: "tiny_576_model",
                  "tiny-mla-dsa": "tiny_dsa_model"}


@pytest.mark.mla_section("golden")
@pytest.mark.parametrize("prompt_set", [*golden.PROMPT_SETS, *golden.DSA_GOLDENS])
def test_golden_generation(mla_backend, prompt_set, snapshot, request, mla_device, mla_figures):
    """The dense tiny model on tiny-short / tiny-long (tiny-mla-576 for a backend that takes only DeepSeek's
    dims); its DSA variant on the same prompts (tiny-dsa-*), each backend that accepts the model's config; the
    config is read before the model loads, so a backend that declines it skips at no cost."""
    golden.check_golden_generation(mla_backend, request, snapshot, prompt_set=prompt_set, device=mla_device,
                                   figures=mla_figures,
                                   model=lambda name: request.getfixturevalue(MODEL_FIXTURES[name]))


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
                                             lambda name: request.getfixturevalue(MODEL_FIXTURES[name]), request,
                                             snapshot, mla_device, mla_figures)
