"""The kernel adapters of the op contract (mla_conformance.impl.ops.flashmla, mla_conformance.impl.ops.flashinfer): gating
and their glue.

On a host without the kernels every adapter declines with the support matrix's own sentence. Their glue
(argument layout, metadata across FlashMLA releases, head and top-k padding, topk_length translation,
FlashInfer's split q / ckv / kpe views and CSR page lists, lse base, causal queries before the first key)
runs on the CPU against **stand-in kernel modules**: torch functions with the kernels' call signatures and
documented input checks that compute with ReferenceOp / their own few lines. They stand in for the GPU
kernel, not for the adapter under test; the real kernels run in the op suite where a device allows
(``.gpu_check/op_adapters.py``).
"""

from __future__ import annotations

import math
import types

import pytest
import torch

from mla_conformance import arch
from mla_conformance.arch import DeviceInfo, PackageInfo
from mla_conformance.contract.op import OpCase, declarations
from mla_conformance.specs import get_op
from mla_conformance.impl.ops.flashinfer import FlashInferFA2Op, FlashInferOp
from mla_conformance.impl.ops.flashmla import FlashMLAOp, FlashMLASparseOp
from mla_conformance.impl.ops.reference import ReferenceOp, encode_fp8_656
from mla_conformance.model.attention_oracles import lse_to_natural
from mla_conformance.model import attention_oracles as oracles

BF16 = torch.bfloat16
INT_MAX = 2**31 - 1

KERNELS = {"flashmla": "flashmla/dense_decode", "flashmla-sparse": "flashmla/sparse_decode",
           "flashinfer": "flashinfer/fa2_mla", "flashinfer-fa2": "flashinfer/fa2_mla"}
CASES = {"flashmla": OpCase(batch=2, s_q=1, h_q=16, page_block_size=64, dtype=BF16),
         "flashmla-sparse": OpCase(batch=2, s_q=1, h_q=64, page_block_size=64, dtype=BF16,
                                   kv_format="fp8-e4m3-flashmla", topk=64),
         "flashinfer": OpCase(batch=2, s_q=1, h_q=16, page_block_size=16, dtype=BF16),
         "flashinfer-fa2": OpCase(batch=2, s_q=1, h_q=16, page_block_size=16, dtype=BF16)}


# --------------------------------------------------------------------------- gating


@pytest.mark.parametrize("name", list(KERNELS))
def test_adapter_declines_here_with_the_matrix_sentence(name):
    op = get_op(name)
    expected = arch.why_not(KERNELS[name], arch.detect("cpu"))
    if expected is None:
        pytest.skip(f"{KERNELS[name]} runs on this host")
    assert op.name == name
    assert op.unsupported_reason(CASES[name]) == expected
    # a stand-in module changes nothing: the device is still judged
    assert FlashMLAOp(flash_mla_module=types.SimpleNamespace()).unsupported_reason(CASES["flashmla"]) == \
        arch.why_not("flashmla/dense_decode", arch.detect("cpu"))


def test_declarations():
    assert declarations(get_op("flashmla")) == {
        "lse_base": "e", "returns_lse": True, "empty_row": "+inf", "sparse_decode": False,
        "sparse_decode_extra_cache": False, "invalid_index": "minus-one", "attn_sink": False, "page_block_sizes": (64,), "kv_formats": ("latent",),
        "fp8_scale_format": "pow2", "deterministic": True, "batch_invariant": False, "head_dims": ((576, 512),),
        "padding_rows": "defined", "out_buffers": False, "prefill_head_dims": ((192, 128),), "prefill_lse_base": "e",
        "prefill_empty_row": "+inf", "prefill_returns_lse": True}
    sparse = declarations(get_op("flashmla-sparse"))
    assert sparse["kv_formats"] == ("fp8-e4m3-flashmla",) and sparse["fp8_scale_format"] == "pow2"
    # the adapter remaps every index outside the cache to -1 (the decode kernel special-cases only -1)
    assert sparse["sparse_decode"] and sparse["attn_sink"] and sparse["invalid_index"] == "out-of-range"
    fi = declarations(get_op("flashinfer"))
    assert fi["lse_base"] == "2" and fi["empty_row"] == "-inf" and fi["kv_formats"] == ("latent",)
    assert get_op("flashinfer-fa2").backend == "fa2" and get_op("flashinfer").backend == "auto"


def _device(cap, name, *, packages=("flash_mla", "flashinfer")):
    return DeviceInfo.from_capability(cap, name, cuda_version="12.9",
                                      packages=[PackageInfo(p, True, "1.0") for p in packages])


@pytest.mark.parametrize("op,case,needle", [
    (FlashMLAOp, dict(dtype=torch.float16), "bfloat16 only"),
    (FlashMLAOp, dict(page_block_size=16), "pages of 64 tokens, not 16"),
    (FlashMLAOp, dict(kv_format="fp8-e4m3-flashmla"), "flashmla-sparse"),
    (FlashMLAOp, dict(topk=64), "flashmla-sparse"),
    (FlashMLASparseOp, dict(topk=None), "op flashmla"),
    (FlashMLASparseOp, dict(causal=True), "not causal"),
    (FlashMLASparseOp, dict(kv_format="latent"), "656-byte"),
    (FlashMLASparseOp, dict(h_q=256), "not 256"),
    (FlashInferOp, dict(dtype=torch.float32), "float16 or bfloat16"),
    (FlashInferOp, dict(topk=16), "no top-k"),
    (FlashInferOp, dict(attn_sink=True), "attention sink"),
    (FlashInferOp, dict(kv_format="fp8-e4m3-flashmla"), "656-byte"),
])
def test_sentences_after_the_device(monkeypatch, op, case, needle):
    """On a device the matrix accepts, what the kernel cannot take is the next sentence."""
    monkeypatch.setattr(arch, "detect", lambda device=None: _device((9, 0), "NVIDIA H200"))
    base = dict(batch=2, s_q=1, h_q=64, page_block_size=64, dtype=BF16)
    if op is FlashMLASparseOp:
        base.update(kv_format="fp8-e4m3-flashmla", topk=64)
    stand_in = {FlashMLAOp: "flash_mla_module", FlashMLASparseOp: "flash_mla_module",
                FlashInferOp: "flashinfer_module"}[op]
    instance = op(**{stand_in: fake_flash_mla() if op is not FlashInferOp else fake_flashinfer()})
    reason = instance.unsupported_reason(OpCase(**{**base, **case}))
    assert reason and needle in reason, reason
    assert instance.unsupported_reason(OpCase(**base)) is None


def test_flashinfer_auto_is_gated_by_fa3_on_hopper_and_fa2_elsewhere(monkeypatch):
    op = FlashInferOp()
    assert op.kernel_id(_device((9, 0), "H100")) == "flashinfer/fa3_mla"
    assert op.kernel_id(_device((8, 9), "L40S")) == "flashinfer/fa2_mla"
    assert op.kernel_id(DeviceInfo.cpu()) == "flashinfer/fa2_mla"
    assert FlashInferOp(backend="fa3").kernel_id(_device((8, 9), "L40S")) == "flashinfer/fa3_mla"
    monkeypatch.setattr(arch, "detect", lambda device=None: _device((7, 5), "Tesla T4"))
    reason = op.unsupported_reason(CASES["flashinfer"])
    assert reason == arch.why_not("flashinfer/fa2_mla", _device((7, 5), "Tesla T4"))
    assert "SM75" in reason and "Tesla T4" in reason
    with pytest.raises(ValueError, match="backend 'fa4'"):
        FlashInferOp(backend="fa4")


# --------------------------------------------------------------------------- stand-in kernels (labelled)


def fake_flash_mla(interface: str = "current", calls: list | None = None):
    """STAND-IN for the ``flash_mla`` package: FlashMLA's call signatures and documented checks, ReferenceOp's
    arithmetic. ``interface``: "current" (get_mla_metadata() -> FlashMLASchedMeta; topk_length, attn_sink) or
    "sep2025" (get_mla_metadata(cache_seqlens, ..., is_fp8_kvcache, topk) -> tensors; no topk_length/attn_sink)."""
    calls = [] if calls is None else calls
    ref = ReferenceOp()

    class FlashMLASchedMeta:
        pass

    def get_current(*args, **kwargs):
        return FlashMLASchedMeta(), None

    def get_sep2025(cache_seqlens, num_q_tokens_per_head_k, num_heads_k, num_heads_q=None, is_fp8_kvcache=False,
                    topk=None):
        calls.append(("metadata", num_q_tokens_per_head_k, num_heads_q, is_fp8_kvcache, topk))
        return torch.zeros(4, 8, dtype=torch.int32), torch.zeros(cache_seqlens.numel() + 1, dtype=torch.int32)

    def kernel(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits=None,
               softmax_scale=None, causal=False, is_fp8_kvcache=False, indices=None, attn_sink=None,
               topk_length=None):
        b, s_q, h_q, d = q.shape
        assert q.dtype == BF16 and q.is_contiguous() and d == 576 and head_dim_v == 512
        if interface == "current":
            assert isinstance(tile_scheduler_metadata, FlashMLASchedMeta) and num_splits is None
        if indices is None:
            assert k_cache.dtype == BF16 and k_cache.shape[1] == 64 and k_cache.shape[2:] == (1, 576)
            assert block_table.dtype == cache_seqlens.dtype == torch.int32 and block_table.is_contiguous()
            assert attn_sink is None and topk_length is None
        else:
            assert not causal and is_fp8_kvcache and k_cache.dtype == torch.uint8 and k_cache.stride(1) == 656
            assert h_q in (64, 128), f"FlashMLA sparse decode: Unsupported h_q: {h_q}"
            assert indices.dtype == torch.int32 and indices.shape[:2] == (b, s_q) and indices.is_contiguous()
            assert indices.shape[-1] % 64 == 0, "top-k is read in blocks of 64"
            n_slots = k_cache.shape[0] * k_cache.shape[1]
            outside = (indices != -1) & ((indices < 0) | (indices >= n_slots))
            assert not bool(outside.any()), "FlashMLA's sparse decode reads any index but -1 as a slot (out of bounds)"
            assert topk_length is None or (topk_length.dtype == torch.int32 and topk_length.shape == (b,))
            assert attn_sink is None or (attn_sink.dtype == torch.float32 and attn_sink.shape == (h_q,))
        calls.append(("kernel", b, s_q, h_q, None if indices is None else indices.shape[-1]))
        scale = d ** -0.5 if softmax_scale is None else softmax_scale
        out, lse = ref.decode(q, k_cache, block_table, cache_seqlens, softmax_scale=scale, causal=causal,
                              indices=indices, topk_length=topk_length, attn_sink=attn_sink)
        return out.to(BF16), lse

    def sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None):
        """flash_mla_sparse_fwd's checks (csrc/api/sparse_fwd.h), ReferenceOp's arithmetic (batched: the kernel runs
        64 or 128 heads, too many for the float64 oracle's loops in a default run)."""
        s_q, h_q, d_qk = q.shape
        s_kv, h_kv, _ = kv.shape
        assert q.dtype == kv.dtype == BF16 and d_qk in (576, 512) and d_v == 512, "sparse_fwd: bf16, d_qk 576/512"
        assert h_q in (64, 128), f"Unsupported h_q: {h_q}"
        assert indices.dtype == torch.int32 and indices.shape[:2] == (s_q, h_kv) and indices.stride(-1) == 1
        assert q.stride(-1) == kv.stride(-1) == 1, "KU_CHECK_LAST_DIM_CONTIGUOUS"
        assert indices.shape[-1] % 128 == 0, "FlashMLA's tests run top-k multiples of 128"
        odd = (indices < 0) & (indices != -1)
        assert not bool(odd.any()), "invalid indices should be set to -1 or numbers >= s_kv"
        assert topk_length is None or (topk_length.dtype == torch.int32 and topk_length.shape == (s_q,))
        assert attn_sink is None or (attn_sink.dtype == torch.float32 and attn_sink.shape == (h_q,))
        calls.append(("sparse_fwd", s_q, h_q, indices.shape[-1]))
        out, max_logits, lse = ref.sparse_prefill(q, kv, indices, softmax_scale=sm_scale, d_v=d_v,
                                                  topk_length=topk_length, attn_sink=attn_sink)
        return out.to(BF16), max_logits, lse

    def varlen(q, k, v, cu_seqlens_qo, cu_seqlens_kv, max_seqlen_qo, max_seqlen_kv, dropout_p=0.0,
               softmax_scale=None, causal=False, deterministic=False, is_varlen=True):
        """flash_attn_varlen_func's signature and layout (flash_mla_interface.py: out [total_q, h, dv], lse a
        [total_q, h] view of an [h, total_q] buffer), ReferenceOp's arithmetic; what it leaves for a query with
        no key is NaN here (FlashMLA's tests make none, so nothing is promised)."""
        assert q.dtype == k.dtype == v.dtype == BF16 and q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
        assert cu_seqlens_qo.dtype == cu_seqlens_kv.dtype == torch.int32 and dropout_p == 0.0 and not deterministic
        assert max_seqlen_qo == int((cu_seqlens_qo[1:] - cu_seqlens_qo[:-1]).max())
        assert max_seqlen_kv == int((cu_seqlens_kv[1:] - cu_seqlens_kv[:-1]).max())
        calls.append(("varlen", int(cu_seqlens_qo.numel() - 1), q.shape[1], k.shape[1], bool(causal)))
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
        out, lse = ref.prefill(q, k, v, cu_seqlens_qo, cu_seqlens_kv, softmax_scale=scale, causal=causal)
        lse_buf = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32)
        lse_buf.copy_(lse.T)
        nokey = torch.isposinf(lse)
        out = torch.where(nokey[..., None], torch.full((), math.nan), out.float())
        lse_view = torch.where(nokey, torch.full((), -math.inf), lse_buf.T)
        return out.to(BF16), lse_view

    if interface == "current":
        return types.SimpleNamespace(get_mla_metadata=get_current, flash_mla_with_kvcache=kernel, calls=calls,
                                     flash_mla_sparse_fwd=sparse_fwd, flash_attn_varlen_func=varlen)

    def kernel_sep2025(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits,
                       softmax_scale=None, causal=False, is_fp8_kvcache=False, indices=None):
        assert tile_scheduler_metadata.dtype == num_splits.dtype == torch.int32
        return kernel(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits,
                      softmax_scale=softmax_scale, causal=causal, is_fp8_kvcache=is_fp8_kvcache, indices=indices)

    def sparse_fwd_sep2025(q, kv, indices, sm_scale, d_v=512):
        return sparse_fwd(q, kv, indices, sm_scale, d_v)

    return types.SimpleNamespace(get_mla_metadata=get_sep2025, flash_mla_with_kvcache=kernel_sep2025, calls=calls,
                                 flash_mla_sparse_fwd=sparse_fwd_sep2025)


def fake_flashinfer(calls: list | None = None, methods: bool = True):
    """STAND-IN for ``flashinfer`` (``flashinfer.mla.BatchMLAPagedAttentionWrapper``): plan / run with FlashInfer's
    layout (q_nope / q_pe, ckv [pages, page, 512] / kpe [pages, page, 64] read through strides, CSR page
    lists), its causal rule (drop kv_idx + qo_len > kv_len + q_idx), lse in base 2, -inf for a query with no
    keys; float32 math written here, from FlashInfer's tests/attention/test_deepseek_mla.py reference.
    ``methods``: also ``BatchPrefillWithRaggedKVCacheWrapper``, ``merge_state`` and ``append_paged_mla_kv_cache``
    (:func:`_fake_flashinfer_methods`); False: a release without them."""
    calls = [] if calls is None else calls

    class BatchMLAPagedAttentionWrapper:
        def __init__(self, float_workspace_buffer, use_cuda_graph=False, qo_indptr=None, kv_indptr=None,
                     kv_indices=None, kv_len_arr=None, backend="auto"):
            assert backend in ("auto", "fa2", "fa3")
            self.backend = backend

        def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe,
                 page_size, causal, sm_scale, q_data_type, kv_data_type, use_profiler=False):
            assert (head_dim_ckv, head_dim_kpe) == (512, 64)
            assert kv_data_type in (torch.float16, torch.bfloat16) and q_data_type == kv_data_type
            for t in (qo_indptr, kv_indptr, kv_indices, kv_len_arr):
                assert t.dtype == torch.int32
            self.p = dict(qo=qo_indptr, kvp=kv_indptr, kvi=kv_indices, lens=kv_len_arr, h=num_heads,
                          page=page_size, causal=causal, scale=sm_scale, dtype=q_data_type)
            calls.append(("plan", self.backend, int(qo_indptr.numel() - 1), page_size, causal))

        def run(self, q_nope, q_pe, ckv_cache, kpe_cache, out=None, lse=None, return_lse=False, **kwargs):
            p = self.p
            assert q_nope.dtype == q_pe.dtype == ckv_cache.dtype == kpe_cache.dtype == p["dtype"]
            assert ckv_cache.dim() == kpe_cache.dim() == 3 and ckv_cache.shape[1] == p["page"]
            assert ckv_cache.stride(-1) == kpe_cache.stride(-1) == 1 and ckv_cache.shape[-1] == 512
            n, h = q_nope.shape[:2]
            assert h == p["h"] and q_pe.shape == (n, h, 64)
            o = torch.zeros(n, h, 512, dtype=q_nope.dtype)
            l2 = torch.full((n, h), -math.inf, dtype=torch.float32)
            for b in range(p["lens"].numel()):
                q0, q1 = int(p["qo"][b]), int(p["qo"][b + 1])
                pages = p["kvi"][int(p["kvp"][b]):int(p["kvp"][b + 1])].long()
                L = int(p["lens"][b])
                ckv = ckv_cache[pages].reshape(-1, 512)[:L].float()
                kpe = kpe_cache[pages].reshape(-1, 64)[:L].float()
                qo_len = q1 - q0
                s = (torch.einsum("qhd,kd->qhk", q_nope[q0:q1].float(), ckv)
                     + torch.einsum("qhd,kd->qhk", q_pe[q0:q1].float(), kpe)) * p["scale"]   # [qo_len, h, L]
                i = torch.arange(qo_len)[:, None]
                keep = (torch.arange(L)[None, :] + qo_len <= L + i) if p["causal"] else torch.ones(qo_len, L, dtype=torch.bool)
                s = s.masked_fill(~keep[:, None, :], -math.inf)
                none = ~keep.any(-1)                                                          # [qo_len]
                lse_e = torch.logsumexp(s, -1)
                prob = torch.exp(s - torch.where(none[:, None], 0.0, lse_e)[..., None])
                o[q0:q1] = torch.einsum("qhk,kd->qhd", prob, ckv).to(o.dtype)
                l2[q0:q1] = lse_e / math.log(2.0)
                # a query with no keys: out 0, lse -inf (write_empty_o); causal with qo_len > kv_len is "not
                # supported" in FlashInfer's tests: this stand-in returns NaN there
                bad = none & (L > 0) & bool(p["causal"])
                o[q0:q1][none] = 0
                l2[q0:q1][none] = -math.inf
                o[q0:q1][bad] = float("nan")
                l2[q0:q1][bad] = float("nan")
            return (o, l2) if return_lse else o

    extra = _fake_flashinfer_methods(calls) if methods else {}
    return types.SimpleNamespace(mla=types.SimpleNamespace(BatchMLAPagedAttentionWrapper=BatchMLAPagedAttentionWrapper),
                                 calls=calls, **extra)


def _fake_flashinfer_methods(calls: list) -> dict:
    """STAND-INS for FlashInfer's ragged prefill, merge_state and append_paged_mla_kv_cache: their signatures and
    documented checks (flashinfer/prefill.py, csrc/cascade.cu, csrc/page.cu), ReferenceOp's arithmetic (the
    float64 oracles' row loops are too slow for the layer runs these stand-ins also serve) turned into
    FlashInfer's conventions: lse in base 2, -inf for a
    query with no keys, NaN for causal queries before the first key (not supported in FlashInfer's tests); the
    append is the kernel's indexing (page iter kv_indptr[batch] * page + position) written here."""

    class BatchPrefillWithRaggedKVCacheWrapper:
        def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, backend="auto"):
            assert kv_layout == "NHD" and backend in ("auto", "fa2", "fa3")
            self.backend = backend

        def plan(self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo=None,
                 custom_mask=None, packed_custom_mask=None, causal=False, sm_scale=None, q_data_type="float16",
                 kv_data_type=None, **kwargs):
            assert qo_indptr.dtype == kv_indptr.dtype == torch.int32 and num_qo_heads % num_kv_heads == 0
            self.p = dict(qo=qo_indptr, kv=kv_indptr, hq=num_qo_heads, hk=num_kv_heads, dqk=head_dim_qk,
                          dvo=head_dim_vo or head_dim_qk, causal=causal, scale=sm_scale, dtype=q_data_type,
                          kv_dtype=kv_data_type or q_data_type)
            calls.append(("prefill plan", self.backend, int(qo_indptr.numel() - 1), bool(causal)))

        def run(self, q, k, v, *args, out=None, lse=None, return_lse=False, **kwargs):
            p = self.p
            assert q.dtype == p["dtype"] in (torch.float16, torch.bfloat16) and k.dtype == v.dtype == p["kv_dtype"]
            assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1, "last dims contiguous"
            assert q.shape[1:] == (p["hq"], p["dqk"]) and k.shape[1:] == (p["hk"], p["dqk"])
            assert v.shape[1:] == (p["hk"], p["dvo"]) and q.shape[0] == int(p["qo"][-1])
            o, l = ReferenceOp().prefill(q, k, v, p["qo"], p["kv"], softmax_scale=p["scale"], causal=p["causal"])
            l2 = torch.where(torch.isinf(l), -math.inf, l / math.log(2.0)).float()
            if p["causal"]:
                for b in range(p["qo"].numel() - 1):
                    m, n = int(p["qo"][b + 1] - p["qo"][b]), int(p["kv"][b + 1] - p["kv"][b])
                    for i in range(max(0, m - n)):               # qo_len > kv_len: unsupported upstream
                        o[int(p["qo"][b]) + i] = float("nan")
                        l2[int(p["qo"][b]) + i] = float("nan")
            return (o.to(q.dtype), l2) if return_lse else o.to(q.dtype)

    def merge_state(v_a, s_a, v_b, s_b):
        assert v_a.is_contiguous() and v_b.is_contiguous() and s_a.is_contiguous() and s_b.is_contiguous(), \
            "CHECK_INPUT: contiguous"
        assert v_a.dtype == v_b.dtype and v_a.dtype in (torch.float16, torch.bfloat16)
        assert v_a.shape == v_b.shape and v_a.shape[2] in (64, 128, 256, 512), f"Unsupported head_dim: {v_a.shape[2]}"
        assert s_a.dtype == s_b.dtype == torch.float32 and s_a.shape == s_b.shape == v_a.shape[:2]
        assert not bool(torch.isposinf(s_a).any() or torch.isposinf(s_b).any()), \
            "an s of +inf is a value to MergeStateKernel (its empty state is -inf)"
        calls.append(("merge_state", tuple(v_a.shape)))
        o, l = ReferenceOp().merge(v_a, s_a * math.log(2.0), v_b, s_b * math.log(2.0))    # natural inside
        l2 = torch.where(torch.isinf(l), -math.inf, l / math.log(2.0))
        return o.to(v_a.dtype), l2.float()

    def append_paged_mla_kv_cache(append_ckv, append_kpe, batch_indices, positions, ckv_cache, kpe_cache,
                                  kv_indices, kv_indptr, kv_last_page_len):
        assert append_ckv.stride(-1) == append_kpe.stride(-1) == 1 and ckv_cache.stride(-1) == kpe_cache.stride(-1) == 1
        assert append_ckv.shape[1] == ckv_cache.shape[2] == 512 and append_kpe.shape[1] == kpe_cache.shape[2] == 64
        assert ckv_cache.dim() == kpe_cache.dim() == 3 and append_ckv.dtype == ckv_cache.dtype
        n = append_ckv.shape[0]
        assert batch_indices.shape == positions.shape == (n,) and kv_indptr.shape == (kv_last_page_len.numel() + 1,)
        page = ckv_cache.shape[1]
        calls.append(("append", n))
        for i in range(n):
            page_iter, entry = divmod(int(kv_indptr[int(batch_indices[i])]) * page + int(positions[i]), page)
            block = int(kv_indices[page_iter])
            ckv_cache[block, entry] = append_ckv[i]
            kpe_cache[block, entry] = append_kpe[i]

    return {"BatchPrefillWithRaggedKVCacheWrapper": BatchPrefillWithRaggedKVCacheWrapper, "merge_state": merge_state,
            "append_paged_mla_kv_cache": append_paged_mla_kv_cache}


def fake_vllm(calls: list | None = None):
    """STAND-IN for vLLM's ``merge_attn_states`` (vllm/v1/attention/ops/merge_attn_states.py) and
    ``concat_and_cache_mla`` (vllm/_custom_ops.py): their signatures and documented checks; the merge is the
    float64 oracle's (either infinity an empty side, lse [h, T] natural, written into output / output_lse); the
    writer copies [kv_c | k_pe] ("auto") or encodes the 656-byte row as the read revision of
    concat_and_cache_ds_mla_kernel does (tile scale max(amax / 448, FLT_MIN), no 1e-4 floor), skipping slot < 0."""
    calls = [] if calls is None else calls

    def merge_attn_states(output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse=None,
                          prefill_tokens_with_context=None, output_scale=None):
        assert prefix_output.stride(1) == suffix_output.stride(1), "matching head strides"
        assert output.dtype in (torch.float32, torch.float16, torch.bfloat16)
        T, h, _ = output.shape
        assert prefix_lse.shape == suffix_lse.shape == (h, T) and prefix_lse.dtype == torch.float32
        calls.append(("merge_attn_states", T, h))
        o, l = oracles.merge(prefix_output, prefix_lse.t(), suffix_output, suffix_lse.t(), base="e")
        output.copy_(o.to(output.dtype))
        if output_lse is not None:
            output_lse.copy_(torch.where(torch.isinf(l), -math.inf, l).t().float())

    def concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale):
        assert kv_cache.dim() == 3 and slot_mapping.dtype == torch.int64 and kv_cache_dtype in ("auto", "fp8_ds_mla")
        assert scale.dtype == torch.float32 and scale.numel() == 1
        page = kv_cache.shape[1]
        calls.append(("concat_and_cache_mla", kv_cache_dtype, int((slot_mapping >= 0).sum())))
        for t, slot in enumerate(slot_mapping.tolist()):
            if slot < 0:
                continue
            block, off = divmod(slot, page)
            if kv_cache_dtype == "auto":
                kv_cache[block, off] = torch.cat([kv_c[t], k_pe[t]]).to(kv_cache.dtype)
                continue
            tiles = kv_c[t].float().view(4, 128)
            s = torch.clamp(tiles.abs().amax(-1) / 448.0, min=torch.finfo(torch.float32).tiny)
            row = kv_cache[block, off]
            row[:512] = (tiles / s[:, None]).to(torch.float8_e4m3fn).view(torch.uint8).flatten()
            row[512:528] = s.view(torch.uint8)
            row[528:] = k_pe[t].to(BF16).contiguous().view(torch.uint8)

    return types.SimpleNamespace(merge_attn_states=merge_attn_states, concat_and_cache_mla=concat_and_cache_mla,
                                 calls=calls)


# --------------------------------------------------------------------------- the glue, on the stand-ins


def _paged(lens, page, *, fp8=False, seed=0, h_q=16, s_q=1):
    """q [B, s_q, h_q, 576] bf16, a NaN-poisoned shuffled paged cache holding each row's keys, block table, lens."""
    gen = torch.Generator().manual_seed(seed)
    B = len(lens)
    max_blocks = max(1, max(math.ceil(n / page) for n in lens)) + 1
    num_blocks = B * max_blocks + 3
    keys = torch.randn(num_blocks * page, 576, generator=gen)
    kv = keys.to(BF16).view(num_blocks, page, 1, 576).clone()
    bt = torch.randperm(num_blocks, generator=gen)[:B * max_blocks].view(B, max_blocks).to(torch.int32)
    for b, n in enumerate(lens):  # NaN everywhere a row has no token
        for j in range(max_blocks):
            lo = max(0, n - j * page)
            if lo < page:
                kv[bt[b, j], lo:] = float("nan")
    if fp8:
        kv = encode_fp8_656(kv.float())
    q = torch.randn(B, s_q, h_q, 576, generator=gen).to(BF16)
    return q, kv, bt, torch.tensor(lens, dtype=torch.int32)


def _close(a, b, what):
    a, b = a.double(), b.double()
    assert a.shape == b.shape, (what, a.shape, b.shape)
    same_inf = torch.isinf(a) == torch.isinf(b)
    assert bool(same_inf.all()), f"{what}: infinities differ"
    fin = torch.isfinite(b)
    err = (a[fin] - b[fin]).abs().max().item() if bool(fin.any()) else 0.0
    assert err <= 2e-2, f"{what}: max abs error {err:.3e}"


@pytest.mark.parametrize("interface,s_q,causal", [("current", 3, True), ("sep2025", 1, False)])
def test_flashmla_dense_glue_equals_reference_op(interface, s_q, causal):
    q, kv, bt, lens = _paged([70, 0, 3], 64, s_q=s_q, h_q=8)
    calls = []
    op = FlashMLAOp(flash_mla_module=fake_flash_mla(interface, calls))
    out, lse = op.decode(q, kv, bt, lens, softmax_scale=0.07, causal=causal)
    ref_out, ref_lse = ReferenceOp().decode(q, kv, bt, lens, softmax_scale=0.07, causal=causal)
    assert out.shape == (3, s_q, 8, 512) and lse.shape == (3, 8, s_q) and lse.dtype == torch.float32
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    assert ("kernel", 3, s_q, 8, None) in calls
    if interface == "sep2025":
        assert ("metadata", s_q * 8, 8, False, None) in calls


@pytest.mark.parametrize("interface", ["current", "sep2025"])
def test_flashmla_sparse_glue_pads_heads_and_topk_and_equals_reference_op(interface):
    q, kv, bt, lens = _paged([40, 17], 16, fp8=True, h_q=3, s_q=2)
    num_slots = kv.shape[0] * kv.shape[1]
    gen = torch.Generator().manual_seed(3)
    t = torch.randint(0, 10**6, (2, 2, 10), generator=gen) % lens.long().view(2, 1, 1)  # written tokens only
    idx = (bt.long().gather(1, (t // 16).flatten(1)).view(2, 2, 10) * 16 + t % 16).to(torch.int32)
    idx[0, 0, 3], idx[0, 1, 4], idx[1, 0, 5] = -1, INT_MAX, num_slots  # invalid entries
    idx[1, 1] = -1                                                        # a query with no valid index
    topk_length = torch.tensor([10, 6], dtype=torch.int32)
    sink = torch.tensor([0.5, math.inf, -math.inf])
    calls = []
    op = FlashMLASparseOp(flash_mla_module=fake_flash_mla(interface, calls))
    kwargs = dict(softmax_scale=0.05, causal=False, indices=idx, topk_length=topk_length)
    if interface == "current":
        kwargs["attn_sink"] = sink
    out, lse = op.decode(q, kv, bt, lens, **kwargs)
    ref_out, ref_lse = ReferenceOp().decode(q, kv, bt, lens, **kwargs)
    assert out.shape == (2, 2, 3, 512) and lse.shape == (2, 3, 2)
    _close(out, ref_out, "out")
    _close(lse, ref_lse, "lse")
    assert bool(torch.isposinf(lse[1, :, 1]).all()) and bool((out[1, 1] == 0).all())
    assert ("kernel", 2, 2, 64, 64) in calls  # 3 heads ran as 64, top-10 as 64
    if interface == "sep2025":
        assert ("metadata", 2 * 64, 64, True, 64) in calls


def test_flashmla_sparse_declines_attn_sink_on_a_release_without_it(monkeypatch):
    monkeypatch.setattr(arch, "detect", lambda device=None: _device((9, 0), "NVIDIA H200"))
    case = OpCase(batch=1, s_q=1, h_q=64, page_block_size=64, dtype=BF16, kv_format="fp8-e4m3-flashmla", topk=64)
    old = FlashMLASparseOp(flash_mla_module=fake_flash_mla("sep2025"))
    assert old.unsupported_reason(case) is None
    reason = old.unsupported_reason(OpCase(**{**case.__dict__, "attn_sink": True}))
    assert reason and "attn_sink" in reason
    assert FlashMLASparseOp(flash_mla_module=fake_flash_mla()).unsupported_reason(
        OpCase(**{**case.__dict__, "attn_sink": True})) is None


@pytest.mark.parametrize("page,s_q,causal", [(1, 4, True), (16, 1, False), (16, 2, False)])
def test_flashinfer_glue_equals_reference_op_in_base_2(page, s_q, causal):
    """Zero-length rows, a row shorter than s_q (causal queries with no keys), pages split across rows."""
    q, kv, bt, lens = _paged([0, 2, 37], page, s_q=s_q, h_q=4)
    q = q[:, :, :, :].transpose(1, 2).contiguous().transpose(1, 2)  # non-contiguous q
    calls = []
    op = FlashInferOp(flashinfer_module=fake_flashinfer(calls))
    out, lse = op.decode(q, kv, bt, lens, softmax_scale=0.06, causal=causal)
    ref_out, ref_lse = ReferenceOp().decode(q, kv, bt, lens, softmax_scale=0.06, causal=causal)
    assert out.shape == (3, s_q, 4, 512) and lse.shape == (3, 4, s_q) and lse.dtype == torch.float32
    empty = torch.isinf(ref_lse)
    assert bool(torch.isneginf(lse[empty]).all()), "FlashInfer's empty rows: lse -inf, as declared"
    assert bool((out.transpose(1, 2)[empty] == 0).all())
    natural = lse_to_natural(lse, op.lse_base)
    _close(natural[~empty], ref_lse[~empty], "lse (base 2 read as declared)")
    _close(out, ref_out, "out")
    assert calls == [("plan", "auto", 3, page, causal)]


def test_flashinfer_lse_is_base_2_not_e():
    """Read as natural log, the stand-in's base-2 lse is off by the factor log(2): the declaration matters."""
    q, kv, bt, lens = _paged([33], 16, h_q=2)
    _, lse = FlashInferOp(flashinfer_module=fake_flashinfer()).decode(q, kv, bt, lens, softmax_scale=0.06,
                                                                      causal=False)
    _, ref_lse = ReferenceOp().decode(q, kv, bt, lens, softmax_scale=0.06, causal=False)
    assert torch.allclose(lse * math.log(2.0), ref_lse, atol=1e-3)
    assert not torch.allclose(lse, ref_lse, atol=1e-2)


# --------------------------------------------------------------------------- the optional methods' adapters
# (prefill / merge / write of FlashInfer, sparse_prefill of FlashMLA, merge / write of vLLM), glue on the stand-ins
# above, checked by the op suite's own checks (mla_conformance.checks.{prefill,merge,write,sparse_prefill})

from mla_conformance.checks.op import merge as merge_checks  # noqa: E402
from mla_conformance.checks.op import prefill as prefill_checks  # noqa: E402
from mla_conformance.checks.op import sparse_prefill as sparse_checks  # noqa: E402
from mla_conformance.checks.op import write as write_checks  # noqa: E402
from mla_conformance.contract.op import MethodCase  # noqa: E402
from mla_conformance.impl.ops.vllm_ops import VLLMOp  # noqa: E402

METHOD_CASES = {
    "prefill": MethodCase("prefill", BF16, h_q=8, h_k=8, d_qk=192, d_v=128, tokens=4, causal=True),
    "merge": MethodCase("merge", BF16, h_q=8, d_v=128, tokens=4),
    "write": MethodCase("write", BF16, d_qk=576, d_v=512, tokens=4, kv_format="latent", page_block_size=16),
    "sparse_prefill": MethodCase("sparse_prefill", BF16, h_q=64, h_k=1, d_qk=576, d_v=512, tokens=4, topk=64),
}
METHOD_KERNELS = [
    (lambda: FlashInferOp(), "prefill", "flashinfer/fa2_prefill"),
    (lambda: FlashInferOp(), "merge", "flashinfer/merge_state"),
    (lambda: FlashInferOp(), "write", "flashinfer/append_paged_mla_kv_cache"),
    (lambda: FlashMLASparseOp(), "sparse_prefill", "flashmla/sparse_prefill"),
    (lambda: FlashMLAOp(), "prefill", "flashmla/dense_prefill"),
    (lambda: VLLMOp(), "merge", "vllm/merge_attn_states"),
    (lambda: VLLMOp(), "write", "vllm/concat_and_cache_mla"),
]


@pytest.fixture
def on_h200(monkeypatch):
    """The device judged is an H200 with flash_mla, flashinfer and vllm installed (the kernels are stand-ins)."""
    info = _device((9, 0), "NVIDIA H200", packages=("flash_mla", "flashinfer", "vllm"))
    monkeypatch.setattr(arch, "detect", lambda device=None: info)
    return info


@pytest.mark.parametrize("make,method,kernel", METHOD_KERNELS, ids=lambda v: v if isinstance(v, str) else "")
def test_method_adapters_decline_here_with_the_matrix_sentence(make, method, kernel):
    expected = arch.why_not(kernel, arch.detect("cpu"))
    if expected is None:
        pytest.skip(f"{kernel} runs on this host")
    assert make().unsupported_reason(METHOD_CASES[method]) == expected
    assert kernel in arch.ADAPTERS and make().name in arch.ADAPTERS[kernel]
    assert arch.adapter_status()[kernel]["note"] == arch.NOT_RUN_ON_HARDWARE


def test_method_declarations():
    fi = declarations(FlashInferOp())
    assert (fi["prefill_lse_base"], fi["prefill_empty_row"], fi["prefill_head_dims"]) == ("2", "-inf", ((192, 128),))
    assert (fi["merge_lse_base"], fi["merge_empty_row"], fi["write_kv_formats"]) == ("2", "-inf", ("latent",))
    sp = declarations(FlashMLASparseOp())
    assert sp["sparse_prefill_head_dims"] == ((576, 512), (512, 512)) and sp["sparse_prefill_lse_base"] == "e"
    assert sp["sparse_prefill_topk_length"] and sp["sparse_prefill_attn_sink"]
    assert declarations(VLLMOp()) == {"merge_lse_base": "e", "merge_empty_row": "-inf", "merge_empty_input": "either",
                                      "write_kv_formats": ("latent", "fp8-e4m3-flashmla"),
                                      "write_fp8_scale_format": "fp32", "write_page_block_sizes": (1, 16, 64),
                                      "write_padding_slot": "negative"}
    assert FlashInferOp().method_kernel_id("prefill", _device((9, 0), "H100")) == "flashinfer/fa3_prefill"
    assert FlashInferOp().method_kernel_id("prefill", _device((8, 9), "L40S")) == "flashinfer/fa2_prefill"
    assert FlashInferFA2Op().method_kernel_id("prefill", _device((9, 0), "H100")) == "flashinfer/fa2_prefill"


def _replace(case, **kw):
    return MethodCase(**{**case.__dict__, **kw})


@pytest.mark.parametrize("make,case,needle", [
    (lambda: FlashInferOp(flashinfer_module=fake_flashinfer()), _replace(METHOD_CASES["merge"], dtype=torch.float32),
     "float16 or bfloat16"),
    (lambda: FlashInferOp(flashinfer_module=fake_flashinfer()), _replace(METHOD_CASES["merge"], d_v=96),
     "head_dim 64, 128, 256, 512, not 96"),
    (lambda: FlashInferOp(flashinfer_module=fake_flashinfer()), _replace(METHOD_CASES["merge"], h_q=128, d_v=512),
     "at most 1024"),
    (lambda: FlashInferOp(flashinfer_module=fake_flashinfer()),
     _replace(METHOD_CASES["write"], kv_format="fp8-e4m3-flashmla"), "format 'latent'"),
    (lambda: FlashInferOp(flashinfer_module=fake_flashinfer(methods=False)), METHOD_CASES["prefill"],
     "has no BatchPrefillWithRaggedKVCacheWrapper (a release before it)"),
    (lambda: FlashMLASparseOp(flash_mla_module=fake_flash_mla()), _replace(METHOD_CASES["sparse_prefill"], h_k=2),
     "MQA"),
    (lambda: FlashMLASparseOp(flash_mla_module=fake_flash_mla("sep2025")),
     _replace(METHOD_CASES["sparse_prefill"], topk_length=True), "takes no topk_length"),
    (lambda: VLLMOp(vllm_module=fake_vllm()), _replace(METHOD_CASES["merge"], dtype=torch.float8_e4m3fn),
     "float32, float16 or bfloat16"),
    (lambda: VLLMOp(vllm_module=fake_vllm()), _replace(METHOD_CASES["write"], kv_format="fp8-e4m3-model1"),
     "not fp8-e4m3-model1"),
])
def test_method_sentences_after_the_device(on_h200, make, case, needle):
    op = make()
    reason = op.unsupported_reason(case)
    assert reason and needle in reason, reason
    if "a release before it" not in needle:  # the release itself lacks the kernel: every case is declined
        assert op.unsupported_reason(METHOD_CASES[case.method]) is None


def test_flashinfer_prefill_glue_passes_the_prefill_checks(on_h200, mla_figures):
    """Rows with kv_len 0 and q_len > kv_len (causal: queries with no key, written by the adapter), strided q / k /
    v, h_k 1 and h_q 8: the stand-in's base-2 lse read as declared."""
    calls = []
    op = FlashInferOp(flashinfer_module=fake_flashinfer(calls))
    for causal, strided, h_k in ((True, False, 1), (False, True, 8)):
        spec = prefill_checks.PrefillSpec(rows=((3, 0), (5, 2), (4, 9)), h_q=8, h_k=h_k, causal=causal,
                                          strided=strided, seed=11)
        prefill_checks.check_against_oracle(op, spec, check="prefill glue on the stand-in", figures=mla_figures)
    assert [c for c in calls if c[0] == "prefill plan"] == [("prefill plan", "auto", 3, True),
                                                           ("prefill plan", "auto", 3, False)]


def test_flashinfer_merge_glue_passes_the_merge_checks(on_h200, mla_figures):
    """+inf and -inf empty sides (the adapter maps +inf to FlashInfer's -inf), both sides empty, strided inputs."""
    op = FlashInferOp(flashinfer_module=fake_flashinfer())
    for empties, strided in ((merge_checks.ONE_SIDED + merge_checks.BOTH_EMPTY, False), (merge_checks.ONE_SIDED, True)):
        spec = merge_checks.spec_for(op, dtype="bfloat16", empties=empties, strided=strided, seed=5)
        merge_checks.check_against_oracle(op, spec, check="merge glue on the stand-in", figures=mla_figures)


def test_flashinfer_write_glue_passes_the_write_checks(on_h200, mla_figures):
    """Padding slots (-1) never reach the kernel, each token a one-page request; every other byte untouched."""
    calls = []
    op = FlashInferOp(flashinfer_module=fake_flashinfer(calls))
    inp = write_checks.check_write(op, write_checks.WriteSpec(kv_format="latent", page=16), check="write glue",
                                   figures=mla_figures)
    assert calls == [("append", int((inp.slots >= 0).sum()))]


def test_flashmla_sparse_prefill_glue_passes_the_sparse_prefill_checks(on_h200, mla_figures):
    """3 heads run as 64, top-64 padded to 128, FlashMLA's invalid indices (INT_MIN, -123456 set to -1), all-invalid
    rows, topk_length and +-inf sinks; d_qk 576 and 512 (MODEL1)."""
    calls = []
    op = FlashMLASparseOp(flash_mla_module=fake_flash_mla(calls=calls))
    for d_qk in (576, 512):
        spec = sparse_checks.SparseSpec(s_q=4, s_kv=80, topk=64, h_q=3, d_qk=d_qk, invalid_share=0.3,
                                        all_invalid_rows=(1,), topk_length=True, attn_sink=True, seed=7)
        sparse_checks.check_against_oracle(op, spec, check="sparse prefill glue on the stand-in", figures=mla_figures)
    assert calls == [("sparse_fwd", 4, 64, 128)] * 2


def test_flashmla_dense_prefill_glue_passes_the_prefill_checks(monkeypatch, mla_figures):
    """On an SM100 device (the kernel's only target): rows with kv_len 0 and q_len > kv_len (causal: queries with
    no key, which the stand-in leaves NaN and the adapter sets to out 0, lse +inf), strided k / v made contiguous,
    h_k 1 and 8 under h_q 8."""
    info = _device((10, 0), "NVIDIA B200", packages=("flash_mla",))
    monkeypatch.setattr(arch, "detect", lambda device=None: info)
    calls = []
    op = FlashMLAOp(flash_mla_module=fake_flash_mla(calls=calls))
    for causal, strided, h_k in ((True, False, 1), (False, True, 8)):
        spec = prefill_checks.PrefillSpec(rows=((3, 0), (5, 2), (4, 9)), h_q=8, h_k=h_k, causal=causal,
                                          strided=strided, seed=12)
        prefill_checks.check_against_oracle(op, spec, check="dense prefill glue on the stand-in", figures=mla_figures)
    assert calls == [("varlen", 3, 8, 1, True), ("varlen", 3, 8, 8, False)]
    old = FlashMLAOp(flash_mla_module=fake_flash_mla("sep2025"))
    assert "no flash_attn_varlen_func" in old.unsupported_reason(METHOD_CASES["prefill"])
    h200 = _device((9, 0), "NVIDIA H200", packages=("flash_mla",))
    monkeypatch.setattr(arch, "detect", lambda device=None: h200)
    assert op.unsupported_reason(METHOD_CASES["prefill"]) == arch.why_not("flashmla/dense_prefill", h200)


def test_vllm_merge_and_write_glue(on_h200, mla_figures):
    """merge: lse handed as vLLM's [h, T], both-empty -inf; write: format latent bit for bit. The FP8 656-byte
    writer as the read revision encodes it (FLT_MIN floor, no 1e-4) differs from FlashMLA's quant.py on an
    all-zero tile, and passes: under fp32 scales a tile is judged by what it decodes to (scale FLT_MIN, payload 0:
    0), the floor optional."""
    calls = []
    op = VLLMOp(vllm_module=fake_vllm(calls))
    spec = merge_checks.spec_for(op, dtype="float32", empties=merge_checks.ONE_SIDED + merge_checks.BOTH_EMPTY,
                                 strided=True, seed=6)
    merge_checks.check_against_oracle(op, spec, check="vllm merge glue", figures=mla_figures)
    write_checks.check_write(op, write_checks.WriteSpec(kv_format="latent", page=16), check="vllm write glue",
                             figures=mla_figures)
    write_checks.check_write(op, write_checks.WriteSpec(kv_format="fp8-e4m3-flashmla", page=16),
                             check="vllm fp8 write glue", figures=mla_figures)
    assert [c[:2] for c in calls] == [("merge_attn_states", 8), ("concat_and_cache_mla", "auto"),
                                      ("concat_and_cache_mla", "fp8_ds_mla")]
