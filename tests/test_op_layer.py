"""OpBackend (mla_conformance.impl.ops.layer): an op behind the layer contract, and the ``op:SPEC`` backend spec.

``pytest suites --mla-backend op:reference-op`` runs the whole layer suite through the wrapper; these tests
keep the wrapper's own behaviour checked in the default run, cheaply: numerics against the float64 oracle at
V3 / V2-Lite latent dims (kv_lora 512 + rope 64, the op contract's 576), the spec forms and their errors, the
sentences it declines with, and an op's bad output reported as the op's.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from mla_conformance import MLAConfig, MLAWeights, arch, checks
from mla_conformance.contract.op import METHODS, declarations, methods_of
from mla_conformance.specs import get_backend, get_op
from mla_conformance.errors import BackendSpecError
from mla_conformance.impl.ops.layer import OpBackend
from mla_conformance.impl.ops.reference import ReferenceOp

V3_MINI = MLAConfig.preset("v3-mini")  # kv_lora 512 + rope 64, 2 heads: cheap on a CPU
BF16 = torch.bfloat16


def test_reference_op_through_the_layer_contract_against_float64(mla_figures):
    """checks.numerics (prefill of 23 / 16 / 7 tokens in one padded call, then 4 decode steps) raises on failure."""
    m = checks.numerics(OpBackend(ReferenceOp()), "v3-mini", "varlen_batch", torch.float32)
    mla_figures.update(m)


def test_op_spec_resolves_to_the_wrapper():
    backend = get_backend("op:reference-op")
    assert isinstance(backend, OpBackend) and isinstance(backend.op, ReferenceOp)
    assert backend.name == "op:reference-op" and backend.supports_paging and backend.cache_format == "latent"
    assert backend.page_block_sizes == (1, 16, 64) and backend.page_block_size == 64
    assert backend.kv_codecs == ("none", "fp8-e4m3-flashmla")
    assert get_backend(" op:mla_conformance.impl.ops.reference:ReferenceOp ").name == "op:reference-op"
    cache = backend.new_cache(V3_MINI, batch_size=2, capacity=20, dtype=BF16, device="cpu", page_block_size=16)
    assert cache.page_block_size == 16 and cache.kv_pages.shape[1:] == (16, 1, 576)
    with pytest.raises(ValueError, match="pages of 1, 16, 64 tokens, not 32"):
        backend.new_cache(V3_MINI, batch_size=2, capacity=20, dtype=BF16, device="cpu", page_block_size=32)


def test_op_spec_from_a_file(tmp_path):
    path = tmp_path / "my_op.py"
    path.write_text(textwrap.dedent("""
        from mla_conformance.impl.ops.reference import ReferenceOp

        class MyOp(ReferenceOp):
            name = "my-op"
            page_block_sizes = (16,)
    """))
    backend = get_backend(f"op:{path}:MyOp")
    assert backend.name == "op:my-op" and backend.page_block_size == 16


@pytest.mark.parametrize("spec,needles", [
    ("op:", ["'op:'", "needs an op spec", "reference-op"]),
    ("op:referense-op", ["'op:referense-op'", "did you mean 'reference-op'"]),
    ("op:mla_conformance.impl.ops.reference:oracle", ["not an op", "missing unsupported_reason"]),
    ("op:no/such/file.py:Op", ["'no/such/file.py'", "does not exist"]),
    ("op:mla_conformance.impl.ops.reference:NoSuch", ["has no attribute 'NoSuch'"]),
    ("reference-op", ["is an op", "'op:reference-op'"]),
])
def test_bad_op_specs_say_what_is_wrong(spec, needles):
    with pytest.raises(BackendSpecError) as info:
        get_backend(spec)
    msg = str(info.value)
    assert msg.startswith(f"backend spec {spec!r}: "), msg
    for needle in needles:
        assert needle in msg, msg


class _SingleTokenOp(ReferenceOp):
    """An op that decodes one query per row only (XQA-like): the wrapper needs multi-token causal decode."""

    name = "single-token"

    def unsupported_reason(self, case):
        return f"{self.name} decodes one query per row, not s_q {case.s_q}" if case.s_q > 1 else None


class _DefaultDimsOp(ReferenceOp):
    """reference-op declaring only the op contract's default head dims (576 / 512)."""

    name = "default-dims"
    head_dims = None


@pytest.mark.parametrize("config,kwargs,needle", [
    ("tiny", dict(op=_DefaultDimsOp), "kv_lora_rank 64 and qk_rope_head_dim 16"),
    ("tiny-dsa", {}, "DeepSeek Sparse Attention"),
    ("v3-mini", dict(kv_codec="int8-g16"), "kv_codec 'int8-g16' is neither"),
    ("v3-mini", dict(kv_codec="fp8-e4m3-flashmla", dtype=torch.float32), "needs cache dtype bfloat16"),
])
def test_what_the_wrapper_declines(config, kwargs, needle):
    op = kwargs.pop("op", ReferenceOp)
    args = {"dtype": BF16, "device": "cpu", "kv_codec": "none", **kwargs}
    backend = OpBackend(op())
    reason = backend.unsupported_reason(MLAConfig.preset(config), **args)
    assert reason and needle in reason, reason
    assert backend.unsupported_reason(V3_MINI, dtype=BF16, device="cpu", kv_codec="none") is None
    assert backend.unsupported_reason(V3_MINI, dtype=BF16, device="cpu", kv_codec="fp8-e4m3-flashmla") is None


def test_the_ops_own_sentences_pass_through():
    reason = OpBackend(_SingleTokenOp()).unsupported_reason(V3_MINI, dtype=BF16, device="cpu", kv_codec="none")
    assert reason == "single-token decodes one query per row, not s_q 2"
    latent_only = type("LatentOnly", (ReferenceOp,), {"name": "latent-only", "kv_formats": ("latent",)})()
    reason = OpBackend(latent_only).unsupported_reason(V3_MINI, dtype=BF16, device="cpu",
                                                       kv_codec="fp8-e4m3-flashmla")
    assert reason == "op latent-only reads kv formats latent, not 'fp8-e4m3-flashmla' (kv_codec 'fp8-e4m3-flashmla')"
    flashmla = get_backend("op:flashmla")
    expected = arch.why_not("flashmla/dense_decode", arch.detect("cpu"))
    if expected is not None:
        assert flashmla.unsupported_reason(V3_MINI, dtype=BF16, device="cpu", kv_codec="none") == expected


def test_a_bad_op_output_is_named():
    class WrongShape(ReferenceOp):
        name = "wrong-shape"

        def decode(self, q, *args, **kwargs):
            out, lse = super().decode(q, *args, **kwargs)
            return out[..., :256], lse

    backend = OpBackend(WrongShape())
    w = checks.weights_for("v3-mini", torch.float32)
    cache = backend.new_cache(w.config, batch_size=1, capacity=4, dtype=torch.float32, device="cpu")
    x = torch.randn(1, 2, w.config.hidden_size)
    with pytest.raises(ValueError, match=r"op wrong-shape: decode\(\) returned out \(1, 2, 2, 256\), expected \(1, 2, 2, 512\)"):
        backend.attend(w, x, torch.arange(2)[None], cache)


def test_flashinfer_glue_through_the_layer_contract(monkeypatch, mla_figures):
    """FlashInferOp's glue (stand-in kernel module, tests/test_op_adapters.py) behind OpBackend, on a device
    stated as an SM89 with flashinfer installed: the same numerics check (float64 oracle, bfloat16 tolerance)."""
    from mla_conformance.arch import DeviceInfo, PackageInfo
    from mla_conformance.impl.ops.flashinfer import FlashInferOp
    from tests.test_op_adapters import fake_flashinfer

    monkeypatch.setattr(arch, "detect", lambda device=None: DeviceInfo.from_capability(
        (8, 9), "NVIDIA L40S", packages=[PackageInfo("flashinfer", True, "0.5")]))
    calls = []
    backend = OpBackend(FlashInferOp(flashinfer_module=fake_flashinfer(calls)), page_block_size=16)
    m = checks.numerics(backend, "v3-mini", "varlen_batch", BF16)
    mla_figures.update(m)
    # prefill 23 / 16 / 7: one plan per distinct token count; then 4 decode steps of all three rows
    assert calls == [("plan", "auto", 1, 16, True)] * 3 + [("plan", "auto", 3, 16, True)] * 4


def test_declared_head_dims_let_the_tiny_model_through():
    """reference-op declares head_dims "any": the tiny model (kv_lora 64 + rope 16) runs through it, with
    head_dim_v passed; an op declaring only 576 / 512 never sees another width."""
    tiny = MLAConfig.preset("tiny")
    assert OpBackend(ReferenceOp()).unsupported_reason(tiny, dtype=torch.float32, device="cpu", kv_codec="none") is None
    seen = []

    class Recording(ReferenceOp):
        name = "recording"

        def decode(self, q, *args, **kwargs):
            seen.append((q.shape[-1], kwargs.get("head_dim_v")))
            return super().decode(q, *args, **kwargs)

    backend = OpBackend(Recording())
    w = MLAWeights.random(tiny, dtype=torch.float32, seed=0)
    cache = backend.new_cache(tiny, batch_size=1, capacity=8, dtype=torch.float32, device="cpu")
    x = torch.randn(1, 3, tiny.hidden_size)
    out = backend.attend(w, x, torch.arange(3)[None], cache)
    assert out.shape == x.shape and torch.isfinite(out).all()
    assert seen == [(tiny.kv_lora_rank + tiny.qk_rope_head_dim, tiny.kv_lora_rank)]


# --------------------------------------------------------------------------- ops with other methods than decode


def _op_file(tmp_path, body: str) -> str:
    path = tmp_path / "ops.py"
    path.write_text(textwrap.dedent(body), encoding="utf-8")
    return str(path)


def test_an_op_needs_one_method_not_decode(tmp_path):
    """An op with only merge resolves (every method is optional); one with none of the methods is refused naming
    them; a merge-only op behind the layer contract is refused naming decode; a method's declaration outside
    its allowed values is a bad spec naming the attribute."""
    path = _op_file(tmp_path, """
        class MergeOnly:
            name = "merge-only"
            merge_empty_row = "-inf"
            def unsupported_reason(self, case):
                return None
            def merge(self, out_a, lse_a, out_b, lse_b):
                return out_a, lse_a

        class Nothing:
            name = "nothing"
            def unsupported_reason(self, case):
                return None

        class BadBase(MergeOnly):
            name = "bad-base"
            merge_lse_base = "10"
        """)
    op = get_op(f"{path}:MergeOnly")
    assert methods_of(op) == ("merge",)
    assert declarations(op) == {"merge_lse_base": "e", "merge_empty_row": "-inf"}
    with pytest.raises(BackendSpecError, match="it has none of the methods decode, prefill, sparse_prefill, merge, "
                                               "write"):
        get_op(f"{path}:Nothing")
    with pytest.raises(BackendSpecError, match=r"merge_lse_base = '10' is not one of 'e', '2'"):
        get_op(f"{path}:BadBase")
    with pytest.raises(BackendSpecError, match=r"backend spec 'op:.*MergeOnly'.*has no decode\(\)"):
        get_backend(f"op:{path}:MergeOnly")


def test_reference_op_declares_every_method():
    op = ReferenceOp()
    assert methods_of(op) == METHODS
    decl = declarations(op)
    assert decl["write_kv_formats"] == ("latent", "fp8-e4m3-flashmla", "fp8-e4m3-model1")
    assert decl["sparse_prefill_head_dims"] == ((576, 512), (512, 512)) and decl["prefill_head_dims"] == "any"
