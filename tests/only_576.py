"""Built-in backends and reference-op restricted to DeepSeek's latent dims, kv_lora_rank 512 + qk_rope_head_dim 64
(576 / 512), as FlashMLA's, vLLM's CPU and TRT-LLM's MLA kernels are: what runs the golden suite on
fixtures/models/tiny-mla-576 (mla_conformance.checks.layer.golden.golden_model picks it for a backend that declines
the tiny model's 80 / 64). Everything else is the built-in's own code, unchanged:

    pytest suites/test_generation_golden.py --mla-backend tests/only_576.py:Absorbed576
    pytest suites/test_generation_golden.py --mla-backend op:tests/only_576.py:ReferenceOp576

(tests/test_tiny_mla_576.py runs them; the goldens ``tiny576-*`` were written with the first command and
``--snapshot-update``.)
"""

from __future__ import annotations

from mla_conformance.contract.op import D_QK, D_V
from mla_conformance.impl.ops.layer import head_dims_of
from mla_conformance.impl.ops.reference import ReferenceOp
from mla_conformance.specs import get_backend

DIMS_576 = (D_QK, D_V)


def latent_dims(config) -> tuple[int, int] | None:
    """(d_qk, d_v) of an MLA config's latent (impl.ops.layer.head_dims_of); None for a config without a latent."""
    return None if getattr(config, "kv_lora_rank", None) is None else head_dims_of(config)


class _Only576:
    """A built-in backend (``inner``) that declines every latent but 576 / 512 with a sentence, then asks the
    built-in; every other attribute is the built-in's."""

    inner = ""

    def __init__(self):
        self._inner = get_backend(self.inner)
        self.name = f"{self._inner.name}-576"

    def unsupported_reason(self, config, *, dtype, device, kv_codec="none"):
        dims = latent_dims(config)
        if dims != DIMS_576:
            return (f"{self.name} takes DeepSeek's latent only, kv_lora_rank 512 + qk_rope_head_dim 64 (576 / 512), "
                    f"as FlashMLA's and vLLM's CPU kernels do; this config's is "
                    f"{'none' if dims is None else f'{dims[0]} / {dims[1]}'}")
        return self._inner.unsupported_reason(config, dtype=dtype, device=device, kv_codec=kv_codec)

    def __getattr__(self, attr):
        if attr.startswith("__") or attr == "_inner":
            raise AttributeError(attr)
        return getattr(self._inner, attr)


class Absorbed576(_Only576):
    inner = "reference-absorbed"


class Naive576(_Only576):
    inner = "reference-naive"


class HF576(_Only576):
    inner = "hf-transformers"


class ReferenceOp576(ReferenceOp):
    """reference-op declaring the op contract's default head dims, 576 / 512 only (as the README's MyOp does, which
    declares none), instead of "any"."""

    name = "reference-op-576"
    head_dims = (DIMS_576,)
