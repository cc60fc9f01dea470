"""``mla-conformance codecs``: bytes per token of every KV codec, measured from real caches
(:func:`mla_conformance.kv.codec_table.codec_table`), ratios, and seed 001's sizes next to the honest ones."""

from __future__ import annotations

import json
from typing import Any

from mla_conformance.checks import DTYPES
from mla_conformance.cli.common import DEFAULT_PRESET, UserError, preset_help
from mla_conformance.kv.codec_table import codec_table
from mla_conformance.model.config import MLAConfig


def add_cli(sub: Any) -> None:
    p = sub.add_parser(
        "codecs", help="bytes per token of every KV codec (measured from real caches), ratios, seed 001",
        description="For each quantized latent-cache layout: payload and metadata bytes per token per layer, "
                    "measured by writing tokens into reference-absorbed caches and checked against the layout "
                    "formula; whole-model bytes; ratios against the plain latent and expanded caches; and seed "
                    "001's metadata-free sizes next to the honest ones.")
    p.add_argument("--preset", default=DEFAULT_PRESET, help=preset_help())
    p.add_argument("--dtype", default="bfloat16", help="cache dtype (default: bfloat16)")
    p.add_argument("--json", action="store_true", help="print deterministic JSON")
    p.set_defaults(func=run)


def format_table(table: dict[str, Any], preset: str) -> str:
    """The table as text: one row per codec, the kernel FP8 layouts (656-byte V3.2 row, 584-byte MODEL1: bytes
    per token, those a write sets, page block size and bytes), then seed 001's sizes with and without scales."""
    out = [f"KV codecs at {preset} ({table['layers']} layers), cache dtype {table['dtype']}: bytes per token "
           f"per layer (measured == formula); plain latent {table['latent_bytes_per_token_layer']:,} B, "
           f"expanded {table['expanded_bytes_per_token_layer']:,} B",
           f"{'codec':24} {'payload':>8} {'meta':>6} {'total':>6} {'model B/tok':>12} {'x latent':>9} "
           f"{'x expanded':>10}  k_pe"]
    for r in table["codecs"]:
        if "unsupported" in r:
            out.append(f"{r['name']:24} unsupported: {r['unsupported']}")
            continue
        out.append(f"{r['name']:24} {r['payload']:>8,} {r['metadata']:>6,} {r['total']:>6,} "
                   f"{r['model_bytes_per_token']:>12,} {r['ratio_vs_latent']:>9.2f} {r['ratio_vs_expanded']:>10.2f}  "
                   f"{r['kpe']}")
    layouts = table.get("kernel_layouts") or []
    if layouts:
        out.append("\nkernel FP8 layouts (the op contract's write/decode, at their own dims whatever the preset):")
        out.append(f"  {'layout':20} {'dims':20} {'payload':>7} {'meta':>5} {'total':>6} {'written':>8} "
                   f"{'blk tok':>7} {'block B':>8}")
        for r in layouts:
            out.append(f"  {r['name']:20} {r['dims']:20} {r['payload']:>7,} {r['metadata']:>5,} {r['total']:>6,} "
                       f"{r['written_bytes_per_token']:>8,} {r['page_block_size']:>7,} {r['block_bytes']:>8,}")
    seed = table["quant_study"]
    if seed.get("schemes"):
        out.append(f"\nseed 001 (no scale/zero-point bytes counted; base {seed['expanded_bytes_per_token']:,} "
                   "B/token):")
        for s in seed["schemes"]:
            out.append(f"  {s['scheme']}: {s['seed_bytes_per_token_layer']} B x {seed['layers']} = "
                       f"{s['seed_model_bytes_per_token']:,} B = {s['seed_model_kib']:.1f} KiB, "
                       f"{s['seed_ratio_vs_expanded']:.1f}x (reported {s['reported']})")
            for h in s["honest"]:
                out.append(f"    with scales, {h['codec']}: {h['payload']} + {h['metadata']} = {h['total']} B x "
                           f"{seed['layers']} = {h['model_bytes_per_token']:,} B = {h['model_kib']:.1f} KiB, "
                           f"{h['ratio_vs_expanded']:.1f}x ({h['difference_bytes']:+,} B, "
                           f"{h['difference_pct']:+.1f}%)")
    return "\n".join(out)


def run(args) -> int:
    MLAConfig.preset(args.preset)  # unknown preset -> MLAInputError naming it -> exit 2
    if args.dtype not in DTYPES:
        raise UserError(f"unknown --dtype {args.dtype!r}; known: {', '.join(DTYPES)}")
    table = codec_table(args.preset, DTYPES[args.dtype])
    print(json.dumps(table, indent=1, sort_keys=True) if args.json else format_table(table, args.preset))
    return 0
