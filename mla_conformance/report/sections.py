"""The measured tables of conformance.md: cache bytes (the V2-Lite cache probe, slot overhead), numerical
error with tolerance and margin, RoPE conventions, KV codecs, generation, the checkpoint probe, kernel
gating. Each reads the figures the checks recorded (:mod:`mla_conformance.schema`); a figure the run
did not record reads "not recorded", never a number computed here in its place."""

from __future__ import annotations

from typing import Any

from mla_conformance.arch.matrix import NOT_RUN_ON_HARDWARE, adapter_status
from mla_conformance.report.build import backend_of, formula_bytes, in_section, margin, measured_bytes, number, tolerance_of
from mla_conformance.report.fmt import NOT_MEASURED, NOT_RECORDED, cell, fmt_e, fmt_int, fmt_x, mark
from mla_conformance.schema import ROPE_CONVENTIONS

#: The seeds' experiments, by the names the report and README use.
EXPERIMENTS = {
    "seed 000": ("V2-Lite cache probe", "what a cache holds after a prefill and one decode step at "
                 "DeepSeek-V2-Lite dimensions in BF16, read from the cache's own tensors."),
    "seed 001": ("latent quantization study", "bytes and error of quantized encodings of the latent cache "
                 "(INT8/INT4/INT2/FP8, per tensor, token or channel group), scales and zero points counted."),
    "seed 004": ("KV budget", "KV bytes per token of MHA, GQA and MLA, decode arithmetic intensity and the "
                 "registers and shared memory of one MLA decode tile (`mla-conformance budget`)."),
}


def _bytes_cell(v) -> str:
    return NOT_MEASURED if v is None else fmt_int(v)


def _formula_cell(v) -> str:
    return "" if v is None else fmt_int(v)


def _slots(f) -> str:
    if f.get("allocated_slots") is None or f.get("requested_slots") is None:
        return ""
    if f.get("preallocated") is False:  # nothing allocated up front: the cache grows with the tokens
        return f"grows: {fmt_int(f['allocated_slots'])} now, {fmt_int(f['requested_slots'])} requested"
    over = f.get("slot_overhead")
    if over is None and f["requested_slots"]:
        over = f["allocated_slots"] / f["requested_slots"]
    return f"{fmt_int(f['allocated_slots'])} / {fmt_int(f['requested_slots'])}" + (
        f" ({over:.3g}x)" if over is not None else "")


def _format_formula(rows: list[dict], fmt: str) -> int | float | None:
    """The ``fmt`` format's formula bytes at the probe's dims, as recorded: a row's own
    ``formula_<fmt>_bytes_per_token``, else the formula a row of that format recorded for itself."""
    for t in rows:
        v = number(t["figures"], f"formula_{fmt}_bytes_per_token")
        if v is not None:
            return v
    return next((formula_bytes(t["figures"]) for t in rows if t["figures"].get("cache_format") == fmt
                 and formula_bytes(t["figures"]) is not None), None)


def _probe_formula(seed: list[dict]) -> dict[str, Any] | None:
    """The probe's setup and the latent / expanded formulas at its dims and dtype, from what its rows recorded."""
    f = next((t["figures"] for t in seed if t["figures"].get("preset") and t["figures"].get("dtype")), None)
    if f is None:
        return None
    return {"preset": f["preset"], "dtype": f["dtype"], "tokens": f.get("tokens"), "batch": f.get("batch"),
            "capacity": f.get("capacity"), "latent": _format_formula(seed, "latent"),
            "expanded": _format_formula(seed, "expanded"), "latent_elements": number(f, "latent_dim"),
            "expanded_elements": number(f, "expanded_dim")}


def _formula_phrase(v, elements, what: str) -> str:
    if v is None:
        return f"{what} {NOT_RECORDED}"
    return f"{v:,} B" + (" per token per layer" if what == "latent" else "") + f" {what}" + (
        f" ({elements:,} elements)" if elements is not None else "")


def _probe_sentence(name: str, sentence: str, formula: dict | None) -> str:
    if formula is None:
        return f"The {name} (seed 000) measures {sentence}"
    setup = (f"{formula['tokens']} stored tokens" if formula.get("tokens") is not None else "its tokens") + (
        f" (batch {formula['batch']}, {formula['capacity']} slots requested)" if formula.get("batch") is not None
        and formula.get("capacity") is not None else "")
    latent, expanded = formula["latent"], formula["expanded"]
    ratio = f", {expanded / latent:.4g}x" if latent and expanded is not None else ""
    return (f"The {name} (seed 000) measures what a cache holds after {setup} at {formula['preset']} dimensions "
            f"in {formula['dtype']}, read from the cache's own tensors. *measured*: the bytes per stored token "
            f"written into those tensors in this run; *formula*: what the declared format takes at these dims "
            f"(`checks.format_bytes_per_token`, computed from the config): "
            f"{_formula_phrase(latent, formula['latent_elements'], 'latent')}, "
            f"{_formula_phrase(expanded, formula['expanded_elements'], 'expanded')}{ratio}. A row "
            f"without a measurement says \"{NOT_MEASURED}\".")


def bytes_lines(report) -> list[str]:
    seed = in_section(report, "v2-lite-cache-probe")
    out: list[str] = []
    formula = None
    if seed:
        name, sentence = EXPERIMENTS["seed 000"]
        formula = _probe_formula(seed)
        out += ["## Cache bytes: the " + name, "", _probe_sentence(name, sentence, formula), "",
                "| | backend | format | bytes/token/layer measured | bytes/token/layer formula | active B (measured) | "
                "allocated B | slots allocated / requested | tensors |",
                "|---|---|---|---:|---:|---:|---:|---:|---|"]
        for t in sorted(seed, key=backend_of):
            f = t["figures"]
            tens = ", ".join(f"{k} {fmt_int(v)}" for k, v in sorted((f.get("tensors") or {}).items()))
            out.append(f"| {mark(t)} | {t.get('backend', '')} | {f.get('cache_format', '')} | "
                       f"{_bytes_cell(measured_bytes(f))} | {_formula_cell(formula_bytes(f))} | "
                       f"{fmt_int(f.get('active_nbytes', ''))} | {fmt_int(f.get('allocated_nbytes', ''))} | "
                       f"{_slots(f)} | {tens} |")
        probe = {t.get("backend"): t["figures"] for t in seed if t.get("outcome") == "passed"}
        if {"reference-naive", "reference-absorbed"} <= set(probe):
            naive, absorbed = probe["reference-naive"]["active_nbytes"], probe["reference-absorbed"]["active_nbytes"]
            both = formula and formula["latent"] and formula["expanded"] is not None
            out.append(f"\nMeasured: reference-naive active bytes / reference-absorbed active bytes = "
                       f"{fmt_int(naive)} / {fmt_int(absorbed)} = {naive / absorbed:.6f} "
                       f"(expanded over latent); the latent cache is {(1 - absorbed / naive) * 100:.2f}% smaller"
                       + (f". Formula at these dims: {formula['expanded']:,} / {formula['latent']:,} = "
                          f"{formula['expanded'] / formula['latent']:.6f}" if both else "") + ".")
    rows = [t for t in report["tests"] if t.get("figures")]
    over = [t for t in rows if t["figures"].get("allocated_slots") is not None
            and t["figures"].get("requested_slots") is not None
            and t["figures"]["allocated_slots"] != t["figures"]["requested_slots"]
            and t["figures"].get("preallocated") is not False]
    growing = sorted({backend_of(t) for t in rows if t["figures"].get("preallocated") is False and backend_of(t)})
    if growing:
        out += ["", f"Caches that grow with the tokens (nothing preallocated, so no slot count to judge or "
                    f"report): {', '.join(growing)}."]
    if over:
        out += ["", "### Slot overhead (a figure, not a failure)", "",
                "Slot counts that differ from the requested capacity are the engine's allocation policy (pools, "
                "max_seq_len, growth on demand), not its format: bytes per slot are judged against the format, "
                "slot counts only reported.", "",
                "| | test | requested slots | allocated slots | allocated / requested | bytes/token measured | "
                "bytes/token formula |", "|---|---|---:|---:|---:|---:|---:|"]
        for t in over:
            f = t["figures"]
            ratio = f.get("slot_overhead") or (f["allocated_slots"] / f["requested_slots"] if f["requested_slots"] else None)
            out.append(f"| {mark(t)} | `{t['nodeid']}` | {fmt_int(f['requested_slots'])} | "
                       f"{fmt_int(f['allocated_slots'])} | {fmt_x(ratio)} | {_bytes_cell(measured_bytes(f))} | "
                       f"{_formula_cell(formula_bytes(f))} |")
    return out


def _tol_cell(v) -> str:
    return NOT_RECORDED if v is None else fmt_e(v)


def _margin_of(t: dict) -> float | None:
    """A numerics row's margin: tolerance / measured for the tighter of rel_fro and max_rel (None: no bound recorded)."""
    f = t["figures"]
    tol_rf, tol_mr = tolerance_of(f)
    margins = [m for m in (margin(f.get("rel_fro"), tol_rf), margin(f.get("max_rel"), tol_mr)) if m is not None]
    return min(margins) if margins else None


def error_summary_lines(report) -> list[str]:
    """Per backend, its numerics tests' count, how many failed, and the one closest to its bound: the figure a reader
    comes for; every test's row is :func:`error_lines`' table, further down."""
    errs = in_section(report, "numerics")
    if not errs:
        return []
    out = ["## Closest to the bound: numerical error per backend", "",
           "Per backend, its tests against the float64 expanded reference and the one closest to its tolerance "
           "(*margin* = tolerance / measured for the tighter of rel Frobenius and max rel; below 1x fails). Every "
           "test's row: *Numerical error against the float64 expanded reference*, below.", "",
           "| backend | tests | failed | smallest margin | at (preset, scenario, dtype) |", "|---|---:|---:|---:|---|"]
    by_backend: dict[str, list[dict]] = {}
    for t in errs:
        by_backend.setdefault(t.get("backend", ""), []).append(t)
    for backend, rows in sorted(by_backend.items()):
        judged = [(m, t["nodeid"], t) for t in rows for m in [_margin_of(t)] if m is not None]
        failed = sum(t["outcome"] in ("failed", "error") for t in rows)
        if judged:
            m, _, t = min(judged, key=lambda x: (x[0], x[1]))
            p = t["params"]
            at = f"{p.get('preset', '')}, {p.get('scenario', '')}, {p.get('dtype', '')}"
            shown = fmt_x(m)
        else:
            shown, at = NOT_RECORDED, ""
        out.append(f"| {backend} | {len(rows)} | {failed} | {shown} | {at} |")
    return out


def error_lines(report) -> list[str]:
    errs = in_section(report, "numerics")
    if not errs:
        return []
    out = ["## Numerical error against the float64 expanded reference", "",
           "Per test, the worst row. *rel Frobenius* = ||out - ref||_F / ||ref||_F; *max rel* = max |out - ref| / "
           "rms(ref); *tol* = the stated tolerance of that dtype (markers.md); *margin* = tolerance / measured for "
           "the tighter of the two (below 1x fails); *1 - cos* = 1 - cosine similarity of out and ref.", "",
           "| | backend | preset | scenario | dtype | rel Frobenius | tol | max rel | tol | margin | max abs | "
           "p99 abs | 1 - cos |",
           "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    failing_first = sorted(errs, key=lambda t: (t["outcome"] not in ("failed", "error"), t.get("backend", ""),
                                                t["params"].get("preset", ""), t["params"].get("dtype", ""),
                                                t["params"].get("scenario", "")))
    for t in failing_first:
        f, p = t["figures"], t["params"]
        tol_rf, tol_mr = tolerance_of(f)
        margins = [m for m in (margin(f.get("rel_fro"), tol_rf), margin(f.get("max_rel"), tol_mr)) if m is not None]
        out.append(f"| {mark(t)} | {t.get('backend', '')} | {p.get('preset', '')} | {p.get('scenario', '')} | "
                   f"{p.get('dtype', '')} | {fmt_e(f.get('rel_fro'))} | {_tol_cell(tol_rf)} | {fmt_e(f.get('max_rel'))} | "
                   f"{_tol_cell(tol_mr)} | {fmt_x(min(margins)) if margins else ''} | {fmt_e(f.get('max_abs'))} | "
                   f"{fmt_e(f.get('p99_abs'))} | {fmt_e(f.get('cosine_diff'))} |")
    for t in failing_first:
        if t["figures"].get("likely_cause"):
            out.append(f"\n`{t['nodeid']}`: likely cause: {t['figures']['likely_cause']}")
    return out


def _codec_section(report) -> str | None:
    rows = [t for t in in_section(report, "codec-bytes")
            if t.get("params", {}).get("preset") == "deepseek-v2-lite" and t["params"].get("dtype") == "bfloat16"]
    if not rows:
        return None
    attn = {(t.get("backend"), t["params"].get("codec")): t["figures"] for t in in_section(report, "codec-attention")}
    acc = {(t.get("backend"), t["params"].get("kv_codec")): t["figures"].get("accuracy")
           for t in in_section(report, "golden-codec")}
    layers = next((number(t["figures"], "layers") for t in rows if number(t["figures"], "layers") is not None), None)
    times_layers = f"{layers} layers" if layers is not None else f"layers {NOT_RECORDED}"
    name, sentence = EXPERIMENTS["seed 001"]
    has_attn = any(attn.get((t.get("backend"), t["params"]["codec"])) for t in rows)
    has_acc = any(acc.get((t.get("backend"), t["params"]["codec"])) is not None for t in rows)
    head = ["", "backend", "codec", "payload B (formula)", "metadata B (formula)", "B/token/layer measured",
            "B/token/layer formula", f"model B/token (formula x {times_layers})", "BF16 latent B (formula) / measured B"]
    if has_attn:
        head.append("attention rel. error vs codec none")
    if has_acc:
        head.append("tiny-model accuracy")
    none = next((formula_bytes(t["figures"]) for t in rows if t["params"]["codec"] == "none"
                 and formula_bytes(t["figures"]) is not None), None)
    latent = f", {none:,} B/token/layer by the formula" if none is not None else ""
    out = [f"## KV codecs: the {name}", "",
           f"The {name} (seed 001) compares {sentence} *measured*: bytes per stored token written into the cache "
           "tensors in this run, at V2-Lite dims with a BF16 cache; *formula*: the codec's payload + metadata "
           "(`Codec.bytes_per_token`). *BF16 latent B / measured B* is the compression relative to the "
           f"unquantized latent (codec `none`{latent}): above 1 is smaller.", "",
           "| " + " | ".join(head) + " |", "|---|---|---|" + "---:|" * (len(head) - 3)]
    seed = []
    for t in sorted(rows, key=lambda t: (t.get("backend", ""), t["params"]["codec"])):
        f, codec = t["figures"], t["params"]["codec"]
        cells = [mark(t), t.get("backend", ""), codec, fmt_int(f.get("payload", "")), fmt_int(f.get("metadata", "")),
                 _bytes_cell(measured_bytes(f)), _formula_cell(formula_bytes(f)),
                 fmt_int(f.get("model_bytes_per_token", "")),
                 f"{f['ratio_vs_latent']:.3f}" if isinstance(f.get("ratio_vs_latent"), (int, float)) else ""]
        if has_attn:
            a = attn.get((t.get("backend"), codec), {}).get("attention", {})
            a = a.get("rel_fro") if isinstance(a, dict) else None
            cells.append("0 (baseline)" if codec == "none" and a is None else fmt_e(a))
        if has_acc:
            g = acc.get((t.get("backend"), codec))
            cells.append("" if g is None else f"{g:.4f}")
        out.append("| " + " | ".join(cells) + " |")
        if f.get("quant_study"):
            seed.append((codec, f["quant_study"]))
    if seed:
        out += ["", "The study's printed sizes (as it printed them, quoted from `codecs.QUANT_STUDY_SCHEMES`) count "
                    f"no scale or zero-point bytes. With them (the codec's formula x {times_layers}), per token; "
                    "*compression* is relative to the expanded BF16 cache (per-head K and V):", ""]
        for codec, s in seed:
            out.append(f"- {s['scheme']} (printed {s['reported']}): printed {fmt_int(s['seed_model_bytes_per_token'])} B "
                       f"({s['seed_ratio_vs_expanded']:.1f}x compression) vs formula {codec} "
                       f"{fmt_int(s['honest_model_bytes_per_token'])} B ({s['honest_ratio_vs_expanded']:.1f}x "
                       f"compression), +{fmt_int(s['difference_bytes'])} B")
    return "\n".join(out)


def _generation_section(report) -> str | None:
    rows = in_section(report, "golden")
    if not rows:
        return None
    out = ["## Generation on the embedded tiny model", "",
           "Greedy generation with every layer's attention through the backend; *accuracy* = fraction of the "
           "pinned answer tokens produced; *golden* = the tokens equal the stored snapshot.", "",
           "| | backend | prompt set | accuracy | golden |", "|---|---|---|---:|---|"]
    for t in sorted(rows, key=lambda t: (t.get("backend", ""), t["params"].get("prompt_set", ""))):
        out.append(f"| {mark(t)} | {t.get('backend', '')} | {t['params'].get('prompt_set', '')} | "
                   f"{t['figures']['accuracy']:.4f} | {t['outcome']} |")
    return "\n".join(out)


def _checkpoint_section(report) -> str | None:
    """``run --checkpoint DIR``'s rows (the fixture's rows of the same test are CI's proof of the path)."""
    rows = [t for t in in_section(report, "checkpoint") if t["figures"].get("source") == "checkpoint"]
    if not rows:
        return None
    name = EXPERIMENTS["seed 000"][0]
    out = [f"## The {name} on the given checkpoint", "",
           "The real layer-1 attention input of the checkpoint (its tokenizer, embedding and layer 0), a prefill "
           "and one decode step per backend; errors of the decode token against the float64 reference.", "",
           "| | backend | dtype | tokens | active B | allocated B | decode max abs | mean abs | p99 abs |",
           "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for t in sorted(rows, key=lambda t: (t.get("backend", ""), t["figures"]["dtype"])):
        f = t["figures"]
        d = f["decode"]
        out.append(f"| {mark(t)} | {t.get('backend', '')} | {f['dtype']} | {f['tokens']} | {fmt_int(f['active_nbytes'])} | "
                   f"{fmt_int(f['allocated_nbytes'])} | {fmt_e(d['max_abs'])} | {fmt_e(d['mean_abs'])} | "
                   f"{fmt_e(d['p99_abs'])} |")
    return "\n".join(out)


def _gating_section(report) -> str | None:
    """From the environment recorded when the run happened (``kernel_gating``), never re-detected."""
    env = report["environment"]
    gating = env.get("kernel_gating")
    if not gating:
        return None
    dev = env["device"]
    if not dev.startswith("cuda") and all(r is not None for r in gating.values()):
        return ("## Kernel gating on this device\n\nNo CUDA device (`" + dev + "`): none of the "
                f"{len(gating)} kernels of the support matrix runs here; their tests skip with the "
                "reason. `mla-conformance matrix --capability X.Y` says which run on a given GPU."
                + "\n\n" + "\n".join(_adapter_lines(report)))
    out = ["## Kernel gating on this device", "", "| kernel | verdict |", "|---|---|"]
    for kid, reason in sorted(gating.items()):
        out.append(f"| {kid} | {'runs here' if reason is None else reason} |")
    return "\n".join(out + [""] + _adapter_lines(report))


def _adapter_lines(report) -> list[str]:
    """The suite's FlashMLA / FlashInfer adapters, each with whether it has ever run on the real kernel
    (``arch.matrix.ADAPTERS``, ``RUN_ON_HARDWARE``: a property of this suite's version, not of the host)."""
    judged = set(report.get("verdicts") or {}) | set(report.get("op_results") or {})
    out = ["Adapters of these kernels in this suite (built-in ops; `flashmla` and `flashmla-sparse` also as layer "
           "backends):", ""]
    for kid, st in sorted(adapter_status().items()):
        names = ", ".join(f"`{n}`" + (" (judged in this run)" if n in judged else "") for n in st["adapters"])
        out.append(f"- {kid}: {names}: " + ("run on hardware" if st["run_on_hardware"] else NOT_RUN_ON_HARDWARE))
    return out


def rope_conventions(report) -> dict[str, dict[str, Any]]:
    """Per backend, the RoPE convention its conventions test recorded (``figures["rope_convention"]``), with
    the errors against each oracle; a backend whose test ran without recording one (skipped, errored) maps to
    its outcome and reason. Backends with no such row are left out."""
    out: dict[str, dict[str, Any]] = {}
    for t in sorted(report["tests"], key=lambda t: t["nodeid"]):
        f = t.get("figures") or {}
        if t.get("section") != "conventions" and "rope_convention" not in f:
            continue
        backend = backend_of(t)
        if not backend or (backend in out and out[backend].get("convention")):
            continue
        out[backend] = {"convention": f.get("rope_convention"), "outcome": t["outcome"], "reason": t.get("reason"),
                        "errors": {k.removeprefix("rel_fro_"): v for k, v in sorted(f.items())
                                   if k.startswith("rel_fro_") and isinstance(v, (int, float))}}
    return out


def _convention_section(report) -> str | None:
    found = rope_conventions(report)
    if not found:
        return None

    out = ["## RoPE convention each backend follows", "",
           "YaRN's cos/sin factor where published code disagrees (a config with mscale != mscale_all_dim; "
           "`suites/test_conventions.py`): either convention conforms, the test records which one the backend "
           "matched. *rel Frobenius*: measured against each float64 oracle in this run.", "",
           "| | backend | RoPE convention | rel Frobenius per oracle |", "|---|---|---|---|"]
    for backend, c in sorted(found.items()):
        conv = c["convention"]
        if conv:
            shown = f"**{conv}**" + (f" ({ROPE_CONVENTIONS[conv]})" if conv in ROPE_CONVENTIONS else "")
        else:
            shown = f"{NOT_RECORDED} ({c['outcome']}" + (f": {c['reason'][:160]}" if c.get("reason") else "") + ")"
        errs = ", ".join(f"{k} {fmt_e(v)}" for k, v in c["errors"].items())
        out.append(f"| {mark(c) if c['outcome'] != 'skipped' else 'skip'} | {backend} | {cell(shown)} | {errs} |")
    return "\n".join(out)


#: The sections after the op cases (conventions, codecs, generation, checkpoint, gating); each a
#: function(report) -> str | None.
REPORT_SECTIONS: list = [_convention_section, _codec_section, _generation_section, _checkpoint_section,
                         _gating_section]
