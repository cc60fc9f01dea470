"""`mla-conformance run` writes deterministic reports atomically; `merge` builds the cross-host matrix."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.meta

ROOT = Path(__file__).resolve().parents[2]
SUBSET = "seed_table or seed_figures or (test_against_float64 and tiny and float32 and prefill and not decode)"


def _run(*args):
    env = dict(os.environ, PYTHONHASHSEED="0")
    return subprocess.run([sys.executable, "-m", "mla_conformance.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, env=env)


def test_run_twice_is_byte_identical_and_merges(tmp_path):
    outs = []
    for name in ("a", "b"):
        out = tmp_path / name
        r = _run("run", "--out", str(out), "--name", "host", "--", "-q", "-p", "no:xdist", "-k", SUBSET)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
        outs.append(out)
    a, b = (o / "conformance.json" for o in outs)
    assert a.read_bytes() == b.read_bytes()
    report = json.loads(a.read_text())
    assert report["schema"] == "mla-conformance/report" and report["schema_version"] == 1
    assert report["summary"]["reference-absorbed"]["passed"] >= 2
    md = (outs[0] / "conformance.md").read_text()
    assert "29,952" in md and "266,240" in md and "8.888889" in md
    assert (outs[0] / "bytes_per_token.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (outs[0] / "attention_error.png").exists() and (outs[0] / "timings.json").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary directories left behind"

    r = _run("merge", str(a), str(b), "--out", str(tmp_path / "matrix"))
    assert r.returncode == 0, r.stderr
    matrix = json.loads((tmp_path / "matrix" / "matrix.json").read_text())
    assert "host / reference-absorbed" in matrix["columns"]
    row = matrix["rows"]["suites/test_cache_bytes.py::test_seed_table"]
    assert row["host / hf-transformers"]["outcome"] == "passed"
    assert "| check |" in (tmp_path / "matrix" / "matrix.md").read_text()


def test_merge_rejects_non_reports(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"schema": "something-else"}))
    r = _run("merge", str(bad), "--out", str(tmp_path / "m"))
    assert r.returncode == 2 and str(bad) in r.stderr and "not an mla-conformance report" in r.stderr
    assert not (tmp_path / "m").exists()
