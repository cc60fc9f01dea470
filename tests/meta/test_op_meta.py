"""Every op check can fail, and correct ops pass: each broken op of tests/meta/impls/broken/ops.py must come out
*failed* (an AssertionError verdict naming the op, not an error, a skip or a pass) in the op tests named for it;
the ops written independently of reference-op (tests/meta/impls/independent/op.py) pass every op test, the one that
implements only the base contract with explicit skips for what it does not declare; crashing ops are *errors*.
All of it through the plugin (--mla-op, --mla-results), as a user runs it: a run of the op matrix's cells and
one of its correct ops over OP_SUITES (tests/meta/kill_matrix.py)."""

import ast

import pytest

from . import harness
from .kill_matrix import (BROKEN_OPS, CORRECT_OPS, ERROR_OPS, ERROR_TEXT, FROZEN, HINTS, OP_CELLS, OP_ERRORS, OP_SUITES,
                          SKIPS, op_cells_run, op_correct_run)

pytestmark = pytest.mark.meta
ROOT = harness.ROOT
SUITES = ROOT / "suites"
CELLS, ERRORS = OP_CELLS, OP_ERRORS


def op_tests() -> set[str]:
    """file::function of every test in the op suites of this matrix (each requests mla_op)."""
    found = set()
    for path in (ROOT / f for f in OP_SUITES):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                assert "mla_op" in [a.arg for a in node.args.args], f"{path.name}::{node.name} takes no mla_op"
                found.add(f"{path.name}::{node.name}")
    return found


@pytest.fixture
def run(suite_run) -> harness.SuiteRun:
    """The op matrix: every cell on its broken op, and every test of OP_SUITES on the correct ops."""
    return suite_run("op-matrix", lambda pytester: op_cells_run(pytester).joined(op_correct_run(pytester)))


def test_every_op_test_is_failed_by_a_broken_op():
    tests = op_tests()
    covered = {test.split("[")[0] for _, test, _ in CELLS}
    assert not sorted(tests - covered), f"op tests no broken op is shown to fail: {sorted(tests - covered)}"
    assert not sorted(covered - tests), f"cells for op tests that do not exist: {sorted(covered - tests)}"


@pytest.mark.parametrize("key,test,nodeid", CELLS, ids=[f"{t.split('::')[1].split('[')[0]}<-{k}" for k, t, _ in CELLS])
def test_broken_op_fails_its_check(run, key, test, nodeid):
    name = BROKEN_OPS[key][1]
    reason = run.assert_failed(nodeid, name)
    got = run.result(nodeid)
    assert reason.startswith(f"{name} [B="), f"{nodeid}: the failure does not name the op and the case: {reason}"
    assert got.get("figures", {}).get("case"), f"{nodeid}: no case figure recorded: {got}"
    if key in HINTS:
        assert HINTS[key] in reason, f"{nodeid}: the failure does not name the likely cause {HINTS[key]!r}: {reason}"


def test_declarations_decide_what_runs(run):
    """invalid_index: an op of the default "minus-one" is handed -1 only (the other kinds skip naming the
    declaration); returns_lse = False: out checks run with lse None, the merge skips naming returns_lse."""
    by = run.by_id
    kind = "suites/test_op_sparse.py::test_sparse_invalid_indices[no-lse-triton-op-{}]"
    assert by[kind.format("minus-one")]["outcome"] == "passed"
    for k in ("past-end", "int-max"):
        got = by[kind.format(k)]
        assert got["outcome"] == "skipped" and "defaults to invalid_index = 'minus-one'" in got["reason"] \
            and "(declare invalid_index = 'out-of-range'" in got["reason"], got
    assert by[kind.format("int-max").replace("no-lse-triton-op", "independent-op")]["outcome"] == "passed"
    merge = by["suites/test_op_numerics.py::test_split_kv_merge[no-lse-triton-op-1]"]
    assert merge["outcome"] == "skipped" and "returns_lse = False" in merge["reason"], merge
    dense = by["suites/test_op_numerics.py::test_out_lse_vs_oracle[no-lse-triton-op-bfloat16]"]
    assert dense["outcome"] == "passed" and dense["figures"]["lse_compared"] is False, dense
    # rows without keys declined with the op's own sentence; the multi-token test falls back to rows of s_q keys
    assert "leaves a query with no keys undefined" in by[
        "suites/test_op_paging.py::test_empty_and_single_key_rows[no-lse-triton-op]"]["reason"]
    assert by["suites/test_op_paging.py::test_multi_token_decode[no-lse-triton-op-8-causal]"]["outcome"] == "passed"


def test_padding_declarations_and_the_two_kinds_of_rows_without_keys(run):
    """An op declines one kind of query without keys and keeps the other (zero-padding-after-op: zero-length rows
    yes, causal queries before the first key no); padding_rows = 'undefined' leaves padding rows unlooked at; the
    frozen base op passes the padded and replayed batches (legal under the base contract)."""
    by = run.by_id
    empty = by["suites/test_op_paging.py::test_empty_and_single_key_rows[zero-padding-after-op]"]
    assert empty["outcome"] == "skipped" and "causal query before its row's first key" in empty["reason"], empty
    merge = by["suites/test_op_numerics.py::test_split_kv_merge[zero-padding-after-op-1]"]
    assert merge["outcome"] == "passed" and "rows without keys" in merge["figures"]["case"], merge  # empty parts
    for op in ("zero-padding-after-op", "undefined-padding-op", "frozen-base-op", "base-contract-op"):
        for layout in ("trailing", "interleaved"):
            got = by[f"suites/test_op_padding.py::test_padded_batch[{op}-{layout}]"]
            assert got["outcome"] == "passed", got
            assert got["figures"]["padding_rows_compared"] is (op != "undefined-padding-op"), got
    assert by["suites/test_op_replay.py::test_graph_replay[frozen-base-op-dense]"]["outcome"] == "passed"
    assert by["suites/test_op_replay.py::test_graph_replay[zero-padding-after-op-dense]"]["figures"]["replay_bitwise"]


def test_the_likely_cause_is_named_only_where_it_applies(run):
    """The top-left hint is not handed to ops failing causal tests for other reasons (the op methods' matrix, in
    the same run, has its own top-left op)."""
    for t in run.only(OP_SUITES).tests:
        if HINTS["top-left-causal"] in t.get("reason", ""):
            assert t.get("params", {}).get("op") == BROKEN_OPS["top-left-causal"][1], t["nodeid"]


def test_bounds_are_not_loose_for_the_p_rounding_ops(run):
    """The correct P-rounding ops use a real share of the bound (the bound is not slack by orders of magnitude),
    and the 4x broken op exceeds it by about 4x: the derived bound separates them."""
    def worst(name, test):
        rows = [t for t in run.tests if t.get("params", {}).get("op") == name and test in t["nodeid"]]
        return max(float(t.get("figures", {}).get("out_error_over_bound", 0.0)) for t in rows)
    for name in ("p-rounding-op", "p-rounding-fp16-op", "split-kv-op"):
        assert 0.3 < worst(name, "test_out_lse_vs_oracle") <= 1.0, (name, worst(name, "test_out_lse_vs_oracle"))
    for dt in ("bfloat16", "float16"):
        ratio = worst("broken-coarse-p", f"test_out_lse_vs_oracle[broken-coarse-p-{dt}]")
        assert 3.0 < ratio < 6.0, (dt, ratio)


@pytest.mark.parametrize("key", list(CORRECT_OPS))
def test_correct_op_passes(run, key):
    _, name, mode = CORRECT_OPS[key]
    mine = run.only(OP_SUITES).tests
    rows = [t for t in mine if t.get("params", {}).get("op") == name]
    expected = sum(1 for t in mine if t.get("params", {}).get("op") == CORRECT_OPS["independent"][1])
    assert len(rows) == expected and rows, f"{name}: {len(rows)} op tests ran, expected {expected}"
    bad = [f"{t['nodeid']}: {t['outcome']} {t.get('reason', '')}" for t in rows if t["outcome"] not in ("passed", "skipped")]
    assert not bad, f"{name} does not pass:\n" + "\n".join(bad)
    skipped = [t for t in rows if t["outcome"] == "skipped"]
    if mode == "all":
        assert not skipped, f"{name} declares every optional part but skipped: {[t['nodeid'] for t in skipped]}"
        return
    # every sentence of a skip (first_supported joins them with '; ') is one the op may skip with
    odd = [f"{t['nodeid']}: {t.get('reason')}" for t in skipped if not t.get("reason", "").startswith(f"{name}: ")
           or not all(any(s in part for s in SKIPS[mode]) for part in t["reason"].removeprefix(f"{name}: ").split("; "))]
    assert not odd, f"{name} skipped for reasons other than what it does not declare:\n" + "\n".join(odd)
    passed = len(rows) - len(skipped)
    assert passed >= 20, f"{name}: {passed} passed, {len(skipped)} skipped"
    if mode == "dtype":  # one dtype: only the test_out_lse_vs_oracle parametrisations of other dtypes skip
        assert all("test_out_lse_vs_oracle" in t["nodeid"] or "test_op_fp8" in t["nodeid"] for t in skipped), \
            [t["nodeid"] for t in skipped]
    if mode in ("base", "frozen"):
        assert len(skipped) >= 10, f"{name}: {passed} passed, {len(skipped)} skipped"


@pytest.mark.parametrize("key,nodeid", ERRORS, ids=[k for k, _ in ERRORS])
def test_crash_is_an_error(run, key, nodeid):
    reason = run.assert_error(nodeid, "BackendError", "BackendOutputError")
    for text in ERROR_TEXT.get(key, ()):
        assert text in reason, f"{nodeid}: the error does not say {text!r}: {reason}"


@pytest.mark.parametrize("path", sorted({spec.split(":")[0] for spec, _, _ in CORRECT_OPS.values()}))
def test_independent_ops_import_nothing_of_the_suite(path):
    """The correct ops share no code with reference-op or the oracle: their files import torch and math only."""
    tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
    modules = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names} | \
        {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert modules <= {"__future__", "math", "torch"}, modules


def test_the_frozen_op_is_the_base_contract():
    """The frozen op has exactly the base contract's surface: a name, unsupported_reason and decode, and no optional
    declaration (the README's op, its relation to this one: tests/meta/test_readme_template.py)."""
    from mla_conformance.contract.op import DECLARATIONS

    tree = ast.parse((ROOT / FROZEN.split(":")[0]).read_text(encoding="utf-8"))
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef)]
    members = {n.targets[0].id if isinstance(n, ast.Assign) else n.name for n in cls.body
               if isinstance(n, (ast.Assign, ast.FunctionDef))}
    assert members == {"name", "unsupported_reason", "decode"}, members
    assert not members & set(DECLARATIONS)


def test_results_record_ops_and_declarations(run):
    names = [name for _, name, _ in [*BROKEN_OPS.values(), *ERROR_OPS.values(), *CORRECT_OPS.values()]]
    assert run["ops"] == names, run["ops"]  # the cells run's, then the correct ops' run's
    decl = run["op_declarations"]["independent-op"]
    assert decl == {"lse_base": "2", "returns_lse": True, "empty_row": "-inf", "sparse_decode": True,
                    "sparse_decode_extra_cache": True,
                    "invalid_index": "out-of-range", "attn_sink": True, "page_block_sizes": [1, 16, 64],
                    "kv_formats": ["latent", "fp8-e4m3-flashmla"], "fp8_scale_format": "fp32",
                    "deterministic": True, "batch_invariant": True, "head_dims": [[576, 512]],
                    "padding_rows": "defined", "out_buffers": True}, decl
    assert run["op_declarations"]["undefined-padding-op"]["padding_rows"] == "undefined"
    assert run["op_declarations"]["no-lse-triton-op"]["returns_lse"] is False
    assert run["op_declarations"]["base-contract-op"]["page_block_sizes"] == [64]
    row = run.by_id["suites/test_op_numerics.py::test_out_lse_vs_oracle[independent-op-float32]"]
    assert row["params"] == {"op": "independent-op", "dtype": "float32"} and row["section"] == "op-numerics", row
    assert {"case", "out_max_abs", "out_rel_fro", "out_error_over_bound", "lse_max_abs", "tolerance_p_round",
            "tolerance_dot", "tolerance_acc", "tolerance_u_out"} <= set(row["figures"])


# --------------------------------------------------------------------------- the plugin's --mla-op selection


SELECTION_TESTS = """
def test_layer(mla_backend):
    pass


def test_op(mla_op):
    pass
"""


def _collect(pytester, *options) -> tuple[int, str]:
    """Collect one layer test and one op test (a file of their own in pytester's directory: collecting the real
    suites costs seconds) with the given options, in this process."""
    pytester.makepyfile(test_kinds=SELECTION_TESTS)
    # no:unraisableexception: its cleanup runs gc.collect() twice per session, 2/3 of a collection's time here
    got = harness.pytest_inprocess(pytester, "-p", "no:xdist", "-p", "no:unraisableexception",
                                   "-q", "--co", *options)
    return int(got.ret), "\n".join(got.outlines + got.errlines)


def _ids(out: str, kind: str) -> list[str]:
    return [line for line in out.splitlines() if f"::test_{kind}[" in line]


def test_selection_by_options(pytester):
    from mla_conformance.contract.layer import DEFAULT_BACKENDS

    independent = f"{ROOT / 'tests/meta/impls/independent/op.py'}:IndependentOp"
    code, out = _collect(pytester)  # neither option: the default backends' layer tests, the default ops' op tests
    assert code == 0 and len(_ids(out, "layer")) == len(DEFAULT_BACKENDS), out[-3000:]
    assert [line.split("[")[1] for line in _ids(out, "op")] == ["reference-op]"], out[-3000:]
    code, out = _collect(pytester, "--mla-backend", "reference-absorbed")  # a verdict on a backend
    assert code == 0 and _ids(out, "layer") and not _ids(out, "op"), out[-3000:]
    assert "1 op tests deselected: --mla-backend was given without --mla-op" in out, out[-3000:]
    code, out = _collect(pytester, "--mla-op", independent)  # a verdict on an op
    assert code == 0 and not _ids(out, "layer") and _ids(out, "op") == [line for line in _ids(out, "op")
                                                                          if "[independent-op]" in line], out[-3000:]
    assert f"{len(DEFAULT_BACKENDS)} layer tests deselected: --mla-op was given without --mla-backend" in out, \
        out[-3000:]
    code, out = _collect(pytester, "--mla-op", independent, "--mla-backend", "reference-absorbed")  # both
    assert code == 0 and _ids(out, "layer") and _ids(out, "op") and "deselected:" not in out, out[-3000:]


@pytest.mark.parametrize("spec,message", [
    ("no-such-op", "--mla-op: op spec 'no-such-op': not a built-in op"),
    ("reference-opp", "did you mean 'reference-op'?"),
    ("tests/meta/impls/independent/op.py:Missing", "--mla-op: op spec 'tests/meta/impls/independent/op.py:Missing'"),
])
def test_bad_op_spec_is_a_usage_error(pytester, spec, message):
    code, out = _collect(pytester, "--mla-op", spec)
    assert code == pytest.ExitCode.USAGE_ERROR and message in out, out[-3000:]


def test_duplicate_op_names_are_refused(pytester):
    code, out = _collect(pytester, "--mla-op", "reference-op", "--mla-op", "reference-op")
    assert code == pytest.ExitCode.USAGE_ERROR and "--mla-op: two ops share the name(s) ['reference-op']" in out, out
