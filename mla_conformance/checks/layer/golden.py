"""Checks of greedy generation with the embedded tiny model (every layer's attention through the backend), for
suites/test_generation_golden.py: the answers' accuracy, and the tokens against the golden of the run's numerics
class (syrupy snapshots under golden/generation/, shared by all backends; mla_conformance.generation.golden).

Which model a golden test generates with follows what the backend takes (:func:`golden_model`): the embedded
tiny model (``tiny-mla``, latent 80 / 64) wherever the backend takes its config -- every backend that did keeps
its verdicts -- else the same tasks at DeepSeek's own latent dims (``tiny-mla-576``: kv_lora_rank 512 +
qk_rope_head_dim 64, what FlashMLA's, vLLM's CPU and TRT-LLM's kernels take) where the backend takes that: an op
that declares only (576, 512) runs its goldens on it (golden names ``tiny576-*``) instead of skipping.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from mla_conformance.checks.layer.driver import require_support
from mla_conformance.contract.layer import support_reason
from mla_conformance.errors import MLAInputError
from mla_conformance.generation.generate import (DEFAULT_MODEL, DEFAULT_PROMPTS, DSA_MODEL, load_model,
                                                 numerics_class, run_generation)
from mla_conformance.generation.golden import golden_extension, golden_path, golden_payload, read_golden
from mla_conformance.model.config import MLAConfig
from mla_conformance.resources import fixtures_dir

#: the dense tiny model's prompt sets
PROMPT_SETS = ["tiny-short", "tiny-long"]
#: golden name -> the DSA tiny model's prompt set it generates (its goldens are named apart from the dense model's)
DSA_GOLDENS = {"tiny-dsa-short": "tiny-short", "tiny-dsa-long": "tiny-long"}
#: the golden of every prompt set in one run (the per-codec goldens)
ALL_SETS = "+".join(PROMPT_SETS)


@dataclasses.dataclass(frozen=True)
class GoldenModel:
    """A dense tiny model the golden tests generate with: its directory, its prompts file (prompt sets
    :data:`PROMPT_SETS`) and the prefix its goldens are named with in place of ``tiny`` (``tiny-short`` ->
    ``tiny576-short``)."""

    name: str
    directory: Path
    prompts: Path
    golden_prefix: str

    def golden_name(self, prompt_set: str) -> str:
        """The golden's name for a prompt set (or ``+``-joined sets) of this model."""
        return "+".join(self.golden_prefix + s.removeprefix("tiny") for s in prompt_set.split("+"))


#: the embedded tiny model (kv_lora_rank 64 + qk_rope_head_dim 16: latent 80 / 64)
TINY = GoldenModel("tiny-mla", DEFAULT_MODEL, DEFAULT_PROMPTS, "tiny")
#: the same tasks at DeepSeek's latent dims (kv_lora_rank 512 + qk_rope_head_dim 64: 576 / 512), for a backend that
#: takes only those (fixtures/train_tiny.py --variant tiny-mla-576)
TINY_576 = GoldenModel("tiny-mla-576", fixtures_dir() / "models" / "tiny-mla-576", fixtures_dir() / "prompts-576.json",
                       "tiny576")
#: in the order a golden test tries them
DENSE_MODELS = (TINY, TINY_576)


def golden_model(backend, *, dtype, device, kv_codec="none") -> GoldenModel:
    """The first of :data:`DENSE_MODELS` whose config the backend takes (read from config.json: nothing loads). A
    backend that takes none skips with its sentence for tiny-mla, followed by its sentence for each other model
    where that one differs (the same refusal, e.g. of a kv_codec, is said once)."""
    __tracebackhide__ = True
    reasons: list[str] = []
    for m in DENSE_MODELS:
        config = MLAConfig.from_hf(m.directory)
        reason = support_reason(backend, config, dtype=dtype, device=device, kv_codec=kv_codec)
        if reason is None:
            return m
        if not reasons:
            reasons.append(reason)
        elif reason != reasons[0]:  # its latent's head dims (d_qk / d_v) name it
            reasons.append(f"{m.name} ({config.latent_dim}/{config.kv_lora_rank}): {reason}")
    pytest.skip("; ".join(reasons))


def model_dtype(device: str) -> torch.dtype:
    """The tiny model's dtype on a device: bfloat16 on CUDA, float32 elsewhere."""
    return torch.bfloat16 if device.startswith("cuda") else torch.float32


def load_tiny_model(device: str, dsa: bool = False, model: GoldenModel = TINY):
    """The tiny model (``dsa``: its DeepSeek Sparse Attention variant; ``model``: another of
    :data:`DENSE_MODELS`) in :func:`model_dtype` on ``device``."""
    return load_model(DSA_MODEL if dsa else model.directory, model_dtype(device), device)


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
                            model: Callable[[str], Any]) -> None:
    """The dense tiny model on ``prompt_set`` (tiny-short / tiny-long; at DeepSeek's dims for a backend that takes
    only those: :func:`golden_model`), or its DSA variant on the same prompts (a name of :data:`DSA_GOLDENS`):
    accuracy >= 0.99 and the golden tokens. The config is read before the model loads (``model(name)`` returns
    the model of that name: tiny-mla, tiny-mla-576 or tiny-mla-dsa), so a backend that declines it skips at no
    cost."""
    __tracebackhide__ = True
    dtype = model_dtype(device)
    if prompt_set in DSA_GOLDENS:
        name, model_dir, prompts_file, prompts, golden_name = (DSA_MODEL.name, DSA_MODEL, DEFAULT_PROMPTS,
                                                               DSA_GOLDENS[prompt_set], prompt_set)
        require_support(backend, MLAConfig.from_hf(model_dir), dtype=dtype, device=device)
    else:
        m = golden_model(backend, dtype=dtype, device=device)
        name, model_dir, prompts_file, prompts, golden_name = (m.name, m.directory, m.prompts, prompt_set,
                                                               m.golden_name(prompt_set))
    result = run_generation(model_dir, backend, prompt_sets=[prompts], dtype=dtype, device=device,
                            prompts_file=prompts_file, model=model(name))
    figures.update(golden_model=name, accuracy=result["accuracy"], cache_active_nbytes=result["cache_active_nbytes"])
    assert result["accuracy"] >= 0.99, (
        f"{backend.name} {name} {prompt_set}: accuracy {result['accuracy']:.4f} vs bound >= 0.99 (the fraction of the "
        "pinned answer tokens greedy generation produced)")
    check_against_golden(request, snapshot, result, prompts, "none", device, dtype, golden_name=golden_name)


def check_golden_generation_per_codec(backend, kv_codec: str, floor: float | None, tiny_model, request, snapshot,
                                      device, figures: dict) -> None:
    """Generation under a quantized latent cache: accuracy at least ``floor`` (None: a negative control, recorded
    only) and the tokens pinned per codec, with the model :func:`golden_model` picks. ``tiny_model``: the model, or
    a callable returning the model of a name (tiny-mla, tiny-mla-576), called only once the backend has said it
    takes the codec (the config is read from the model's directory first: a backend that declines the codec skips
    without the model, or transformers, loaded)."""
    __tracebackhide__ = True
    dtype = model_dtype(device)
    m = golden_model(backend, dtype=dtype, device=device, kv_codec=kv_codec)
    model = tiny_model if isinstance(tiny_model, torch.nn.Module) else tiny_model(m.name)
    result = run_generation(m.directory, backend, kv_codec=kv_codec, prompt_sets=PROMPT_SETS, dtype=dtype,
                            device=device, prompts_file=m.prompts, model=model)
    figures.update(golden_model=m.name, kv_codec=kv_codec, accuracy=result["accuracy"],
                   cache_active_nbytes=result["cache_active_nbytes"])
    if floor is not None:
        assert result["accuracy"] >= floor, (f"{backend.name} {m.name} kv_codec {kv_codec}: accuracy "
                                             f"{result['accuracy']:.4f} vs bound >= {floor} (the codec's floor)")
    check_against_golden(request, snapshot, result, ALL_SETS, kv_codec, device, dtype,
                         golden_name=m.golden_name(ALL_SETS))
