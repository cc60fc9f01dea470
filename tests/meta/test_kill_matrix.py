"""Every conformance test can fail, and correct code passes it: each cell of :data:`KILL_MATRIX`
runs a conformance test on a broken backend and must come out *failed* -- an AssertionError verdict naming
the backend, not an error, a skip or a pass; the same tests on the correct backends written independently
of the reference must pass (or skip an optional part they do not implement). All of it in one run of the suite
(:func:`layer_matrix_run`), through the plugin as a user runs it (tests/meta/harness.py); and every
conformance test of suites/ has a cell."""

import ast
from pathlib import Path

import pytest

from . import harness
from mla_conformance.contract.methods import METHOD_SUITES

pytestmark = pytest.mark.meta

HERE = "tests/meta"

#: backend spec -> the name it reports (test ids carry the name)
BROKEN = {
    "rope-layout": (f"{HERE}/impls/broken/backends.py:RopeLayoutMixup", "broken-rope-layout"),
    "kv-b-swapped": (f"{HERE}/impls/broken/backends.py:KvBSwapped", "broken-kv-b-swapped"),
    "decode-position": (f"{HERE}/impls/broken/backends.py:ShiftedDecodePosition", "broken-decode-position"),
    "lying-bytes": (f"{HERE}/impls/broken/backends.py:LyingBytes", "broken-lying-bytes"),
    "expanded-uint8": (f"{HERE}/impls/broken/caches.py:ExpandedUint8ClaimsLatent", "broken-expanded-uint8-pool"),
    "scales-not-counted": (f"{HERE}/impls/broken/caches.py:ScalesNotCounted", "broken-scales-not-counted"),
    "int8-codec": (f"{HERE}/impls/broken/caches.py:BadInt8Codec", "broken-int8-codec"),
    "leaky-pages": (f"{HERE}/impls/broken/caches.py:LeakyPages", "broken-leaky-pages"),
    "paged-bytes": (f"{HERE}/impls/broken/caches.py:PagedBytesUncounted", "broken-paged-bytes"),
    "dsa-interleaved-rope": (f"{HERE}/impls/broken/backends.py:InterleavedIndexerRope", "broken-dsa-interleaved-indexer-rope"),
    "dsa-topk-off-by-one": (f"{HERE}/impls/broken/backends.py:TopkOffByOne", "broken-dsa-topk-off-by-one"),
    "dsa-keys-hidden": (f"{HERE}/impls/broken/backends.py:IndexerKeysHidden", "broken-dsa-indexer-keys-hidden"),
    "dsa-v32-prefix-bf16": (f"{HERE}/impls/independent/deepseek_v32_backend.py:DeepSeekV32PreFixBF16Key",
                            "broken-dsa-v32-prefix-interleaved-bf16"),
    # padded batches (tests/meta/impls/broken/padding_backends.py): idle rows, multi-token steps
    "idle-row-decodes": (f"{HERE}/impls/broken/padding_backends.py:IdleRowDecodes", "broken-idle-row-decodes"),
    "idle-row-writes-slot": (f"{HERE}/impls/broken/padding_backends.py:IdleRowWritesSlot", "broken-idle-row-writes-slot"),
    "idle-rows-compacted": (f"{HERE}/impls/broken/padding_backends.py:IdleRowsCompacted", "broken-idle-rows-compacted"),
    "verify-same-output": (f"{HERE}/impls/broken/padding_backends.py:VerifyStepSameOutput", "broken-verify-step-same-output"),
    "verify-padding-appended": (f"{HERE}/impls/broken/padding_backends.py:VerifyPaddingAppended",
                                "broken-verify-padding-appended"),
}
#: a layer cell's failure must say this (the likely cause), for the broken backends named
LAYER_HINTS = {"idle-row-decodes": "was idle (lengths 0) but its seq_lens went",
               "idle-row-writes-slot": "the token storage of idle row(s) [1, 3] (lengths 0) changed",
               "idle-rows-compacted": "likely cause: the idle rows (lengths 0) change their neighbours",
               "verify-same-output": "likely cause: every query position of a multi-token step gets the same output",
               "verify-padding-appended": "likely cause: the right padding counted as tokens"}

#: correct backends written independently of the reference: on their cells (every cell's first
#: parametrisation, or the tests named) they must pass, or skip where they do not implement an optional
#: part (paging, quantized codecs)
CORRECT = {
    "independent": (f"{HERE}/impls/independent/backend.py:IndependentMLA", "independent-absorbed"),
    "overallocating": (f"{HERE}/impls/broken/caches.py:OverAllocating", "independent-overallocating"),
    "v3-style": (f"{HERE}/impls/independent/v3_reference_backend.py:DeepSeekV3StyleMLA", "deepseek-v3-style"),
    "reference-dsa": ("reference-dsa", "reference-dsa"),
    # the base contract as the README shows it, frozen (never edited): its verdict must not move as features land
    "frozen-base": (f"{HERE}/frozen_base_backend.py:MyBackend", "my-mla"),
}
CORRECT_TESTS = {
    "independent": "all but V3 dims",  # every cell but the V3-dims bytes (DeepSeek-V3-sized weights; same rule as bytes_formula)
    "frozen-base": "all but V3 dims",
    "overallocating": ("suites/test_cache_bytes.py::test_seed_table", "suites/test_cache_bytes.py::test_bytes_formula"),
    "v3-style": ("suites/test_numerics.py::test_against_float64", "suites/test_numerics.py::test_incremental_equals_prefill",
                 "suites/test_conventions.py::test_yarn_rope_attention_factor_convention",
                 "suites/test_checkpoint.py::test_prefill_decode_on_checkpoint",
                 "suites/test_generation_golden.py::test_golden_generation", "suites/test_cache_bytes.py::test_seed_table"),
    "reference-dsa": ("suites/test_dsa.py::test_sparse_attention", "suites/test_dsa.py::test_short_context_is_dense",
                      "suites/test_dsa.py::test_selection", "suites/test_cache_bytes.py::test_bytes_formula_dsa",
                      "suites/test_dsa.py::test_cache_bytes_v32_dims", "suites/test_dsa.py::test_indexer_scores"),
}

#: conformance test (file::function) -> [(broken key, the parametrisation after the backend name)]
KILL_MATRIX = {
    "suites/test_cache_bytes.py::test_seed_table": [("expanded-uint8", "")],
    "suites/test_cache_bytes.py::test_bytes_formula": [("lying-bytes", "-6-2-3-float32-tiny")],
    "suites/test_cache_bytes.py::test_bytes_formula_v3_dims": [("lying-bytes", "-deepseek-v3")],
    "suites/test_cache_bytes.py::test_bytes_formula_dsa": [("dsa-keys-hidden", "-6-2-3-tiny-dsa-bfloat16")],
    "suites/test_dsa.py::test_sparse_attention": [("dsa-interleaved-rope", "-float32-prefill"),
                                                  ("dsa-topk-off-by-one", "-float32-varlen_batch")],
    "suites/test_dsa.py::test_short_context_is_dense": [("dsa-topk-off-by-one", "-0-prefill-tiny-dsa-float32")],
    "suites/test_dsa.py::test_selection": [("dsa-interleaved-rope", "-prefill"),
                                           ("dsa-v32-prefix-bf16", "-v3.2-mini-varlen_batch")],
    "suites/test_dsa.py::test_cache_bytes_v32_dims": [("dsa-keys-hidden", "-6-2-3")],
    "suites/test_dsa.py::test_indexer_scores": [("dsa-interleaved-rope", "-float32-prefill_decode")],
    "suites/test_numerics.py::test_against_float64": [("decode-position", "-float32-prefill_decode-tiny"),
                                                      ("rope-layout", "-bfloat16-varlen_batch-v3-mini")],
    "suites/test_numerics.py::test_float16": [("kv-b-swapped", "-tiny")],
    "suites/test_numerics.py::test_incremental_equals_prefill": [("decode-position", "-float32-tiny")],
    "suites/test_checkpoint.py::test_prefill_decode_on_checkpoint": [("kv-b-swapped", "fixture-{b}-float32")],
    "suites/test_conventions.py::test_yarn_rope_attention_factor_convention": [("rope-layout", "")],
    "suites/test_generation_golden.py::test_golden_generation": [("kv-b-swapped", "-tiny-short"),
                                                                 ("dsa-interleaved-rope", "-tiny-dsa-short")],
    "suites/test_generation_golden.py::test_golden_generation_per_codec": [("int8-codec", "-int8-g32")],
    "suites/test_paged_cache.py::test_paged_equals_contiguous": [("leaky-pages", "-tiny-float32-16")],
    "suites/test_paged_cache.py::test_nan_in_unused_pages_never_reaches_outputs": [("leaky-pages", "")],
    "suites/test_paged_cache.py::test_paged_cache_bytes": [("paged-bytes", "")],
    "suites/test_quantized_kv.py::test_codec_bytes": [("scales-not-counted", "-int8-g32-tiny-bfloat16")],
    "suites/test_quantized_kv.py::test_attention_error": [("int8-codec", "-int8-g32")],
    "suites/test_layer_padding.py::test_idle_rows": [("idle-row-decodes", ""), ("idle-row-writes-slot", ""),
                                                     ("idle-rows-compacted", "")],
    "suites/test_layer_padding.py::test_multi_token_steps": [("verify-same-output", ""),
                                                             ("verify-padding-appended", "")],
}

#: crashes are errors, not verdicts: (broken spec, name, node id) that must come out "error"
ERROR_CELLS = [
    (f"{HERE}/impls/broken/backends.py:RaisesOnDecode", "broken-raises",
     "suites/test_numerics.py::test_against_float64[broken-raises-float32-prefill_decode-tiny]"),
    (f"{HERE}/impls/broken/backends.py:WrongShape", "broken-wrong-shape",
     "suites/test_cache_bytes.py::test_seed_table[broken-wrong-shape]"),
]

#: conformance-looking tests that are not verdicts, with the reason
EXEMPT = {
    "suites/test_decode_bench.py::test_decode_step": "a timing (benchmark marker): figures, not a verdict",
    "suites/test_decode_bench.py::test_sparse_decode_step": "a timing (benchmark marker): figures, not a verdict",
}

#: suite files whose broken implementations another meta run holds -> its tables: the generated-case
#: properties (their broken backends and ops are shapes nobody listed) and the op methods beyond decode
ELSEWHERE = {
    "suites/test_deepseek_v4.py": f"{HERE}/test_v4_meta.py",
    "suites/test_v4_golden.py": f"{HERE}/test_v4_meta.py",
    "suites/test_layer_generated.py": f"{HERE}/test_generated_meta.py",
    "suites/test_op_generated.py": f"{HERE}/test_generated_meta.py",
    "suites/test_op_dcp.py": f"{HERE}/test_dcp_meta.py",
    "suites/test_distributed.py": f"{HERE}/test_distributed_meta.py",
    **{f"suites/{name}": f"{HERE}/test_op_methods_meta.py" for name in METHOD_SUITES},
}


def _node(test: str, name: str, params: str) -> str:
    inside = params.replace("{b}", name) if "{b}" in params else name + params
    return f"{test}[{inside}]"


def node_ids() -> list[tuple[str, str, str]]:
    """(test, broken key, node id) of every cell."""
    return [(test, key, _node(test, BROKEN[key][1], params))
            for test, cells in KILL_MATRIX.items() for key, params in cells]


def correct_node_ids() -> list[tuple[str, str, str]]:
    """(test, correct key, node id): every cell's parametrisation on every correct backend."""
    return [(test, key, _node(test, CORRECT[key][1], params))
            for test, cells in KILL_MATRIX.items() for key in CORRECT for _, params in cells[:1]
            if (test in CORRECT_TESTS[key] if isinstance(CORRECT_TESTS[key], tuple)
                else not test.endswith("test_bytes_formula_v3_dims"))]



def layer_matrix_run(pytester) -> harness.SuiteRun:
    """Every layer cell on its broken backend, the correct backends' cells, the crash cells."""
    specs = [*(spec for spec, _ in [*BROKEN.values(), *CORRECT.values()]), *(spec for spec, _, _ in ERROR_CELLS)]
    cells = [n for _, _, n in node_ids() + correct_node_ids()] + [n for _, _, n in ERROR_CELLS]
    return harness.run_inprocess(pytester, cells, backends=specs, expect=1)

ROOT = harness.ROOT
CELLS = node_ids()
PASSING = correct_node_ids()


def conformance_tests() -> set[str]:
    """file::function of every test function in suites/test_*.py that takes the ``mla_backend`` fixture (but the
    files another meta module kills: ELSEWHERE)."""
    found = set()
    for path in sorted((ROOT / "suites").glob("test_*.py")):
        if f"suites/{path.name}" in ELSEWHERE:
            continue
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_") and \
                    "mla_backend" in [a.arg for a in node.args.args]:
                found.add(f"suites/{path.name}::{node.name}")
    return found


@pytest.fixture
def run(suite_run) -> harness.SuiteRun:
    return suite_run("layer-matrix", layer_matrix_run)


@pytest.fixture
def outcomes(run) -> dict[str, dict]:
    return run.by_id


@pytest.mark.parametrize("suite,module", sorted(ELSEWHERE.items()))
def test_suites_killed_elsewhere_are_killed_there(suite, module):
    """A suite file left out of this matrix is one another meta module runs its broken implementations on."""
    assert (ROOT / suite).is_file(), f"{suite} does not exist (ELSEWHERE)"
    assert Path(suite).name in (ROOT / module).read_text(encoding="utf-8"), f"{module} does not run {suite}"


def test_every_conformance_test_has_a_cell():
    tests = conformance_tests()
    missing = sorted(tests - set(KILL_MATRIX) - set(EXEMPT))
    assert not missing, f"conformance tests that no broken backend is shown to fail: {missing}"
    stale = sorted((set(KILL_MATRIX) | set(EXEMPT)) - tests)
    assert not stale, f"kill-matrix rows for tests that do not exist (or take no backend): {stale}"


@pytest.mark.parametrize("test,broken,nodeid", CELLS, ids=[f"{t.split('::')[1]}<-{b}" for t, b, _ in CELLS])
def test_cell_fails(run, test, broken, nodeid):
    reason = run.assert_failed(nodeid, BROKEN[broken][1])
    if "golden" not in test:  # a golden mismatch is syrupy's diff; every other verdict names the backend
        assert BROKEN[broken][1] in reason, f"{nodeid}: the failure does not name the backend: {reason}"
    assert LAYER_HINTS.get(broken, "") in reason, f"{nodeid}: the failure does not say {LAYER_HINTS[broken]!r}: {reason}"


@pytest.mark.parametrize("test,correct,nodeid", PASSING, ids=[f"{t.split('::')[1]}<-{c}" for t, c, _ in PASSING])
def test_correct_backend_passes(outcomes, test, correct, nodeid):
    got = outcomes.get(nodeid)
    assert got is not None, f"{nodeid} did not run"
    if got["outcome"] == "skipped" and correct == "frozen-base":
        return  # its skips: test_frozen_backend_skips_only_what_it_never_declared
    if got["outcome"] == "skipped":  # only an optional part the backend does not implement
        assert CORRECT[correct][1] in got.get("reason", "") and any(
            w in got["reason"] for w in ("paged-cache extension", "kv_codec", "DeepSeek Sparse Attention")), f"{nodeid}: skipped: {got['reason']}"
    else:
        assert got["outcome"] == "passed", f"{nodeid}: {got['outcome']}: {got.get('reason', '')}"


def test_frozen_backend_skips_only_what_it_never_declared(outcomes):
    """The frozen base-contract backend (tests/meta/frozen_base_backend.py, never edited) passes every cell but
    the optional parts, and each of those skips with a sentence naming what it did not declare or declined."""
    name = CORRECT["frozen-base"][1]
    mine = {n: outcomes.get(n, {}) for t, c, n in PASSING if c == "frozen-base"}
    assert mine and all(o.get("outcome") in ("passed", "skipped") for o in mine.values()), mine
    for nodeid, got in mine.items():
        if got["outcome"] != "skipped":
            continue
        reason = got.get("reason", "")
        dsa = "dsa" in nodeid
        assert (f'{name} does not declare DeepSeek Sparse Attention' in reason and 'sparse_attention = "dsa"' in reason
                if dsa else (f"{name}: no " in reason or "supports_paging" in reason)), f"{nodeid}: {reason}"
    assert any(o["outcome"] == "skipped" and "dsa" in n for n, o in mine.items()), "no DSA cell skipped"


def test_correct_backends_pass_most_cells(outcomes):
    for key, (_, name) in CORRECT.items():
        passed = [n for t, c, n in PASSING if c == key and outcomes.get(n, {}).get("outcome") == "passed"]
        expected = len(CORRECT_TESTS[key]) if isinstance(CORRECT_TESTS[key], tuple) else 8
        assert len(passed) >= expected, f"{name}: only {len(passed)} cells passed"


@pytest.mark.parametrize("spec,name,nodeid", ERROR_CELLS, ids=[n for _, n, _ in ERROR_CELLS])
def test_crash_is_recorded_as_error(run, spec, name, nodeid):
    """A backend that raises or returns the wrong shape is an *error* in the results, not a failure."""
    run.assert_error(nodeid, "BackendError", "BackendOutputError")


#: the fixtures that hand a test what it judges: a backend, an op, an engine, a backend across ranks
SUBJECTS = {"mla_backend", "mla_op", "mla_engine", "distributed_backend"}


def test_suites_hold_conformance_tests_only():
    """Every test function in suites/ judges an implementation (requests one of :data:`SUBJECTS`); the tool's own
    tests are in tests/."""
    tool = []
    for path in sorted((ROOT / "suites").glob("test_*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_") and \
                    not SUBJECTS & {a.arg for a in node.args.args}:
                tool.append(f"suites/{path.name}::{node.name}")
    assert not tool, f"tests in suites/ that judge no backend (move them to tests/): {tool}"
