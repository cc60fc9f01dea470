"""``mla-conformance run``: the options; the run itself is :func:`mla_conformance.runner.run.run_command`."""

from __future__ import annotations

import argparse
import math

from mla_conformance.contract.op import BUILTIN_OPS, DEFAULT_OPS
from mla_conformance.pytest_plugin.isolation import DEFAULT_TIMEOUT_S
from mla_conformance.runner.run import run_command
from mla_conformance.runner.watchdog import DEFAULT_STALL_S


def _seconds(text: str) -> float:
    """argparse type: seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {text}")
    return value


def add_cli(sub) -> None:
    p = sub.add_parser("run", help="run the conformance suite and write reports/<name>/conformance.{json,md}",
                       description="Run the conformance suite on the built-in backends and op (or --backend "
                                   "SPEC... and/or --op SPEC...) and write conformance.json, conformance.md and "
                                   "plots into --out, a new or empty directory or one holding an earlier report "
                                   "of this tool (anything else there is an error; nothing is touched). "
                                   "Arguments after `--` go to pytest, e.g. `-- -k tiny -n 2`. Exits non-zero "
                                   "when a backend or op fails or is NOT TESTED (no conformance test executed).")
    p.add_argument("--backend", action="append", metavar="SPEC",
                   help="backend spec (repeatable); with --op alone no backend runs; with neither, the built-in "
                        "backends and the built-in op")
    p.add_argument("--op", action="append", metavar="SPEC",
                   help=f"op spec (the op contract; repeatable): a built-in op ({', '.join(BUILTIN_OPS)}), "
                        f"package.module:attr or path/to/file.py:attr; with --backend alone no op runs; with "
                        f"neither, {', '.join(DEFAULT_OPS)}")
    p.add_argument("--engine", action="append", metavar="SPEC",
                   help="a serving engine run end to end on the pinned models (suites/test_engine.py): "
                        "ENGINE[:key=value,...], e.g. vllm:attention_backend=CPU_MLA,dtype=float32 (repeatable; "
                        "docs/engines.md); alone, only the engine suite runs")
    p.add_argument("--world-size", type=int, action="append", metavar="W",
                   help="run the distributed layer cases (suites/test_distributed.py: W spawned gloo ranks, TP, "
                        "DCP, TP x DCP) at W ranks (repeatable; without it W = 2); the report "
                        "shows each rank's cache bytes and the verdict")
    p.add_argument("--checkpoint", metavar="DIR",
                   help="a real DeepSeek checkpoint for the checkpoint tests (config, weights and tokenizer "
                        "are checked before any test runs)")
    p.add_argument("--out", metavar="DIR", help="output directory (default reports/<name>)")
    p.add_argument("--name", help="report name (default: this host's name)")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available)")
    p.add_argument("--suites", metavar="DIR", help="suites directory (default: the installed suites, mla_conformance.suites)")
    p.add_argument("--timeout", type=_seconds, metavar="SECONDS",
                   help=f"bound on each test (pytest's --mla-timeout; default {DEFAULT_TIMEOUT_S:g} s, 0 = "
                        "none): past it the test is an error and the run goes on in a fresh worker")
    p.add_argument("--stall-timeout", type=_seconds, metavar="SECONDS",
                   help=f"bound on the whole run making no progress (default {DEFAULT_STALL_S:g} s, 0 = none): no "
                        "test started or finished and no worker started or collected for this long (beyond what "
                        "a running test's --timeout allows) ends the run with the report of what was recorded, "
                        "the tests not reached as errors 'not run' (mla_conformance.runner.watchdog)")
    p.add_argument("pytest_args", nargs="*", metavar="-- PYTEST_ARGS")
    p.set_defaults(func=run_command)
