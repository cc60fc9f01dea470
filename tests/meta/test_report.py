"""Reports: verdicts (failed / error / NOT TESTED), the error table with tolerance and margin, slot
overhead, skips grouped, determinism, and `merge` keeping every row.

Most tests build reports from hand-made results dicts in-process; one real `mla-conformance run` (a
small subset: the two reference backends and reference-op) runs twice -- once plain, once with `-n 2` --
shared by the tests that need a real run: byte-identical conformance.json and .md, the op section, merge.
"""

import json
from pathlib import Path

import pytest

from mla_conformance.runner import run as report_run
from mla_conformance.report.build import INDEPENDENT, build_report, formula_bytes, measured_bytes, round_floats
from mla_conformance.report.markdown import render_markdown
from mla_conformance.report.merge import MATRIX_SCHEMA_VERSION, merge_reports
from mla_conformance.report.outdir import MARKER
from mla_conformance.report.plots import write_plots

from mla_conformance.resources import suites_dir


pytestmark = pytest.mark.meta

#: A small run that reaches every kind of report row: the V2-Lite cache probe (bytes table, the naive /
#: absorbed ratio, plots) and one numerics row per layer backend, and reference-op in two op sections.
SUBSET = ("seed_table or (test_against_float64 and tiny and float32 and prefill and not decode) "
          "or (test_out_lse_vs_oracle and float32) or test_deterministic")

#: The suite modules SUBSET draws from; the others are not collected (collecting them all costs every process time).
SUBSET_FILES = ("test_cache_bytes.py", "test_numerics.py", "test_op_numerics.py")


def run_args(out: Path, *mode: str) -> list[str]:
    ignore = [f"--ignore={p}" for p in sorted(suites_dir().glob("test_*.py")) if p.name not in SUBSET_FILES]
    return ["run", "--out", str(out), "--name", "host", "--backend", "reference-naive", "--backend",
            "reference-absorbed", "--op", "reference-op", "--", "-q", *mode, "-k", SUBSET, *ignore]


ROOT = Path(__file__).resolve().parents[2]
ENV = {"suite_version": "0", "python": "3", "torch": "2", "transformers": "5", "platform": "p", "machine": "m",
       "device": "cpu", "device_name": "x", "capability": None, "cuda": None}


#: the section each test function's rows belong to (the mla_section marker in suites/)
SECTIONS = {"test_against_float64": "numerics", "test_seed_table": "v2-lite-cache-probe",
            "test_bytes_formula": "cache-bytes", "test_codec_bytes": "codec-bytes",
            "test_attention_error": "codec-attention", "test_golden_generation_per_codec": "golden-codec"}


def _t(nodeid, outcome, backend=None, reason=None, figures=None, **params):
    t = {"nodeid": nodeid, "outcome": outcome, "device": "cpu"}
    section = SECTIONS.get(nodeid.split("::")[-1].split("[")[0])
    if section:
        t["section"] = section
    if backend:
        params["backend"] = backend
    if params:
        t["params"] = params
    if reason:
        t["reason"] = reason
    if figures:
        t["figures"] = figures
    return t


def _numerics(backend, outcome, rel_fro, max_rel, **extra):
    """A numerics row as checks.numerics records it: the metrics and the bounds it was held to."""
    fig = {"rel_fro": rel_fro, "max_rel": max_rel, "max_abs": 1e-3, "mean_abs": 1e-4, "p99_abs": 5e-4,
           "exact_fraction": 0.0, "cosine_diff": 1.234567e-13, "ref_rms": 1.0, "tolerance_rel_fro": 1e-5,
           "tolerance_max_rel": 1e-4, **extra}
    return _t(f"suites/test_numerics.py::test_against_float64[{backend}-float32-prefill-tiny]", outcome, backend,
              reason="rel_fro 3e-4 > 1e-5" if outcome == "failed" else None, figures=fig,
              dtype="float32", preset="tiny", scenario="prefill")


def results():
    return {"backends": ["good", "wrong", "crashy", "decliner"], "exitstatus": 1, "device": "cpu", "tests": [
        _numerics("good", "passed", 5.0e-7, 2.0e-6),
        _numerics("wrong", "failed", 3.0e-4, 2.0e-3, tolerance_rel_fro=1e-5, tolerance_max_rel=1e-4,
                  likely_cause="matches the reference without YaRN mscale^2 to 3e-7"),
        _t("suites/test_numerics.py::test_against_float64[crashy-float32-prefill-tiny]", "error", "crashy",
           reason="BackendError: crashy.attend raised RuntimeError: boom", dtype="float32", preset="tiny",
           scenario="prefill"),
        _t("suites/test_cache_bytes.py::test_seed_table[good]", "passed", "good", figures={
            "cache_format": "latent", "per_token_bytes": 1152, "bytes_per_token": 1152, "format_bytes_per_token": 1152,
            "active_nbytes": 29952, "allocated_nbytes": 4719616, "tensors": {"kv": 4719616},
            "requested_slots": 32, "allocated_slots": 4097, "slot_overhead": 128.03125}),
        _t("suites/test_cache_bytes.py::test_seed_table[decliner]", "skipped", "decliner",
           reason="decliner: no latent cache here"),
        _t("suites/test_numerics.py::test_against_float64[decliner-float32-prefill-tiny]", "skipped", "decliner",
           reason="decliner: no latent cache here", dtype="float32", preset="tiny", scenario="prefill"),
        _t("suites/test_numerics.py::test_against_float64[decliner-bfloat16-prefill-tiny]", "skipped", "decliner",
           reason="decliner: no bf16", dtype="bfloat16", preset="tiny", scenario="prefill"),
        _t("suites/test_budget.py::test_cli_json", "passed"),
    ]}


def test_verdicts_failed_error_and_not_tested():
    rep = build_report(results(), name="h", env=ENV)
    v = {b: x["verdict"] for b, x in rep["verdicts"].items()}
    assert v == {"good": "CONFORMS", "wrong": "DOES NOT CONFORM", "crashy": "DOES NOT CONFORM",
                 "decliner": "NOT TESTED"}
    assert rep["summary"]["wrong"]["failed"] == 1 and rep["summary"]["wrong"]["error"] == 0
    assert rep["summary"]["crashy"]["error"] == 1 and rep["summary"]["crashy"]["failed"] == 0
    assert rep["verdicts"]["decliner"]["skip_reasons"] == [
        {"reason": "decliner: no latent cache here", "count": 2}, {"reason": "decliner: no bf16", "count": 1}]
    md = render_markdown(rep)
    assert "| decliner | **NOT TESTED** |" in md and "**decliner: NOT TESTED**" in md
    assert "- decliner: no latent cache here (2 tests)" in md
    assert "| crashy | **DOES NOT CONFORM** | 0 | 0 | 1 |" in md


def test_a_backend_or_op_with_no_test_selected_is_not_selected_not_not_tested():
    """Issue 18 item 6: deselected by the user's -k/-m is no NOT TESTED (which stays for all-skipped)."""
    res = {"backends": ["a", "b"], "ops": ["idle-op"], "tests": [_numerics("a", "passed", 1e-7, 1e-6)]}
    rep = build_report(res, name="h", env=ENV)
    assert rep["verdicts"]["b"]["verdict"] == "NOT SELECTED" and rep["verdicts"]["a"]["verdict"] == "CONFORMS"
    assert rep["op_results"]["idle-op"]["verdict"] == "NOT SELECTED"
    assert "| b | **NOT SELECTED** |" in render_markdown(rep)


def test_error_table_keeps_failing_rows_with_tolerance_and_margin():
    md = render_markdown(build_report(results(), name="h", env=ENV))
    table = md[md.index("## Numerical error"):]
    rows = [line for line in table.splitlines() if line.startswith("| **FAIL** |") or line.startswith("| ok |")]
    assert rows[0].startswith("| **FAIL** | wrong |"), "failing rows first"
    assert "3.000e-04 | 1.000e-05 | 2.000e-03 | 1.000e-04 | 0.0333x" in rows[0]  # tolerance / measured
    assert rows[1].startswith("| ok | good |") and "| 1.000e-05 |" in rows[1] and "| 20x |" in rows[1]
    assert "likely cause: matches the reference without YaRN mscale^2" in table
    assert "exact" not in table.split("\n\n", 2)[2].splitlines()[0], "the unexplained exact column is gone"


def test_error_table_says_not_recorded_for_a_bound_the_row_did_not_record():
    """The renderer never looks a tolerance up in checks.TOLERANCES: a row without one says so, no margin."""
    row = _numerics("good", "passed", 5.0e-7, 2.0e-6)
    del row["figures"]["tolerance_rel_fro"], row["figures"]["tolerance_max_rel"]
    md = render_markdown(build_report({"backends": ["good"], "tests": [row]}, name="h", env=ENV))
    line = next(x for x in md.splitlines() if x.startswith("| ok | good |"))
    assert "| 5.000e-07 | not recorded | 2.000e-06 | not recorded |  |" in line


def test_failures_come_first_and_skips_are_grouped_with_counts():
    md = render_markdown(build_report(results(), name="h", env=ENV))
    assert md.index("## Failures") < md.index("## Cache bytes") < md.index("## Skipped")
    fails = md[md.index("## Failures"):md.index("## Cache bytes")]
    assert "| error | `suites/test_numerics.py::test_against_float64[crashy-" in fails
    assert "| failed | `suites/test_numerics.py::test_against_float64[wrong-" in fails and "Likely cause" in fails
    skips = md[md.index("## Skipped"):]
    assert "| 2 | decliner: no latent cache here |" in skips and "| 1 | decliner: no bf16 |" in skips


def test_slot_overhead_is_a_figure():
    md = render_markdown(build_report(results(), name="h", env=ENV))
    assert "| ok | good | latent | 1,152 | 1,152 | 29,952 | 4,719,616 | 4,097 / 32 (128x) |" in md
    assert "### Slot overhead (a figure, not a failure)" in md and "| 32 | 4,097 | 128x |" in md


def test_sections_render_only_what_was_measured():
    rep = build_report(results(), name="h", env=ENV)
    md = render_markdown(rep)
    for absent in ("naive / absorbed", "reference-naive active bytes", "## KV codecs", "## Generation",
                   "on the given checkpoint", "## Plots"):
        assert absent not in md
    fixture_probe = _t("suites/test_checkpoint.py::test_prefill_decode_on_checkpoint[fixture-good-float32]", "passed",
                       "good", figures={"source": "fixture", "tokens": 26, "dtype": "float32", "active_nbytes": 1,
                                        "allocated_nbytes": 1, "decode": {"max_abs": 0, "mean_abs": 0, "p99_abs": 0}},
                       probe="fixture", dtype="float32")
    res = results()
    res["tests"].append(fixture_probe)
    assert "checkpoint" not in render_markdown(build_report(res, name="h", env=ENV)).split("## Kernel")[0].lower()
    assert "[Attention" in render_markdown(rep, plots=["attention_error.png"])

def _probe_row(backend, preset, dtype, **figures):
    return _t(f"suites/test_cache_bytes.py::test_seed_table[{backend}]", "passed", backend, figures={
        "preset": preset, "dtype": dtype, "tokens": 26, "batch": 1, "capacity": 32, "active_nbytes": 1,
        "allocated_nbytes": 1, **figures})


def test_bytes_table_never_shows_the_formula_as_measured():
    """A row that recorded only the format formula (``formula_bytes_per_token``) reads "not measured" in the measured
    column and its formula beside it; a row with both shows both, each under its own label."""
    res = {"backends": ["formula-only", "both"], "tests": [
        _probe_row("formula-only", "deepseek-v2-lite", "bfloat16", cache_format="latent",
                   formula_bytes_per_token=1152),
        _probe_row("both", "deepseek-v2-lite", "bfloat16", cache_format="latent", formula_bytes_per_token=1152,
                   measured_bytes_per_token=1153)]}
    md = render_markdown(build_report(res, name="h", env=ENV))
    assert "| bytes/token/layer measured | bytes/token/layer formula |" in md
    assert "| ok | formula-only | latent | not measured | 1,152 |" in md
    assert "| ok | both | latent | 1,153 | 1,152 |" in md
    assert measured_bytes({"formula_bytes_per_token": 1152, "format_bytes_per_token": 1152}) is None
    assert measured_bytes({"bytes_per_token": 7, "formula_bytes_per_token": 9}) == 7
    assert formula_bytes({"format_bytes_per_token": 9}) == 9


def test_bytes_plot_bars_only_measurements(tmp_path, monkeypatch):
    """The bytes plot's bars are measurements; the formula is drawn apart (a tick), never as a bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.axes

    bars = []
    real_bar = matplotlib.axes.Axes.bar
    monkeypatch.setattr(matplotlib.axes.Axes, "bar", lambda self, x, h, *a, **kw: (bars.append((list(x), list(h))),
                                                                                    real_bar(self, x, h, *a, **kw))[1])
    res = {"backends": ["formula-only", "both"], "tests": [
        _probe_row("formula-only", "deepseek-v2-lite", "bfloat16", cache_format="latent",
                   formula_bytes_per_token=1152),
        _probe_row("both", "deepseek-v2-lite", "bfloat16", cache_format="latent", format_bytes_per_token=1152,
                   bytes_per_token=1153)]}
    assert write_plots(build_report(res, name="h", env=ENV), tmp_path) == ["bytes_per_token.png"]
    assert bars == [([0], [1153])], "only the measured row is a bar (rows sorted by backend: both, formula-only)"


def test_probe_sentence_is_derived_from_the_run_not_typed():
    """The probe's text states the formulas the rows recorded, labelled formula; no typed 1,152 / 10,240 /
    8.9x: at tiny dims in float32 the numbers are tiny's. The renderer computes none of them."""
    from mla_conformance import MLAConfig

    tiny = MLAConfig.preset("tiny")
    recorded = {"formula_latent_bytes_per_token": tiny.latent_dim * 4,
                "formula_expanded_bytes_per_token": tiny.expanded_dim * 4,
                "latent_dim": tiny.latent_dim, "expanded_dim": tiny.expanded_dim}
    md = render_markdown(build_report({"backends": ["a"], "tests": [
        _probe_row("a", "tiny", "float32", cache_format="latent", bytes_per_token=1, **recorded)]}, name="h", env=ENV))
    text = md[md.index("## Cache bytes"):]
    assert f"{tiny.latent_dim * 4:,} B per token per layer latent ({tiny.latent_dim:,} elements)" in text
    assert f"{tiny.expanded_dim * 4:,} B expanded ({tiny.expanded_dim:,} elements)" in text
    assert "*formula*" in text and "*measured*" in text
    assert "tiny dimensions in float32" in text and "26 stored tokens" in text
    for typed in ("1,152", "10,240", "8.9x", "8.888"):
        assert typed not in text, typed
    # a run of the two reference backends: each row's own formula (latent, expanded) is the sentence's
    v2 = render_markdown(build_report({"backends": ["naive", "absorbed"], "tests": [
        _probe_row("absorbed", "deepseek-v2-lite", "bfloat16", cache_format="latent", bytes_per_token=1,
                   formula_bytes_per_token=1152),
        _probe_row("naive", "deepseek-v2-lite", "bfloat16", cache_format="expanded", bytes_per_token=1,
                   formula_bytes_per_token=10240)]}, name="h", env=ENV))
    assert "1,152 B per token per layer latent" in v2 and "10,240 B expanded" in v2 and "8.889x" in v2
    # nothing recorded: said so, not computed from the config
    bare = render_markdown(build_report({"backends": ["a"], "tests": [
        _probe_row("a", "deepseek-v2-lite", "bfloat16", cache_format="latent", bytes_per_token=1)]}, name="h", env=ENV))
    assert "latent not recorded, expanded not recorded. A row" in bare and "1,152" not in bare
    assert "0.0039" not in render_markdown(build_report(results(), name="h", env=ENV))


def test_rope_convention_in_the_report_and_the_terminal_summary():
    """conformance.md names the RoPE convention each backend's conventions test recorded; the plugin's
    terminal summary reads the same figure from the test reports."""
    conv = lambda b, c, outcome="passed", **kw: {
        "nodeid": f"suites/test_conventions.py::test_yarn_rope_attention_factor_convention[{b}]", "outcome": outcome,
        "section": "conventions", "params": {"backend": b},
        **({"figures": {"rope_convention": c, "rel_fro_transformers": 1e-7, "rel_fro_deepseek_v3": 3e-2}} if c else {}),
        **kw}
    res = {"backends": ["v2", "v3", "off"], "tests": [conv("v2", "transformers"), conv("v3", "deepseek-v3"),
                                                      conv("off", None, "skipped", reason="off: no YaRN here")]}
    md = render_markdown(build_report(res, name="h", env=ENV))
    sec = md[md.index("## RoPE convention"):]
    assert "| ok | v2 | **transformers** (transformers / DeepSeek-V2" in sec
    assert "| ok | v3 | **deepseek-v3** (DeepSeek-V3 reference" in sec
    assert "| skip | off | not recorded (skipped: off: no YaRN here) |" in sec
    from types import SimpleNamespace

    from mla_conformance.pytest_plugin.terminal import rope_conventions

    rep = lambda b, c: SimpleNamespace(when="call", nodeid=conv(b, c)["nodeid"],
                                       user_properties=[("mla_figures", {"rope_convention": c})])
    tr = SimpleNamespace(stats={"passed": [rep("v2", "transformers")], "failed": [rep("v3", "deepseek-v3")]})
    assert rope_conventions(tr) == {"v2": "transformers", "v3": "deepseek-v3"}


def test_floats_rounded_and_report_deterministic():
    a = build_report(results(), name="h", env=ENV)
    res = results()
    res["tests"].reverse()
    res["tests"][0]["figures"] = {**res["tests"][0].get("figures", {})}
    b = build_report(res, name="h", env=ENV)
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    assert render_markdown(a) == render_markdown(b)
    fig = next(t for t in a["tests"] if "[good-float32" in t["nodeid"])["figures"]
    assert fig["cosine_diff"] == 1.23e-13 and round_floats(1.2345678e-7) == 1.235e-7
    assert round_floats({"cosine_diff": 2.540190280342358e-13}) == round_floats({"cosine_diff": 2.539080057317733e-13})


# --------------------------------------------------------------------------- ops (the op contract)

DECL = {"lse_base": "e", "empty_row": "+inf", "page_block_sizes": [16, 64], "kv_formats": ["latent"],
        "fp8_scale_format": "pow2", "deterministic": True, "batch_invariant": False, "head_dims": [[576, 512]]}


def _op(nodeid, outcome, op, section, reason=None, figures=None, **params):
    t = {"nodeid": f"suites/{nodeid}", "outcome": outcome, "device": "cpu", "section": section,
         "params": {"op": op, **params}}
    if reason:
        t["reason"] = reason
    if figures:
        t["figures"] = figures
    return t


def _op_fig(case, out_rel_fro, **extra):
    return {"case": case, "check": "out/lse vs float64 oracle", "op": "x", "out_rel_fro": out_rel_fro,
            "out_max_abs": 1.23456e-6, "lse_max_abs": 2.5e-7, "queries": 64, "tolerance": "float32",
            "tolerance_out_rtol": 1e-5, "tolerance_out_atol": 2e-5, "tolerance_lse": 1e-5, "lse_base": "e", **extra}


def op_results():
    """A run with one layer backend and three ops: one conforming, one failing, one only skipped."""
    res = {"backends": ["good"], "ops": ["good-op", "base2-op", "idle-op"], "exitstatus": 1, "device": "cpu",
           "op_declarations": {"good-op": {**DECL, "head_dims": "any", "max_topk": 2048}, "base2-op": {**DECL, "lse_base": "2", "empty_row": "-inf",
                                                             "deterministic": False},
                               "idle-op": {**DECL, "kv_formats": ["latent", "fp8-e4m3-flashmla"]}},
           "tests": [_numerics("good", "passed", 5.0e-7, 2.0e-6),
                     _t("suites/test_budget.py::test_cli_json", "passed")]}
    case = "B=4, s_q=2, h_q=8, page=16, float32, latent, non-causal, cpu"
    for op, outcome, err in (("good-op", "passed", 3.9e-7), ("base2-op", "failed", 0.3)):
        res["tests"] += [
            _op(f"test_op_numerics.py::test_out_lse_vs_oracle[{op}-float32]", outcome, op, "op-numerics",
                reason="base2-op: lse off by ln 2 at row 0" if outcome == "failed" else None,
                figures=_op_fig(case, err), dtype="float32"),
            _op(f"test_op_numerics.py::test_batch_invariant[{op}]", "skipped", op, "op-determinism",
                reason=f"{op} does not declare batch_invariant"),
        ]
    res["tests"] += [_op("test_op_fp8.py::test_fp8_scales[idle-op]", "skipped", "idle-op", "op-fp8",
                         reason="idle-op: no FP8 here")]
    return res


def test_op_section_verdicts_declarations_and_cases():
    rep = build_report(op_results(), name="h", env=ENV)
    assert set(rep["summary"]) == {"good", INDEPENDENT} and rep["summary"][INDEPENDENT]["passed"] == 1
    assert rep["summary"]["good"]["passed"] == 1, "op rows count under no backend and not as independent"
    assert rep["ops"] == ["good-op", "base2-op", "idle-op"]
    ops = rep["op_results"]
    assert {o: v["verdict"] for o, v in ops.items()} == {"good-op": "CONFORMS", "base2-op": "DOES NOT CONFORM",
                                                         "idle-op": "NOT TESTED"}
    assert ops["good-op"]["executed"] == 1 and ops["good-op"]["summary"]["skipped"] == 1
    assert ops["idle-op"]["skip_reasons"] == [{"reason": "idle-op: no FP8 here", "count": 1}]
    assert ops["base2-op"]["declarations"]["lse_base"] == "2" and ops["base2-op"]["declarations"]["empty_row"] == "-inf"
    numerics = ops["good-op"]["sections"]["op-numerics"]
    assert numerics == [{"check": "out/lse vs float64 oracle",
                         "case": "B=4, s_q=2, h_q=8, page=16, float32, latent, non-causal, cpu", "outcome": "passed",
                         "nodeid": "suites/test_op_numerics.py::test_out_lse_vs_oracle[good-op-float32]",
                         "measured": {"out_rel_fro": 3.9e-7, "out_max_abs": 1.235e-6, "lse_max_abs": 2.5e-7,
                                      "queries": 64},
                         "tolerance": {"row": "float32", "out_rtol": 1e-5, "out_atol": 2e-5, "lse": 1e-5}}]
    assert ops["good-op"]["sections"]["op-determinism"] == [  # skipped before it described its case
        {"check": "test_batch_invariant", "case": "", "outcome": "skipped",
         "reason": "good-op does not declare batch_invariant",
         "nodeid": "suites/test_op_numerics.py::test_batch_invariant[good-op]"}]
    row = next(t for t in rep["tests"] if t["nodeid"].endswith("test_out_lse_vs_oracle[good-op-float32]"))
    assert row["op"] == "good-op" and row["params"] == {"dtype": "float32"} and "backend" not in row


def test_op_section_in_markdown():
    md = render_markdown(build_report(op_results(), name="h", env=ENV))
    ops = md[md.index("## Ops (the op contract)"):md.index("## Failures")]
    assert "| op | verdict | passed | failed | errors | skipped | xfailed | xpassed |\n" in ops
    assert "| base2-op | **DOES NOT CONFORM** | 0 | 1 | 0 | 1 | 0 | 0 |\n" in ops
    # the declarations, one row each where some op's differs from the contract's default (fp8 scales pow2 and batch
    # invariant False are every op's default here: no row), with the default and each op's
    decl = ops[ops.index("| declaration | default |"):]
    assert decl.startswith("| declaration | default | base2-op | good-op | idle-op |")
    assert [line.split(" | ")[0] for line in decl.splitlines()[2:] if line.startswith("| ")] == [
        "| LSE base", "| empty row lse", "| page sizes", "| KV formats", "| deterministic", "| head dims qk/v",
        "| max topk"]
    assert "| LSE base | e | 2 | e | e |" in decl and "| empty row lse | +inf | -inf | +inf | +inf |" in decl
    assert "| deterministic | no | no | yes | yes |" in decl and "| head dims qk/v | 576/512 | 576/512 | any | 576/512 |" in decl
    assert "| max topk | (not in the contract) |  | 2048 |  |" in decl, \
        "a declaration the report does not know gets a row of its own"
    assert "FP8 scales" not in ops and "batch invariant" not in ops, "a declaration at its default is no row"
    assert "**op idle-op: NOT TESTED** (0 conformance tests executed)" in ops and "- idle-op: no FP8 here (1 test)" in ops
    assert "| good | **CONFORMS** |" in md and "| idle-op |" not in md[:md.index("## Ops")], "ops not in the backends' table"
    cases = md[md.index("## Op cases"):]
    assert cases.index("### op-determinism") < cases.index("### op-fp8") < cases.index("### op-numerics")
    numerics = cases[cases.index("### op-numerics"):]
    rows = [line for line in numerics.splitlines() if line.startswith("| **FAIL**") or line.startswith("| ok")]
    assert rows[0].startswith("| **FAIL** | base2-op | out/lse vs float64 oracle | "
                              "B=4, s_q=2, h_q=8, page=16, float32, latent, non-causal, cpu | "
                              "lse_max_abs 2.500e-07, out_max_abs 1.235e-06, out_rel_fro 3.000e-01, queries 64; "
                              "base2-op: lse off by ln 2 at row 0 | float32 |"), \
        "failing rows first, measured figures and the bound (its OP_TOLERANCES row, derived in docs/tolerances.md)"
    assert rows[1].startswith("| ok | good-op |") and "out_rel_fro 3.900e-07" in rows[1]
    assert "| skip | idle-op | test_fp8_scales |  | idle-op: no FP8 here |  |" in cases
    assert "`suites/test_op_numerics.py::test_out_lse_vs_oracle[base2-op-float32]`" in md[md.index("## Failures"):]


def test_op_section_deterministic_and_absent_without_ops():
    a = build_report(op_results(), name="h", env=ENV)
    res = op_results()
    res["tests"].reverse()
    res["ops"] = list(reversed(res["ops"]))
    b = build_report(res, name="h", env=ENV)
    assert json.dumps(a["op_results"], sort_keys=True) == json.dumps(b["op_results"], sort_keys=True)
    assert render_markdown(a) == render_markdown(b)
    plain = build_report(results(), name="h", env=ENV)
    assert "ops" not in plain and "op_results" not in plain and "## Op" not in render_markdown(plain)
    only_ops = op_results()
    only_ops["backends"], only_ops["tests"] = [], [t for t in only_ops["tests"] if "op" in t.get("params", {})]
    md = render_markdown(build_report(only_ops, name="h", env=ENV))
    assert "No layer backend was under test in this run" in md and "| backend | verdict |" not in md


def test_merge_keeps_op_results_in_their_own_grid(capsys):
    a = build_report(op_results(), name="cpu-host", env=ENV)
    res = op_results()
    res["tests"][2]["outcome"] = "failed"  # good-op fails its numerics on the other host
    res["op_declarations"]["good-op"] = {**DECL, "lse_base": "2"}
    b = build_report(res, name="gpu-host", env={**ENV, "device": "cuda"})
    m1, md1 = merge_reports([("a.json", a), ("b.json", b)])
    m2, md2 = merge_reports([("b.json", b), ("a.json", a)])
    assert (m1, md1) == (m2, md2) and m1["schema_version"] == MATRIX_SCHEMA_VERSION
    assert not [c for c in m1["columns"] if "op" in c.split(" / ")[1]], "op columns stay out of the layer grid"
    ops = m1["ops"]
    assert ops["columns"] == ["cpu-host / base2-op", "cpu-host / good-op", "cpu-host / idle-op",
                              "gpu-host / base2-op", "gpu-host / good-op", "gpu-host / idle-op"]
    assert ops["verdicts"]["cpu-host / good-op"] == "CONFORMS" and ops["verdicts"]["gpu-host / good-op"] == "DOES NOT CONFORM"
    assert ops["verdicts"]["gpu-host / idle-op"] == "NOT TESTED"
    assert ops["declarations"]["gpu-host / good-op"]["lse_base"] == "2"
    row = ops["rows"]["suites/test_op_numerics.py::test_out_lse_vs_oracle[dtype=float32]"]
    assert row["cpu-host / good-op"]["outcome"] == "passed" and row["gpu-host / good-op"]["outcome"] == "failed"
    grid = md1[md1.index("## Ops (the op contract)"):]
    assert "| **LSE base** | 2 | e | e | 2 | 2 | e |" in grid and "| **empty row lse** | -inf | +inf |" in grid
    assert INDEPENDENT not in grid and INDEPENDENT in md1[:md1.index("## Ops")]


# --------------------------------------------------------------------------- merge


def test_merge_keeps_same_named_reports_apart_in_any_order(capsys):
    a = build_report(results(), name="host", env=ENV)
    res = results()
    res["tests"][0]["outcome"] = "failed"  # a modified copy of the same host's report
    b = build_report(res, name="host", env=ENV)
    assert a["run_id"] != b["run_id"]
    m1, md1 = merge_reports([("a.json", a), ("b.json", b)])
    err = capsys.readouterr().err
    m2, md2 = merge_reports([("b.json", b), ("a.json", a)])
    assert (m1, md1) == (m2, md2)
    assert "2 different reports are named 'host'" in err and "a.json" in err and "b.json" in err
    cols = [c for c in m1["columns"] if c.endswith("/ good")]
    assert cols == sorted([f"host [{a['run_id']}] / good", f"host [{b['run_id']}] / good"])
    row = m1["rows"]["suites/test_numerics.py::test_against_float64[dtype=float32, preset=tiny, scenario=prefill]"]
    assert {row[c]["outcome"] for c in cols} == {"passed", "failed"}
    assert md1.count("**FAIL**") == 2 + 1  # wrong in both, good in the modified copy


def test_merge_counts_an_identical_report_once(capsys):
    a = build_report(results(), name="host", env=ENV)
    m, _ = merge_reports([("a.json", a), ("copy.json", json.loads(json.dumps(a)))])
    assert "same report" in capsys.readouterr().err
    assert len(m["hosts"]) == 1 and "host / good" in m["columns"]
    assert m["verdicts"]["host / decliner"] == "NOT TESTED"


def test_merge_rejects_non_reports(tmp_path, capsys):
    from mla_conformance.cli import main

    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"schema": "something-else"}))
    assert main(["merge", str(bad), "--out", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "not an mla-conformance report" in err and "Traceback" not in err
    assert not (tmp_path / "m").exists()


# --------------------------------------------------------------------------- one real run, twice


def _run_here(pytester, out: str, *mode: str):
    """`mla-conformance run` on SUBSET into ``out``/ with pytest's ``mode`` options (``-p no:xdist``, or ``-n 2``:
    two worker processes, one torch thread each, their results handed to the controller). The pytest command `run`
    builds is run in this process through tests/meta/harness.py (pytester), where torch is already imported,
    instead of a fresh interpreter (its xdist workers are processes of their own); the command line, the results
    file and everything after are `run`'s own. Returns (tmp dir, out/, exit code, output)."""
    from mla_conformance.cli import main

    from .harness import pytest_inprocess

    shown: list[str] = []

    def pytest_here(cmd, watch=None):
        assert cmd[1:3] == ["-m", "pytest"], cmd
        # the plugin is imported already, so pytest cannot assertion-rewrite it: say nothing about that
        got = pytest_inprocess(pytester, *cmd[3:], "-W", "ignore::pytest.PytestAssertRewriteWarning")
        shown.extend(got.outlines + got.errlines)
        return int(got.ret), None

    tmp = pytester.path / f"run-{out}"
    tmp.mkdir()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(report_run, "_run_pytest", pytest_here)
        mp.chdir(tmp)
        rc = main(run_args(tmp / out, *mode))
    return tmp, tmp / out, rc, "\n".join(shown)


@pytest.fixture
def two_runs(suite_run):
    """The two runs, made once per session by the first test that asks (tests/conftest.py's suite_run): (the plain
    run's tmp dir, [a/, b/], [exit codes])."""
    tmp, a, rc_a, _ = suite_run("test_report-plain-run", lambda pytester: _run_here(pytester, "a", "-p", "no:xdist"))
    btmp, b, rc_b, output = suite_run("test_report-xdist-run", lambda pytester: _run_here(pytester, "b", "-n", "2"))
    assert rc_b == 0, f"the -n 2 run exited {rc_b}:\n{output[-3000:]}"
    assert not [p for p in btmp.iterdir() if p.name.startswith(".")], "temporary directories left behind (-n 2)"
    return tmp, [a, b], [rc_a, rc_b]


def test_run_plain_and_xdist_are_byte_identical(two_runs):
    tmp, outs, rcs = two_runs
    assert rcs == [0, 0]
    for fname in ("conformance.json", "conformance.md"):
        assert (outs[0] / fname).read_bytes() == (outs[1] / fname).read_bytes(), \
            f"{fname} differs between a plain run and -n 2"
    report = json.loads((outs[0] / "conformance.json").read_text())
    assert report["schema"] == "mla-conformance/report" and report["schema_version"] == 1
    assert report["summary"]["reference-absorbed"]["passed"] == 2
    assert report["verdicts"]["reference-naive"]["verdict"] == "CONFORMS"
    md = (outs[0] / "conformance.md").read_text()
    assert "29,952" in md and "266,240" in md and "8.888889" in md
    assert "(bytes_per_token.png)" in md and "(attention_error.png)" in md
    assert (outs[0] / "bytes_per_token.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (outs[0] / "timings.json").exists() and (outs[0] / MARKER).exists()
    assert not [p for p in tmp.iterdir() if p.name.startswith(".")], "temporary directories left behind"


def test_run_op_writes_the_op_section(two_runs):
    """`run --op reference-op`: the op's verdict, the declarations the run recorded, its cases and figures."""
    _, outs, _ = two_runs
    report = json.loads((outs[0] / "conformance.json").read_text())
    op = report["op_results"]["reference-op"]
    assert report["ops"] == ["reference-op"] and op["verdict"] == "CONFORMS" and op["executed"] == 2
    assert op["declarations"]["lse_base"] == "e" and op["declarations"]["empty_row"] == "+inf"
    assert set(op["sections"]) == {"op-numerics", "op-determinism"}
    (case,) = op["sections"]["op-numerics"]
    assert case["outcome"] == "passed" and "float32" in case["case"] and case["tolerance"]["row"] == "float32"
    assert 0 < case["measured"]["out_error_over_bound"] <= 1 and case["tolerance"]["dot"] > 0
    assert not [t for t in report["tests"] if t.get("op") and t.get("backend")]
    md = (outs[0] / "conformance.md").read_text()
    # its lse base (e) and empty row (+inf) are the contract's defaults: no row; its page sizes are not
    assert "| reference-op | **CONFORMS** | 2 | 0 | 0 | 0 | 0 | 0 |\n" in md
    assert "| page sizes | 64 | 1, 16, 64 |" in md and "| LSE base |" not in md
    assert "### op-numerics" in md and "### op-determinism" in md


def test_run_reports_merge_across_hosts(two_runs):
    tmp, outs, _ = two_runs
    from mla_conformance.cli import main

    a, b = (o / "conformance.json" for o in outs)
    gpu = json.loads(a.read_text())  # the same run as another host's: a name of its own, one op case failing
    gpu["name"] = "gpu-host"
    case = next(t for t in gpu["tests"] if t.get("op") and t["section"] == "op-numerics")
    case["outcome"] = "failed"
    gpu["op_results"]["reference-op"]["verdict"] = "DOES NOT CONFORM"
    (tmp / "gpu.json").write_text(json.dumps(gpu))
    assert main(["merge", str(a), str(b), str(tmp / "gpu.json"), "--out", str(tmp / "matrix")]) == 0
    matrix = json.loads((tmp / "matrix" / "matrix.json").read_text())
    assert [h["label"] for h in matrix["hosts"]] == ["gpu-host", "host"], "a and b are one report, counted once"
    assert "host / reference-absorbed" in matrix["columns"] and "gpu-host / reference-naive" in matrix["columns"]
    assert matrix["rows"]["suites/test_cache_bytes.py::test_seed_table"]["host / reference-naive"]["outcome"] == "passed"
    ops = matrix["ops"]
    assert ops["columns"] == ["gpu-host / reference-op", "host / reference-op"]
    assert ops["verdicts"] == {"gpu-host / reference-op": "DOES NOT CONFORM", "host / reference-op": "CONFORMS"}
    row = ops["rows"]["suites/test_op_numerics.py::test_out_lse_vs_oracle[dtype=float32]"]
    assert row == {"gpu-host / reference-op": {"outcome": "failed"}, "host / reference-op": {"outcome": "passed"}}
    md = (tmp / "matrix" / "matrix.md").read_text()
    assert "| check |" in md and "## Ops (the op contract)" in md and "| **LSE base** | e | e |" in md


def test_sections_come_from_records_not_test_names():
    """A renamed test keeps its report section: rows are found by their recorded section."""
    renamed = results()
    for t in renamed["tests"]:
        t["nodeid"] = t["nodeid"].replace("test_against_float64", "test_output_vs_oracle").replace(
            "test_seed_table", "test_probe_bytes")
    md_a = render_markdown(build_report(results(), name="h", env=ENV))
    md_b = render_markdown(build_report(renamed, name="h", env=ENV))
    strip = lambda md: md.replace("test_output_vs_oracle", "test_against_float64").replace("test_probe_bytes",
                                                                                           "test_seed_table")
    assert strip(md_b) == md_a
    assert "Cache bytes: the V2-Lite cache probe" in md_b


# --------------------------------------------------------------------------- issue 20: schema, grouping, no stray output


def test_identical_failures_are_one_row_with_a_count():
    """One exception raised by 62 tests is one row: the count and the first few test ids."""
    res = {"backends": ["crashy"], "tests": [
        _t(f"suites/test_numerics.py::test_against_float64[crashy-float32-case{i:02d}]", "error", "crashy",
           reason="BackendError: crashy.attend raised RuntimeError: boom", dtype="float32", preset="tiny",
           scenario=f"case{i:02d}") for i in range(62)]}
    res["tests"].append(_t("suites/test_numerics.py::test_against_float64[crashy-bfloat16-x]", "error", "crashy",
                           reason="BackendError: crashy.attend raised ValueError: other", dtype="bfloat16"))
    md = render_markdown(build_report(res, name="h", env=ENV))
    fails = md[md.index("## Failures"):].split("\n\n")[1].splitlines()[2:]
    assert len(fails) == 2, fails
    boom = next(line for line in fails if "boom" in line)
    assert boom.startswith("| error | 62 tests: `suites/test_numerics.py::test_against_float64[crashy-float32-case00]`, ")
    assert "case02]` and 59 more | BackendError: crashy.attend raised RuntimeError: boom |" in boom
    assert "case03" not in boom
    assert "| error | `suites/test_numerics.py::test_against_float64[crashy-bfloat16-x]` | " in md


def test_figures_refuse_an_undeclared_key():
    from mla_conformance.schema import FIGURES, Figures, is_declared

    f = Figures(rel_fro=1e-7)
    f.update({"max_abs": 1.0}, case="x")
    f["row3_vs_float64"] = 0.5
    f.setdefault("check", "c")
    assert dict(f) == {"rel_fro": 1e-7, "max_abs": 1.0, "case": "x", "row3_vs_float64": 0.5, "check": "c"}
    for write in (lambda: f.__setitem__("rel_frob", 1), lambda: f.update(rel_frob=1), lambda: f.update({"x y": 1}),
                  lambda: f.setdefault("nope"), lambda: Figures(nope=1)):
        with pytest.raises(KeyError) as exc:
            write()
        assert "is not declared" in str(exc.value) and "mla_conformance/schema.py" in str(exc.value)
        assert "\n" not in str(exc.value)
    assert not is_declared("rowx_vs_float64") and list(FIGURES) == sorted(FIGURES), "FIGURES is kept sorted"


def test_renderers_read_only_declared_figures_and_sections():
    """Every figure key and section the report's renderers read by string is declared in mla_conformance/schema.py,
    and no renderer imports checks or the config."""
    import re

    from mla_conformance.schema import FIGURES, SECTIONS, is_declared

    src = "\n".join((ROOT / "mla_conformance" / "report" / f).read_text()
                    for f in ("build.py", "markdown.py", "sections.py", "plots.py", "merge.py"))
    figure_reads = set(re.findall(r'\bf(?:igures"\])?(?:\.get\(|\[)"([a-z0-9_]+)"', src))
    for args in re.findall(r'number\([^,()]*(?:\([^)]*\))?[^,()]*, ([^)]*)\)', src):  # number(f, "key", ...)
        figure_reads |= set(re.findall(r'"([a-z0-9_]+)"', args))
    assert len(figure_reads) > 25, figure_reads
    undeclared = sorted(k for k in figure_reads if not is_declared(k) and not k.startswith("formula_{"))
    assert not undeclared, f"read but not declared in FIGURES: {undeclared}"
    sections = set(re.findall(r'in_section\(report, "([a-z0-9_-]+)"\)', src))
    sections |= set(re.findall(r'"section"\) == "([a-z0-9_-]+)"', src))
    assert sections and not sections - set(SECTIONS), sections - set(SECTIONS)
    for forbidden in (r"mla_conformance\.checks", r"MLAConfig", r"(?<!OP_)TOLERANCES", r"format_bytes_per_token\(",
                      r"import torch", r"mla_conformance\.model\.config"):
        assert not re.search(forbidden, src), forbidden
    assert FIGURES and "except ImportError" not in src


def test_generic_sections_get_a_table_of_their_own():
    from mla_conformance.contract.methods import METHOD_SPECS
    from mla_conformance.report.markdown import GENERIC_SECTIONS

    # the optional methods' sections (their MethodSpecs'), the composition's and the generated cases'
    optional = {sec for spec in METHOD_SPECS if not spec.base for sec in spec.sections}
    assert {"op_prefill", "op_sparse_prefill", "op_merge", "op_write"} <= optional
    assert optional | {"op_composition", "op_generated", "layer_generated"} == set(GENERIC_SECTIONS)
    res = op_results()
    res["tests"] += [
        _op("test_op_prefill.py::test_prefill_vs_oracle[good-op-float32]", "failed", "good-op", "op_prefill",
            reason="good-op: out differs", figures=_op_fig("prefill B=2", 0.3, out_error_over_bound=4.5)),
        _t("suites/test_layer_generated.py::test_generated[good-case0]", "passed", "good", section="x",
           figures={"case": "generated case 0", "rel_fro": 1e-7, "tolerance_rel_fro": 1e-5})]
    res["tests"][-1]["section"] = "layer_generated"
    md = render_markdown(build_report(res, name="h", env=ENV))
    prefill = md[md.index("## op_prefill:"):]
    assert "| **FAIL** | good-op | test_prefill_vs_oracle | prefill B=2 | 4.500e+00 x the bound; good-op: out differs |" \
        in prefill
    layer = md[md.index("## layer_generated:"):]
    assert "| ok | good | test_generated | generated case 0 | rel_fro 1.000e-07 (tolerance 1.000e-05) |" in layer
    assert "### op_prefill" not in md[md.index("## Op cases"):], "not twice"


@pytest.mark.parametrize("argv", [["--device", "cuda:7"], ["--backend", "nope"], ["--op", "nope"],
                                  ["--name", "a/b"]])
def test_a_run_that_fails_on_its_inputs_writes_nothing(tmp_path, monkeypatch, capsys, argv):
    """Not even an empty reports/ (the default --out's parent) or the --out given."""
    import torch

    from mla_conformance.cli import main

    if argv[0] == "--device" and torch.cuda.device_count() > 7:
        pytest.skip("this host has a cuda:7")
    monkeypatch.chdir(tmp_path)
    ran = []
    monkeypatch.setattr(report_run, "_run_pytest", lambda cmd, watch=None: ran.append(cmd) or (0, None))
    assert main(["run", *argv]) == 2 and main(["run", "--out", str(tmp_path / "x" / "y"), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("mla-conformance run: error: ") for line in err), err
    assert not ran and not list(tmp_path.iterdir()), list(tmp_path.iterdir())


def test_merge_prints_whole_words_at_the_terminal_width_and_keeps_the_full_text_in_the_file(tmp_path, capsys,
                                                                                          monkeypatch):
    from mla_conformance.cli import main

    reason = ("decliner: this backend declares no latent cache here, so the numerics of the latent path "
              "(prefill, decode, varlen batches) are not checked on it")
    res = results()
    for t in res["tests"]:
        if t["outcome"] == "skipped":
            t["reason"] = reason
    src = tmp_path / "a.json"
    src.write_text(json.dumps(build_report(res, name="host", env=ENV)))
    monkeypatch.setenv("COLUMNS", "50")
    assert main(["merge", str(src), "--out", str(tmp_path / "m")]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert all(len(line) <= 50 or len(line.split()) == 1 for line in lines), [x for x in lines if len(x) > 50]
    assert "host / decliner: NOT TESTED" in out and "3 x decliner: this backend" in out
    assert " ".join(out.split()).count(reason) == 1, "every word whole, none cut"
    md = (tmp_path / "m" / "matrix.md").read_text()
    assert f"skip: {reason} |" in md
