"""KV-cache budget, decode arithmetic intensity and the MLA decode tile account.

Pure arithmetic on an :class:`~mla_conformance.model.config.MLAConfig`; no torch, no device. Symbols:
``H_q`` query heads, ``H_kv`` cached K/V heads, ``d`` per-head width, ``d_c`` = ``kv_lora_rank``,
``d_r`` = ``qk_rope_head_dim``, ``b`` bytes per cached element, ``L`` = ``num_hidden_layers``.

KV bytes per token per layer (one row each; multiply by ``L`` for the model, by ``L * N`` for one
sequence of ``N`` tokens):

* MHA reference ``mha_{H}x{d}``: K and V for every head, ``2 * H * d * b`` (V3: 2*128*128*2 = 65,536).
  The reference defaults to ``H = num_attention_heads`` and ``d = qk_nope_head_dim`` (the DeepSeek-V2
  paper's ``d_h``); ``--mha-heads`` / ``--mha-head-dim`` override it.
* GQA ``gqa_{g}`` with g = 8 and 1 KV heads of the same width: ``2 * g * d * b`` (4,096 / 512).
  Rows with ``g >= H`` are left out (that is MHA, or more KV heads than queries).
* MLA latent ``mla_latent``: ``c_KV`` plus the shared RoPE key, ``(d_c + d_r) * b`` (576*2 = 1,152).
* MLA expanded ``mla_expanded_naive``: what an unabsorbed MLA caches after ``wkv_b``, per-head K
  (nope + rope) and V, ``H * (qk_nope + qk_rope + v) * b`` (128*320*2 = 81,920).
* Extra rows from ``kv_rows(..., extra_codecs=[(name, bytes), ...])``: encodings of the latent.

Decode arithmetic intensity (FLOP per cached byte; one query token attends to every cached token,
so the per-token FLOPs over the per-token bytes is independent of the sequence length):

* MHA/GQA: each query head does ``2d`` FLOPs for ``q.k`` and ``2d`` for ``p*v``; the cache holds
  ``2 * H_kv * d * b`` bytes, so ``AI = 4 d H_q / (2 H_kv d b) = 2 H_q / (H_kv b)``.
* MLA absorbed: each head scores against the 576-wide latent (``2 (d_c + d_r)``) and reads ``c_KV``
  again for the output (``2 d_c``), all from one shared ``(d_c + d_r) * b``-byte row:
  ``AI = 2 H_q (2 d_c + d_r) / (b (d_c + d_r))`` (V3.2, bf16: 241.8).
* MLA expanded: ``2 H (d_qk + d_v)`` FLOPs over ``H (d_qk + d_v) b`` bytes, i.e. ``2 / b`` like MHA.
* Extra codec rows: the latent's FLOPs over the codec's bytes.

A machine's balance point is peak FLOP/s over memory bytes/s; MLA decode becomes compute-bound when
``AI >= balance``, i.e. at ``H_q >= balance * b * (d_c + d_r) / (2 (2 d_c + d_r))`` query heads.

Tile account of an MLA decode kernel (FlashMLA / TileLang style; one CTA owns ``block_h`` heads and
walks the cache ``block_n`` tokens at a time): the fp32 accumulators ``acc_o = block_h * d_c`` and
``acc_s = block_h * block_n`` spread over ``threads`` threads, one 32-bit register per element, against
the 255-register limit (Q/K/V fragments not counted); and shared memory for Q, Q_pe, S, KV, K_pe, O,
with KV and K_pe multiplied by the pipeline ``stages``. The shared-memory sum is a simple
lifetime-sum *upper bound*: every buffer counted as live at once, no reuse or aliasing.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Iterable

from mla_conformance.model.config import MLAConfig
from mla_conformance.errors import MLAInputError

#: Bytes per element of the cache dtypes the CLI accepts.
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}

#: GQA rows compared against (KV heads).
GQA_KV_HEADS = (8, 1)

#: Per-thread register limit of CUDA (compute capability >= 3.5).
REGISTER_LIMIT = 255


@dataclasses.dataclass(frozen=True)
class KVRow:
    """One cache layout: its bytes per token per layer and the decode FLOPs per cached token per layer."""

    key: str
    label: str
    bytes_per_token_per_layer: int | float
    flops_per_token_per_layer: int

    @property
    def arithmetic_intensity(self) -> float:
        return self.flops_per_token_per_layer / self.bytes_per_token_per_layer


@dataclasses.dataclass(frozen=True)
class Hardware:
    """A machine's peak dense BF16 tensor FLOP/s and memory bandwidth, with where the numbers come from."""

    key: str
    name: str
    peak_flops: float
    bandwidth: float  # bytes / s
    source: str

    @property
    def balance(self) -> float:
        """FLOP per byte at which compute and memory time are equal."""
        return self.peak_flops / self.bandwidth


HARDWARE: tuple[Hardware, ...] = (
    Hardware("h100_sxm_seed004", "H100 SXM5 (rounded)", 1000e12, 3.0e12,
             "seed 004 (kv_budget.py): rounded public H100 SXM5 figures, ~1000 TFLOP/s dense BF16 "
             "(datasheet ~989) and 3.0 TB/s"),
    Hardware("h100_sxm", "H100 SXM", 989.4e12, 3.35e12,
             "NVIDIA H100 datasheet / Hopper whitepaper: 989.4 TFLOPS dense BF16 "
             "(1,979 with sparsity), 3.35 TB/s HBM3"),
    Hardware("h200_sxm", "H200 SXM", 989.4e12, 4.8e12,
             "NVIDIA H200 datasheet: 989.4 TFLOPS dense BF16 (1,979 with sparsity), 4.8 TB/s HBM3e"),
)


#: Maximum shared memory one thread block may use (opt-in), bytes, by compute capability (CUDA C++
#: Programming Guide, "Technical Specifications per Compute Capability").
SMEM_PER_BLOCK: dict[str, int] = {
    "7.0": 96 * 1024, "7.5": 64 * 1024, "8.0": 163 * 1024, "8.6": 99 * 1024, "8.7": 163 * 1024,
    "8.9": 99 * 1024, "9.0": 227 * 1024, "10.0": 227 * 1024, "10.3": 227 * 1024, "12.0": 99 * 1024,
    "12.1": 99 * 1024,
}
#: Devices the budget judges the tile against when none is stated (the hardware rows above are SM90).
DEFAULT_SMEM_DEVICES = ("9.0",)


def smem_verdict(total_bytes: float, capability: str) -> dict[str, Any]:
    """Fits / does not fit: the tile's shared-memory upper bound against one block's limit."""
    limit = SMEM_PER_BLOCK.get(capability)
    if limit is None:
        raise MLAInputError(f"no shared-memory limit known for compute capability {capability}; known: "
                            f"{', '.join(SMEM_PER_BLOCK)}")
    fits = total_bytes <= limit
    return {"capability": capability, "smem_per_block_bytes": limit, "fits": fits,
            "verdict": ("fits" if fits else "does not fit") + f": {total_bytes / 1024:,.1f} KiB "
                       f"{'<=' if fits else '>'} {limit / 1024:,.0f} KiB per block on compute capability {capability}"
                       + ("" if fits else " (upper bound: a kernel that reuses or aliases buffers may still fit)")}


# ---------------------------------------------------------------------------------------- formulas
def mha_decode_ai(heads_q: int, heads_kv: int, elem_bytes: float) -> float:
    """MHA/GQA decode arithmetic intensity: ``2 H_q / (H_kv b)`` FLOP per byte."""
    return 2.0 * heads_q / (heads_kv * elem_bytes)


def mla_decode_ai(heads_q: int, d_c: int, d_r: int, elem_bytes: float) -> float:
    """Absorbed-MLA decode arithmetic intensity: ``2 H_q (2 d_c + d_r) / (b (d_c + d_r))``."""
    return 2.0 * heads_q * (2 * d_c + d_r) / (elem_bytes * (d_c + d_r))


def mla_heads_to_balance(balance: float, d_c: int, d_r: int, elem_bytes: float) -> float:
    """Query heads at which absorbed-MLA decode reaches ``balance`` FLOP/byte (``mla_decode_ai`` solved for H_q)."""
    return balance * elem_bytes * (d_c + d_r) / (2.0 * (2 * d_c + d_r))


def resolve_elem_bytes(dtype: str, elem_bytes: float | None = None) -> float:
    """Bytes per element: ``elem_bytes`` if given, else that of ``dtype``."""
    if elem_bytes is not None:
        if not elem_bytes > 0:
            raise MLAInputError(f"elem_bytes must be positive, got {elem_bytes!r}")
        return elem_bytes
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise MLAInputError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}") from None


# ---------------------------------------------------------------------------------------- KV rows
def kv_rows(
    config: MLAConfig,
    dtype: str = "bfloat16",
    extra_codecs: Iterable[tuple[str, int | float]] | None = None,
    *,
    mha_heads: int | None = None,
    mha_head_dim: int | None = None,
    elem_bytes: float | None = None,
) -> list[KVRow]:
    """The cache layouts compared, MHA first, then GQA, MLA latent, MLA expanded, then ``extra_codecs``.

    ``extra_codecs`` yields ``(name, bytes_per_token_per_layer)`` for other encodings of the MLA
    latent (e.g. an fp8 cache with scales); they are charged the latent's decode FLOPs.
    """
    b = resolve_elem_bytes(dtype, elem_bytes)
    h = config.num_attention_heads if mha_heads is None else mha_heads
    d = config.qk_nope_head_dim if mha_head_dim is None else mha_head_dim
    for name, value in (("mha_heads", h), ("mha_head_dim", d)):
        if not isinstance(value, int) or value <= 0:
            raise MLAInputError(f"{name} must be a positive integer, got {value!r}")
    _int = _as_int_if_whole
    rows = [KVRow(f"mha_{h}x{d}", f"MHA {h} heads x {d}", _int(2 * h * d * b), 4 * d * h)]
    rows += [KVRow(f"gqa_{g}", f"GQA {g} KV head{'s' * (g > 1)} x {d}", _int(2 * g * d * b), 4 * d * h)
             for g in GQA_KV_HEADS if g < h]
    d_c, d_r, hq = config.kv_lora_rank, config.qk_rope_head_dim, config.num_attention_heads
    latent_flops = 2 * hq * (2 * d_c + d_r)
    rows.append(KVRow("mla_latent", f"MLA latent c_KV({d_c}) + k_pe({d_r})",
                      _int(config.latent_dim * b), latent_flops))
    per_head = config.qk_head_dim + config.v_head_dim
    rows.append(KVRow("mla_expanded_naive", f"MLA expanded {hq} x ({config.qk_head_dim} + {config.v_head_dim})",
                      _int(config.expanded_dim * b), 2 * hq * per_head))
    seen = {row.key for row in rows}
    for name, nbytes in extra_codecs or ():
        if name in seen:
            raise MLAInputError(f"extra codec row {name!r} duplicates an existing row")
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)) or not nbytes > 0:
            raise MLAInputError(f"extra codec row {name!r}: bytes per token per layer must be positive, got {nbytes!r}")
        seen.add(name)
        rows.append(KVRow(name, f"codec {name}", nbytes, latent_flops))
    return rows


def _as_int_if_whole(x: float) -> int | float:
    return int(x) if float(x).is_integer() else x


# ---------------------------------------------------------------------------------------- tile
def tile_account(config: MLAConfig, *, block_h: int = 64, block_n: int = 64, threads: int = 256,
                 stages: int = 2, elem_bytes: float = 2) -> dict[str, Any]:
    """Registers and shared memory of one MLA decode CTA (see the module docstring)."""
    for name, value in (("block_h", block_h), ("block_n", block_n), ("threads", threads), ("stages", stages)):
        if not isinstance(value, int) or value <= 0:
            raise MLAInputError(f"{name} must be a positive integer, got {value!r}")
    d_c, d_r = config.kv_lora_rank, config.qk_rope_head_dim
    acc_o, acc_s = block_h * d_c, block_h * block_n
    regs_o, regs_s = math.ceil(acc_o / threads), math.ceil(acc_s / threads)
    smem = {
        "q": block_h * d_c * elem_bytes,
        "q_pe": block_h * d_r * elem_bytes,
        "s": block_h * block_n * elem_bytes,
        "kv": block_n * d_c * elem_bytes * stages,
        "k_pe": block_n * d_r * elem_bytes * stages,
        "o": block_h * d_c * elem_bytes,
    }
    smem = {k: _as_int_if_whole(v) for k, v in smem.items()}
    total = _as_int_if_whole(sum(smem.values()))
    return {
        "block_h": block_h, "block_n": block_n, "threads": threads, "stages": stages,
        "elem_bytes": _as_int_if_whole(elem_bytes), "d_c": d_c, "d_r": d_r,
        "acc_o_fp32_elems": acc_o, "acc_s_fp32_elems": acc_s,
        "acc_o_regs_per_thread": regs_o, "acc_s_regs_per_thread": regs_s,
        "acc_regs_per_thread": regs_o + regs_s, "register_limit": REGISTER_LIMIT,
        "acc_fits_register_limit": regs_o + regs_s <= REGISTER_LIMIT,
        "smem_bytes": smem, "smem_total_bytes": total, "smem_total_kib": total / 1024,
        "smem_note": "lifetime-sum upper bound: every buffer live at once, no reuse; "
                     "accumulator registers exclude Q/K/V fragments",
    }


# ---------------------------------------------------------------------------------------- report
def budget(config: MLAConfig, seq_len: int, *, dtype: str = "bfloat16", elem_bytes: float | None = None,
           mha_heads: int | None = None, mha_head_dim: int | None = None,
           extra_codecs: Iterable[tuple[str, int | float]] | None = None,
           block_h: int = 64, block_n: int = 64, threads: int = 256, stages: int = 2,
           hardware: Iterable[Hardware] = HARDWARE, preset: str | None = None,
           capabilities: Iterable[str] = DEFAULT_SMEM_DEVICES) -> dict[str, Any]:
    """Every figure of the budget as one JSON-ready dict (the ``--json`` output)."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0:
        raise MLAInputError(f"sequence length must be a positive integer, got {seq_len!r}")
    b = resolve_elem_bytes(dtype, elem_bytes)
    rows = kv_rows(config, dtype, extra_codecs, mha_heads=mha_heads, mha_head_dim=mha_head_dim, elem_bytes=b)
    layers = config.num_hidden_layers
    mha = rows[0]
    d_c, d_r = config.kv_lora_rank, config.qk_rope_head_dim
    mla_ai = mla_decode_ai(config.num_attention_heads, d_c, d_r, b)
    tile = tile_account(config, block_h=block_h, block_n=block_n, threads=threads, stages=stages, elem_bytes=b)
    tile["smem_verdicts"] = {cap: smem_verdict(tile["smem_total_bytes"], cap) for cap in capabilities}
    return {
        "dsa": dsa_bytes(config, seq_len, b),
        "kernel_layouts": kernel_layouts(),
        "preset": preset,
        "config": {k: getattr(config, k) for k in (
            "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
            "num_hidden_layers")},
        "dtype": dtype, "elem_bytes": _as_int_if_whole(b), "seq_len": seq_len, "layers": layers,
        "mha_reference": {"key": mha.key, "heads": mha_heads or config.num_attention_heads,
                          "head_dim": mha_head_dim or config.qk_nope_head_dim},
        "row_labels": {r.key: r.label for r in rows},
        "kv_bytes_per_token_per_layer": {r.key: r.bytes_per_token_per_layer for r in rows},
        "kv_bytes_per_token_model": {r.key: _as_int_if_whole(r.bytes_per_token_per_layer * layers) for r in rows},
        "sequence_bytes": {r.key: _as_int_if_whole(r.bytes_per_token_per_layer * layers * seq_len) for r in rows},
        "fraction_of_mha": {r.key: r.bytes_per_token_per_layer / mha.bytes_per_token_per_layer for r in rows},
        "arithmetic_intensity": {r.key: r.arithmetic_intensity for r in rows},
        "balance": {
            hw.key: {
                "name": hw.name, "peak_flops": hw.peak_flops, "bandwidth_bytes_per_s": hw.bandwidth,
                "source": hw.source, "balance_flop_per_byte": hw.balance,
                "mla_heads_needed": mla_heads_to_balance(hw.balance, d_c, d_r, b),
                "mla_decode_bound": "compute" if mla_ai >= hw.balance else "memory",
            }
            for hw in hardware
        },
        "tile": tile,
    }


#: The FP8 layouts of DeepSeek-V3.2's DSA cache (FlashMLA's sparse decode and DeepSeek's indexer):
#: latent 512 x e4m3 + 4 x fp32 tile scales + 64 x bf16 rope = 656 B; indexer key 128 x e4m3 + one fp32
#: scale per 128 values = 132 B.
FP8_LATENT_SCALE_BLOCK = 128
FP8_INDEXER_SCALE_BLOCK = 128


def dsa_bytes(config: MLAConfig, seq_len: int, elem_bytes: float) -> dict[str, Any] | None:
    """DeepSeek Sparse Attention's cache per token per layer, the latent and the lightning indexer's key
    apart and together ("latent+indexer"), in the cache dtype and in the FP8 form; None for dense MLA.
    The ``mla_latent`` row (seed 004's 1,152 B/token/layer for V3.2) is the latent alone."""
    if getattr(config, "index_topk", None) is None:
        return None
    _int = _as_int_if_whole
    d_c, d_r, d_i = config.kv_lora_rank, config.qk_rope_head_dim, config.index_head_dim
    latent, indexer = _int(config.latent_dim * elem_bytes), _int(d_i * elem_bytes)
    fp8_latent = d_c + 4 * math.ceil(d_c / FP8_LATENT_SCALE_BLOCK) + 2 * d_r
    fp8_indexer = d_i + 4 * math.ceil(d_i / FP8_INDEXER_SCALE_BLOCK)
    layers = config.num_hidden_layers

    def block(lat, idx):
        total = _int(lat + idx)
        return {"latent_bytes_per_token_per_layer": lat, "indexer_bytes_per_token_per_layer": idx,
                "total_bytes_per_token_per_layer": total,
                "latent_sequence_bytes": _int(lat * layers * seq_len),
                "indexer_sequence_bytes": _int(idx * layers * seq_len),
                "total_sequence_bytes": _int(total * layers * seq_len),
                "indexer_fraction_of_total": idx / total}

    return {"index_n_heads": config.index_n_heads, "index_head_dim": d_i, "index_topk": config.index_topk,
            "cache_dtype": block(latent, indexer), "fp8_indexer": block(latent, fp8_indexer),
            "fp8": block(fp8_latent, fp8_indexer),
            "note": "mla_latent (seed 004's figure) is the latent alone; a DSA cache also holds one indexer key "
                    "per token per layer (cache_format 'latent+indexer')"}


def kernel_layouts() -> dict[str, Any]:
    """The FP8 cache layouts of FlashMLA's kernels at their own head dims, next to the preset's rows: the 656-byte
    V3.2 row is the ``fp8-e4m3-flashmla`` codec row above where the preset's dims are 512 + 64; MODEL1's 584-byte
    layout (d_qk 512 = 448 + 64) is listed here whatever the preset (mla_conformance.kv.model1)."""
    from mla_conformance.kv import model1  # imports torch: the arithmetic above stays importable without it

    return {model1.NAME: model1.layout_row()}


def to_json(report: dict[str, Any]) -> str:
    """Deterministic JSON: sorted keys, two-space indent."""
    return json.dumps(report, sort_keys=True, indent=2)


def fmt_bytes(n: float) -> str:
    """Binary units: ``575668224`` -> ``549.00 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} B" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_report(report: dict[str, Any]) -> str:
    """The human-readable tables of ``mla-conformance budget``."""
    c = report["config"]
    out = [f"KV budget: {report['preset'] or 'config'}  heads={c['num_attention_heads']} "
           f"kv_lora={c['kv_lora_rank']} rope={c['qk_rope_head_dim']} nope={c['qk_nope_head_dim']} "
           f"v={c['v_head_dim']} layers={report['layers']}  dtype={report['dtype']} "
           f"({report['elem_bytes']} B/elem)  seq={report['seq_len']:,}", ""]
    head = f"{'cache layout':<34} {'B/token/layer':>14} {'B/token (model)':>16} {'one sequence':>14} {'vs MHA':>8} {'AI FLOP/B':>10}"
    out += [head, "-" * len(head)]
    for key, label in report["row_labels"].items():
        out.append(f"{label:<34} {report['kv_bytes_per_token_per_layer'][key]:>14,} "
                   f"{fmt_bytes(report['kv_bytes_per_token_model'][key]):>16} "
                   f"{fmt_bytes(report['sequence_bytes'][key]):>14} "
                   f"{report['fraction_of_mha'][key]:>8.2%} {report['arithmetic_intensity'][key]:>10.1f}")
    for row in (report.get("kernel_layouts") or {}).values():
        out.append(f"{row['name']:<34} {row['total']:>14,}  FlashMLA's layout at its own dims ({row['dims']}, "
                   f"not this preset's): {row['payload']} payload + {row['metadata']} scale/padding B; pages of "
                   f"{row['page_block_size']}: {row['block_bytes']:,} B per block")
    dsa = report.get("dsa")
    if dsa:
        out += ["", f"DeepSeek Sparse Attention (indexer {dsa['index_n_heads']} heads x {dsa['index_head_dim']}, "
                    f"top-{dsa['index_topk']:,}): the MLA latent row above is the latent alone (seed 004's "
                    f"{dsa['cache_dtype']['latent_bytes_per_token_per_layer']:,} B/token/layer); the cache also "
                    "holds one indexer key per token per layer"]
        for key, label in (("cache_dtype", f"{report['dtype']}"),
                           ("fp8_indexer", f"{report['dtype']} + FP8 indexer"),  # DeepSeek's V3.2-Exp reference
                           ("fp8", "FP8 (e4m3 + fp32 scales)")):
            d = dsa[key]
            out.append(f"  {label:<26} latent {d['latent_bytes_per_token_per_layer']:>6,} + indexer "
                       f"{d['indexer_bytes_per_token_per_layer']:>4,} = {d['total_bytes_per_token_per_layer']:>6,} "
                       f"B/token/layer; one sequence {fmt_bytes(d['latent_sequence_bytes'])} + "
                       f"{fmt_bytes(d['indexer_sequence_bytes'])} = {fmt_bytes(d['total_sequence_bytes'])}")
    out += ["", "Balance point (peak FLOP/s / bandwidth) and query heads MLA decode needs to reach it:"]
    for hw in report["balance"].values():
        out.append(f"  {hw['name']:<20} {hw['peak_flops'] / 1e12:>7.1f} TFLOP/s {hw['bandwidth_bytes_per_s'] / 1e12:>5.2f} TB/s"
                   f"  balance {hw['balance_flop_per_byte']:>6.1f} FLOP/B  heads {hw['mla_heads_needed']:>6.1f}"
                   f"  ({hw['mla_decode_bound']}-bound at {c['num_attention_heads']})")
        out.append(f"  {'':<20} source: {hw['source']}")
    t = report["tile"]
    out += ["", f"MLA decode tile: block_h={t['block_h']} block_n={t['block_n']} threads={t['threads']} "
                f"stages={t['stages']} d_c={t['d_c']} d_r={t['d_r']}",
            f"  acc_o = {t['block_h']} x {t['d_c']} = {t['acc_o_fp32_elems']:,} fp32 -> {t['acc_o_regs_per_thread']} regs/thread",
            f"  acc_s = {t['block_h']} x {t['block_n']} = {t['acc_s_fp32_elems']:,} fp32 -> {t['acc_s_regs_per_thread']} regs/thread",
            f"  together {t['acc_regs_per_thread']} of {t['register_limit']} regs/thread "
            f"({'fits' if t['acc_fits_register_limit'] else 'over the limit'}; Q/K/V fragments not counted)",
            "  shared memory:"]
    for name, nbytes in t["smem_bytes"].items():
        out.append(f"    {name:<6} {nbytes:>10,} B")
    out.append(f"    {'total':<6} {t['smem_total_bytes']:>10,} B = {t['smem_total_kib']:,.1f} KiB "
               "(lifetime-sum upper bound, no buffer reuse)")
    for v in t.get("smem_verdicts", {}).values():
        out.append(f"  {v['verdict'].upper().split(':')[0]}: {v['verdict'].split(': ', 1)[1]}")
    return "\n".join(out)


def codec_rows(config: MLAConfig, dtype: str) -> list[tuple[str, int]]:
    """(codec name, total bytes per token per layer incl. scales) for every quantized latent codec that
    supports this config and cache dtype (formula of mla_conformance.kv.codecs; the codecs suite checks it
    against real caches)."""
    import torch

    from mla_conformance.kv.codecs import CODECS  # imports torch: the arithmetic above stays importable without it

    cache_dtype = getattr(torch, dtype, None)
    if not isinstance(cache_dtype, torch.dtype):
        return []
    rows = []
    for name, codec in CODECS.items():
        if name == "none" or codec.unsupported_reason(config, cache_dtype):
            continue
        rows.append((name, int(codec.bytes_per_token(config, cache_dtype)["total"])))
    return rows
