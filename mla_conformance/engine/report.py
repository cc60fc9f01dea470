"""The engine suite's rows in the report (``mla-conformance run --engine SPEC``): one row per engine configuration
and model, from the figures its tests recorded under ``engine`` (mla_conformance.engine.suite); the outcome of each
test. Wall times and memory stay out of conformance.json (it is byte-identical between runs): the rows keep the
deterministic figures."""

from __future__ import annotations

from mla_conformance.engine.contract import parse_engine_spec
from mla_conformance.engine.session import ENGINE_MODELS
from mla_conformance.errors import MLAInputError

#: the figures a row keeps (wall_s, load_s, peak_rss_bytes are clock / host readings: printed by the tier, not kept)
KEPT = ("spec", "model", "attention_backend", "dtype", "tokens_matched", "tokens_compared", "ties",
        "worst_logprob_delta", "worst_logprob_ratio", "bytes_per_token_per_layer", "latent_bytes",
        "expanded_bytes_per_token_per_layer", "expanded_over_latent", "worst_logprob_delta_vs_cold", "died")
_CHECK = {"test_engine_greedy_tokens": "greedy", "test_engine_logprobs": "logprobs",
          "test_engine_prefix_cache": "prefix_cache", "test_engine_chunked_prefill": "chunked_prefill",
          "test_engine_kv_cache_fp8": "kv_cache_fp8", "test_engine_kv_bytes": "kv_bytes"}


def engine_rows(results: dict) -> list[dict]:
    """Rows keyed by (spec, model): each check's outcome (and skip / failure sentence) and the figures."""
    rows: dict[tuple[str, str], dict] = {}
    for t in results.get("tests", []):
        nodeid = t.get("nodeid", "")
        if "test_engine.py::" not in nodeid:
            continue
        test, _, param = nodeid.split("::", 1)[1].partition("[")
        check = _CHECK.get(test)
        fig = (t.get("figures") or {}).get("engine") or {}
        spec, model = fig.get("spec"), fig.get("model")
        if spec is None:  # skipped before a run: the id is "<spec>-<model>"
            param = param.rstrip("]")
            if param.startswith("no-engine"):  # no --mla-engine: no engine row (the skip is in the tests' list)
                continue
            model = next((m for m in sorted(ENGINE_MODELS, key=len, reverse=True) if param.endswith("-" + m)), "")
            spec = param[: -len(model) - 1] if model else param
        row = rows.setdefault((spec, model), {"spec": spec, "model": model, "checks": {}})
        outcome = t.get("outcome")
        row["checks"][check or test] = {"outcome": outcome, **({"reason": t["reason"]} if t.get("reason") else {})}
        variant = fig.get("variant")
        for key in KEPT:
            if key not in fig:
                continue
            if key == "worst_logprob_delta_vs_cold":  # each comparison with the cold run under its check's name
                row.setdefault("vs_cold", {})[check or test] = fig[key]
            elif variant == "fp8" and key not in ("spec", "model", "died"):  # the quantized cache's, apart
                row.setdefault("fp8", {})[key] = fig[key]
            elif key not in row or variant == "cold":
                row[key] = fig[key]
    return [rows[k] for k in sorted(rows)]


def add_engine_rows(report: dict, results: dict) -> dict:
    rows = engine_rows(results)
    if rows:
        report["engines"] = rows
    return report


def _num(v, fmt="{:.3g}") -> str:
    return "" if v is None else fmt.format(v)


def engine_markdown(report: dict) -> str:
    rows = report.get("engines") or []
    if not rows:
        return ""
    out = ["", "## Engines", "",
           "A serving engine running the pinned models end to end against the float64 reference "
           "(suites/test_engine.py, docs/engines.md).", "",
           "| engine configuration | model | tokens matched | ties | worst logprob delta | KV bytes / token / layer "
           "| checks |", "| --- | --- | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        matched = f"{r['tokens_matched']} / {r['tokens_compared']}" if "tokens_matched" in r else ""
        checks = "; ".join(f"{k} {v['outcome']}" for k, v in sorted(r["checks"].items()))
        kv = _num(r.get("bytes_per_token_per_layer"), "{:g}")
        if r.get("expanded_bytes_per_token_per_layer"):
            kv += f" (expanded {r['expanded_bytes_per_token_per_layer']:g}, {r['expanded_over_latent']:g}x)"
        out.append(f"| `{r['spec']}` | {r['model']} | {matched} | {len(r.get('ties') or []) if 'ties' in r else ''} "
                   f"| {_num(r.get('worst_logprob_delta'))} | {kv} | {checks} |")
    lines = []
    for r in rows:  # one line per distinct sentence of a row (a model the engine refuses: one line for all checks)
        said: dict[tuple[str, str], list[str]] = {}
        for k, v in sorted(r["checks"].items()):
            if v.get("reason") and v["outcome"] != "passed":
                said.setdefault((v["outcome"], v["reason"].splitlines()[0][:300]), []).append(k)
        lines += [f"- `{r['spec']}` {r['model']} {', '.join(ks)}: {outcome}: {reason}"
                  for (outcome, reason), ks in said.items()]
    if lines:
        out += ["", "Skips and failures:", "", *lines]
    return "\n".join(out) + "\n"


def run_options(args, suites) -> tuple[list[str], list[str], bool]:
    """``mla-conformance run --engine SPEC...``: (the pytest paths, the pytest options, engine only). With --engine and
    neither --backend nor --op, only the engine suite runs and the built-in backends are not under test."""

    specs = list(getattr(args, "engine", None) or [])
    for spec in specs:
        try:
            parse_engine_spec(spec)
        except MLAInputError as exc:
            raise MLAInputError(f"--engine: {exc}") from None
    engine_only = bool(specs) and not args.backend and not args.op
    paths = [str(suites / "test_engine.py")] if engine_only else [str(suites)]
    opts = [opt for spec in specs for opt in ("--mla-engine", spec)]
    # engine only: run serially (runner.run adds no workers), as each xdist worker would start the engines again
    # (the engines run in subprocesses of their own anyway)
    return paths, opts, engine_only


def print_engine_rows(report: dict) -> None:
    for r in report.get("engines") or []:
        outcomes = sorted({v["outcome"] for v in r["checks"].values()})
        figures = (f"{r['tokens_matched']}/{r['tokens_compared']} tokens matched, worst logprob delta "
                   f"{r['worst_logprob_delta']:.3g}" if "tokens_matched" in r else "")
        if r.get("bytes_per_token_per_layer"):
            figures += f"{', ' if figures else ''}{r['bytes_per_token_per_layer']:g} KV bytes / token / layer"
        print(f"  engine {r['spec']} on {r['model']}: {', '.join(outcomes)}{f' ({figures})' if figures else ''}")


def merged_engine_rows(labelled: list[tuple[str, dict]]) -> list[dict]:
    """``mla-conformance merge``: every report's engine rows, each with the report (host) it came from."""
    return [{"report": label, **row} for label, report in sorted(labelled, key=lambda lr: lr[0])
            for row in report.get("engines") or []]


def merged_engine_markdown(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    out = ["", "## Engines", "", "Rows: report (host) and engine configuration on a pinned model (suites/test_engine.py).",
           "", "| report | engine configuration | model | tokens matched | ties | worst logprob delta "
           "| KV bytes / token / layer | checks |", "| --- | --- | --- | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        matched = f"{r['tokens_matched']} / {r['tokens_compared']}" if "tokens_matched" in r else ""
        ties = len(r.get("ties") or []) if "ties" in r else ""
        checks = "; ".join(f"{k} {v['outcome']}" for k, v in sorted(r["checks"].items()))
        out.append(f"| {r['report']} | `{r['spec']}` | {r['model']} | {matched} | {ties} "
                   f"| {_num(r.get('worst_logprob_delta'))} | {_num(r.get('bytes_per_token_per_layer'), '{:g}')} "
                   f"| {checks} |")
    return out
