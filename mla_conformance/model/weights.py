"""One layer's MLA attention parameters, keyed by Hugging Face names relative to ``self_attn.``."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Iterator

import torch

from mla_conformance.model.checkpoint import SafetensorsCheckpoint
from mla_conformance.model.config import MLAConfig, expected_shapes
from mla_conformance.errors import CheckpointError

#: DeepSeek-V3 ``inference/model.py`` names -> Hugging Face names (seed 000, section 3.3).
V3_REFERENCE_NAMES = {
    "wq.weight": "q_proj.weight",
    "wq_a.weight": "q_a_proj.weight",
    "q_norm.weight": "q_a_layernorm.weight",
    "wq_b.weight": "q_b_proj.weight",
    "wkv_a.weight": "kv_a_proj_with_mqa.weight",
    "kv_norm.weight": "kv_a_layernorm.weight",
    "wkv_b.weight": "kv_b_proj.weight",
    "wo.weight": "o_proj.weight",
    # DeepSeek Sparse Attention (V3.2) indexer: the same names under both prefixes (DeepSeek-V3.2-Exp
    # inference/convert.py maps wq_b/wk/k_norm/weights_proj to themselves), so only the prefix differs:
    # model.layers.{L}.self_attn.indexer.* (HF) or layers.{L}.attn.indexer.* (reference).
    "indexer.wq_b.weight": "indexer.wq_b.weight",
    "indexer.wk.weight": "indexer.wk.weight",
    "indexer.k_norm.weight": "indexer.k_norm.weight",
    "indexer.k_norm.bias": "indexer.k_norm.bias",
    "indexer.weights_proj.weight": "indexer.weights_proj.weight",
}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality, compared as int64 words where the bytes allow (torch.equal on bfloat16 converts every
    element: 5x slower at V2-Lite dims)."""
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    if a.dtype == torch.bool or a.dtype.is_complex or a.numel() == 0:
        return torch.equal(a, b)
    a, b = a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    if a.numel() % 8 == 0:
        a, b = a.view(torch.int64), b.view(torch.int64)
    return torch.equal(a, b)


class LayerTensors(Mapping):
    """A read-only ``Mapping[str, Tensor]`` of one attention layer's parameters (``_tensors``), with ``.config``:
    what MLA's and DeepSeek-V4's layer weights share. ``DTYPE_OF`` names the tensor whose dtype and device are the
    weights' own."""

    DTYPE_OF = ""

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._tensors[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    @property
    def dtype(self) -> torch.dtype:
        return self._tensors[self.DTYPE_OF].dtype

    @property
    def device(self) -> torch.device:
        return self._tensors[self.DTYPE_OF].device

    def changed_from(self, other: "LayerTensors") -> list[str]:
        """Names of the tensors whose bits differ from ``other``'s (same names, shapes and dtypes): a write, even of
        an equal value (-0.0 for 0.0), is a change; a NaN left alone is not."""
        return [k for k, v in self._tensors.items() if not same_bits(v, other[k])]


class MLAWeights(LayerTensors):
    """A read-only ``Mapping[str, Tensor]`` of one attention layer's parameters, with ``.config``."""

    DTYPE_OF = "kv_b_proj.weight"

    def __init__(self, config: MLAConfig, tensors: Mapping[str, torch.Tensor], *, source: str = "weights"):
        self.config = config
        shapes = expected_shapes(config)
        missing = [k for k in shapes if k not in tensors]
        if missing:
            raise CheckpointError(f"{source}: missing attention tensor(s) {missing}")
        extra = sorted(set(tensors) - set(shapes))
        if extra:
            raise CheckpointError(f"{source}: unexpected tensor(s) {extra} for this config "
                                  f"({'q_lora' if config.q_lora_rank else 'no q_lora'}"
                                  f"{', DSA' if config.dsa else ', dense: no indexer'})")
        for name, shape in shapes.items():
            if tuple(tensors[name].shape) != shape:
                raise CheckpointError(f"{source}: tensor {name!r} has shape {tuple(tensors[name].shape)}, "
                                      f"expected {shape} for {config.describe()}")
        self._tensors = {k: tensors[k] for k in shapes}
        self.source = source

    def __repr__(self) -> str:
        t = next(iter(self._tensors.values()))
        return f"MLAWeights({self.source}, {t.dtype}, {t.device}, {self.config.describe()})"

    def to(self, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> "MLAWeights":
        return MLAWeights(self.config, {k: v.to(device=device, dtype=dtype) for k, v in self._tensors.items()},
                          source=self.source)

    def clone(self) -> "MLAWeights":
        """Own copies of every tensor: what a backend gets, so it cannot change anyone else's weights."""
        return MLAWeights(self.config, {k: v.detach().clone() for k, v in self._tensors.items()},
                          source=self.source)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def random(cls, config: MLAConfig, *, seed: int = 0, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu", draw_dtype: torch.dtype = torch.float64,
               period: int | None = None) -> "MLAWeights":
        """Deterministic, well-scaled random weights (drawn in ``draw_dtype``, float64 by default, on CPU,
        then cast).

        Linear layers have std 1/sqrt(fan_in) so projections of an RMS-normalised input stay of order
        one; the query gets a gain so attention is peaked rather than uniform (uniform attention would
        hide position and masking bugs); norm weights are 1 + small noise, norm biases (the DSA
        indexer's k_norm) small noise; o_proj is scaled so outputs are of order one, not tiny. The indexer
        tensors are drawn after the dense ones, so a DSA config's attention weights equal its dense twin's.

        ``period``: draw only the first ``period`` columns of each matrix and repeat them along the row (the same
        scale: a projection's output keeps unit variance). For checks that need finite, well-scaled values and
        nothing else (the byte checks: at DeepSeek-V3 dims a full draw is 180M values, most of a byte test's time).
        """
        gen = torch.Generator().manual_seed(int(seed))
        tensors = {}
        gains = {"q_proj.weight": 2.0, "q_b_proj.weight": 2.0, "o_proj.weight": 3.0}
        for name, shape in expected_shapes(config).items():
            if name.endswith(".bias"):
                t = 0.1 * torch.randn(shape, generator=gen, dtype=draw_dtype)
            elif len(shape) == 1:
                t = 1.0 + 0.1 * torch.randn(shape, generator=gen, dtype=draw_dtype)
            elif period is not None and shape[1] > period:
                t = torch.randn((shape[0], period), generator=gen, dtype=draw_dtype)
                t = t.mul_(gains.get(name, 1.0) / math.sqrt(shape[1])).to(device=device, dtype=dtype)  # cast, then tile
                t = t.repeat(1, -(-shape[1] // period))[:, :shape[1]].contiguous()
            else:
                t = torch.randn(shape, generator=gen, dtype=draw_dtype) / math.sqrt(shape[1])
                t = t * gains.get(name, 1.0)
            tensors[name] = t.to(device=device, dtype=dtype)
        return cls(config, tensors, source=f"random(seed={seed})")

    @classmethod
    def from_checkpoint(cls, directory: str | Path, *, layer: int = 0, config: MLAConfig | None = None,
                        dtype: torch.dtype | None = None) -> "MLAWeights":
        """Read one layer's attention tensors (and only those) from a safetensors checkpoint.

        Accepts Hugging Face names (``model.layers.{L}.self_attn.*``) and DeepSeek-V3 reference names
        (``layers.{L}.attn.wq.weight`` ...); a DSA config also reads the indexer (``indexer.*``, the same
        suffixes under either prefix). ``config`` defaults to the directory's config.json.
        """
        directory = Path(directory)
        ckpt = SafetensorsCheckpoint(directory)
        config = config or MLAConfig.from_hf(directory)
        wanted = expected_shapes(config)
        hf_prefix = f"model.layers.{layer}.self_attn."
        v3_prefix = f"layers.{layer}.attn."
        inverse = {hf: v3 for v3, hf in V3_REFERENCE_NAMES.items()}
        names = {}
        for name in wanted:
            if hf_prefix + name in ckpt:
                names[name] = hf_prefix + name
            elif v3_prefix + inverse[name] in ckpt:
                names[name] = v3_prefix + inverse[name]
            else:
                raise CheckpointError(f"{directory}: layer {layer} attention tensor {hf_prefix + name!r} "
                                      f"(or {v3_prefix + inverse[name]!r}) is not in the checkpoint")
        read = ckpt.read(names.values())
        tensors = {}
        for name, full in names.items():
            t = read[full]
            if tuple(t.shape) != wanted[name]:
                raise CheckpointError(f"{ckpt.file_of(full)}: tensor {full!r} has shape {tuple(t.shape)}, "
                                      f"expected {wanted[name]} for {config.describe()}")
            tensors[name] = t if dtype is None else t.to(dtype)
        return cls(config, tensors, source=f"{directory}:layer{layer}")
