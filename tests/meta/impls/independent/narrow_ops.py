"""Correct narrow ops: tests/meta/impls/independent/op.py's IndependentOp (written without the suite's reference)
restricted as real kernels are, for tests/meta/test_decode_only_meta.py.

* :class:`DecodeOnlyIndependentOp`: every declaration of IndependentOp, one query per row (s_q 1): every op test whose
  rule is not about multi-token decode runs on it (determinism, batch invariance, strided out buffers, FP8, sparse,
  attn_sink at s_q 1);
* :class:`SparseFp8DecodeOnlyOp`: FlashMLA's sparse decode as its test oracle runs it (bfloat16 q over the FP8
  656-byte cache, s_q 1): the sparse tests run on it.
"""

from __future__ import annotations

import torch

from tests.meta.impls.independent.op import IndependentOp


class DecodeOnlyIndependentOp(IndependentOp):
    name = "decode-only-independent-op"

    def unsupported_reason(self, case):
        s_q = getattr(case, "s_q", 1)
        if s_q > 1:
            return f"{self.name} decodes one query per row (s_q 1), not s_q {s_q}"
        return super().unsupported_reason(case)


class SparseFp8DecodeOnlyOp:
    """FlashMLA's sparse decode as its test oracle runs it: top-k indices over the FP8 656-byte cache, a bfloat16 q,
    one query per row, pages of 64, attn_sink and the second cache (``extra_k_cache``); everything else declined
    with a sentence. The arithmetic is tests/meta/impls/independent/op.py's IndependentOp (written without the
    suite's reference), whose declarations it keeps where they apply (lse in base 2, empty rows -inf, fp32 scales,
    invalid indices out of range)."""

    name = "sparse-fp8-decode-only-op"
    lse_base = "2"
    empty_row = "-inf"
    sparse_decode = True
    sparse_decode_extra_cache = True
    invalid_index = "out-of-range"
    attn_sink = True
    page_block_sizes = (64,)
    kv_formats = ("fp8-e4m3-flashmla",)
    fp8_scale_format = "fp32"

    def __init__(self):
        self._op = IndependentOp()  # the arithmetic; the declarations are this class's

    def unsupported_reason(self, case):
        if case.topk is None:
            return f"{self.name} is sparse decode only (top-k indices), not dense"
        if case.kv_format != "fp8-e4m3-flashmla":
            return f"{self.name} reads the FP8 656-byte cache only, not {case.kv_format}"
        if case.dtype != torch.bfloat16:
            return f"{self.name} takes a bfloat16 q only, not {str(case.dtype).removeprefix('torch.')}"
        if case.s_q > 1:
            return f"{self.name} decodes one query per row (s_q 1), not s_q {case.s_q}"
        return None

    def decode(self, q, kv_cache, block_table, cache_seqlens, *, softmax_scale, causal, indices=None,
               topk_length=None, attn_sink=None, extra_k_cache=None, extra_indices=None, extra_topk_length=None):
        if indices is None or q.shape[1] != 1:
            raise ValueError(f"{self.name}: sparse decode of one query per row only")
        return self._op.decode(q, kv_cache, block_table, cache_seqlens, softmax_scale=softmax_scale, causal=causal,
                               indices=indices, topk_length=topk_length, attn_sink=attn_sink,
                               extra_k_cache=extra_k_cache, extra_indices=extra_indices,
                               extra_topk_length=extra_topk_length)
