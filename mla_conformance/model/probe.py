"""Seed 000's experiment on a real checkpoint, as a reusable probe.

The tokenizer, the embedding, decoder layer 0 (transformers' own DeepseekV2DecoderLayer) and layer 1's
input RMSNorm turn the pinned prompt into the real layer-1 attention input; layer 1's attention weights
come from the same checkpoint. Only those tensors are read (for DeepSeek-V2-Lite the first shard holds
them all). Each backend then runs a prefill of all but the last token and a 1-token decode.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from mla_conformance.model.checkpoint import SafetensorsCheckpoint
from mla_conformance.model.config import MLAConfig
from mla_conformance.errors import CheckpointError
from mla_conformance.model.weights import MLAWeights


def restore_yarn_softmax_scale(attn, softmax_scale: float) -> None:
    """For input preparation only (:func:`layer1_input`, the reference anchor's test), never for the backend under
    test: give a DeepseekV2Attention YaRN's softmax factor mscale(factor, mscale_all_dim)^2 where it lacks it.

    Some transformers releases (4.57 among them) set ``scaling = qk_head_dim ** -0.5`` and drop that factor,
    which DeepSeek's own code and later transformers apply. Detected from the module, never the version.
    """
    plain = attn.qk_head_dim ** -0.5
    if attn.scaling == plain and not math.isclose(softmax_scale, plain, rel_tol=1e-12):
        attn.scaling = softmax_scale


def _hf_config(directory: Path):
    from transformers import AutoConfig

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        return AutoConfig.from_pretrained(str(directory))
    except Exception as exc:
        raise CheckpointError(f"{directory / 'config.json'}: transformers cannot read it ({exc})") from None


def tokenize(directory: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(directory))
    except Exception as exc:
        raise CheckpointError(f"{directory}: no usable tokenizer ({type(exc).__name__}: {exc})") from None
    return tok(text)["input_ids"]


@torch.no_grad()
def layer1_input(directory: str | Path, token_ids: list[int]) -> torch.Tensor:
    """The real attention input of layer 1, [1, T, hidden], float32."""
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as modeling

    directory = Path(directory)
    cfg = _hf_config(directory)
    cfg._attn_implementation = "eager"
    if getattr(cfg, "first_k_dense_replace", 0) < 1:
        raise CheckpointError(f"{directory}: layer 0 is an MoE layer (first_k_dense_replace=0); the probe runs "
                              "a dense layer 0 only")
    ckpt = SafetensorsCheckpoint(directory)
    prefix = "model.layers.0."
    names = [n for n in ckpt.names() if n.startswith(prefix)]
    if not names:
        raise CheckpointError(f"{directory}: no tensors named {prefix}* in the checkpoint")
    wanted = ["model.embed_tokens.weight", "model.layers.1.input_layernorm.weight", *names]
    t = {k: v.to(torch.float32) for k, v in ckpt.read(wanted).items()}
    with torch.device("meta"):
        layer0 = modeling.DeepseekV2DecoderLayer(cfg, layer_idx=0)
    state = {k.removeprefix(prefix): v for k, v in t.items() if k.startswith(prefix)}
    expected = dict(layer0.state_dict())
    for k, v in state.items():
        if k in expected and tuple(expected[k].shape) != tuple(v.shape):
            raise CheckpointError(f"{ckpt.file_of(prefix + k)}: tensor {prefix + k!r} has shape {tuple(v.shape)}, "
                                  f"expected {tuple(expected[k].shape)}")
    missing, unexpected = layer0.load_state_dict(state, strict=False, assign=True)
    if missing:
        raise CheckpointError(f"{directory}: layer 0 tensors missing from the checkpoint: "
                              f"{[prefix + k for k in missing]}")
    layer0 = layer0.to(torch.float32).eval()
    restore_yarn_softmax_scale(layer0.self_attn, MLAConfig.from_hf(cfg.to_dict()).softmax_scale)
    rotary = modeling.DeepseekV2RotaryEmbedding(cfg)
    ids = torch.tensor([token_ids])
    emb = t["model.embed_tokens.weight"]
    if int(ids.max()) >= emb.shape[0]:
        raise CheckpointError(f"{ckpt.file_of('model.embed_tokens.weight')}: token id {int(ids.max())} is beyond "
                              f"the embedding's {emb.shape[0]} rows")
    h = torch.nn.functional.embedding(ids, emb)
    T = ids.shape[1]
    mask = torch.full((T, T), torch.finfo(torch.float32).min).triu(1)[None, None]
    pos = torch.arange(T)[None]
    out = layer0(h, attention_mask=mask, position_ids=pos, position_embeddings=rotary(h, pos))
    h = out[0] if isinstance(out, tuple) else out
    norm = modeling.DeepseekV2RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
    norm.weight.data.copy_(t["model.layers.1.input_layernorm.weight"])
    return norm(h)


def layer1_weights(directory: str | Path) -> MLAWeights:
    return MLAWeights.from_checkpoint(directory, layer=1)
