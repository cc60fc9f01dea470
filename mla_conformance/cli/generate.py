"""``mla-conformance generate`` (greedy generation with attention through a backend) and ``mla-conformance
dsa-variant`` (a DeepSeek Sparse Attention variant of a dense model): :mod:`mla_conformance.generation.generate`."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from mla_conformance.checks import DTYPES
from mla_conformance.cli.common import UserError, check_device, positive_int
from mla_conformance.generation.generate import (DEFAULT_MODEL, DEFAULT_PROMPTS, make_dsa_variant, run_generation,
                                                 tiny_training_sequences)
from mla_conformance.kv.codecs import get_codec
from mla_conformance.specs import get_backend


def add_cli(sub: Any) -> None:
    p = sub.add_parser("generate", help="greedy generation with attention running through a backend")
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="model directory (default: the embedded tiny model)")
    p.add_argument("--backend", default="reference-absorbed", metavar="SPEC")
    p.add_argument("--kv-codec", default="none", metavar="NAME")
    p.add_argument("--prompts", action="append", metavar="SET", help="prompt set name in the prompts file (repeatable)")
    p.add_argument("--prompts-file", default=str(DEFAULT_PROMPTS), metavar="FILE")
    p.add_argument("--max-new-tokens", type=positive_int, default=None, metavar="N",
                   help="tokens to generate per prompt, >= 1 (default: each prompt's expected answer length)")
    p.add_argument("--dtype", default="float32", help="float32, float64, bfloat16 or float16 (default: float32)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run_generate)

    v = sub.add_parser("dsa-variant", help="write a DeepSeek Sparse Attention variant of a dense model (indexer added)",
                       description="Copy a dense MLA model directory and add a lightning indexer per layer plus the DSA "
                                   "fields to its config.json, so `generate --model OUT --backend reference-dsa` runs it. "
                                   "With --warmup-steps the indexer is trained as DeepSeek-V3.2's dense warm-up stage "
                                   "trains it (everything else frozen; KL to the dense model's head-averaged attention) "
                                   "on token-id sequences: --train-sequences FILE (a JSON list of lists), or in a "
                                   "checkout held-out episodes of fixtures/train_tiny.py's tasks (seed 11, none of them a "
                                   "pinned prompt).")
    v.add_argument("out", help="directory to write")
    v.add_argument("--model", default=str(DEFAULT_MODEL), help="dense model directory (default: the embedded tiny model)")
    v.add_argument("--index-n-heads", type=positive_int, default=4)
    v.add_argument("--index-head-dim", type=positive_int, default=32)
    v.add_argument("--index-topk", type=positive_int, default=16)
    v.add_argument("--warmup-steps", type=int, default=0, help="indexer training steps (default 0: the seeded draw)")
    v.add_argument("--train-sequences", default=None, metavar="FILE", help="JSON list of token-id lists to train on")
    v.add_argument("--seed", type=int, default=0)
    v.set_defaults(func=run_dsa_variant)


def run_generate(args) -> int:
    if args.dtype not in DTYPES:
        raise UserError(f"--dtype {args.dtype!r}: choose one of {sorted(DTYPES)}")
    device = check_device(args.device)
    if not Path(args.model).is_dir():
        raise UserError(f"--model {args.model}: no such model directory")
    if args.kv_codec != "none":
        try:
            get_codec(args.kv_codec)
        except ValueError as exc:
            raise UserError(f"--kv-codec: {exc}") from None
    backend = get_backend(args.backend)
    result = run_generation(args.model, backend, kv_codec=args.kv_codec, prompt_sets=args.prompts,
                            max_new_tokens=args.max_new_tokens, dtype=DTYPES[args.dtype], device=device,
                            prompts_file=args.prompts_file)
    if args.json:
        print(json.dumps(result, indent=1, sort_keys=True, ensure_ascii=False))
    else:
        for o in result["outputs"]:
            print(f"{o['id']:>24}  {o['correct']}/{len(o['expected'])}  {o.get('text', o['tokens'])}")
        print(f"accuracy {result['accuracy']:.4f} ({result['backend']}, kv_codec {result['kv_codec']}, "
              f"{result['dtype']}, {result['device']})")
    return 0


def run_dsa_variant(args) -> int:
    if args.warmup_steps < 0:
        raise UserError(f"--warmup-steps must be >= 0, got {args.warmup_steps}")
    if not Path(args.model).is_dir():
        raise UserError(f"--model {args.model}: no such model directory")
    sequences = None
    if args.warmup_steps:
        if args.train_sequences:
            try:
                sequences = json.loads(Path(args.train_sequences).read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError) as exc:
                raise UserError(f"--train-sequences {args.train_sequences}: {exc}") from None
        else:
            sequences = tiny_training_sequences()
    figures = make_dsa_variant(args.model, args.out, index_n_heads=args.index_n_heads,
                               index_head_dim=args.index_head_dim, index_topk=args.index_topk, sequences=sequences,
                               steps=args.warmup_steps, seed=args.seed,
                               progress=lambda m: print(f"[dsa-variant] {m}", file=sys.stderr, flush=True))
    print(json.dumps({"out": str(args.out), **figures}, indent=1))
    return 0
