"""``mla-conformance bench`` times no wrong kernel: a broken backend, a broken op behind the layer contract (its
layer output wrong) and a broken op whose layer output is right but whose lse is wrong (caught by the op-level
check) each get "not timed: wrong output (...)" and no figure, the command exits 1, and the correct backend next
to them is timed."""

import contextlib
import io
import json

import pytest

from mla_conformance.cli import main
from mla_conformance.perf import timing
from mla_conformance.perf.table import format_table

BROKEN = {"tests/meta/broken_backends.py:WrongSoftmaxScale": ("broken-softmax-scale", "rel_fro"),
          "op:tests/meta/broken_ops.py:ReadsPageTail": ("op:broken-reads-page-tail", "non-finite"),
          "op:tests/meta/broken_ops.py:Base2DeclaredE": ("op:broken-lse-base2-as-e", "OP_TOLERANCES")}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One ``bench`` run (v3-mini, 70 cached tokens: a 64-token page and its tail) of the three broken kernels and
    reference-absorbed; the copy bandwidth read from 8 MiB instead of 256 (a figure no test here reads)."""
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    argv = ["bench", "--preset", "v3-mini", "--context", "70", "--rounds", "1", "--warmup", "0", "--json",
            "--out", str(out)]
    for spec in [*BROKEN, "reference-absorbed"]:
        argv += ["--backend", spec]
    stdout, stderr = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(timing, "_BANDWIDTH", {"cpu": timing.measure_bandwidth("cpu", nbytes=8 << 20, refresh=True)})
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            rc = main(argv)
    return rc, json.loads(stdout.getvalue()), stderr.getvalue(), json.loads(out.read_text())


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
    assert c["outcome"] == "pass" and c["measured"]["rel_fro"] <= c["bound"]["rel_fro"]
    assert c["checked"]["kv_codec"] == "none" and c["checked"]["batch"] == 1
