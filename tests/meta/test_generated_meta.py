"""The generated-case suites find the geometry classes the hand-written ones miss: each broken op of
tests/meta/impls/kernel_style/geometry_ops.py (wide support declared, wrong on one class only) and the broken backend of
tests/meta/impls/broken/geometry_backends.py must be *failed* by the default run (default profile, derandomized) of its
generated test, with a shrunk case that shows the class, and the command the failure prints must replay exactly
that case; the correct wide-declaring op and the independent backend pass every generated test. Through the plugin
(--mla-op, --mla-backend, --mla-results): a run of the cells and one of the correct implementations
(tests/meta/kill_matrix.py generated_runs); then one in-process session per printed command."""

import json
import shlex

import pytest

from mla_conformance.checks.strategies import parse_case
from tests.meta import harness
from .generated_cells import ROOT, SUITES, BROKEN, CORRECT, CELLS
from .kill_matrix import generated_runs

pytestmark = pytest.mark.meta


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
    assert got.get("reason", "").startswith(f"{name} ["), f"the failure does not name the implementation: {got}"
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
    assert got["reason"] == failed["reason"].split("\n")[0], (command, got["reason"], failed["reason"])


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
