"""FlashInfer's MLA paged attention (``flashinfer.mla.BatchMLAPagedAttentionWrapper``) behind the op contract.

Read at flashinfer-ai/flashinfer ``fb28d7242b3506a2348265962041acc1fb56cca4`` (``flashinfer/mla/_core.py``,
``include/flashinfer/attention/mla.cuh``, ``tests/attention/test_deepseek_mla.py``; the matrix rows
``flashinfer/fa2_mla`` and ``flashinfer/fa3_mla`` cite them):

* layout: the wrapper takes the query and the cache split, ``q_nope`` [n, h, 512] / ``q_pe`` [n, h, 64] and
  ``ckv_cache`` [pages, page_size, 512] / ``kpe_cache`` [pages, page_size, 64], each read through its strides.
  The adapter hands it *views*: q[..., :512] / q[..., 512:] flattened over (batch, s_q), and
  kv_cache[:, :, 0, :512] / kv_cache[:, :, 0, 512:] of the contract's [num_blocks, page, 1, 576] pool (no
  copy). The block table becomes FlashInfer's CSR form (``kv_indptr``: ceil(len / page) pages per row,
  ``kv_indices``: those entries of each row, in order), ``qo_indptr`` = s_q per row;
* ``plan(..., causal, sm_scale, q dtype, kv dtype)`` then ``run(q_nope, q_pe, ckv, kpe, return_lse=True)``.
  The lse is in **base 2** (``return_lse_base_on_e=False``, the default, is left as is): declared
  ``lse_base = "2"``;
* causal: FlashInfer drops key kv_idx for query q_idx when ``kv_idx + qo_len > kv_len + q_idx``, the
  contract's bottom-right alignment. FlashInfer's tests skip ``qo_len > kv_len`` ("not supported for causal
  attention"); the contract says a causal query before the row's first key has no keys, so the adapter
  writes those queries itself (out 0, lse -inf) over whatever the kernel returned for them;
* a query with no keys gets out 0 and lse **-inf** (``write_empty_o``): declared ``empty_row = "-inf"``;
* dtypes float16 and bfloat16 (kv dtype = q dtype); the kernel's FP8 cache (e4m3 ckv *and* kpe, per-tensor
  or per-128-channel scales, SM90 only) is not the contract's 656-byte layout (bf16 rope): declined; no
  sparse indices, no attention sink: declined;
* ``backend``: ``"auto"`` (FlashInfer's default: fa3 on SM90, fa2 elsewhere), ``"fa2"`` or ``"fa3"``; the
  matrix row gating a case is fa3's where fa3 runs, fa2's otherwise.

The optional methods (mla_conformance.contract.op), read at the same revision:

* ``prefill``: ``flashinfer.BatchPrefillWithRaggedKVCacheWrapper`` (``flashinfer/prefill.py``,
  ``include/flashinfer/attention/prefill.cuh``; vLLM drives it the same way in
  ``vllm/v1/attention/backends/mla/prefill/flashinfer.py``): ``plan(qo_indptr, kv_indptr, num_qo_heads,
  num_kv_heads, head_dim_qk, head_dim_vo=, causal=, sm_scale=, q_data_type=, kv_data_type=)`` then
  ``run(q, k, v, return_lse=True)``; q / k / v are read through their token and head strides (the last dim must
  be contiguous: copied when it is not). Causal aligns bottom-right (``q_idx + kv_len - qo_len``); the lse is
  ``log2(d) + m`` of base-2 scaled logits: declared ``prefill_lse_base = "2"``; a query with no keys keeps
  m = -inf, d = 1: out 0, lse -inf (``prefill_empty_row = "-inf"``). As for decode, causal queries before their
  row's first key are written by the adapter (out 0, lse -inf). ``backend`` "auto" is FlashInfer's
  ``determine_attention_backend`` (``flashinfer/utils.py``: fa3 on SM90 for (192, 128), else fa2), gated by the
  rows ``flashinfer/fa3_prefill`` / ``flashinfer/fa2_prefill``; (d_qk, d_v) 192 / 128 (DeepSeek-V3's MHA mode);
* ``merge``: ``flashinfer.merge_state(v_a, s_a, v_b, s_b) -> (v, s)`` (``flashinfer/cascade.py``,
  ``csrc/cascade.cu``, ``MergeStateKernel`` in ``include/flashinfer/attention/cascade.cuh``): contiguous
  inputs (CHECK_INPUT; the adapter copies strided ones, and casts v_b to v_a's dtype), float16 / bfloat16 v,
  head_dim 64 / 128 / 256 / 512 (DISPATCH_HEAD_DIM) and num_heads x head_dim / vec_size <= 1024 threads; s in
  **base 2** (``merge_lse_base = "2"``). Its empty state is -inf (two empty sides: out 0, s -inf, the kernel's
  d_sum guard: ``merge_empty_row = "-inf"``); an s of +inf would be taken as a value, so the adapter maps +inf
  (FA2's empty marker) to -inf before the call;
* ``write``: ``flashinfer.append_paged_mla_kv_cache(append_ckv, append_kpe, batch_indices, positions,
  ckv_cache, kpe_cache, kv_indices, kv_indptr, kv_last_page_len)`` (``flashinfer/page.py``, ``csrc/page.cu``,
  ``AppendPagedKVMlaCacheKernel`` in ``include/flashinfer/page.cuh``; "current only support ckv=512 and
  kpe=64"): the latent format only, ckv / kpe the [pages, page, 512] / [pages, page, 64] views of the
  contract's pool (strided caches are read through their strides). FlashInfer has no slot mapping and no
  padding slot: each token of a non-negative slot becomes a one-page request (kv_indices = its block,
  position = its offset), tokens of negative slots are not handed to the kernel.

A stand-in module (``flashinfer_module=``, with ``.mla.BatchMLAPagedAttentionWrapper``, and for the methods
``BatchPrefillWithRaggedKVCacheWrapper``, ``merge_state``, ``append_paged_mla_kv_cache``) replaces
``import flashinfer`` for CPU tests of the glue; the device is judged all the same. A module without one of
those names (an older release) declines that method with a sentence.
"""

from __future__ import annotations

import math

import torch

from mla_conformance import arch
from mla_conformance.contract.op import D_QK, D_ROPE, D_V, PREFILL_D_QK, PREFILL_D_V, declared
from mla_conformance.dtypes import dtype_name
from mla_conformance.impl.ops.ragged import queries_without_keys, with_empty_queries

FA2_KERNEL = "flashinfer/fa2_mla"
FA3_KERNEL = "flashinfer/fa3_mla"
FA2_PREFILL = "flashinfer/fa2_prefill"
FA3_PREFILL = "flashinfer/fa3_prefill"
MERGE_KERNEL = "flashinfer/merge_state"
APPEND_KERNEL = "flashinfer/append_paged_mla_kv_cache"
#: the kernel each optional method calls, and the module attribute it is
METHOD_API = {"prefill": "BatchPrefillWithRaggedKVCacheWrapper", "merge": "merge_state",
              "write": "append_paged_mla_kv_cache"}
MERGE_HEAD_DIMS = (64, 128, 256, 512)
BACKENDS = ("auto", "fa2", "fa3")
WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended float workspace


class FlashInferOp:
    """FlashInfer's BatchMLAPagedAttentionWrapper (fa2 / fa3) behind the op contract; lse in base 2."""

    name = "flashinfer"
    lse_base = "2"
    empty_row = "-inf"
    page_block_sizes = (1, 16, 64)  # any page size; FlashInfer's own tests run 1 and 16
    kv_formats = ("latent",)
    prefill_head_dims = ((PREFILL_D_QK, PREFILL_D_V),)
    prefill_lse_base = "2"
    prefill_empty_row = "-inf"
    merge_lse_base = "2"
    merge_empty_row = "-inf"
    write_kv_formats = ("latent",)
    write_page_block_sizes = (1, 16, 64)

    def __init__(self, flashinfer_module=None, backend: str = "auto", workspace_bytes: int = WORKSPACE_BYTES):
        if backend not in BACKENDS:
            raise ValueError(f"FlashInferOp backend {backend!r}: expected one of {', '.join(BACKENDS)}")
        # a stand-in module (CPU glue tests) replaces `import flashinfer`; gating still judges the real device
        self._module = flashinfer_module
        self.backend = backend
        self.workspace_bytes = int(workspace_bytes)
        self._wrappers: dict[str, object] = {}
        self._prefill_wrappers: dict[str, object] = {}

    # ------------------------------------------------------------------ gating
    def kernel_id(self, info) -> str:
        """The matrix row of what runs on ``info`` (a DeviceInfo): fa3 where the wrapper picks it, else fa2."""
        if self.backend == "fa3":
            return FA3_KERNEL
        if self.backend == "fa2":
            return FA2_KERNEL
        return FA3_KERNEL if arch.why_not(FA3_KERNEL, info, check_package=False) is None else FA2_KERNEL

    def method_kernel_id(self, method: str, info) -> str:
        """The matrix row of an optional method's kernel on ``info``."""
        if method != "prefill":
            return {"merge": MERGE_KERNEL, "write": APPEND_KERNEL}[method]
        if self.backend in ("fa2", "fa3"):
            return FA3_PREFILL if self.backend == "fa3" else FA2_PREFILL
        return FA3_PREFILL if arch.why_not(FA3_PREFILL, info, check_package=False) is None else FA2_PREFILL

    def _flashinfer(self):
        if self._module is not None:
            return self._module
        import flashinfer
        import flashinfer.mla  # noqa: F401

        return flashinfer

    def unsupported_reason(self, case):
        if getattr(case, "method", "decode") != "decode":
            return self._method_reason(case)
        info = arch.detect(case.device)
        reason = arch.why_not(self.kernel_id(info), info)
        if reason:
            return reason
        if case.sparse:
            return (f"FlashInfer's BatchMLAPagedAttentionWrapper attends every key of the row; it takes no top-k "
                    f"indices (sparse top-{case.topk})")
        if case.attn_sink:
            return "FlashInfer's BatchMLAPagedAttentionWrapper.run takes no attention sink"
        if case.dtype not in (torch.float16, torch.bfloat16):
            return (f"FlashInfer's MLA wrapper takes a float16 or bfloat16 q and cache, not "
                    f"{dtype_name(case.dtype)}")
        if case.kv_format != "latent":
            return (f"FlashInfer's MLA wrapper reads the latent as ckv and kpe in q's dtype (its FP8 cache is e4m3 "
                    f"ckv and kpe with per-tensor or per-128-channel scales, SM90 only), not the {case.kv_format} "
                    "656-byte layout with a bfloat16 rope")
        if case.page_block_size not in self.page_block_sizes:
            return (f"{self.name} is run with pages of {', '.join(map(str, self.page_block_sizes))} tokens, not "
                    f"{case.page_block_size}")
        if self._module is None:
            try:
                self._flashinfer()
            except Exception as exc:
                return f"FlashInfer MLA: the flashinfer package does not import ({type(exc).__name__}: {exc})"
        return None

    def _method_reason(self, case) -> str | None:
        method = case.method
        reason = arch.why_not(self.method_kernel_id(method, arch.detect(case.device)), arch.detect(case.device))
        if reason:
            return reason
        if case.dtype not in (torch.float16, torch.bfloat16):
            what = {"prefill": "q, k and v", "merge": "v_a and v_b", "write": "the appended ckv / kpe"}[method]
            return f"FlashInfer's {METHOD_API[method]} takes float16 or bfloat16 {what}, not {dtype_name(case.dtype)}"
        if method == "merge":
            if case.d_v not in MERGE_HEAD_DIMS:
                return (f"FlashInfer's merge_state dispatches head_dim {', '.join(map(str, MERGE_HEAD_DIMS))}, "
                        f"not {case.d_v}")
            vec = max(16 // torch.empty(0, dtype=case.dtype).element_size(), case.d_v // 32)
            if case.h_q * (case.d_v // vec) > 1024:
                return (f"FlashInfer's merge_state runs num_heads x head_dim / {vec} threads per block, at most 1024: "
                        f"not {case.h_q} heads of {case.d_v}")
        if method == "write":
            if case.kv_format != "latent":
                return (f"FlashInfer's append_paged_mla_kv_cache writes ckv and kpe in their dtype (format 'latent'), "
                        f"not {case.kv_format}")
            if (case.d_qk, case.d_v) != (D_QK, D_V):
                return f"FlashInfer's append_paged_mla_kv_cache takes ckv 512 and kpe 64 only, not {case.d_v} + " \
                       f"{case.d_qk - case.d_v}"
            if case.page_block_size not in declared(self, "write_page_block_sizes"):
                return (f"{self.name} writes pages of {', '.join(map(str, self.write_page_block_sizes))} tokens, "
                        f"not {case.page_block_size}")
        if self._module is None:
            try:
                self._flashinfer()
            except Exception as exc:
                return f"FlashInfer: the flashinfer package does not import ({type(exc).__name__}: {exc})"
        if not hasattr(self._flashinfer(), METHOD_API[method]):
            return f"FlashInfer: the installed flashinfer has no {METHOD_API[method]} (a release before it)"
        return None

    # ------------------------------------------------------------------ decode
    def _wrapper_for(self, device: torch.device):
        """One wrapper per device (its workspaces are allocated once; plan() is called per decode)."""
        key = str(device)
        if key not in self._wrappers:
            fi = self._flashinfer()
            workspace = torch.empty(self.workspace_bytes, dtype=torch.int8, device=device)
            self._wrappers[key] = fi.mla.BatchMLAPagedAttentionWrapper(workspace, backend=self.backend)
        return self._wrappers[key]

    def decode(self, q, kv_cache, block_table, cache_seqlens, *, softmax_scale, causal, indices=None,
               topk_length=None, attn_sink=None):
        if indices is not None or topk_length is not None or attn_sink is not None:
            raise ValueError(f"{self.name}: BatchMLAPagedAttentionWrapper takes no indices, topk_length or attn_sink")
        if kv_cache.dtype != q.dtype:
            raise ValueError(f"{self.name}: the cache is {kv_cache.dtype} but q is {q.dtype}; FlashInfer plans "
                             "one dtype for both here")
        B, s_q, h_q, d = q.shape
        dev = q.device
        if B == 0:
            return (q.new_zeros(0, s_q, h_q, D_V), torch.zeros(0, h_q, s_q, dtype=torch.float32, device=dev))
        page = kv_cache.shape[1]
        lens = cache_seqlens.to(device=dev, dtype=torch.int32)
        pages = (lens + page - 1) // page                                              # [B]
        used = torch.arange(block_table.shape[1], device=dev)[None, :] < pages[:, None]
        kv_indices = block_table.to(device=dev, dtype=torch.int32)[used].contiguous()   # row-major: rows in order
        kv_indptr = torch.zeros(B + 1, dtype=torch.int32, device=dev)
        kv_indptr[1:] = torch.cumsum(pages, 0)
        qo_indptr = torch.arange(B + 1, dtype=torch.int32, device=dev) * s_q

        q_nope = q[..., :D_V].reshape(B * s_q, h_q, D_V)
        q_pe = q[..., D_V:].reshape(B * s_q, h_q, D_ROPE)
        ckv = kv_cache[:, :, 0, :D_V]
        kpe = kv_cache[:, :, 0, D_V:]

        wrapper = self._wrapper_for(dev)
        wrapper.plan(qo_indptr, kv_indptr, kv_indices, lens, h_q, D_V, D_ROPE, page, bool(causal),
                     float(softmax_scale), q.dtype, kv_cache.dtype)
        out, lse = wrapper.run(q_nope, q_pe, ckv, kpe, return_lse=True)
        out = out.view(B, s_q, h_q, D_V)
        lse = lse.view(B, s_q, h_q).transpose(1, 2)                                    # [B, h_q, s_q], base 2
        if causal and s_q > 1:
            # queries before the row's first key (s_q > len): none in FlashInfer's tests, no keys by the contract
            empty = torch.arange(s_q, device=dev)[None, :] < (s_q - lens.to(torch.int64))[:, None]   # [B, s_q]
            if bool(empty.any()):
                out = torch.where(empty[:, :, None, None], torch.zeros((), dtype=out.dtype, device=dev), out)
                lse = torch.where(empty[:, None, :], torch.full((), -math.inf, device=dev), lse)
        return out, lse.to(torch.float32).contiguous()


    # ------------------------------------------------------------------ the optional methods
    def _prefill_wrapper_for(self, device: torch.device):
        key = str(device)
        if key not in self._prefill_wrappers:
            fi = self._flashinfer()
            workspace = torch.empty(self.workspace_bytes, dtype=torch.uint8, device=device)
            self._prefill_wrappers[key] = fi.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD",
                                                                                  backend=self.backend)
        return self._prefill_wrappers[key]

    def prefill(self, q, k, v, cu_seqlens_q, cu_seqlens_k, *, softmax_scale, causal):
        dev = q.device
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        qo_indptr = cu_seqlens_q.to(device=dev, dtype=torch.int32)
        kv_indptr = cu_seqlens_k.to(device=dev, dtype=torch.int32)
        total_q, h_q, d_qk = q.shape
        h_k, d_v = k.shape[1], v.shape[-1]
        wrapper = self._prefill_wrapper_for(dev)
        wrapper.plan(qo_indptr, kv_indptr, h_q, h_k, d_qk, head_dim_vo=d_v, causal=bool(causal),
                     sm_scale=float(softmax_scale), q_data_type=q.dtype, kv_data_type=k.dtype)
        out, lse = wrapper.run(q, k, v, return_lse=True)                              # lse [total_q, h_q], base 2
        # causal queries before their row's first key (qo_len > kv_len; none in FlashInfer's tests) have no keys
        out, lse = with_empty_queries(out, lse.to(torch.float32), queries_without_keys(qo_indptr, kv_indptr, causal),
                                      -math.inf)
        return out, lse

    def merge(self, out_a, lse_a, out_b, lse_b):
        fi = self._flashinfer()
        minus_inf = torch.full((), -math.inf, device=lse_a.device)
        # FlashInfer's empty state is -inf; +inf (FA2's marker) would be merged as a value
        s_a = torch.where(torch.isposinf(lse_a), minus_inf, lse_a).to(torch.float32).contiguous()
        s_b = torch.where(torch.isposinf(lse_b), minus_inf, lse_b).to(torch.float32).contiguous()
        out, lse = fi.merge_state(out_a.contiguous(), s_a, out_b.to(out_a.dtype).contiguous(), s_b)
        return out, lse

    def write(self, kv_c, k_pe, kv_cache, slot_mapping, *, kv_format):
        if kv_format != "latent":
            raise ValueError(f"{self.name}: append_paged_mla_kv_cache writes format 'latent', not {kv_format!r}")
        fi = self._flashinfer()
        dev = kv_cache.device
        slots = slot_mapping.to(device=dev, dtype=torch.int64)
        keep = (slots >= 0).nonzero().flatten()
        if keep.numel() == 0:
            return None
        slots = slots[keep]
        page = kv_cache.shape[1]
        n = int(keep.numel())
        ar = torch.arange(n + 1, dtype=torch.int32, device=dev)
        offset = (slots % page).to(torch.int32)
        # one request of one page per token: page iter kv_indptr[t] = t, entry = its offset in that page
        fi.append_paged_mla_kv_cache(kv_c[keep.to(kv_c.device)], k_pe[keep.to(k_pe.device)], ar[:-1], offset,
                                     kv_cache[:, :, 0, :D_V], kv_cache[:, :, 0, D_V:],
                                     (slots // page).to(torch.int32), ar, offset + 1)
        return None


class FlashInferFA2Op(FlashInferOp):
    """FlashInferOp pinned to backend fa2 (what ``auto`` runs everywhere but SM90; on SM90 a second path)."""

    name = "flashinfer-fa2"

    def __init__(self, flashinfer_module=None, workspace_bytes: int = WORKSPACE_BYTES):
        super().__init__(flashinfer_module, backend="fa2", workspace_bytes=workspace_bytes)


__all__ = ["FlashInferOp", "FlashInferFA2Op"]
