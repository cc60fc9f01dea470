"""Checks of the op contract's ``write`` (the cache writer: vLLM's ``concat_and_cache_mla``, FlashInfer's
``append_paged_mla_kv_cache``) for suites/test_op_write.py and the composition.

Inputs (:func:`build`, cached per :class:`WriteSpec`): kv_c and k_pe as views of one projection output
[T, kv_lora + rope + 32] (NaN in the last 32 columns), a slot_mapping that writes part of a page, a whole page
and the first slots of another page in shuffled token order, with -1 entries (padding) among them -- slot 0 and
the last block are never written, so a -1 taken as 0 or as the last slot shows; the cache's block memory filled
with seeded random bytes (every byte a canary) and a canary after it.

After the call (:func:`check_write`): every byte outside the written tokens' spans is unchanged
(mla_conformance.kv.cache_write), and each written token holds exactly what the oracle encodes -- bit for bit for
the latent format; for the FP8 layouts e4m3 payload, tile scales and the bfloat16 rope as FlashMLA's
tests/quant.py writes them under the declared ``write_fp8_scale_format``: bit for bit under ``"pow2"``
(DeepSeek's ue8m0: max(amax / 448, 1e-4) rounded up to a power of two is one exact value). Under ``"fp32"``
the tile is judged by what a reader of the cache decodes, not by the scale's bits: each stored scale finite, >= 0
and amax / 448 within WRITE_FP32_SCALE_REL (checks/tolerances.py: any arithmetic of bfloat16's precision or
better, FlashMLA's earlier float32-scale writer included), the 1e-4 floor optional (SGLang drops it; it exists
to keep log2 finite in the pow2 path); each e4m3 value times its tile's stored scale within half an e4m3 step
(at value / scale, x (1 + 2^-20) for a tie) of the written value -- an all-zero tile of scale 0 decodes to 0,
never NaN. Failures name the token, slot, field and both values, and the likely cause where one fits.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch

from mla_conformance.checks import op as op_checks
from mla_conformance.checks.op import methods as method_checks
from mla_conformance.checks.op.inputs import declared_otherwise
from mla_conformance.contract.op import MethodCase, OpCase, declared
from mla_conformance.errors import BackendOutputError
from mla_conformance.kv import cache_write, model1
from mla_conformance.checks.tolerances import WRITE_FP32_SCALE_REL
from mla_conformance.dtypes import FP8_E4M3_MAX
from mla_conformance.kv.codecs import FLASHMLA_SCALE_FLOOR, flashmla_fp8_scales
from mla_conformance.messages import failure
from mla_conformance.impl.ops.reference import oracle

METHOD = "write"
FP8_656 = "fp8-e4m3-flashmla"
#: (kv_lora, rope) of each format's rows
WIDTHS = {"latent": (512, 64), FP8_656: (512, 64), model1.NAME: (model1.D_NOPE, model1.D_ROPE)}
#: the fields of each format's spans: (name, span, start, end, kind)
FIELDS = {
    "latent": (("row", 0, 0, None, "raw"),),
    FP8_656: (("tile scales", 0, 512, 528, "f32"), ("e4m3 payload", 0, 0, 512, "e4m3"), ("k_pe", 0, 528, 656, "bf16")),
    model1.NAME: (("tile scales", 1, 0, 7, "e8m0"), ("e4m3 payload", 0, 0, 448, "e4m3"), ("k_pe", 0, 448, 576, "bf16")),
}  # scales first: a wrong scale is the cause of a wrong payload


@dataclasses.dataclass(frozen=True)
class WriteSpec:
    """``layout``: "runs" (part of a page, a whole page, a page's first slots) or "rows" (decode rows of
    ``rows`` tokens, each from offset 0 of its first page: for the round trip through decode); ``content``:
    "random" (per-token magnitudes 2^-4..2^4, one all-zero tile), "probe-336" (every tile's amax exactly 336:
    scale 1.0 under pow2, 0.75 under fp32), "kpe-large" (a small latent, hence tiny scales, and k_pe of
    +-100..400). ``padding_slots`` padding tokens go first, in the middle, last and between the real ones
    (``padding_layout`` "spread"), or (``"batch"``) as a batch padded up to a captured size: a few between the real
    tokens and the rest trailing; each with slot -1 (``padding_slot`` "negative", vLLM's) or the dummy slot 0
    ("dummy-slot-0", SGLang's: the caller reserves slot 0 and never reads it)."""

    kv_format: str = "latent"
    dtype: str = "bfloat16"
    page: int = 16
    layout: str = "runs"
    rows: tuple[int, ...] = (37, 20)
    content: str = "random"
    padding_slots: int = 4
    padding_layout: str = "spread"
    padding_slot: str = "negative"
    scale_format: str = "pow2"
    seed: int = 0
    device: str = "cpu"

    @property
    def widths(self) -> tuple[int, int]:
        return WIDTHS[self.kv_format]

    def case(self, tokens: int) -> MethodCase:
        kvl, rope = self.widths
        return MethodCase(METHOD, getattr(torch, self.dtype), d_qk=kvl + rope, d_v=kvl, tokens=tokens,
                          kv_format=self.kv_format, page_block_size=self.page, strided=True, device=self.device)


@dataclasses.dataclass
class WriteInputs:
    spec: WriteSpec
    bufs: dict
    blocks: torch.Tensor          # the cache's block memory (a view of the cache buffer), [num_blocks, block_bytes]
    cache_view: torch.Tensor      # what the op is handed as kv_cache
    slots: torch.Tensor           # slot_mapping (cpu)
    block_table: torch.Tensor     # layout "rows": int32 [B, pages]
    kv_c: torch.Tensor            # views of the projection buffer
    k_pe: torch.Tensor
    padding: torch.Tensor         # bool [T]: the padding tokens (slot -1, or the dummy slot 0)

    @property
    def case(self) -> MethodCase:
        return self.spec.case(int(self.slots.numel()))

    @property
    def real_slots(self) -> torch.Tensor:
        """slot_mapping with every padding token as -1: the tokens whose bytes are checked."""
        return torch.where(self.padding, torch.full_like(self.slots, -1), self.slots)


def _content(spec: WriteSpec, g, T: int) -> torch.Tensor:
    kvl, rope = spec.widths
    tile = model1.TILE if spec.kv_format == model1.NAME else 128
    x = torch.randn(T, kvl, generator=g, dtype=torch.float64)
    r = torch.randn(T, rope, generator=g, dtype=torch.float64) * 4
    if spec.content == "probe-336":
        tiles = x.unflatten(-1, (-1, tile))
        tiles = tiles / tiles.abs().amax(-1, keepdim=True) * 300
        tiles[..., 0] = torch.where(tiles[..., 0] < 0, -336.0, 336.0)   # amax exactly 336 (exact in bf16)
        x, r = tiles.flatten(-2), r * 25
    elif spec.content == "kpe-large":
        x = x / 64
        r = torch.sign(r) * (100 + 300 * torch.rand(T, rope, generator=g, dtype=torch.float64))
    else:
        x = x * torch.pow(2.0, torch.randint(-4, 5, (T, 1), generator=g)).to(torch.float64)
        x[T // 3, :tile] = 0.0                                            # an all-zero tile: the 1e-4 floor
    return torch.cat([x, r], dim=-1)


def _slots(spec: WriteSpec, g) -> tuple[list[int], torch.Tensor, int]:
    page = spec.page
    if spec.layout == "runs":
        num_blocks = 6
        u = (torch.randperm(4, generator=g)[:3] + 1).tolist()            # blocks 1..4: never 0, never the last
        runs = [(u[0], range(page // 3, page)), (u[1], range(page)), (u[2], range(max(1, page // 4)))]
        slots = [b * page + o for b, offs in runs for o in offs]
        return slots, torch.zeros(0, 0, dtype=torch.int32), num_blocks
    pages = [-(-L // page) for L in spec.rows]
    num_blocks = sum(pages) + 2
    ids = (torch.randperm(num_blocks - 2, generator=g) + 1).tolist()
    table = torch.full((len(spec.rows), max(pages) + 1), 2 ** 30, dtype=torch.int32)
    slots, used = [], 0
    for b, L in enumerate(spec.rows):
        mine = ids[used:used + pages[b]]
        used += pages[b]
        table[b, :pages[b]] = torch.tensor(mine, dtype=torch.int32)
        slots += [mine[p // page] * page + p % page for p in range(L)]
    return slots, table, num_blocks


@functools.lru_cache(maxsize=32)
def build(spec: WriteSpec) -> WriteInputs:
    g = torch.Generator().manual_seed(6000 + spec.seed)
    dt = getattr(torch, spec.dtype)
    valid, table, num_blocks = _slots(spec, g)
    order = torch.randperm(len(valid), generator=g).tolist()
    slots = [valid[i] for i in order]
    if spec.padding_layout == "batch":                                     # a few between, the rest trailing
        between = min(2, spec.padding_slots)
        for k in range(between):
            slots.insert((k + 1) * len(slots) // (between + 1), -1)
        slots += [-1] * (spec.padding_slots - between)
    else:
        for k in range(spec.padding_slots):                                # -1 first, in the middle, last
            slots.insert([0, len(slots) // 2, len(slots)][k % 3] if k < 3 else (7 * k) % len(slots), -1)
    T = len(slots)
    content = torch.zeros(T, sum(spec.widths), dtype=torch.float64)
    keep = torch.tensor([s >= 0 for s in slots])
    if spec.padding_slot == "dummy-slot-0":                                 # block 0 is never a real token's
        slots = [s if s >= 0 else 0 for s in slots]
    content[keep] = _content(spec, g, int(keep.sum()))
    content[~keep] = torch.randn(int((~keep).sum()), content.shape[1], generator=g, dtype=torch.float64)
    elem = torch.empty(0, dtype=dt).element_size()
    nbytes = cache_write.block_bytes(spec.kv_format, spec.page, elem)
    memory = torch.randint(0, 256, (num_blocks, nbytes), generator=g, dtype=torch.uint8)
    bufs = method_checks.buffers(spec.device, proj=(content.to(dt), {"pad_last": 32}), cache=memory,
                      slot_mapping=torch.tensor(slots, dtype=torch.int64))
    blocks = bufs["cache"].view
    kvl, rope = spec.widths
    if spec.kv_format == "latent":
        view = blocks.view(dt).view(num_blocks, spec.page, 1, kvl + rope)
    elif spec.kv_format == FP8_656:
        view = blocks.view(num_blocks, spec.page, 1, cache_write.row_bytes(FP8_656, 1, 0))
    else:
        view = model1.cache_view(blocks, spec.page)
    proj = bufs["proj"].view
    return WriteInputs(spec, bufs, blocks, view, torch.tensor(slots, dtype=torch.int64), table,
                       proj[:, :kvl], proj[:, kvl:kvl + rope], ~keep)


def padding_slot(op) -> str:
    """The op's padding convention (``write_padding_slot``): "negative" (default) or "dummy-slot-0"."""
    return declared(op, "write_padding_slot")


def require_negative_slots(op) -> None:
    """Skip, naming the declaration, for an op whose caller never passes a negative slot ("dummy-slot-0")."""
    __tracebackhide__ = True
    if padding_slot(op) != "negative":
        pytest.skip(f"{op.name}: " + declared_otherwise(op, "write_padding_slot", "negative",
                                                        "write with negative (padding) slots"))


def scale_format(op) -> str:
    return declared(op, "write_fp8_scale_format")


def run(op, inp: WriteInputs, check: str) -> None:
    """op.write on the inputs (the cache buffer restored to its random bytes first)."""
    __tracebackhide__ = True
    cache = inp.bufs["cache"]
    cache.base.copy_(cache.snapshot)
    result = method_checks.call(op, METHOD, inp.case, check, inp.bufs, ("kv_c", "k_pe", "kv_cache", "slot_mapping"),
                     views={"kv_c": inp.kv_c, "k_pe": inp.k_pe, "kv_cache": inp.cache_view}, mutable=("cache",),
                     kv_format=inp.spec.kv_format)
    if result is not None:
        raise BackendOutputError(f"{method_checks.where(op, inp.case, check)}: write() returned {type(result).__name__}, not "
                                 "None (it writes into kv_cache)")


@functools.lru_cache(maxsize=32)
def expected_of(spec: WriteSpec, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(block memory after a correct write in scale format ``fmt``, mask of the bytes it sets)."""
    inp = build(spec)
    before = inp.bufs["cache"].snapshot[:inp.blocks.numel()].view(inp.blocks.shape)
    return cache_write.expected(spec.kv_format, before, inp.kv_c, inp.k_pe, inp.real_slots, page=spec.page,
                                cache_dtype=getattr(torch, spec.dtype), scale_format=fmt, width=sum(spec.widths))


def dummy_mask(inp: WriteInputs) -> torch.Tensor:
    """Bool mask of the block memory the padding tokens may change: the spans of slot 0 under "dummy-slot-0"
    (what the caller reserves and never reads), nothing under "negative"."""
    mask = torch.zeros(inp.blocks.shape, dtype=torch.bool)
    if inp.spec.padding_slot == "dummy-slot-0" and bool(inp.padding.any()):
        elem = torch.empty(0, dtype=getattr(torch, inp.spec.dtype)).element_size()
        for start, length in cache_write.spans(inp.spec.kv_format, inp.spec.page, 0, elem, sum(inp.spec.widths)):
            mask[0, start:start + length] = True
    return mask


def check_write(op, spec: WriteSpec, *, check: str, figures: dict) -> WriteInputs:
    """Run the write and check every byte of the cache (module docstring)."""
    __tracebackhide__ = True
    method_checks.require_method(op, METHOD)
    inp = build(spec)
    case = method_checks.require(op, inp.case)
    fmt = scale_format(op)
    figures.update(case=case.describe(), check=check, op=op.name)
    if spec.kv_format != "latent":
        figures["scale_format"] = fmt if spec.kv_format == FP8_656 else "ue8m0"
    run(op, inp, check)
    w = method_checks.where(op, case, check)
    cache = inp.bufs["cache"]
    n = inp.blocks.numel()
    got = cache.base[:n].view(inp.blocks.shape).cpu()
    want, mask = expected_of(spec, fmt if spec.kv_format == FP8_656 else "pow2")
    before = cache.snapshot[:n].view(inp.blocks.shape).cpu()
    tail = cache.base[n:].cpu()
    figures.update(tokens=int((inp.real_slots >= 0).sum()), written_nbytes=int(mask.sum()))
    if not torch.equal(tail, cache.snapshot[n:].cpu()):
        first = int((tail != cache.snapshot[n:].cpu()).nonzero()[0])
        raise AssertionError(failure(f"{w}: the op wrote past the end of kv_cache ({first} byte(s) after its last block "
                             "changed): a writer writes only the slots slot_mapping names"))
    stray = (got != before) & ~mask & ~dummy_mask(inp)
    figures["stray_bytes"] = int(stray.sum())
    if bool(stray.any()):
        raise AssertionError(failure(f"{w}: {_stray_message(inp, stray, mask)}"))
    _check_fields(op, case, w, inp, got, want, mask, fmt, figures)
    return inp


def _slot_of(inp: WriteInputs, block: int, byte: int) -> tuple[int, int]:
    """(offset of the token whose spans hold byte ``byte`` of a block, or -1 for block padding; span index)."""
    spec = inp.spec
    elem = torch.empty(0, dtype=getattr(torch, spec.dtype)).element_size()
    for o in range(spec.page):
        for i, (start, length) in enumerate(cache_write.spans(spec.kv_format, spec.page, o, elem, sum(spec.widths))):
            if start <= byte < start + length:
                return o, i
    return -1, -1


def _stray_message(inp: WriteInputs, stray, mask) -> str:
    spec = inp.spec
    block, byte = (int(i) for i in stray.nonzero()[0])
    offset, _ = _slot_of(inp, block, byte)
    slot = block * spec.page + offset
    n_pad = int(inp.padding.sum())
    where_ = (f"slot {slot} (block {block}, offset {offset})" if offset >= 0 else f"block {block}'s padding")
    blocks_changed = sorted({int(b) for b in stray.nonzero()[:, 0]})
    written_blocks = sorted({int(s) // spec.page for s in inp.real_slots.tolist() if s >= 0})
    n_slots = inp.blocks.shape[0] * spec.page
    if spec.kv_format == model1.NAME and _per_token_rows(inp, block):
        cause = ("likely cause: MODEL1 tokens written as 584-byte rows at offset x 584 (the [num_blocks, page, 1, 584] "
                 "view read as per-token rows); FlashMLA's MODEL1 layout is per block: token o's 576-byte part at "
                 "o x 576, its 7 scale bytes at page x 576 + o x 8")
    elif spec.padding_slot == "dummy-slot-0" and n_pad and block == 0:
        cause = (f"likely cause: the {n_pad} padding tokens (slot_mapping 0, the dummy slot the op declares: "
                 "write_padding_slot = 'dummy-slot-0') wrote more than slot 0 -- the rest of block 0 belongs to no "
                 "padding token; a dummy-slot writer writes the padding tokens to slot 0 like any other slot")
    elif spec.padding_slot == "dummy-slot-0" and n_pad:
        cause = (f"likely cause: the {n_pad} padding tokens (slot_mapping 0, the declared dummy slot: "
                 "write_padding_slot = 'dummy-slot-0') written elsewhere than slot 0")
    elif offset >= 0 and slot in (0, n_slots - 1) and n_pad:
        cause = (f"likely cause: slot_mapping -1 (padding, {n_pad} entries) written to slot {slot} "
                 f"({'the first' if slot == 0 else 'the last, Python-style -1'}); a negative slot writes nothing")
    elif set(blocks_changed) <= set(written_blocks):
        cause = ("likely cause: the writer rewrites whole pages (every slot of a page it writes into): the other "
                 "slots of a page belong to other tokens")
    else:
        cause = "a writer sets only the spans of the slots slot_mapping names"
    return (f"{int(stray.sum())} byte(s) of the cache that no written token owns changed, first at byte {byte} of "
            f"block {block}: {where_}, which no entry of slot_mapping names; {cause}")


def _per_token_rows(inp: WriteInputs, block: int) -> bool:
    """Whether some token written into ``block`` sits, payload first, at offset x 584 (per-token rows)."""
    spec = inp.spec
    mem = inp.bufs["cache"].base[:inp.blocks.numel()].view(inp.blocks.shape).cpu()
    parts, _ = model1.encode(inp.kv_c.detach().cpu(), inp.k_pe.detach().cpu())
    for t, slot in enumerate(inp.real_slots.tolist()):
        b, o = divmod(slot, spec.page)
        if slot >= 0 and b == block and o > 0 and torch.equal(mem[b, o * 584:o * 584 + 576], parts[t]):
            return True
    return False


def _values(kind: str, b: torch.Tensor) -> torch.Tensor:
    b = b.contiguous()
    if kind == "f32":
        return b.view(torch.float32).to(torch.float64)
    if kind == "bf16":
        return b.view(torch.bfloat16).to(torch.float64)
    if kind == "e8m0":
        return b.view(torch.float8_e8m0fnu).to(torch.float64)
    if kind == "e4m3":
        return b.view(torch.float8_e4m3fn).to(torch.float64)
    return b.to(torch.float64)


def _check_fields(op, case, w, inp: WriteInputs, got, want, mask, fmt, figures) -> None:
    __tracebackhide__ = True
    spec = inp.spec
    elem = torch.empty(0, dtype=getattr(torch, spec.dtype)).element_size()
    width = sum(spec.widths)
    tokens = [(t, int(s)) for t, s in enumerate(inp.real_slots.tolist()) if s >= 0]
    mismatched = 0
    for name, span, a, b, kind in FIELDS[spec.kv_format]:
        for t, slot in tokens:
            block, offset = divmod(slot, spec.page)
            start, length = cache_write.spans(spec.kv_format, spec.page, offset, elem, width)[span]
            hi = start + (length if b is None else b)
            g_bytes, w_bytes = got[block, start + a:hi], want[block, start + a:hi]
            if fmt == "fp32" and spec.kv_format == FP8_656 and name != "k_pe":   # judged by what they decode to
                problem = _fp32_tile_problem(inp, t, slot, got[block, start:start + 656]) \
                    if name == "tile scales" else None
                if problem:
                    figures["mismatched_fields"] = 1
                    raise AssertionError(failure(f"{w}: {problem}"))
                continue
            if torch.equal(g_bytes, w_bytes):
                continue
            mismatched += 1
            figures["mismatched_fields"] = mismatched
            raise AssertionError(failure(f"{w}: {_field_message(op, inp, t, slot, name, kind, g_bytes, w_bytes, fmt)}"))
    figures["mismatched_fields"] = mismatched


def _fp32_tile_problem(inp: WriteInputs, t: int, slot: int, row: torch.Tensor) -> str | None:
    """Under fp32 scales, one token's 656-byte row judged by what a reader decodes (module docstring): each tile
    scale finite, >= 0 and within WRITE_FP32_SCALE_REL of amax / 448 (up to the optional 1e-4 floor); each e4m3
    value x its tile's stored scale within half an e4m3 step (at x / scale) of the written value. The sentence
    of the first problem, else None."""
    spec = inp.spec
    x = inp.kv_c[t].detach().cpu().to(torch.float64).unflatten(-1, (4, 128))
    s = row[512:528].contiguous().view(torch.float32).to(torch.float64)
    v = row[:512].contiguous().view(torch.float8_e4m3fn).to(torch.float64).unflatten(-1, (4, 128))
    amax = x.abs().amax(-1)
    ideal = amax / FP8_E4M3_MAX
    lo, hi = ideal * (1 - WRITE_FP32_SCALE_REL), ideal.clamp_min(FLASHMLA_SCALE_FLOOR) * (1 + WRITE_FP32_SCALE_REL)
    head = f"token {t} (slot {slot} = block {slot // spec.page}, offset {slot % spec.page})"
    rule = (f"under write_fp8_scale_format = 'fp32' a tile's scale is amax / 448 within {WRITE_FP32_SCALE_REL:.3g} "
            "relative (any arithmetic of bfloat16's precision or better), up to the optional 1e-4 floor")
    bad = ~(torch.isfinite(s) & (s >= lo) & (s <= hi))
    if bool(bad.any()):
        j = int(bad.nonzero()[0])
        sj, aj = float(s[j]), float(amax[j])
        hint = ""
        if math.isfinite(sj) and sj > 0 and aj > 0:
            n = aj / sj
            hint = f"; the stored scale is amax / {n:.4g}"
            if abs(n - 240.0) <= 240.0 * WRITE_FP32_SCALE_REL:
                hint += " (240: e4m3fnuz's largest value, not e4m3fn's 448)"
            if sj == float(flashmla_fp8_scales(inp.kv_c[t].detach().cpu(), "pow2")[j]):
                hint += ("; the stored scales follow the 'pow2' convention (amax / 448 rounded up to a power of two): "
                         "declare write_fp8_scale_format = 'pow2', or write 'fp32' scales")
        return (f"{head}: tile {j}'s scale is {sj!r} for amax {aj!r} (allowed [{float(lo[j]):.6g}, "
                f"{float(hi[j]):.6g}]): {rule}{hint}")
    y = torch.where(s[:, None] > 0, x / torch.where(s > 0, s, 1.0)[:, None], torch.zeros_like(x))
    half = torch.exp2(torch.floor(torch.log2(y.abs().clamp_min(2.0 ** -6))) - 4)   # half an e4m3 step at y
    decoded = v * s[:, None]
    err = (decoded - x).abs()
    over = ~(err <= s[:, None] * half * (1 + 2.0 ** -20))                           # NaN is over
    if not bool(over.any()):
        return None
    j, i = (int(k) for k in over.nonzero()[0])
    sj, vj, xj = float(s[j]), float(v[j, i]), float(x[j, i])
    msg = (f"{head}: value {128 * j + i} (tile {j}) decodes to e4m3 {vj!r} x scale {sj!r} = {float(decoded[j, i])!r}, "
           f"written {xj!r} ({int(over.sum())} value(s) off by more than half an e4m3 step of value / scale: what a "
           "reader of the cache gets)")
    if math.isnan(vj) and sj == 0.0:
        return (f"{msg}; likely cause: 0 x inf -- an all-zero tile encoded with scale 0 as value x (1 / scale), its "
                "payload NaN, which decodes to NaN x 0 = NaN; a scale of 0 needs a payload of 0 (or the 1e-4 floor)")
    if math.isnan(vj):
        return (f"{msg}; the payload is NaN: value / scale = {float(y[j, i]):.6g} is past e4m3's range (e4m3fn has no "
                "infinity), or the writer divided 0 by 0")
    c = inp.kv_c[t].detach().cpu()
    for other, said in ((flashmla_fp8_scales(c, "pow2"), "the 'pow2' scales"),
                        (flashmla_fp8_scales(c, "fp32"), "amax / 448 with the 1e-4 floor"),
                        (amax.to(torch.float32) / FP8_E4M3_MAX, "amax / 448 without the floor")):
        o = other.to(torch.float64)[j]
        if float(o) > 0 and float(o) != sj and torch.equal((x[j] / o).to(torch.float8_e4m3fn).to(torch.float64), v[j]):
            return (f"{msg}; likely cause: the e4m3 bytes are value / {float(o)!r} ({said}), the stored scale is "
                    f"{sj!r}: the payload was divided by another scale than the one stored")
    return msg


def _field_message(op, inp: WriteInputs, t: int, slot: int, name: str, kind: str, g_bytes, w_bytes, fmt) -> str:
    spec = inp.spec
    gv, wv = _values(kind, g_bytes), _values(kind, w_bytes)
    diff = (g_bytes != w_bytes).nonzero().flatten() if kind == "raw" else (gv != wv).nonzero().flatten()
    i = int(diff[0]) if diff.numel() else 0
    n = int(diff.numel())
    head = (f"token {t} (slot {slot} = block {slot // spec.page}, offset {slot % spec.page}): its {name} differ from "
            f"the oracle's encoding ({n} value(s))")
    if kind == "raw":
        dt = getattr(torch, spec.dtype)
        kvl = spec.widths[0]
        j = i // torch.empty(0, dtype=dt).element_size()
        got_v, want_v = g_bytes.contiguous().view(dt)[j], w_bytes.contiguous().view(dt)[j]
        part = f"kv_c[{j}]" if j < kvl else f"k_pe[{j - kvl}]"
        return (f"{head}: value {j} ({part}) is {float(got_v)!r}, written {float(want_v)!r}; the latent format "
                "stores [kv_c | k_pe] bit for bit in the cache dtype")
    msg = f"{head}: value {i} is {float(gv[i])!r}, expected {float(wv[i])!r}"
    if name == "k_pe":
        scales = _values("f32" if spec.kv_format == FP8_656 else "e8m0",
                         _scale_bytes(inp, slot)).tolist()
        k = inp.k_pe[t].detach().cpu().to(torch.float64)
        for s in scales:
            for op_name, v in (("divided by", k / s), ("multiplied by", k * s)):
                if torch.equal(v.to(torch.bfloat16).to(torch.float64), gv):
                    return (f"{msg}; likely cause: k_pe {op_name} the latent's FP8 tile scale {s:g} (k_scale applied "
                            "to k_pe, vLLM PR #42956); k_pe is stored as bfloat16, never scaled")
        return f"{msg}; k_pe is stored as bfloat16, unscaled"
    if name == "tile scales":
        said = "declared" if getattr(op, "write_fp8_scale_format", None) is not None else "the default: not declared"
        c = inp.kv_c[t].detach().cpu()
        other = {"pow2": "fp32", "fp32": "pow2"}[fmt]
        hint = ""
        if spec.kv_format == FP8_656 and torch.allclose(gv, flashmla_fp8_scales(c, other).to(torch.float64), rtol=2 ** -22,
                                                        atol=0):
            hint = (f"; the stored scales follow the {other!r} convention (amax / 448"
                    f"{' as is' if other == 'fp32' else ' rounded up to a power of two'}): declare "
                    f"write_fp8_scale_format = {other!r}, or write {fmt!r} scales")
        if float(gv[i]) == 0.0 and float(wv[i]) > 0 and float(c.float().unflatten(-1,
                                                                                  (-1, _tile(spec))).abs().amax(-1)[i]) == 0:
            hint = "; likely cause: no 1e-4 floor on amax / 448 (an all-zero tile gets scale 0, its payload 0 / 0)"
        conv = "UE8M0 (power-of-two) scales only" if spec.kv_format == model1.NAME else \
            f"write_fp8_scale_format = {fmt!r} ({said})"
        rounded = " rounded up to a power of two" if fmt == "pow2" or spec.kv_format == model1.NAME else ""
        return f"{msg} (scale = max(amax / 448, 1e-4){rounded}; {conv}){hint}"
    return (f"{msg}: e4m3 of kv_c / its tile's scale, round to nearest even, as FlashMLA's tests/quant.py "
            f"quantize_k_cache")


def _tile(spec: WriteSpec) -> int:
    return model1.TILE if spec.kv_format == model1.NAME else 128


def _scale_bytes(inp: WriteInputs, slot: int) -> torch.Tensor:
    spec = inp.spec
    block, offset = divmod(slot, spec.page)
    mem = inp.bufs["cache"].base[:inp.blocks.numel()].view(inp.blocks.shape).cpu()
    if spec.kv_format == FP8_656:
        return mem[block, offset * 656 + 512:offset * 656 + 528]
    start, length = model1.spans(spec.page, offset)[1]
    return mem[block, start:start + length]


__all__ = ["WriteSpec", "WriteInputs", "build", "run", "check_write", "expected_of", "scale_format", "padding_slot",
           "require_negative_slots", "dummy_mask", "FP8_656"]


# --------------------------------------------------------------------------- the round trip through decode


def check_round_trip(op, spec: WriteSpec, *, h_q: int, check: str, figures: dict, topk: int = 32):
    """Write rows (layout "rows"), check the bytes (:func:`check_write`), then ``decode`` over what the op wrote
    against the float64 decode oracle over those encoded values (mla_conformance.model.attention_oracles.decode; the
    decode bounds): write and decode agree on the layout. MODEL1 is read by sparse decode (FlashMLA's): top-``topk``
    indices over the written slots, a quarter of them -1."""
    __tracebackhide__ = True
    method_checks.require_method(op, METHOD, "decode")
    assert spec.layout == "rows", spec
    dt = getattr(torch, spec.dtype)
    sparse = spec.kv_format == model1.NAME
    dcase = OpCase(batch=len(spec.rows), s_q=1, h_q=h_q, page_block_size=spec.page, dtype=dt,
                   kv_format=spec.kv_format, topk=topk if sparse else None, device=spec.device)
    op_checks.require(op, dcase)
    inp = check_write(op, spec, check=check + " (the write)", figures=figures)
    g = torch.Generator().manual_seed(6500 + spec.seed)
    d_qk = sum(spec.widths)
    q = torch.randn(len(spec.rows), 1, h_q, d_qk, generator=g, dtype=torch.float64).to(dt)
    lens = torch.tensor(spec.rows, dtype=torch.int32)
    cache = op_checks.Buffer("kv_cache", inp.blocks.detach().clone(), device=spec.device)  # the block memory as written
    if spec.kv_format == "latent":
        cache.view = cache.view.view(dt).view(inp.cache_view.shape)
    elif spec.kv_format == FP8_656:
        cache.view = cache.view.view(inp.cache_view.shape)
    else:
        cache.view = model1.cache_view(cache.view, spec.page)
    written = cache.view
    bufs = {"q": op_checks.Buffer("q", q, device=spec.device), "kv_cache": cache,
            "block_table": op_checks.Buffer("block_table", inp.block_table, device=spec.device),
            "cache_seqlens": op_checks.Buffer("cache_seqlens", lens, device=spec.device)}
    if sparse:
        valid = inp.real_slots[inp.real_slots >= 0]
        idx = torch.stack([valid[torch.randperm(valid.numel(), generator=g)[:topk]] for _ in spec.rows])
        idx[:, ::4] = -1
        bufs["indices"] = op_checks.Buffer("indices", idx[:, None, :].to(torch.int32), device=spec.device)
    dinp = op_checks.OpInputs(op_checks.Spec(dcase, spec.rows), bufs, op_checks.SOFTMAX_SCALE, [], [], inp.blocks.shape[0])
    out, lse = op_checks.run_op(op, dinp, check + " (decode over the written cache)")
    # the encoding check_write accepted (the oracle's bytes, up to the fp32-scale allowances) is what decode reads
    ref = oracle(q, written.detach().cpu(), inp.block_table, lens, softmax_scale=op_checks.SOFTMAX_SCALE, causal=False,
                 indices=bufs["indices"].view.cpu() if sparse else None, head_dim_v=d_qk if sparse else None,
                 magnitudes=True)
    op_checks.compare(op, dcase, out, lse, ref[0], ref[1], check=check, figures=figures, oracle=ref,
               against="the float64 oracle over the encoded cache")
    return out, lse
