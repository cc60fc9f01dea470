"""Checks of greedy generation with the embedded tiny model (every layer's attention through the backend), for
suites/test_generation_golden.py: the answers' accuracy, and the tokens against the golden of the run's numerics
class (syrupy snapshots under golden/generation/, shared by all backends; mla_conformance.generation.golden).
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from mla_conformance.checks.layer.driver import require_support
from mla_conformance.errors import MLAInputError
from mla_conformance.generation.generate import DEFAULT_MODEL, DSA_MODEL, load_model, numerics_class, run_generation
from mla_conformance.generation.golden import golden_extension, golden_path, golden_payload, read_golden
from mla_conformance.model.config import MLAConfig

#: the dense tiny model's prompt sets
PROMPT_SETS = ["tiny-short", "tiny-long"]
#: golden name -> the DSA tiny model's prompt set it generates (its goldens are named apart from the dense model's)
DSA_GOLDENS = {"tiny-dsa-short": "tiny-short", "tiny-dsa-long": "tiny-long"}
#: the golden of every prompt set in one run (the per-codec goldens)
ALL_SETS = "+".join(PROMPT_SETS)


def model_dtype(device: str) -> torch.dtype:
    """The tiny model's dtype on a device: bfloat16 on CUDA, float32 elsewhere."""
    return torch.bfloat16 if device.startswith("cuda") else torch.float32


def load_tiny_model(device: str, dsa: bool = False):
    """The tiny model (``dsa``: its DeepSeek Sparse Attention variant) in :func:`model_dtype` on ``device``."""
    return load_model(DSA_MODEL if dsa else DEFAULT_MODEL, model_dtype(device), device)


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


def check_golden_generation(backend, request, snapshot, *, prompt_set: str, device, figures: dict,
                            model: Callable[[bool], Any]) -> None:
    """The dense tiny model on ``prompt_set`` (tiny-short / tiny-long), or its DSA variant on the same prompts (a
    name of :data:`DSA_GOLDENS`): accuracy >= 0.99 and the golden tokens. The config is read before the model
    loads (``model(dsa)`` returns it), so a backend that declines it skips at no cost."""
    __tracebackhide__ = True
    dtype = model_dtype(device)
    dsa = prompt_set in DSA_GOLDENS
    model_dir, prompts = (DSA_MODEL, DSA_GOLDENS[prompt_set]) if dsa else (DEFAULT_MODEL, prompt_set)
    require_support(backend, MLAConfig.from_hf(model_dir), dtype=dtype, device=device)
    result = run_generation(model_dir, backend, prompt_sets=[prompts], dtype=dtype, device=device, model=model(dsa))
    figures.update(accuracy=result["accuracy"], cache_active_nbytes=result["cache_active_nbytes"])
    assert result["accuracy"] >= 0.99, f"{backend.name}: accuracy {result['accuracy']:.4f} on {prompt_set}"
    check_against_golden(request, snapshot, result, prompts, "none", device, dtype, golden_name=prompt_set)


def check_golden_generation_per_codec(backend, kv_codec: str, floor: float | None, tiny_model, request, snapshot,
                                      device, figures: dict) -> None:
    """Generation under a quantized latent cache: accuracy at least ``floor`` (None: a negative control, recorded
    only) and the tokens pinned per codec. ``tiny_model``: the model, or a callable returning it, called only once
    the backend has said it takes the codec (the config is read from the model's directory first: a backend that
    declines the codec skips without the model, or transformers, loaded)."""
    __tracebackhide__ = True
    dtype = model_dtype(device)
    require_support(backend, MLAConfig.from_hf(DEFAULT_MODEL), dtype=dtype, device=device, kv_codec=kv_codec)
    model = tiny_model if isinstance(tiny_model, torch.nn.Module) else tiny_model()
    result = run_generation(DEFAULT_MODEL, backend, kv_codec=kv_codec, prompt_sets=PROMPT_SETS, dtype=dtype,
                            device=device, model=model)
    figures.update(kv_codec=kv_codec, accuracy=result["accuracy"], cache_active_nbytes=result["cache_active_nbytes"])
    if floor is not None:
        assert result["accuracy"] >= floor, f"{backend.name} kv_codec {kv_codec}: accuracy {result['accuracy']:.4f}"
    check_against_golden(request, snapshot, result, ALL_SETS, kv_codec, device, dtype)
