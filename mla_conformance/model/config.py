"""MLA attention configuration with Hugging Face field names, published presets and YaRN math."""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path
from typing import Any, Mapping

from mla_conformance.errors import CheckpointError, MLAInputError
from mla_conformance.resources import read_json

_YARN_KEYS = (
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
)


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """One MLA attention layer, in the field names of a Hugging Face ``config.json``.

    Attributes:
        hidden_size: model width; input and output of the attention block.
        num_attention_heads: query heads (MLA has one shared latent "KV head").
        q_lora_rank: rank of the low-rank query path (q_a_proj -> norm -> q_b_proj); None = plain q_proj.
        kv_lora_rank: width of the cached latent c_KV (512 in every published DeepSeek model).
        qk_nope_head_dim: per-head query/key width without RoPE.
        qk_rope_head_dim: width of the decoupled RoPE key, shared by all heads and cached.
        v_head_dim: per-head value width.
        rms_norm_eps: epsilon of the q_a / kv_a RMSNorms.
        rope_theta: RoPE base.
        rope_scaling: None, or the YaRN dict of config.json (rope_type "yarn", factor, ...).
        max_position_embeddings: the extended context length.
        num_hidden_layers: layers of the whole model (for whole-model byte figures only).
        index_n_heads: DeepSeek Sparse Attention (V3.2): heads of the lightning indexer; None = dense MLA.
        index_head_dim: width of the indexer's query heads and of its one key per token (128 in V3.2).
        index_topk: tokens each query attends to after the indexer's selection (2048 in V3.2).
            The three are set together or not at all; DSA needs q_lora (the indexer query reads its latent).
        indexer_rope_interleave: the RoPE pair layout of the indexer's rotated dims, a model property (DSA
            only): False (default) = half-split pairs (x[i], x[i + r/2]), DeepSeek-V3.2's (its corrected
            reference of 2025-11-18, transformers' DeepseekV32); True = interleaved pairs (x[2i], x[2i+1]),
            MLA's own layout, as GLM-5's DSA configs declare (transformers' GlmMoeDsa
            ``indexer_rope_interleave``). Read from a Hugging Face config where present.
    """

    hidden_size: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Mapping[str, Any] | None = None
    max_position_embeddings: int = 4096
    num_hidden_layers: int = 1
    index_n_heads: int | None = None
    index_head_dim: int | None = None
    index_topk: int | None = None
    indexer_rope_interleave: bool = False

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
                     "qk_rope_head_dim", "v_head_dim", "max_position_embeddings", "num_hidden_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise MLAInputError(f"MLAConfig.{name} must be a positive integer, got {value!r}")
        if self.qk_rope_head_dim % 2:
            raise MLAInputError(f"MLAConfig.qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if self.rope_scaling is not None:
            object.__setattr__(self, "rope_scaling", yarn_or_none(self.rope_scaling, "MLAConfig.rope_scaling"))
        dsa = {name: getattr(self, name) for name in DSA_FIELDS}
        if self.indexer_rope_interleave and all(v is None for v in dsa.values()):
            raise MLAInputError("MLAConfig.indexer_rope_interleave is a DeepSeek Sparse Attention field (the "
                                "indexer's RoPE layout); this config has no indexer (index_topk unset)")
        if any(v is not None for v in dsa.values()):
            unset = [k for k, v in dsa.items() if v is None]
            if unset:
                raise MLAInputError(f"MLAConfig: DeepSeek Sparse Attention needs {', '.join(DSA_FIELDS)} together; "
                                    f"{', '.join(unset)} unset")
            for name, value in dsa.items():
                if not isinstance(value, int) or value <= 0:
                    raise MLAInputError(f"MLAConfig.{name} must be a positive integer, got {value!r}")
            if self.q_lora_rank is None:
                raise MLAInputError("MLAConfig: DeepSeek Sparse Attention needs q_lora_rank (the indexer's query "
                                    "is projected from the q_lora latent)")
            if not isinstance(self.indexer_rope_interleave, bool):
                raise MLAInputError(f"MLAConfig.indexer_rope_interleave must be True or False, got "
                                    f"{self.indexer_rope_interleave!r}")
            if self.index_head_dim < self.qk_rope_head_dim:
                raise MLAInputError(f"MLAConfig.index_head_dim ({self.index_head_dim}) must be at least "
                                    f"qk_rope_head_dim ({self.qk_rope_head_dim}): the indexer rotates that many dims")

    # ------------------------------------------------------------------ derived sizes
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Elements a latent cache stores per token per layer: c_KV + k_pe (576 at DeepSeek dims)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def expanded_dim(self) -> int:
        """Elements an expanded (naive) cache stores per token per layer: H x (qk_head + v)."""
        return self.num_attention_heads * (self.qk_head_dim + self.v_head_dim)

    @property
    def dsa(self) -> bool:
        """True for DeepSeek Sparse Attention (a lightning indexer selects index_topk tokens per query)."""
        return self.index_topk is not None

    @property
    def yarn(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(qk_head_dim), times YaRN mscale(factor, mscale_all_dim)^2 when YaRN is on."""
        scale = self.qk_head_dim ** -0.5
        y = self.yarn
        if y and y.get("mscale_all_dim"):
            m = yarn_get_mscale(float(y["factor"]), float(y["mscale_all_dim"]))
            scale = scale * m * m
        return scale

    @property
    def rope_attention_factor(self) -> float:
        """The factor YaRN multiplies cos/sin by: mscale(factor, mscale) / mscale(factor, mscale_all_dim)."""
        y = self.yarn
        if not y:
            return 1.0
        if y.get("attention_factor") is not None:
            return float(y["attention_factor"])
        factor = float(y["factor"])
        mscale, mscale_all = y.get("mscale"), y.get("mscale_all_dim")
        if mscale and mscale_all:
            return yarn_get_mscale(factor, float(mscale)) / yarn_get_mscale(factor, float(mscale_all))
        return yarn_get_mscale(factor, 1.0)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def preset(cls, name: str) -> "MLAConfig":
        try:
            fields = PRESETS[name]
        except KeyError:
            raise MLAInputError(
                f"unknown MLA preset {name!r}; known presets: {', '.join(sorted(PRESETS))}"
            ) from None
        return cls(**copy.deepcopy(fields))

    @classmethod
    def from_hf(cls, config: Mapping[str, Any] | str | Path) -> "MLAConfig":
        """Read a Hugging Face DeepSeek config: a dict, a config.json path, or a checkpoint directory.

        Accepts the old ``rope_scaling`` + ``rope_theta`` form and the new ``rope_parameters`` form.
        """
        config, source = hf_config_dict(config)
        # DeepSeek-V3 reference names (inference/model.py ModelArgs) map onto the HF ones.
        aliases = {"dim": "hidden_size", "n_heads": "num_attention_heads", "n_layers": "num_hidden_layers",
                   "original_seq_len": None}
        for old, new in aliases.items():
            if old in config and new and new not in config:
                config[new] = config[old]
        rope_theta = config.get("rope_theta")
        rope_scaling = config.get("rope_scaling")
        params = config.get("rope_parameters")
        if isinstance(params, Mapping):
            params = dict(params)
            rope_theta = params.pop("rope_theta", rope_theta)
            kind = params.get("rope_type", params.get("type", "default"))
            rope_scaling = params if kind == "yarn" else None
        if isinstance(rope_scaling, Mapping):
            rope_scaling = dict(rope_scaling)
            kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
            if kind == "yarn":
                rope_scaling = {"rope_type": "yarn", **{k: rope_scaling[k] for k in _YARN_KEYS if k in rope_scaling}}
            else:
                rope_scaling = None
        try:
            return cls(
                hidden_size=int(config["hidden_size"]),
                num_attention_heads=int(config["num_attention_heads"]),
                q_lora_rank=None if config.get("q_lora_rank") in (None, 0) else int(config["q_lora_rank"]),
                kv_lora_rank=int(config["kv_lora_rank"]),
                qk_nope_head_dim=int(config["qk_nope_head_dim"]),
                qk_rope_head_dim=int(config["qk_rope_head_dim"]),
                v_head_dim=int(config["v_head_dim"]),
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
                rope_scaling=rope_scaling,
                max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
                num_hidden_layers=int(config.get("num_hidden_layers", 1)),
                **_dsa_fields(config),
            )
        except KeyError as exc:
            raise CheckpointError(f"{source}: missing MLA field {exc.args[0]!r}") from None

    def to_hf_dict(self) -> dict[str, Any]:
        """The attention fields in the config.json (old ``rope_scaling``) form."""
        d = dataclasses.asdict(self)
        d["rope_scaling"] = dict(self.rope_scaling) if self.rope_scaling else None
        if not self.dsa:  # dense MLA: the dict is what it was before DSA fields existed
            for name in (*DSA_FIELDS, "indexer_rope_interleave"):
                d.pop(name)
        return d

    def describe(self) -> str:
        q = f"q_lora={self.q_lora_rank}" if self.q_lora_rank else "q_proj"
        y = self.yarn
        rope = f"yarn x{y['factor']:g} from {y['original_max_position_embeddings']}" if y else "plain rope"
        return (f"hidden={self.hidden_size} heads={self.num_attention_heads} {q} kv_lora={self.kv_lora_rank} "
                f"nope={self.qk_nope_head_dim} rope={self.qk_rope_head_dim} v={self.v_head_dim} {rope}"
                + (f" dsa(index_heads={self.index_n_heads} index_dim={self.index_head_dim} "
                   f"topk={self.index_topk}{' rope=interleaved' if self.indexer_rope_interleave else ''})"
                   if self.dsa else ""))


#: The DeepSeek Sparse Attention fields (Hugging Face DeepseekV32Config names); None = dense MLA.
DSA_FIELDS = ("index_n_heads", "index_head_dim", "index_topk")

#: transformers' DeepseekV32Config defaults (= DeepSeek-V3.2's published values), used for a
#: ``model_type: deepseek_v32`` config.json that leaves a field out, as transformers itself would.
_V32_DSA_DEFAULTS = {"index_n_heads": 64, "index_head_dim": 128, "index_topk": 2048}
#: transformers' GlmMoeDsaConfig defaults (``model_type: glm_moe_dsa``), whose indexer RoPE is interleaved
_GLM_DSA_DEFAULTS = {"index_n_heads": 32, "index_head_dim": 128, "index_topk": 2048}


def _dsa_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """The DSA fields of a HF (or DeepSeek reference, same names) config; {} for dense MLA. The indexer's
    RoPE layout is read from ``indexer_rope_interleave`` where the config has it (GLM-MoE-DSA), else it is
    DeepSeek-V3.2's half-split."""
    present = {k: config.get(k) for k in DSA_FIELDS if config.get(k) is not None}
    if config.get("model_type") == "deepseek_v32":
        present = {**_V32_DSA_DEFAULTS, **present}
    if config.get("model_type") == "glm_moe_dsa":
        present = {**_GLM_DSA_DEFAULTS, **present}
    out: dict[str, Any] = {k: int(v) for k, v in present.items()}
    interleave = config.get("indexer_rope_interleave")
    if interleave is None and config.get("model_type") == "glm_moe_dsa":
        interleave = True  # transformers' GlmMoeDsaIndexer rotates interleaved pairs whatever the config says
    if interleave is not None:
        if not isinstance(interleave, bool):
            raise CheckpointError(f"indexer_rope_interleave must be true or false, got {interleave!r}")
        if out or interleave:
            out["indexer_rope_interleave"] = interleave
    return out


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature: 0.1 * mscale * ln(scale) + 1 (1 when scale <= 1)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def hf_config_dict(config: Mapping[str, Any] | str | Path) -> tuple[dict[str, Any], str]:
    """(a Hugging Face config as a dict, where it came from): a dict or a config object (``to_dict``), a config.json
    path or a checkpoint directory (a missing or unreadable file is a CheckpointError naming it)."""
    if isinstance(config, (str, Path)):
        path = Path(config)
        if path.is_dir():
            path = path / "config.json"
        return read_json(path, missing="no such file (expected a Hugging Face config.json)",
                         error=CheckpointError), str(path)
    if hasattr(config, "to_dict") and not isinstance(config, Mapping):
        config = config.to_dict()
    return dict(config), "config dict"


def yarn_or_none(rope_scaling: Mapping[str, Any], where: str) -> dict[str, Any] | None:
    """A config's ``rope_scaling`` as this package keeps it: the YaRN dict (checked for factor and
    original_max_position_embeddings), None for "default"; any other rope type is an MLAInputError naming ``where``."""
    rs = dict(rope_scaling)
    kind = rs.get("rope_type", rs.get("type"))
    if kind not in ("yarn", "default", None):
        raise MLAInputError(f"{where}: only 'yarn' is supported, got rope_type={kind!r}")
    if kind == "yarn":
        for key in ("factor", "original_max_position_embeddings"):
            if key not in rs:
                raise MLAInputError(f"{where} (yarn) needs '{key}'")
    return rs if kind == "yarn" else None


def rope_inv_freq(config: MLAConfig, dtype=None):
    """Inverse RoPE frequencies [qk_rope_head_dim / 2] of an MLA config (:func:`yarn_inv_freq`)."""
    import torch  # the config module is torch-free until frequencies are asked for

    return yarn_inv_freq(config.qk_rope_head_dim, config.rope_theta, config.yarn).to(dtype or torch.float64)


def yarn_inv_freq(dim: int, base: float, y: Mapping[str, Any] | None):
    """Inverse RoPE frequencies [dim / 2] in float64, with YaRN's ramp when ``y`` (a YaRN dict) is given.

    Written from the YaRN paper / DeepSeek-V3 ``precompute_freqs_cis`` (DeepSeek-V4's is the same function):
    dimensions whose wavelength is shorter than the original context rotate as trained (extrapolation), long ones
    are divided by ``factor`` (interpolation), with a linear ramp between the beta_fast and beta_slow corrections.
    """
    import torch  # the config module is torch-free until frequencies are asked for

    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if y:
        factor = float(y["factor"])
        original = float(y["original_max_position_embeddings"])
        beta_fast = float(y.get("beta_fast") or 32)
        beta_slow = float(y.get("beta_slow") or 1)

        def correction_dim(rotations: float) -> float:
            return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(correction_dim(beta_fast)), 0)
        high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        smooth = 1 - ramp  # 1 = keep the trained frequency, 0 = interpolate
        freqs = freqs / factor * (1 - smooth) + freqs * smooth
    return freqs


_V2_YARN = {"rope_type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
            "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}
_V3_YARN = {"rope_type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}

#: Published config.json values (attention fields) of each model, plus two small numerics presets:
#:
#: * ``tiny``: the attention of the trained fixture model in fixtures/models/tiny-mla (q_lora on, YaRN
#:   from 64 positions; softmax mscale(factor, mscale_all_dim)^2 != 1);
#: * ``v3-mini``: DeepSeek-V3 head dims (kv_lora 512, nope 128, rope 64, v 128) with q_lora (rank 96),
#:   2 heads, hidden 256 and YaRN from 128 positions, so checks.SCENARIOS' long_context crosses
#:   original_max_position_embeddings.
#: * ``tiny-dsa``: ``tiny`` with DeepSeek Sparse Attention (4 indexer heads of 32, top-16), so selection
#:   bites from the 17th token on CPU.
#: * ``v3.2-mini``: ``v3-mini`` with V3.2's indexer key width (4 indexer heads of 128, top-16): the V3.2
#:   cache layouts (latent 512 + rope 64 + indexer 128; the FP8 656 + 132 bytes) at a CPU-sized model, and
#:   V3.2's half-split indexer RoPE.
#: * ``glm-dsa-mini``: ``v3.2-mini`` with the indexer's RoPE in interleaved pairs
#:   (``indexer_rope_interleave=True``), as GLM-5's DSA configs (GLM-MoE-DSA) declare.
#:
#: ``deepseek-v3.2`` carries V3.2's published indexer (64 heads of 128, top-2048: DeepSeek-V3.2-Exp
#: inference/config_671B_v3.2.json and transformers' DeepseekV32Config defaults). Every preset has mscale == mscale_all_dim, as every published DeepSeek config does: YaRN's cos/sin
#: factor mscale(mscale)/mscale(mscale_all_dim) is then 1, a point on which transformers / DeepSeek-V2
#: modeling and DeepSeek-V3's reference inference/model.py agree. Where they differ (mscale !=
#: mscale_all_dim) is a stated convention, tested by suites/test_conventions.py, not imposed here.
PRESETS: dict[str, dict[str, Any]] = {
    "deepseek-v2-lite": dict(hidden_size=2048, num_attention_heads=16, q_lora_rank=None, kv_lora_rank=512,
                             qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, rms_norm_eps=1e-6,
                             rope_theta=10000.0, rope_scaling=_V2_YARN, max_position_embeddings=163840,
                             num_hidden_layers=27),
    "deepseek-v2": dict(hidden_size=5120, num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512,
                        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, rms_norm_eps=1e-6,
                        rope_theta=10000.0, rope_scaling=_V2_YARN, max_position_embeddings=163840,
                        num_hidden_layers=60),
    "deepseek-v3": dict(hidden_size=7168, num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512,
                        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, rms_norm_eps=1e-6,
                        rope_theta=10000.0, rope_scaling=_V3_YARN, max_position_embeddings=163840,
                        num_hidden_layers=61),
    "tiny": dict(hidden_size=128, num_attention_heads=4, q_lora_rank=64, kv_lora_rank=64,
                 qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, rms_norm_eps=1e-6,
                 rope_theta=10000.0,
                 rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                               "beta_fast": 32, "beta_slow": 1, "mscale": 0.8, "mscale_all_dim": 0.8},
                 max_position_embeddings=256, num_hidden_layers=2),
    "v3-mini": dict(hidden_size=256, num_attention_heads=2, q_lora_rank=96, kv_lora_rank=512,
                    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, rms_norm_eps=1e-6,
                    rope_theta=10000.0,
                    rope_scaling={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 128,
                                  "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
                    max_position_embeddings=1024, num_hidden_layers=2),
}

# the DSA presets are their dense counterparts plus the lightning indexer (V3.2's published 64 / 128 / 2048)
PRESETS["deepseek-v3.2"] = {**PRESETS["deepseek-v3"], "index_n_heads": 64, "index_head_dim": 128, "index_topk": 2048}
PRESETS["tiny-dsa"] = {**PRESETS["tiny"], "index_n_heads": 4, "index_head_dim": 32, "index_topk": 16}
PRESETS["v3.2-mini"] = {**PRESETS["v3-mini"], "index_n_heads": 4, "index_head_dim": 128, "index_topk": 16}
PRESETS["glm-dsa-mini"] = {**PRESETS["v3.2-mini"], "indexer_rope_interleave": True}


def expected_shapes(config: MLAConfig) -> dict[str, tuple[int, ...]]:
    """The HF parameter names of one attention layer and their shapes (nn.Linear: [out, in])."""
    c = config
    shapes: dict[str, tuple[int, ...]] = {}
    if c.q_lora_rank is None:
        shapes["q_proj.weight"] = (c.num_attention_heads * c.qk_head_dim, c.hidden_size)
    else:
        shapes["q_a_proj.weight"] = (c.q_lora_rank, c.hidden_size)
        shapes["q_a_layernorm.weight"] = (c.q_lora_rank,)
        shapes["q_b_proj.weight"] = (c.num_attention_heads * c.qk_head_dim, c.q_lora_rank)
    shapes["kv_a_proj_with_mqa.weight"] = (c.kv_lora_rank + c.qk_rope_head_dim, c.hidden_size)
    shapes["kv_a_layernorm.weight"] = (c.kv_lora_rank,)
    shapes["kv_b_proj.weight"] = (c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)
    shapes["o_proj.weight"] = (c.hidden_size, c.num_attention_heads * c.v_head_dim)
    if c.dsa:  # DeepSeek Sparse Attention's lightning indexer, transformers' DeepseekV32Indexer names
        shapes["indexer.wq_b.weight"] = (c.index_n_heads * c.index_head_dim, c.q_lora_rank)
        shapes["indexer.wk.weight"] = (c.index_head_dim, c.hidden_size)
        shapes["indexer.k_norm.weight"] = (c.index_head_dim,)   # a LayerNorm, with bias
        shapes["indexer.k_norm.bias"] = (c.index_head_dim,)
        shapes["indexer.weights_proj.weight"] = (c.index_n_heads, c.hidden_size)
    return shapes
