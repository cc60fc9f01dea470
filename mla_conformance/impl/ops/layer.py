"""Any op behind the layer contract: projections, RoPE and both absorptions in torch, attention in the op's kernels.

:class:`OpBackend` turns an op (:mod:`mla_conformance.contract.op`) into a layer backend
(:mod:`mla_conformance.contract.layer`), so one op implementation is checked by both suites: ``pytest suites
--mla-backend op:SPEC`` runs the whole layer suite (numerics, bytes, paging, goldens) on it, SPEC being any
op spec ``--mla-op`` takes (a built-in op name, ``package.module:attr``, ``path/to/file.py:attr``)::

    q_nope, q_pe, c, k_pe = project(weights, x, positions)        (mla_conformance.model.reference)
    cache <- [c | k_pe]                                            op.write where it has one, else the suite
    decode rows (one new token):
      q     = [q_nope W_UK | q_pe]                  [B, S, H, 576]  (the query absorbs W_UK)
      o_lat = op.decode(q, kv_pages, block_table, seq_lens, causal=True)[0]     [B, S, H, 512]
      o     = o_lat W_UV^T                                          (the output absorbs W_UV)
    prefill rows (more than one new token), when the op has prefill and merge:
      o     = MHA-mode chunked prefill (mla_conformance.impl.ops.chunked_prefill): the cached context
              up-projected per head in chunks of 24 tokens, prefill(causal=False) per chunk, prefill(causal=True)
              over the new tokens, merged pairwise with merge
    out   = o_proj(o)

So an op with prefill, merge and write has its whole kernel set exercised by the layer numerics, byte tests and
goldens. :meth:`OpBackend.routes` says, per config, which way prefill and the cache fill go and why.

Without the prefill route every call goes through ``op.decode`` with ``causal=True``: the contract's causal
multi-token decode aligns the S queries with the *last* S keys of the row (query i sees keys
< cache_seqlens - S + i + 1), which is exactly query i at position seq_lens + i when the row appended S
tokens. Rows of a padded batch appended fewer tokens, so rows are grouped by how many they appended and
each group is one ``decode`` call with that many queries; rows that appended nothing are left out.

A decode-only op (one that declines causal multi-token decode, s_q > 1, and has no prefill route: most decode
kernels) is not refused: its rows of more than one new token (prefill, multi-token steps) are attended by the
suite's reference (reference-op's causal decode, :data:`REFERENCE_PREFILL`) over the op's own cache -- filled by
``op.write`` where it has one, else by the suite -- and every one-token decode step goes through ``op.decode``. So
the layer numerics, bytes, paging and goldens run through the op's decode kernel; ``routes()`` says so.

What the wrapper declines (``unsupported_reason``), in this order, each with a sentence: DeepSeek Sparse
Attention configs (the wrapper drives dense decode); head dims other than kv_lora_rank 512 + qk_rope_head_dim
64 (the op contract's 576 / 512) unless the op declares them in ``head_dims`` (reference-op takes any: the
embedded tiny model's golden generations then run through it, with ``head_dim_v`` passed); a kv_codec that is not ``"none"`` (the op's ``"latent"`` format) or
``"fp8-e4m3-flashmla"`` (the op's 656-byte format, when the op lists it in ``kv_formats``); then whatever
the op itself declines for the one-token decode case the layer hands it (s_q 1, causal, the layer's head count,
the page size, the dtype), asked through ``op.unsupported_reason(OpCase(...))``. What the op declines for
multi-token decode (s_q > 1), prefill, merge or write is not a refusal: the multi-token rows then run the op's
multi-token decode or the suite's reference prefill, the cache the suite's fill.

The cache is always paged (``supports_paging``; the op's ``page_block_sizes``). ``paged_bit_exact`` is False:
another page size is another call of the op, which may split its reductions differently; paged runs are
held to the dtype's tolerance instead of bit equality.
"""

from __future__ import annotations

import torch

from mla_conformance.contract.layer import dense_only_reason, is_v4
from mla_conformance.kv.codecs import get_codec
from mla_conformance.model import reference
from mla_conformance.kv.caches import PagedLatentCache, to_flashmla_layout
from mla_conformance.contract.op import D_QK, D_ROPE, D_V, OpCase, declared, takes_head_dims
from mla_conformance.impl.ops import chunked_prefill
from mla_conformance.impl.ops.reference import ReferenceOp

FP8_CODEC = "fp8-e4m3-flashmla"
#: layer kv_codec -> the op's kv format
CODEC_FORMATS = {"none": "latent", FP8_CODEC: "fp8-e4m3-flashmla"}
#: how many queries the multi-token (prefill, MTP) case asks the op about
MULTI_TOKEN_S_Q = 2
#: what attends the multi-token rows of an op that has neither a prefill route nor causal multi-token decode
REFERENCE_PREFILL = "the suite's reference prefill (reference-op's causal decode over the op's cache)"


def head_dims_of(config) -> tuple[int, int]:
    """(d_qk, d_v) of a config's latent: kv_lora_rank + qk_rope_head_dim, kv_lora_rank."""
    return int(config.kv_lora_rank) + int(config.qk_rope_head_dim), int(config.kv_lora_rank)


def dims_reason(name: str, config, op=None) -> str | None:
    """The sentence for a config whose latent is not the op contract's 512 + 64 and not among the head dims
    the op declares (``head_dims``)."""
    d_qk, d_v = head_dims_of(config)
    if (d_qk, d_v) == (D_QK, D_V) or (op is not None and takes_head_dims(op, d_qk, d_v)):
        return None
    return (f"{name} hands the op the op contract's head dims, {D_QK} = kv_lora_rank {D_V} + qk_rope_head_dim "
            f"{D_ROPE} (value {D_V}), or others the op declares in head_dims; this config has kv_lora_rank "
            f"{config.kv_lora_rank} and qk_rope_head_dim {config.qk_rope_head_dim} ({d_qk} / {d_v}), which "
            f"op {getattr(op, 'name', '?')} does not declare")


class OpBackend:
    """A layer backend made of torch projections and an op's kernels: ``decode``, and ``prefill`` / ``merge`` /
    ``write`` where the op has them (the op contract). ``context_chunk``: context tokens per chunk of the
    MHA-mode prefill (default mla_conformance.impl.ops.chunked_prefill.CONTEXT_CHUNK)."""

    cache_format = "latent"
    supports_paging = True
    paged_bit_exact = False
    #: V4 layers go to mla_conformance.impl.ops.v4_layer (the op's sparse decode over two caches with the sink);
    #: an op that lacks what that needs declines them there, with the missing declaration named
    deepseek_v4 = True

    def __init__(self, op, page_block_size: int | None = None, context_chunk: int | None = None):
        for attr in ("unsupported_reason", "decode"):
            if not callable(getattr(op, attr, None)):
                raise TypeError(f"OpBackend needs an op (name, unsupported_reason, decode); "
                                f"{type(op).__name__} has no {attr}()")
        op_name = getattr(op, "name", None)
        if not isinstance(op_name, str) or not op_name:
            raise TypeError(f"OpBackend needs an op with a 'name' string; {type(op).__name__} has none")
        self.op = op
        self.name = f"op:{op_name}"
        sizes = tuple(int(n) for n in declared(op, "page_block_sizes"))
        self.page_block_sizes = sizes
        if page_block_size is None:
            page_block_size = 64 if 64 in sizes else sizes[0]
        elif page_block_size not in sizes:
            raise ValueError(f"{self.name}: the op reads pages of {', '.join(map(str, sizes))} tokens, "
                             f"not {page_block_size}")
        self.page_block_size = int(page_block_size)
        formats = declared(op, "kv_formats")
        self.kv_codecs = tuple(codec for codec, fmt in CODEC_FORMATS.items() if fmt in formats)
        self.context_chunk = chunked_prefill.CONTEXT_CHUNK if context_chunk is None else int(context_chunk)
        if self.context_chunk <= 0:
            raise ValueError(f"{self.name}: context_chunk must be a positive number of tokens, got {context_chunk}")

    # ------------------------------------------------------------------ gating
    def request_reason(self, config, *, dtype, device, kv_codec="none") -> str | None:
        """What the wrapper itself declines (before asking the op)."""
        reason = dense_only_reason(self.name, config)
        if reason:
            return reason
        reason = dims_reason(self.name, config, self.op)
        if reason:
            return reason
        if kv_codec not in CODEC_FORMATS:
            return (f"{self.name} hands the op an unquantized latent cache (kv_codec 'none') or FlashMLA's FP8 "
                    f"656-byte cache ({FP8_CODEC}); kv_codec {kv_codec!r} is neither")
        if kv_codec not in self.kv_codecs:
            return (f"op {self.op.name} reads kv formats {', '.join(declared(self.op, 'kv_formats'))}, not "
                    f"{CODEC_FORMATS[kv_codec]!r} (kv_codec {kv_codec!r})")
        if kv_codec == FP8_CODEC:
            reason = get_codec(kv_codec).unsupported_reason(config, dtype)
            if reason:
                return reason
        if not torch.empty(0, dtype=dtype).is_floating_point():
            return f"{self.name} needs a floating-point dtype, got {dtype}"
        return None

    def prefill_route_reason(self, config, *, dtype, device) -> str | None:
        """Why prefill rows go through ``op.decode`` rather than the op's prefill and merge (None: they do not)."""
        return chunked_prefill.prefill_reason(self.op, config, dtype=dtype, device=device)

    def write_route_reason(self, config, *, dtype, device, kv_codec="none", page_block_size=None) -> str | None:
        """Why the suite fills the cache rather than ``op.write`` (None: the op writes it)."""
        page = self.page_block_size if page_block_size is None else int(page_block_size)
        return chunked_prefill.write_reason(self.op, config, dtype=dtype, device=device,
                               kv_format=CODEC_FORMATS.get(kv_codec, kv_codec), page_block_size=page)

    def multi_token_decode_reason(self, config, *, dtype, device, kv_codec="none") -> str | None:
        """Why multi-token rows cannot go through ``op.decode`` (the op's sentence for causal s_q
        :data:`MULTI_TOKEN_S_Q`; None: they can)."""
        return self.op.unsupported_reason(self._case(config, MULTI_TOKEN_S_Q, dtype=dtype, device=device,
                                                     kv_codec=kv_codec))

    def multi_token_route(self, config, *, dtype, device, kv_codec="none") -> str:
        """What attends the rows of more than one new token: ``"prefill"`` (the op's prefill and merge),
        ``"decode"`` (the op's causal multi-token decode) or ``"reference"`` (:data:`REFERENCE_PREFILL`, for an op
        that has neither but takes one-token decode: a decode-only op)."""
        if self.prefill_route_reason(config, dtype=dtype, device=device) is None:
            return "prefill"
        if self.multi_token_decode_reason(config, dtype=dtype, device=device, kv_codec=kv_codec) is None:
            return "decode"
        if self.op.unsupported_reason(self._case(config, 1, dtype=dtype, device=device, kv_codec=kv_codec)):
            return "decode"  # the op declines this config altogether (unsupported_reason says so): nothing to route
        return "reference"

    def routes(self, config, *, dtype, device, kv_codec="none", page_block_size=None) -> dict[str, str]:
        """Which of the op's kernels run the layer's prefill and cache fill for this config, and why not."""
        p = self.prefill_route_reason(config, dtype=dtype, device=device)
        w = self.write_route_reason(config, dtype=dtype, device=device, kv_codec=kv_codec,
                                    page_block_size=page_block_size)
        route = self.multi_token_route(config, dtype=dtype, device=device, kv_codec=kv_codec)
        if route == "prefill":
            prefill = f"op.prefill + op.merge (MHA mode, context chunks of {self.context_chunk} tokens)"
        elif route == "decode":
            prefill = f"op.decode (causal multi-token): {p}"
        else:
            m = self.multi_token_decode_reason(config, dtype=dtype, device=device, kv_codec=kv_codec)
            prefill = f"{REFERENCE_PREFILL}, every one-token decode step through op.decode: {p}; {m}"
        return {"prefill": prefill, "write": "op.write" if w is None else f"the suite: {w}"}

    def _case(self, config, s_q: int, *, dtype, device, kv_codec="none") -> OpCase:
        return OpCase(batch=1, s_q=s_q, h_q=int(config.num_attention_heads), page_block_size=self.page_block_size,
                      dtype=dtype, kv_format=CODEC_FORMATS.get(kv_codec, kv_codec), causal=True, device=str(device))

    def op_cases(self, config, *, dtype, device, kv_codec="none") -> list[OpCase]:
        """The decode cases a layer run hands the op: one-token decode, and multi-token causal decode where the
        multi-token rows go through ``op.decode`` (no prefill route, and the op takes it; an op that declines it
        gets its multi-token rows from the suite's reference prefill instead, :data:`REFERENCE_PREFILL`)."""
        cases = [self._case(config, 1, dtype=dtype, device=device, kv_codec=kv_codec)]
        if self.multi_token_route(config, dtype=dtype, device=device, kv_codec=kv_codec) == "decode":
            cases.append(self._case(config, MULTI_TOKEN_S_Q, dtype=dtype, device=device, kv_codec=kv_codec))
        return cases

    def _v4(self):
        # the V4 path (it imports reference-v4's torch pieces) loads only for V4 configs
        from mla_conformance.impl.ops.v4_layer import V4OpPath
        return V4OpPath(self)

    def unsupported_reason(self, config, *, dtype, device, kv_codec="none"):
        if is_v4(config):
            return self._v4().unsupported_reason(config, dtype=dtype, device=device, kv_codec=kv_codec)
        reason = self.request_reason(config, dtype=dtype, device=device, kv_codec=kv_codec)
        if reason:
            return reason
        for case in self.op_cases(config, dtype=dtype, device=device, kv_codec=kv_codec):
            reason = self.op.unsupported_reason(case)
            if reason:
                return reason
        return None

    # ------------------------------------------------------------------ cache
    def new_cache(self, config, *, batch_size, capacity, dtype, device, kv_codec="none", page_block_size=None):
        if is_v4(config):
            return self._v4().new_cache(config, batch_size=batch_size, capacity=capacity, dtype=dtype,
                                        device=device, kv_codec=kv_codec)
        page_block_size = self.page_block_size if page_block_size is None else page_block_size
        if page_block_size not in self.page_block_sizes:
            raise ValueError(f"{self.name}: the op reads pages of {', '.join(map(str, self.page_block_sizes))} "
                             f"tokens, not {page_block_size}")
        if kv_codec not in self.kv_codecs:
            raise ValueError(f"{self.name} stores kv_codec {', '.join(map(repr, self.kv_codecs))}, not {kv_codec!r}")
        return PagedLatentCache(config, batch_size=batch_size, capacity=capacity, dtype=dtype, device=device,
                                kv_codec=kv_codec, page_block_size=page_block_size)

    # ------------------------------------------------------------------ attention
    def decode(self, q, kv_cache, block_table, cache_seqlens, softmax_scale: float, head_dim_v: int = D_V):
        """One ``op.decode`` call (causal): q [b, s_q, H, 576] -> o_lat [b, s_q, H, 512] (other head dims: the
        op declared them and gets ``head_dim_v``); checks what comes back."""
        extra = {} if (q.shape[-1], head_dim_v) == (D_QK, D_V) else {"head_dim_v": head_dim_v}
        out = self.op.decode(q, kv_cache, block_table, cache_seqlens, softmax_scale=softmax_scale, causal=True,
                             **extra)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(f"op {self.op.name}: decode() returned {type(out).__name__}, not (out, lse)")
        o, _lse = out
        expected = (*q.shape[:3], head_dim_v)
        if not isinstance(o, torch.Tensor) or tuple(o.shape) != expected:
            got = tuple(o.shape) if isinstance(o, torch.Tensor) else type(o).__name__
            raise ValueError(f"op {self.op.name}: decode() returned out {got}, expected {expected}")
        return o

    @staticmethod
    def reference_decode(q, kv_cache, block_table, cache_seqlens, softmax_scale: float, head_dim_v: int = D_V):
        """:data:`REFERENCE_PREFILL`: the rows of more than one new token of a decode-only op, attended causally by
        reference-op over the op's cache (latent or FP8 656-byte: as the op reads it)."""
        return ReferenceOp().decode(q, kv_cache, block_table, cache_seqlens, softmax_scale=softmax_scale,
                                    causal=True, head_dim_v=head_dim_v)[0]

    def attend(self, weights, hidden_states, positions, cache, lengths=None):
        if is_v4(weights.config):
            return self._v4().attend(weights, hidden_states, positions, cache, lengths)
        if hidden_states.dtype != weights.dtype:
            raise ValueError(f"hidden_states are {hidden_states.dtype} but weights are {weights.dtype}")
        if not isinstance(cache, PagedLatentCache):
            raise TypeError(f"{self.name}: expected the PagedLatentCache of new_cache(), got {type(cache).__name__}")
        cfg = weights.config
        dt, dev = hidden_states.dtype, hidden_states.device
        lengths, new_lens = cache.write_plan(positions, lengths)
        q_nope, q_pe, c, k_pe = reference.project(weights, hidden_states, positions)
        context_lens = cache.seq_lens.clone()
        if self.write_route_reason(cfg, dtype=dt, device=dev, kv_codec=cache.kv_codec,
                                   page_block_size=cache.page_block_size) is None:
            chunked_prefill.write_latent(self.op, cache, c, k_pe, lengths, CODEC_FORMATS[cache.kv_codec])
        else:
            cache.write_latent(c, k_pe, lengths)
        route = self.multi_token_route(cfg, dtype=dt, device=dev, kv_codec=cache.kv_codec)
        multi = (lengths > 1) if route == "prefill" else torch.zeros_like(lengths, dtype=torch.bool)
        w_uk, w_uv = reference.split_kv_b(weights)
        q = torch.cat([torch.einsum("bshd,hdc->bshc", q_nope, w_uk), q_pe], dim=-1)  # [B, S, H, 576]
        kv_cache, block_table, cache_seqlens = to_flashmla_layout(cache, new_lens)

        B, S, H = q.shape[:3]
        o_lat = torch.zeros(B, S, H, cfg.kv_lora_rank, dtype=q.dtype, device=q.device)
        decode_lens = torch.where(multi, torch.zeros_like(lengths), lengths)
        for n in sorted({int(v) for v in decode_lens.tolist()} - {0}):
            rows = (decode_lens == n).nonzero().flatten().to(q.device)
            decode = self.decode if n == 1 or route == "decode" else self.reference_decode
            o_lat[rows, :n] = decode(q[rows, :n].contiguous(), kv_cache, block_table[rows].contiguous(),
                                     cache_seqlens[rows].contiguous(), cfg.softmax_scale,
                                     cfg.kv_lora_rank).to(q.dtype)
        o = torch.einsum("bshc,hdc->bshd", o_lat, w_uv)
        if bool(multi.any()):
            o = self._prefill_rows(weights, cache, o, q_nope, q_pe, c, k_pe, lengths, context_lens, multi)
        out = o.flatten(-2) @ weights["o_proj.weight"].T
        cache.commit(new_lens)
        return out.to(hidden_states.dtype)

    def _prefill_rows(self, weights, cache, o, q_nope, q_pe, c, k_pe, lengths, context_lens, multi):
        """The rows that appended more than one token, through the op's prefill and merge (MHA mode)."""
        rows = multi.nonzero().flatten().tolist()
        n = [int(lengths[b]) for b in rows]
        C = [int(context_lens[b]) for b in rows]
        q = torch.cat([torch.cat([q_nope[b, :m], q_pe[b, :m]], dim=-1) for b, m in zip(rows, n)])
        new_c = torch.cat([c[b, :m] for b, m in zip(rows, n)])
        new_kpe = torch.cat([k_pe[b, :m] for b, m in zip(rows, n)])
        ctx_c = ctx_kpe = None
        if max(C) > 0:  # the context as the cache holds it (written by op.write or the suite), dequantized
            ctx_c, ctx_kpe = cache.read_latent(max(C))
        out = chunked_prefill.mha_prefill(self.op, weights, q, new_c, new_kpe, n,
                             lambda r, a, e: (ctx_c[rows[r], a:e], ctx_kpe[rows[r], a:e]), C,
                             chunk=self.context_chunk)
        o = o.clone()
        start = 0
        for b, m in zip(rows, n):
            o[b, :m] = out[start:start + m].to(o.dtype)
            start += m
        return o


__all__ = ["OpBackend", "dims_reason", "head_dims_of"]
