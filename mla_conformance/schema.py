"""The results' declared schema: every section a conformance test's rows belong to and every figure key a
check records, each with its meaning and unit. Checks write figures under these keys (the plugin's
``mla_figures`` fixture yields a :class:`Figures`, which refuses any other key); the report's renderers read them
and nothing else (never the checks' tables or the config).

Pure python (no torch, no pytest): ``merge`` and the renderers import it without the numerics, the plugin without
the report (a package of its own, below both: tests/layers.py).

To add a figure: one line in :data:`FIGURES` (kept sorted), ``"key": "meaning (unit)"``. A key with ``{n}``
stands for that key with any decimal number there (``row{n}_vs_float64``: ``row0_vs_float64``, ...).
Nested dicts (a figure whose value is a dict) are one figure: only the top-level key is declared.
"""

from __future__ import annotations

import re
from typing import Any, Iterable

#: section (a test's ``mla_section`` marker) -> what its rows are. Kept sorted.
SECTIONS: dict[str, str] = {
    "cache-bytes": "bytes per stored token measured in the cache's own tensors against the format's formula",
    "checkpoint": "seed 000's prefill + decode on the layer-1 input of the embedded model or --checkpoint",
    "codec-attention": "attention output error of each KV codec against codec none and the float64 reference",
    "codec-bytes": "bytes per token of each KV codec (payload, metadata) measured and by formula",
    "conventions": "the YaRN RoPE convention a backend matches (transformers or DeepSeek-V3)",
    "deepseek-v4": "DeepSeek-V4 attention (window, CSA, HCA, sink): output against the float64 V4 oracle per layer type, decode == prefill, cache bytes per component",
    "decode-timing": "decode step timings (clock readings: timings.json, never conformance.json)",
    "distributed": "the layer across W spawned ranks (TP, DCP, TP x DCP): each rank's output against the single-process float64 reference, its cache bytes against its tokens",
    "dsa": "DeepSeek Sparse Attention: indexer scores, top-k selection, sparse output, cache bytes",
    "engine": "a serving engine (--mla-engine) on the pinned models: greedy tokens and log-probabilities against the float64 reference, prefix-cache reuse, chunked prefill, FP8 cache, KV bytes from its own tensors",
    "golden": "greedy generation on the embedded tiny model against the pinned answers and snapshot",
    "golden-codec": "greedy generation accuracy with each KV codec",
    "incremental": "prefill + single-token decode steps equal one prefill of all the tokens",
    "layer_generated": "generated (hypothesis) cases of the layer contract",
    "layer_padding": "padded batches through the layer contract: idle rows (lengths 0), multi-token steps",
    "numerics": "layer output against the float64 expanded reference, per preset, scenario and dtype",
    "numerics-float16": "layer output in float16 against the float64 expanded reference",
    "op-dcp": "an op under decode context parallelism: W ranks' partials merged by lse against the unsharded oracle; the write on owners' shards",
    "op-determinism": "an op's bitwise determinism and batch invariance (when it declares them)",
    "op-fp8": "an op on FP8 caches against the dequantized oracle; the FP8 scale format",
    "op-numerics": "an op's out and lse against the float64 oracle",
    "op-out-buffers": "an op's decode into caller-owned out= / lse= buffers, contiguous and strided (out_buffers)",
    "op-padding": "an op on batches padded as for a captured CUDA graph (rows of cache_seqlens 0)",
    "op-poison": "an op never reads poisoned pages (NaN tails, invalid block ids, canaries)",
    "op-replay": "an op called as a graph replays: the same tensors refilled with every batch",
    "op-shapes": "an op over multi-token decode, head counts, empty rows, page sizes, strides",
    "op-sparse": "a sparse op's top-k indices, invalid indices, attention sink",
    "op-speculative": "an op's causal multi-token decode at any q_len over an engine's persistent tables",
    "op-split-kv": "two partial op calls merged by LSE equal the whole",
    "op_composition": "ops composed (e.g. prefill then decode) against the oracle",
    "op_generated": "generated (hypothesis) cases of the op contract",
    "op_merge": "an op's merge of partial (out, lse) states",
    "op_prefill": "a prefill op's out and lse against the float64 oracle",
    "op_sparse_prefill": "a sparse prefill op's out and lse against the float64 oracle",
    "op_write": "an op's write of new tokens into a paged cache",
    "paged": "a paged cache equals the contiguous one; unused pages never reach the outputs",
    "v2-lite-cache-probe": "seed 000's cache probe at DeepSeek-V2-Lite dims in BF16",
}

#: figure key -> meaning (unit). One flat dict, sorted by key: append a line to add one.
FIGURES: dict[str, str] = {
    "accuracy": "fraction of the pinned answer tokens the greedy generation produced (0..1)",
    "active_nbytes": "the cache's own active_nbytes() after the run (bytes)",
    "all_tokens": "error metrics over every token (dict: max_abs, rel_fro, ...)",
    "allocated_nbytes": "the cache's own allocated_nbytes() (bytes)",
    "allocated_slots": "token slots the cache's storage holds: storage bytes / measured bytes per token (tokens)",
    "attention": "attention output error of the codec against codec none (dict: rel_fro, max_rel, ...)",
    "backend": "the backend's name",
    "bandwidth_fraction": "achieved GB/s over the measured memory bandwidth (ratio)",
    "baseline_vs_float64": "rel Frobenius error of codec none against the float64 reference (ratio)",
    "batch": "rows in the batch (count)",
    "bookkeeping": "the cache tensors counted as bookkeeping, not token storage (list of names)",
    "bookkeeping_bytes": "bytes of a V4 cache's bookkeeping tensors (v4_layout) after the run (bytes)",
    "bound": "the codec's stated error bound (dict: rel_fro, max_rel)",
    "buffer_layout": "the layout of the caller-owned out= / lse= buffers an op decoded into (name: checks.op.calls.LAYOUTS)",
    "bytes_per_step": "bytes a decode step reads: cache + weights (bytes)",
    "bytes_per_token": "bytes per stored token per layer measured in the cache tensors (bytes; = measured_bytes_per_token)",
    "cache_active_nbytes": "the cache's active_nbytes() after generation (bytes)",
    "cache_bytes": "cache bytes a decode step reads (bytes)",
    "cache_format": "the cache format the backend declared (latent, expanded, latent+indexer)",
    "cache_redundancy": "tokens stored over all ranks divided by the case's tokens: W under TP, 1 under DCP (ratio)",
    "cache_storage_checked": "whether each call's token-storage bytes were compared (False: a growing cache) (bool)",
    "cache_written_by": "who filled the composition's latent cache: the op's write, or the suite",
    "capacity": "token capacity requested per row (tokens)",
    "case": "one-line description of an op case (shapes, dtype, format, causality, device)",
    "check": "what an op row checked (one line)",
    "chunks": "context chunks of the composition's chunked prefill (count)",
    "compressed_bytes": "bytes the V4 cache's compressed entries hold after the run, measured (bytes)",
    "context": "cached tokens per row (tokens)",
    "cosine_diff": "1 - cosine similarity of output and reference (dimensionless)",
    "dcp": "the op's dcp convention: how a rank's call receives its shard (local, global)",
    "dcp_combine_checked": "whether the op's own dcp_combine of the ranks' partials was held to the oracle too (bool)",
    "dcp_empty_shards": "rows of a DCP case that some rank holds no key of, summed over ranks (count)",
    "dcp_interleave": "DCP interleave S: token g lives on rank (g // S) % W (tokens)",
    "dcp_keys_per_rank": "keys each rank held of a DCP case (list of counts, rank order)",
    "dcp_lse_base": "the base the DCP partials' lse were merged in (e or 2)",
    "dcp_tokens_per_rank": "tokens each rank wrote under DCP (list of counts, rank order)",
    "dcp_world_size": "DCP world size W: ranks a case's tokens are sharded over (count)",
    "decode": "error metrics of the decode token (dict: max_abs, mean_abs, p99_abs, ...)",
    "dense_bytes": "bytes a dense decode step reads (bytes)",
    "dense_flops": "FLOPs of the dense decode step (count)",
    "dense_median_s": "median dense decode step time (s)",
    "dense_over_sparse_bytes": "dense over sparse bytes read per step (ratio)",
    "dense_over_sparse_time": "dense over sparse median step time (ratio)",
    "dtype": "the compute / cache dtype's name (float32, bfloat16, ...)",
    "engine": "an engine configuration's row (dict: spec, model, variant, tokens_matched, tokens_compared, ties, worst_logprob_delta, bytes_per_token_per_layer, wall_s, peak_rss_bytes, died, ...)",
    "exact_fraction": "fraction of output elements equal to the reference (0..1)",
    "expanded_dim": "elements per token per layer of the expanded (per-head K/V) cache at the row's preset (count)",
    "expected_compressed_bytes": "the V4 compressed entries' bytes by DeepSeek's layout: n // ratio x head_dim x element size (bytes)",
    "expected_indexer_bytes": "the V4 CSA indexer keys' bytes: n // ratio x index_head_dim x element size (bytes)",
    "expected_window_bytes": "the V4 window ring's bytes by DeepSeek's layout: min(n, sliding_window) x head_dim x element size (bytes)",
    "extra_page_block_size": "tokens per page of sparse decode's second cache (extra_k_cache) (tokens)",
    "fill": "fraction of the cache's slots holding tokens during the timed steps (0..1)",
    "flop_model": "how the FLOPs were counted (one line)",
    "flops": "FLOPs of one decode step (count)",
    "format_bytes_per_token": "the declared format's bytes per token per layer by formula (bytes; = formula_bytes_per_token)",
    "formula_bytes_per_token": "the declared format's bytes per token per layer by formula (bytes)",
    "formula_expanded_bytes_per_token": "the expanded format's bytes per token per layer by formula at the row's preset and dtype (bytes)",
    "formula_indexer_bytes_per_token": "the DSA indexer's bytes per token per layer by formula (bytes)",
    "formula_latent_bytes_per_token": "the latent format's bytes per token per layer by formula at the row's preset and dtype (bytes)",
    "gb_per_s": "bytes read per step over the median step time (GB/s)",
    "generated_case": "the minimal (shrunk) generated case that failed, or the replayed one: the line --mla-case reads (text)",
    "generated_declined": "generated cases the implementation declined with its unsupported_reason (count)",
    "generated_examples": "generated cases checked by the test (count)",
    "generated_examples_per_stratum": "generated cases checked per stratum of the property (dict: stratum -> count)",
    "generated_profile": "the hypothesis profile of the generated cases (mla-conformance or mla-conformance-thorough)",
    "generated_property": "the generated-case property (heads, pages, mtp, long_rows, batch, sparse, mixed, layer)",
    "generated_stratum": "the stratum (geometry class) of the property whose case failed (text)",
    "generated_worst_case": "the passing generated case closest to its bound (text, a --mla-case line)",
    "generated_worst_error_over_bound": "the largest error over its bound among the generated cases: op out_error_over_bound, layer rel_fro over its tolerance (ratio)",
    "gflop_per_s": "FLOPs per step over the median step time (GFLOP/s)",
    "global_bytes": "the codec's per-cache (not per-token) metadata (bytes)",
    "golden_model": "the fixture model a golden generation ran: tiny-mla, or tiny-mla-576 for a backend taking only DeepSeek's 576 / 512 latent",
    "index_topk": "keys the DSA indexer selects per query (count)",
    "indexer_bytes": "bytes the V4 cache's CSA indexer keys hold after the run, measured (bytes)",
    "indexer_format": "the DSA indexer cache format the backend declared",
    "kpe": "how the codec stores the RoPE part k_pe (one word)",
    "kv_codec": "the KV codec's name (none: unquantized)",
    "latent_dim": "elements per token per layer of the latent cache at the row's preset (count)",
    "layers": "hidden layers of the row's preset, the factor of the model-wide figures (count)",
    "layout": "where a padded batch's padding rows are: after the real rows or between them",
    "likely_cause": "the known bug class whose oracle matches the output far better (one line)",
    "longest_row": "keys of a padded batch's longest row (count)",
    "lse_base": "the base the op's lse was read in (e or 2)",
    "lse_compared": "whether the op's lse was compared (false: the op declares returns_lse = False)",
    "lse_differing_values": "lse values differing between two calls that must be bitwise equal (count)",
    "lse_error_over_bound": "max over queries of |lse - oracle lse| / its bound (ratio; above 1 fails)",
    "lse_max_abs": "max |lse - oracle lse| over queries with keys, natural log (nats)",
    "lse_max_abs_difference": "max |difference| of lse between two calls that must be bitwise equal (nats)",
    "magnitude": "the scale of the FP8 sweep's inputs (factor)",
    "margin_rel_fro": "tolerance_rel_fro / rel_fro: how many times the error could grow before failing (ratio)",
    "max_abs": "max |out - ref| (output units)",
    "max_logits_max_abs": "max |max_logits - oracle| over queries with a valid index, sparse prefill (logit units)",
    "max_rel": "max |out - ref| / rms(ref) (dimensionless)",
    "mean_abs": "mean |out - ref| (output units)",
    "measured_bandwidth_gb_per_s": "memory bandwidth measured on the device (GB/s)",
    "measured_bytes_per_buffer": "measured bytes per stored token per cache tensor (dict name -> bytes)",
    "measured_bytes_per_token": "bytes per stored token per layer written into the cache tensors (bytes)",
    "median_s": "median decode step time (s)",
    "metadata": "the codec's scale / zero-point bytes per token per layer by formula (bytes)",
    "mismatched_fields": "written token fields (payload, scales, k_pe, row) differing from the oracle's encoding (count)",
    "model_bytes_per_token": "the codec's formula x the preset's layers (bytes per token, whole model)",
    "nan_elements_left_in_cache": "NaN elements left in unused pages after the run (count)",
    "neighbours_over_tolerance": "worst rel_fro of a row vs the same row without idle rows / its tolerance (ratio)",
    "op": "the op's name",
    "out_differing_values": "out values differing between two calls that must be bitwise equal (count)",
    "out_error_over_bound": "max over out elements of |out - oracle| / its bound (ratio; above 1 fails)",
    "out_max_abs": "max |out - oracle| over queries with keys (output units)",
    "out_max_abs_difference": "max |difference| of out between two calls that must be bitwise equal (output units)",
    "out_rel_fro": "||out - oracle||_F / ||oracle||_F over queries with keys (dimensionless)",
    "own_selection_queries": "queries compared against the oracle with the backend's own top-k selection (count)",
    "own_selection_rel_fro": "rel Frobenius error with the backend's own top-k selection (dimensionless)",
    "p99_abs": "99th percentile of |out - ref| (output units)",
    "padding_fill": "what a padded batch's padding rows' block-table rows hold, in order: -1, 0, stale ids (poisoned, live)",
    "padding_positions": "the rows of a padded batch that are padding (cache_seqlens 0)",
    "padding_rows": "padding rows of a batch (count)",
    "padding_rows_compared": "whether padding rows' out and lse were held (false: the op declares them undefined)",
    "page_block_size": "tokens per page of the paged cache (tokens)",
    "payload": "the codec's value bytes per token per layer by formula (bytes)",
    "preallocated": "whether the cache allocated its storage up front (false: it grows with the tokens)",
    "preset": "the MLAConfig preset of the row",
    "probe_scale": "the FP8 scale the op stored for the probe tile",
    "quant_study": "seed 001's printed size of a scheme against the codec's formula (dict)",
    "queries": "queries in the case (count)",
    "queries_checked": "queries whose top-k selection was checked (count)",
    "queries_without_keys": "queries with no key to attend (count)",
    "rank_cache_bytes": "cache bytes each rank wrote, measured in its tensors (list of bytes, rank order)",
    "rank_max_rel": "each rank's max |out - ref| / rms(ref) against the single-process float64 reference (list)",
    "rank_rel_fro": "each rank's rel Frobenius error against the single-process float64 reference (list)",
    "rank_tokens": "tokens each rank's cache holds: its written bytes / bytes per token (list)",
    "ratio_vs_expanded": "expanded BF16 bytes over the measured bytes per token (ratio)",
    "ratio_vs_latent": "unquantized latent bytes over the measured bytes per token (ratio)",
    "reason": "why the codec's bound is what it is (one line)",
    "ref_rms": "rms of the reference output (output units)",
    "rel_fro": "||out - ref||_F / ||ref||_F (dimensionless)",
    "rel_fro_deepseek_v3": "rel Frobenius error against the DeepSeek-V3 RoPE convention's oracle (dimensionless)",
    "rel_fro_of_scores": "rel Frobenius error of the indexer scores against the oracle (dimensionless)",
    "rel_fro_over_tolerance": "layer rel_fro over the dtype's rel_fro tolerance (ratio; above 1 fails)",
    "rel_fro_transformers": "rel Frobenius error against the transformers RoPE convention's oracle (dimensionless)",
    "replay_batches": "real rows of each call of a graph-replay sequence, on the same tensors (counts)",
    "replay_bitwise": "whether each replayed call was held bitwise to a fresh call (the op declares deterministic)",
    "replay_calls": "calls of a graph-replay sequence on the same tensors (count)",
    "reproducer": "the command replaying exactly the failing generated case (pytest ... --mla-case '...')",
    "requested_slots": "batch x capacity token slots requested (tokens)",
    "resets_context": "whether each timed step saw the same context (the cache rewound between steps)",
    "rope_convention": "the RoPE convention the backend matched (transformers, deepseek-v3, neither)",
    "row{n}_vs_float64": "rel Frobenius error of batch row n against the float64 reference (dimensionless)",
    "scale_format": "the FP8 scale format the op stored (pow2, float)",
    "scores_checked": "indexer scores compared (count)",
    "slot_overhead": "allocated_slots / requested_slots (ratio)",
    "source": "where the probe's input came from (fixture or checkpoint)",
    "sparse_bytes": "bytes a sparse decode step reads (bytes)",
    "sparse_fill": "fraction of the sparse cache's slots holding tokens (0..1)",
    "sparse_flops": "FLOPs of the sparse decode step (count)",
    "sparse_median_s": "median sparse decode step time (s)",
    "state_bytes": "bytes of the V4 compressors' open-window state after the run, measured (reported, not held) (bytes)",
    "steps": "steps of the composition taken and checked: prefills and merges (count)",
    "stray_bytes": "cache bytes a write changed outside the spans of the tokens it was given (count; above 0 fails)",
    "tensors": "bytes of each tensor the cache's tensors() lists (dict name -> bytes)",
    "tie_row": "the tolerance row used to call two indexer scores tied",
    "tie_swaps": "top-k swaps between tied keys, allowed (count)",
    "tied_queries_not_compared": "queries left out: their top-k selection is a tie within precision (count)",
    "tokens": "tokens stored in the cache (count)",
    "tolerance": "the name of the tolerance row the op case was held to",
    "tolerance_acc": "the op tolerance row's accumulation term (relative)",
    "tolerance_dot": "the op tolerance row's dot-product term (relative)",
    "tolerance_max_rel": "the max_rel bound the row was held to (dimensionless)",
    "tolerance_p_round": "the op tolerance row's softmax rounding term (relative)",
    "tolerance_rel_fro": "the rel_fro bound the row was held to (dimensionless)",
    "tolerance_row": "the name of the tolerance row the DSA scores were held to",
    "tolerance_u_out": "unit roundoff of the op's out dtype (relative)",
    "unattributed_storage_bytes": "storage bytes left over after whole slots (bytes)",
    "weight_bytes": "weight bytes a decode step reads (bytes)",
    "window_bytes": "bytes the V4 cache's window component holds after the run, measured from its tensors (bytes)",
    "written_nbytes": "bytes of token storage the run wrote (bytes)",
    "zero_tile_scale": "the FP8 scale the op stored for an all-zero tile",
}

#: The values of the ``rope_convention`` figure: the YaRN RoPE conventions the reference and its oracles implement
#: (mla_conformance.model.reference), each with what it means. They differ only when a config's ``mscale`` !=
#: ``mscale_all_dim`` (every published DeepSeek config has the two equal, so the factor is 1 there); the softmax
#: scale, 1/sqrt(qk_head_dim) x mscale(factor, mscale_all_dim)^2, is the same in both.
ROPE_CONVENTIONS: dict[str, str] = {
    "transformers": "transformers / DeepSeek-V2 modeling: cos/sin x mscale(factor, mscale) / "
                    "mscale(factor, mscale_all_dim)",
    "deepseek-v3": "DeepSeek-V3 reference inference/model.py: no cos/sin factor",
}

_PATTERNS = [re.compile(re.escape(k).replace(re.escape("{n}"), r"\d+") + r"\Z") for k in FIGURES if "{n}" in k]


def is_declared(key: Any) -> bool:
    """``key`` is a figure :data:`FIGURES` declares (a ``{n}`` key stands for any number there)."""
    return isinstance(key, str) and (key in FIGURES or any(p.match(key) for p in _PATTERNS))


class UndeclaredFigure(KeyError):
    """A figure key :data:`FIGURES` does not declare (its message is one line, without KeyError's quotes)."""

    def __str__(self) -> str:
        return str(self.args[0])


def _undeclared(key: Any) -> UndeclaredFigure:
    return UndeclaredFigure(f"figure {key!r} is not declared: add it with its meaning and unit to FIGURES in "
                            "mla_conformance/schema.py")


class Figures(dict):
    """The dict a test fills with figures (the ``mla_figures`` fixture): only keys :data:`FIGURES` declares.

    A plain dict of it (``dict(figures)``) is what travels (JSON, xdist's serializer takes no subclass)."""

    def __init__(self, *args, **kwargs):
        super().__init__()
        self.update(*args, **kwargs)

    def __setitem__(self, key, value) -> None:
        if not is_declared(key):
            raise _undeclared(key)
        super().__setitem__(key, value)

    def update(self, *args, **kwargs) -> None:
        if len(args) > 1:
            raise TypeError(f"update expected at most 1 positional argument, got {len(args)}")
        items: Iterable = ()
        if args:
            other = args[0]
            items = other.items() if hasattr(other, "items") else other
        for key, value in [*items, *kwargs.items()]:
            self[key] = value

    def setdefault(self, key, default=None):
        if key not in self:
            self[key] = default
        return self[key]

    def __ior__(self, other):
        self.update(other)
        return self

    def copy(self) -> Figures:
        return Figures(self)
