"""Bad input gets a clear message naming what and where, and nothing half-written."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mla_conformance.errors import MLAInputError
from mla_conformance.golden import read_golden

pytestmark = pytest.mark.meta

ROOT = Path(__file__).resolve().parents[2]


def _run(*args, **kw):
    env = dict(os.environ, PYTHONHASHSEED="0")
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, env=env, **kw)


def test_expectation_file(tmp_path):
    """Listed failures become xfail; a listed passing test is reported XPASS; an unmatched line warns."""
    expect = tmp_path / "expect.txt"
    expect.write_text(
        "# known failures of broken-missing-mscale\n"
        "suites/test_numerics.py::test_against_float64[broken-missing-mscale-float32-prefill-tiny]  mscale^2 missing\n"
        "suites/test_cache_bytes.py::test_seed_table[broken-missing-mscale]  listed but passes\n"
        "suites/test_numerics.py::test_nothing_like_this  stale entry\n")
    r = _run("-m", "pytest", "suites/test_numerics.py", "suites/test_cache_bytes.py", "-p", "no:cacheprovider",
             "-p", "no:xdist", "-rxXs", "-k", "(float64 and tiny and prefill and not decode and float32) or seed_table",
             "--mla-backend", "suites/meta/broken_backends.py:MissingMscale", "--mla-expect", str(expect))
    out = r.stdout
    assert r.returncode == 0, out[-3000:]
    assert "1 xfailed" in out and "1 xpassed" in out
    assert "XPASS" in out and "listed but passes" in out
    assert "matches no collected test" in out and "test_nothing_like_this" in out


def test_expectation_file_errors(tmp_path):
    bad = tmp_path / "expect.txt"
    bad.write_text("suites/test_numerics.py::test_against_float64[x\n")
    r = _run("-m", "pytest", "suites/test_numerics.py", "-p", "no:cacheprovider", "-p", "no:xdist",
             "--mla-expect", str(bad), "--co", "-q")
    assert r.returncode == 4 and f"{bad}:1" in r.stderr and "gives no reason" in r.stderr
    assert "Traceback" not in r.stderr


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


def test_plugin_rejects_bad_device():
    r = _run("-m", "pytest", "suites/test_cache_bytes.py", "-p", "no:cacheprovider", "-p", "no:xdist",
             "--mla-device", "tpu", "--co", "-q")
    assert r.returncode == 4 and "--mla-device 'tpu'" in r.stderr and "Traceback" not in r.stderr

