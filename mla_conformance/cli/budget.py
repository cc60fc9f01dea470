"""``mla-conformance budget``: KV-cache bytes, decode arithmetic intensity and the MLA decode tile account
(:mod:`mla_conformance.kv.budget`), with a fits / does-not-fit verdict per stated device."""

from __future__ import annotations

from typing import Any

from mla_conformance.arch.capability import cap_str, parse_capability
from mla_conformance.cli.common import DEFAULT_PRESET, UserError, preset_help
from mla_conformance.kv.budget import (DEFAULT_SMEM_DEVICES, DTYPE_BYTES, SMEM_PER_BLOCK, budget, codec_rows,
                                       format_report, to_json)
from mla_conformance.model.config import MLAConfig


def add_cli(sub: Any) -> None:
    p = sub.add_parser(
        "budget", help="the KV budget: cache bytes, decode arithmetic intensity, MLA tile account and a "
                       "fits / does-not-fit verdict",
        description="The KV budget (seed 004): KV-cache bytes (MHA/GQA/MLA latent/expanded/codecs), decode "
                    "arithmetic intensity, balance points, and the MLA decode tile's registers and shared "
                    "memory with a fits / does-not-fit verdict against the stated device's per-block limit. "
                    "With --v4: DeepSeek-V4's KV cache beside V3 MLA and V3.2 DSA, and DeepSeek's 1M-token claim.")
    p.add_argument("--preset", default=DEFAULT_PRESET, help=preset_help() + "; seed 004's figures: deepseek-v3.2")
    p.add_argument("--seq", type=int, default=8192, help="sequence length for the one-sequence bytes (default: 8192)")
    p.add_argument("--capability", action="append", metavar="X.Y", default=None,
                   help="judge the tile's shared memory against this compute capability's per-block limit "
                        f"(repeatable; known: {', '.join(SMEM_PER_BLOCK)}; default: 9.0, the H100/H200 rows)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_BYTES), help="cache dtype (default: bfloat16)")
    p.add_argument("--elem-bytes", type=float, default=None, help="bytes per element (default: from --dtype)")
    p.add_argument("--mha-heads", type=int, default=None, help="heads of the MHA/GQA reference (default: preset's heads)")
    p.add_argument("--mha-head-dim", type=int, default=None,
                   help="head width of the MHA/GQA reference (default: preset's qk_nope_head_dim)")
    p.add_argument("--block-h", type=int, default=64)
    p.add_argument("--block-n", type=int, default=64)
    p.add_argument("--threads", type=int, default=256)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--v4", action="store_true",
                   help="instead of the preset's budget: DeepSeek-V4-Flash and V4-Pro's KV cache per layer type and "
                        "model at 128k and 1M tokens (bf16, FP8 MODEL1), beside V3 MLA and V3.2 DSA, and the ratio to "
                        "V3.2 against DeepSeek's claim (mla_conformance.kv.v4_budget); --json applies, the other "
                        "options do not")
    p.add_argument("--json", action="store_true", help="print the figures as deterministic JSON")
    p.set_defaults(func=run)


def _smem_capability(text: str) -> str:
    """``9.0``, ``sm_90``, ``SM100`` -> the key of SMEM_PER_BLOCK (``"9.0"``); UserError naming the value."""
    try:
        cap = cap_str(parse_capability(text))
    except ValueError as exc:
        raise UserError(f"--capability {text}: {exc}") from None
    if cap not in SMEM_PER_BLOCK:
        raise UserError(f"--capability {cap}: no shared-memory limit known; known: {', '.join(SMEM_PER_BLOCK)}")
    return cap


#: presets that name a DeepSeek-V4 model: budget --preset NAME prints the V4 tables (as --v4)
V4_PRESET_NAMES = ("deepseek-v4-flash", "deepseek-v4-pro")


def run(args) -> int:
    if args.v4 or args.preset in V4_PRESET_NAMES:
        # the V4 tables (and V4Config's presets) load only when asked for
        from mla_conformance.kv import v4_budget

        report = v4_budget.v4_report()
        print(to_json(report) if args.json else v4_budget.format_v4_report(report))
        return 0
    if args.seq <= 0:
        raise UserError(f"--seq must be a positive integer, got {args.seq}")
    elem_bytes = args.elem_bytes
    if elem_bytes is not None and float(elem_bytes).is_integer():
        elem_bytes = int(elem_bytes)
    config = MLAConfig.preset(args.preset)  # unknown name -> MLAInputError naming it -> exit 2
    caps = [_smem_capability(c) for c in (args.capability or DEFAULT_SMEM_DEVICES)]
    for name in ("block_h", "block_n", "threads", "stages", "mha_heads", "mha_head_dim"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise UserError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    if args.elem_bytes is not None and not args.elem_bytes > 0:
        raise UserError(f"--elem-bytes must be positive, got {args.elem_bytes}")
    report = budget(config, args.seq, dtype=args.dtype, elem_bytes=elem_bytes, mha_heads=args.mha_heads,
                    mha_head_dim=args.mha_head_dim, block_h=args.block_h, block_n=args.block_n,
                    threads=args.threads, stages=args.stages, preset=args.preset,
                    extra_codecs=codec_rows(config, args.dtype), capabilities=caps)
    print(to_json(report) if args.json else format_report(report))
    return 0
