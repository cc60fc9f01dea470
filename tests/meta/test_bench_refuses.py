"""``mla-conformance bench`` times no wrong kernel: a broken backend, a broken op behind the layer contract (its
layer output wrong) and a broken op whose layer output is right but whose lse is wrong (caught by the op-level
check) each get "not timed: wrong output (...)" and no figure, the command exits 1, and the correct backend next
to them is timed. At a long row (1016 cached tokens), where the gate's bound carries the score-rounding term
(mla_conformance.perf.score_rounding), the references that TOLERANCES' bf16 bound alone would refuse are timed and a
backend wrong by a few times that bound (tests/meta/impls/broken/bench_backends.py) is not."""

import contextlib
import io
import json

import pytest

from mla_conformance.checks.tolerances import TOLERANCES
from mla_conformance.cli import main
from mla_conformance.perf import timing
from mla_conformance.perf.table import format_table

BROKEN = {"tests/meta/impls/broken/backends.py:WrongSoftmaxScale": ("broken-softmax-scale", "rel_fro"),
          "op:tests/meta/impls/broken/ops.py:ReadsPageTail": ("op:broken-reads-page-tail", "non-finite"),
          "op:tests/meta/impls/broken/ops.py:Base2DeclaredE": ("op:broken-lse-base2-as-e", "OP_TOLERANCES")}


def bench(tmp_path_factory, specs, *extra):
    """One ``bench`` run on v3-mini of ``specs`` (rc, the JSON printed, stderr, the JSON written); the copy bandwidth
    read from 8 MiB instead of 256 (a figure no test here reads)."""
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    argv = ["bench", "--preset", "v3-mini", *extra, "--rounds", "1", "--warmup", "0", "--json", "--out", str(out)]
    for spec in specs:
        argv += ["--backend", spec]
    stdout, stderr = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(timing, "_BANDWIDTH", {"cpu": timing.measure_bandwidth("cpu", nbytes=8 << 20, refresh=True)})
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            rc = main(argv)
    return rc, json.loads(stdout.getvalue()), stderr.getvalue(), json.loads(out.read_text())


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The three broken kernels and reference-absorbed at 70 cached tokens (a 64-token page and its tail)."""
    return bench(tmp_path_factory, [*BROKEN, "reference-absorbed"], "--context", "70")


LONG_BROKEN = "tests/meta/impls/broken/bench_backends.py:MscaleOnce"
CORRECT = ("reference-naive",)  # reference-absorbed at this row: tests/test_bench_gate.py


@pytest.fixture(scope="module")
def long_run(tmp_path_factory):
    """broken-mscale-once and reference-naive at 1016 cached tokens, 2 rows (row 1: TOLERANCES' bf16 rel_fro is
    exceeded by the references' score rounding alone, tests/test_bench_gate.py)."""
    return bench(tmp_path_factory, [LONG_BROKEN, *CORRECT], "--context", "1016", "--batch", "2")


def test_exit_status_says_something_was_not_timed(run):
    rc, report, _, written = run
    assert rc == 1 and written == report


@pytest.mark.parametrize("spec", list(BROKEN))
def test_a_wrong_kernel_gets_no_figure_and_a_reason(run, spec):
    _, report, err, _ = run
    name, measured = BROKEN[spec]
    row = next(r for r in report["results"] if r["backend"] == name)
    assert row["not_timed"].startswith("not timed: wrong output (") and measured in row["not_timed"]
    assert row["gb_per_s"] is None and row["median_s"] is None
    assert row["correctness"]["outcome"] == "wrong output"
    assert row["correctness"]["checked"]["context"] == 70 and row["correctness"]["checked"]["preset"] == "v3-mini"
    assert f"{name} context 70: {row['not_timed']}" in err
    line = next(line for line in format_table(report).splitlines() if line.startswith(name + " "))
    assert "not timed: wrong output (" in line and "GB/s" not in line


def test_the_correct_backend_is_timed(run):
    _, report, _, _ = run
    row = next(r for r in report["results"] if r["backend"] == "reference-absorbed")
    assert row["gb_per_s"] > 0 and "not_timed" not in row
    c = row["correctness"]
    assert c["outcome"] == "pass" and all(m["rel_fro"] <= b["rel_fro"] and m["max_rel"] <= b["max_rel"]
                                          for m, b in zip(c["measured"]["rows"], c["bound"]["rows"]))
    assert c["checked"]["kv_codec"] == "none" and c["checked"]["batch"] == 1


@pytest.mark.parametrize("name", CORRECT)
def test_correct_references_at_a_long_row_are_timed(long_run, name):
    """Over TOLERANCES' bf16 rel_fro on a row, within the suite's bound plus the row's score-rounding term."""
    _, report, _, _ = long_run
    row = next(r for r in report["results"] if r["backend"] == name)
    assert row["gb_per_s"] > 0 and "not_timed" not in row, row.get("not_timed")
    measured, bounds = row["correctness"]["measured"]["rows"], row["correctness"]["bound"]["rows"]
    assert max(m["rel_fro"] for m in measured) > TOLERANCES["bfloat16"].rel_fro, measured
    assert all(m["rel_fro"] <= b["rel_fro"] for m, b in zip(measured, bounds)), (measured, bounds)


def test_a_kernel_wrong_by_a_few_times_the_long_row_bound_is_not_timed(long_run):
    """broken-mscale-once: every row over its bound (suite + score rounding) by at least 1.5x, refused, exit
    status 1."""
    rc, report, err, _ = long_run
    row = next(r for r in report["results"] if r["backend"] == "broken-mscale-once")
    assert rc == 1 and row["gb_per_s"] is None and "score rounding" in row["not_timed"], row.get("not_timed")
    measured, bounds = row["correctness"]["measured"]["rows"], row["correctness"]["bound"]["rows"]
    assert all(m["rel_fro"] >= 1.5 * b["rel_fro"] for m, b in zip(measured, bounds)), (measured, bounds)
    assert f"broken-mscale-once context 1016: {row['not_timed']}" in err
