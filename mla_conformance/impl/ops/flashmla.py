"""FlashMLA's decode kernels behind the op contract: ``flashmla`` (dense) and ``flashmla-sparse`` (sparse, FP8).

Both call ``flash_mla.flash_mla_with_kvcache`` (deepseek-ai/FlashMLA, ``flash_mla/flash_mla_interface.py``):

* :class:`FlashMLAOp`: dense decode (kernel ``flashmla/dense_decode`` of :mod:`mla_conformance.arch`, SM90):
  bfloat16 q and latent cache [num_blocks, 64, 1, 576], page block 64 (``csrc/api/dense_decode.h``: "Currently
  page_block_size must be 64"), causal multi-token decode aligned bottom-right as the contract's; lse in
  base e, +inf for a query with no keys (FlashMLA's convention, the contract's default).
* :class:`FlashMLASparseOp`: sparse decode (kernel ``flashmla/sparse_decode``, SM90 and SM100): bfloat16 q,
  the FP8 656-byte cache (uint8 [num_blocks, page, 1, 656]: 512 e4m3, 4 float32 tile scales, 64 bf16 rope),
  ``indices`` into the flattened cache, ``topk_length``, ``attn_sink``, ``causal=False``. What the kernel
  cannot take is translated, never declined: it runs h_q 64 or 128 (``csrc/api/sparse_decode.h``), so
  fewer heads are padded with zero queries up to 64 (65..127 up to 128) and the padding is cut from out
  and lse; it reads top-k in blocks of 64 (``TOPK_BLOCK_SIZE``, ``csrc/sm90/decode/sparse_fp8/config.h``),
  so indices are padded with -1 (invalid) to a multiple of 64; a FlashMLA release without ``topk_length``
  gets the entries past ``topk_length[b]`` set to -1 instead. A release without ``attn_sink`` declines
  cases that pass one. The decode kernel special-cases only -1 (``splitkv_mla.cuh`` reads any other index
  as a slot; FlashMLA's test oracle raises on one outside the cache), so every index outside
  ``[0, num_blocks * page_block_size)`` is set to -1 before the call: the adapter gives the sparse
  *prefill*'s rule (``invalid_index = "out-of-range"``) and never hands the kernel an out-of-bounds index.

:class:`FlashMLAOp` also has the optional ``prefill`` (kernel ``flashmla/dense_prefill``, SM100):
``flash_mla.flash_attn_varlen_func(q, k, v, cu_seqlens_qo, cu_seqlens_kv, max_seqlen_qo, max_seqlen_kv,
softmax_scale=, causal=) -> (out, lse)``, ragged bfloat16 q / k / v as the contract's prefill takes them, causal
aligned bottom-right and lse in natural log [total_q, h_q] (its tests/test_fmha_sm100.py); a query with no key,
which FlashMLA's tests never make, is set to out 0 and lse +inf by the adapter.

:class:`FlashMLASparseOp` also has the optional ``sparse_prefill`` (kernel ``flashmla/sparse_prefill``, SM90 and
SM100): ``flash_mla.flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None) ->
(out, max_logits, lse)`` (``flash_mla/flash_mla_interface.py`` and ``csrc/api/sparse_fwd.h`` at
9241ae3ef9bac614dd25e45e507e089f888280e0; the definitions are tests/ref.py's, which the op contract's
sparse_prefill copies): bfloat16 q and kv [s_kv, h_kv, d_qk], d_qk 576 or 512 (MODEL1), d_v 512, int32 indices
[s_q, h_kv, topk], the last dim of every input contiguous. The adapter translates as for decode: h_q 64 or 128
only ("Unsupported h_q"), so fewer heads are padded with zero queries (and zero sinks) and cut from out,
max_logits and lse; FlashMLA's tests run top-k multiples of 128 (tests/test_flash_mla_sparse_prefill.py), so
indices are padded with -1 to one; "invalid indices should be set to -1 or numbers >= s_kv", so every index
outside [0, s_kv) (INT_MIN, -123456 included) is set to -1 first. h_kv must be 1 (MQA, the README's mode).

Gating (``unsupported_reason``): the support matrix's sentence (:func:`mla_conformance.arch.why_not` on the
case's device) first, then dtype, page size, KV format and mode sentences, then ``import flash_mla``. A
stand-in module (``flash_mla_module=``, CPU tests of the glue) replaces the import; the device is judged all
the same.

``get_mla_metadata`` changed across FlashMLA releases; :func:`mla_metadata` calls the installed one as its
signature asks:

* ``get_mla_metadata(cache_seqlens, num_heads_per_head_k, num_heads_k)`` (first release) and
  ``get_mla_metadata(cache_seqlens, num_q_tokens_per_head_k, num_heads_k, num_heads_q=None,
  is_fp8_kvcache=False, topk=None)`` return ``(tile_scheduler_metadata, num_splits)`` tensors; the second
  argument is ``s_q * h_q // h_kv`` in both;
* ``get_mla_metadata(*args, **kwargs)`` (current) returns ``(FlashMLASchedMeta(), None)``, filled in by the
  first ``flash_mla_with_kvcache`` call, which must then get ``num_splits=None``.
"""

from __future__ import annotations

import inspect
import math

import torch

from mla_conformance import arch
from mla_conformance.contract.op import D_V
from mla_conformance.dtypes import dtype_name
from mla_conformance.impl.ops.ragged import queries_without_keys, with_empty_queries

DENSE_KERNEL = "flashmla/dense_decode"
SPARSE_KERNEL = "flashmla/sparse_decode"
SPARSE_PREFILL_KERNEL = "flashmla/sparse_prefill"
DENSE_PREFILL_KERNEL = "flashmla/dense_prefill"
#: top-k entries the sparse prefill adapter pads indices to a multiple of (FlashMLA's tests run multiples of 128)
PREFILL_TOPK_BLOCK = 128
DENSE_PAGE = 64
SPARSE_HEADS = (64, 128)
TOPK_BLOCK = 64
FP8_FORMAT = "fp8-e4m3-flashmla"


def mla_metadata(get_mla_metadata, cache_seqlens: torch.Tensor, s_q: int, h_q: int, h_kv: int = 1, *,
                 is_fp8_kvcache: bool = False, topk: int | None = None):
    """Call the installed ``get_mla_metadata`` as its signature wants; returns (tile_scheduler_metadata, num_splits)."""
    try:
        params = inspect.signature(get_mla_metadata).parameters
    except (TypeError, ValueError):  # a compiled function without a signature: the first release's form
        params = None
    if params is not None:
        named = [p for p in params.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if not named:  # current interface: an empty FlashMLASchedMeta, initialised by the kernel call
            return get_mla_metadata()
        if "num_heads_q" in params:
            extra = {}
            if "is_fp8_kvcache" in params and is_fp8_kvcache:
                extra["is_fp8_kvcache"] = True
            if "topk" in params and topk is not None:
                extra["topk"] = topk
            return get_mla_metadata(cache_seqlens, s_q * h_q // h_kv, h_kv, num_heads_q=h_q, **extra)
    if is_fp8_kvcache or topk is not None:
        raise ValueError("the installed flash_mla.get_mla_metadata predates sparse / FP8 decode (no topk argument)")
    return get_mla_metadata(cache_seqlens, s_q * h_q // h_kv, h_kv)


def _kernel_params(fm) -> set[str] | None:
    """The keyword parameters of the installed flash_mla_with_kvcache (None: not inspectable)."""
    try:
        return set(inspect.signature(fm.flash_mla_with_kvcache).parameters)
    except (TypeError, ValueError):
        return None


class _FlashMLABase:
    kernel_id = ""
    kernel_name = ""

    def __init__(self, flash_mla_module=None):
        # a stand-in module (CPU glue tests) replaces `import flash_mla`; gating still judges the real device
        self._module = flash_mla_module

    def _flash_mla(self):
        if self._module is not None:
            return self._module
        import flash_mla

        return flash_mla

    def _arch_reason(self, case) -> str | None:
        return arch.why_not(self.kernel_id, arch.detect(case.device))

    def _import_reason(self) -> str | None:
        if self._module is not None:
            return None
        try:
            import flash_mla  # noqa: F401
        except Exception as exc:
            return f"{self.kernel_name}: the flash_mla package does not import ({type(exc).__name__}: {exc})"
        return None


class FlashMLAOp(_FlashMLABase):
    """FlashMLA dense decode (SM90, bfloat16, page block 64) behind the op contract, and its dense prefill (SM100,
    ``flash_attn_varlen_func``) as the optional ``prefill``."""

    name = "flashmla"
    kernel_id = DENSE_KERNEL
    kernel_name = "FlashMLA dense decode"
    lse_base = "e"
    empty_row = "+inf"
    # prefill: FlashMLA's dense prefill (SM100), DeepSeek-V3's MHA-mode dims (the default prefill_head_dims)
    prefill_lse_base = "e"
    prefill_empty_row = "+inf"
    page_block_sizes = (DENSE_PAGE,)
    kv_formats = ("latent",)
    # split-KV with a schedule fixed by the inputs, a fixed-order combine: the same call gives the same bits.
    # Not batch invariant: the tile scheduler splits the whole batch's keys over the SMs, so a row's split
    # points depend on the other rows.
    deterministic = True
    batch_invariant = False

    def unsupported_reason(self, case):
        if getattr(case, "method", "decode") == "prefill":
            return self._prefill_reason(case)
        reason = self._arch_reason(case)
        if reason:
            return reason
        if case.sparse:
            return (f"{self.kernel_name} attends every key of the row; top-k indices (sparse top-{case.topk}) need "
                    "FlashMLA's sparse decode (op flashmla-sparse)")
        if case.attn_sink:
            return f"{self.kernel_name} takes no attn_sink (flash_mla_with_kvcache accepts one with indices only)"
        if case.dtype != torch.bfloat16:
            return (f"{self.kernel_name} takes bfloat16 only (the BF16 cache of FlashMLA's README), "
                    f"not {dtype_name(case.dtype)}")
        if case.page_block_size != DENSE_PAGE:
            return f"{self.kernel_name} reads pages of {DENSE_PAGE} tokens, not {case.page_block_size}"
        if case.kv_format != "latent":
            return (f"{self.kernel_name} reads a bfloat16 latent cache (format 'latent'); the {case.kv_format} "
                    "cache runs in FlashMLA's sparse decode (op flashmla-sparse)")
        return self._import_reason()

    def decode(self, q, kv_cache, block_table, cache_seqlens, *, softmax_scale, causal, indices=None,
               topk_length=None, attn_sink=None):
        if indices is not None or topk_length is not None or attn_sink is not None:
            raise ValueError(f"{self.name}: dense decode takes no indices, topk_length or attn_sink")
        B, s_q, h_q, _ = q.shape
        if B == 0:
            return (q.new_zeros(0, s_q, h_q, D_V), torch.zeros(0, h_q, s_q, dtype=torch.float32, device=q.device))
        fm = self._flash_mla()
        block_table = block_table.to(torch.int32).contiguous()
        cache_seqlens = cache_seqlens.to(torch.int32).contiguous()
        h_kv = kv_cache.shape[2]
        tile_scheduler_metadata, num_splits = mla_metadata(fm.get_mla_metadata, cache_seqlens, s_q, h_q, h_kv)
        out, lse = fm.flash_mla_with_kvcache(q.contiguous(), kv_cache, block_table, cache_seqlens, D_V,
                                             tile_scheduler_metadata, num_splits,
                                             softmax_scale=softmax_scale, causal=causal)
        return out, lse

    # ----------------------------------------------------------------------- prefill: FlashMLA's dense prefill

    def _prefill_reason(self, case) -> str | None:
        name = "FlashMLA dense prefill"
        reason = arch.why_not(DENSE_PREFILL_KERNEL, arch.detect(case.device))
        if reason:
            return reason
        if case.dtype != torch.bfloat16:
            return f"{name} takes bfloat16 q, k and v, not {dtype_name(case.dtype)}"
        reason = self._import_reason()
        if reason:
            return reason
        if not hasattr(self._flash_mla(), "flash_attn_varlen_func"):
            return f"{name}: the installed flash_mla has no flash_attn_varlen_func (a release before SM100 prefill)"
        return None

    def prefill(self, q, k, v, cu_seqlens_q, cu_seqlens_k, *, softmax_scale, causal):
        """``flash_attn_varlen_func(q, k, v, cu_seqlens_qo, cu_seqlens_kv, max_seqlen_qo, max_seqlen_kv,
        softmax_scale=, causal=) -> (out, lse)`` (flash_mla/flash_mla_interface.py; its tests/test_fmha_sm100.py
        oracle: causal aligned bottom-right, ``tril(diagonal=s_k - s_q)``, lse a natural-log logsumexp
        [total_q, h_q]). Strided k / v are made contiguous first. FlashMLA's tests give every query a key
        (s_k >= s_q >= 1); a query without one (kv_len 0, or a causal query before its row's first key) gets
        out 0 and lse +inf here, whatever the kernel left there."""
        fm = self._flash_mla()
        dev = q.device
        q, k, v = (t if t.is_contiguous() else t.contiguous() for t in (q, k, v))
        cu_q = cu_seqlens_q.to(device=dev, dtype=torch.int32)
        cu_k = cu_seqlens_k.to(device=dev, dtype=torch.int32)
        q_lens, k_lens = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
        out, lse = fm.flash_attn_varlen_func(q, k, v, cu_q, cu_k, int(q_lens.max()) if q_lens.numel() else 0,
                                             int(k_lens.max()) if k_lens.numel() else 0,
                                             softmax_scale=float(softmax_scale), causal=bool(causal))
        lse = lse.to(torch.float32).contiguous()                                     # [total_q, h_q]
        return with_empty_queries(out, lse, queries_without_keys(cu_q, cu_k, causal), math.inf)


class FlashMLASparseOp(_FlashMLABase):
    """FlashMLA sparse decode (SM90 / SM100, bfloat16 q, FP8 656-byte cache, top-k indices) behind the op contract."""

    name = "flashmla-sparse"
    kernel_id = SPARSE_KERNEL
    kernel_name = "FlashMLA sparse decode"
    lse_base = "e"
    empty_row = "+inf"   # tests/ref.py: a query with no valid index gets lse +inf and out 0
    sparse_decode = True
    attn_sink = True     # where the installed release takes one (else declined, see unsupported_reason)
    invalid_index = "out-of-range"  # every index outside the cache is remapped to -1 before the kernel
    page_block_sizes = (1, 16, 64)  # the kernel checks no page size; FlashMLA's tests use 2, 61, 64, 69
    kv_formats = (FP8_FORMAT,)
    fp8_scale_format = "pow2"  # FlashMLA's tests/quant.py writes amax/448 rounded up to 2^k (ue8m0)
    sparse_prefill_head_dims = ((576, 512), (512, 512))
    sparse_prefill_lse_base = "e"
    sparse_prefill_topk_length = True   # where the installed release takes them (else declined)
    sparse_prefill_attn_sink = True

    def unsupported_reason(self, case):
        if getattr(case, "method", "decode") == "sparse_prefill":
            return self._sparse_prefill_reason(case)
        reason = self._arch_reason(case)
        if reason:
            return reason
        if not case.sparse:
            return (f"{self.kernel_name} attends the top-k indices it is given; dense decode (no indices) is "
                    "FlashMLA's dense decode (op flashmla)")
        if case.causal:
            return f"{self.kernel_name} is not causal (flash_mla_with_kvcache asserts causal False with indices)"
        if case.dtype != torch.bfloat16:
            return f"{self.kernel_name} takes a bfloat16 q, not {dtype_name(case.dtype)}"
        if case.kv_format != FP8_FORMAT:
            return (f"{self.kernel_name} reads the FP8 656-byte cache ({FP8_FORMAT}), not a {case.kv_format} "
                    "cache")
        if case.page_block_size not in self.page_block_sizes:
            return (f"{self.kernel_name} is run here with pages of {', '.join(map(str, self.page_block_sizes))} "
                    f"tokens, not {case.page_block_size}")
        if case.h_q > SPARSE_HEADS[-1]:
            return (f"{self.kernel_name} runs 64 or 128 query heads (fewer are padded), not {case.h_q}")
        reason = self._import_reason()
        if reason:
            return reason
        params = _kernel_params(self._flash_mla())
        if params is not None and "indices" not in params:
            return f"{self.kernel_name}: the installed flash_mla predates sparse decode (flash_mla_with_kvcache has no indices)"
        if case.attn_sink and params is not None and "attn_sink" not in params:
            return f"{self.kernel_name}: the installed flash_mla takes no attn_sink (a release before attention sinks)"
        return None

    def _sparse_prefill_reason(self, case) -> str | None:
        name = "FlashMLA sparse prefill"
        reason = arch.why_not(SPARSE_PREFILL_KERNEL, arch.detect(case.device))
        if reason:
            return reason
        if case.dtype != torch.bfloat16:
            return f"{name} takes bfloat16 q and kv, not {dtype_name(case.dtype)}"
        if case.h_k != 1:
            return f"{name} is run here in MQA mode (h_kv 1, FlashMLA's README and tests), not h_kv {case.h_k}"
        if case.h_q > SPARSE_HEADS[-1]:
            return f"{name} runs 64 or 128 query heads (fewer are padded), not {case.h_q}"
        reason = self._import_reason()
        if reason:
            return reason
        fm = self._flash_mla()
        if not hasattr(fm, "flash_mla_sparse_fwd"):
            return f"{name}: the installed flash_mla has no flash_mla_sparse_fwd"
        try:
            params = set(inspect.signature(fm.flash_mla_sparse_fwd).parameters)
        except (TypeError, ValueError):
            params = None
        for flag, arg in ((case.topk_length, "topk_length"), (case.attn_sink, "attn_sink")):
            if flag and params is not None and arg not in params:
                return f"{name}: the installed flash_mla_sparse_fwd takes no {arg} (a release before it)"
        return None

    def sparse_prefill(self, q, kv, indices, *, softmax_scale, d_v, topk_length=None, attn_sink=None):
        s_q, h_q, d_qk = q.shape
        s_kv = kv.shape[0]
        fm = self._flash_mla()
        h_run = SPARSE_HEADS[0] if h_q <= SPARSE_HEADS[0] else SPARSE_HEADS[1]
        if h_run != h_q:
            q = torch.cat([q, q.new_zeros(s_q, h_run - h_q, d_qk)], dim=1)
            if attn_sink is not None:
                attn_sink = torch.cat([attn_sink.to(torch.float32), attn_sink.new_zeros(h_run - h_q, dtype=torch.float32)])
        idx = indices.to(torch.int64)
        idx = torch.where((idx >= 0) & (idx < s_kv), idx, torch.full_like(idx, -1)).to(torch.int32)
        topk = idx.shape[-1]
        padded = max(PREFILL_TOPK_BLOCK, math.ceil(topk / PREFILL_TOPK_BLOCK) * PREFILL_TOPK_BLOCK)
        if padded != topk:
            idx = torch.cat([idx, idx.new_full((*idx.shape[:2], padded - topk), -1)], dim=-1)
        kwargs = {}
        if topk_length is not None:
            kwargs["topk_length"] = topk_length.to(torch.int32).contiguous()
        if attn_sink is not None:
            kwargs["attn_sink"] = attn_sink.to(torch.float32).contiguous()
        q = q if q.stride(-1) == 1 else q.contiguous()
        kv = kv if kv.stride(-1) == 1 else kv.contiguous()
        out, max_logits, lse = fm.flash_mla_sparse_fwd(q, kv, idx.contiguous(), float(softmax_scale), int(d_v),
                                                      **kwargs)
        return out[:, :h_q], max_logits[:, :h_q].contiguous(), lse[:, :h_q].contiguous()

    def decode(self, q, kv_cache, block_table, cache_seqlens, *, softmax_scale, causal, indices=None,
               topk_length=None, attn_sink=None):
        if indices is None:
            raise ValueError(f"{self.name}: sparse decode needs indices")
        if causal:
            raise ValueError(f"{self.name}: sparse decode is not causal")
        B, s_q, h_q, _ = q.shape
        if B == 0:
            return (q.new_zeros(0, s_q, h_q, D_V), torch.zeros(0, h_q, s_q, dtype=torch.float32, device=q.device))
        fm = self._flash_mla()
        params = _kernel_params(fm)
        native_topk_length = params is None or "topk_length" in params
        # heads: 64 or 128 (zero queries pad; each head attends on its own, the padding is cut off below)
        h_run = SPARSE_HEADS[0] if h_q <= SPARSE_HEADS[0] else SPARSE_HEADS[1]
        if h_run != h_q:
            q = torch.cat([q, q.new_zeros(B, s_q, h_run - h_q, q.shape[-1])], dim=2)
            if attn_sink is not None:
                attn_sink = torch.cat([attn_sink.to(torch.float32), attn_sink.new_zeros(h_run - h_q, dtype=torch.float32)])
        n_slots = kv_cache.shape[0] * kv_cache.shape[1]
        idx = indices.to(torch.int64)
        # the decode kernel treats only -1 as invalid: no index outside the cache ever reaches it
        idx = torch.where((idx >= 0) & (idx < n_slots), idx, torch.full_like(idx, -1)).to(torch.int32)
        topk = idx.shape[-1]
        if topk_length is not None and not native_topk_length:
            keep = torch.arange(topk, device=idx.device) < topk_length.to(idx.device).view(B, 1, 1)
            idx = torch.where(keep, idx, torch.full_like(idx, -1))
            topk_length = None
        padded = max(TOPK_BLOCK, math.ceil(topk / TOPK_BLOCK) * TOPK_BLOCK)
        if padded != topk:
            idx = torch.cat([idx, idx.new_full((B, s_q, padded - topk), -1)], dim=-1)
        idx = idx.contiguous()
        cache_seqlens = cache_seqlens.to(torch.int32).contiguous()
        block_table = block_table.to(torch.int32).contiguous()
        tile_scheduler_metadata, num_splits = mla_metadata(fm.get_mla_metadata, cache_seqlens, s_q, h_run,
                                                           kv_cache.shape[2], is_fp8_kvcache=True, topk=padded)
        kwargs = dict(softmax_scale=softmax_scale, causal=False, is_fp8_kvcache=True, indices=idx)
        if topk_length is not None:
            kwargs["topk_length"] = topk_length.to(torch.int32).contiguous()
        if attn_sink is not None:
            kwargs["attn_sink"] = attn_sink.to(torch.float32).contiguous()
        out, lse = fm.flash_mla_with_kvcache(q.contiguous(), kv_cache, block_table, cache_seqlens, D_V,
                                             tile_scheduler_metadata, num_splits, **kwargs)
        return out[:, :, :h_q], lse[:, :h_q].contiguous()


__all__ = ["FlashMLAOp", "FlashMLASparseOp", "mla_metadata"]
