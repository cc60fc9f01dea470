"""DeepSeek-V4 attention configuration and one layer's weights, in the field and tensor names of Hugging Face's
``DeepseekV4Config`` / ``DeepseekV4Attention`` (transformers 5.x), with the published presets.

V4's attention (DeepSeek's ``inference/model.py`` of the V4 release, class ``Attention``; docs/deepseek-v4.md):
one ``head_dim``-wide vector per token (RMSNorm, then RoPE on its *trailing* ``qk_rope_head_dim`` dims,
interleaved pairs) read as key and value by every head; a 128-token sliding window in every layer; per layer a
compression ratio: 0 (``sliding_attention``), 4 (``compressed_sparse_attention``, CSA: an overlapping gated
compressor and a lightning indexer choosing ``index_topk`` compressed entries per query) or 128
(``heavily_compressed_attention``, HCA: every closed compressed entry attended).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from mla_conformance.errors import CheckpointError, MLAInputError
from mla_conformance.model.config import hf_config_dict, yarn_or_none
from mla_conformance.model.checkpoint import SafetensorsCheckpoint
from mla_conformance.model.weights import LayerTensors

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
#: the short names the suite's ids and messages use
SHORT = {SLIDING: "swa", CSA: "csa", HCA: "hca"}
#: DeepSeek's per-layer ``compress_ratios`` values -> layer types (0 and 1 both mean window only)
_RATIO_TYPES = {0: SLIDING, 1: SLIDING}

_YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow")


@dataclasses.dataclass(frozen=True)
class V4Config:
    """One DeepSeek-V4 model's attention fields (Hugging Face ``DeepseekV4Config`` names) and the layer judged.

    Attributes:
        hidden_size: model width (attention input and output).
        num_attention_heads: query heads; all share one ``head_dim`` KV vector per token (shared-KV MQA).
        head_dim: the per-token KV width and each head's query width (512 in every published V4).
        qk_rope_head_dim: the trailing dims of each head / KV vector that carry RoPE (64).
        q_lora_rank: the low-rank query latent (q_a_proj -> q_a_norm -> q_b_proj; also the indexer's query input).
        o_groups / o_lora_rank: the grouped low-rank output projection (o_a_proj per group, then o_b_proj).
        sliding_window: tokens each query sees in the window branch, itself included (128).
        layer_types: per layer, one of LAYER_TYPES; ``layer`` is the index of the layer a layer test judges.
        compress_rates: {layer type: ratio} for CSA (4) and HCA (128).
        rope_theta: the window-only layers' RoPE base (plain RoPE, no YaRN).
        compress_rope_theta / rope_scaling: the compressed layers' RoPE base and YaRN dict (both the window keys,
            the queries and the compressed entries of a CSA / HCA layer use it; no mscale on cos/sin or the scale).
        index_n_heads / index_head_dim / index_topk: the CSA lightning indexer.
    """

    hidden_size: int
    num_attention_heads: int
    layer_types: tuple[str, ...]
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    compress_rates: Mapping[str, int] = dataclasses.field(
        default_factory=lambda: {CSA: 4, HCA: 128})
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: Mapping[str, Any] | None = None
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 1048576
    layer: int = 0

    #: what the layer contract's declaration check reads (contract.layer.declaration_reason)
    attention_kind = "deepseek-v4"

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "compress_rates", dict(self.compress_rates))
        for name in ("hidden_size", "num_attention_heads", "head_dim", "qk_rope_head_dim", "q_lora_rank",
                     "o_groups", "o_lora_rank", "sliding_window", "index_n_heads", "index_head_dim", "index_topk"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise MLAInputError(f"V4Config.{name} must be a positive integer, got {value!r}")
        if not self.layer_types:
            raise MLAInputError("V4Config.layer_types is empty: a V4 model has at least one attention layer")
        bad = [t for t in self.layer_types if t not in LAYER_TYPES]
        if bad:
            raise MLAInputError(f"V4Config.layer_types: {bad} are not V4 layer types ({', '.join(LAYER_TYPES)})")
        if not 0 <= self.layer < len(self.layer_types):
            raise MLAInputError(f"V4Config.layer {self.layer} is not a layer of this model "
                                f"({len(self.layer_types)} layers)")
        for kind in (CSA, HCA):
            ratio = self.compress_rates.get(kind)
            if not isinstance(ratio, int) or ratio < 2:
                raise MLAInputError(f"V4Config.compress_rates[{kind!r}] must be an integer >= 2, got {ratio!r}")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > self.head_dim:
            raise MLAInputError(f"V4Config.qk_rope_head_dim ({self.qk_rope_head_dim}) must be even and at most "
                                f"head_dim ({self.head_dim})")
        if self.qk_rope_head_dim > self.index_head_dim:
            raise MLAInputError(f"V4Config.index_head_dim ({self.index_head_dim}) must be at least qk_rope_head_dim "
                                f"({self.qk_rope_head_dim}): the indexer rotates that many trailing dims")
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            raise MLAInputError(f"V4Config.o_groups ({self.o_groups}) must divide num_attention_heads x head_dim "
                                f"({self.num_attention_heads * self.head_dim})")
        if self.rope_scaling is not None:
            rs = yarn_or_none(self.rope_scaling, "V4Config.rope_scaling")
            object.__setattr__(self, "rope_scaling", rs and {"rope_type": "yarn",
                                                             **{k: rs[k] for k in _YARN_KEYS if k in rs}})

    # ------------------------------------------------------------------ the judged layer
    @property
    def layer_type(self) -> str:
        return self.layer_types[self.layer]

    @property
    def compress_ratio(self) -> int:
        """The judged layer's ratio: 0 for a window-only layer, else compress_rates of its type."""
        return 0 if self.layer_type == SLIDING else self.compress_rates[self.layer_type]

    @property
    def overlap(self) -> bool:
        """CSA's compressor windows overlap (2 x ratio source tokens per entry, stride ratio); HCA's do not."""
        return self.layer_type == CSA

    @property
    def num_hidden_layers(self) -> int:
        return len(self.layer_types)

    def for_layer(self, layer: int) -> "V4Config":
        return dataclasses.replace(self, layer=layer)

    def first_layer_of(self, layer_type: str) -> "V4Config":
        if layer_type not in self.layer_types:
            raise MLAInputError(f"this V4 model has no {layer_type} layer (layer_types {sorted(set(self.layer_types))})")
        return self.for_layer(self.layer_types.index(layer_type))

    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """head_dim^-0.5: V4 has no YaRN mscale on the softmax scale (DeepSeek's Attention.softmax_scale)."""
        return self.head_dim ** -0.5

    def rope(self) -> tuple[float, dict | None]:
        """(theta, YaRN dict or None) of the judged layer: window-only layers use rope_theta without YaRN,
        compressed layers compress_rope_theta with rope_scaling (DeepSeek's Attention.__init__)."""
        if self.compress_ratio:
            return float(self.compress_rope_theta), self.rope_scaling
        return float(self.rope_theta), None

    def describe(self) -> str:
        m = self.compress_ratio
        kind = SHORT[self.layer_type] + (f" ratio {m}" if m else "")
        return (f"V4 layer {self.layer} ({kind}) hidden={self.hidden_size} heads={self.num_attention_heads} "
                f"head_dim={self.head_dim} rope={self.qk_rope_head_dim} q_lora={self.q_lora_rank} "
                f"o_groups={self.o_groups}x{self.o_lora_rank} window={self.sliding_window}"
                + (f" indexer({self.index_n_heads}x{self.index_head_dim}, topk {self.index_topk})"
                   if self.layer_type == CSA else ""))

    # ------------------------------------------------------------------ constructors
    @classmethod
    def preset(cls, name: str) -> "V4Config":
        try:
            fields = V4_PRESETS[name]
        except KeyError:
            raise MLAInputError(f"unknown DeepSeek-V4 preset {name!r}; known: {', '.join(sorted(V4_PRESETS))}") from None
        return cls(**copy.deepcopy(fields))

    @classmethod
    def from_hf(cls, config: Mapping[str, Any] | str | Path, *, layer: int = 0) -> "V4Config":
        """Read a Hugging Face ``deepseek_v4`` config (a dict, a config.json path or a checkpoint directory):
        ``layer_types`` or DeepSeek's per-layer ``compress_ratios`` (0/1 window only, 4 CSA, 128 HCA; an entry past
        num_hidden_layers, the MTP layer's, is dropped), ``compress_rates``, the nested ``rope_parameters``
        ({"main", "compress"}) or the flat ``rope_theta`` / ``compress_rope_theta`` / ``rope_scaling`` form."""
        config, source = hf_config_dict(config)
        try:
            n = int(config["num_hidden_layers"])
            rates = dict(config.get("compress_rates") or {CSA: 4, HCA: 128})
            for legacy, kind in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
                if config.get(legacy):
                    rates[kind] = int(config[legacy])
            types = config.get("layer_types")
            if not types and config.get("compress_ratios") is not None:
                by_ratio = {**_RATIO_TYPES, rates[CSA]: CSA, rates[HCA]: HCA}
                ratios = list(config["compress_ratios"])[:n]
                unknown = sorted({r for r in ratios if r not in by_ratio})
                if unknown:
                    raise CheckpointError(f"{source}: compress_ratios {unknown} are not V4 ratios "
                                          f"(0 window only, {rates[CSA]} CSA, {rates[HCA]} HCA)")
                types = [by_ratio[r] for r in ratios]
            if not types:
                raise CheckpointError(f"{source}: neither layer_types nor compress_ratios: the layers' attention "
                                      "types are unknown")
            rope_theta = config.get("rope_theta", 10000.0)
            compress_theta = config.get("compress_rope_theta", 160000.0)
            scaling = config.get("rope_scaling")
            params = config.get("rope_parameters")
            if isinstance(params, Mapping) and isinstance(params.get("main"), Mapping):
                rope_theta = params["main"].get("rope_theta", rope_theta)
                comp = dict(params.get("compress") or {})
                compress_theta = comp.get("rope_theta", compress_theta)
                scaling = comp if comp.get("rope_type", comp.get("type")) == "yarn" else None
            rope_dim = config.get("qk_rope_head_dim")
            if rope_dim is None and config.get("partial_rotary_factor"):
                rope_dim = int(int(config["head_dim"]) * float(config["partial_rotary_factor"]))
            return cls(
                hidden_size=int(config["hidden_size"]), num_attention_heads=int(config["num_attention_heads"]),
                layer_types=tuple(types[:n]), head_dim=int(config.get("head_dim", 512)),
                qk_rope_head_dim=int(rope_dim if rope_dim is not None else 64),
                q_lora_rank=int(config.get("q_lora_rank", 1024)), o_groups=int(config.get("o_groups", 8)),
                o_lora_rank=int(config.get("o_lora_rank", 1024)),
                sliding_window=int(config.get("sliding_window", 128)), compress_rates=rates,
                rope_theta=float(rope_theta), compress_rope_theta=float(compress_theta), rope_scaling=scaling,
                index_n_heads=int(config.get("index_n_heads", 64)),
                index_head_dim=int(config.get("index_head_dim", 128)),
                index_topk=int(config.get("index_topk", 512)), rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(config.get("max_position_embeddings", 1048576)), layer=layer)
        except KeyError as exc:
            raise CheckpointError(f"{source}: missing DeepSeek-V4 field {exc.args[0]!r}") from None

    def to_hf_dict(self) -> dict[str, Any]:
        """The attention fields as ``DeepseekV4Config`` keyword arguments (flat rope form)."""
        return {
            "hidden_size": self.hidden_size, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": 1, "head_dim": self.head_dim, "qk_rope_head_dim": self.qk_rope_head_dim,
            "q_lora_rank": self.q_lora_rank, "o_groups": self.o_groups, "o_lora_rank": self.o_lora_rank,
            "sliding_window": self.sliding_window, "num_hidden_layers": self.num_hidden_layers,
            "layer_types": list(self.layer_types), "compress_rates": dict(self.compress_rates),
            "rope_theta": self.rope_theta, "compress_rope_theta": self.compress_rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "index_n_heads": self.index_n_heads, "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk, "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
        }


def _alternating(n: int, first: str) -> list[str]:
    other = HCA if first == CSA else CSA
    return [first if i % 2 == 0 else other for i in range(n)]


#: V4's published attention shapes. V4-Flash (deepseek-ai/DeepSeek-V4-Flash config.json): 43 layers,
#: compress_ratios [0, 0, then 4 / 128 alternating from 4] (a 44th entry, 0, is the MTP layer's and not counted).
#: V4-Pro (deepseek-ai/DeepSeek-V4-Pro): 61 layers, compress_ratios [128, 128, then 4 / 128 alternating from 4].
#: Both: head_dim 512, rope 64, window 128, compress_rope_theta 160000 with YaRN x16 from 65536, rope_theta 10000.
_V4_YARN = {"rope_type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32,
            "beta_slow": 1}
V4_PRESETS: dict[str, dict[str, Any]] = {
    "deepseek-v4-flash": dict(hidden_size=4096, num_attention_heads=64, q_lora_rank=1024, o_groups=8,
                              o_lora_rank=1024, index_n_heads=64, index_head_dim=128, index_topk=512,
                              layer_types=[SLIDING] * 2 + _alternating(41, CSA), rope_scaling=_V4_YARN),
    "deepseek-v4-pro": dict(hidden_size=7168, num_attention_heads=128, q_lora_rank=1536, o_groups=16,
                            o_lora_rank=1024, index_n_heads=64, index_head_dim=128, index_topk=1024,
                            layer_types=[HCA] * 2 + _alternating(59, CSA), rope_scaling=_V4_YARN),
    # Numerics presets, one model holding every layer type (layer 0 window only, 1 CSA, 2 HCA), small enough for
    # CPU CI: window 8, CSA every 4 tokens (top-3 of the compressed entries), HCA every 16; YaRN x4 from 32 on the
    # compressed layers. Contexts of 20..70 tokens cross the window, several CSA entries and the HCA entries.
    "v4-tiny": dict(hidden_size=64, num_attention_heads=4, head_dim=32, qk_rope_head_dim=8, q_lora_rank=32,
                    o_groups=2, o_lora_rank=16, sliding_window=8, layer_types=[SLIDING, CSA, HCA],
                    compress_rates={CSA: 4, HCA: 16}, index_n_heads=2, index_head_dim=16, index_topk=3,
                    rope_scaling={"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 32,
                                  "beta_fast": 32, "beta_slow": 1}, max_position_embeddings=4096),
    # V4's own widths (head_dim 512, rope 64, index_head_dim 128, window 128, ratios 4 / 128) with few heads and a
    # small model width: the cache layouts (bytes, MODEL1 FP8 rows) at the real per-token sizes on CPU.
    "v4-mini": dict(hidden_size=256, num_attention_heads=2, q_lora_rank=64, o_groups=2, o_lora_rank=64,
                    index_n_heads=8, index_head_dim=128, index_topk=8, layer_types=[SLIDING, CSA, HCA],
                    rope_scaling=_V4_YARN),
}
#: the numerics presets' judged layers: suite id -> (preset, layer type)
TINY_LAYERS = {"swa": ("v4-tiny", SLIDING), "csa": ("v4-tiny", CSA), "hca": ("v4-tiny", HCA)}


def v4_config(preset: str, layer_type: str) -> V4Config:
    return V4Config.preset(preset).first_layer_of(layer_type)


# ============================================================================ weights

def expected_shapes(config: V4Config) -> dict[str, tuple[int, ...]]:
    """The judged layer's tensors, Hugging Face names relative to ``self_attn.`` (DeepseekV4Attention's state dict)."""
    h, H, D, qr = config.hidden_size, config.num_attention_heads, config.head_dim, config.q_lora_rank
    g, r = config.o_groups, config.o_lora_rank
    shapes = {
        "q_a_proj.weight": (qr, h), "q_a_norm.weight": (qr,), "q_b_proj.weight": (H * D, qr),
        "kv_proj.weight": (D, h), "kv_norm.weight": (D,),
        "o_a_proj.weight": (g * r, H * D // g), "o_b_proj.weight": (h, g * r), "sinks": (H,),
    }
    m = config.compress_ratio
    if m:
        coff = 2 if config.overlap else 1
        shapes.update({"compressor.kv_proj.weight": (coff * D, h), "compressor.gate_proj.weight": (coff * D, h),
                       "compressor.position_bias": (m, coff * D), "compressor.kv_norm.weight": (D,)})
    if config.layer_type == CSA:
        Di, Hi = config.index_head_dim, config.index_n_heads
        shapes.update({"compressor.indexer.kv_proj.weight": (2 * Di, h),
                       "compressor.indexer.gate_proj.weight": (2 * Di, h),
                       "compressor.indexer.position_bias": (m, 2 * Di),
                       "compressor.indexer.kv_norm.weight": (Di,),
                       "compressor.indexer.q_b_proj.weight": (Hi * Di, qr),
                       "compressor.indexer.scorer.weights_proj.weight": (Hi, h)})
    return shapes


#: DeepSeek's V4 inference/model.py names (layers.{L}.attn.*) -> Hugging Face names (model.layers.{L}.self_attn.*)
V4_REFERENCE_NAMES = {
    "wq_a.weight": "q_a_proj.weight", "q_norm.weight": "q_a_norm.weight", "wq_b.weight": "q_b_proj.weight",
    "wkv.weight": "kv_proj.weight", "kv_norm.weight": "kv_norm.weight", "wo_a.weight": "o_a_proj.weight",
    "wo_b.weight": "o_b_proj.weight", "attn_sink": "sinks",
    "compressor.wkv.weight": "compressor.kv_proj.weight", "compressor.wgate.weight": "compressor.gate_proj.weight",
    "compressor.ape": "compressor.position_bias", "compressor.norm.weight": "compressor.kv_norm.weight",
    "indexer.compressor.wkv.weight": "compressor.indexer.kv_proj.weight",
    "indexer.compressor.wgate.weight": "compressor.indexer.gate_proj.weight",
    "indexer.compressor.ape": "compressor.indexer.position_bias",
    "indexer.compressor.norm.weight": "compressor.indexer.kv_norm.weight",
    "indexer.wq_b.weight": "compressor.indexer.q_b_proj.weight",
    "indexer.weights_proj.weight": "compressor.indexer.scorer.weights_proj.weight",
}


class V4Weights(LayerTensors):
    """A read-only ``Mapping[str, Tensor]`` of one V4 attention layer's parameters (HF names), with ``.config``
    (a :class:`V4Config` whose ``layer`` is this layer). The same interface as :class:`MLAWeights`, so the layer
    driver runs a V4 backend as it runs an MLA one."""

    DTYPE_OF = "q_b_proj.weight"

    def __init__(self, config: V4Config, tensors: Mapping[str, torch.Tensor], *, source: str = "weights"):
        self.config = config
        shapes = expected_shapes(config)
        missing = [k for k in shapes if k not in tensors]
        if missing:
            raise CheckpointError(f"{source}: missing V4 attention tensor(s) {missing} for {config.describe()}")
        extra = sorted(set(tensors) - set(shapes))
        if extra:
            raise CheckpointError(f"{source}: unexpected tensor(s) {extra} for {config.describe()}")
        for name, shape in shapes.items():
            if tuple(tensors[name].shape) != shape:
                raise CheckpointError(f"{source}: tensor {name!r} has shape {tuple(tensors[name].shape)}, expected "
                                      f"{shape} for {config.describe()}")
        self._tensors = {k: tensors[k] for k in shapes}
        self.source = source

    def __repr__(self) -> str:
        return f"V4Weights({self.source}, {self.dtype}, {self.device}, {self.config.describe()})"

    def to(self, dtype: torch.dtype | None = None, device=None) -> "V4Weights":
        """A copy in ``dtype``; the sinks, position biases and norm weights stay float32 or wider, as DeepSeek keeps
        them (``attn_sink`` / ``ape`` are float32 parameters in its model; RMSNorm weights are float32 there too)."""
        def cast(name, t):
            keep = t.ndim == 1 or name.endswith("position_bias")
            target = dtype if not keep or dtype in (None, torch.float64, torch.float32) else torch.float32
            return t.to(device=device, dtype=target)
        return V4Weights(self.config, {k: cast(k, v) for k, v in self._tensors.items()}, source=self.source)

    def clone(self) -> "V4Weights":
        return V4Weights(self.config, {k: v.detach().clone() for k, v in self._tensors.items()}, source=self.source)

    @classmethod
    def random(cls, config: V4Config, *, seed: int = 0, dtype: torch.dtype = torch.float32,
               device="cpu") -> "V4Weights":
        """Deterministic, well-scaled random weights drawn in float64: projections std 1/sqrt(fan_in), the query
        with a gain of 2 (peaked attention shows masking bugs), norm weights 1 + small noise, sinks of order one
        (so the sink takes a visible share of the softmax), position biases of order one (so the compressor's
        gate is not uniform), the indexer's query with a gain (well-separated selections)."""
        gen = torch.Generator().manual_seed(int(seed))
        gains = {"q_b_proj.weight": 2.0, "o_b_proj.weight": 2.0, "compressor.indexer.q_b_proj.weight": 2.0,
                 "compressor.gate_proj.weight": 2.0, "compressor.indexer.gate_proj.weight": 2.0}
        tensors = {}
        for name, shape in expected_shapes(config).items():
            if name == "sinks":
                t = torch.randn(shape, generator=gen, dtype=torch.float64)
            elif name.endswith("position_bias"):
                t = torch.randn(shape, generator=gen, dtype=torch.float64)
            elif len(shape) == 1:
                t = 1.0 + 0.1 * torch.randn(shape, generator=gen, dtype=torch.float64)
            else:
                t = torch.randn(shape, generator=gen, dtype=torch.float64) * (gains.get(name, 1.0) / math.sqrt(shape[1]))
            tensors[name] = t
        return cls(config, tensors, source=f"random(seed={seed})").to(dtype, device=device)

    @classmethod
    def from_checkpoint(cls, directory: str | Path, *, layer: int = 0, config: V4Config | None = None,
                        dtype: torch.dtype | None = None) -> "V4Weights":
        """One layer's attention tensors from a safetensors checkpoint, under Hugging Face names
        (``model.layers.{L}.self_attn.*``) or DeepSeek's (``layers.{L}.attn.*``, V4_REFERENCE_NAMES)."""
        directory = Path(directory)
        ckpt = SafetensorsCheckpoint(directory)
        config = (config or V4Config.from_hf(directory)).for_layer(layer)
        wanted = expected_shapes(config)
        inverse = {hf: ref for ref, hf in V4_REFERENCE_NAMES.items()}
        names = {}
        for name in wanted:
            for full in (f"model.layers.{layer}.self_attn.{name}", f"layers.{layer}.attn.{inverse[name]}"):
                if full in ckpt:
                    names[name] = full
                    break
            else:
                raise CheckpointError(f"{directory}: layer {layer} attention tensor "
                                      f"'model.layers.{layer}.self_attn.{name}' (or 'layers.{layer}.attn."
                                      f"{inverse[name]}') is not in the checkpoint")
        read = ckpt.read(names.values())
        tensors = {n: (read[f] if dtype is None else read[f].to(dtype)) for n, f in names.items()}
        return cls(config, tensors, source=f"{directory}:layer{layer}")
