"""The generated-case suites find the geometry classes the hand-written ones miss: each broken op of
tests/meta/impls/kernel_style/geometry_ops.py (wide support declared, wrong on one class only) and the broken backend of
tests/meta/impls/broken/geometry_backends.py must be *failed* by the default run (default profile, derandomized) of its
generated test, with a shrunk case that shows the class, and the command the failure prints must replay exactly
that case; the correct wide-declaring op and the independent backend pass every generated test. Through the plugin
(--mla-op, --mla-backend, --mla-results): a run of the cells and one of the correct implementations
(:func:`generated_runs`); then one in-process session per printed command."""

import json
import math
import shlex
from pathlib import Path

import pytest

from mla_conformance.checks.strategies import parse_case
from tests.meta import harness

pytestmark = pytest.mark.meta

ROOT = Path(__file__).resolve().parent.parent.parent
SUITES = ["suites/test_op_generated.py", "suites/test_layer_generated.py"]
OPS = ROOT / "tests" / "meta" / "impls" / "kernel_style" / "geometry_ops.py"


def _pow2(n: int) -> bool:
    return n & (n - 1) == 0


#: broken implementation -> (option, spec, the name it reports, the generated test that must fail it, what the shrunk
#: case must show: a predicate on the parsed case and the class in words)
BROKEN = {
    "page-bitmask": ("--mla-op", f"{OPS}:BrokenPageBitmask", "broken-page-bitmask", "test_op_generated.py::test_generated_pages",
                     lambda c: not _pow2(c.page) and max(c.lens) > 2 ** int(math.log2(c.page)),
                     "a page size not a power of two, a row past its first 2^floor(log2 P) keys"),
    "tail-head-tile": ("--mla-op", f"{OPS}:BrokenTailHeadTile", "broken-tail-head-tile", "test_op_generated.py::test_generated_heads",
                       lambda c: c.h_q == 126, "126 heads (a tail tile of 62 after one of 64)"),
    "odd-heads": ("--mla-op", f"{OPS}:BrokenOddHeads", "broken-odd-heads", "test_op_generated.py::test_generated_heads",
                  lambda c: c.h_q > 8 and c.h_q % 2 == 1 and c.h_q < 64, "an odd head count above 8"),
    "causal-non-pow2": ("--mla-op", f"{OPS}:BrokenCausalNonPow2", "broken-causal-non-pow2", "test_op_generated.py::test_generated_mtp",
                        lambda c: c.causal and c.s_q == 3, "causal s_q = 3"),
    "rows-capped": ("--mla-op", f"{OPS}:BrokenRowsCapped", "broken-rows-capped-2048", "test_op_generated.py::test_generated_long_rows",
                    lambda c: max(c.lens) > 2048, "a row past 2048 keys"),
    "batch-capped": ("--mla-op", f"{OPS}:BrokenBatchCapped", "broken-batch-capped-32", "test_op_generated.py::test_generated_batch",
                     lambda c: c.batch == 33, "33 rows"),
    "topk-tail": ("--mla-op", f"{OPS}:BrokenTopkTail", "broken-topk-tail-dropped", "test_op_generated.py::test_generated_sparse",
                  lambda c: c.topk is not None and c.topk > 64 and c.topk % 64, "top-k above 64, not a multiple of 64"),
    "zero-new-token-rows": ("--mla-backend", "tests/meta/impls/broken/geometry_backends.py:BrokenZeroNewTokenRows",
                            "broken-zero-new-token-rows", "test_layer_generated.py::test_generated_layer",
                            lambda c: c.batch >= 2 and c.chunk is not None and c.chunk < max(c.prefill) and c.decode >= 1,
                            "ragged rows prefilled in chunks (a row with no new tokens in a call), then decode"),
}
#: correct implementations: every generated test of theirs must pass
CORRECT = {"wide-geometry-op": ("--mla-op", f"{OPS}:WideOp"),
           "independent-absorbed": ("--mla-backend", "tests/meta/impls/independent/backend.py:IndependentMLA")}


def _node(test: str, name: str) -> str:
    return f"suites/{test}[{name}]"


CELLS = {key: _node(test, name) for key, (_, _, name, test, _, _) in BROKEN.items()}


def _split(specs) -> tuple[list[str], list[str]]:
    return ([s for o, s, *_ in specs if o == "--mla-backend"], [s for o, s, *_ in specs if o == "--mla-op"])


def generated_runs(pytester) -> harness.SuiteRun:
    """The generated-case meta run: each broken implementation's cell, and every
    generated test of the correct ones; one SuiteRun of both."""
    backends, ops = _split(BROKEN.values())
    cells = harness.run_inprocess(pytester, list(CELLS.values()), backends=backends, ops=ops, expect=1)
    backends, ops = _split(CORRECT.values())
    return cells.joined(harness.run_inprocess(pytester, SUITES, backends=backends, ops=ops))



@pytest.fixture
def run(suite_run) -> harness.SuiteRun:
    """The default-profile run of both generated suites with every implementation of the tables: each broken one's
    cell and every generated test of the correct ones."""
    return suite_run("generated-matrix", generated_runs)


@pytest.mark.parametrize("key", list(BROKEN))
def test_broken_geometry_is_failed_with_a_shrunk_case_showing_it(run, key):
    _, _, name, _, shows, words = BROKEN[key]
    got = run.by_id.get(CELLS[key])
    assert got is not None, f"{CELLS[key]} did not run"
    assert got["outcome"] == "failed", f"{CELLS[key]}: expected a failure of {name}, got {got['outcome']}: " \
                                       f"{got.get('reason', '')}"
    assert got.get("reason", "").startswith(f"{name} ") and "\n  case: " in got["reason"], \
        f"the failure does not name the implementation and (on a line of its own) the case: {got}"
    figures = got.get("figures", {})
    case = parse_case(figures.get("generated_case", ""))
    assert shows(case), f"{name}: the shrunk case {figures['generated_case']!r} does not show {words}"
    assert figures.get("reproducer", "").startswith("pytest ") and "--mla-case" in figures["reproducer"], figures


@pytest.mark.parametrize("name", list(CORRECT))
def test_correct_implementation_passes_every_generated_test(run, name):
    rows = [t for t in run["tests"] if t["nodeid"].split("::")[0] in SUITES
            and name in (t.get("params", {}).get("op"), t.get("params", {}).get("backend"))]
    expected = 7 if CORRECT[name][0] == "--mla-op" else 1
    assert len(rows) == expected, f"{name}: {len(rows)} generated tests ran, expected {expected}"
    bad = [f"{t['nodeid']}: {t['outcome']} {t.get('reason', '')}" for t in rows if t["outcome"] != "passed"]
    assert not bad, f"{name} does not pass:\n" + "\n".join(bad)
    empty = [t["nodeid"] for t in rows if not all(t["figures"]["generated_examples_per_stratum"].values())]
    assert not empty, f"{name}: a stratum ran no case in {empty}"


@pytest.fixture
def replays(run, suite_run) -> dict:
    """Each broken implementation's printed command, run as printed (from the checkout's root, as a user types
    it there), one in-process session each."""
    def build(pytester):
        out = {}
        for key, nodeid in CELLS.items():
            command = run.by_id[nodeid]["figures"]["reproducer"]
            words = shlex.split(command)
            assert words[0] == "pytest", command
            results = pytester.path / f"replay-{key}.json"
            got = harness.pytest_inprocess(pytester, *harness.BASE, "--rootdir", str(ROOT), "--mla-results",
                                           str(results), *map(harness.here, words[1:]))
            payload = json.loads(results.read_text()) if results.is_file() else {}
            out[key] = (command, int(got.ret), payload, "\n".join(got.outlines + got.errlines))
        return out
    return suite_run("generated-replays", build)


@pytest.mark.parametrize("key", list(BROKEN))
def test_printed_command_replays_exactly_the_case(run, replays, key):
    command, code, payload, log = replays[key]
    tests = payload.get("tests", [])
    assert code == 1 and len(tests) == 1, f"{command}: exit {code}, {len(tests)} test(s) ran:\n{log[-3000:]}"
    got, failed = tests[0], run.by_id[CELLS[key]]
    assert got["outcome"] == "failed" and got["nodeid"] == CELLS[key], (command, got)
    assert got["figures"]["generated_examples"] == 1, f"{command}: ran {got['figures']['generated_examples']} cases"
    assert got["figures"]["generated_case"] == failed["figures"]["generated_case"], (command, got["figures"])
    assert _verdict(got["reason"]) == _verdict(failed["reason"]), (command, got["reason"], failed["reason"])


def _verdict(reason: str) -> list[str]:
    """A failure's lines but the case it ran and the command replaying it (a replay's own)."""
    return [line for line in reason.splitlines()
            if not line.lstrip().startswith(("minimal case (", "replay exactly this case:"))]


def test_the_default_profile_draws_the_same_cases_in_every_run():
    """Deterministic: the default profile draws the same cases twice (and the thorough one, random, others)."""
    from hypothesis import given

    from mla_conformance.checks.strategies import OpSupport, layer_strata, op_strata
    from mla_conformance.pytest_plugin.generated import hypothesis_settings

    support = OpSupport(pages=(64, 16, 1, 48), formats=(("latent", "float32"), ("latent", "bfloat16")),
                        sparse_formats=(("latent", "float32"),), invalid=("minus-one", "past-end"), sink=True)
    strata = [s for p in ("heads", "pages", "mtp", "batch", "sparse", "mixed") for s in op_strata(p, support)]
    strata += layer_strata((("tiny", None), ("tiny-dsa", 16)))

    def draw(profile, strata, share=1.0):
        seen = []
        for stratum in strata:
            hypothesis_settings(profile, stratum.share * share)(given(stratum.strategy)(
                lambda case: seen.append(str(case))))()
        return seen

    first = draw("mla-conformance", strata)
    assert first == draw("mla-conformance", strata) and len(first) >= len(strata)
    # the thorough profile is random: two runs of 3 cases of each of two strata differ
    assert draw("mla-conformance-thorough", strata[:2], 0.05) != draw("mla-conformance-thorough", strata[:2], 0.05)
