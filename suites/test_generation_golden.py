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
import torch

from mla_conformance import MLAConfig, checks
from mla_conformance.errors import MLAInputError
from mla_conformance.generation.generate import DEFAULT_MODEL, DSA_MODEL, load_model, numerics_class, run_generation
from mla_conformance.generation.golden import golden_extension, golden_path, golden_payload, read_golden

PROMPT_SETS = ["tiny-short", "tiny-long"]
#: golden name -> the DSA tiny model's prompt set it generates (its goldens are named apart from the dense model's)
DSA_GOLDENS = {"tiny-dsa-short": "tiny-short", "tiny-dsa-long": "tiny-long"}


def model_dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if device.startswith("cuda") else torch.float32


@pytest.fixture(scope="module")
def tiny_model(mla_device):
    return load_model(DEFAULT_MODEL, model_dtype(mla_device), mla_device)


@pytest.fixture(scope="module")
def tiny_dsa_model(mla_device):
    return load_model(DSA_MODEL, model_dtype(mla_device), mla_device)


def check_against_golden(request, snapshot, result, prompt_set, kv_codec, device, dtype, golden_name=None):
    """``golden_name``: the golden's name where it is not the prompt set's (another model's goldens)."""
    __tracebackhide__ = True
    cls = numerics_class(device, dtype)
    golden_name = golden_name or prompt_set
    path = golden_path(cls, golden_name, kv_codec)
    payload = golden_payload(result, cls, prompt_set)
    if not request.config.option.update_snapshots:
        try:
            stored = read_golden(path)
        except MLAInputError as exc:
            pytest.fail(str(exc), pytrace=False)
        if stored is None:
            pytest.skip(f"no golden for numerics class {cls} ({path.relative_to(path.parents[3])}); create it with "
                        f"`pytest {request.node.nodeid.split('::')[0]} --snapshot-update` and review the diff")
    assert payload == snapshot(extension_class=golden_extension(cls, golden_name, kv_codec))


@pytest.mark.mla_section("golden")
@pytest.mark.parametrize("prompt_set", [*PROMPT_SETS, *DSA_GOLDENS])
def test_golden_generation(mla_backend, prompt_set, snapshot, request, mla_device, mla_figures):
    """The dense tiny model on tiny-short / tiny-long; its DSA variant on the same prompts (tiny-dsa-*), each
    backend that accepts the model's config; the config is read before the model loads, so a backend that
    declines it skips at no cost."""
    dtype = model_dtype(mla_device)
    dsa = prompt_set in DSA_GOLDENS
    model_dir, prompts = (DSA_MODEL, DSA_GOLDENS[prompt_set]) if dsa else (DEFAULT_MODEL, prompt_set)
    checks.require_support(mla_backend, MLAConfig.from_hf(model_dir), dtype=dtype, device=mla_device)
    model = request.getfixturevalue("tiny_dsa_model" if dsa else "tiny_model")
    result = run_generation(model_dir, mla_backend, prompt_sets=[prompts], dtype=dtype, device=mla_device, model=model)
    mla_figures.update(accuracy=result["accuracy"], cache_active_nbytes=result["cache_active_nbytes"])
    assert result["accuracy"] >= 0.99, f"{mla_backend.name}: accuracy {result['accuracy']:.4f} on {prompt_set}"
    check_against_golden(request, snapshot, result, prompts, "none", mla_device, dtype, golden_name=prompt_set)


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
ALL_SETS = "+".join(PROMPT_SETS)


@pytest.mark.mla_section("golden-codec")
@pytest.mark.parametrize("kv_codec", list(CODEC_ACCURACY))
def test_golden_generation_per_codec(mla_backend, kv_codec, tiny_model, snapshot, request, mla_device, mla_figures):
    """Generation under each quantized latent cache: accuracy measured and the tokens pinned per codec."""
    dtype = model_dtype(mla_device)
    checks.require_support(mla_backend, MLAConfig.from_hf(tiny_model.config.to_dict()), dtype=dtype,
                           device=mla_device, kv_codec=kv_codec)
    result = run_generation(DEFAULT_MODEL, mla_backend, kv_codec=kv_codec, prompt_sets=PROMPT_SETS, dtype=dtype,
                            device=mla_device, model=tiny_model)
    mla_figures.update(kv_codec=kv_codec, accuracy=result["accuracy"], cache_active_nbytes=result["cache_active_nbytes"])
    floor = CODEC_ACCURACY[kv_codec]
    if floor is not None:
        assert result["accuracy"] >= floor, f"{mla_backend.name} kv_codec {kv_codec}: accuracy {result['accuracy']:.4f}"
    check_against_golden(request, snapshot, result, ALL_SETS, kv_codec, mla_device, dtype)
