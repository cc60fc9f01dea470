"""``reference-op`` (the built-in op, torch, any device: decode, prefill, sparse_prefill, merge and write), the
decode oracle's reading of a paged cache (:func:`oracle`: decode the cache, then
mla_conformance.model.attention_oracles.decode), and the FP8 656-byte page codec the op tests write caches with.
Every method's float64 oracle, the merge by lse and the lse conversions are mla_conformance.model.attention_oracles;
the bytes a write must leave, mla_conformance.kv.cache_write.

The two computations are written apart on purpose:

* :class:`ReferenceOp` is batched: it gathers every row's pages through the block table at once, *selects*
  (``torch.where``) zeros for every key a query may not see (unfilled page tails and unused pages hold
  NaN in the suite's caches: masking by multiplication would leak them, 0 x NaN is NaN), and computes in
  float32 (float64 for a float64 q).
* the oracle (mla_conformance.model.attention_oracles.decode) loops over rows and queries in float64 with plain
  indexing, from the contract's words.
"""

from __future__ import annotations

import math

import torch

from mla_conformance.kv import model1
from mla_conformance.model import attention_oracles
from mla_conformance.kv.codecs import decode_flashmla_fp8, encode_flashmla_fp8, flashmla_fp8_scales
from mla_conformance.contract.op import D_QK, D_V, declared


# --------------------------------------------------------------------------- FP8 656-byte rows
# (the layout's code lives with the codec, mla_conformance.kv.codecs; here on [..., 576] latents)


#: tile scales [..., 4] float32 of a latent [..., 512] ("pow2" or "fp32")
fp8_scales = flashmla_fp8_scales


def encode_fp8_656(latent: torch.Tensor, scale_format: str = "pow2") -> torch.Tensor:
    """[..., 576] latent (c | k_pe) -> uint8 [..., 656]: 512 e4m3 (c / tile scale), 4 float32 scales, 64 bf16 rope."""
    if latent.shape[-1] != D_QK:
        raise ValueError(f"expected a [..., {D_QK}] latent, got {tuple(latent.shape)}")
    return encode_flashmla_fp8(latent[..., :D_V], latent[..., D_V:], scale_format)


def decode_fp8_656(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 [..., 656] -> [..., 576] in ``dtype``: e4m3 x its float32 tile scale, then the bf16 rope."""
    return torch.cat(decode_flashmla_fp8(rows, dtype), dim=-1)


def is_model1(kv_cache: torch.Tensor) -> bool:
    """A MODEL1 cache: the uint8 [num_blocks, page, 1, 584] view of its block memory (mla_conformance.kv.model1)."""
    return kv_cache.dtype == torch.uint8 and kv_cache.dim() == 4 and kv_cache.shape[-1] == model1.TOKEN_BYTES


def dequantize_cache(kv_cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The cache as [num_blocks, page, 1, 576] in ``dtype`` (decoding the 656-byte layout), or [..., 512] for a
    whole MODEL1 cache (its tokens' bytes are spread over each block: it decodes whole blocks only)."""
    if is_model1(kv_cache):
        return model1.decode(kv_cache, dtype)
    if kv_cache.dtype == torch.uint8:
        return decode_fp8_656(kv_cache, dtype)
    return kv_cache.to(dtype)


# --------------------------------------------------------------------------- the float64 decode oracle, on a cache


def oracle(q, kv_cache, block_table, cache_seqlens, *, softmax_scale, causal, indices=None, topk_length=None,
           attn_sink=None, head_dim_v=None, magnitudes=False, align="bottom-right"):
    """mla_conformance.model.attention_oracles.decode over a paged cache as the op receives it
    ([num_blocks, page, 1, d_qk] in any dtype, or a 656-byte FP8 or MODEL1 uint8 cache): the FP8 layout is decoded
    as stored (float32 scales read as float32, whatever format wrote them), then every row is the oracle's."""
    num_blocks, page, d_qk = kv_cache.shape[0], kv_cache.shape[1], q.shape[-1]
    keys = dequantize_cache(kv_cache.detach().cpu(), torch.float64).reshape(num_blocks * page, d_qk)
    return attention_oracles.decode(q, keys, block_table, cache_seqlens, page=page, softmax_scale=softmax_scale,
                                    causal=causal, indices=indices, topk_length=topk_length, attn_sink=attn_sink,
                                    head_dim_v=head_dim_v, magnitudes=magnitudes, align=align)


# --------------------------------------------------------------------------- the reference op


def _row_reader(kv_cache: torch.Tensor, acc: torch.dtype):
    """slots -> the cache's rows at those flat slots, decoded to ``acc`` (MODEL1: its blocks decoded first, its
    tokens' bytes lying apart in each block; else gathered first, then only the rows read decoded)."""
    num_blocks, page = kv_cache.shape[0], kv_cache.shape[1]
    if is_model1(kv_cache):
        return model1.decode(kv_cache, acc).reshape(num_blocks * page, model1.D_QK).__getitem__
    flat = kv_cache.reshape(num_blocks * page, kv_cache.shape[-1])
    return lambda slots: dequantize_cache(flat[slots], acc)


def _gather(rows, indices: torch.Tensor, topk_length, n_slots: int, acc: torch.dtype):
    """The keys sparse indices [B, s_q, k] select (zeros where invalid) and which are valid: in range, and within
    topk_length [B] where given."""
    idx = indices.long()
    B = idx.shape[0]
    valid = (idx >= 0) & (idx < n_slots)
    if topk_length is not None:
        valid &= torch.arange(idx.shape[-1], device=idx.device) < topk_length.long().view(B, 1, 1)
    keys = rows(torch.where(valid, idx, 0))
    return torch.where(valid[..., None], keys, torch.zeros((), dtype=acc, device=idx.device)), valid


def _owned(n: torch.Tensor, world_size: int, rank: int, interleave: int) -> torch.Tensor:
    """How many of the global tokens 0 .. n - 1 rank ``rank`` holds (mla_conformance.contract.dcp.owned_count)."""
    n = n.clamp_min(0)
    cycle = interleave * world_size
    return (n // cycle) * interleave + (n % cycle - rank * interleave).clamp(0, interleave)


def _local_slots(positions, block_table, cache_seqlens, page: int, world_size: int, rank: int, interleave: int):
    """Global token positions [B, s_q, k] (-1 invalid) -> this rank's flat cache slots, -1 for a position another
    rank owns or outside the row (mla_conformance.contract.dcp: owner and local index)."""
    pos = positions.long()
    B = pos.shape[0]
    ok = (pos >= 0) & (pos < cache_seqlens.long().view(B, 1, 1)) & ((pos // interleave) % world_size == rank)
    local = (pos // (interleave * world_size)) * interleave + pos % interleave
    col = torch.where(ok, local // page, 0).clamp(max=block_table.shape[1] - 1)
    blocks = torch.gather(block_table.long(), 1, col.reshape(B, -1)).reshape(pos.shape)
    return torch.where(ok, blocks * page + local % page, -1)


class ReferenceOp:
    """The op contract in torch on any device, dense and sparse, latent and FP8 656-byte caches, pages of 1, 16
    and 64 tokens, any head dims (``head_dims = "any"``: the layer wrapper runs the tiny model through it)."""

    name = "reference-op"
    lse_base = "e"
    returns_lse = True
    empty_row = "+inf"
    sparse_decode = True
    sparse_decode_extra_cache = True
    invalid_index = "out-of-range"   # it ignores -1 and every index outside the cache
    attn_sink = True
    page_block_sizes = (1, 16, 64)
    kv_formats = ("latent", "fp8-e4m3-flashmla", "fp8-e4m3-model1")
    fp8_scale_format = "pow2"
    deterministic = True
    batch_invariant = True
    head_dims = "any"
    out_buffers = True
    prefill_head_dims = "any"
    prefill_lse_base = "e"
    prefill_empty_row = "+inf"
    sparse_prefill_head_dims = ((576, 512), (512, 512))
    sparse_prefill_topk_length = True
    sparse_prefill_attn_sink = True
    merge_lse_base = "e"
    merge_empty_row = "+inf"
    write_kv_formats = ("latent", "fp8-e4m3-flashmla", "fp8-e4m3-model1")
    write_fp8_scale_format = "pow2"
    write_page_block_sizes = (1, 16, 64)
    # decode context parallelism (mla_conformance.contract.dcp): global lengths and positions, mapped per rank
    dcp = "global"
    dcp_lse_base = "e"
    dcp_sparse = True
    dcp_write = True

    def unsupported_reason(self, case):
        method = getattr(case, "method", "decode")
        pages = {"decode": "page_block_sizes", "write": "write_page_block_sizes"}.get(method)
        if pages and case.page_block_size not in declared(self, pages):
            return (f"{self.name} {'reads' if method == 'decode' else 'writes'} pages of "
                    f"{', '.join(map(str, declared(self, pages)))} tokens, not {case.page_block_size}")
        if not torch.empty(0, dtype=case.dtype).is_floating_point():
            return f"{self.name} needs a floating-point {'q' if method != 'write' else 'kv_c'}, got {case.dtype}"
        return None

    def decode(self, q, kv_cache, block_table, cache_seqlens, *, softmax_scale, causal, indices=None,
               topk_length=None, attn_sink=None, head_dim_v=None, extra_k_cache=None, extra_indices=None,
               extra_topk_length=None, out=None, lse=None, dcp_world_size=None, dcp_rank=None, dcp_interleave=None):
        dcp = None if dcp_world_size is None else (int(dcp_world_size), int(dcp_rank), int(dcp_interleave))
        result = self._decode(q, kv_cache, block_table, cache_seqlens, softmax_scale=softmax_scale, causal=causal,
                              indices=indices, topk_length=topk_length, attn_sink=attn_sink, head_dim_v=head_dim_v,
                              extra_k_cache=extra_k_cache, extra_indices=extra_indices,
                              extra_topk_length=extra_topk_length, dcp=dcp)
        # out_buffers: the caller's buffers (any strides) written and returned as they are
        return tuple(r if buf is None else buf.copy_(r) for r, buf in zip(result, (out, lse)))

    def _decode(self, q, kv_cache, block_table, cache_seqlens, *, softmax_scale, causal, indices, topk_length,
                attn_sink, head_dim_v, extra_k_cache, extra_indices, extra_topk_length, dcp=None):
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        B, s_q, h_q, d_qk = q.shape
        d_v = D_V if head_dim_v is None else int(head_dim_v)
        if kv_cache.dtype == torch.uint8:  # the FP8 layouts fix their dims (MODEL1: d_v = d_qk = 512)
            fits = (d_qk, d_v) == ((model1.D_QK, model1.D_QK) if is_model1(kv_cache) else (D_QK, D_V))
        else:
            fits = kv_cache.shape[-1] == d_qk
        if not fits or not 0 < d_v <= d_qk:
            raise ValueError(f"{self.name}: q [..., {d_qk}], head_dim_v {d_v} and a kv_cache of rows "
                             f"{kv_cache.dtype} [..., {kv_cache.shape[-1]}] do not fit together")
        num_blocks, page = kv_cache.shape[0], kv_cache.shape[1]
        if is_model1(kv_cache) and indices is None:
            raise ValueError(f"{self.name}: the MODEL1 layout is read by sparse decode only (FlashMLA's)")
        rows = _row_reader(kv_cache, acc)
        qf = q.to(acc)
        dev = q.device
        if indices is not None and dcp is not None:  # global positions in each row: keep this rank's, localised
            indices = _local_slots(indices, block_table, cache_seqlens, page, *dcp)
        if indices is not None:
            keys, valid = _gather(rows, indices, topk_length, num_blocks * page, acc)  # [B, s_q, k, d_qk]
            if extra_k_cache is not None:  # the second cache's selection joins the first's under one softmax
                extra_keys, extra_valid = _gather(_row_reader(extra_k_cache, acc), extra_indices, extra_topk_length,
                                                  extra_k_cache.shape[0] * extra_k_cache.shape[1], acc)
                keys, valid = torch.cat([keys, extra_keys], dim=2), torch.cat([valid, extra_valid], dim=-1)
            logits = torch.einsum("bshd,bskd->bshk", qf, keys) * softmax_scale
            allowed = valid[:, :, None, :]                                      # [B, s_q, 1, k]
            values = keys[..., :d_v]
            mix = "bshk,bskd->bshd"
        else:
            lens = cache_seqlens.long()
            if dcp is not None:  # global lengths: the keys this rank holds, and each causal query's among them
                glens, lens = lens, _owned(lens, *dcp)
            # only the pages some row uses (the block table may be as wide as the capacity); under CUDA-graph
            # capture every column (reading the lengths on the host would end the capture)
            capturing = dev.type == "cuda" and torch.cuda.is_current_stream_capturing()
            max_blocks = block_table.shape[1] if capturing else min(block_table.shape[1],
                                                                    -(-int(lens.max()) // page) if B else 0)
            T = max_blocks * page
            used = torch.arange(max_blocks, device=dev) < ((lens + page - 1) // page)[:, None]  # [B, max_blocks]
            bt = torch.where(used, block_table[:, :max_blocks].long(), 0).clamp(0, num_blocks - 1)
            slots = (bt[:, :, None] * page + torch.arange(page, device=dev)).reshape(B, T)
            keys = rows(slots)                                                  # [B, T, d_qk]
            pos = torch.arange(T, device=dev)
            key_ok = pos < lens[:, None]                                        # [B, T]
            keys = torch.where(key_ok[..., None], keys, torch.zeros((), dtype=acc, device=dev))
            if causal:
                limit = lens[:, None] - s_q + torch.arange(s_q, device=dev) + 1  # [B, s_q]
                if dcp is not None:  # the global bound, mapped to this rank (never from the local length)
                    limit = _owned(glens[:, None] - s_q + torch.arange(s_q, device=dev) + 1, *dcp)
                ok = key_ok[:, None, :] & (pos < limit[..., None])              # [B, s_q, T]
            else:
                ok = key_ok[:, None, :].expand(B, s_q, T)
            logits = torch.einsum("bshd,btd->bsht", qf, keys) * softmax_scale
            allowed = ok[:, :, None, :]
            values = keys[..., :d_v]
            mix = "bsht,btd->bshd"
        logits = torch.where(allowed, logits, torch.full((), -math.inf, dtype=acc, device=dev))
        lse = torch.logsumexp(logits, dim=-1)                                   # [B, s_q, h]
        empty = torch.isneginf(lse)
        p = torch.exp(logits - torch.where(empty, torch.zeros_like(lse), lse)[..., None])
        p = torch.where(allowed, p, torch.zeros((), dtype=acc, device=dev))
        out = torch.einsum(mix, p, values)
        if attn_sink is not None:
            factor = torch.sigmoid(lse - attn_sink.to(acc).view(1, 1, h_q))      # exp(lse) / (exp(lse) + exp(sink))
            out = out * torch.where(empty, torch.zeros_like(factor), factor)[..., None]
        lse = torch.where(empty, torch.full_like(lse, math.inf), lse)
        return out.to(q.dtype), lse.transpose(1, 2).to(torch.float32).contiguous()

    # ----------------------------------------------------------------------- the optional methods

    def prefill(self, q, k, v, cu_seqlens_q, cu_seqlens_k, *, softmax_scale, causal):
        """Varlen attention row by row, heads batched; float32 (float64 for a float64 q); bottom-right causal."""
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        total_q, h_q, _ = q.shape
        group = h_q // k.shape[1]
        dev = q.device
        out = torch.zeros(total_q, h_q, v.shape[-1], dtype=acc, device=dev)
        lse = torch.full((total_q, h_q), math.inf, dtype=torch.float32, device=dev)
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        for b in range(len(cq) - 1):
            m, n = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
            if m == 0 or n == 0:
                continue
            keys = k[ck[b]:ck[b + 1]].to(acc).repeat_interleave(group, dim=1)      # [n, h_q, d_qk]
            values = v[ck[b]:ck[b + 1]].to(acc).repeat_interleave(group, dim=1)
            logits = torch.einsum("mhd,nhd->hmn", q[cq[b]:cq[b + 1]].to(acc), keys) * softmax_scale
            if causal:  # query i sees keys j <= n - m + i
                seen = torch.arange(n, device=dev)[None, :] <= (n - m + torch.arange(m, device=dev))[:, None]
                logits = torch.where(seen, logits, torch.tensor(-math.inf, dtype=acc, device=dev))
            l = torch.logsumexp(logits, dim=-1)                                    # [h, m]
            empty = torch.isneginf(l)
            p = torch.exp(logits - torch.where(empty, torch.zeros_like(l), l)[..., None])
            out[cq[b]:cq[b + 1]] = torch.einsum("hmn,nhd->mhd", p, values)
            lse[cq[b]:cq[b + 1]] = torch.where(empty, torch.full_like(l, math.inf), l).T.to(torch.float32)
        return out.to(q.dtype), lse

    def sparse_prefill(self, q, kv, indices, *, softmax_scale, d_v, topk_length=None, attn_sink=None):
        """FlashMLA's flash_mla_sparse_fwd: gather the valid indexed keys (torch.where zeros for the rest)."""
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        s_q, h_q, d_qk = q.shape
        s_kv, h_kv = kv.shape[:2]
        dev = q.device
        idx = indices.long()                                                       # [s_q, h_kv, topk]
        valid = (idx >= 0) & (idx < s_kv)
        if topk_length is not None:
            valid &= torch.arange(idx.shape[-1], device=dev) < topk_length.long()[:, None, None]
        keys = kv.to(acc)[torch.where(valid, idx, 0), torch.arange(h_kv, device=dev)[None, :, None]]
        keys = torch.where(valid[..., None], keys, torch.zeros((), dtype=acc, device=dev))  # [s_q, h_kv, k, d]
        qg = q.to(acc).reshape(s_q, h_kv, h_q // h_kv, d_qk)
        logits = torch.einsum("sgjd,sgkd->sgjk", qg, keys) * softmax_scale
        logits = torch.where(valid[:, :, None, :], logits, torch.tensor(-math.inf, dtype=acc, device=dev))
        lse = torch.logsumexp(logits, dim=-1)                                      # [s_q, h_kv, group]
        empty = torch.isneginf(lse)
        max_logits = logits.amax(-1) if logits.shape[-1] else torch.full_like(lse, -math.inf)
        p = torch.exp(logits - torch.where(empty, torch.zeros_like(lse), lse)[..., None])
        out = torch.einsum("sgjk,sgkd->sgjd", p, keys[..., :d_v])
        if attn_sink is not None:
            factor = torch.sigmoid(lse - attn_sink.to(acc).reshape(1, h_kv, -1))
            out = out * torch.where(empty, torch.zeros_like(factor), factor)[..., None]
        lse = torch.where(empty, torch.full_like(lse, math.inf), lse)
        return (out.reshape(s_q, h_q, d_v).to(q.dtype), max_logits.reshape(s_q, h_q).to(torch.float32),
                lse.reshape(s_q, h_q).to(torch.float32))

    def merge(self, out_a, lse_a, out_b, lse_b):
        """By lse (natural log); +inf and -inf both mark an empty side, whose out is not read."""
        acc = torch.float64 if out_a.dtype == torch.float64 else torch.float32
        la, lb = lse_a.to(acc), lse_b.to(acc)
        ea, eb = torch.isinf(la), torch.isinf(lb)
        both = ea & eb
        m = torch.maximum(torch.where(ea, -math.inf, la), torch.where(eb, -math.inf, lb))
        m = torch.where(both, torch.zeros_like(m), m)
        wa = torch.where(ea, torch.zeros_like(la), torch.exp(la - m))
        wb = torch.where(eb, torch.zeros_like(lb), torch.exp(lb - m))
        total = torch.where(both, torch.ones_like(wa), wa + wb)
        zero = torch.zeros((), dtype=acc, device=out_a.device)
        out = ((wa / total)[..., None] * torch.where(ea[..., None], zero, out_a.to(acc)) +
               (wb / total)[..., None] * torch.where(eb[..., None], zero, out_b.to(acc)))
        lse = torch.where(both, torch.full_like(m, math.inf), m + torch.log(total))
        return out.to(out_a.dtype), lse.to(torch.float32)

    def write(self, kv_c, k_pe, kv_cache, slot_mapping, *, kv_format, dcp_world_size=None, dcp_rank=None,
              dcp_interleave=None, dcp_positions=None):
        """The tokens of non-negative slots, encoded as the format stores them, into their slots only (under DCP
        only the tokens this rank owns)."""
        keep = slot_mapping >= 0
        if dcp_world_size is not None:
            keep &= (dcp_positions.long() // int(dcp_interleave)) % int(dcp_world_size) == int(dcp_rank)
        slots = slot_mapping[keep].long()
        c, r = kv_c[keep], k_pe[keep]
        page = kv_cache.shape[1]
        block, offset = slots // page, slots % page
        if kv_format == "latent":
            kv_cache[block, offset, 0] = torch.cat([c, r], dim=-1).to(kv_cache.dtype)
        elif kv_format == "fp8-e4m3-flashmla":
            kv_cache[block, offset, 0] = encode_flashmla_fp8(c, r, declared(self, "write_fp8_scale_format"))
        elif kv_format == model1.NAME:
            mem = model1.block_memory(kv_cache)                                    # [num_blocks, page * 584]
            payload, scales = model1.encode(c, r)
            ar = lambda n: torch.arange(n, device=kv_cache.device)  # noqa: E731
            mem[block[:, None], offset[:, None] * model1.PART_BYTES + ar(model1.PART_BYTES)] = payload
            mem[block[:, None], page * model1.PART_BYTES + offset[:, None] * model1.SCALE_BYTES + ar(model1.TILES)] = \
                scales
        else:
            raise ValueError(f"{self.name}: write() got kv_format {kv_format!r}, not one of "
                             f"{', '.join(declared(self, 'write_kv_formats'))}")
