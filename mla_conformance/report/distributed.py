"""The report's distributed rows (issue 44): the layer across W ranks (section ``distributed``: each rank's cache
bytes, the redundancy over the ranks, each rank's error against the single-process reference, the verdict) and the
ops under decode context parallelism (section ``op-dcp``: the merged verdict per op, W and S). Appended to
conformance.md by mla_conformance.runner.run; reads only the tests' figures (mla_conformance.schema.FIGURES)."""

from __future__ import annotations

from mla_conformance.report.fmt import mark


def _rows(report, section: str) -> list[dict]:
    return [t for t in report.get("tests", []) if t.get("section") == section]


def distributed_markdown(report) -> str:
    """'' when the run has no distributed or op-dcp row."""
    out: list[str] = []
    layer = [t for t in _rows(report, "distributed") if t["outcome"] != "skipped"]
    if layer:
        out += ["", "## Across ranks (TP, DCP, TP x DCP)", "",
                "| verdict | backend | case | cache bytes per rank | tokens per rank | redundancy | rel_fro per rank |",
                "|---|---|---|---|---|---|---|"]
        by_case: dict = {}
        for t in layer:
            f = t.get("figures") or {}
            row = by_case.setdefault((f.get("backend", ""), f.get("case", t["nodeid"])), {"verdicts": []})
            row["verdicts"].append(t["outcome"])
            row.update({k: v for k, v in f.items() if k in ("rank_cache_bytes", "rank_tokens", "cache_redundancy",
                                                              "rank_rel_fro")})
        for (backend, case), r in sorted(by_case.items()):
            # the worst of the case's tests (an error outranks a failure), as the other tables mark a row
            worst = next((o for o in ("error", "failed") if o in r["verdicts"]), "passed")
            verdict = mark({"outcome": worst})
            fmt = lambda xs, spec: ", ".join(format(x, spec) for x in xs) if xs else ""  # noqa: E731
            out.append(f"| {verdict} | {backend} | {case} | {fmt(r.get('rank_cache_bytes'), 'd')} | "
                       f"{fmt(r.get('rank_tokens'), 'g')} | {r.get('cache_redundancy', '') and format(r['cache_redundancy'], '.3g')} | "
                       f"{fmt(r.get('rank_rel_fro'), '.2e')} |")
    ops = [t for t in _rows(report, "op-dcp") if t["outcome"] != "skipped"]
    if ops:
        out += ["", "## Ops under decode context parallelism (the ranks' partials merged by lse)", "",
                "| op | tests | passed | failed / error | W x S shardings |", "|---|---|---|---|---|"]
        per: dict = {}
        for t in ops:
            f = t.get("figures") or {}
            p = per.setdefault(t.get("op") or f.get("op", ""), {"n": 0, "ok": 0, "shard": set()})
            p["n"] += 1
            p["ok"] += t["outcome"] == "passed"
            if "dcp_world_size" in f:
                p["shard"].add((f["dcp_world_size"], f.get("dcp_interleave")))
        for op, p in sorted(per.items()):
            out.append(f"| {op} | {p['n']} | {p['ok']} | {p['n'] - p['ok']} | {len(p['shard'])} |")
    return "\n".join(out) + ("\n" if out else "")
