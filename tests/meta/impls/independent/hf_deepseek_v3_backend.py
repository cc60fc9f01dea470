"""A user's MLA backend on transformers' own DeepseekV3Attention, written to the BASE layer contract only.

It declares nothing optional (no ``cache_format``: the default "latent" is what transformers 5.x's
DeepseekV3Attention caches, c_KV [B, 1, T, kv_lora_rank] + k_pe [B, 1, T, qk_rope_head_dim]; no
``sparse_attention``; no ``supports_paging``), so every optional part of the suite skips for it, naming the
declaration that would opt it in.

Nothing here re-implements attention: the module (``DeepseekV3Attention``), its rotary embedding
(``DeepseekV3RotaryEmbedding``) and its cache (``DynamicCache``) are transformers' classes, driven as
transformers ships them (eager attention). This file only builds them from the suite's MLAConfig, loads the
layer's weights, and supplies what the model would: position embeddings and a 4-D additive mask encoding
causality and the rows' right padding. Self-contained: torch and transformers only, like a user's backend.

RoPE layout: DeepSeek's checkpoints rotate interleaved pairs (x[2i], x[2i+1]); transformers' DeepseekV3
serves that with ``rope_interleave=True`` (its default, set explicitly here).
"""

from __future__ import annotations

import inspect

import torch


def _v3_config(config):
    """transformers' DeepseekV3Config for one MLA layer of the suite's MLAConfig (HF field names)."""
    from transformers import DeepseekV3Config

    rope = {"rope_type": "default", "rope_theta": float(config.rope_theta)}
    if config.rope_scaling:
        rope = {**dict(config.rope_scaling), "rope_theta": float(config.rope_theta)}
        kind = rope.pop("type", None)
        rope.setdefault("rope_type", kind or "yarn")
    cfg = DeepseekV3Config(
        hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_attention_heads, q_lora_rank=config.q_lora_rank,
        kv_lora_rank=config.kv_lora_rank, qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim, v_head_dim=config.v_head_dim,
        rms_norm_eps=config.rms_norm_eps, max_position_embeddings=config.max_position_embeddings,
        rope_parameters=rope, rope_interleave=True,
        # one attention layer; the MoE / vocabulary fields are not used by DeepseekV3Attention
        num_hidden_layers=1, vocab_size=16, intermediate_size=32, moe_intermediate_size=16,
        n_routed_experts=1, n_shared_experts=1, num_experts_per_tok=1, n_group=1, topk_group=1,
        first_k_dense_replace=1, attention_bias=False, attention_dropout=0.0,
    )
    cfg._attn_implementation = "eager"
    return cfg


class HFDeepseekV3Cache:
    """transformers' DynamicCache plus the bookkeeping transformers leaves to the model.

    DynamicCache appends every slot of a call (padding included) for all rows alike; this wrapper records,
    per slot, the position of the token it holds (-1 for a padding slot), and the mask is built from that.
    """

    def __init__(self, hf_config, *, batch_size, capacity, device):
        from transformers import DynamicCache

        self.hf = DynamicCache(config=hf_config)
        self.batch_size = batch_size
        self.capacity = capacity
        self.seq_lens = torch.zeros(batch_size, dtype=torch.int64, device=device)
        self.slot_pos = torch.empty(batch_size, 0, dtype=torch.int64, device=device)  # -1 = padding

    def _kv(self):
        layers = self.hf.layers
        if not layers or getattr(layers[0], "keys", None) is None:
            return None
        return layers[0].keys, layers[0].values

    def tensors(self) -> dict[str, torch.Tensor]:
        kv = self._kv()
        return {} if kv is None else {"layers.0.keys": kv[0], "layers.0.values": kv[1]}

    def allocated_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def active_nbytes(self) -> int:
        """Bytes of the slots that hold real tokens (padding slots transformers appended excluded)."""
        kv = self._kv()
        if kv is None:
            return 0
        per_slot = sum(t[:, :, :1].numel() * t.element_size() for t in kv) // self.batch_size  # [B, 1, T, d]
        return int((self.slot_pos >= 0).sum()) * per_slot


class HFDeepseekV3:
    """transformers.models.deepseek_v3.DeepseekV3Attention with transformers' DynamicCache."""

    name = "hf-deepseek-v3"

    def __init__(self):
        self._entry = None  # (weights, attention module, rotary embedding)

    def unsupported_reason(self, config, *, dtype, device, kv_codec="none"):
        if kv_codec != "none":
            return (f"{self.name} caches what transformers' DynamicCache stores; it has no quantized latent "
                    f"codec, so kv_codec {kv_codec!r} is not supported")
        return None

    def _module(self, weights):
        if self._entry is not None and self._entry[0] is weights:
            return self._entry[1], self._entry[2]
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
            DeepseekV3Attention, DeepseekV3RotaryEmbedding)

        hf_config = _v3_config(weights.config)
        with torch.device("meta"):  # no random init of parameters that load_state_dict replaces
            attn = DeepseekV3Attention(hf_config, layer_idx=0)
        missing, unexpected = attn.load_state_dict(dict(weights), strict=False, assign=True)
        if missing or unexpected:
            raise ValueError(f"transformers' DeepseekV3Attention parameters do not match the weights: "
                             f"missing {missing}, unexpected {unexpected}")
        attn = attn.eval()
        for buf_name, buf in attn.named_buffers():
            if buf.is_meta:
                raise ValueError(f"transformers' DeepseekV3Attention buffer {buf_name} was not loaded")
        rotary = DeepseekV3RotaryEmbedding(hf_config).to(weights.device)
        self._entry = (weights, attn, rotary)
        return attn, rotary

    def new_cache(self, config, *, batch_size, capacity, dtype, device, kv_codec="none"):
        return HFDeepseekV3Cache(_v3_config(config), batch_size=batch_size, capacity=capacity, device=device)

    @torch.no_grad()
    def attend(self, weights, hidden_states, positions, cache, lengths=None):
        attn, rotary = self._module(weights)
        B, S, _ = hidden_states.shape
        dev = hidden_states.device
        positions = positions.to(device=dev, dtype=torch.int64)
        lengths = (torch.full((B,), S, dtype=torch.int64, device=dev) if lengths is None
                   else lengths.to(device=dev, dtype=torch.int64))
        if int((cache.seq_lens + lengths).max()) > cache.capacity:
            raise ValueError(f"cache overflow: capacity {cache.capacity}")
        valid = torch.arange(S, device=dev)[None, :] < lengths[:, None]
        slot_pos = torch.cat([cache.slot_pos, torch.where(valid, positions, torch.full_like(positions, -1))], dim=1)
        # query i of row b sees the real slots at positions <= its own; a padded query (output ignored) sees
        # all of its row's real slots, so no mask row is empty
        qpos = torch.where(valid, positions, torch.full_like(positions, torch.iinfo(torch.int64).max))
        allowed = (slot_pos[:, None, :] >= 0) & (slot_pos[:, None, :] <= qpos[:, :, None])
        mask = torch.zeros(B, 1, S, slot_pos.shape[1], dtype=hidden_states.dtype, device=dev)
        mask.masked_fill_(~allowed[:, None], torch.finfo(hidden_states.dtype).min)
        pos_emb = rotary(hidden_states, positions)
        params = inspect.signature(attn.forward).parameters
        kw = {"cache": cache.hf} if "cache" in params else {"past_key_values": cache.hf}
        out = attn(hidden_states, position_embeddings=pos_emb, attention_mask=mask, **kw)[0]
        cache.slot_pos = slot_pos
        cache.seq_lens = cache.seq_lens + lengths
        return out.to(hidden_states.dtype)
