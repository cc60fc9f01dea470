"""Greedy generation with every layer's attention running through a backend.

Embeddings, norms, MLP/MoE and the LM head are transformers' own DeepseekV2 modules, loaded from a real
checkpoint directory by ``DeepseekV2ForCausalLM.from_pretrained``; only attention is replaced, by
``backend.attend`` over the backend's own cache (one per layer). Prompts are batched with right padding,
so generation also exercises the backend's varlen path.

DeepSeek Sparse Attention: a model directory whose config.json carries ``index_n_heads``,
``index_head_dim`` and ``index_topk`` (the tiny model's DSA variant, :func:`make_dsa_variant`) runs through a
DSA backend (``--backend reference-dsa``). transformers' DeepseekV2 modules load the dense parts and ignore
the indexer tensors; each layer's indexer (``model.layers.{L}.self_attn.indexer.*``) is read from the
directory's safetensors with :meth:`MLAWeights.from_checkpoint`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

from mla_conformance.contract.calls import call_backend, check_output
from mla_conformance.contract.layer import support_reason
from mla_conformance.model import reference
from mla_conformance.model import dsa_reference as dsa_ref
from mla_conformance.model.checkpoint import SafetensorsCheckpoint
from mla_conformance.model.config import MLAConfig
from mla_conformance.errors import CheckpointError, MLAInputError, PackageImportError, environment_line
from mla_conformance.resources import fixtures_dir, prompts_file, read_json, tiny_model_dir
from mla_conformance.model.config import expected_shapes
from mla_conformance.model.weights import MLAWeights
from mla_conformance.dtypes import dtype_name

#: the embedded tiny model and its prompts (package data; the checkout's fixtures/ in an editable install)
DEFAULT_MODEL = tiny_model_dir()
DEFAULT_PROMPTS = prompts_file()
#: the embedded tiny model's DeepSeek Sparse Attention variant (index_topk 6, its indexer warm-up trained; the
#: command that built it: fixtures/models/tiny-mla-dsa/README.md)
DSA_MODEL = fixtures_dir() / "models" / "tiny-mla-dsa"


def load_model(directory: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """DeepseekV2ForCausalLM from a local directory (offline), after checking its files name themselves."""
    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise CheckpointError(f"{directory}: not a model directory (no config.json)")
    SafetensorsCheckpoint(directory)  # validates every safetensors header and size, naming a bad file
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:  # transformers imports its model lazily: a package of the environment that does not load surfaces here
        from transformers import DeepseekV2ForCausalLM
        from transformers.utils import logging as hf_logging
    except Exception as exc:
        raise PackageImportError(f"transformers' DeepseekV2ForCausalLM does not import in this environment: "
                                 f"{environment_line(exc)}") from None

    hf_logging.disable_progress_bar()
    # a DSA model's indexer tensors are not DeepseekV2 parameters (layer_weights reads them from the files):
    # transformers' load report would list them as UNEXPECTED on every load; errors still surface
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        try:
            model, info = DeepseekV2ForCausalLM.from_pretrained(str(directory), dtype=dtype, attn_implementation="eager",
                                                                output_loading_info=True)
        except TypeError:  # transformers < 4.56 calls it torch_dtype
            model, info = DeepseekV2ForCausalLM.from_pretrained(str(directory), torch_dtype=dtype,
                                                                attn_implementation="eager", output_loading_info=True)
    except Exception as exc:
        raise CheckpointError(f"{directory}: transformers could not load the model: {type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else ''}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    check_loading_info(directory, info, unused_ok=".indexer.")
    return model.to(device).eval()


def check_loading_info(directory, info: dict, unused_ok: str | None = None) -> None:
    """transformers' ``output_loading_info``: a tensor the model needs and the files lack is a CheckpointError
    (transformers would initialise it at random: never generate with that); a tensor the files hold and the model
    does not use is a warning (except names containing ``unused_ok``)."""
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        raise CheckpointError(f"{directory}: the model files lack {len(missing)} tensor(s) the model needs: "
                              f"{', '.join(missing[:4])}{' …' if len(missing) > 4 else ''}")
    unexpected = sorted(k for k in info.get("unexpected_keys") or [] if not unused_ok or unused_ok not in k)
    if unexpected:
        warnings.warn(f"{directory}: tensors the model does not use: {', '.join(unexpected[:4])}"
                      f"{' …' if len(unexpected) > 4 else ''}", stacklevel=3)


def layer_weights(model, config: MLAConfig, model_dir: str | Path | None = None) -> list[MLAWeights]:
    """Each layer's attention weights from the loaded model; a DSA config's indexer tensors (which
    DeepseekV2 modules do not hold) from ``model_dir``'s safetensors (default: the directory the model was
    loaded from)."""
    out = []
    names = list(expected_shapes(config))
    model_dir = model_dir or getattr(model.config, "_name_or_path", None)
    for i, layer in enumerate(model.model.layers):
        params = dict(layer.self_attn.named_parameters())
        tensors = {n: params[n].detach() for n in names if not n.startswith("indexer.")}
        if config.dsa:
            if not model_dir or not Path(model_dir).is_dir():
                raise CheckpointError(f"layer {i}: this config has DeepSeek Sparse Attention but no model directory "
                                      "to read the indexer tensors from")
            like = next(iter(tensors.values()))
            ckpt = MLAWeights.from_checkpoint(model_dir, layer=i, config=config)
            tensors.update({n: ckpt[n].to(device=like.device, dtype=like.dtype) for n in names if n.startswith("indexer.")})
        out.append(MLAWeights(config, tensors, source=f"model.layers.{i}.self_attn"))
    return out


@dataclasses.dataclass
class Generation:
    tokens: list[list[int]]
    layers: int
    cache_active_nbytes: int
    cache_allocated_nbytes: int


@torch.no_grad()
def greedy_generate(model, backend, prompts: list[list[int]], max_new_tokens: list[int] | int, *,
                    kv_codec: str = "none", device: str = "cpu", on_logits=None) -> Generation:
    """Greedy decoding of a batch of prompts; attention of every layer goes through ``backend``.
    ``on_logits(logits, active)``, when given, sees each step's next-token logits [B, vocab] and which rows
    chose a token at that step (the engine suite's reference log-probabilities: mla_conformance.engine)."""
    config = MLAConfig.from_hf(model.config.to_dict())
    dtype = next(model.parameters()).dtype
    reason = support_reason(backend, config, dtype=dtype, device=device, kv_codec=kv_codec)
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
        if on_logits is not None:
            on_logits(logits[torch.arange(B, device=device), last],
                      [int(step_lens[b]) > 0 and len(generated[b]) < new[b] for b in range(B)])
        for b in range(B):
            if int(step_lens[b]) > 0 and len(generated[b]) < new[b]:
                generated[b].append(int(next_tok[b]))
    active = sum(int(c.active_nbytes()) for c in caches)
    allocated = sum(int(c.allocated_nbytes()) for c in caches)
    return Generation(generated, len(caches), active, allocated)


# --------------------------------------------------------------------------- prompts


def load_prompts(path: str | Path = DEFAULT_PROMPTS) -> dict[str, Any]:
    path = Path(path)
    data = read_json(path, missing="no such prompts file")
    if not isinstance(data.get("sets"), dict):
        raise MLAInputError(f"{path}: no 'sets' object")
    return data


def new_tokens(ep: dict[str, Any]) -> int:
    """How many tokens an episode generates: its ``max_new_tokens``, else its expected answer's length."""
    return ep.get("max_new_tokens") or len(ep["expected"]["token_ids"])


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
    new = [max_new_tokens or new_tokens(ep) for ep in eps]
    gen = greedy_generate(model, backend, [ep["token_ids"] for ep in eps], new, kv_codec=kv_codec, device=device)
    return generation_result(model_dir, backend, eps, gen, kv_codec=kv_codec, dtype=dtype, device=device)


def generation_result(model_dir, backend, eps: list[dict[str, Any]], gen: Generation, *, kv_codec, dtype,
                      device) -> dict[str, Any]:
    """The result dict of a generation run (what golden_payload reads): each episode's tokens against its
    expected ones, the accuracy, the caches' bytes."""
    tok = _tokenizer(model_dir)
    outputs = []
    for ep, toks in zip(eps, gen.tokens):
        item = {"id": ep["id"], "set": ep["set"], "tokens": toks,
                "expected": ep["expected"]["token_ids"],
                "correct": sum(int(a == b) for a, b in zip(toks, ep["expected"]["token_ids"]))}
        if tok is not None:
            item["text"] = tok.decode(toks)
        outputs.append(item)
    return {"model": str(model_dir), "backend": backend.name, "kv_codec": kv_codec, "dtype": dtype_name(dtype),
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
    name = dtype_name(dtype)
    if device.startswith("cuda"):
        cap = torch.cuda.get_device_capability(torch.device(device).index or 0)
        return f"cuda-sm{cap[0]}{cap[1]}-{name}"
    return f"{device.split(':')[0]}-{name}"


def tiny_training_sequences(prompts_path: str | Path = DEFAULT_PROMPTS, seed: int = 11) -> list[list[int]]:
    """Held-out episodes (prompt + answer ids) of the tiny model's tasks, from fixtures/train_tiny.py (a checkout
    only): 32 long copies, 16 recalls, 16 copies, none of them a pinned prompt of ``prompts_path``."""
    tt = _train_tiny()
    pinned = {" ".join(tt.VOCAB[i] for i in ep["token_ids"][1:])
              for eps in load_prompts(prompts_path)["sets"].values() for ep in eps if ep.get("token_ids")}
    out = []
    for kind, n in (("long_copy", 32), ("recall", 16), ("copy", 16)):
        out += [[tt.BOS, *tt.ids(p), *tt.ids(a)] for p, a in tt.held_out(seed, kind, n, pinned)]
    return out


def _train_tiny():
    """fixtures/train_tiny.py of the checkout the fixtures are read from (not shipped in a wheel), loaded by path,
    so the console script finds it from any working directory."""
    import importlib.util

    path = fixtures_dir() / "train_tiny.py"
    if not path.is_file():
        raise MLAInputError("the tiny model's task generator (fixtures/train_tiny.py) is only in a checkout; give "
                            "--train-sequences FILE")
    module = sys.modules.get("_mla_train_tiny")
    if module is None:
        spec = importlib.util.spec_from_file_location("_mla_train_tiny", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["_mla_train_tiny"] = module
        spec.loader.exec_module(module)
    return module


def _source_label(src: Path) -> str:
    """``src`` as dsa_variant.json records it: relative (fixtures/models/...) for a model among the fixtures, so a
    shipped variant names no build machine's path; as given otherwise."""
    try:
        return "fixtures/" + src.resolve().relative_to(fixtures_dir().resolve()).as_posix()
    except ValueError:
        return str(src)


# --------------------------------------------------------------------------- a DSA variant of a dense model


class _Trainable(dict):
    """name -> tensor with ``.config``: what dsa_reference.indexer_project reads, with trainable indexer tensors."""

    def __init__(self, config, tensors):
        super().__init__(tensors)
        self.config = config


def _dense_attention_targets(model, config: MLAConfig, ids: torch.Tensor, lengths: torch.Tensor):
    """Per layer: (layer input x [B, T, hidden], the dense model's attention distribution averaged over heads
    [B, T, T]) of right-padded token ids, from transformers' forward (hidden states) and the reference
    projections (the layer's own weights)."""
    B, T = ids.shape
    t = torch.arange(T)
    allowed = (t[None, None, :] <= t[None, :, None]) & (t[None, None, :] < lengths[:, None, None])
    with torch.no_grad():
        hidden = model.model(input_ids=ids, output_hidden_states=True).hidden_states
    out = []
    for layer, w, h in zip(model.model.layers, layer_weights(model, dataclasses.replace(
            config, index_n_heads=None, index_head_dim=None, index_topk=None)), hidden):
        with torch.no_grad():
            x = layer.input_layernorm(h)
            q_nope, q_pe, c, k_pe = reference.project(w, x, t.expand(B, T))
            k, _ = reference.expand_kv(w, c, k_pe)
            q = torch.cat([q_nope, q_pe], dim=-1)
            scores = torch.einsum("bshd,bthd->bsht", q, k) * config.softmax_scale
            p = reference.masked_softmax(scores, allowed, torch.float32).mean(2)
        out.append((x, p))
    return out, allowed


def make_dsa_variant(src: str | Path, dst: str | Path, *, index_n_heads: int = 4, index_head_dim: int = 32,
                     index_topk: int = 16, sequences: list[list[int]] | None = None, steps: int = 0,
                     lr: float = 3e-3, seed: int = 0, progress=None) -> dict[str, Any]:
    """Write ``dst``: the dense model ``src`` (config.json, safetensors, tokenizer files copied) plus a
    lightning indexer per layer and the DSA fields in config.json.

    The indexer starts from ``MLAWeights.random``'s draw (seeded). With ``steps`` > 0 and token-id
    ``sequences`` it is trained as DeepSeek-V3.2's dense warm-up stage trains it: everything else frozen, the
    indexer's distribution softmax(I[s, :]) is pulled towards the dense model's attention averaged over heads
    (KL(p || softmax(I)), mean over the sequences' queries), Adam, full batch. Returns the figures (the
    final KL per layer, the fraction of the dense attention mass the indexer's top-k keeps)."""
    import shutil

    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    cfg_json = json.loads((src / "config.json").read_text(encoding="utf-8"))
    cfg_json.update(index_n_heads=index_n_heads, index_head_dim=index_head_dim, index_topk=index_topk)
    config = MLAConfig.from_hf(cfg_json)
    model = load_model(src, torch.float32)
    drawn = MLAWeights.random(config, seed=seed, dtype=torch.float32)
    dense = layer_weights(model, dataclasses.replace(config, index_n_heads=None, index_head_dim=None, index_topk=None))
    indexer = [{n: drawn[n].clone().requires_grad_(steps > 0) for n in drawn if n.startswith("indexer.")}
               for _ in dense]
    figures: dict[str, Any] = {"index_n_heads": index_n_heads, "index_head_dim": index_head_dim,
                               "index_topk": index_topk, "steps": steps}
    if steps > 0:
        if not sequences:
            raise MLAInputError("training the indexer needs token-id sequences")
        lengths = torch.tensor([len(s) for s in sequences])
        ids = torch.zeros(len(sequences), int(lengths.max()), dtype=torch.int64)
        for b, seq in enumerate(sequences):
            ids[b, :len(seq)] = torch.tensor(seq)
        targets, allowed = _dense_attention_targets(model, config, ids, lengths)
        B, T = ids.shape
        positions = torch.arange(T).expand(B, T)
        valid = allowed.any(-1)
        opt = torch.optim.Adam([t for layer in indexer for t in layer.values()], lr=lr)

        def losses():
            out = []
            for w, ix, (x, p) in zip(dense, indexer, targets):
                ww = _Trainable(config, {**dict(w), **ix})
                q, k, hw = dsa_ref.indexer_project(ww, x, positions)
                logp = torch.log_softmax(dsa_ref.indexer_scores(q, k, hw, allowed), -1)
                kl = (p * (torch.log(p.clamp_min(1e-30)) - logp.masked_fill(~allowed, 0))).sum(-1)
                out.append(kl[valid].mean())
            return out

        with torch.no_grad():
            figures["kl_per_layer_initial"] = [float(v) for v in losses()]
        for step in range(steps):
            opt.zero_grad()
            total = sum(losses())
            total.backward()
            opt.step()
            if progress and (step % 50 == 0 or step == steps - 1):
                progress(f"indexer warm-up step {step + 1}/{steps}: KL {total.item() / len(dense):.4f}")
        with torch.no_grad():
            figures["kl_per_layer"] = [float(v) for v in losses()]
            kept = []
            for w, ix, (x, p) in zip(dense, indexer, targets):
                ww = _Trainable(config, {**dict(w), **ix})
                q, k, hw = dsa_ref.indexer_project(ww, x, positions)
                sel = dsa_ref.selection_mask(dsa_ref.select_topk(dsa_ref.indexer_scores(q, k, hw, allowed), index_topk), T)
                kept.append(float((p * sel).sum(-1)[valid].mean()))
            figures["dense_mass_in_topk"] = kept
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name not in ("config.json", "model.safetensors"):
            shutil.copy2(f, dst / f.name)
    (dst / "config.json").write_text(json.dumps(cfg_json, indent=2) + "\n", encoding="utf-8")
    state = load_file(str(src / "model.safetensors"))
    for i, ix in enumerate(indexer):
        for n, t in ix.items():
            state[f"model.layers.{i}.self_attn.{n}"] = t.detach().contiguous().clone()
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "dsa_variant.json").write_text(json.dumps({"source": _source_label(src), **figures}, indent=2) + "\n",
                                          encoding="utf-8")
    return figures
