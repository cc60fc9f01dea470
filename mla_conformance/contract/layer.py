"""The backend contract: what an MLA implementation provides to be checked by this suite.

A backend is any object with::

    name: str
    unsupported_reason(config, *, dtype, device, kv_codec) -> str | None
    new_cache(config, *, batch_size, capacity, dtype, device, kv_codec="none") -> cache
    attend(weights, hidden_states, positions, cache, lengths=None) -> Tensor

``attend``: ``hidden_states`` [B, S, hidden_size] is the attention input (after the layer's input
RMSNorm); ``positions`` [B, S] int64 with ``positions[b, i] == cache.seq_lens[b] + i``; optional
``lengths`` [B] = valid new tokens per row (right padding; outputs at padded slots are ignored; 0 is an idle
row: it appends nothing and its cache does not change). It appends the valid tokens to the cache, attends causally over everything cached for that row, and
returns the output after ``o_proj``, [B, S, hidden_size], in hidden_states' dtype. ``weights`` is an
:class:`mla_conformance.MLAWeights` (a Mapping of HF tensor names, with ``.config``).

A cache has ``batch_size``, ``capacity``, ``seq_lens`` (int64 tensor [B]), ``active_nbytes()`` (bytes
holding the stored tokens, payload plus metadata such as scales), ``allocated_nbytes()`` (every
buffer it allocated) and ``tensors() -> dict[str, Tensor]`` (every buffer, by name: the cache's own
tensors, never copies).

What the suite does around a backend (the rules of :mod:`mla_conformance.kv.caches.measure`):

* **Bytes are measured, not believed.** Every buffer in ``tensors()`` counts, of any dtype. A buffer is
  *bookkeeping* (block table, lengths, page map, a per-cache scale) only by structure: at most
  2 x batch_size x pages + 16 elements, pages = ceil(capacity / page_block_size) (16-token pages when
  the cache declares no ``page_block_size``). Everything else is token storage. Bytes per stored token
  are measured from the tensors (the token storage that no longer holds the suite's poison, below) and
  must equal the declared format's; ``active_nbytes()`` must equal stored tokens x that (plus at most
  the bookkeeping bytes); ``allocated_nbytes()`` must equal the bytes of ``tensors()``.
* **Slots are policy, bytes per token are format.** A cache may allocate more slots than
  ``batch_size x capacity`` (a pool, ``max_seq_len``): reported as ``allocated_slots`` /
  ``slot_overhead``, never a failure. One that preallocates fewer fails. A cache that grows as tokens
  arrive (transformers' DynamicCache) is reported as growing.
* **Unwritten slots are poison.** Right after ``new_cache`` the suite fills every token-storage buffer
  with NaN (integer, uint8 and float8 storage with 0xFF bytes: NaN once read as e4m3, bfloat16 or
  float32) and checks it landed. A backend must never let a slot no token was written to reach its
  output: select (``torch.where``) or read only written slots; 0 x NaN is NaN.
* **Inputs are the backend's own, read-only.** Each run gets its own copy of the weights; changing them,
  or the ``hidden_states`` of a call, in place fails, naming the tensor.
* **Failed vs error.** A check that finds wrong outputs or bytes *fails* the test (AssertionError). A
  backend that raises, or returns something that is not a Tensor of the right shape and dtype, is an
  *error* (:class:`mla_conformance.errors.BackendError`). Both fail the run; reports count them apart.
* **Conventions are reported, not imposed.** Where correct implementations differ (YaRN's cos/sin
  factor when ``mscale != mscale_all_dim``: transformers / DeepSeek-V2 vs DeepSeek-V3's reference),
  the presets avoid the difference and one named test reports which convention a backend follows.

Optional parts are **opt-in, never opt-out**: each applies to a backend only when the backend declares it,
so code written to an older contract gets the same verdict from a newer suite, with explicit skips naming
the declaration that would opt it in. Every later extension is held to this rule. The optional parts:

* ``cache_format`` on the backend or the cache: ``"latent"`` (default), ``"expanded"`` or
  ``"latent+indexer"`` (DeepSeek Sparse Attention: the latent plus one indexer key of ``index_head_dim``
  elements per token); byte checks hold the cache to the per-token formula of the format it declares
  (:func:`mla_conformance.checks.format_bytes_per_token`).
* DeepSeek Sparse Attention (V3.2): a backend opts in by *declaring* it, ``sparse_attention = "dsa"`` on
  the backend (or ``cache_format = "latent+indexer"`` on the backend). A backend that declares neither is
  never handed a config with ``index_topk`` set: every DSA test skips for it with a sentence naming the
  declaration (:func:`declaration_reason`), whatever its ``unsupported_reason`` says. A declaring backend may
  still decline a DSA config in ``unsupported_reason``. Its
  ``attend`` scores every cached token with the lightning indexer, keeps the top-min(index_topk, len)
  per query (causal) and attends over those only. Optionally the cache (or the backend) exposes the last
  ``attend`` call's selection as ``last_topk_indices``: int64 [B, S, index_topk], key slots (positions)
  by any order, unused slots -1; the DSA tests then check the selected set against the oracle's. Optionally
  also ``last_indexer_scores``: float32 [B, S, T], the lightning indexer's score of every key position
  0..T-1 for each query of the last call, -inf where the key is masked (future, past the row); the DSA tests
  then check them against the float64 oracle (the ``indexer-scores`` rows of checks.TOLERANCES).
* ``kv_codec`` values other than ``"none"`` (quantized caches): a backend that cannot do one says so
  in ``unsupported_reason`` and the suite skips with that sentence.
* ``supports_paging = True`` with ``new_cache(..., page_block_size=N)`` (paged latent cache).
* DeepSeek-V4 attention: a backend opts in with ``deepseek_v4 = True``; it is then also handed
  :class:`mla_conformance.model.v4_config.V4Config` layers (with :class:`~mla_conformance.model.v4_config.V4Weights`),
  and declines the MLA configs it does not implement in ``unsupported_reason`` (and MLA backends never see a V4
  config). The V4 contract (the same four members; the cache's ``v4_layout``) is docs/deepseek-v4.md's.
* ``diagnose(weights) -> str | None``: a known cause, appended to a numerics failure's message
  (hf-transformers uses it to say when a transformers release drops YaRN's mscale^2).

A backend is named on the command line by a *spec*: a registered name (``reference-absorbed``), a
``package.module:attr`` or a ``path/to/file.py:attr``, where attr is a class (instantiated without
arguments) or an instance; or ``op:SPEC``, where SPEC is an *op* spec (:mod:`mla_conformance.contract.op`: a
built-in op such as ``reference-op`` or ``flashmla``, ``package.module:attr``, ``path/to/file.py:attr``):
the op wrapped by :class:`mla_conformance.impl.ops.layer.OpBackend` (projections, RoPE and both absorptions in
torch, the attention in ``op.decode``), named ``op:<op name>``. One op implementation thus runs both the
op suite (``--mla-op SPEC``) and this one (``--mla-backend op:SPEC``). The prefix ``op:`` is reserved: a
module named ``op`` cannot be given as ``op:attr``.
"""

from __future__ import annotations


from mla_conformance.errors import BackendError, BackendSpecError

#: Built-in backends: name -> "module:attr".
BUILTINS: dict[str, str] = {
    "reference-naive": "mla_conformance.impl.backends.reference:ReferenceNaive",
    "reference-absorbed": "mla_conformance.impl.backends.reference:ReferenceAbsorbed",
    "hf-transformers": "mla_conformance.impl.backends.hf:HFTransformers",
    "flashmla": "mla_conformance.impl.backends.flashmla:FlashMLA",
    "reference-dsa": "mla_conformance.impl.backends.reference:ReferenceDSA",
    "flashmla-sparse": "mla_conformance.impl.backends.flashmla:FlashMLASparse",
    "reference-v4": "mla_conformance.impl.backends.v4:ReferenceV4",
    # across ranks (mla_conformance.contract.distributed; suites/test_distributed.py); not default backends
    "reference-tp": "mla_conformance.impl.backends.distributed:ReferenceTP",
    "reference-dcp": "mla_conformance.impl.backends.distributed:ReferenceDCP",
    "reference-tp-dcp": "mla_conformance.impl.backends.distributed:ReferenceTPDCP",
}

#: Backends a default run checks.
DEFAULT_BACKENDS = ("reference-naive", "reference-absorbed", "hf-transformers", "reference-dsa", "reference-v4")

REQUIRED_METHODS = ("unsupported_reason", "new_cache", "attend")

#: Cache formats a backend may declare (``cache_format``).
CACHE_FORMATS = ("latent", "expanded", "latent+indexer")


#: Sparse attention schemes a backend may declare (``sparse_attention``).
SPARSE_ATTENTION = ("dsa",)


def declares_dsa(backend) -> bool:
    """Whether the backend declares DeepSeek Sparse Attention: ``sparse_attention = "dsa"`` or
    ``cache_format = "latent+indexer"`` on the backend (a value outside the known ones raises BackendSpecError)."""
    kind = getattr(backend, "sparse_attention", None)
    if kind is not None and kind not in SPARSE_ATTENTION:
        raise BackendSpecError(f"backend {getattr(backend, 'name', backend)!r}: sparse_attention {kind!r} is not "
                               f"one of {', '.join(map(repr, SPARSE_ATTENTION))} (or None: dense MLA)")
    return kind == "dsa" or getattr(backend, "cache_format", None) == "latent+indexer"


def is_v4(config) -> bool:
    """Whether ``config`` is a DeepSeek-V4 layer (a V4Config: ``attention_kind == "deepseek-v4"``)."""
    return getattr(config, "attention_kind", None) == "deepseek-v4"


def declares_v4(backend) -> bool:
    """Whether the backend declares DeepSeek-V4 attention: ``deepseek_v4 = True`` on the backend."""
    return getattr(backend, "deepseek_v4", False) is True


def declaration_reason(backend, config) -> str | None:
    """The skip sentence when ``config`` needs an optional part the backend does not declare (DeepSeek-V4
    attention, a :class:`mla_conformance.model.v4_config.V4Config`, without ``deepseek_v4 = True``; DeepSeek
    Sparse Attention, ``index_topk`` set, without ``sparse_attention = "dsa"``); None when the backend may be
    asked (its own ``unsupported_reason`` decides next)."""
    if is_v4(config):
        if declares_v4(backend):
            return None
        return (f"{getattr(backend, 'name', backend)} does not declare DeepSeek-V4 attention; this config is a V4 "
                "layer (shared-KV MQA with a sliding window, a sink and compressed entries). A backend opts in with "
                "deepseek_v4 = True (docs/deepseek-v4.md)")
    if getattr(config, "index_topk", None) is None or declares_dsa(backend):
        return None
    return (f"{getattr(backend, 'name', backend)} does not declare DeepSeek Sparse Attention; this config has "
            f"index_topk {config.index_topk} (a lightning indexer selects the keys each query attends to). A "
            "backend opts in with sparse_attention = \"dsa\" (or cache_format = \"latent+indexer\")")


def support_reason(backend, config, *, dtype, device, kv_codec="none") -> str | None:
    """Why the backend is not run on this combination, as a sentence: an optional part the config needs and the
    backend does not declare (:func:`declaration_reason`), else the backend's own ``unsupported_reason``
    prefixed with its name; None to run it. A raising ``unsupported_reason`` is a BackendError."""
    undeclared = declaration_reason(backend, config)
    if undeclared:
        return undeclared
    try:
        reason = backend.unsupported_reason(config, dtype=dtype, device=device, kv_codec=kv_codec)
    except Exception as exc:
        raise BackendError(f"{getattr(backend, 'name', backend)}: unsupported_reason() raised "
                           f"{type(exc).__name__}: {exc}") from exc
    return f"{backend.name}: {reason}" if reason else None


def dense_only_reason(name: str, config) -> str | None:
    """The sentence of a dense-MLA backend asked for a DeepSeek Sparse Attention config (index_topk set)."""
    if getattr(config, "index_topk", None) is None:
        return None
    return (f"{name} implements dense MLA; this config has DeepSeek Sparse Attention (index_topk "
            f"{config.index_topk}: a lightning indexer selects the keys each query attends to), which it does "
            "not implement (reference-dsa does)")


def declared_on(backend, cache, attr: str, allowed, default):
    """A declaration ``attr`` on the cache, else on the backend, else ``default``; a value outside ``allowed``
    raises BackendSpecError naming the backend, the attribute and the allowed values."""
    for owner in (cache, backend):
        value = getattr(owner, attr, None) if owner is not None else None
        if value is not None:
            if value not in allowed:
                raise BackendSpecError(f"backend {getattr(backend, 'name', backend)!r}: {attr} {value!r} "
                                       f"is not one of {', '.join(map(repr, allowed))}")
            return value
    return default


def cache_format_of(backend, cache=None) -> str:
    """The cache format a backend declares: on the cache, else on the backend, else "latent"."""
    return declared_on(backend, cache, "cache_format", CACHE_FORMATS, "latent")


def supports_paging(backend) -> bool:
    return bool(getattr(backend, "supports_paging", False))
