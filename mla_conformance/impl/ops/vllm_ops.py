"""vLLM's merge-states and MLA cache-write kernels behind the op contract's optional ``merge`` and ``write``, where
vLLM is importable (op ``vllm``: no decode; ``--mla-op mla_conformance.impl.ops.vllm_ops:VLLMOp``).

Read in vllm-project/vllm through the code index:

* ``merge``: ``vllm.v1.attention.ops.merge_attn_states.merge_attn_states(output, prefix_output, prefix_lse,
  suffix_output, suffix_lse, output_lse=None, ...) -> None`` (``vllm/v1/attention/ops/merge_attn_states.py`` at
  15a3fd47ef45622a355ab7be62035231891f5e44: the CUDA kernel for float32 / float16 / bfloat16 with a head size
  that is a multiple of 16 bytes, the Triton kernel otherwise; ``prefix_output.stride(1) == suffix_output.stride(1)``
  asserted). It writes into ``output``; the lse tensors are **[num_heads, num_tokens]** and natural
  (``expf`` / ``logf`` in ``csrc/attention/merge_attn_states.cu`` at 0150b0ba25c7ff3974d0e8c203f39bf5442941ff,
  which maps either infinity to -inf: ``merge_lse_base = "e"``). Two empty sides gave NaN in that revision;
  vLLM PR #28181 (CUDA) and #39148 (Triton) return the prefix's zero output and -inf there:
  ``merge_empty_row = "-inf"``. The adapter hands contiguous outputs (v_b cast to v_a's dtype) and the lse
  transposed to [h, T], and returns output_lse transposed back.
* ``write``: ``vllm._custom_ops.concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype: str,
  scale: Tensor) -> None`` (``vllm/_custom_ops.py``; several revisions agree), kv_cache [num_blocks, block_size,
  entry] -- the contract's pool without its axis of 1 (a view). ``kv_cache_dtype`` "auto" writes [kv_c | k_pe]
  as is (format "latent"); "fp8_ds_mla" writes the 656-byte row of FlashMLA's V3.2 layout
  (``concat_and_cache_ds_mla_kernel`` in ``csrc/cache_kernels.cu``, revision not recorded by the index: tile
  scale ``max(amax / 448, FLT_MIN)`` kept as a float32 -- declared ``write_fp8_scale_format = "fp32"`` -- with
  no 1e-4 floor, so a tile with amax below 448e-4 gets another scale than FlashMLA's tests/quant.py, which the
  fp32 rule allows (a tile is judged by what it decodes to); other
  revisions round the scale up to a power of two (vLLM PRs #49435, #54563)). A negative slot writes nothing
  (the kernel returns for ``slot_idx < 0``).

Gating: the matrix rows ``vllm/merge_attn_states`` and ``vllm/concat_and_cache_mla`` (vLLM's CUDA build targets,
bfloat16 from SM80), then ``import vllm``. A stand-in (``vllm_module=``: an object with ``merge_attn_states`` and
``concat_and_cache_mla`` of vLLM's signatures) replaces the imports for CPU tests of the glue; the device is
judged all the same.
"""

from __future__ import annotations

import torch

from mla_conformance import arch
from mla_conformance.contract.op import D_QK, D_V, declared
from mla_conformance.dtypes import dtype_name

MERGE_KERNEL = "vllm/merge_attn_states"
WRITE_KERNEL = "vllm/concat_and_cache_mla"
#: op contract kv format -> vLLM's kv_cache_dtype string
CACHE_DTYPES = {"latent": "auto", "fp8-e4m3-flashmla": "fp8_ds_mla"}


class VLLMOp:
    """vLLM's merge_attn_states and concat_and_cache_mla behind the op contract (merge and write only)."""

    name = "vllm"
    merge_lse_base = "e"
    merge_empty_row = "-inf"
    write_kv_formats = ("latent", "fp8-e4m3-flashmla")
    write_fp8_scale_format = "fp32"
    write_page_block_sizes = (1, 16, 64)

    def __init__(self, vllm_module=None):
        # a stand-in (CPU glue tests) replaces the vLLM imports; gating still judges the real device
        self._module = vllm_module

    def _kernels(self):
        if self._module is not None:
            return self._module
        from vllm import _custom_ops
        from vllm.v1.attention.ops.merge_attn_states import merge_attn_states

        return type("VLLMKernels", (), {"merge_attn_states": staticmethod(merge_attn_states),
                                        "concat_and_cache_mla": staticmethod(_custom_ops.concat_and_cache_mla)})

    def unsupported_reason(self, case):
        method = getattr(case, "method", "decode")
        if method not in ("merge", "write"):
            return f"{self.name} has merge and write only, not {method}"
        reason = arch.why_not(MERGE_KERNEL if method == "merge" else WRITE_KERNEL, arch.detect(case.device))
        if reason:
            return reason
        if method == "merge" and case.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            return (f"vLLM's merge_attn_states takes float32, float16 or bfloat16 outputs (FP8 only with an output "
                    f"scale), not {dtype_name(case.dtype)}")
        if method == "write":
            if case.kv_format not in CACHE_DTYPES:
                return f"vLLM's concat_and_cache_mla writes formats {', '.join(CACHE_DTYPES)}, not {case.kv_format}"
            if case.kv_format != "latent" and (case.dtype != torch.bfloat16 or (case.d_qk, case.d_v) != (D_QK, D_V)):
                return (f"vLLM's fp8_ds_mla writer takes a bfloat16 kv_c of 512 and k_pe of 64, not "
                        f"{dtype_name(case.dtype)} {case.d_v} + {case.d_qk - case.d_v}")
            if case.page_block_size not in declared(self, "write_page_block_sizes"):
                return (f"{self.name} writes pages of {', '.join(map(str, self.write_page_block_sizes))} tokens, "
                        f"not {case.page_block_size}")
        if self._module is None:
            try:
                self._kernels()
            except Exception as exc:
                return f"vLLM: the vllm package does not import its kernels ({type(exc).__name__}: {exc})"
        return None

    def merge(self, out_a, lse_a, out_b, lse_b):
        prefix = out_a.contiguous()
        suffix = out_b.to(out_a.dtype).contiguous()
        p_lse = lse_a.to(torch.float32).t().contiguous()                           # vLLM's [num_heads, num_tokens]
        s_lse = lse_b.to(torch.float32).t().contiguous()
        output = torch.empty_like(prefix)
        output_lse = torch.empty_like(p_lse)
        self._kernels().merge_attn_states(output, prefix, p_lse, suffix, s_lse, output_lse)
        return output, output_lse.t()

    def write(self, kv_c, k_pe, kv_cache, slot_mapping, *, kv_format):
        if kv_format not in CACHE_DTYPES:
            raise ValueError(f"{self.name}: concat_and_cache_mla writes {', '.join(CACHE_DTYPES)}, not {kv_format!r}")
        scale = torch.ones(1, dtype=torch.float32, device=kv_cache.device)       # per-tensor scale: unused here
        self._kernels().concat_and_cache_mla(kv_c, k_pe, kv_cache[:, :, 0], slot_mapping.to(torch.int64),
                                             CACHE_DTYPES[kv_format], scale)
        return None


__all__ = ["VLLMOp"]
