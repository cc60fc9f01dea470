"""``hf-transformers`` for DeepSeek-V4 layers: transformers' own ``DeepseekV4Attention``
(transformers.models.deepseek_v4.modeling_deepseek_v4), driven with its own cache classes.

Nothing here re-implements attention. The module, its rotary embeddings, its compressors and lightning indexer,
and its cache layers (``DeepseekV4HCACache`` / ``DeepseekV4CSACache`` / ``DynamicSlidingWindowLayer``, built
by transformers' ``DynamicCache(config=...)``) are transformers' classes. This module only

* converts a :class:`V4Config` into a ``DeepseekV4Config`` (the model's layer_types, the judged layer's index;
  small harmless values for the MoE / vocabulary fields the attention never reads), eager attention;
* builds ``DeepseekV4Attention(cfg, layer_idx=config.layer)``, loads the layer's weights (strict) in the
  dtypes ``from_pretrained`` would give them (``DeepseekV4PreTrainedModel._keep_in_fp32_modules_strict``:
  sinks, position biases and every norm weight stay float32 under bf16 / fp16; ``_keep_in_fp32_modules``
  under fp16 only), and
* hands it what ``DeepseekV4Model.forward`` hands every layer: ``position_embeddings`` =
  {"main": ..., "compress": ...} from a ``DeepseekV4RotaryEmbedding``, ``position_ids``, the cache, and the
  4-D mask of ``transformers.masking_utils.create_sliding_window_causal_mask`` (the one mask the model builds
  for all V4 layer types; eager attention always materialises it). The model sizes that mask against the
  first cache layer; every layer of a real model has seen the same tokens, so sizing it against the judged
  layer (``layer_idx=config.layer``, the argument transformers offers for this) is the same mask.

Rows. transformers' V4 cache keeps one compressor state per cache (``entry_count``, the buffer of an open
window, the overlap slice), not one per row: a call whose rows are at different positions, or carry different
numbers of new tokens (right padding, idle rows), is something a batched transformers cache cannot represent,
and appending the padding would compress it into the row's entries. So the cache wrapper holds one transformers
Cache for all rows while every call feeds every row the same number of tokens (transformers' batched path),
and from the first call that does not, one transformers Cache per row (each row's valid tokens run through the
module alone; an idle row's Cache is not touched). The split copies the shared Cache per row with transformers'
own batch selection (``Cache.reorder_cache``, its beam-search API), then restores the invariant transformers'
compressed-layer ``update`` keeps (values *is* keys).

The cache reports the tensors transformers holds for the judged layer (``tensors()``), by role in
``v4_layout``: the sliding-window keys ("window"; compressed layers store K = V once, ``values is keys``; the
window-only layer's ``DynamicSlidingWindowLayer`` holds keys and values as two tensors of equal content, both
listed), the compressed entries ("compressed"), the indexer's compressed keys ("indexer"), the compressor
buffers and overlap slices ("state"). Everything transformers holds is live state (it stores no padding here),
so ``active_nbytes() == allocated_nbytes()``.
"""

from __future__ import annotations

import copy
import inspect
import re

import torch

V4_KIND = "deepseek-v4"
#: DeepseekV4Config fields the attention never reads (MoE, vocabulary, hyper-connections): small harmless values
_FILLER = dict(vocab_size=16, n_routed_experts=2, num_experts_per_tok=1, moe_intermediate_size=8, n_shared_experts=1,
               num_nextn_predict_layers=0, attention_dropout=0.0, attention_bias=False)


def is_v4(config) -> bool:
    return getattr(config, "attention_kind", None) == V4_KIND


def _modeling_module():
    try:
        from transformers.models.deepseek_v4 import modeling_deepseek_v4 as modeling
    except ImportError:
        return None
    needed = ("DeepseekV4Attention", "DeepseekV4RotaryEmbedding", "DeepseekV4HCACache", "DeepseekV4CSACache",
              "DeepseekV4PreTrainedModel")
    return modeling if all(hasattr(modeling, n) for n in needed) else None


def v4_unavailable_reason() -> str | None:
    """The sentence when the installed transformers has no DeepseekV4Attention, naming the release."""
    if _modeling_module() is not None:
        return None
    import transformers

    return (f"transformers {transformers.__version__} has no DeepseekV4Attention (transformers.models.deepseek_v4, "
            "DeepSeek-V4's sliding-window / compressed sparse / heavily compressed attention with its cache layers, "
            "is not in this release); hf-transformers serves DeepSeek-V4 configs only through a release that has it")


def hf_v4_config(config):
    """transformers' DeepseekV4Config for a :class:`mla_conformance.model.v4_config.V4Config` (eager attention)."""
    import logging

    from transformers import DeepseekV4Config

    kwargs = {**config.to_hf_dict(), **_FILLER}
    kwargs["num_hidden_layers"] = config.num_hidden_layers
    kwargs["layer_types"] = list(config.layer_types)
    # transformers warns when YaRN's factor differs from max_position_embeddings / original (the tiny presets'
    # numbers): the explicit factor is used, as DeepSeek's code does; the warning is noise here
    log = logging.getLogger("transformers.modeling_rope_utils")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        cfg = DeepseekV4Config(**kwargs)
    finally:
        log.setLevel(level)
    cfg._attn_implementation = "eager"
    return cfg


def _fp32_patterns(dtype: torch.dtype) -> list[str]:
    """The parameter-name patterns ``from_pretrained`` keeps in float32 at ``dtype`` (DeepseekV4PreTrainedModel's own
    lists, read from the class: PreTrainedModel._get_dtype_plan's rule)."""
    modeling = _modeling_module()
    cls = modeling.DeepseekV4PreTrainedModel
    patterns: list[str] = []
    if dtype == torch.float16:
        patterns += list(cls._keep_in_fp32_modules or [])
    if dtype in (torch.float16, torch.bfloat16):
        patterns += list(cls._keep_in_fp32_modules_strict or [])
    return patterns


def _load_dtype(full_name: str, dtype: torch.dtype, patterns: list[str]) -> torch.dtype:
    """What ``from_pretrained(dtype=dtype)`` gives parameter ``full_name``: core_model_loading matches the plan's
    globs with ``re.search`` on the checkpoint key (``*`` -> ``.*``)."""
    for p in patterns:
        if re.search(p.replace("*", ".*"), full_name):
            return torch.float32
    return dtype


def _fp32_projection_hint(attn, dtype: torch.dtype) -> str | None:
    """The known cause when transformers' compressor crashes at float16: ``from_pretrained(dtype=float16)`` keeps
    the ``_keep_in_fp32_modules`` projections in float32 and the compressor feeds them float16 activations."""
    if dtype != torch.float16:
        return None
    kept = [n for n, p in attn.named_parameters()
            if p.dtype == torch.float32 and p.ndim == 2 and n.endswith(".weight")]
    if not kept:
        return None
    return (f"transformers' DeepseekV4PreTrainedModel._keep_in_fp32_modules keeps {kept} in float32 when a model is "
            "loaded in float16 (PreTrainedModel._get_dtype_plan), and the compressor / indexer call them on the "
            "float16 hidden states without upcasting (DeepSeek's Compressor upcasts x to float32 first): "
            "from_pretrained(dtype=torch.float16) gives a model whose compressed layers cannot run.")


# ============================================================================ the cache

_STATE_DICTS = ("compressed_kv", "buffer_kv", "buffer_gate", "overlap_kv", "overlap_gate")


class HFV4Cache:
    """transformers' V4 cache for ``batch_size`` rows: one ``DynamicCache(config=...)`` for all rows while the calls
    feed every row alike, one per row from the first call that does not (module docstring)."""

    def __init__(self, hf_config, config, *, batch_size, capacity, dtype, device):
        self.hf_config = hf_config
        self.config = config
        self.batch_size = batch_size
        self.capacity = capacity
        self.dtype = dtype
        self.device = device
        self.layer_idx = config.layer
        self.seq_lens = torch.zeros(batch_size, dtype=torch.int64, device=device)
        self.shared = None      # one transformers Cache for all rows (rows fed alike so far)
        self.rows = None        # one transformers Cache per row (after the first call that feeds rows differently)
        #: CSA: the last call's indexer selection [B, S, index_topk], compressed-entry indices (-1 = unused)
        self.last_topk_indices: torch.Tensor | None = None

    def _new_hf(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.hf_config)

    def shared_cache(self):
        if self.shared is None:
            self.shared = self._new_hf()
        return self.shared

    def row_caches(self):
        """One transformers Cache per row; the first time, split the shared one (if any) by transformers'
        batch selection."""
        if self.rows is not None:
            return self.rows
        if self.shared is None:
            self.rows = [self._new_hf() for _ in range(self.batch_size)]
            return self.rows
        modeling = _modeling_module()
        rows = []
        for b in range(self.batch_size):
            c = copy.deepcopy(self.shared)
            c.reorder_cache(torch.tensor([b], dtype=torch.long))
            # transformers' compressed-layer update keeps values *is* keys; index_select made them two tensors
            for layer in c.layers:
                if isinstance(layer, modeling.DeepseekV4HCACache) and getattr(layer, "keys", None) is not None:
                    layer.values = layer.keys
            rows.append(c)
        self.rows, self.shared = rows, None
        return self.rows

    # ------------------------------------------------------------------ what transformers holds
    def _layer_tensors(self, cache, prefix: str) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        layers = getattr(cache, "layers", None)
        if not layers or len(layers) <= self.layer_idx:
            return out
        layer = layers[self.layer_idx]
        base = f"{prefix}layers.{self.layer_idx}."
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if isinstance(keys, torch.Tensor) and keys.numel():
            out[base + "keys"] = keys
        if isinstance(values, torch.Tensor) and values.numel() and values is not keys:
            out[base + "values"] = values
        for attr in _STATE_DICTS:
            states = getattr(layer, attr, None)
            if isinstance(states, dict):
                for name, t in states.items():
                    if isinstance(t, torch.Tensor) and t.numel():
                        out[f"{base}{attr}.{name}"] = t
        return out

    def tensors(self) -> dict[str, torch.Tensor]:
        if self.rows is not None:
            out = {}
            for b, c in enumerate(self.rows):
                out.update(self._layer_tensors(c, f"rows.{b}."))
            return out
        return self._layer_tensors(self.shared, "") if self.shared is not None else {}

    @property
    def v4_layout(self) -> dict[str, str]:
        layout = {}
        for name in self.tensors():
            tail = name.rsplit(f"layers.{self.layer_idx}.", 1)[1]
            if tail in ("keys", "values"):
                layout[name] = "window"
            elif tail == "compressed_kv.compressor":
                layout[name] = "compressed"
            elif tail == "compressed_kv.indexer":
                layout[name] = "indexer"
            else:
                layout[name] = "state"
        return layout

    def allocated_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def active_nbytes(self) -> int:
        """transformers grows its V4 cache and holds no padding here: every byte it holds is live state."""
        return self.allocated_nbytes()


# ============================================================================ the driver

class HFV4:
    """Builds and drives transformers' DeepseekV4Attention for V4Config layers (called by HFTransformers)."""

    def __init__(self):
        self._modules: dict = {}

    def unsupported_reason(self, config, *, dtype, device, kv_codec="none"):
        reason = v4_unavailable_reason()
        if reason:
            return reason
        if kv_codec != "none":
            return (f"hf-transformers caches what transformers' DeepSeek-V4 cache layers store (the window keys, "
                    f"compressed entries and compressor state in the model dtype); it has no quantized codec, so "
                    f"kv_codec {kv_codec!r} is not supported")
        try:  # transformers validates its config: a decline, not a crash
            hf_v4_config(config)
        except Exception as exc:
            first = " ".join(str(exc).split()) or type(exc).__name__
            return f"transformers' DeepseekV4Config rejects this config: {first}"
        return None

    def new_cache(self, config, *, batch_size, capacity, dtype, device, kv_codec="none"):
        return HFV4Cache(hf_v4_config(config), config, batch_size=batch_size, capacity=capacity, dtype=dtype,
                         device=device)

    def module(self, weights):
        """(DeepseekV4Attention with the weights loaded, the model-level DeepseekV4RotaryEmbedding, its config)."""
        key = (id(weights), weights.dtype, str(weights.device))
        hit = self._modules.get(key)
        if hit is not None and hit[0] is weights:
            return hit[1], hit[2], hit[3]
        modeling = _modeling_module()
        config = weights.config
        hf_config = hf_v4_config(config)
        dtype, device = weights.dtype, weights.device
        with torch.device("meta"):  # no random init of parameters that load_state_dict replaces
            attn = modeling.DeepseekV4Attention(hf_config, layer_idx=config.layer)
        # the rotary embeddings own non-persistent buffers (inv_freq) that no state dict carries: build them for real
        for name, sub in list(attn.named_modules()):
            if isinstance(sub, modeling.DeepseekV4RotaryEmbedding):
                parent = attn.get_submodule(name.rsplit(".", 1)[0]) if "." in name else attn
                setattr(parent, name.rsplit(".", 1)[-1], modeling.DeepseekV4RotaryEmbedding(hf_config, device=device))
        patterns = _fp32_patterns(dtype)
        prefix = f"model.layers.{config.layer}.self_attn."
        state = {k: v.to(device=device, dtype=_load_dtype(prefix + k, dtype, patterns)) for k, v in weights.items()}
        attn.load_state_dict(state, strict=True, assign=True)
        attn = attn.eval()
        for n, t in list(attn.named_parameters()) + list(attn.named_buffers()):
            if t.is_meta:
                raise ValueError(f"transformers' DeepseekV4Attention tensor {n} was not loaded")
        rotary = modeling.DeepseekV4RotaryEmbedding(hf_config, device=device)
        self._modules = {key: (weights, attn, rotary, hf_config)}
        return attn, rotary, hf_config

    def _run(self, attn, rotary, hf_config, x, pos, hf_cache, topk_out):
        """One forward of DeepseekV4Attention as DeepseekV4Model.forward drives a layer: x [b, s, hidden] (all
        valid), pos [b, s], hf_cache a transformers Cache."""
        from transformers.masking_utils import create_sliding_window_causal_mask

        cache_kw = "cache" if "cache" in inspect.signature(create_sliding_window_causal_mask).parameters \
            else "past_key_values"
        mask = create_sliding_window_causal_mask(config=hf_config, inputs_embeds=x, attention_mask=None,
                                                 position_ids=pos, layer_idx=attn.layer_idx, **{cache_kw: hf_cache})
        pe = {"main": rotary(x, position_ids=pos, layer_type="main"),
              "compress": rotary(x, position_ids=pos, layer_type="compress")}
        kw = {"cache": hf_cache} if "cache" in inspect.signature(attn.forward).parameters \
            else {"past_key_values": hf_cache}
        hook = None
        if topk_out is not None and attn.compressor is not None and hasattr(attn.compressor, "indexer"):
            # read (never change) the top-k entry indices transformers' indexer returns to its compressor
            hook = attn.compressor.indexer.register_forward_hook(lambda mod, args, out: topk_out.append(out))
        try:
            out = attn(x, position_embeddings=pe, position_ids=pos, attention_mask=mask, **kw)[0]
        except RuntimeError as exc:
            hint = _fp32_projection_hint(attn, x.dtype)
            if hint:
                raise RuntimeError(f"{hint} transformers raised: {exc}") from exc
            raise
        finally:
            if hook is not None:
                hook.remove()
        return out

    @torch.no_grad()
    def attend(self, weights, hidden_states, positions, cache: HFV4Cache, lengths=None):
        attn, rotary, hf_config = self.module(weights)
        cfg = weights.config
        B, S, _ = hidden_states.shape
        dev = hidden_states.device
        lengths = (torch.full((B,), S, dtype=torch.int64) if lengths is None
                   else lengths.to(device="cpu", dtype=torch.int64))
        if int((cache.seq_lens.cpu() + lengths).max()) > cache.capacity:
            raise ValueError(f"cache overflow: capacity {cache.capacity}")
        out = torch.zeros(B, S, cfg.hidden_size, dtype=hidden_states.dtype, device=dev)
        csa = attn.compressor is not None and hasattr(attn.compressor, "indexer")
        topk = torch.full((B, S, cfg.index_topk), -1, dtype=torch.int64, device=dev) if csa else None
        n0 = int(lengths[0])
        uniform = bool((lengths == n0).all()) and cache.rows is None
        if uniform:
            if n0 > 0:
                picked: list = [] if csa else None
                y = self._run(attn, rotary, hf_config, hidden_states[:, :n0], positions[:, :n0],
                              cache.shared_cache(), picked)
                out[:, :n0] = y.to(hidden_states.dtype)
                if csa and len(picked) == 1:
                    topk[:, :n0, :picked[0].shape[-1]] = picked[0]
        else:
            rows = cache.row_caches()
            for b in range(B):
                n = int(lengths[b])
                if n == 0:  # an idle row: its transformers Cache is not touched
                    continue
                picked = [] if csa else None
                y = self._run(attn, rotary, hf_config, hidden_states[b:b + 1, :n], positions[b:b + 1, :n],
                              rows[b], picked)
                out[b, :n] = y[0].to(hidden_states.dtype)
                if csa and len(picked) == 1:
                    topk[b, :n, :picked[0].shape[-1]] = picked[0][0]
        cache.seq_lens = cache.seq_lens + lengths.to(cache.seq_lens.device)
        cache.last_topk_indices = topk
        return out

    def diagnose(self, weights) -> str | None:
        return None
