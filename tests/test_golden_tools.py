"""The tool's own tests of suites/test_generation_golden.py's machinery (no backend under test): moved out of the
conformance suite, which keeps only tests that judge a backend."""

from pathlib import Path

import pytest
import torch

from mla_conformance.checks.layer.golden import PROMPT_SETS, load_tiny_model, model_dtype
from mla_conformance.generation.generate import DEFAULT_MODEL, numerics_class, run_generation
from mla_conformance.generation.golden import golden_path, read_golden


@pytest.fixture(scope="module")
def tiny_model(mla_device):
    return load_tiny_model(mla_device)


@pytest.mark.parametrize("prompt_set", PROMPT_SETS)
def test_transformers_generate_matches_golden(prompt_set, tiny_model, request, mla_device):
    """Unmodified transformers (model.generate with its own cache) produces the golden tokens too."""
    dtype = model_dtype(mla_device)
    path = golden_path(numerics_class(mla_device, dtype), prompt_set, "none")
    stored = read_golden(path)
    if stored is None:
        pytest.skip(f"no golden at {path}")
    from mla_conformance.generation.generate import episodes, load_prompts

    eps = {ep["id"]: ep for ep in episodes(load_prompts(), [prompt_set])}
    for out in stored["outputs"]:
        ids = torch.tensor([eps[out["id"]]["token_ids"]], device=mla_device)
        with torch.no_grad():
            gen = tiny_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=len(out["tokens"]),
                                      do_sample=False, pad_token_id=0)
        assert gen[0, ids.shape[1]:].tolist() == out["tokens"], out["id"]


def test_int2_negative_control_collapses(tiny_model, mla_device, mla_figures):
    """INT2 is the negative control: it must measurably hurt, or the accuracy check has no teeth."""
    from mla_conformance.specs import get_backend

    dtype = model_dtype(mla_device)
    acc = {}
    for codec in ("int8-g32", "int2-asym-g32"):
        acc[codec] = run_generation(DEFAULT_MODEL, get_backend("reference-absorbed"), kv_codec=codec,
                                    prompt_sets=PROMPT_SETS, dtype=dtype, device=mla_device,
                                    model=tiny_model)["accuracy"]
    mla_figures.update(acc)
    print(f"measured accuracy: int8-g32 {acc['int8-g32']:.4f}, int2-asym-g32 {acc['int2-asym-g32']:.4f}")
    assert acc["int2-asym-g32"] < acc["int8-g32"] and acc["int2-asym-g32"] < 0.99, acc


def test_model_missing_a_tensor_is_refused(tmp_path):
    """transformers would initialise a missing tensor at random and generate garbage: load_model names it."""
    import shutil

    from safetensors.torch import load_file, save_file

    from mla_conformance.errors import CheckpointError
    from mla_conformance.generation.generate import DEFAULT_MODEL, load_model

    for f in Path(DEFAULT_MODEL).iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, tmp_path / f.name)
    tensors = load_file(str(Path(DEFAULT_MODEL) / "model.safetensors"))
    dropped = "model.layers.1.self_attn.kv_b_proj.weight"
    assert dropped in tensors
    del tensors[dropped]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"lack 1 tensor\(s\).*layers\.1\.self_attn\.kv_b_proj\.weight"):
        load_model(tmp_path)
