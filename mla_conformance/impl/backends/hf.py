"""``hf-transformers``: transformers' own DeepseekV2Attention (DeepseekV32Attention for DeepSeek Sparse
Attention configs), driven with its own Cache object.

Nothing here re-implements attention: the module, its rotary embedding and its ``DynamicCache`` are
transformers' classes. This backend only builds them from an :class:`MLAConfig`, loads the layer's
weights, and supplies what the model would (position embeddings and a 4-D additive mask that encodes
causality and the rows' padding).

What transformers caches changed across releases (4.x stores the expanded per-head K/V, recent 5.x
the latent): the cache object here reports the bytes of the tensors transformers actually holds and
derives its ``cache_format`` from their shapes, never from the version number.

DeepSeek Sparse Attention (configs with ``index_topk``): transformers' ``DeepseekV32Attention`` and its
``DeepseekV32Indexer``, where the installed release has them. transformers keeps the indexer keys in the same
Cache object, on the layer (``DynamicIndexedLayer.indexer_keys``, [B, T, index_head_dim]); ``tensors()``
hands out that tensor itself, so the bytes count them ("latent+indexer": 576 + 128 elements, 1,408 B per
token in BF16 at V3.2 dims). The indexer returns its top-k *slot* indices to the attention module, which
folds them into the mask; a forward hook on the indexer reads that return value (nothing is changed) and
the cache exposes it as ``last_topk_indices`` by key position (-1 for slots the query may not see).
"""

from __future__ import annotations

import inspect
import math

import torch

from mla_conformance.contract.layer import is_v4
from mla_conformance.errors import environment_line
from mla_conformance.model.config import MLAConfig


def _hf_config(config: MLAConfig):
    from transformers import DeepseekV2Config

    kwargs = dict(
        hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_attention_heads, q_lora_rank=config.q_lora_rank,
        kv_lora_rank=config.kv_lora_rank, qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim, v_head_dim=config.v_head_dim,
        rms_norm_eps=config.rms_norm_eps, rope_theta=config.rope_theta,
        max_position_embeddings=config.max_position_embeddings, num_hidden_layers=1, vocab_size=16,
        intermediate_size=32, attention_bias=False, attention_dropout=0.0,
    )
    if config.rope_scaling:
        rs = dict(config.rope_scaling)
        rs.setdefault("type", "yarn")
        kwargs["rope_scaling"] = rs
    cfg = DeepseekV2Config(**kwargs)
    cfg._attn_implementation = "eager"
    return cfg


def _hf_v32_config(config: MLAConfig):
    """transformers' DeepseekV32Config for an MLAConfig with DeepSeek Sparse Attention (5.x: rope_parameters)."""
    from transformers import DeepseekV32Config

    rope = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling:
        rope = {**dict(config.rope_scaling), "rope_theta": config.rope_theta}
        rope.setdefault("rope_type", rope.pop("type", "yarn"))
    cfg = DeepseekV32Config(
        hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_attention_heads, q_lora_rank=config.q_lora_rank,
        kv_lora_rank=config.kv_lora_rank, qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim, v_head_dim=config.v_head_dim, rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings, num_hidden_layers=1, vocab_size=16,
        intermediate_size=32, attention_bias=False, attention_dropout=0.0, rope_parameters=rope,
        index_n_heads=config.index_n_heads, index_head_dim=config.index_head_dim, index_topk=config.index_topk)
    cfg._attn_implementation = "eager"
    return cfg


def v32_unavailable_reason() -> str | None:
    """The sentence when the installed transformers has no DeepseekV32Attention, naming the release."""
    try:
        from transformers.models.deepseek_v32 import modeling_deepseek_v32 as modeling
    except ImportError:
        modeling = None
    if modeling is not None and hasattr(modeling, "DeepseekV32Attention") and hasattr(modeling, "DeepseekV32Indexer"):
        return None
    import transformers

    return (f"transformers {transformers.__version__} has no DeepseekV32Attention (transformers.models.deepseek_v32, "
            "DeepSeek-V3.2's lightning indexer and sparse MLA, is not in this release); hf-transformers serves "
            "DeepSeek Sparse Attention configs only through a release that has it")


def yarn_scale_diagnosis(attn, softmax_scale: float) -> str | None:
    """A sentence when transformers' module scales scores differently from YaRN's definition."""
    if math.isclose(attn.scaling, softmax_scale, rel_tol=1e-9):
        return None
    import transformers

    plain = attn.qk_head_dim ** -0.5
    what = ("drops YaRN's softmax factor mscale(factor, mscale_all_dim)^2 (fixed in later transformers: "
            "'Fix yarn mscale_all_dim for DeepSeek v2')" if math.isclose(attn.scaling, plain, rel_tol=1e-12)
            else "uses a different softmax scale")
    return (f"transformers {transformers.__version__}'s DeepseekV2Attention.scaling is {attn.scaling:.6g}, "
            f"YaRN needs {softmax_scale:.6g}: this transformers {what}")


class HFCache:
    """Wraps transformers' DynamicCache plus the bookkeeping transformers leaves to the model.

    transformers appends every slot of a call (padding included) for all rows alike, so this wrapper
    records, per slot, whether it holds a real token and at which position; the mask is built from that.
    """

    def __init__(self, hf_config, config: MLAConfig, *, batch_size, capacity, dtype, device):
        from transformers import DynamicCache

        try:
            self.hf = DynamicCache(config=hf_config)
        except TypeError:  # older releases take no config
            self.hf = DynamicCache()
        self.config = config
        self.batch_size = batch_size
        self.capacity = capacity
        self.dtype = dtype
        self.device = device
        self.seq_lens = torch.zeros(batch_size, dtype=torch.int64, device=device)
        self.slot_pos = torch.empty(batch_size, 0, dtype=torch.int64, device=device)  # -1 = padding
        #: DSA: the last attend call's selection [B, S, index_topk] by key position (-1 = unused slot)
        self.last_topk_indices: torch.Tensor | None = None

    def _layer(self):
        layers = getattr(self.hf, "layers", None)
        return layers[0] if layers else None

    def _indexer_keys(self) -> torch.Tensor | None:
        """transformers' own indexer key cache ([B, T, index_head_dim] on DynamicIndexedLayer), or None."""
        layer = self._layer()
        keys = getattr(layer, "indexer_keys", None) if layer is not None else None
        return keys if isinstance(keys, torch.Tensor) and keys.dim() == 3 else None

    def _kv(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        layers = getattr(self.hf, "layers", None)
        if layers is not None:  # transformers >= 4.56
            if not layers or getattr(layers[0], "keys", None) is None:
                return None
            return layers[0].keys, layers[0].values
        if getattr(self.hf, "key_cache", None):  # older releases
            return self.hf.key_cache[0], self.hf.value_cache[0]
        return None

    def fill(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Public API for benchmarks: store ``keys``/``values`` in transformers' layout ([B, heads, T, d])
        as T tokens per row, positions 0..T-1, through transformers' own ``Cache.update``."""
        T = keys.shape[-2]
        self.hf.update(keys.contiguous(), values.contiguous(), 0)
        self.slot_pos = torch.arange(T, device=keys.device).expand(self.batch_size, T).clone()
        self.seq_lens = torch.full((self.batch_size,), T, dtype=torch.int64, device=self.seq_lens.device)

    def rewind(self, length: int) -> None:
        """Public API for benchmarks: drop every slot past ``length`` (rows filled alike, no padding)."""
        kv = self._kv()
        if kv is not None and kv[0].shape[-2] != length:
            keys, values = kv[0][..., :length, :], kv[1][..., :length, :]
            layers = getattr(self.hf, "layers", None)
            if layers is not None:
                layers[0].keys, layers[0].values = keys, values
                ik = self._indexer_keys()
                if ik is not None:
                    layers[0].indexer_keys = ik[:, :length]
            else:  # older releases: lists per layer
                self.hf.key_cache[0], self.hf.value_cache[0] = keys, values
            if hasattr(self.hf, "_seen_tokens"):
                self.hf._seen_tokens = length
        self.slot_pos = self.slot_pos[:, :length]
        self.seq_lens = torch.clamp(self.seq_lens, max=int(length))

    def tensors(self) -> dict[str, torch.Tensor]:
        kv = self._kv()
        out = {} if kv is None else {"layers.0.keys": kv[0], "layers.0.values": kv[1]}
        ik = self._indexer_keys()
        if ik is not None:
            out["layers.0.indexer_keys"] = ik
        return out

    def allocated_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def active_nbytes(self) -> int:
        """Bytes of the slots holding real tokens (transformers grows its cache: slots == allocation
        unless rows were padded)."""
        kv = self._kv()
        if kv is None:
            return 0
        per_slot = sum(t[:, :, :1].numel() * t.element_size() for t in kv)  # [B, heads, T, d]: slot axis 2
        ik = self._indexer_keys()
        if ik is not None:
            per_slot += ik[:, :1].numel() * ik.element_size()              # [B, T, d]: slot axis 1
        return int((self.slot_pos >= 0).sum()) * (per_slot // self.batch_size)

    @property
    def cache_format(self) -> str:
        """"latent" when transformers stores one [.., kv_lora] head, "expanded" when per-head K/V;
        "latent+indexer" when it also holds indexer keys (DeepSeek Sparse Attention)."""
        kv = self._kv()
        if kv is None:
            return "latent+indexer" if self.config.dsa else "latent"
        keys = kv[0]
        if keys.shape[1] == 1 and keys.shape[-1] == self.config.kv_lora_rank:
            return "latent+indexer" if self._indexer_keys() is not None else "latent"
        return "expanded"


class HFTransformers:
    """transformers.models.deepseek_v2.DeepseekV2Attention with transformers' DynamicCache; for DeepSeek
    Sparse Attention configs transformers.models.deepseek_v32.DeepseekV32Attention (its indexer keys in the
    same DynamicCache, on a DynamicIndexedLayer); for DeepSeek-V4 layer configs (V4Config) transformers'
    DeepseekV4Attention with its own V4 cache layers (mla_conformance.impl.backends.hf_v4)."""

    name = "hf-transformers"
    #: opts in to the DSA tests; on a transformers release without DeepseekV32Attention unsupported_reason says so
    sparse_attention = "dsa"
    #: opts in to the DeepSeek-V4 tests: V4Config layers go to transformers' DeepseekV4Attention (hf_v4)
    deepseek_v4 = True

    def __init__(self):
        self._modules: dict = {}
        self._v4 = None

    def _v4_driver(self):
        if self._v4 is None:
            # transformers' V4 modules (and their import) only for V4 configs
            from mla_conformance.impl.backends.hf_v4 import HFV4

            self._v4 = HFV4()
        return self._v4

    def unsupported_reason(self, config, *, dtype, device, kv_codec="none"):
        if is_v4(config):
            return self._v4_driver().unsupported_reason(config, dtype=dtype, device=device, kv_codec=kv_codec)
        if config.dsa:
            reason = v32_unavailable_reason()
            if reason:
                return reason
            if config.q_lora_rank is None:
                return ("transformers' DeepseekV32Attention always projects the query through q_lora (its "
                        "indexer reads the q_lora latent); this config has q_lora_rank None")
            if config.indexer_rope_interleave:
                return ("transformers' DeepseekV32Indexer rotates half-split RoPE pairs; this config declares "
                        "indexer_rope_interleave (GLM-5-style DSA), which hf-transformers does not map onto "
                        "transformers' GlmMoeDsa")
        if kv_codec != "none":
            return (f"hf-transformers caches what transformers' DynamicCache stores; it has no quantized "
                    f"latent codec, so kv_codec {kv_codec!r} is not supported")
        try:
            from transformers.models.deepseek_v2 import modeling_deepseek_v2  # noqa: F401
        except Exception as exc:  # noqa: BLE001 - the environment's sentence, not a crash
            if isinstance(exc, ImportError) and exc.__cause__ is None and exc.__context__ is None:
                return f"this transformers has no DeepseekV2 model ({exc}); transformers >= 4.57 is needed"
            return f"transformers' DeepseekV2 model does not import in this environment: {environment_line(exc)}"
        try:  # transformers validates its config (e.g. hidden_size divisible by the heads): a decline, not a crash
            _hf_v32_config(config) if config.dsa else _hf_config(config)
        except Exception as exc:
            first = " ".join(str(exc).split()) or type(exc).__name__
            return f"transformers' {'DeepseekV32Config' if config.dsa else 'DeepseekV2Config'} rejects this config: {first}"
        return None

    def _module(self, weights):
        key = (id(weights), weights.dtype, str(weights.device))
        hit = self._modules.get(key)
        if hit is not None and hit[0] is weights:
            return hit[1], hit[2], hit[3]
        if weights.config.dsa:
            from transformers.models.deepseek_v32 import modeling_deepseek_v32 as modeling

            hf_config, cls, rotary_cls = _hf_v32_config(weights.config), "DeepseekV32Attention", "DeepseekV32RotaryEmbedding"
        else:
            from transformers.models.deepseek_v2 import modeling_deepseek_v2 as modeling

            hf_config, cls, rotary_cls = _hf_config(weights.config), "DeepseekV2Attention", "DeepseekV2RotaryEmbedding"
        with torch.device("meta"):  # no random init of parameters that load_state_dict replaces
            attn = getattr(modeling, cls)(hf_config, layer_idx=0)
        missing, unexpected = attn.load_state_dict(dict(weights), strict=False, assign=True)
        if missing or unexpected:
            raise ValueError(f"transformers' {cls} parameters do not match the weights: "
                             f"missing {missing}, unexpected {unexpected}")
        attn = attn.eval()  # driven as transformers ships it: a wrong scale is a finding, not something to patch
        for buf_name, buf in list(attn.named_buffers()):  # non-persistent buffers load_state_dict left on meta
            if buf.is_meta:
                raise ValueError(f"transformers' {cls} buffer {buf_name} was not loaded")
        rotary = getattr(modeling, rotary_cls)(hf_config).to(weights.device)
        self._modules = {key: (weights, attn, rotary, hf_config)}
        return attn, rotary, hf_config

    def diagnose(self, weights) -> str | None:
        """Optional extension: a known cause for a numerics failure, appended to the failure message."""
        if is_v4(weights.config):
            return self._v4_driver().diagnose(weights)
        attn, _, _ = self._module(weights)
        return yarn_scale_diagnosis(attn, weights.config.softmax_scale)

    def new_cache(self, config, *, batch_size, capacity, dtype, device, kv_codec="none"):
        if is_v4(config):
            return self._v4_driver().new_cache(config, batch_size=batch_size, capacity=capacity, dtype=dtype,
                                               device=device, kv_codec=kv_codec)
        hf_config = _hf_v32_config(config) if config.dsa else _hf_config(config)
        return HFCache(hf_config, config, batch_size=batch_size, capacity=capacity, dtype=dtype, device=device)

    @torch.no_grad()
    def attend(self, weights, hidden_states, positions, cache: HFCache, lengths=None):
        if is_v4(weights.config):
            return self._v4_driver().attend(weights, hidden_states, positions, cache, lengths)
        attn, rotary, _ = self._module(weights)
        B, S, _ = hidden_states.shape
        dev = hidden_states.device
        lengths = (torch.full((B,), S, dtype=torch.int64, device=dev) if lengths is None
                   else lengths.to(device=dev, dtype=torch.int64))
        if int((cache.seq_lens + lengths).max()) > cache.capacity:
            raise ValueError(f"cache overflow: capacity {cache.capacity}")
        valid = torch.arange(S, device=dev)[None, :] < lengths[:, None]
        new_pos = torch.where(valid, positions, torch.full_like(positions, -1))
        slot_pos = torch.cat([cache.slot_pos, new_pos], dim=1)
        # query i of row b sees real slots at positions <= its own; padded queries see the row's tokens
        qpos = torch.where(valid, positions, torch.full_like(positions, torch.iinfo(torch.int64).max))
        allowed = (slot_pos[:, None, :] >= 0) & (slot_pos[:, None, :] <= qpos[:, :, None])
        mask = torch.zeros(B, 1, S, slot_pos.shape[1], dtype=hidden_states.dtype, device=dev)
        mask.masked_fill_(~allowed[:, None], torch.finfo(hidden_states.dtype).min)
        pos_emb = rotary(hidden_states, positions)
        kw = {"cache": cache.hf} if "cache" in inspect.signature(attn.forward).parameters else {
            "past_key_values": cache.hf}
        if weights.config.dsa:
            kw["position_ids"] = positions
            selected: list[torch.Tensor] = []
            # read (never change) the top-k slot indices transformers' indexer returns to its attention module
            hook = attn.indexer.register_forward_hook(lambda mod, args, output: selected.append(output))
            try:
                out = attn(hidden_states, attention_mask=mask, position_embeddings=pos_emb, **kw)[0]
            finally:
                hook.remove()
            cache.last_topk_indices = (self._by_position(selected[0], slot_pos, allowed, weights.config.index_topk)
                                       if len(selected) == 1 else None)
        else:
            out = attn(hidden_states, attention_mask=mask, position_embeddings=pos_emb, **kw)[0]
        cache.slot_pos = slot_pos
        cache.seq_lens = cache.seq_lens + lengths
        return out.to(hidden_states.dtype)

    @staticmethod
    def _by_position(slots: torch.Tensor, slot_pos: torch.Tensor, allowed: torch.Tensor, topk: int) -> torch.Tensor:
        """transformers' top-k *slot* indices [B, S, k] as key positions, -1 where the slot is one the query may
        not see (padding, a future token: transformers' top-k fills up with masked slots when fewer keys are
        allowed than k) and for the slots past min(topk, T)."""
        slots = slots.long()
        B, S, k = slots.shape
        pos = torch.gather(slot_pos[:, None, :].expand(B, S, -1), 2, slots)
        seen = torch.gather(allowed, 2, slots)
        idx = torch.where(seen, pos, torch.full_like(pos, -1))
        if k < topk:
            idx = torch.nn.functional.pad(idx, (0, topk - k), value=-1)
        return idx
