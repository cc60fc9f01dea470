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
    """An op that decodes one query per row only (XQA-like) and has no prefill: its multi-token rows go through the
    suite's reference prefill over its cache, every one-token step through its decode (recorded)."""

    name = "single-token"
    prefill = None

    def __init__(self):
        self.calls = []

    def unsupported_reason(self, case):
        s_q = getattr(case, "s_q", 1)
        return f"{self.name} decodes one query per row, not s_q {s_q}" if s_q > 1 else None

    def decode(self, q, *args, **kwargs):
        self.calls.append(tuple(q.shape[:2]))
        return super().decode(q, *args, **kwargs)


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
    no_bf16 = type("NoBf16", (ReferenceOp,), {"name": "no-bf16", "unsupported_reason": lambda self, case: (
        "no-bf16 takes float32 only" if case.dtype == BF16 else None)})()
    reason = OpBackend(no_bf16).unsupported_reason(V3_MINI, dtype=BF16, device="cpu", kv_codec="none")
    assert reason == "no-bf16 takes float32 only"
    latent_only = type("LatentOnly", (ReferenceOp,), {"name": "latent-only", "kv_formats": ("latent",)})()
    reason = OpBackend(latent_only).unsupported_reason(V3_MINI, dtype=BF16, device="cpu",
                                                       kv_codec="fp8-e4m3-flashmla")
    assert reason == "op latent-only reads kv formats latent, not 'fp8-e4m3-flashmla' (kv_codec 'fp8-e4m3-flashmla')"
    flashmla = get_backend("op:flashmla")
    expected = arch.why_not("flashmla/dense_decode", arch.detect("cpu"))
    if expected is not None:
        assert flashmla.unsupported_reason(V3_MINI, dtype=BF16, device="cpu", kv_codec="none") == expected


@pytest.mark.parametrize("kv_codec,dtype", [("none", torch.float32), ("fp8-e4m3-flashmla", BF16)])
def test_a_decode_only_op_runs_the_layer(kv_codec, dtype):
    """An op that declines s_q > 1 and has no prefill is not refused: the prefill rows (23 / 16 / 7 tokens) are the
    suite's reference prefill over the op's cache (routes() says so, with the op's sentence), and every one of the 4
    decode steps is one op.decode call of one query per row; the layer output against the float64 oracle."""
    from mla_conformance.impl.ops.layer import REFERENCE_PREFILL

    op = _SingleTokenOp()
    backend = OpBackend(op, page_block_size=16)
    assert backend.unsupported_reason(V3_MINI, dtype=dtype, device="cpu", kv_codec=kv_codec) is None
    route = backend.routes(V3_MINI, dtype=dtype, device="cpu", kv_codec=kv_codec)["prefill"]
    assert route.startswith(REFERENCE_PREFILL) and route.endswith("single-token decodes one query per row, not s_q 2")
    assert backend.multi_token_route(V3_MINI, dtype=dtype, device="cpu", kv_codec=kv_codec) == "reference"
    if kv_codec == "none":
        checks.numerics(backend, "v3-mini", "varlen_batch", dtype)
        assert op.calls == [(3, 1)] * 4, op.calls
    w = checks.weights_for("v3-mini", dtype)
    cache = backend.new_cache(w.config, batch_size=2, capacity=8, dtype=dtype, device="cpu", kv_codec=kv_codec)
    x = torch.randn(2, 5, w.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(dtype)
    op.calls.clear()
    backend.attend(w, x[:, :4], torch.arange(4).expand(2, 4), cache, torch.tensor([4, 1]))  # a prefill and a step
    backend.attend(w, x[:, 4:], torch.tensor([[4], [1]]), cache, torch.tensor([1, 1]))
    assert op.calls == [(1, 1), (2, 1)], op.calls  # the 4-token row through the reference, the steps through the op


def test_a_bad_op_output_is_named():
    class WrongShape(ReferenceOp):
        name = "wrong-shape"
        prefill = None  # every call through decode

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
    stated as an SM89 with flashinfer installed: the same numerics check (float64 oracle, bfloat16 tolerance).
    Every cache fill through append_paged_mla_kv_cache, the prefill through the ragged prefill wrapper, the decode
    steps through the MLA paged wrapper; a flashinfer without the prefill / append kernels (an older release)
    runs every call through decode and the suite's cache fill."""
    from mla_conformance.arch import DeviceInfo, PackageInfo
    from mla_conformance.impl.ops.flashinfer import FlashInferOp
    from tests.test_op_adapters import fake_flashinfer

    monkeypatch.setattr(arch, "detect", lambda device=None: DeviceInfo.from_capability(
        (8, 9), "NVIDIA L40S", packages=[PackageInfo("flashinfer", True, "0.5")]))
    calls = []
    backend = OpBackend(FlashInferOp(flashinfer_module=fake_flashinfer(calls)), page_block_size=16)
    assert backend.routes(V3_MINI, dtype=BF16, device="cpu")["prefill"].startswith("op.prefill + op.merge")
    m = checks.numerics(backend, "v3-mini", "varlen_batch", BF16)
    mla_figures.update(m)
    # prefill 23 / 16 / 7 in one call (no context: no merge), then 4 decode steps of all three rows
    assert calls == [("append", 46), ("prefill plan", "auto", 3, True)] + \
        [("append", 3), ("plan", "auto", 3, 16, True)] * 4
    old = []
    backend = OpBackend(FlashInferOp(flashinfer_module=fake_flashinfer(old, methods=False)), page_block_size=16)
    checks.numerics(backend, "v3-mini", "varlen_batch", BF16)
    # one plan per distinct token count of the prefill call, then the decode steps
    assert old == [("plan", "auto", 1, 16, True)] * 3 + [("plan", "auto", 3, 16, True)] * 4


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
    x = torch.randn(1, 4, tiny.hidden_size)
    out = backend.attend(w, x[:, :3], torch.arange(3)[None], cache)  # prefill: op.prefill (192 / 128 -> any)
    out = backend.attend(w, x[:, 3:], torch.arange(3, 4)[None], cache)  # one decode step
    assert out.shape == (1, 1, tiny.hidden_size) and torch.isfinite(out).all()
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
    assert declarations(op) == {"merge_lse_base": "e", "merge_empty_row": "-inf", "merge_empty_input": "either"}
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


# --------------------------------------------------------------------------- prefill, merge and write behind op:

#: a row joins while another continues a chunked prefill: call 1 has row 0 at 30 cached tokens (context chunks of
#: 24 and 6) and row 1 fresh (kv_len 0 in both chunks: its first chunk merge has two empty sides); then a decode step
JOIN_CALLS = [(30, 0), (5, 6), (1, 1)]


class _Recording(ReferenceOp):
    name = "recording-methods"

    def __init__(self):
        self.calls = []

    def prefill(self, q, k, v, cu_seqlens_q, cu_seqlens_k, **kw):
        self.calls.append(("prefill", kw["causal"], cu_seqlens_k.tolist(), v.is_contiguous()))
        return super().prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, **kw)

    def merge(self, *args):
        self.calls.append(("merge",))
        return super().merge(*args)

    def write(self, kv_c, k_pe, kv_cache, slot_mapping, **kw):
        self.calls.append(("write", kw["kv_format"], int((slot_mapping < 0).sum())))
        return super().write(kv_c, k_pe, kv_cache, slot_mapping, **kw)

    def decode(self, q, *args, **kw):
        self.calls.append(("decode", q.shape[1]))
        return super().decode(q, *args, **kw)


def _join_run(op, dtype=torch.float32, preset="tiny"):
    from mla_conformance.checks.layer.paged import drive, paged_weights
    from mla_conformance.model.reference import reference_attention_f64

    w = paged_weights(preset, dtype)
    totals = [sum(c[b] for c in JOIN_CALLS) for b in range(2)]
    x = torch.randn(2, max(totals), w.config.hidden_size, generator=torch.Generator().manual_seed(3),
                    dtype=torch.float64)
    out, _ = drive(OpBackend(op, page_block_size=16), w, x, JOIN_CALLS)
    oracle = reference_attention_f64(paged_weights(preset, torch.float64), x.to(dtype).to(torch.float64),
                                     torch.tensor(totals))
    return out, oracle, totals


def test_prefill_rows_run_the_ops_prefill_merge_and_write():
    """op:reference-op: one write per call (the padding tokens' slots -1), the context in chunks of 24 through
    prefill(causal=False) (v a strided view of the kv_b_proj output), the new tokens through prefill(causal=True),
    merged pairwise; one-token rows through decode; every row equals the float64 reference."""
    op = _Recording()
    out, oracle, totals = _join_run(op)
    assert op.calls == [
        ("write", "latent", 30), ("prefill", True, [0, 30], False),                        # call 0: no context
        ("write", "latent", 1), ("prefill", False, [0, 24, 24], False), ("prefill", False, [0, 6, 6], False),
        ("merge",), ("prefill", True, [0, 5, 11], False), ("merge",),                      # call 1
        ("write", "latent", 0), ("decode", 1)]                                             # call 2
    tol = checks.TOLERANCES["float32"]
    for b, n in enumerate(totals):
        m = checks.error_metrics(out[b, :n], oracle[b, :n])
        assert m["rel_fro"] <= tol.rel_fro and m["max_rel"] <= tol.max_rel, (b, m)
    backend = OpBackend(ReferenceOp())
    routes = backend.routes(V3_MINI, dtype=BF16, device="cpu", kv_codec="fp8-e4m3-flashmla")
    assert routes == {"prefill": "op.prefill + op.merge (MHA mode, context chunks of 24 tokens)", "write": "op.write"}


def test_a_merge_giving_nan_on_two_empty_sides_fails_behind_op():
    """The broken merge of tests/meta/impls/broken/op_methods.py behind op:, on the joining row (two empty sides)."""
    from tests.meta.impls.broken.op_methods import MergeBothEmptyNaN

    with pytest.raises(AssertionError, match="non-finite"):
        _join_run(MergeBothEmptyNaN())


def test_routes_say_why_not():
    """Without prefill / merge, with undeclared prefill dims, or a write the layer cannot use, that part runs the
    decode path or the suite's cache fill, and routes() names why; the decode-only frozen op declines nothing new."""
    from tests.meta.frozen_base_op import FrozenBaseOp

    frozen = OpBackend(FrozenBaseOp()).routes(V3_MINI, dtype=BF16, device="cpu")
    assert frozen["prefill"].endswith("has no prefill() and no merge()") and "has no write()" in frozen["write"]
    v3_dims = type("V3Dims", (ReferenceOp,), {"name": "v3-dims", "prefill_head_dims": ((192, 128),)})()
    r = OpBackend(v3_dims).routes(MLAConfig.preset("tiny"), dtype=torch.float32, device="cpu")
    assert "declares prefill_head_dims ((192, 128),), not this config's" in r["prefill"], r
    fp32 = type("Fp32Writer", (ReferenceOp,), {"name": "fp32-writer", "write_fp8_scale_format": "fp32"})()
    r = OpBackend(fp32).routes(V3_MINI, dtype=BF16, device="cpu", kv_codec="fp8-e4m3-flashmla")
    assert r["write"].startswith("the suite: op fp32-writer writes fp32 tile scales"), r
    r = OpBackend(fp32).routes(V3_MINI, dtype=BF16, device="cpu", kv_codec="none", page_block_size=1)
    assert r["write"] == "op.write", r


def test_a_bad_prefill_output_is_named():
    class HalfHeads(ReferenceOp):
        name = "half-heads"

        def prefill(self, q, *args, **kwargs):
            out, lse = super().prefill(q, *args, **kwargs)
            return out[:, :1], lse

    backend = OpBackend(HalfHeads())
    w = checks.weights_for("v3-mini", torch.float32)
    cache = backend.new_cache(w.config, batch_size=1, capacity=4, dtype=torch.float32, device="cpu")
    x = torch.randn(1, 2, w.config.hidden_size)
    with pytest.raises(ValueError, match=r"op half-heads: prefill\(\) returned out \(2, 1, 128\), expected \(2, 2, 128\)"):
        backend.attend(w, x, torch.arange(2)[None], cache)


def test_flashinfer_glue_on_a_joining_row(monkeypatch):
    """FlashInferOp's prefill, merge_state (two empty sides: the joining row's first context chunks) and append
    behind op: on the stand-ins, v3-mini dims (MHA mode 192 / 128) in bfloat16: every row within the tolerance."""
    from mla_conformance.arch import DeviceInfo, PackageInfo
    from mla_conformance.impl.ops.flashinfer import FlashInferOp
    from tests.test_op_adapters import fake_flashinfer

    monkeypatch.setattr(arch, "detect", lambda device=None: DeviceInfo.from_capability(
        (8, 9), "NVIDIA L40S", packages=[PackageInfo("flashinfer", True, "0.5")]))
    calls = []
    out, oracle, totals = _join_run(FlashInferOp(flashinfer_module=fake_flashinfer(calls)), BF16, "v3-mini")
    tol = checks.TOLERANCES["bfloat16"]
    for b, n in enumerate(totals):
        m = checks.error_metrics(out[b, :n], oracle[b, :n])
        assert m["rel_fro"] <= tol.rel_fro and m["max_rel"] <= tol.max_rel, (b, m)
    assert [c[0] for c in calls].count("merge_state") == 2 and ("prefill plan", "auto", 2, False) in calls


def test_a_dummy_slot_writer_gets_no_padding_tokens_behind_op():
    """An op declaring write_padding_slot = "dummy-slot-0" is never handed a negative slot by the wrapper (the layer's
    paged cache reserves no dummy slot, so its padding tokens are left out): the idle-rows case through it passes."""
    class DummySlot(ReferenceOp):
        name = "dummy-slot-op"
        write_padding_slot = "dummy-slot-0"
        negative = 0

        def write(self, kv_c, k_pe, kv_cache, slot_mapping, **kw):
            type(self).negative += int((slot_mapping < 0).sum())
            return super().write(kv_c, k_pe, kv_cache, slot_mapping, **kw)

    from mla_conformance.checks.layer import padding as layer_padding

    op = DummySlot()
    layer_padding.idle_rows(OpBackend(op, page_block_size=16))
    assert DummySlot.negative == 0
