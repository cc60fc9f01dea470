"""Greedy generation with a DeepSeek-V4 model whose every layer's attention runs through a backend.

The V4 counterpart of :mod:`mla_conformance.generation.generate`. Everything but attention is transformers' own
DeepseekV4 modules, loaded from a real ``deepseek_v4`` checkpoint directory by
``DeepseekV4ForCausalLM.from_pretrained``: the embedding, the manifold-constrained hyper-connections (``hc_mult``
residual streams, ``attn_hc`` / ``ffn_hc``, ``hc_head``), the norms, the MoE blocks and the LM head.
:func:`load_v4_model` replaces each decoder layer's ``self_attn`` with :class:`BackendAttention`, a thin module
holding that layer's :class:`~mla_conformance.model.v4_config.V4Weights` (the tensors transformers loaded, under
their HF names); the decoder layer calls it as it calls ``DeepseekV4Attention`` (the collapsed stream after
``input_layernorm`` in, the attention output out) and it hands the call to ``backend.attend`` over the backend's
own cache, one per layer. Prompts are batched with right padding (``lengths``), so generation also exercises the
backend's varlen path, its compressor state across calls and the entries that close during decode.

The embedded model (``fixtures/models/tiny-v4``, trained by ``fixtures/train_tiny_v4.py``; its README.md has the
command and the measured accuracies) answers recalls whose key-value pairs lie beyond what the sliding windows of
its three layers reach together, so only compressed entries carry the answer (measured: with the CSA layer's
entries hidden the recalled values fall to chance; hiding the HCA layer's changes none).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mla_conformance.contract.calls import call_backend, check_output
from mla_conformance.contract.layer import support_reason
from mla_conformance.errors import CheckpointError, MLAInputError
from mla_conformance.generation.generate import (Generation, check_loading_info, episodes, generation_result,
                                                 load_prompts, new_tokens)
from mla_conformance.model.checkpoint import SafetensorsCheckpoint
from mla_conformance.model.v4_config import V4Config, V4Weights, expected_shapes
from mla_conformance.resources import fixtures_dir

#: the embedded tiny DeepSeek-V4 model and its prompt sets (package data; the checkout's fixtures/ in an editable
#: install)
V4_MODEL = fixtures_dir() / "models" / "tiny-v4"
V4_PROMPTS = fixtures_dir() / "prompts-v4.json"


class BackendAttention(nn.Module):
    """Stands in for one decoder layer's ``DeepseekV4Attention``: holds the layer's weights and returns
    ``attend(weights, hidden_states)`` (the callable the generation step passes through the decoder layer's
    keyword arguments) with no attention weights, as ``DeepseekV4Attention.forward`` returns
    ``(output, attn_weights)``."""

    def __init__(self, weights: V4Weights):
        super().__init__()
        self.weights = weights

    def forward(self, hidden_states: torch.Tensor, attend=None, **kwargs):
        if attend is None:
            raise MLAInputError(f"{self.weights.source}: this model's attention runs through a backend; call it via "
                                "mla_conformance.generation.v4.greedy_generate")
        return attend(self.weights, hidden_states), None

    def extra_repr(self) -> str:
        return self.weights.config.describe()


def v4_config_of(model) -> V4Config:
    return V4Config.from_hf(model.config.to_dict())


def attach_backend_attention(model) -> list[V4Weights]:
    """Replace each layer's ``self_attn`` with :class:`BackendAttention` (once) and return the layers' weights:
    the attention module's own parameters under their HF names (``model.layers.{L}.self_attn.*``)."""
    config = v4_config_of(model)
    out = []
    for i, layer in enumerate(model.model.layers):
        if not isinstance(layer.self_attn, BackendAttention):
            cfg = config.for_layer(i)
            params = dict(layer.self_attn.named_parameters())
            missing = [n for n in expected_shapes(cfg) if n not in params]
            if missing:
                raise CheckpointError(f"layer {i}: the attention module lacks {missing} for {cfg.describe()}")
            tensors = {n: params[n].detach() for n in expected_shapes(cfg)}
            layer.self_attn = BackendAttention(V4Weights(cfg, tensors, source=f"model.layers.{i}.self_attn"))
        out.append(layer.self_attn.weights)
    return out


def load_v4_model(directory: str | Path = V4_MODEL, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """DeepseekV4ForCausalLM from a local directory (offline), every layer's attention a :class:`BackendAttention`."""
    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise CheckpointError(f"{directory}: not a model directory (no config.json)")
    SafetensorsCheckpoint(directory)  # validates every safetensors header and size, naming a bad file
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from transformers import DeepseekV4ForCausalLM
    except ImportError:
        raise CheckpointError(f"{directory}: this transformers has no DeepseekV4ForCausalLM (DeepSeek-V4 needs "
                              "transformers >= 5.x with models/deepseek_v4)") from None
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        model, info = DeepseekV4ForCausalLM.from_pretrained(str(directory), dtype=dtype, output_loading_info=True)
    except Exception as exc:
        raise CheckpointError(f"{directory}: transformers could not load the model: {type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else ''}") from None
    check_loading_info(directory, info)
    model = model.to(device).eval()
    attach_backend_attention(model)
    return model


def unsupported_layers(backend, config: V4Config, *, dtype, device, kv_codec="none") -> str | None:
    """The first layer the backend does not run, as support_reason's sentence (None: it runs every layer)."""
    for layer in range(config.num_hidden_layers):
        reason = support_reason(backend, config.for_layer(layer), dtype=dtype, device=device, kv_codec=kv_codec)
        if reason:
            return reason
    return None


@torch.no_grad()
def greedy_generate(model, backend, prompts: list[list[int]], max_new_tokens: list[int] | int, *,
                    kv_codec: str = "none", device: str = "cpu") -> Generation:
    """Greedy decoding of a batch of right-padded prompts; every layer's attention goes through ``backend``."""
    weights = attach_backend_attention(model)
    config = weights[0].config
    dtype = model.model.embed_tokens.weight.dtype
    reason = unsupported_layers(backend, config, dtype=dtype, device=device, kv_codec=kv_codec)
    if reason:
        raise MLAInputError(f"backend {backend.name} cannot run this model: {reason}")
    B = len(prompts)
    new = [max_new_tokens] * B if isinstance(max_new_tokens, int) else list(max_new_tokens)
    lens = torch.tensor([len(p) for p in prompts])
    capacity = int((lens + torch.tensor(new)).max())
    caches = [call_backend(backend, "new_cache", w.config, batch_size=B, capacity=capacity, dtype=dtype,
                           device=device, kv_codec=kv_codec) for w in weights]
    ids = torch.zeros(B, int(lens.max()), dtype=torch.int64)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = torch.tensor(p)
    inner = model.model
    hc = model.config.hc_mult
    generated: list[list[int]] = [[] for _ in range(B)]
    step_ids, step_lens = ids.to(device), lens.to(device)
    for step in range(max(new)):
        if step > 0:
            step_ids = torch.tensor([[g[-1] if g else 0] for g in generated], device=device)
            step_lens = torch.tensor([1 if len(generated[b]) < new[b] else 0 for b in range(B)], device=device)
        positions = caches[0].seq_lens[:, None].to(device) + torch.arange(step_ids.shape[1], device=device)[None, :]
        # DeepseekV4Model.forward: the embedding copied onto hc_mult streams, the layers, hc_head, the final norm
        h = inner.embed_tokens(step_ids).unsqueeze(2).expand(-1, -1, hc, -1).contiguous()
        for layer, cache in zip(inner.layers, caches):
            def attend(w, x, cache=cache):
                out = call_backend(backend, "attend", w, x, positions, cache, step_lens)
                return check_output(backend, out, x, step_lens, f"generation step {step}, layer {w.source}",
                                    positions)
            h = layer(h, input_ids=step_ids, attend=attend)
        logits = model.lm_head(inner.norm(inner.hc_head(h)))
        last = (step_lens - 1).clamp(min=0)
        next_tok = logits[torch.arange(B, device=device), last].argmax(-1)
        for b in range(B):
            if int(step_lens[b]) > 0 and len(generated[b]) < new[b]:
                generated[b].append(int(next_tok[b]))
    active = sum(int(c.active_nbytes()) for c in caches)
    allocated = sum(int(c.allocated_nbytes()) for c in caches)
    return Generation(generated, len(caches), active, allocated)


def run_generation(model_dir=V4_MODEL, backend=None, *, kv_codec="none", prompt_sets=None, max_new_tokens=None,
                   dtype=torch.float32, device="cpu", prompts_file=V4_PROMPTS, model=None) -> dict[str, Any]:
    """The V4 model on the named prompt sets of ``prompts_file``: the same result dict as
    :func:`mla_conformance.generation.generate.run_generation` (what golden_payload reads)."""
    if backend is None:
        raise MLAInputError("run_generation needs a backend")
    model = model if model is not None else load_v4_model(model_dir, dtype, device)
    eps = episodes(load_prompts(prompts_file), prompt_sets)
    new = [max_new_tokens or new_tokens(ep) for ep in eps]
    gen = greedy_generate(model, backend, [ep["token_ids"] for ep in eps], new, kv_codec=kv_codec, device=device)
    return generation_result(model_dir, backend, eps, gen, kv_codec=kv_codec, dtype=dtype, device=device)
