"""The ``flashmla`` backend (mla_conformance.impl.backends.flashmla: OpBackend over the ``flashmla`` op of
mla_conformance.impl.ops.flashmla): gating, its glue around the kernel, and the kernel itself where a device allows.

Without an SM90 GPU and the ``flash_mla`` package every check of the suite skips it with the support
matrix's sentence. The glue (absorbed query layout, paged cache, get_mla_metadata across FlashMLA
releases, grouping a padded batch into kernel calls, W_UV and o_proj) runs on the CPU against a
stand-in ``flash_mla`` module that computes what FlashMLA's documentation and its own reference test
define (``tests/test_flash_mla.py``: attention over ``cache_seqlens[b]`` keys gathered through the
block table, causal mask ``tril(diagonal=s_k - s_q)``). The real kernel is compared with
reference-absorbed by the ``requires_kernel("flashmla/dense_decode")`` test at the end.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from mla_conformance import MLAConfig, checks
from mla_conformance.checks.layer import paged
from mla_conformance.arch.device import DeviceInfo, PackageInfo, detect
from mla_conformance.arch.gating import why_not
from mla_conformance.specs import get_backend
from mla_conformance.impl.backends.flashmla import KERNEL_ID, FlashMLA, mla_metadata
from mla_conformance.kv.caches import PagedLatentCache
from mla_conformance.model.reference import reference_attention_f64

SPEC = "mla_conformance.impl.backends.flashmla:FlashMLA"
LITE = MLAConfig.preset("deepseek-v2-lite")
BF16 = torch.bfloat16


# --------------------------------------------------------------------------- gating


def test_reason_on_this_cpu_names_flashmla_and_sm90():
    reason = FlashMLA().unsupported_reason(LITE, dtype=BF16, device="cpu", kv_codec="none")
    assert reason == why_not(KERNEL_ID, detect("cpu"))
    assert "FlashMLA" in reason and "SM90" in reason


@pytest.mark.parametrize("what,kwargs,needle", [
    ("float32", dict(dtype=torch.float32), "bfloat16"),
    ("float16", dict(dtype=torch.float16), "not float16"),
    ("tiny dims", dict(config=MLAConfig.preset("tiny")), "kv_lora_rank 512 and qk_rope_head_dim 64"),
    ("fp8 codec", dict(kv_codec="fp8-e4m3-flashmla"), "sparse decode"),
    ("int8 codec", dict(kv_codec="int8-g16"), "kv_codec 'int8-g16' is not supported"),
])
def test_reasons_for_what_the_kernel_cannot_do(what, kwargs, needle):
    """Request-level reasons (dtype, dims, codec) come before the device's, so they read the same anywhere."""
    kwargs = dict(kwargs)
    config = kwargs.pop("config", LITE)
    args = {"dtype": BF16, "device": "cpu", "kv_codec": "none", **kwargs}
    reason = FlashMLA().unsupported_reason(config, **args)
    assert reason and needle in reason and "FlashMLA" in reason, reason


def _hopper(installed: bool) -> DeviceInfo:
    return DeviceInfo.from_capability((9, 0), "NVIDIA H100 80GB HBM3", cuda_version="12.8",
                                      packages=[PackageInfo("flash_mla", installed, "1.0.0" if installed else None)])


def test_reasons_on_a_hopper_without_the_package(monkeypatch):
    import mla_conformance.arch as arch  # the op asks arch.detect (mla_conformance.impl.ops.flashmla)

    monkeypatch.setattr(arch, "detect", lambda device=None: _hopper(False))
    reason = FlashMLA().unsupported_reason(LITE, dtype=BF16, device="cuda", kv_codec="none")
    assert reason == ("FlashMLA dense decode runs on this device, SM90 (NVIDIA H100 80GB HBM3, compute capability "
                      "9.0), but the flash_mla package is not installed")
    monkeypatch.setattr(arch, "detect", lambda device=None: _hopper(True))
    # both import outcomes on every host, whether or not this one has flash_mla: one that fails to import ...
    monkeypatch.setitem(sys.modules, "flash_mla", None)
    reason = FlashMLA().unsupported_reason(LITE, dtype=BF16, device="cuda", kv_codec="none")
    assert reason.startswith("FlashMLA dense decode: the flash_mla package does not import (ModuleNotFoundError: "), reason
    # ... and one that imports (a stand-in in sys.modules, or handed over as the module)
    monkeypatch.setitem(sys.modules, "flash_mla", fake_flash_mla("new"))
    assert FlashMLA().unsupported_reason(LITE, dtype=BF16, device="cuda", kv_codec="none") is None
    assert FlashMLA(flash_mla_module=fake_flash_mla("new")).unsupported_reason(
        LITE, dtype=BF16, device="cuda", kv_codec="none") is None


def test_an_sm120_is_told_it_needs_sm90(monkeypatch):
    import mla_conformance.arch as arch  # the op asks arch.detect (mla_conformance.impl.ops.flashmla)

    monkeypatch.setattr(arch, "detect", lambda device=None: DeviceInfo.from_capability((12, 0), "RTX 5090"))
    reason = FlashMLA().unsupported_reason(LITE, dtype=BF16, device="cuda", kv_codec="none")
    assert reason.startswith("FlashMLA dense decode needs SM90") and "SM120" in reason


def test_flashmla_is_projections_plus_the_flashmla_op():
    """The layer backend is OpBackend over FlashMLAOp: `flashmla` and `op:flashmla` decline alike on this host."""
    from mla_conformance.impl.ops.flashmla import FlashMLAOp
    from mla_conformance.impl.ops.layer import OpBackend

    backend = FlashMLA()
    assert isinstance(backend, OpBackend) and isinstance(backend.op, FlashMLAOp) and backend.op.name == "flashmla"
    assert backend.name == "flashmla" and get_backend("op:flashmla").name == "op:flashmla"
    here = why_not(KERNEL_ID, detect("cpu"))  # a CPU device never runs the kernel, on any host
    assert here is not None and "SM90" in here
    assert get_backend("op:flashmla").unsupported_reason(LITE, dtype=BF16, device="cpu", kv_codec="none") == here


def test_spec_and_declared_parts():
    backend = get_backend(SPEC)
    assert backend.name == "flashmla" and backend.cache_format == "latent" and backend.supports_paging
    cache = backend.new_cache(LITE, batch_size=2, capacity=70, dtype=BF16, device="cpu")
    assert isinstance(cache, PagedLatentCache) and cache.page_block_size == 64
    assert cache.kv_pages.shape[1:] == (64, 1, 576) and cache.block_table.shape == (2, 2)
    with pytest.raises(ValueError, match="pages of 64 tokens, not 16"):
        backend.new_cache(LITE, batch_size=2, capacity=70, dtype=BF16, device="cpu", page_block_size=16)


@pytest.mark.parametrize("preset", ["tiny", "deepseek-v2-lite"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_suite_checks_skip_flashmla_here_naming_it(preset, dtype):
    """What `pytest suites --mla-backend flashmla -rs` does on a device without the kernel (the CPU device, on
    any host): every check skips through require_support with a sentence naming FlashMLA."""
    backend = get_backend(SPEC)
    with pytest.raises(pytest.skip.Exception) as info:
        checks.numerics(backend, preset, "prefill", checks.DTYPES[dtype], device="cpu")
    # the first reason that applies: dtype, then head dims, then the device
    needle = ("takes bfloat16 only" if dtype != "bfloat16" else
              "kv_lora_rank 512 and qk_rope_head_dim 64" if preset == "tiny" else "needs SM90")
    assert str(info.value).startswith("flashmla: FlashMLA dense decode ") and needle in str(info.value), info.value


# --------------------------------------------------------------------------- get_mla_metadata across releases


def test_metadata_call_follows_the_installed_signature():
    seqlens = torch.tensor([5, 70], dtype=torch.int32)
    calls = []

    def first_release(cache_seqlens, num_heads_per_head_k, num_heads_k):
        calls.append(("first", num_heads_per_head_k, num_heads_k))
        return "tile", "splits"

    def with_topk(cache_seqlens, num_q_tokens_per_head_k, num_heads_k, num_heads_q=None, is_fp8_kvcache=False,
                  topk=None):
        calls.append(("topk", num_q_tokens_per_head_k, num_heads_k, num_heads_q, is_fp8_kvcache, topk))
        return "tile", "splits"

    def current(*args, **kwargs):
        calls.append(("current", args, kwargs))
        return "sched_meta", None

    class Compiled:  # a pybind function: no inspectable signature
        __signature__ = "not a signature"

        def __call__(self, *args):
            calls.append(("compiled", args[1], args[2]))
            return "tile", "splits"

    assert mla_metadata(first_release, seqlens, s_q=2, h_q=16) == ("tile", "splits")
    assert mla_metadata(with_topk, seqlens, s_q=1, h_q=16) == ("tile", "splits")
    assert mla_metadata(current, seqlens, s_q=1, h_q=16) == ("sched_meta", None)
    assert mla_metadata(Compiled(), seqlens, s_q=3, h_q=128) == ("tile", "splits")
    assert calls == [("first", 32, 1), ("topk", 16, 1, 16, False, None), ("current", (), {}), ("compiled", 384, 1)]


# --------------------------------------------------------------------------- the glue, on a CPU stand-in


def fake_flash_mla(interface: str, calls: list | None = None):
    """A CPU ``flash_mla`` with FlashMLA's documented semantics and input checks (fp32 math, bf16 out).

    ``interface``: "first" (get_mla_metadata -> tensors) or "new" (-> (FlashMLASchedMeta, None)).
    """
    calls = [] if calls is None else calls

    class FlashMLASchedMeta:
        pass

    def get_first(cache_seqlens, num_heads_per_head_k, num_heads_k):
        assert cache_seqlens.dtype == torch.int32 and num_heads_k == 1
        return torch.zeros(4, 8, dtype=torch.int32), torch.zeros(cache_seqlens.numel() + 1, dtype=torch.int32)

    def get_new(*args, **kwargs):
        return FlashMLASchedMeta(), None

    def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                               num_splits=None, softmax_scale=None, causal=False):
        b, s_q, h_q, d = q.shape
        assert q.dtype == k_cache.dtype == BF16 and q.is_contiguous() and d == 576 and head_dim_v == 512
        assert k_cache.dim() == 4 and k_cache.shape[1] == 64 and k_cache.shape[2:] == (1, 576)
        assert block_table.dtype == cache_seqlens.dtype == torch.int32 and block_table.is_contiguous()
        assert block_table.shape[0] == cache_seqlens.shape[0] == b and causal
        if interface == "new":
            assert isinstance(tile_scheduler_metadata, FlashMLASchedMeta) and num_splits is None
        else:
            assert tile_scheduler_metadata.dtype == num_splits.dtype == torch.int32
        assert bool((cache_seqlens >= s_q).all()), "every query needs its own key in the cache"
        calls.append((b, s_q))
        scale = d ** -0.5 if softmax_scale is None else softmax_scale
        out = torch.empty(b, s_q, h_q, head_dim_v, dtype=q.dtype)
        lse = torch.empty(b, h_q, s_q, dtype=torch.float32)
        for i in range(b):
            L = int(cache_seqlens[i])
            t = torch.arange(L)
            kv = k_cache[block_table[i, t // 64].long(), t % 64, 0].float()  # [L, 576], only t < L is read
            scores = torch.einsum("shd,td->hst", q[i].float(), kv) * scale
            keep = torch.ones(s_q, L, dtype=torch.bool).tril(diagonal=L - s_q)
            scores = scores.masked_fill(~keep, float("-inf"))
            lse[i] = scores.logsumexp(-1)
            out[i] = torch.einsum("hst,tc->shc", scores.softmax(-1), kv[:, :head_dim_v]).to(q.dtype)
        return out, lse

    return types.SimpleNamespace(get_mla_metadata=get_first if interface == "first" else get_new,
                                 flash_mla_with_kvcache=flash_mla_with_kvcache, calls=calls)


@pytest.mark.parametrize("interface", ["first", "new"])
def test_glue_against_float64_at_v2_lite_dims(interface, mla_figures):
    """FlashMLA's pipeline with the stand-in kernel: within the bf16 tolerance of the float64 reference."""
    backend = FlashMLA(flash_mla_module=fake_flash_mla(interface))
    scenario = checks.SCENARIOS["varlen_batch"]  # prefill 23 / 16 / 7 in one padded call, then 4 decode steps
    w = checks.weights_for("deepseek-v2-lite", BF16)
    x = checks.inputs_for(w.config, scenario)
    out, cache = checks.run_scenario(backend, w, x, scenario)
    lengths = checks.scenario_lengths(scenario)
    ref = reference_attention_f64(checks.weights_for("deepseek-v2-lite", torch.float64), x.to(BF16).double(),
                                  lengths)
    valid = torch.arange(x.shape[1])[None, :] < lengths[:, None]
    m = checks.error_metrics(out[valid], ref[valid])
    tol = checks.TOLERANCES["bfloat16"]
    mla_figures.update(m)  # the interface is in the test id
    assert m["rel_fro"] <= tol.rel_fro and m["max_rel"] <= tol.max_rel, checks.format_metrics(m)
    assert cache.seq_lens.tolist() == lengths.tolist()


def test_glue_groups_rows_by_new_tokens_and_matches_reference_absorbed(mla_figures):
    """Padded calls become one kernel call per distinct token count; empty rows make none (the paged checks'
    driver, call schedule and 576-wide config: mla_conformance.checks.layer.paged)."""
    CALLS, TOTALS, drive = paged.CALLS, paged.TOTALS, paged.drive
    calls = []
    backend = FlashMLA(flash_mla_module=fake_flash_mla("new", calls))
    w = paged.paged_weights("dims-576", BF16)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(len(TOTALS), max(TOTALS), w.config.hidden_size, generator=gen, dtype=torch.float64)
    out, cache = drive(backend, w, x, CALLS)
    # CALLS: (23, 0, 7, 16) (1, 1, 0, 1) (1, 1, 1, 1) (0, 1, 1, 1) (5, 0, 0, 2) (1, 1, 1, 1) -> (rows, s_q)
    assert calls == [(1, 7), (1, 16), (1, 23), (3, 1), (4, 1), (3, 1), (1, 2), (1, 5), (4, 1)]
    ref, _ = drive(get_backend("reference-absorbed"), w, x, CALLS)
    valid = torch.arange(max(TOTALS))[None, :] < torch.tensor(TOTALS)[:, None]
    m = checks.error_metrics(out[valid], ref[valid])
    mla_figures.update(m)
    tol = checks.TOLERANCES["bfloat16"]
    assert m["rel_fro"] <= tol.rel_fro and m["max_rel"] <= tol.max_rel, checks.format_metrics(m)
    assert cache.seq_lens.tolist() == list(TOTALS)


# --------------------------------------------------------------------------- the real kernel


@pytest.mark.requires_kernel("flashmla/dense_decode")
@pytest.mark.parametrize("scenario", ["varlen_batch", "long_context"])
def test_flashmla_kernel_matches_reference_absorbed(scenario, mla_device, mla_figures):
    """FlashMLA dense decode on the GPU: within bf16 tolerance of float64, and of reference-absorbed."""
    backend = get_backend(SPEC)
    checks.require_support(backend, LITE, dtype=BF16, device=mla_device)
    m64 = checks.numerics(backend, "deepseek-v2-lite", scenario, BF16, device=mla_device)
    sc = checks.SCENARIOS[scenario]
    w = checks.weights_for("deepseek-v2-lite", BF16, mla_device)
    x = checks.inputs_for(w.config, sc)
    out, cache = checks.run_scenario(backend, w, x, sc, device=mla_device)
    ref, _ = checks.run_scenario(get_backend("reference-absorbed"), w, x, sc, device=mla_device)
    lengths = checks.scenario_lengths(sc)
    valid = torch.arange(x.shape[1])[None, :] < lengths[:, None]
    m = checks.error_metrics(out[valid], ref[valid])
    mla_figures.update(vs_float64=m64, vs_reference_absorbed=m)
    tol = checks.TOLERANCES["bfloat16"]
    assert m["rel_fro"] <= tol.rel_fro and m["max_rel"] <= tol.max_rel, (
        f"flashmla vs reference-absorbed, {scenario}: {checks.format_metrics(m)}")
    assert cache.seq_lens.tolist() == lengths.tolist()


# --------------------------------------------------------------------------- flashmla-sparse (DSA), on a CPU stand-in


def test_flashmla_sparse_gating_sentences():
    from mla_conformance.impl.backends.flashmla import FlashMLASparse

    backend = get_backend("flashmla-sparse")
    assert isinstance(backend, FlashMLASparse) and backend.cache_format == "latent+indexer"
    dsa = MLAConfig.preset("v3.2-mini")
    here = why_not("flashmla/sparse_decode", detect("cpu"))  # a CPU device never runs the kernel, on any host
    assert here is not None and "SM90" in here
    assert backend.unsupported_reason(dsa, dtype=BF16, device="cpu", kv_codec="fp8-e4m3-flashmla") == here
    assert "FP8 656-byte cache only" in backend.unsupported_reason(dsa, dtype=BF16, device="cpu", kv_codec="none")
    assert "dense MLA" in backend.unsupported_reason(LITE, dtype=BF16, device="cpu", kv_codec="fp8-e4m3-flashmla")
    reason = backend.unsupported_reason(MLAConfig.preset("tiny-dsa"), dtype=BF16, device="cpu",
                                        kv_codec="fp8-e4m3-flashmla")
    assert "kv_lora_rank 512 and qk_rope_head_dim 64" in reason


def test_flashmla_sparse_glue_equals_reference_dsa(mla_figures):
    """reference-dsa's FP8 cache and selection, the attention in FlashMLASparseOp over a stand-in flash_mla
    (tests/test_op_adapters.py): same selection, outputs within the bf16 tolerance of reference-dsa's."""
    from mla_conformance.impl.backends.flashmla import FlashMLASparse
    from tests.test_op_adapters import fake_flash_mla

    calls = []
    backend = FlashMLASparse(flash_mla_module=fake_flash_mla("current", calls))
    scenario = checks.SCENARIOS["varlen_batch"]
    w = checks.weights_for("v3.2-mini", BF16)
    x = checks.inputs_for(w.config, scenario)
    out, cache = checks.run_scenario(backend, w, x, scenario, kv_codec="fp8-e4m3-flashmla")
    ref, ref_cache = checks.run_scenario(get_backend("reference-dsa"), w, x, scenario, kv_codec="fp8-e4m3-flashmla")
    assert torch.equal(cache.last_topk_indices, ref_cache.last_topk_indices)
    lengths = checks.scenario_lengths(scenario)
    valid = torch.arange(x.shape[1])[None, :] < lengths[:, None]
    m = checks.error_metrics(out[valid], ref[valid])
    mla_figures.update(m)
    tol = checks.TOLERANCES["bfloat16"]
    assert m["rel_fro"] <= tol.rel_fro and m["max_rel"] <= tol.max_rel, checks.format_metrics(m)
    # 2 heads ran as 64, top-16 as 64; one call per attend (prefill of 23, then 4 decode steps)
    assert [c for c in calls if c[0] == "kernel"] == [("kernel", 3, 23, 64, 64)] + [("kernel", 3, 1, 64, 64)] * 4
