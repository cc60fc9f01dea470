"""DeepSeek-V4's KV cache per sequence, beside DeepSeek-V3's MLA and V3.2's DSA caches (``mla-conformance budget
--v4``), and the ratio to V3.2 that DeepSeek's claim states ("at 1M tokens V4-Pro needs 10% of V3.2's KV cache,
V4-Flash 7%").

Pure arithmetic on :class:`~mla_conformance.model.v4_config.V4Config` presets. What one V4 layer holds for one
sequence of ``T`` tokens (DeepSeek's V4 ``inference/model.py``: ``Attention.kv_cache`` is ``window + T // ratio``
rows of ``head_dim``; ``Indexer.kv_cache`` ``T // ratio`` rows of ``index_head_dim``; ``Compressor.kv_state`` and
``score_state`` float32 ``[coff * ratio, coff * width]`` each, ``coff`` 2 for CSA's overlapping compressor, else 1):

* window: ``min(T, sliding_window)`` rows of ``head_dim`` (a ring: constant once ``T`` passes the window);
* compressed entries: ``T // ratio`` rows of ``head_dim`` (ratio 4 in CSA layers, 128 in HCA layers, none in
  window-only layers);
* indexer keys (CSA layers): ``T // ratio`` rows of ``index_head_dim``;
* compressor state (CSA and HCA layers): the open window, ``2 x (coff * ratio) x (coff * head_dim) x 4`` bytes,
  plus the indexer's compressor at ``index_head_dim`` in CSA layers; constant in ``T``, float32 in every format.

A row's bytes come from their owners: bf16 ``head_dim x 2`` (:data:`~mla_conformance.kv.budget.DTYPE_BYTES`);
FP8, FlashMLA's MODEL1 row (:mod:`mla_conformance.kv.model1`, 584 B at head_dim 512 = 448 + 64); indexer keys bf16
or V3.2's FP8 block-128 key (:func:`mla_conformance.kv.budget.dsa_bytes` at V4's ``index_head_dim``). The V3 / V3.2
rows are :func:`mla_conformance.kv.budget.budget`'s own figures for those presets.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

from mla_conformance.errors import MLAInputError
from mla_conformance.kv.budget import DTYPE_BYTES, budget, codec_rows, dsa_bytes, fmt_bytes
from mla_conformance.model.config import MLAConfig
from mla_conformance.model.v4_config import CSA, HCA, LAYER_TYPES, SHORT, V4Config

#: The V4 models compared, with the names the tables use.
V4_MODELS = {"deepseek-v4-flash": "V4-Flash", "deepseek-v4-pro": "V4-Pro"}
#: The dense-MLA and DSA models they are compared with (the budget's own presets, 61 layers each).
V3_MODELS = {"deepseek-v3": "V3 MLA", "deepseek-v3.2": "V3.2 DSA"}
#: Contexts of the tables: 128k and 1M tokens (V4's max_position_embeddings, 1,048,576).
CONTEXTS = (128 * 1024, 1024 * 1024)
CONTEXT_NAMES = {128 * 1024: "128k", 1024 * 1024: "1M"}

#: The V4 cache formats. The compressor state is float32 in all of them.
FORMATS: dict[str, str] = {
    "bf16": "window rows and compressed entries head_dim x bf16, indexer keys index_head_dim x bf16 "
            "(DeepSeek's V4 inference/model.py stores both in bf16)",
    "fp8": "window rows and compressed entries in FlashMLA's MODEL1 FP8 row (kv.model1), indexer keys bf16 as "
           "DeepSeek's reference stores them",
    "fp8+fp8-indexer": "MODEL1 FP8 rows, indexer keys float8 e4m3 + one float32 scale per 128 values (V3.2's FP8 "
                       "indexer key, kv.budget.dsa_bytes)",
}
#: The V3 / V3.2 row each V4 format is set beside: V3's budget row key, V3.2's dsa block.
V3_ROW = {"bf16": "mla_latent", "fp8": "fp8-e4m3-flashmla", "fp8+fp8-indexer": "fp8-e4m3-flashmla"}
V32_BLOCK = {"bf16": "cache_dtype", "fp8": "fp8", "fp8+fp8-indexer": "fp8"}

#: DeepSeek's claim (DeepSeek-V4 release: "at 1M tokens V4-Pro needs 10% of V3.2's KV cache, V4-Flash 7%").
CLAIM_CONTEXT = 1024 * 1024
CLAIM = {"deepseek-v4-pro": 0.10, "deepseek-v4-flash": 0.07}
#: The claim states whole percents: a measured ratio within half a point of it agrees.
CLAIM_TOLERANCE = 0.005
#: (V4 format, V3.2 format, like-for-like) pairings of the claim comparison; FP8 vs FP8 is the like-for-like one:
#: both caches in the FP8 form FlashMLA serves them in, the indexer keys in the same FP8 block-128 key on both sides.
PAIRINGS = (("fp8+fp8-indexer", "fp8", True), ("bf16", "bf16", False), ("fp8", "fp8", False))
PAIRING_NOTES = {
    ("fp8+fp8-indexer", "fp8"): "the like-for-like pairing: both caches in their FlashMLA FP8 rows (V4: MODEL1, "
                                "V3.2: fp8-e4m3-flashmla), the same FP8 indexer key on both sides",
    ("bf16", "bf16"): "both in bf16, indexer keys included",
    ("fp8", "fp8"): "V4's indexer keys in bf16 as DeepSeek's V4 reference stores them, V3.2's in FP8",
}


# ---------------------------------------------------------------------------------------- rows
def _layer(config: V4Config, layer_type: str) -> V4Config:
    if layer_type not in LAYER_TYPES:
        raise MLAInputError(f"{layer_type!r} is not a V4 layer type ({', '.join(LAYER_TYPES)})")
    return config.first_layer_of(layer_type)


def row_bytes(config: V4Config, fmt: str) -> dict[str, int]:
    """Bytes of one window / compressed row (``head_dim`` wide) and of one indexer key in format ``fmt``."""
    if fmt not in FORMATS:
        raise MLAInputError(f"unknown V4 cache format {fmt!r}; known: {', '.join(FORMATS)}")
    keys = indexer_key_bytes(config)
    if fmt == "bf16":
        return {"row": config.head_dim * DTYPE_BYTES["bfloat16"], "indexer_key": keys["bf16"]}
    from mla_conformance.kv import model1  # imports torch

    if (config.head_dim, config.qk_rope_head_dim) != (model1.D_QK, model1.D_ROPE):
        raise MLAInputError(f"the MODEL1 FP8 row is {model1.D_QK} = {model1.D_NOPE} + {model1.D_ROPE} wide; this config's "
                            f"head_dim is {config.head_dim} (rope {config.qk_rope_head_dim})")
    return {"row": model1.bytes_per_token()["total"], "indexer_key": keys["fp8" if fmt == "fp8+fp8-indexer" else "bf16"]}


def indexer_key_bytes(config: V4Config) -> dict[str, int]:
    """One indexer key at V4's ``index_head_dim``, bf16 and FP8: the DSA budget's indexer column
    (:func:`~mla_conformance.kv.budget.dsa_bytes`, V3.2's lightning-indexer key formats) at that width."""
    v32 = dataclasses.replace(MLAConfig.preset("deepseek-v3.2"), index_head_dim=config.index_head_dim,
                              qk_rope_head_dim=config.qk_rope_head_dim)  # the indexer rotates rope dims of its key
    dsa = dsa_bytes(v32, 1, DTYPE_BYTES["bfloat16"])
    return {"bf16": dsa["cache_dtype"]["indexer_bytes_per_token_per_layer"],
            "fp8": dsa["fp8"]["indexer_bytes_per_token_per_layer"]}


def window_rows(config: V4Config, seq_len: int) -> int:
    """Rows of the sliding-window ring after ``seq_len`` tokens: ``min(T, sliding_window)``."""
    return min(_check_len(seq_len), config.sliding_window)


def compressed_rows(config: V4Config, layer_type: str, seq_len: int) -> int:
    """Closed compressed entries after ``seq_len`` tokens: ``T // ratio`` (0 in a window-only layer)."""
    ratio = _layer(config, layer_type).compress_ratio
    return _check_len(seq_len) // ratio if ratio else 0


def indexer_rows(config: V4Config, layer_type: str, seq_len: int) -> int:
    """Indexer keys after ``seq_len`` tokens: one per compressed entry in a CSA layer, none elsewhere."""
    return compressed_rows(config, layer_type, seq_len) if layer_type == CSA else 0


def compressor_state_bytes(config: V4Config, layer_type: str) -> dict[str, int]:
    """float32 kv_state + score_state of the layer's compressor (``2 x coff*ratio x coff*head_dim x 4``) and, in a
    CSA layer, of its indexer's compressor (at index_head_dim); 0 in a window-only layer."""
    layer = _layer(config, layer_type)
    ratio, coff, f32 = layer.compress_ratio, 2 if layer.overlap else 1, DTYPE_BYTES["float32"]
    if not ratio:
        return {"compressor": 0, "indexer_compressor": 0, "total": 0}
    main = 2 * (coff * ratio) * (coff * config.head_dim) * f32
    index = 2 * (coff * ratio) * (coff * config.index_head_dim) * f32 if layer_type == CSA else 0
    return {"compressor": main, "indexer_compressor": index, "total": main + index}


def layer_bytes(config: V4Config, layer_type: str, seq_len: int, fmt: str) -> dict[str, Any]:
    """One layer's cache for one sequence of ``seq_len`` tokens, by component, in format ``fmt``."""
    rb = row_bytes(config, fmt)
    w, c, i = window_rows(config, seq_len), compressed_rows(config, layer_type, seq_len), \
        indexer_rows(config, layer_type, seq_len)
    parts = {"window": w * rb["row"], "compressed": c * rb["row"], "indexer": i * rb["indexer_key"],
             "state": compressor_state_bytes(config, layer_type)["total"]}
    total = sum(parts.values())
    return {**parts, "total": total, "bytes_per_token": total / seq_len,
            "rows": {"window": w, "compressed": c, "indexer": i}}


def model_bytes(config: V4Config, seq_len: int, fmt: str) -> dict[str, Any]:
    """The whole model's cache for one sequence: :func:`layer_bytes` summed over ``layer_types``."""
    sums = collections.Counter()
    for layer_type in config.layer_types:
        one = layer_bytes(config, layer_type, seq_len, fmt)
        sums.update({k: one[k] for k in ("window", "compressed", "indexer", "state", "total")})
    return {**dict(sums), "bytes_per_token": sums["total"] / seq_len}


def layer_counts(config: V4Config) -> dict[str, int]:
    """{layer type: layers of that type}, in LAYER_TYPES order, types the model has only."""
    counts = collections.Counter(config.layer_types)
    return {t: counts[t] for t in LAYER_TYPES if counts[t]}


def derivation(config: V4Config, seq_len: int, fmt: str) -> str:
    """The whole model's bytes as a formula line, ``layers x [rows x bytes + ... + state]`` per layer type."""
    rb, terms = row_bytes(config, fmt), []
    for layer_type, n in layer_counts(config).items():
        w, c = window_rows(config, seq_len), compressed_rows(config, layer_type, seq_len)
        i, state = indexer_rows(config, layer_type, seq_len), compressor_state_bytes(config, layer_type)["total"]
        parts = [f"({w:,} + {c:,}) x {rb['row']:,}" if c else f"{w:,} x {rb['row']:,}"]
        parts += [f"{i:,} x {rb['indexer_key']:,}"] * bool(i) + [f"{state:,}"] * bool(state)
        terms.append(f"{n} {SHORT[layer_type]} x [{' + '.join(parts)}]")
    return " + ".join(terms) + f" = {model_bytes(config, seq_len, fmt)['total']:,} B"


def _check_len(seq_len: int) -> int:
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0:
        raise MLAInputError(f"sequence length must be a positive integer, got {seq_len!r}")
    return seq_len


# ---------------------------------------------------------------------------------------- V3 / V3.2
def v3_rows(seq_len: int) -> dict[str, dict[str, Any]]:
    """DeepSeek-V3's MLA and V3.2's DSA caches for one sequence, bf16 and FP8: kv.budget's own figures for those
    presets (V3: the mla_latent row and the fp8-e4m3-flashmla codec row; V3.2: the dsa block's latent + indexer)."""
    out = {}
    for preset, label in V3_MODELS.items():
        config = MLAConfig.preset(preset)
        report = budget(config, seq_len, preset=preset, extra_codecs=codec_rows(config, "bfloat16"))
        layers, dsa = report["layers"], report["dsa"]
        rows = {}
        for fmt in ("bf16", "fp8"):
            if dsa is None:
                per_layer, total = (report["kv_bytes_per_token_per_layer"][V3_ROW[fmt]],
                                    report["sequence_bytes"][V3_ROW[fmt]])
                what = {"bf16": "mla_latent", "fp8": "fp8-e4m3-flashmla codec"}[fmt]
            else:
                block = dsa[V32_BLOCK[fmt]]
                per_layer, total = block["total_bytes_per_token_per_layer"], block["total_sequence_bytes"]
                what = (f"latent {block['latent_bytes_per_token_per_layer']:,} + indexer "
                        f"{block['indexer_bytes_per_token_per_layer']:,}")
            rows[fmt] = {"bytes_per_token_per_layer": per_layer, "total": total, "bytes_per_token": total / seq_len,
                         "what": what,
                         "derivation": f"{layers} x {seq_len:,} x {per_layer:,} = {total:,} B"}
        out[preset] = {"label": label, "layers": layers, "formats": rows}
    return out


# ---------------------------------------------------------------------------------------- report
def v4_report(contexts: tuple[int, ...] = CONTEXTS) -> dict[str, Any]:
    """Every figure of ``mla-conformance budget --v4`` as one JSON-ready dict."""
    contexts = tuple(_check_len(t) for t in contexts)
    models = {}
    for preset, label in V4_MODELS.items():
        config = V4Config.preset(preset)
        counts = layer_counts(config)
        models[preset] = {
            "label": label, "layers": config.num_hidden_layers,
            "layer_counts": {SHORT[t]: n for t, n in counts.items()},
            "head_dim": config.head_dim, "index_head_dim": config.index_head_dim,
            "sliding_window": config.sliding_window,
            "compress_rates": {SHORT[t]: config.compress_rates[t] for t in (CSA, HCA)},
            "row_bytes": {fmt: row_bytes(config, fmt) for fmt in FORMATS},
            "state_bytes": {SHORT[t]: compressor_state_bytes(config, t) for t in counts},
            "per_layer": {fmt: {SHORT[t]: {str(T): layer_bytes(config, t, T, fmt) for T in contexts} for t in counts}
                          for fmt in FORMATS},
            "model": {fmt: {str(T): {**model_bytes(config, T, fmt), "derivation": derivation(config, T, fmt)}
                            for T in contexts} for fmt in FORMATS},
        }
    v3 = {str(T): v3_rows(T) for T in sorted(set(contexts) | {CLAIM_CONTEXT})}
    return {"contexts": list(contexts), "formats": dict(FORMATS), "models": models,
            "v3": {str(T): v3[str(T)] for T in contexts}, "claim": claim_comparison(models, v3)}


def claim_comparison(models: dict[str, Any] | None = None, v3: dict[str, Any] | None = None) -> dict[str, Any]:
    """V4 / V3.2 at CLAIM_CONTEXT for each of PAIRINGS, against CLAIM."""
    key = str(CLAIM_CONTEXT)
    v32 = (v3 or {key: v3_rows(CLAIM_CONTEXT)})[key]["deepseek-v3.2"]
    pairings = []
    for v4_fmt, v32_fmt, like in PAIRINGS:
        theirs = v32["formats"][v32_fmt]
        ratios = {}
        for preset in V4_MODELS:
            config = V4Config.preset(preset)
            if models is not None and key in models[preset]["model"][v4_fmt]:
                ours = models[preset]["model"][v4_fmt][key]
            else:
                ours = {**model_bytes(config, CLAIM_CONTEXT, v4_fmt),
                        "derivation": derivation(config, CLAIM_CONTEXT, v4_fmt)}
            measured, claimed = ours["total"] / theirs["total"], CLAIM[preset]
            agrees = abs(measured - claimed) <= CLAIM_TOLERANCE + 1e-12
            ratios[preset] = {
                "v4_bytes": ours["total"], "v32_bytes": theirs["total"], "measured": measured, "claimed": claimed,
                "reduction": theirs["total"] / ours["total"], "claimed_reduction": 1 / claimed, "agrees": agrees,
                "v4_derivation": ours["derivation"], "v32_derivation": theirs["derivation"],
                "verdict": ("agrees" if agrees else "does not agree") + f": {measured:.1%} measured vs {claimed:.0%} "
                           f"claimed ({(measured - claimed) * 100:+.1f} points; V3.2 / V4 = "
                           f"{theirs['total'] / ours['total']:.1f}x vs {1 / claimed:.1f}x)"}
        pairings.append({"v4_format": v4_fmt, "v32_format": v32_fmt, "like_for_like": like, "ratios": ratios})
    return {"context": CLAIM_CONTEXT, "claimed": dict(CLAIM), "tolerance": CLAIM_TOLERANCE,
            "claim": "at 1M tokens V4-Pro needs 10% of V3.2's KV cache, V4-Flash 7% (DeepSeek-V4 release)",
            "pairings": pairings}


def _ctx(t: int) -> str:
    name = CONTEXT_NAMES.get(t)
    return f"{name} ({t:,})" if name else f"{t:,}"


def format_v4_report(report: dict[str, Any]) -> str:
    """The human-readable tables of ``mla-conformance budget --v4``."""
    contexts = report["contexts"]
    out = ["DeepSeek-V4 KV cache, one sequence (DeepSeek's V4 inference/model.py): per layer a window ring of "
           "min(T, window) rows + T // ratio compressed rows of head_dim, T // ratio indexer keys of index_head_dim "
           "in CSA layers, and the compressor's float32 state (constant in T)",
           "formats (the compressor state is float32 in each):"]
    out += [f"  {k:<16} {v}" for k, v in report["formats"].items()] + [""]
    head = f"  {'scope':<20} {'format':<16}" + "".join(
        f" {_ctx(t) + ': sequence':>26} {'B/token':>10}" for t in contexts)
    for m in report["models"].values():
        counts = " + ".join(f"{n} {t}" for t, n in m["layer_counts"].items())
        rb = m["row_bytes"]
        out.append(f"{m['label']}: {m['layers']} layers = {counts}; head_dim {m['head_dim']}, window "
                   f"{m['sliding_window']}, ratio csa {m['compress_rates']['csa']} / hca {m['compress_rates']['hca']}, "
                   f"index_head_dim {m['index_head_dim']}")
        out.append("  row / indexer key bytes: " + ", ".join(
            f"{fmt} {r['row']:,} / {r['indexer_key']:,}" for fmt, r in rb.items())
            + "; compressor state per layer (float32): " + ", ".join(
            f"{t} {s['total']:,} B" + (f" ({s['compressor']:,} + indexer's {s['indexer_compressor']:,})"
                                       if s["indexer_compressor"] else "")
            for t, s in m["state_bytes"].items() if s["total"]))
        out += [head, "  " + "-" * (len(head) - 2)]
        for t, n in m["layer_counts"].items():
            for fmt in report["formats"]:
                cells = m["per_layer"][fmt][t]
                scope = f"{t} layer (x{n})"
                out.append(f"  {scope:<20} {fmt:<16}" + "".join(
                    f" {fmt_bytes(cells[str(T)]['total']):>26} {cells[str(T)]['bytes_per_token']:>10,.2f}"
                    for T in contexts))
        for fmt in report["formats"]:
            cells = m["model"][fmt]
            scope = f"model ({m['layers']} layers)"
            out.append(f"  {scope:<20} {fmt:<16}" + "".join(
                f" {fmt_bytes(cells[str(T)]['total']):>26} {cells[str(T)]['bytes_per_token']:>10,.2f}"
                for T in contexts))
        last = str(contexts[-1])
        for fmt in report["formats"]:
            out.append(f"  {fmt} at {_ctx(contexts[-1])}: {m['model'][fmt][last]['derivation']}")
        out.append("")
    out.append("Beside them, the budget's DeepSeek-V3 (MLA) and V3.2 (DSA) rows at the same contexts:")
    out += [head, "  " + "-" * (len(head) - 2)]
    first = report["v3"][str(contexts[0])]
    for preset, m in first.items():
        for fmt in m["formats"]:
            label = f"{m['label']} ({m['layers']} layers)"
            out.append(f"  {label:<20} {fmt:<16}" + "".join(
                f" {fmt_bytes(report['v3'][str(T)][preset]['formats'][fmt]['total']):>26} "
                f"{report['v3'][str(T)][preset]['formats'][fmt]['bytes_per_token']:>10,.2f}" for T in contexts)
                + f"  ({m['formats'][fmt]['bytes_per_token_per_layer']:,} B/token/layer: {m['formats'][fmt]['what']})")
    c = report["claim"]
    out += ["", f"DeepSeek's claim: {c['claim']}.",
            f"Measured V4 / V3.2 at {_ctx(c['context'])} tokens, per pairing (V4 format / V3.2 format; agrees: within "
            f"{c['tolerance'] * 100:.1f} points of the stated percent):"]
    for p in c["pairings"]:
        out.append(f"  {p['v4_format']} / {p['v32_format']}: {PAIRING_NOTES[(p['v4_format'], p['v32_format'])]}")
        out.append(f"    V3.2 = {next(iter(p['ratios'].values()))['v32_derivation']}")
        for preset, r in p["ratios"].items():
            label = report["models"][preset]["label"]
            out.append(f"    {label} = {r['v4_derivation']}")
            out.append(f"    {label}: {r['verdict']}")
    return "\n".join(out)


__all__ = ["V4_MODELS", "V3_MODELS", "CONTEXTS", "FORMATS", "CLAIM", "CLAIM_CONTEXT", "PAIRINGS", "row_bytes",
           "indexer_key_bytes", "window_rows", "compressed_rows", "indexer_rows", "compressor_state_bytes",
           "layer_bytes", "model_bytes", "layer_counts", "derivation", "v3_rows", "v4_report", "claim_comparison",
           "format_v4_report", "PAIRING_NOTES"]
