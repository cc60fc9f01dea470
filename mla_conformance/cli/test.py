"""``mla-conformance test``: plain pytest over the installed conformance suites, from any directory.

The same tests as ``mla-conformance run``, with pytest's own terminal output and exit code and no report:
``mla-conformance test --backend my_backend.py:MyMLA -- -k numerics -x``.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path


def run_tests(args) -> int:
    from mla_conformance.specs import get_backend
    from mla_conformance.report import find_suites
    from mla_conformance.resources import pytest_location_args

    for spec in args.backend or []:
        get_backend(spec)  # fail fast, naming the spec
    suites = find_suites()
    with tempfile.TemporaryDirectory(prefix="mla-conformance-test-") as tmpdir:
        cmd = [sys.executable, "-m", "pytest", str(suites), *pytest_location_args(suites, tmpdir),
               "-p", "no:cacheprovider", "-ra"]
        if importlib.util.find_spec("pytest_benchmark"):  # its storage would land in the cwd
            cmd += ["--benchmark-storage", f"file://{Path(tmpdir) / 'benchmarks'}"]
        for spec in args.backend or []:
            cmd += ["--mla-backend", spec]
        if args.checkpoint:
            cmd += ["--mla-checkpoint", args.checkpoint]
        if args.device:
            cmd += ["--mla-device", args.device]
        cmd += list(args.pytest_args or [])
        print(f"mla-conformance test: pytest {' '.join(cmd[3:])}", flush=True)
        return subprocess.run(cmd).returncode


def add_cli(sub) -> None:
    p = sub.add_parser("test", help="run the installed conformance suites with pytest (no report)",
                       description="Run the installed conformance suites (mla_conformance.suites) with pytest from "
                                   "any directory: pytest's output and exit code, no report. Arguments after `--` "
                                   "go to pytest, e.g. `-- -k numerics -x`. Same as `pytest --pyargs "
                                   "mla_conformance.suites --mla-backend SPEC`, with node ids as in a checkout.")
    p.add_argument("--backend", action="append", metavar="SPEC", help="backend spec (repeatable; default: built-ins)")
    p.add_argument("--checkpoint", metavar="DIR", help="a real DeepSeek checkpoint for the checkpoint tests")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available)")
    p.add_argument("pytest_args", nargs="*", metavar="-- PYTEST_ARGS")
    p.set_defaults(func=run_tests)
