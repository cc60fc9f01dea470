"""The CLI never deletes what it did not write, survives Ctrl-C, and answers bad input in one line.

Everything runs in-process through ``mla_conformance.cli.main`` (pytest itself replaced by a stub that
writes a results file where ``run`` would have started pytest), so these tests take milliseconds.
"""

import argparse
import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mla_conformance.report import plots
from mla_conformance.runner import run as report_run
from mla_conformance.report.build import build_report
from mla_conformance.report.outdir import MARKER
from mla_conformance.perf import bench
from mla_conformance.cli import main

from .harness import user_env

pytestmark = pytest.mark.meta

NODEID = "suites/test_cache_bytes.py::test_bytes_formula[reference-absorbed-1-0-1-float32-tiny]"


def _command_run(tmp: Path):
    """`mla-conformance test --backend reference-absorbed -- <a checkout id> -v`, typed in another directory: the
    console script, a real process: (its directory, exit code, output, what it left in the directory)."""
    script = Path(sys.executable).parent / "mla-conformance"
    cmd = [str(script)] if script.is_file() else [sys.executable, "-m", "mla_conformance.cli"]
    proc = subprocess.run([*cmd, "test", "--backend", "reference-absorbed", "--", NODEID, "-v"], cwd=tmp,
                          capture_output=True, text=True, timeout=300, env=user_env())
    return tmp, proc.returncode, proc.stdout + proc.stderr, sorted(p.name for p in tmp.iterdir())


ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "fixtures" / "models" / "tiny-mla"


def _main(argv, capsys):
    """(exit code, stdout, stderr) of the CLI, argparse's own exits included."""
    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = exc.code
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return rc, out, err


def _results(outcome="passed"):
    return {"backends": ["reference-absorbed"], "exitstatus": 0, "device": "cpu", "tests": [
        {"nodeid": "suites/test_cache_bytes.py::test_seed_table[reference-absorbed]", "outcome": outcome,
         "params": {"backend": "reference-absorbed"}, "device": "cpu",
         **({"reason": "reference-absorbed: declined"} if outcome == "skipped" else {})}]}


@pytest.fixture
def fake_pytest(monkeypatch):
    """`run` with pytest replaced: writes the given results (or raises), records the command."""
    calls = []
    state = {"results": _results(), "raise": None}

    def fake_run(cmd, watch=None):
        calls.append(cmd)
        if state["raise"] is not None:
            raise state["raise"]
        path = Path(cmd[cmd.index("--mla-results") + 1])
        path.write_text(json.dumps(state["results"]))
        return 0, None

    monkeypatch.setattr(report_run, "_run_pytest", fake_run)
    state["calls"] = calls
    return state


def _tree(path: Path) -> dict:
    return {str(p.relative_to(path)): (p.read_bytes() if p.is_file() else None) for p in sorted(path.rglob("*"))}


def _scratch(tmp_path: Path) -> Path:
    d = tmp_path / "scratch"
    (d / "sub").mkdir(parents=True)
    (d / "notes.txt").write_text("mine")
    (d / "README.md").write_text("tracked")
    (d / "sub" / "bench.json").write_text("{}")
    return d


# --------------------------------------------------------------------------- writes are owned


@pytest.mark.parametrize("command", ["run", "merge"])
def test_out_directory_with_foreign_files_is_refused_untouched(tmp_path, capsys, fake_pytest, command):
    d = _scratch(tmp_path)
    before = _tree(d)
    argv = ["run", "--out", str(d)] if command == "run" else ["merge", str(tmp_path / "x.json"), "--out", str(d)]
    rc, _, err = _main(argv, capsys)
    assert rc == 2 and "did not write" in err and "README.md" in err and "notes.txt" in err
    assert _tree(d) == before and not fake_pytest["calls"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["scratch"]


@pytest.mark.parametrize("command", ["run", "merge"])
def test_out_dot_in_a_scratch_dir_is_refused(tmp_path, capsys, monkeypatch, fake_pytest, command):
    d = _scratch(tmp_path)
    before = _tree(d)
    monkeypatch.chdir(d)
    argv = ["run", "--out", "."] if command == "run" else ["merge", "a.json", "--out", "."]
    rc, _, err = _main(argv, capsys)
    assert rc == 2 and "current directory" in err
    assert _tree(d) == before and not fake_pytest["calls"]


@pytest.mark.parametrize("command", ["run", "merge"])
def test_out_naming_an_existing_file_is_refused(tmp_path, capsys, fake_pytest, command):
    f = tmp_path / "existing.txt"
    f.write_text("keep me")
    argv = ["run", "--out", str(f)] if command == "run" else ["merge", "a.json", "--out", str(f)]
    rc, _, err = _main(argv, capsys)
    assert rc == 2 and "not a directory" in err
    assert f.read_text() == "keep me" and sorted(p.name for p in tmp_path.iterdir()) == ["existing.txt"]


def test_run_writes_its_report_and_replaces_only_its_own(tmp_path, capsys, fake_pytest):
    out = tmp_path / "reports" / "host"
    old = os.umask(0o002)
    try:
        rc, stdout, _ = _main(["run", "--out", str(out), "--name", "host"], capsys)
    finally:
        os.umask(old)
    assert rc == 0 and (out / "conformance.json").exists() and (out / MARKER).exists()
    assert (out.stat().st_mode & 0o777) == 0o775 and ((out / "conformance.md").stat().st_mode & 0o777) == 0o664
    cmd = fake_pytest["calls"][0]
    assert "-rfE" in cmd and "-rs" not in cmd and "-ra" not in cmd
    storage = cmd[cmd.index("--benchmark-storage") + 1]  # no stray .benchmarks/ in the cwd
    assert storage.startswith("file://") and "mla-conformance-run-" in storage
    first = (out / "conformance.json").read_bytes()
    rc, _, _ = _main(["run", "--out", str(out), "--name", "host"], capsys)  # over its own report: fine
    assert rc == 0 and (out / "conformance.json").read_bytes() == first
    (out / "mine.txt").write_text("x")  # a foreign file turns up: refused, nothing touched
    rc, _, err = _main(["run", "--out", str(out), "--name", "host"], capsys)
    assert rc == 2 and "mine.txt" in err and (out / "conformance.json").read_bytes() == first
    assert sorted(p.name for p in out.parent.iterdir()) == ["host"], "temporary siblings left behind"


def test_interrupted_run_leaves_the_previous_report(tmp_path, capsys, fake_pytest, monkeypatch):
    out = tmp_path / "rep"
    assert _main(["run", "--out", str(out)], capsys)[0] == 0
    before = _tree(out)
    fake_pytest["raise"] = KeyboardInterrupt()  # Ctrl-C while pytest runs
    rc, _, err = _main(["run", "--out", str(out)], capsys)
    assert rc == 130 and "interrupted" in err and _tree(out) == before
    fake_pytest["raise"] = None

    def ctrl_c_while_writing(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(plots, "write_plots", ctrl_c_while_writing)
    rc, _, _ = _main(["run", "--out", str(out)], capsys)
    assert rc == 130 and _tree(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rep"], "temporary directories left behind"


def test_not_tested_backend_fails_the_run(tmp_path, capsys, fake_pytest):
    fake_pytest["results"] = _results("skipped")
    rc, stdout, err = _main(["run", "--out", str(tmp_path / "r")], capsys)
    assert rc != 0 and "NOT TESTED: reference-absorbed" in err
    data = json.loads((tmp_path / "r" / "conformance.json").read_text())
    assert data["verdicts"]["reference-absorbed"]["verdict"] == "NOT TESTED"


def _op_results(outcome="passed"):
    return {"backends": [], "ops": ["reference-op"], "exitstatus": 0, "device": "cpu",
            "op_declarations": {"reference-op": {"lse_base": "e", "empty_row": "+inf", "page_block_sizes": [64],
                                                 "kv_formats": ["latent"], "fp8_scale_format": "pow2",
                                                 "deterministic": True, "batch_invariant": True}},
            "tests": [{"nodeid": "suites/test_op_numerics.py::test_deterministic[reference-op]", "outcome": outcome,
                       "params": {"op": "reference-op"}, "device": "cpu", "section": "op-determinism",
                       **({"reason": "reference-op: declined"} if outcome == "skipped" else
                          {"figures": {"case": "B=4, s_q=2", "out_differing_values": 0}})}]}


def test_run_op_passes_mla_op_and_writes_the_op_section(tmp_path, capsys, fake_pytest):
    fake_pytest["results"] = _op_results()
    out = tmp_path / "r"
    rc, stdout, _ = _main(["run", "--out", str(out), "--op", "reference-op", "--op", "reference-op"], capsys)
    cmd = fake_pytest["calls"][0]
    assert rc == 0 and [cmd[i + 1] for i, a in enumerate(cmd) if a == "--mla-op"] == ["reference-op"] * 2
    assert "--mla-backend" not in cmd and "op reference-op: CONFORMS (1 passed" in stdout
    data = json.loads((out / "conformance.json").read_text())
    assert data["ops"] == ["reference-op"] and data["op_results"]["reference-op"]["verdict"] == "CONFORMS"
    assert data["op_results"]["reference-op"]["declarations"]["lse_base"] == "e" and data["verdicts"] == {}
    assert "| reference-op | **CONFORMS** |" in (out / "conformance.md").read_text()
    fake_pytest["results"] = _op_results("skipped")  # an op with no executed test fails the run, as a backend
    rc, _, err = _main(["run", "--out", str(out), "--op", "reference-op"], capsys)
    assert rc != 0 and "NOT TESTED: op reference-op" in err


def test_run_without_backend_or_op_leaves_the_selection_to_the_plugin(tmp_path, capsys, fake_pytest):
    assert _main(["run", "--out", str(tmp_path / "r")], capsys)[0] == 0
    cmd = fake_pytest["calls"][0]
    assert "--mla-backend" not in cmd and "--mla-op" not in cmd  # the plugin's defaults: backends and reference-op


@pytest.mark.parametrize("spec, words", [("reference-opp", "did you mean 'reference-op'"),
                                         ("nosuchpkg.mod:Op", "'nosuchpkg.mod:Op'"),
                                         ("mla_conformance.contract.op:OpCase", "'mla_conformance.contract.op:OpCase'")])
def test_run_bad_op_is_one_line_naming_the_option_writing_nothing(tmp_path, capsys, fake_pytest, spec, words):
    out = tmp_path / "new" / "r"
    rc, _, err = _main(["run", "--out", str(out), "--backend", "reference-absorbed", "--op", spec], capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("mla-conformance run: error: --op: ") and words in err
    assert not fake_pytest["calls"] and not (tmp_path / "new").exists()


def test_merge_writes_owned_matrix_and_refuses_foreign(tmp_path, capsys):
    rep = build_report(_results(), name="h", env={"suite_version": "0", "python": "3", "torch": "2",
                                                    "device": "cpu"})
    src = tmp_path / "a.json"
    src.write_text(json.dumps(rep))
    out = tmp_path / "m"
    assert _main(["merge", str(src), "--out", str(out)], capsys)[0] == 0
    assert _main(["merge", str(src), "--out", str(out)], capsys)[0] == 0  # its own matrix: replaced
    (out / "notes.txt").write_text("x")
    rc, _, err = _main(["merge", str(src), "--out", str(out)], capsys)
    assert rc == 2 and "notes.txt" in err and (out / "notes.txt").read_text() == "x"
    rc, _, err = _main(["merge", str(tmp_path), "--out", str(tmp_path / "m3")], capsys)
    assert rc == 2 and "is a directory" in err


# --------------------------------------------------------------------------- bench --out, before measuring


@pytest.fixture
def no_measuring(monkeypatch):
    def boom(*a, **kw):
        raise AssertionError("bench measured before checking --out")

    monkeypatch.setattr(bench, "run_bench", boom)


@pytest.mark.parametrize("target", ["dir", "dot", "foreign-file", "proc"])
def test_bench_out_checked_before_measuring(tmp_path, capsys, monkeypatch, no_measuring, target):
    d = _scratch(tmp_path)
    before = _tree(d)
    monkeypatch.chdir(d)
    out = {"dir": str(d / "sub"), "dot": ".", "foreign-file": str(d / "notes.txt"), "proc": "/proc/x/bench.json"}[target]
    rc, _, err = _main(["bench", "--context", "64", "--out", out], capsys)
    assert rc == 2 and "--out" in err
    assert _tree(d) == before


def test_bench_out_writes_and_overwrites_only_its_own(tmp_path, capsys, monkeypatch):
    fake = {"schema": bench.BENCH_SCHEMA, "schema_version": 1, "results": [], "measured_bandwidth_gb_per_s": 1.0,
            "device": {"device": "cpu"}, "naive_over_absorbed": {}}
    monkeypatch.setattr(bench, "run_bench", lambda *a, **kw: fake)
    out = tmp_path / "b.json"
    assert _main(["bench", "--context", "64", "--json", "--out", str(out)], capsys)[0] == 0
    assert json.loads(out.read_text())["schema"] == bench.BENCH_SCHEMA
    assert _main(["bench", "--context", "64", "--json", "--out", str(out)], capsys)[0] == 0


# --------------------------------------------------------------------------- bad input, one line


def _checkpoint(tmp_path, breakage):
    d = tmp_path / "ckpt"
    if breakage == "empty":
        d.mkdir()
        return d, ["config", "weights", "tokenizer"]
    shutil.copytree(TINY, d)
    if breakage == "truncated-weights":
        f = d / "model.safetensors"
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
        return d, ["weights corrupt", "truncated", str(f)]
    if breakage == "no-tokenizer":
        (d / "tokenizer.json").unlink()
        return d, ["tokenizer missing"]
    (d / "config.json").write_text("{not json")
    return d, ["config corrupt"]


@pytest.mark.parametrize("breakage", ["empty", "truncated-weights", "no-tokenizer", "corrupt-config"])
def test_run_checkpoint_validated_before_any_test(tmp_path, capsys, fake_pytest, breakage):
    d, words = _checkpoint(tmp_path, breakage)
    rc, _, err = _main(["run", "--out", str(tmp_path / "r"), "--checkpoint", str(d)], capsys)
    assert rc == 2 and not fake_pytest["calls"] and len(err.strip().splitlines()) == 1
    for w in words:
        assert w in err
    assert not (tmp_path / "r").exists()


def test_pytest_checkpoint_validated_in_configure(tmp_path):
    from mla_conformance.model.checkpoint import validate_checkpoint
    from mla_conformance.errors import CheckpointError

    validate_checkpoint(TINY)
    d, words = _checkpoint(tmp_path, "empty")
    with pytest.raises(CheckpointError, match="config missing.*weights missing.*tokenizer missing"):
        validate_checkpoint(d)
    # that pytest runs it before any test: tests/meta/test_inputs.py::test_plugin_rejects_an_empty_checkpoint_directory


CASES = [
    (["generate", "--device", "tpu"], "expected cpu, cuda or cuda:N"),
    (["generate", "--max-new-tokens", "0"], "integer >= 1"),
    (["generate", "--max-new-tokens", "-1"], "integer >= 1"),
    (["generate", "--model", "/nonexistent-model"], "no such model directory"),
    (["generate", "--kv-codec", "int9"], "unknown kv_codec"),
    (["generate", "--dtype", "float8"], "--dtype 'float8'"),
    (["run", "--device", "tpu", "--out", "/tmp/mla-conformance-never"], "expected cpu, cuda or cuda:N"),
    (["run", "--backend", "reference-absorbd", "--out", "/tmp/mla-conformance-never"], "'reference-absorbd'"),
    (["run", "--name", "a/b"], "--name"),
    (["bench", "--context", "0"], "integer >= 1"),
    (["bench", "--context", "64", "--device", "tpu"], "expected cpu"),
    (["bench", "--context", "64", "--preset", "nope"], "unknown MLA preset"),
    (["bench", "--context", "64", "--backend", "nope"], "'nope'"),
    (["budget", "--seq", "0"], "--seq"),
    (["budget", "--block-h", "0"], "--block-h"),
    (["budget", "--capability", "7.2"], "--capability 7.2"),
    (["matrix", "--capability", "banana"], "compute capability"),
    (["merge", "/nonexistent.json", "--out", "/tmp/mla-conformance-never"], "no such report file"),
]


@pytest.mark.parametrize("argv,words", CASES, ids=[" ".join(c[0][:3]) for c in CASES])
def test_bad_input_is_one_line_exit_2(argv, words, capsys, no_measuring):
    rc, _, err = _main(argv, capsys)
    assert rc == 2, err
    assert words in err
    assert len([line for line in err.splitlines() if "error" in line]) == 1
    assert not Path("/tmp/mla-conformance-never").exists()


def test_cuda_device_on_a_cpu_build(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    for argv in (["generate", "--device", "cuda"], ["bench", "--context", "64", "--device", "cuda"],
                 ["run", "--device", "cuda:1", "--out", "/tmp/mla-conformance-never"]):
        rc, _, err = _main(argv, capsys)
        assert rc == 2 and "torch sees no CUDA device" in err


# --------------------------------------------------------------------------- words: presets, budget, matrix


def test_presets_and_one_default_in_help(capsys):
    from mla_conformance.cli import build_parser
    from mla_conformance.cli.common import DEFAULT_PRESET
    from mla_conformance.model.config import PRESETS

    sub = build_parser()._subparsers._group_actions[0].choices
    for cmd in ("budget", "bench"):
        text = " ".join(sub[cmd].format_help().split())  # argparse wraps at the terminal width
        assert f"(default: {DEFAULT_PRESET})" in text
        for name in PRESETS:
            assert name in text
    listing = (ROOT / "docs" / "cli.md").read_text()  # the README links the presets' table (docs/cli.md)
    for name in PRESETS:
        assert f"`{name}`" in listing, f"preset {name} missing from docs/cli.md's presets table"
    assert "(docs/cli.md)" in (ROOT / "README.md").read_text()


def test_budget_gives_a_fit_verdict(capsys):
    rc, out, _ = _main(["budget", "--preset", "deepseek-v3.2", "--capability", "9.0", "--capability", "8.0"], capsys)
    assert rc == 0 and "DOES NOT FIT: 288.0 KiB > 227 KiB per block on compute capability 9.0" in out
    rc, out, _ = _main(["budget", "--preset", "tiny", "--block-h", "16", "--block-n", "16", "--json"], capsys)
    assert json.loads(out)["tile"]["smem_verdicts"]["9.0"]["fits"] is True


def test_matrix_names_what_runs(capsys):
    rc, out, _ = _main(["matrix", "--capability", "8.0"], capsys)
    out = " ".join(out.split())  # the text is wrapped at the terminal's width
    assert rc == 0 and "On SM80 (8.0): none of FlashMLA's; FlashInfer's flashinfer/fa2_mla" in out
    rc, out, _ = _main(["matrix", "--capability", "9.0"], capsys)
    assert "FlashMLA's flashmla/dense_decode" in " ".join(out.split())


# --------------------------------------------------------------------------- the commands: one module each


def _registered(module: str) -> set[str]:
    sub = argparse.ArgumentParser().add_subparsers()
    importlib.import_module(module).add_cli(sub)
    return set(sub.choices)


def test_commands_map_every_command_to_its_module():
    """COMMANDS names every command the parser has, each module registers exactly the commands mapped to it, and
    every command module under mla_conformance/cli/ is mapped (cli/run.py, cli/bench.py included once they exist)."""
    from mla_conformance import cli

    assert set(cli.build_parser()._subparsers._group_actions[0].choices) == set(cli.COMMANDS)
    for module in dict.fromkeys(cli.COMMANDS.values()):
        assert _registered(module) == {c for c, m in cli.COMMANDS.items() if m == module}, module
    here = Path(cli.__file__).parent
    command_modules = {f"mla_conformance.cli.{p.stem}" for p in here.glob("*.py")} - {
        "mla_conformance.cli.__init__", "mla_conformance.cli.__main__", "mla_conformance.cli.common"}
    assert command_modules <= set(cli.COMMANDS.values()), "a command module under cli/ that COMMANDS does not map"


def test_a_missing_command_module_is_an_import_error(monkeypatch):
    from mla_conformance import cli

    monkeypatch.setitem(cli.COMMANDS, "nope", "mla_conformance.cli.nope")
    with pytest.raises(ImportError, match="mla_conformance.cli.nope"):
        cli.build_parser("nope")
    with pytest.raises(ImportError, match="mla_conformance.cli.nope"):
        cli.build_parser()


def test_every_command_has_help(capsys):
    from mla_conformance import cli

    for command in cli.COMMANDS:
        rc, out, err = _main([command, "--help"], capsys)
        assert rc == 0 and out.startswith(f"usage: mla-conformance {command}"), (command, err)


def test_domain_modules_import_nothing_from_cli():
    """The command modules call into the domain modules, never the other way: no module outside cli/ imports
    from it, at module level or in a function (argparse only in cli/: tests/test_layout.py)."""
    import ast

    pkg = ROOT / "mla_conformance"
    back = {}
    for path in pkg.rglob("*.py"):
        text = path.read_text()
        if path.relative_to(pkg).parts[0] == "cli" or "cli" not in text:
            continue
        for node in ast.walk(ast.parse(text, str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
                     if isinstance(node, ast.ImportFrom) and not node.level else [])
            if any(n == "mla_conformance.cli" or n.startswith("mla_conformance.cli.") for n in names):
                back.setdefault(str(path.relative_to(ROOT)), []).append(node.lineno)
    assert not back, f"domain modules importing from mla_conformance.cli (file: lines): {back}"


# --------------------------------------------------------------------------- test: the checkout's ids


@pytest.fixture
def command_run(tmp_path):
    return _command_run(tmp_path)


def test_test_command_takes_and_prints_checkout_ids(command_run):
    """From another directory, `mla-conformance test -- suites/...::test[...]` runs that test (not the whole
    suite) and pytest prints it as `suites/...`, not as a path relative to the caller's directory (before:
    `../venv/lib/.../site-packages/mla_conformance/suites/...` for an installed suite); it writes nothing there."""
    tmp, rc, out, left = command_run
    assert rc == 0, out[-3000:]
    assert f"{NODEID} PASSED" in out and "1 passed" in out, out[-3000:]
    assert "../" not in out and str(tmp) not in out, out[-3000:]
    assert left == [], f"mla-conformance test wrote into the caller's directory: {left}"


def test_test_command_arguments_keep_their_meaning(tmp_path):
    """Ids in the checkout's form (also bare `test_x.py`, or a path into the installed suites) select tests; the
    caller's paths, file specs and checkpoint become absolute; option values stay as typed."""
    from types import SimpleNamespace

    from mla_conformance.cli.test import pytest_command
    from mla_conformance.resources import suites_dir

    suites = suites_dir()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "test_extra.py").write_text("")
    (tmp_path / "expect.txt").write_text("")
    (tmp_path / "numerics").mkdir()  # a directory named like the -k expression: still the expression
    args = SimpleNamespace(backend=["my_backend.py:MyMLA", "mypkg.mla:MyBackend", "reference-absorbed"],
                           checkpoint="ckpt", device="cpu", pytest_args=[
                               "suites/test_numerics.py::test_a[x-y]", "test_dsa.py", str(suites / "test_op_fp8.py"),
                               "-k", "numerics", "--mla-expect", "expect.txt", "--junitxml=out/j.xml",
                               "--mla-op=op_file.py:Op", "--deselect", "test_numerics.py::test_b", "mine/test_extra.py",
                               "-x"])
    cmd, cwd, env = pytest_command(args, suites, tmp_path, tmp_path)
    assert cwd == suites.parent
    assert cmd[3:6] == ["suites/test_numerics.py::test_a[x-y]", "suites/test_dsa.py", "suites/test_op_fp8.py"]
    rest = cmd[6:]
    t = str(tmp_path)
    for pair in (["--mla-backend", f"{t}/my_backend.py:MyMLA"], ["--mla-backend", "mypkg.mla:MyBackend"],
                 ["--mla-backend", "reference-absorbed"], ["--mla-checkpoint", f"{t}/ckpt"], ["-k", "numerics"],
                 ["--mla-expect", f"{t}/expect.txt"], ["--deselect", "suites/test_numerics.py::test_b"]):
        i = rest.index(pair[0], *([rest.index(pair[0]) + 2] if pair[1] == "mypkg.mla:MyBackend" else []))
        assert rest[i:i + 2] == pair or pair[1] in rest, (pair, rest)
    assert f"--junitxml={t}/out/j.xml" in rest and f"--mla-op={t}/op_file.py:Op" in rest
    assert f"{t}/mine/test_extra.py" in rest and rest[-1] == "-x"
    assert env["PYTHONPATH"].split(os.pathsep)[0] == t  # module:attr specs resolve from the caller's directory
    no_ids = SimpleNamespace(backend=None, checkpoint=None, device=None, pytest_args=["-k", "seed_table"])
    assert pytest_command(no_ids, suites, tmp_path, tmp_path)[0][3] == "suites"  # no id given: every suite
