"""Greedy generation with every layer's attention running through a backend.

Embeddings, norms, MLP/MoE and the LM head are transformers' own DeepseekV2 modules, loaded from a real
checkpoint directory by ``DeepseekV2ForCausalLM.from_pretrained``; only attention is replaced, by
``backend.attend`` over the backend's own cache (one per layer). Prompts are batched with right padding,
so generation also exercises the backend's varlen path.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch

from mla_conformance.checkpoint import SafetensorsCheckpoint
from mla_conformance.config import MLAConfig
from mla_conformance.errors import CheckpointError, MLAInputError
from mla_conformance.resources import prompts_file, tiny_model_dir
from mla_conformance.weights import MLAWeights, expected_shapes

#: the embedded tiny model and its prompts (package data; the checkout's fixtures/ in an editable install)
DEFAULT_MODEL = tiny_model_dir()
DEFAULT_PROMPTS = prompts_file()


def load_model(directory: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """DeepseekV2ForCausalLM from a local directory (offline), after checking its files name themselves."""
    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise CheckpointError(f"{directory}: not a model directory (no config.json)")
    SafetensorsCheckpoint(directory)  # validates every safetensors header and size, naming a bad file
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import DeepseekV2ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    try:
        model = DeepseekV2ForCausalLM.from_pretrained(str(directory), dtype=dtype, attn_implementation="eager")
    except TypeError:  # transformers < 4.56 calls it torch_dtype
        model = DeepseekV2ForCausalLM.from_pretrained(str(directory), torch_dtype=dtype,
                                                      attn_implementation="eager")
    except Exception as exc:
        raise CheckpointError(f"{directory}: transformers could not load the model: {type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else ''}") from None
    return model.to(device).eval()


def layer_weights(model, config: MLAConfig) -> list[MLAWeights]:
    out = []
    names = list(expected_shapes(config))
    for i, layer in enumerate(model.model.layers):
        params = dict(layer.self_attn.named_parameters())
        out.append(MLAWeights(config, {n: params[n].detach() for n in names}, source=f"model.layers.{i}.self_attn"))
    return out


@dataclasses.dataclass
class Generation:
    tokens: list[list[int]]
    layers: int
    cache_active_nbytes: int
    cache_allocated_nbytes: int


@torch.no_grad()
def greedy_generate(model, backend, prompts: list[list[int]], max_new_tokens: list[int] | int, *,
                    kv_codec: str = "none", device: str = "cpu") -> Generation:
    """Greedy decoding of a batch of prompts; attention of every layer goes through ``backend``."""
    from mla_conformance.checks import call_backend, check_output

    config = MLAConfig.from_hf(model.config.to_dict())
    dtype = next(model.parameters()).dtype
    reason = call_backend(backend, "unsupported_reason", config, dtype=dtype, device=device, kv_codec=kv_codec)
    if reason:
        raise MLAInputError(f"backend {backend.name} cannot run this model: {reason}")
    B = len(prompts)
    new = [max_new_tokens] * B if isinstance(max_new_tokens, int) else list(max_new_tokens)
    lens = torch.tensor([len(p) for p in prompts])
    capacity = int((lens + torch.tensor(new)).max())
    weights = layer_weights(model, config)
    caches = [call_backend(backend, "new_cache", config, batch_size=B, capacity=capacity, dtype=dtype, device=device,
                           kv_codec=kv_codec) for _ in weights]
    ids = torch.zeros(B, int(lens.max()), dtype=torch.int64)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = torch.tensor(p)
    inner = model.model
    generated: list[list[int]] = [[] for _ in range(B)]
    step_ids, step_lens = ids.to(device), lens.to(device)
    for step in range(max(new) + 1):
        if step > 0:
            if step == max(new):
                break
            step_ids = torch.tensor([[g[-1]] for g in generated], device=device)
            step_lens = torch.tensor([1 if len(generated[b]) < new[b] else 0 for b in range(B)], device=device)
        positions = caches[0].seq_lens[:, None] + torch.arange(step_ids.shape[1], device=device)[None, :]
        h = inner.embed_tokens(step_ids)
        for layer, w, cache in zip(inner.layers, weights, caches):
            x = layer.input_layernorm(h)
            a = call_backend(backend, "attend", w, x, positions, cache, step_lens)
            check_output(backend, a, x, step_lens, f"generation step {step}, layer {w.source}", positions)
            h = h + a
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        logits = model.lm_head(inner.norm(h))
        last = (step_lens - 1).clamp(min=0)
        next_tok = logits[torch.arange(B, device=device), last].argmax(-1)
        for b in range(B):
            if int(step_lens[b]) > 0 and len(generated[b]) < new[b]:
                generated[b].append(int(next_tok[b]))
    active = sum(int(c.active_nbytes()) for c in caches)
    allocated = sum(int(c.allocated_nbytes()) for c in caches)
    return Generation(generated, len(caches), active, allocated)


# --------------------------------------------------------------------------- prompts


def load_prompts(path: str | Path = DEFAULT_PROMPTS) -> dict[str, Any]:
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise MLAInputError(f"{path}: no such prompts file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise MLAInputError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data.get("sets"), dict):
        raise MLAInputError(f"{path}: no 'sets' object")
    return data


def episodes(prompts: dict[str, Any], names: list[str] | None = None) -> list[dict[str, Any]]:
    """The tiny-model episodes of the named sets (default: every set whose episodes carry token ids)."""
    sets = prompts["sets"]
    if names:
        unknown = [n for n in names if n not in sets]
        if unknown:
            raise MLAInputError(f"unknown prompt set(s) {unknown}; known: {sorted(sets)}")
    chosen = names or [n for n, eps in sets.items() if eps and eps[0].get("token_ids")]
    out = []
    for n in chosen:
        for ep in sets[n]:
            if not ep.get("token_ids"):
                raise MLAInputError(f"prompt set {n!r}: episode {ep.get('id')!r} has no token ids "
                                    "(it is for a real checkpoint's tokenizer)")
            out.append({**ep, "set": n})
    return out


def accuracy(generated: list[list[int]], expected: list[list[int]]) -> float:
    """Fraction of expected answer tokens produced at their position."""
    total = sum(len(e) for e in expected)
    hits = sum(int(g == x) for gen, exp in zip(generated, expected) for g, x in zip(gen, exp))
    return hits / total if total else 1.0


def run_generation(model_dir, backend, *, kv_codec="none", prompt_sets=None, max_new_tokens=None,
                   dtype=torch.float32, device="cpu", prompts_file=DEFAULT_PROMPTS, model=None) -> dict[str, Any]:
    model = model if model is not None else load_model(model_dir, dtype, device)
    eps = episodes(load_prompts(prompts_file), prompt_sets)
    new = [max_new_tokens or ep.get("max_new_tokens") or len(ep["expected"]["token_ids"]) for ep in eps]
    gen = greedy_generate(model, backend, [ep["token_ids"] for ep in eps], new, kv_codec=kv_codec, device=device)
    tok = _tokenizer(model_dir)
    outputs = []
    for ep, toks in zip(eps, gen.tokens):
        item = {"id": ep["id"], "set": ep["set"], "tokens": toks,
                "expected": ep["expected"]["token_ids"],
                "correct": sum(int(a == b) for a, b in zip(toks, ep["expected"]["token_ids"]))}
        if tok is not None:
            item["text"] = tok.decode(toks)
        outputs.append(item)
    return {"model": str(model_dir), "backend": backend.name, "kv_codec": kv_codec, "dtype": str(dtype).removeprefix("torch."),
            "device": device, "accuracy": accuracy(gen.tokens, [ep["expected"]["token_ids"] for ep in eps]),
            "cache_active_nbytes": gen.cache_active_nbytes, "cache_allocated_nbytes": gen.cache_allocated_nbytes,
            "outputs": outputs}


def _tokenizer(model_dir):
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(model_dir))
    except Exception:
        return None


def numerics_class(device: str, dtype: torch.dtype) -> str:
    """e.g. cpu-float32, cuda-sm90-bfloat16: goldens of one class are never compared with another's."""
    name = str(dtype).removeprefix("torch.")
    if device.startswith("cuda"):
        cap = torch.cuda.get_device_capability(torch.device(device).index or 0)
        return f"cuda-sm{cap[0]}{cap[1]}-{name}"
    return f"{device.split(':')[0]}-{name}"


# --------------------------------------------------------------------------- CLI


def _generate_cli(args) -> int:
    from mla_conformance.backends import get_backend
    from mla_conformance.checks import DTYPES

    from mla_conformance.cli import check_device

    if args.dtype not in DTYPES:
        raise MLAInputError(f"--dtype {args.dtype!r}: choose one of {sorted(DTYPES)}")
    args.device = check_device(args.device)
    if not Path(args.model).is_dir():
        raise MLAInputError(f"--model {args.model}: no such model directory")
    if args.kv_codec != "none":
        try:
            from mla_conformance.codecs import get_codec

            get_codec(args.kv_codec)
        except ValueError as exc:
            raise MLAInputError(f"--kv-codec: {exc}") from None
    backend = get_backend(args.backend)
    result = run_generation(args.model, backend, kv_codec=args.kv_codec, prompt_sets=args.prompts,
                            max_new_tokens=args.max_new_tokens, dtype=DTYPES[args.dtype], device=args.device,
                            prompts_file=args.prompts_file)
    if args.json:
        print(json.dumps(result, indent=1, sort_keys=True, ensure_ascii=False))
    else:
        for o in result["outputs"]:
            print(f"{o['id']:>24}  {o['correct']}/{len(o['expected'])}  {o.get('text', o['tokens'])}")
        print(f"accuracy {result['accuracy']:.4f} ({result['backend']}, kv_codec {result['kv_codec']}, "
              f"{result['dtype']}, {result['device']})")
    return 0


def add_cli(sub) -> None:
    p = sub.add_parser("generate", help="greedy generation with attention running through a backend")
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="model directory (default: the embedded tiny model)")
    p.add_argument("--backend", default="reference-absorbed", metavar="SPEC")
    p.add_argument("--kv-codec", default="none", metavar="NAME")
    p.add_argument("--prompts", action="append", metavar="SET", help="prompt set name in the prompts file (repeatable)")
    p.add_argument("--prompts-file", default=str(DEFAULT_PROMPTS), metavar="FILE")
    from mla_conformance.cli import positive_int

    p.add_argument("--max-new-tokens", type=positive_int, default=None, metavar="N",
                   help="tokens to generate per prompt, >= 1 (default: each prompt's expected answer length)")
    p.add_argument("--dtype", default="float32", help="float32, float64, bfloat16 or float16 (default: float32)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_generate_cli)
