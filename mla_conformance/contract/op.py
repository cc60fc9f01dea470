"""The op contract: one decode step of absorbed MLA over a paged latent cache, at kernel level.

The layer contract (:mod:`mla_conformance.contract.layer`) fits whole attention implementations. This one fits
the kernel under them -- FlashMLA's ``flash_mla_with_kvcache``, FlashInfer's MLA paged wrapper, the MLA
backends of vLLM and SGLang. An *op* is any object with::

    name: str
    unsupported_reason(case: OpCase) -> str | None
    decode(q, kv_cache, block_table, cache_seqlens, *, softmax_scale, causal,
           indices=None, topk_length=None, attn_sink=None) -> (out, lse)

Inputs (the op must not write them):

* ``q`` [B, s_q, h_q, 576]: the absorbed query, nope part (kv_lora 512, already multiplied by W_UK) then
  the rotated rope part (64). It may be non-contiguous.
* ``kv_cache`` [num_blocks, page_block_size, 1, 576] in q's dtype (format ``"latent"``: the normed latent
  c then the rotated k_pe), or uint8 [num_blocks, page_block_size, 1, 656] (format ``"fp8-e4m3-flashmla"``:
  512 float8_e4m3fn, 4 float32 tile scales of 128 values, 64 bfloat16 rope; FlashMLA's V3.2 layout).
* ``block_table`` int32 [B, max_blocks]: row b's j-th page is ``kv_cache[block_table[b, j]]``; entries past
  a row's pages may hold anything (the suite puts a huge invalid id there).
* ``cache_seqlens`` int32 [B]: keys per row, 0 allowed.
* ``softmax_scale``: the logit scale (the model's, YaRN mscale^2 included); ``causal``: see below.
* ``indices`` int32 [B, s_q, topk] (sparse decode, where the op declares ``sparse_decode = True``): entries
  index the *flattened* cache (``block * page_block_size + offset``), as FlashMLA's sparse decode does. An
  entry of -1 is invalid and ignored. Which other entries are invalid is the op's ``invalid_index``
  declaration: ``"minus-one"`` (the default) is FlashMLA's sparse *decode* (``flash_mla_with_kvcache`` with
  indices): only -1 is special, and the suite hands the op no other index outside the cache (FlashMLA's own
  test oracle raises on one; its kernel would read out of bounds); ``"out-of-range"`` is FlashMLA's sparse
  *prefill* (``flash_mla_sparse_fwd``): -1 and every entry outside ``[0, num_blocks * page_block_size)`` (one
  past the cache, INT_MAX) are invalid and ignored. With indices the keys are the valid indexed ones,
  ``block_table`` / ``cache_seqlens`` do not restrict them, ``causal`` is False. ``topk_length`` int32 [B]:
  only the first ``topk_length[b]`` entries of row b's indices count.
* ``attn_sink`` float32 [h_q] (where the op declares ``attn_sink = True``; dense and sparse decode): the
  output is scaled by exp(lse) / (exp(lse) + exp(attn_sink[h])) (+inf gives 0, -inf changes nothing); lse
  itself is not changed.

Outputs: ``out`` [B, s_q, h_q, 512] (any floating dtype; the suite compares in float64; its rounding is
allowed half a step *of that dtype*) and ``lse`` float32 [B, h_q, s_q], the log-sum-exp of the scaled
logits over the keys the query attends, in the op's declared base. An lse in any other dtype is an error,
not a verdict: lse is what split-KV partials are merged by (weights exp(lse_i - lse)), and bfloat16 keeps 8
significant bits, so an lse of 10 is off by up to 0.03 and a merged partial by 3%. An op that returns no
lse declares ``returns_lse = False`` and returns ``(out, None)``.
Per query: ``out = softmax(scale * q.k) @ c`` over its keys (the value is the latent part of the key, the
first 512 elements).

* **Dense, non-causal:** query i of row b attends keys ``0 .. cache_seqlens[b] - 1``.
* **Dense, causal (multi-token decode, MTP / speculative):** the s_q queries are the *last* s_q tokens
  of the row (bottom-right alignment): query i attends keys ``< cache_seqlens[b] - s_q + i + 1``.
* **A query with no keys** (a zero-length row, a causal query before the row's first key, a sparse row
  with every index invalid) returns out 0 and lse +inf -- FlashMLA's convention -- unless the op
  declares otherwise (``empty_row``).

Optional declarations, detected and never assumed (defaults in :data:`DECLARATIONS`). The rule, for every
part of the contract beyond dense decode over a latent cache and every later extension: **opt-in, never
opt-out** -- a test of an optional part runs on an op only when the op declares that part; an op that
declares nothing gets an explicit skip naming the declaration that would opt it in
(``tests/meta/frozen_base_op.py`` holds an op written to the base contract, never edited since):

* ``lse_base``: ``"e"`` (natural log, default) or ``"2"`` (FlashInfer);
* ``returns_lse``: ``True`` (default) or ``False``: the op returns ``(out, None)`` (SGLang's decode kernel
  writes no final lse); lse comparisons and the split-KV merge are not run, every out check is;
* ``sparse_decode``: ``False`` (default) or ``True``: the op takes ``indices`` / ``topk_length``;
* ``invalid_index``: ``"minus-one"`` (default, FlashMLA's sparse decode) or ``"out-of-range"`` (FlashMLA's
  sparse prefill), see ``indices`` above;
* ``attn_sink``: ``False`` (default) or ``True``: the op takes ``attn_sink`` (tested on dense and sparse
  decode);
* ``empty_row``: the lse a query with no keys returns, ``"+inf"`` (default) or ``"-inf"``; out is 0 either way;
* ``page_block_sizes``: the page sizes the op reads (default ``(64,)``);
* ``kv_formats``: ``("latent",)`` by default; ``"fp8-e4m3-flashmla"`` for the 656-byte layout;
* ``fp8_scale_format``: how the op's FP8 caches are quantized: ``"pow2"`` (tile scale amax/448 rounded up
  to a power of two: DeepSeek's ue8m0, default) or ``"fp32"`` (amax/448 as is). The suite writes the
  caches it hands the op in the declared format;
* ``deterministic``: the same call twice gives bitwise the same out and lse;
* ``batch_invariant``: a row's out and lse do not depend on the other rows of the batch;
* ``head_dims``: the (d_qk, d_v) pairs the op takes, ``((576, 512),)`` by default (DeepSeek's kv_lora 512 +
  rope 64), or ``"any"``. The op suite always uses 576 / 512. Only an op that declares other dims is ever
  handed them -- by the layer wrapper (``--mla-backend op:SPEC``) on configs with another latent, e.g. the
  embedded tiny model (kv_lora 64 + rope 16) whose golden generations then run through the op -- and it is
  then called with the keyword ``head_dim_v=d_v``: q and the latent cache are [..., d_qk], the value is
  the first d_v elements of the key, out is [..., d_v]. An op that declares only the default never gets
  the keyword.

A case the op cannot run is declined by ``unsupported_reason`` with a sentence (the test skips with it).
:class:`OpCase` says what the case holds, so an op can decline what its own contract leaves undefined:
``rows_without_keys`` (a zero-length row, a causal query before its row's first key, a sparse row whose
every index is invalid: vLLM's and SGLang's Triton kernels compute ``acc / e_sum`` = 0/0 there),
``attn_sink``, ``topk`` (sparse), ``causal``, the dtype, page size and KV format.
An op is named on the command line by a spec (``--mla-op``): a built-in name (:data:`BUILTIN_OPS`),
``package.module:attr`` or ``path/to/file.py:attr``, as backends are.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mla_conformance.errors import BackendSpecError

#: Built-in ops: name -> "module:attr".
BUILTIN_OPS: dict[str, str] = {
    "reference-op": "mla_conformance.impl.ops.reference:ReferenceOp",
    "flashmla": "mla_conformance.impl.ops.flashmla:FlashMLAOp",
    "flashmla-sparse": "mla_conformance.impl.ops.flashmla:FlashMLASparseOp",
    "flashinfer": "mla_conformance.impl.ops.flashinfer:FlashInferOp",
    "flashinfer-fa2": "mla_conformance.impl.ops.flashinfer:FlashInferFA2Op",
}

#: Ops a default run checks.
DEFAULT_OPS = ("reference-op",)

REQUIRED_METHODS = ("unsupported_reason", "decode")

#: The head dims of the op contract: q and the latent key are 576 = 512 (kv_lora, also the value) + 64 (rope).
D_QK = 576
D_V = 512
D_ROPE = 64
FP8_ROW_BYTES = 656

KV_FORMATS = ("latent", "fp8-e4m3-flashmla")

#: Optional declarations and their defaults.
DECLARATIONS: dict[str, Any] = {
    "lse_base": "e",
    "returns_lse": True,
    "empty_row": "+inf",
    "sparse_decode": False,
    "invalid_index": "minus-one",
    "attn_sink": False,
    "page_block_sizes": (64,),
    "kv_formats": ("latent",),
    "fp8_scale_format": "pow2",
    "deterministic": False,
    "batch_invariant": False,
    "head_dims": ((D_QK, D_V),),
}

_ALLOWED = {
    "lse_base": ("e", "2"),
    "empty_row": ("+inf", "-inf"),
    "fp8_scale_format": ("pow2", "fp32"),
    "invalid_index": ("minus-one", "out-of-range"),
    "returns_lse": (True, False),
    "sparse_decode": (True, False),
    "attn_sink": (True, False),
}


@dataclasses.dataclass(frozen=True)
class OpCase:
    """What one op test asks of an op, for ``unsupported_reason``.

    ``dtype`` is q's dtype (a torch dtype); ``kv_format`` one of :data:`KV_FORMATS`; ``topk`` the sparse
    top-k (None: dense decode); ``attn_sink`` whether an attention sink is passed; ``rows_without_keys``
    whether some query of the case has no key (a zero-length row, a causal query before its row's first
    key, a sparse row whose every index is invalid, an empty part of a split-KV call).
    """

    batch: int
    s_q: int
    h_q: int
    page_block_size: int
    dtype: Any
    kv_format: str = "latent"
    topk: int | None = None
    attn_sink: bool = False
    causal: bool = False
    device: str = "cpu"
    rows_without_keys: bool = False

    @property
    def sparse(self) -> bool:
        return self.topk is not None

    def describe(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        parts = [f"B={self.batch}", f"s_q={self.s_q}", f"h_q={self.h_q}", f"page={self.page_block_size}", dt,
                 self.kv_format, "causal" if self.causal else "non-causal"]
        if self.topk is not None:
            parts.append(f"sparse top-{self.topk}")
        if self.attn_sink:
            parts.append("attn_sink")
        if self.rows_without_keys:
            parts.append("rows without keys")
        parts.append(self.device)
        return ", ".join(parts)


def declared(op, key: str):
    """The op's declaration ``key`` (its attribute), else the default of :data:`DECLARATIONS`; a value
    outside the allowed ones raises BackendSpecError naming the op and the attribute."""
    value = getattr(op, key, None)
    if value is None:
        return DECLARATIONS[key]
    if isinstance(DECLARATIONS[key], bool) and key in _ALLOWED and not isinstance(value, bool):
        raise BackendSpecError(f"op {getattr(op, 'name', op)!r}: {key} = {value!r} is not True or False")
    if key in _ALLOWED and value not in _ALLOWED[key]:
        raise BackendSpecError(f"op {getattr(op, 'name', op)!r}: {key} = {value!r} is not one of "
                               f"{', '.join(map(repr, _ALLOWED[key]))}")
    if key == "head_dims":
        if value == "any":
            return value
        try:
            pairs = tuple((int(a), int(b)) for a, b in value)
        except (TypeError, ValueError):
            pairs = ()
        if not pairs or any(not 0 < v <= qk for qk, v in pairs):
            raise BackendSpecError(f"op {getattr(op, 'name', op)!r}: head_dims {value!r} must be 'any' or (d_qk, d_v) "
                                   "pairs with 0 < d_v <= d_qk, e.g. ((576, 512),)")
        return pairs
    if key in ("page_block_sizes", "kv_formats"):
        value = tuple(value)
        if key == "kv_formats" and any(f not in KV_FORMATS for f in value):
            raise BackendSpecError(f"op {getattr(op, 'name', op)!r}: kv_formats {value!r} must be among "
                                   f"{', '.join(map(repr, KV_FORMATS))}")
    return value


def takes_head_dims(op, d_qk: int, d_v: int) -> bool:
    """Whether the op declares (d_qk, d_v) among its ``head_dims`` (576 / 512 always, by default)."""
    dims = declared(op, "head_dims")
    return dims == "any" or (int(d_qk), int(d_v)) in dims


def declarations(op) -> dict[str, Any]:
    """Every declaration of the op, defaults filled in (what the report prints)."""
    return {key: declared(op, key) for key in DECLARATIONS}


__all__ = ["OpCase", "BUILTIN_OPS", "DEFAULT_OPS", "DECLARATIONS", "KV_FORMATS", "declared", "declarations",
           "takes_head_dims",
           "D_QK", "D_V", "D_ROPE", "FP8_ROW_BYTES"]
