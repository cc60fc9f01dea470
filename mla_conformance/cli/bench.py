"""``mla-conformance bench``: time one decode step per backend at long contexts, each checked first.

The measurement is :func:`mla_conformance.perf.bench.run_bench`; a configuration whose decode step fails the
correctness gate is printed as "not timed: wrong output (...)" with no figure, and the command exits 1.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

from mla_conformance.checks.metrics import DTYPES
from mla_conformance.cli.common import DEFAULT_PRESET, UserError, check_device, positive_int, preset_help
from mla_conformance.kv.codecs import get_codec
from mla_conformance.model.config import MLAConfig
from mla_conformance.perf import bench
from mla_conformance.perf.table import format_table
from mla_conformance.report.outdir import check_out_file, write_file_atomically
from mla_conformance.specs import get_backend

#: Exit status of a run in which some configuration was not timed because its output was wrong.
EXIT_NOT_TIMED = 1


def add_cli(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench", help="time one decode step per backend at long contexts (GB/s, FLOPs, bandwidth fraction)",
        description="Time one decode step (one new token per row over CONTEXT cached tokens) for each backend, "
                    "side by side, with bytes per step, achieved GB/s, FLOPs and the fraction of this device's "
                    "memory bandwidth measured in the same run. Caches of the built-in backends are filled "
                    "directly with real latents; every timed step sees exactly CONTEXT cached tokens. Each "
                    "configuration's decode step is first checked against the float64 oracle with the suite's "
                    "bounds; one that fails is not timed ('not timed: wrong output (...)') and the command "
                    "exits 1.")
    p.add_argument("--preset", default=DEFAULT_PRESET, help=preset_help())
    p.add_argument("--context", type=positive_int, nargs="+", required=True, metavar="N", help="cached tokens per row")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="dtype (default: bfloat16)")
    p.add_argument("--backend", action="append", default=None, metavar="SPEC",
                   help="backend spec, or op:SPEC for an op behind the layer contract (repeatable; default: "
                        "reference-naive and reference-absorbed)")
    p.add_argument("--batch", type=positive_int, default=1, help="rows (default: 1)")
    p.add_argument("--kv-codec", default="none", help="cache codec (default: none)")
    p.add_argument("--rounds", type=positive_int, default=None,
                   help="timed rounds per backend (default: 10 up to 4k, 5 up to 16k, 3 beyond)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default: 1)")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch CPU threads (default: torch's; 1 is steadier on a loaded machine)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and hidden states (default: 0)")
    p.add_argument("--json", action="store_true", help="print the results as JSON (sorted keys)")
    p.add_argument("--out", metavar="FILE", default=None,
                   help="write the JSON here (default: reports/bench/bench-<preset>-<dtype>-<time>.json); checked "
                        "before measuring: a new file, or one an earlier `bench` wrote")
    p.set_defaults(func=run_cli)


def run_cli(args) -> int:
    if args.warmup < 0:
        raise UserError(f"--warmup must be >= 0, got {args.warmup}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = check_device(args.device) if args.device is not None else None
    MLAConfig.preset(args.preset)  # unknown preset -> one line, before any work
    if args.kv_codec != "none":
        try:
            get_codec(args.kv_codec)
        except ValueError as exc:
            raise UserError(f"--kv-codec: {exc}") from None
    specs = args.backend or ["reference-naive", "reference-absorbed"]
    for spec in specs:
        get_backend(spec)  # an unknown spec is named before any work
    if args.out:
        out = Path(args.out)
    else:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        out = Path("reports") / "bench" / f"bench-{args.preset}-{args.dtype}-{stamp}.json"
    out = check_out_file(out, bench.BENCH_SCHEMA)  # before measuring: results are never lost to a bad path
    report = bench.run_bench(specs, args.preset, list(args.context), args.dtype, batch=args.batch,
                             kv_codec=args.kv_codec, rounds=args.rounds, warmup=args.warmup, device=device,
                             seed=args.seed)
    text = bench.to_json(report)
    check_out_file(out, bench.BENCH_SCHEMA)
    write_file_atomically(out, text + "\n")
    print(text if args.json else format_table(report))
    print(f"[bench] results written to {out}", file=sys.stderr)
    refused = [r for r in report["results"] if r.get("not_timed")]
    for r in refused:
        print(f"mla-conformance bench: {r['backend']} context {r['context']}: {r['not_timed']}", file=sys.stderr)
    return EXIT_NOT_TIMED if refused else 0
