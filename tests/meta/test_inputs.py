"""Bad input gets a clear message naming what and where, and nothing half-written."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mla_conformance.errors import MLAInputError
from mla_conformance.generation.golden import read_golden

from . import harness

pytestmark = pytest.mark.meta

ROOT = Path(__file__).resolve().parents[2]


def _run(*args, **kw):
    env = dict(os.environ, PYTHONHASHSEED="0")
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, env=env, **kw)


def pytest_inprocess(pytester, *args) -> tuple[int, str, str]:
    """pytest on this checkout's files, in this process (no second torch import; tests/meta/harness.py):
    (exit code, stdout, stderr). Paths and specs are the checkout's (made absolute)."""
    got = harness.pytest_inprocess(pytester, "-n", "0", *map(harness.here, args))
    return int(got.ret), "\n".join(got.outlines), "\n".join(got.errlines)


def test_expectation_file(tmp_path, pytester):
    """Listed failures become xfail; a listed passing test is reported XPASS; an unmatched line warns."""
    expect = tmp_path / "expect.txt"
    expect.write_text(
        "# known failures of broken-missing-mscale\n"
        "suites/test_numerics.py::test_against_float64[broken-missing-mscale-float32-prefill-tiny]  mscale^2 missing\n"
        "suites/test_cache_bytes.py::test_seed_table[broken-missing-mscale]  listed but passes\n"
        "suites/test_numerics.py::test_nothing_like_this  stale entry\n")
    code, out, err = pytest_inprocess(
        pytester, "suites/test_numerics.py", "suites/test_cache_bytes.py", "-rxXs", "-k",
        "(float64 and tiny and prefill and not decode and float32) or seed_table",
        "--mla-backend", "tests/meta/impls/broken/backends.py:MissingMscale", "--mla-expect", str(expect))
    assert code == 0, out[-3000:] + err[-2000:]
    assert "1 xfailed" in out and "1 xpassed" in out
    assert "XPASS" in out and "listed but passes" in out
    assert "matches no collected test" in out and "test_nothing_like_this" in out


def test_expectation_file_errors(tmp_path, pytester):
    bad = tmp_path / "expect.txt"
    bad.write_text("suites/test_numerics.py::test_against_float64[x\n")
    code, out, err = pytest_inprocess(pytester, "suites/test_numerics.py", "--mla-expect", str(bad),
                                      "--co", "-q")
    assert code == 4 and f"{bad}:1" in err and "gives no reason" in err
    assert "Traceback" not in err + out


def test_unwritable_report_dir(tmp_path, capsys):
    from mla_conformance.cli import main

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    assert main(["run", "--out", str(blocker / "report")]) == 2
    err = capsys.readouterr().err
    assert str(blocker) in err and "Traceback" not in err
    assert blocker.read_text() == "not a directory"


def test_run_rejects_bad_backend_before_running(tmp_path, capsys):
    from mla_conformance.cli import main

    assert main(["run", "--out", str(tmp_path / "rep"), "--backend", "reference-absorbd"]) == 2
    err = capsys.readouterr().err
    assert "'reference-absorbd'" in err and "Traceback" not in err
    assert not (tmp_path / "rep").exists()


def test_corrupt_golden_names_the_file(tmp_path):
    g = tmp_path / "tiny-short.none.json"
    g.write_text('{"outputs": [ {"id": ')
    with pytest.raises(MLAInputError, match=str(g).replace(".", r"\.") + ": corrupt golden file"):
        read_golden(g)
    g.write_text(json.dumps({"no": "outputs"}))
    with pytest.raises(MLAInputError, match="no 'outputs' list"):
        read_golden(g)


def test_cli_unknown_preset_and_dtype(capsys):
    from mla_conformance.cli import main

    assert main(["generate", "--dtype", "float8"]) == 2
    err = capsys.readouterr().err
    assert "--dtype 'float8'" in err and "Traceback" not in err


def test_plugin_rejects_bad_device(pytester):
    code, out, err = pytest_inprocess(pytester, "suites/test_cache_bytes.py", "--mla-device", "tpu",
                                      "--co", "-q")
    assert code == 4 and "--mla-device 'tpu'" in err and "Traceback" not in err + out


def test_plugin_rejects_an_empty_checkpoint_directory(tmp_path, pytester):
    """--mla-checkpoint is validated once, before any test: one line naming what is missing, exit 4."""
    code, out, err = pytest_inprocess(pytester, "suites/test_cache_bytes.py", "--mla-checkpoint",
                                      str(tmp_path), "--co", "-q")
    assert code == 4 and "--mla-checkpoint" in err and str(tmp_path) in err
    assert "Traceback" not in err + out and "INTERNALERROR" not in err + out
