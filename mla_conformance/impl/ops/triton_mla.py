"""``triton``: absorbed MLA decode written in Triton, for every GPU Triton reaches (SM80, SM89, SM90, SM100, SM120,
ROCm) and for CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``, set before Python starts), which is how
CPU CI checks it. Install with ``pip install mla-conformance[triton]``.

What it computes: dense decode over the paged latent cache (pages of 1, 16 or 64 tokens), causal multi-token
decode aligned bottom-right (MTP / speculative verify), sparse decode over flat indices (``topk_length``; -1 and
every index outside the cache ignored), the attention sink, and the 656-byte FP8 layout
(``fp8-e4m3-flashmla``: e4m3 values times their float32 tile scale, decoded in the kernel), split-KV over the
block table's capacity merged by lse. lse is float32, natural log, +inf for a query with no key (out 0).
Numbers as a production kernel's: bfloat16 / float16 q and cache into ``tl.dot`` as they are (tensor cores,
float32 accumulation; P rounded to the cache dtype before P.V; the FP8 rows dequantized to q's dtype), float32 q
and cache with ``input_precision="ieee"`` (:attr:`TritonMLAOp.float32_dot_precision`: a GPU's default TF32 would
keep 10 mantissa bits of each operand, 2^-11 relative per product, past the float32 bounds).
The kernels are :mod:`mla_conformance.impl.ops.triton_kernels`; this module prepares their metadata:

* how many keys each query sees (:meth:`TritonMLAOp.visible_keys`: the row's length, causal bottom-right
  ``L - s_q + i + 1``, or the sparse row's ``topk_length``), a small tensor op, so no host sync;
* how many splits (:meth:`TritonMLAOp.splits`): from the block table's width times the page size (the capacity,
  a static shape: a CUDA graph captured at the largest batch replays with any lengths), never from the lengths;
* the FP8 rows seen three ways (bytes, float32 scales, bfloat16 rope) over the same memory, no copy.

It keeps nothing between calls. Declined, with a sentence: triton not installed; a CPU tensor without the
interpreter; a float64 q (the kernels accumulate in float32); the MODEL1 layout; two-cache sparse decode.
"""

from __future__ import annotations

import functools
import math
import os

import torch

from mla_conformance.contract.op import D_QK, D_V
from mla_conformance.kv import model1

#: keys per tile of the partial kernel, and the most splits of one query's keys
BLOCK_N = 64
MAX_SPLITS = 8
#: the keys one split covers at least (small, so that the op suite's rows of ~100 keys are split too and the
#: split merge is checked by every test; a GPU tuned for speed would split less)
MIN_SPLIT = 64
#: query heads per program of both kernels (tl.dot wants at least 16 rows on a GPU)
BLOCK_H = 16
#: head dims the kernels take (tl.arange needs powers of two): DeepSeek's 512 + 64, and the embedded tiny model's
#: 64 + 16 (so ``--mla-backend op:triton`` runs the golden generations through it)
HEAD_DIMS = ((D_QK, D_V), (80, 64))


@functools.lru_cache(maxsize=1)
def triton_missing() -> str | None:
    """Why triton cannot be used here, or None."""
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return f"triton is not installed ({exc}); install it with `pip install mla-conformance[triton]`"
    return None


def kernels():
    """The kernels' module, imported when the op first runs."""
    from mla_conformance.impl.ops import triton_kernels  # imports triton: not before the op runs

    return triton_kernels


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


class TritonMLAOp:
    """The op contract's decode in Triton (see the module docstring)."""

    name = "triton"
    lse_base = "e"
    returns_lse = True
    empty_row = "+inf"
    sparse_decode = True
    invalid_index = "out-of-range"
    attn_sink = True
    page_block_sizes = (1, 16, 64)
    kv_formats = ("latent", "fp8-e4m3-flashmla")
    fp8_scale_format = "pow2"
    #: no atomics, and a row's splits depend on the block table's width only: the same call gives the same bits,
    #: and a row alone (same block-table width) the bits it gets in any batch
    deterministic = True
    batch_invariant = True
    head_dims = HEAD_DIMS
    #: ``tl.dot``'s input_precision for a float32 q and cache: "ieee" (float32 products and sums); None would be
    #: triton's default, "tf32" on NVIDIA GPUs (operands cut to 10 mantissa bits), which the float32 bounds do
    #: not allow (tests/meta/impls/broken/triton_ops.py:DefaultTF32Dot). bfloat16 / float16 dots take triton's
    #: default (the precision applies to float32 operands only)
    float32_dot_precision: str | None = "ieee"

    def unsupported_reason(self, case):
        if getattr(case, "method", "decode") != "decode":
            return None  # it has no other method: those tests skip naming the method
        missing = triton_missing()
        if missing:
            return missing
        device = torch.device(case.device)
        if device.type == "cpu" and not interpreting():
            return ("Triton kernels run on CPU tensors only under Triton's interpreter: set TRITON_INTERPRET=1 "
                    "in the environment before Python starts (the CI tier `pytest -m triton_interpret` does)")
        if device.type == "cuda" and interpreting():
            return "TRITON_INTERPRET=1 is set: the interpreter runs CPU tensors, not a GPU's; unset it"
        if device.type not in ("cpu", "cuda"):
            return f"Triton reaches CUDA and ROCm GPUs (torch device 'cuda') and CPU under its interpreter, not {device}"
        if case.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            return (f"{self.name} takes float32, float16 and bfloat16 q (it accumulates in float32), not "
                    f"{str(case.dtype).removeprefix('torch.')}")
        return None

    # ------------------------------------------------------------------ metadata (overridable: tests/meta)

    def visible_keys(self, cache_seqlens, s_q: int, causal: bool, topk: int | None, topk_length):
        """int32 [B * s_q]: how many keys (dense) or index entries (sparse) each query position reads."""
        B = cache_seqlens.shape[0]
        if topk is not None:
            n = torch.full((B,), topk, dtype=torch.int64, device=cache_seqlens.device)
            if topk_length is not None:
                n = topk_length.to(torch.int64).clamp(0, topk)
            return n[:, None].expand(B, s_q).reshape(-1).to(torch.int32).contiguous()
        lens = cache_seqlens.to(torch.int64)[:, None]
        if causal:  # bottom-right: the s_q queries are the row's last s_q tokens
            lens = lens - s_q + 1 + torch.arange(s_q, device=lens.device)
        return lens.expand(B, s_q).clamp(min=0).reshape(-1).to(torch.int32).contiguous()

    def splits(self, capacity: int) -> tuple[int, int]:
        """(keys per split, number of splits) for a capacity of keys per query (a static shape)."""
        per = max(MIN_SPLIT, -(-capacity // MAX_SPLITS))
        per = -(-per // BLOCK_N) * BLOCK_N
        return per, max(1, -(-capacity // per))

    def fp8_views(self, rows: torch.Tensor):
        """The 656-byte rows [N, 656] as (bytes, float32 [N, 164] tile scales at 128..131, bfloat16 [N, 328] rope at
        264..327): three views of one memory."""
        return rows, rows.view(torch.float32), rows.view(torch.bfloat16)

    def combine(self, o_part, lse_part, attn_sink, shape, out_dtype=torch.float32):
        """The splits merged by lse (the second kernel): (out [B, s_q, h, d_v] in ``out_dtype``, rounded once from
        float32 by the kernel's store, lse float32 [B, h, s_q])."""
        B, s_q, H, d_v = shape
        out = torch.empty(B, s_q, H, d_v, dtype=out_dtype, device=o_part.device)
        lse = torch.empty(B, H, s_q, dtype=torch.float32, device=o_part.device)
        n_splits = o_part.shape[1]
        sink = attn_sink.to(torch.float32).contiguous() if attn_sink is not None else lse_part
        kernels().mla_decode_combine[(B * s_q, -(-H // BLOCK_H))](
            o_part, lse_part, sink, out, lse, H, s_q, n_splits,
            D_V=d_v, BLOCK_H=BLOCK_H, BLOCK_S=max(2, 1 << (n_splits - 1).bit_length()),
            HAS_SINK=attn_sink is not None)
        return out, lse

    # ------------------------------------------------------------------ the call

    def decode(self, q, kv_cache, block_table, cache_seqlens, *, softmax_scale, causal, indices=None,
               topk_length=None, attn_sink=None, head_dim_v=None):
        B, s_q, H, d_qk = q.shape
        d_v = D_V if head_dim_v is None else int(head_dim_v)
        fp8 = kv_cache.dtype == torch.uint8
        if fp8 and kv_cache.shape[-1] == model1.TOKEN_BYTES:
            raise ValueError(f"{self.name}: the MODEL1 layout is not implemented")
        if (d_qk, d_v) not in HEAD_DIMS or (fp8 and (d_qk, d_v) != (D_QK, D_V)) or (
                not fp8 and kv_cache.shape[-1] != d_qk):
            raise ValueError(f"{self.name}: q [..., {d_qk}], head_dim_v {d_v} and a kv_cache of rows "
                             f"{kv_cache.dtype} [..., {kv_cache.shape[-1]}] do not fit together (head dims {HEAD_DIMS})")
        if q.stride(-1) != 1:
            q = q.contiguous()
        num_blocks, page = kv_cache.shape[0], kv_cache.shape[1]
        n_slots = num_blocks * page
        rows = kv_cache.reshape(n_slots, kv_cache.shape[-1])
        if fp8:
            rows, scales, rope = self.fp8_views(rows.contiguous())
        else:
            scales = rope = rows
        sparse = indices is not None
        if sparse:
            indices = indices if indices.stride(-1) == 1 else indices.contiguous()
            capacity = indices.shape[-1]
        else:
            capacity = block_table.shape[1] * page
        n_vis = self.visible_keys(cache_seqlens, s_q, causal and not sparse, indices.shape[-1] if sparse else None,
                                  topk_length)
        per, n_splits = self.splits(max(capacity, 1))
        dev = q.device
        o_part = torch.empty(B * s_q, n_splits, H, d_v, dtype=torch.float32, device=dev)
        lse_part = torch.empty(B * s_q, n_splits, H, dtype=torch.float32, device=dev)
        idx = indices if sparse else n_vis  # a placeholder pointer where there are no indices
        bt = block_table if not sparse else n_vis
        kernels().mla_decode_partial[(B * s_q, -(-H // BLOCK_H), n_splits)](
            q, q.stride(0), q.stride(1), q.stride(2),
            rows, rows.stride(0), scales, scales.stride(0), rope, rope.stride(0),
            bt, bt.stride(0) if not sparse else 0,
            idx, idx.stride(0) if sparse else 0, idx.stride(1) if sparse else 0,
            n_vis, o_part, lse_part,
            softmax_scale * math.log2(math.e), H, s_q, n_slots, per, n_splits,
            PAGE=page, D_V=d_v, D_PE=d_qk - d_v, BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, SPARSE=sparse, FP8=fp8,
            DOT_PRECISION=self.float32_dot_precision if q.dtype == torch.float32 else None)
        out, lse = self.combine(o_part, lse_part, attn_sink, (B, s_q, H, d_v), q.dtype)
        return out.to(q.dtype), lse
