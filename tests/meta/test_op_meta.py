"""Every op check can fail, and correct ops pass: each broken op of tests/meta/broken_ops.py must come out
*failed* (an AssertionError verdict naming the op, not an error, a skip or a pass) in the op tests named for it;
the ops written independently of reference-op (tests/meta/independent_op.py) pass every op test, the one that
implements only the base contract with explicit skips for what it does not declare; crashing ops are *errors*.
All of it in one in-process pytest session through the plugin (--mla-op, --mla-results), as a user runs it."""

import ast
import contextlib
import io
import json
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.meta, pytest.mark.xdist_group("test_op_meta")]  # module fixtures run once under -n
ROOT = Path(__file__).resolve().parent.parent.parent
SUITES = ROOT / "suites"
OPS = "tests/meta/broken_ops.py"
KERNEL_OPS = "tests/meta/kernel_ops.py"
FROZEN = "tests/meta/frozen_base_op.py"

#: broken op -> (spec, the name it reports, the op tests (file::function[params after the op name]) that must fail it)
BROKEN_OPS = {
    "lse-base2-as-e": (f"{OPS}:Base2DeclaredE", "broken-lse-base2-as-e",
                       ["test_op_numerics.py::test_out_lse_vs_oracle[-float32]", "test_op_numerics.py::test_split_kv_merge[-1]",
                        "test_op_sparse.py::test_sparse_vs_oracle[]"]),
    "nan-empty-rows": (f"{OPS}:NanForEmptyRows", "broken-nan-empty-rows",
                       ["test_op_paging.py::test_empty_and_single_key_rows[]",
                        "test_op_sparse.py::test_sparse_all_invalid_rows[]", "test_op_numerics.py::test_split_kv_merge[-2]"]),
    "reads-page-tail": (f"{OPS}:ReadsPageTail", "broken-reads-page-tail",
                        ["test_op_paging.py::test_poisoned_pages[]", "test_op_fp8.py::test_fp8_all_zero_kv[]"]),
    "top-left-causal": (f"{OPS}:TopLeftCausal", "broken-top-left-causal",
                        ["test_op_paging.py::test_multi_token_decode[-4-causal]"]),
    "minus-one-last-token": (f"{OPS}:MinusOneIsLastToken", "broken-minus-one-last-token",
                             ["test_op_sparse.py::test_sparse_invalid_indices[-minus-one]",
                              "test_op_sparse.py::test_sparse_equals_dense[]"]),
    "attn-sink-ignored": (f"{OPS}:SinkIgnored", "broken-attn-sink-ignored",
                          ["test_op_sparse.py::test_attn_sink[]", "test_op_numerics.py::test_attn_sink_dense[]"]),
    # P kept to 3 bits fewer than the cache dtype: an error ~4x the derived bound (written without the reference)
    "coarse-p": (f"{KERNEL_OPS}:CoarsePOp", "broken-coarse-p",
                 ["test_op_numerics.py::test_out_lse_vs_oracle[-bfloat16]",
                  "test_op_numerics.py::test_out_lse_vs_oracle[-float16]"]),
    "fp8-exponent-only": (f"{OPS}:Fp8ExponentOnly", "broken-fp8-exponent-only", ["test_op_fp8.py::test_fp8_scale_probe[]"]),
    "fp8-scales-as-bf16": (f"{OPS}:Fp8ScalesAsBf16", "broken-fp8-scales-as-bf16",
                           ["test_op_fp8.py::test_fp8_scale_probe[]", "test_op_fp8.py::test_fp8_vs_dequantized_oracle[]"]),
    "writes-past-block-table": (f"{OPS}:WritesPastBlockTable", "broken-writes-past-block-table",
                                ["test_op_paging.py::test_poisoned_pages[]"]),
    "ignores-q-strides": (f"{OPS}:IgnoresQStrides", "broken-ignores-q-strides", ["test_op_paging.py::test_noncontiguous_q[]"]),
    "naive-softmax": (f"{OPS}:NaiveSoftmax", "broken-naive-softmax", ["test_op_fp8.py::test_fp8_magnitude_sweep[-x256]"]),
    "ignores-topk-length": (f"{OPS}:IgnoresTopkLength", "broken-ignores-topk-length",
                            ["test_op_sparse.py::test_sparse_topk_length[]"]),
    "nondeterministic": (f"{OPS}:Nondeterministic", "broken-nondeterministic", ["test_op_numerics.py::test_deterministic[]"]),
    "batch-variant": (f"{OPS}:BatchVariant", "broken-batch-variant", ["test_op_numerics.py::test_batch_invariant[]"]),
    "heads-capped": (f"{OPS}:HeadsCapped", "broken-heads-capped-at-64", ["test_op_paging.py::test_head_counts[-128]"]),
    "assumes-page-64": (f"{OPS}:AssumesPage64", "broken-assumes-page-64", ["test_op_paging.py::test_page_sizes[-16]"]),
}

#: a failure message must say this (the likely cause) for the broken op's cells
HINTS = {"top-left-causal": "likely cause: top-left causal alignment"}

#: correct ops: every op test runs on them; "all" must pass; otherwise they may skip only with the sentences
#: of SKIPS[mode] (their own unsupported_reason, or a declaration they do not make)
CORRECT_OPS = {
    "independent": ("tests/meta/independent_op.py:IndependentOp", "independent-op", "all"),
    "base-contract": ("tests/meta/independent_op.py:BaseContractOp", "base-contract-op", "base"),
    # P rounded to the cache dtype before P.V, float32 accumulation, online softmax over pages (half precision)
    "p-rounding-bf16": (f"{KERNEL_OPS}:PRoundingOp", "p-rounding-op", "dtype"),
    "p-rounding-fp16": (f"{KERNEL_OPS}:PRoundingFp16Op", "p-rounding-fp16-op", "dtype"),
    "split-kv": (f"{KERNEL_OPS}:SplitKVOp", "split-kv-op", "dtype"),
    "no-lse-triton": (f"{KERNEL_OPS}:NoLseTritonOp", "no-lse-triton-op", "no-lse"),
    "frozen": (f"{FROZEN}:FrozenBaseOp", "frozen-base-op", "frozen"),
}
#: a skip that names the declaration opting the op in (the op suite's own sentences)
DECLARATION_SKIPS = ("kv_formats is", "page_block_sizes is", "does not declare sparse_decode",
                     "does not declare attn_sink", "does not declare deterministic", "does not declare batch_invariant",
                     "invalid_index = 'minus-one'", "declares returns_lse = False")
SKIPS = {
    "base": ("implements dense decode only", "takes no attn_sink",
             "reads a latent cache in q's dtype only",  # its own sentence, asked before the declarations
             *DECLARATION_SKIPS),
    "dtype": ("computes with a ",),  # the kernel-style ops take one dtype
    "no-lse": ("computes with a ", "leaves a query with no keys undefined", *DECLARATION_SKIPS),
    "frozen": DECLARATION_SKIPS,
}

#: crashes and contract violations are errors, not verdicts
ERROR_OPS = {
    "raises": (f"{OPS}:RaisesOnDecode", "broken-op-raises", "test_op_numerics.py::test_out_lse_vs_oracle[-float32]"),
    "lse-layout": (f"{OPS}:WrongLseLayout", "broken-op-lse-layout", "test_op_numerics.py::test_out_lse_vs_oracle[-float32]"),
    "half-lse": (f"{KERNEL_OPS}:HalfLseOp", "broken-half-lse", "test_op_numerics.py::test_out_lse_vs_oracle[-bfloat16]"),
}
#: what an error's message must say
ERROR_TEXT = {"half-lse": ("lse is bfloat16, not float32", "significant bits", "merged")}


def _node(test: str, name: str) -> str:
    path, rest = test.split("::")
    func, params = rest.split("[")
    return f"suites/{path}::{func}[{name}{params}"


CELLS = [(key, test, _node(test, name)) for key, (_, name, tests) in BROKEN_OPS.items() for test in tests]
ERRORS = [(key, _node(test, name)) for key, (_, name, test) in ERROR_OPS.items()]


def op_tests() -> set[str]:
    """file::function of every test in suites/test_op_*.py (each requests mla_op)."""
    found = set()
    for path in sorted(SUITES.glob("test_op_*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                assert "mla_op" in [a.arg for a in node.args.args], f"{path.name}::{node.name} takes no mla_op"
                found.add(f"{path.name}::{node.name}")
    return found


class _Select:
    """Keeps the named cells of the broken and erroring ops and every op test of the correct ops."""

    def __init__(self, wanted: set[str], correct: set[str]):
        self.wanted, self.correct = wanted, correct

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config, items):
        def keep(item):
            op = getattr(getattr(item, "callspec", None), "params", {}).get("mla_op")
            return item.nodeid in self.wanted or getattr(op, "name", None) in self.correct
        kept = [item for item in items if keep(item)]
        config.hook.pytest_deselected(items=[item for item in items if not keep(item)])
        items[:] = kept


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    """One pytest session, in this process, over suites/test_op_*.py with every op of the tables."""
    results = tmp_path_factory.mktemp("op-meta") / "results.json"
    args = ["-p", "no:xdist", "-p", "no:cacheprovider", "-p", "no:unraisableexception", "-q", "-o", "addopts=",
            "--rootdir", str(ROOT),
            "--mla-results", str(results), "--mla-device", "cpu", *map(str, sorted(SUITES.glob("test_op_*.py")))]
    for spec, _, _ in [*BROKEN_OPS.values(), *CORRECT_OPS.values(), *ERROR_OPS.values()]:
        path, attr = spec.split(":")
        args += ["--mla-op", f"{ROOT / path}:{attr}"]
    wanted = {n for _, _, n in CELLS} | {n for _, n in ERRORS}
    log = io.StringIO()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small tensors: one intra-op thread, not spinning threads fighting a busy host
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            code = pytest.main(args, plugins=[_Select(wanted, {name for _, name, _ in CORRECT_OPS.values()})])
    finally:
        torch.set_num_threads(threads)
    assert results.is_file(), f"the op meta run wrote no results (exit {code}):\n{log.getvalue()[-4000:]}"
    assert code == 1, f"expected exit 1 (test failures), got {code}:\n{log.getvalue()[-4000:]}"
    payload = json.loads(results.read_text())
    payload["by_id"] = {t["nodeid"]: t for t in payload["tests"]}
    return payload


def test_every_op_test_is_failed_by_a_broken_op():
    tests = op_tests()
    covered = {test.split("[")[0] for _, test, _ in CELLS}
    assert not sorted(tests - covered), f"op tests no broken op is shown to fail: {sorted(tests - covered)}"
    assert not sorted(covered - tests), f"cells for op tests that do not exist: {sorted(covered - tests)}"


@pytest.mark.parametrize("key,test,nodeid", CELLS, ids=[f"{t.split('::')[1].split('[')[0]}<-{k}" for k, t, _ in CELLS])
def test_broken_op_fails_its_check(run, key, test, nodeid):
    got = run["by_id"].get(nodeid)
    assert got is not None, f"{nodeid} did not run"
    name = BROKEN_OPS[key][1]
    assert got["outcome"] == "failed", f"{nodeid}: expected a failure of {name}, got {got['outcome']}: {got.get('reason', '')}"
    reason = got.get("reason", "")
    assert reason.startswith(f"{name} [B="), f"{nodeid}: the failure does not name the op and the case: {reason}"
    assert got.get("figures", {}).get("case"), f"{nodeid}: no case figure recorded: {got}"
    if key in HINTS:
        assert HINTS[key] in reason, f"{nodeid}: the failure does not name the likely cause {HINTS[key]!r}: {reason}"


def test_declarations_decide_what_runs(run):
    """invalid_index: an op of the default "minus-one" is handed -1 only (the other kinds skip naming the
    declaration); returns_lse = False: out checks run with lse None, the merge skips naming returns_lse."""
    by = run["by_id"]
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


def test_the_likely_cause_is_named_only_where_it_applies(run):
    """The top-left hint is not handed to ops failing causal tests for other reasons."""
    for t in run["tests"]:
        if HINTS["top-left-causal"] in t.get("reason", ""):
            assert t.get("params", {}).get("op") == BROKEN_OPS["top-left-causal"][1], t["nodeid"]


def test_bounds_are_not_loose_for_the_p_rounding_ops(run):
    """The correct P-rounding ops use a real share of the bound (the bound is not slack by orders of magnitude),
    and the 4x broken op exceeds it by about 4x: the derived bound separates them."""
    def worst(name, test):
        rows = [t for t in run["tests"] if t.get("params", {}).get("op") == name and test in t["nodeid"]]
        return max(float(t.get("figures", {}).get("out_error_over_bound", 0.0)) for t in rows)
    for name in ("p-rounding-op", "p-rounding-fp16-op", "split-kv-op"):
        assert 0.3 < worst(name, "test_out_lse_vs_oracle") <= 1.0, (name, worst(name, "test_out_lse_vs_oracle"))
    for dt in ("bfloat16", "float16"):
        ratio = worst("broken-coarse-p", f"test_out_lse_vs_oracle[broken-coarse-p-{dt}]")
        assert 3.0 < ratio < 6.0, (dt, ratio)


@pytest.mark.parametrize("key", list(CORRECT_OPS))
def test_correct_op_passes(run, key):
    _, name, mode = CORRECT_OPS[key]
    rows = [t for t in run["tests"] if t.get("params", {}).get("op") == name]
    expected = sum(1 for t in run["tests"] if t.get("params", {}).get("op") == CORRECT_OPS["independent"][1])
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
    got = run["by_id"].get(nodeid)
    assert got is not None, f"{nodeid} did not run"
    assert got["outcome"] == "error", f"{nodeid}: {got['outcome']}: {got.get('reason', '')}"
    assert got.get("reason", "").startswith(("BackendError", "BackendOutputError")), got
    for text in ERROR_TEXT.get(key, ()):
        assert text in got["reason"], f"{nodeid}: the error does not say {text!r}: {got['reason']}"


@pytest.mark.parametrize("path", sorted({spec.split(":")[0] for spec, _, _ in CORRECT_OPS.values()}))
def test_independent_ops_import_nothing_of_the_suite(path):
    """The correct ops share no code with reference-op or the oracle: their files import torch and math only."""
    tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
    modules = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names} | \
        {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert modules <= {"__future__", "math", "torch"}, modules


def test_the_frozen_op_is_the_readme_template():
    """The frozen op has exactly the README's base-contract surface: a name, unsupported_reason and decode with
    the README's signature, and no optional declaration."""
    import inspect
    import re

    from mla_conformance.contract.op import DECLARATIONS

    source = (ROOT / FROZEN).read_text(encoding="utf-8")
    tree = ast.parse(source)
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef)]
    members = {n.targets[0].id if isinstance(n, ast.Assign) else n.name for n in cls.body
               if isinstance(n, (ast.Assign, ast.FunctionDef))}
    assert members == {"name", "unsupported_reason", "decode"}, members
    assert not members & set(DECLARATIONS)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    template = re.search(r"def decode\(self, (.*?)\):", readme, re.S).group(1)
    ns: dict = {}
    exec(source, ns)  # noqa: S102 (the file's own source: torch and math only)
    frozen = str(inspect.signature(ns["FrozenBaseOp"].decode)).removeprefix("(self, ").removesuffix(")")
    assert " ".join(template.split()) == " ".join(frozen.split()), (template, frozen)


def test_results_record_ops_and_declarations(run):
    names = [name for _, name, _ in [*BROKEN_OPS.values(), *CORRECT_OPS.values(), *ERROR_OPS.values()]]
    assert run["ops"] == names and run["backends"] == []
    decl = run["op_declarations"]["independent-op"]
    assert decl == {"lse_base": "2", "returns_lse": True, "empty_row": "-inf", "sparse_decode": True,
                    "invalid_index": "out-of-range", "attn_sink": True, "page_block_sizes": [1, 16, 64],
                    "kv_formats": ["latent", "fp8-e4m3-flashmla"], "fp8_scale_format": "fp32",
                    "deterministic": True, "batch_invariant": True, "head_dims": [[576, 512]]}, decl
    assert run["op_declarations"]["no-lse-triton-op"]["returns_lse"] is False
    assert run["op_declarations"]["base-contract-op"]["page_block_sizes"] == [64]
    row = run["by_id"]["suites/test_op_numerics.py::test_out_lse_vs_oracle[independent-op-float32]"]
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


@pytest.fixture(scope="module")
def selection_dir(tmp_path_factory) -> Path:
    """A layer test and an op test outside this repository (collecting the real suites costs seconds)."""
    path = tmp_path_factory.mktemp("op-selection")
    (path / "test_kinds.py").write_text(SELECTION_TESTS, encoding="utf-8")
    return path


def _collect(where: Path, *options) -> tuple[int, str]:
    """Collect one layer test and one op test with the given options, in this process."""
    # no:unraisableexception: its cleanup runs gc.collect() twice per session, 2/3 of a collection's time here
    args = ["-p", "no:xdist", "-p", "no:cacheprovider", "-p", "no:unraisableexception", "-q", "--co", "-o", "addopts=",
            "--rootdir", str(where), str(where / "test_kinds.py"), *options]
    log = io.StringIO()
    with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        code = pytest.main(args)
    return int(code), log.getvalue()


def _ids(out: str, kind: str) -> list[str]:
    return [line for line in out.splitlines() if f"::test_{kind}[" in line]


def test_selection_by_options(selection_dir):
    from mla_conformance.contract.layer import DEFAULT_BACKENDS

    independent = f"{ROOT / 'tests/meta/independent_op.py'}:IndependentOp"
    code, out = _collect(selection_dir)  # neither option: the default backends' layer tests, the default ops' op tests
    assert code == 0 and len(_ids(out, "layer")) == len(DEFAULT_BACKENDS), out[-3000:]
    assert [line.split("[")[1] for line in _ids(out, "op")] == ["reference-op]"], out[-3000:]
    code, out = _collect(selection_dir, "--mla-backend", "reference-absorbed")  # a verdict on a backend
    assert code == 0 and _ids(out, "layer") and not _ids(out, "op"), out[-3000:]
    assert "1 op tests deselected: --mla-backend was given without --mla-op" in out, out[-3000:]
    code, out = _collect(selection_dir, "--mla-op", independent)  # a verdict on an op
    assert code == 0 and not _ids(out, "layer") and _ids(out, "op") == [line for line in _ids(out, "op")
                                                                          if "[independent-op]" in line], out[-3000:]
    assert f"{len(DEFAULT_BACKENDS)} layer tests deselected: --mla-op was given without --mla-backend" in out, \
        out[-3000:]
    code, out = _collect(selection_dir, "--mla-op", independent, "--mla-backend", "reference-absorbed")  # both
    assert code == 0 and _ids(out, "layer") and _ids(out, "op") and "deselected:" not in out, out[-3000:]


@pytest.mark.parametrize("spec,message", [
    ("no-such-op", "--mla-op: op spec 'no-such-op': not a built-in op"),
    ("reference-opp", "did you mean 'reference-op'?"),
    ("tests/meta/independent_op.py:Missing", "--mla-op: op spec 'tests/meta/independent_op.py:Missing'"),
])
def test_bad_op_spec_is_a_usage_error(selection_dir, spec, message):
    code, out = _collect(selection_dir, "--mla-op", spec)
    assert code == pytest.ExitCode.USAGE_ERROR and message in out, out[-3000:]


def test_duplicate_op_names_are_refused(selection_dir):
    code, out = _collect(selection_dir, "--mla-op", "reference-op", "--mla-op", "reference-op")
    assert code == pytest.ExitCode.USAGE_ERROR and "--mla-op: two ops share the name(s) ['reference-op']" in out, out
