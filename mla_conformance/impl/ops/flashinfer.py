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

A stand-in module (``flashinfer_module=``, with ``.mla.BatchMLAPagedAttentionWrapper``) replaces
``import flashinfer`` for CPU tests of the glue; the device is judged all the same.
"""

from __future__ import annotations

import math

import torch

from mla_conformance.contract.op import D_ROPE, D_V

FA2_KERNEL = "flashinfer/fa2_mla"
FA3_KERNEL = "flashinfer/fa3_mla"
BACKENDS = ("auto", "fa2", "fa3")
WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended float workspace


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


class FlashInferOp:
    """FlashInfer's BatchMLAPagedAttentionWrapper (fa2 / fa3) behind the op contract; lse in base 2."""

    name = "flashinfer"
    lse_base = "2"
    empty_row = "-inf"
    page_block_sizes = (1, 16, 64)  # any page size; FlashInfer's own tests run 1 and 16
    kv_formats = ("latent",)

    def __init__(self, flashinfer_module=None, backend: str = "auto", workspace_bytes: int = WORKSPACE_BYTES):
        if backend not in BACKENDS:
            raise ValueError(f"FlashInferOp backend {backend!r}: expected one of {', '.join(BACKENDS)}")
        # a stand-in module (CPU glue tests) replaces `import flashinfer`; gating still judges the real device
        self._module = flashinfer_module
        self.backend = backend
        self.workspace_bytes = int(workspace_bytes)
        self._wrappers: dict[str, object] = {}

    # ------------------------------------------------------------------ gating
    def kernel_id(self, info) -> str:
        """The matrix row of what runs on ``info`` (a DeviceInfo): fa3 where the wrapper picks it, else fa2."""
        if self.backend == "fa3":
            return FA3_KERNEL
        if self.backend == "fa2":
            return FA2_KERNEL
        from mla_conformance import arch

        return FA3_KERNEL if arch.why_not(FA3_KERNEL, info, check_package=False) is None else FA2_KERNEL

    def _flashinfer(self):
        if self._module is not None:
            return self._module
        import flashinfer
        import flashinfer.mla  # noqa: F401

        return flashinfer

    def unsupported_reason(self, case):
        from mla_conformance import arch

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
                    f"{_dtype_name(case.dtype)}")
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


class FlashInferFA2Op(FlashInferOp):
    """FlashInferOp pinned to backend fa2 (what ``auto`` runs everywhere but SM90; on SM90 a second path)."""

    name = "flashinfer-fa2"

    def __init__(self, flashinfer_module=None, workspace_bytes: int = WORKSPACE_BYTES):
        super().__init__(flashinfer_module, backend="fa2", workspace_bytes=workspace_bytes)


__all__ = ["FlashInferOp", "FlashInferFA2Op"]
