#!/usr/bin/env python
"""Run the op suite (and the layer suite through OpBackend) against the kernel adapters on a GPU host.

For a future session with an SM90 (or SM100 / SM8x / SM12x) GPU. Installs nothing: it uses whatever
``flash_mla`` / ``flashinfer`` the environment already has, and reports an op whose package does not import
as "not importable" instead of running it. Run from the repository root::

    python .gpu_check/op_adapters.py            # op suite per op, then the layer suite per op (op:SPEC)
    python .gpu_check/op_adapters.py --ops-only # op suite only
    python .gpu_check/op_adapters.py --timeout 240

What it runs, per adapter that imports (flashmla, flashmla-sparse, flashinfer, flashinfer-fa2), plus
reference-op on the same device as a control:

* ``pytest suites --mla-op NAME --mla-device cuda`` (the op suite: suites/test_op_*.py);
* unless ``--ops-only``: ``pytest suites/test_numerics.py suites/test_paged_cache.py --mla-backend op:NAME
  --mla-device cuda`` for the dense ops (the layer suite's numerics and paging through the wrapper), and
  ``pytest suites/test_dsa.py suites/test_cache_bytes.py --mla-backend flashmla-sparse`` (the DSA layer
  backend over FlashMLA's sparse decode: v3.2-mini with the FP8 cache).

Then it prints one table: op, suite, passed / failed / errors / skipped, wall seconds, the device
(capability, name, CUDA, package versions), and the ids of failing tests with the first line of each
failure, and the skip reasons grouped. Exit status 0 when nothing failed or errored.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OPS = {  # op name -> the package it needs
    "reference-op": None,
    "flashmla": "flash_mla",
    "flashmla-sparse": "flash_mla",
    "flashinfer": "flashinfer",
    "flashinfer-fa2": "flashinfer",
}
DENSE_OPS = ("reference-op", "flashmla", "flashinfer", "flashinfer-fa2")
LAYER_TESTS = ["suites/test_numerics.py", "suites/test_paged_cache.py"]
DSA_LAYER_TESTS = ["suites/test_dsa.py", "suites/test_cache_bytes.py"]


def importable(package: str | None) -> str | None:
    """None when the package imports, else why not (one line)."""
    if package is None:
        return None
    try:
        importlib.import_module(package)
    except Exception as exc:  # a wrong-architecture build raises anything
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None


def device_line() -> str:
    try:
        import torch

        if not torch.cuda.is_available():
            return f"no CUDA device (torch {torch.__version__})"
        cap = torch.cuda.get_device_capability()
        parts = [f"{torch.cuda.get_device_name()} (compute capability {cap[0]}.{cap[1]})",
                 f"torch {torch.__version__}", f"CUDA {torch.version.cuda}"]
    except Exception as exc:
        return f"torch unusable: {exc}"
    from importlib import metadata

    for dist in ("flash-mla", "flash_mla", "flashinfer-python", "flashinfer"):
        try:
            parts.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            pass
    return ", ".join(parts)


def run_pytest(args: list[str], timeout: int) -> dict:
    """Run pytest in a subprocess with a junit report; counts, failures and skip reasons."""
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-o", f"cache_dir={Path(tmp) / 'cache'}", "-rs", f"--junitxml={xml}", *args]
        start = time.time()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
            rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-3000:]
        except subprocess.TimeoutExpired as exc:
            rc, tail = "timeout", str(exc)
        wall = time.time() - start
        result = {"rc": rc, "wall": wall, "passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": [],
                  "skips": collections.Counter(), "tail": tail}
        if not xml.exists():
            return result
        for case in ET.parse(xml).getroot().iter("testcase"):
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            kinds = {child.tag: child for child in case}
            if "failure" in kinds or "error" in kinds:
                node = kinds.get("failure", kinds.get("error"))
                result["failed" if "failure" in kinds else "errors"] += 1
                first = (node.get("message") or node.text or "").strip().splitlines()
                result["failures"].append((name, first[0][:300] if first else ""))
            elif "skipped" in kinds:
                result["skipped"] += 1
                result["skips"][(kinds["skipped"].get("message") or "").strip()[:200]] += 1
            else:
                result["passed"] += 1
        return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops-only", action="store_true", help="skip the layer suite through op:SPEC")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per pytest run (default 300)")
    parser.add_argument("--device", default="cuda", help="--mla-device (default cuda)")
    parser.add_argument("--op", action="append", help="only these ops (repeatable)")
    args = parser.parse_args(argv)

    print(f"device: {device_line()}", flush=True)
    rows = []
    for op, package in OPS.items():
        if args.op and op not in args.op:
            continue
        why = importable(package)
        if why:
            rows.append((op, "-", None, f"not importable ({package}: {why})"))
            continue
        runs = [("op suite", ["suites", "--mla-op", op, "--mla-device", args.device])]
        if not args.ops_only and op in DENSE_OPS:
            runs.append(("layer via op:", [*LAYER_TESTS, "--mla-backend", f"op:{op}", "--mla-device", args.device]))
        if not args.ops_only and op == "flashmla-sparse":  # the DSA layer backend over FlashMLASparseOp
            runs.append(("layer DSA", [*DSA_LAYER_TESTS, "--mla-backend", "flashmla-sparse", "--mla-device",
                                       args.device]))
        for label, pytest_args in runs:
            print(f"running {op}: {label} ...", flush=True)
            rows.append((op, label, run_pytest(pytest_args, args.timeout), None))

    print()
    print(f"{'op':<16} {'suite':<14} {'pass':>5} {'fail':>5} {'err':>5} {'skip':>5} {'wall s':>7}  note")
    bad = 0
    for op, label, res, note in rows:
        if res is None:
            print(f"{op:<16} {label:<14} {'':>5} {'':>5} {'':>5} {'':>5} {'':>7}  {note}")
            continue
        bad += res["failed"] + res["errors"] + (1 if res["rc"] == "timeout" else 0)
        note = "TIMEOUT" if res["rc"] == "timeout" else f"rc {res['rc']}"
        print(f"{op:<16} {label:<14} {res['passed']:>5} {res['failed']:>5} {res['errors']:>5} {res['skipped']:>5} "
              f"{res['wall']:>7.1f}  {note}")
    for op, label, res, _ in rows:
        if res is None:
            continue
        if res["failures"]:
            print(f"\n{op} / {label}: failures and errors")
            for name, first in res["failures"]:
                print(f"  {name}\n      {first}")
        if res["skips"]:
            print(f"\n{op} / {label}: skip reasons")
            for reason, n in res["skips"].most_common(12):
                print(f"  {n:>4} x {reason}")
        if res["rc"] not in (0, 1, 5) or (res["passed"] + res["failed"] + res["errors"] + res["skipped"] == 0):
            print(f"\n{op} / {label}: pytest output tail\n{res['tail']}")
    return 1 if bad else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
