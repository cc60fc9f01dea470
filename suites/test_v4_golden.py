"""Greedy generations of the embedded tiny DeepSeek-V4 model, with every layer's attention through each backend.

The model (fixtures/models/tiny-v4, trained by fixtures/train_tiny_v4.py; its README.md has the command and the
measured accuracies) has one layer of each V4 attention type: window only, CSA (ratio 4, the lightning indexer
keeping the top-2 entries) and HCA (ratio 8). It answers recalls ``k1 v1 .. kn vn fillers RECALL k -> v <eos>``;
in the ``tiny-v4-far`` prompts the queried pair lies further back than the three layers' windows reach together,
so the answer can only come through the compressed entries (the README measures the accuracy with them removed).
Everything but attention is transformers' DeepseekV4 modules (mHC streams, MoE, norms, head); attention is the
backend's ``attend`` over its own cache per layer, right-padded batches, then one-token decode steps
(mla_conformance.generation.v4).

Goldens are syrupy snapshots under golden/generation/<numerics class>/tiny-v4-*.none.json, shared by all backends
(mla_conformance.generation.golden): every backend must produce the same tokens. A backend that does not declare
DeepSeek-V4 attention (``deepseek_v4 = True``) skips with the declaration's sentence, before the model loads.
"""

import pytest

from mla_conformance.checks.layer.golden import check_against_golden, model_dtype
from mla_conformance.generation import v4
from mla_conformance.model.v4_config import V4Config

#: the tiny V4 model's prompt sets (fixtures/prompts-v4.json), each with a golden of its own name
V4_SETS = ["tiny-v4-far", "tiny-v4-near"]


@pytest.fixture(scope="module")
def tiny_v4_model(mla_device):
    try:
        import transformers.models.deepseek_v4  # noqa: F401  (the model's non-attention modules are transformers')
    except ImportError:
        import transformers
        pytest.skip(f"the tiny V4 model runs on transformers' DeepseekV4 modules, which transformers "
                    f"{transformers.__version__} does not have (it needs a release with models/deepseek_v4)")
    return v4.load_v4_model(v4.V4_MODEL, model_dtype(mla_device), mla_device)


@pytest.mark.mla_section("golden")
@pytest.mark.parametrize("prompt_set", V4_SETS)
def test_v4_golden_generation(mla_backend, prompt_set, snapshot, request, mla_device, mla_figures):
    """The tiny V4 model on one prompt set: accuracy >= 0.99 and the golden tokens. Every layer's config is
    offered to the backend (support_reason) before the model loads, so a backend that declines skips at no cost."""
    dtype = model_dtype(mla_device)
    reason = v4.unsupported_layers(mla_backend, V4Config.from_hf(v4.V4_MODEL), dtype=dtype, device=mla_device)
    if reason:
        pytest.skip(reason)
    model = request.getfixturevalue("tiny_v4_model")
    result = v4.run_generation(v4.V4_MODEL, mla_backend, prompt_sets=[prompt_set], dtype=dtype, device=mla_device,
                               model=model)
    mla_figures.update(accuracy=result["accuracy"], cache_active_nbytes=result["cache_active_nbytes"])
    misses = [f"{o['id']}: expected {o['expected']}, got {o['tokens']}" for o in result["outputs"]
              if o["tokens"] != o["expected"]]
    assert result["accuracy"] >= 0.99, (f"{mla_backend.name}: accuracy {result['accuracy']:.4f} on {prompt_set}:\n"
                                        + "\n".join(misses))
    check_against_golden(request, snapshot, result, prompt_set, "none", mla_device, dtype)
