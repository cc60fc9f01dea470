"""Inputs of the op tests: choosing a case the op accepts (its declarations and ``unsupported_reason``), and
building it (:func:`build`): paged caches behind shuffled block tables, NaN (0xFF bytes for the FP8 layout) in
every unused page and in the unfilled tail of each row's last page, unused block-table entries set to
:data:`INVALID_BLOCK`; every buffer the op is handed is a view at the start of a larger allocation whose
remaining bytes (the canary, :class:`Buffer`) are checked after the call, as are the inputs themselves (the op
must not write them). Inputs are deterministic (seeded) and built once per session (:func:`build` is cached).
Derived inputs (a split at a page boundary, one row alone, the dense cache of a sparse selection) at the end.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch

from mla_conformance.checks.metrics import dtype_name
from mla_conformance.contract.op import D_QK, D_V, FP8_ROW_BYTES, OpCase, declared
from mla_conformance.errors import BackendError
from mla_conformance.impl.ops.reference import decode_fp8_656, encode_fp8_656, fp8_scales
from mla_conformance.messages import failure, located
from mla_conformance.model.weights import same_bits

#: page sizes the suite builds caches for (an op's declared page_block_sizes are intersected with these)
KNOWN_PAGE_SIZES = (1, 16, 64)
#: what unused block-table entries hold: a block id far outside any cache the suite builds
INVALID_BLOCK = 2 ** 30
INT_MAX = 2 ** 31 - 1
#: bytes after every buffer handed to an op, filled with CANARY_BYTE and checked after the call
CANARY_BYTES = 256
CANARY_BYTE = 0xA5
#: the logit scale of the op tests: DeepSeek's qk_head_dim 192 ** -0.5 (random q and keys of unit scale give
#: logits of standard deviation ~1.7: a softmax far from uniform and far from one-hot)
SOFTMAX_SCALE = 192 ** -0.5
#: the invalid sparse index kinds: -1, one past the flattened cache, INT_MAX
INVALID_KINDS = ("minus-one", "past-end", "int-max")


def where(op, case: OpCase, check: str) -> str:
    """Where a check ran, as every op failure message begins: the op, its case, the check
    (:func:`mla_conformance.messages.located`: a failure's headline keeps the op and the check, the case gets a
    line of its own)."""
    return located(op.name, case.describe(), check)


# --------------------------------------------------------------------------- choosing cases


def page_sizes(op) -> tuple[int, ...]:
    """The page sizes the op declares that the suite knows how to build."""
    return tuple(p for p in declared(op, "page_block_sizes") if p in KNOWN_PAGE_SIZES)


def pick_page(op, prefer=(16, 64, 1)) -> int:
    return page_order(op, prefer)[0]


def page_order(op, prefer=(16, 64, 1)) -> tuple[int, ...]:
    """The page sizes the op declares that the suite builds, in the order of ``prefer`` (:func:`pick_page` takes the
    first; :func:`make_case` tries the others when the op declines its case at the first); else skip."""
    sizes = page_sizes(op)
    order = tuple(p for p in prefer if p in sizes)
    if order:
        return order
    pytest.skip(f"{op.name}: declares page_block_sizes {declared(op, 'page_block_sizes')}, none of which the suite "
                f"builds ({', '.join(map(str, KNOWN_PAGE_SIZES))})")


def op_reason(op, case) -> str | None:
    """The op's own ``unsupported_reason(case)`` for any method's case; one that raises is a BackendError naming it."""
    __tracebackhide__ = True
    try:
        return op.unsupported_reason(case)
    except Exception as exc:
        raise BackendError(f"{op.name}: unsupported_reason({case.describe()}) raised {type(exc).__name__}: "
                           f"{exc}") from exc


def not_declared(key: str, what: str) -> str:
    """The sentence of an optional part a flag declaration opts into (``key = True``) that the op does not make."""
    return f"does not declare {key} (the op contract's optional declaration `{key} = True`), so {what} is not tested"


def declared_otherwise(op, key: str, value, what: str = "it") -> str:
    """The sentence of a value declaration (page sizes, formats, head dims) that does not include ``value``."""
    src = "declared" if getattr(op, key, None) is not None else "the default: not declared"
    return f"{key} is {declared(op, key)!r} ({src}), not {value!r}: declare {key} with {value!r} to have {what} tested"


def unsupported(op, case: OpCase) -> str | None:
    """The op's sentence for a case it declines (a raising unsupported_reason is a BackendError)."""
    __tracebackhide__ = True
    # the op's own sentence first: on a host its kernel cannot run on, that is the support matrix's sentence
    # (the same for every case), not a remark about the case's format
    reason = op_reason(op, case)
    if reason:
        return reason
    if case.sparse and not declared(op, "sparse_decode"):
        return not_declared("sparse_decode", f"sparse decode (top-{case.topk} indices)")
    if case.attn_sink and not declared(op, "attn_sink"):
        return not_declared("attn_sink", "the attention sink")
    for key, value in (("kv_formats", case.kv_format), ("page_block_sizes", case.page_block_size)):
        if value not in declared(op, key):
            return declared_otherwise(op, key, value)
    return None


def require(op, case, unsupported=unsupported):
    """``case``, else skip with the op's sentence (``unsupported``: decode's, or a method's)."""
    __tracebackhide__ = True
    reason = unsupported(op, case)
    if reason:
        pytest.skip(f"{op.name}: {reason}")
    return case


def first_supported(op, cases, unsupported=unsupported):
    """The first of ``cases`` the op accepts (e.g. float32 before bfloat16, latent before FP8), else skip
    with the op's sentences."""
    __tracebackhide__ = True
    reasons: list[str] = []
    for case in cases:
        reason = unsupported(op, case)
        if not reason:
            return case
        if reason not in reasons:
            reasons.append(reason)
    pytest.skip(f"{op.name}: {'; '.join(reasons)}")


def has_rows_without_keys(lens, s_q: int, causal: bool, sparse: bool = False) -> bool:
    """Whether dense inputs of these row lengths hold a query with no key (a zero-length row; causal: a row
    shorter than s_q, whose first queries come before its first key)."""
    return any(kinds_of_rows_without_keys(lens, s_q, causal, sparse).values())


def kinds_of_rows_without_keys(lens, s_q: int, causal: bool, sparse: bool = False) -> dict:
    """OpCase's two kinds of a query without a key for dense inputs of these row lengths: ``zero_length_rows``
    (a row of 0 keys) and ``queries_before_first_key`` (causal: a row of 1 .. s_q - 1 keys)."""
    return {"zero_length_rows": not sparse and any(L == 0 for L in lens),
            "queries_before_first_key": not sparse and causal and any(0 < L < s_q for L in lens)}


def make_case(op, *, lens, s_q=1, h_q=8, page=None, dtypes=("float32", "bfloat16", "float16"), kv_formats=("latent",),
              topk=None, attn_sink=False, causal=False, device="cpu", rows_without_keys=None,
              zero_length_rows=False, padding_rows=0, multi_token=False) -> OpCase:
    """The first case the op accepts over ``kv_formats`` x ``dtypes`` (an FP8 cache takes a bfloat16 q).
    ``rows_without_keys`` and its kinds default to what the lengths say (:func:`kinds_of_rows_without_keys`);
    ``zero_length_rows``: the case holds a row without any key the lengths do not show (an empty part of a
    split-KV call, a sparse row whose every index is invalid); ``padding_rows``: how many rows are padding.

    When the op declines every one of these cases, the variants it may take instead, before skipping
    (:func:`_variant_case`): the other page sizes it declares (``page`` not given), then one query per row (s_q 1:
    a decode-only op) unless the test's rule is about multi-token decode (``multi_token``; s_q 1 anyway).
    A variant is taken only where the op declines the same case at the test's own s_q and page (the variant is
    what it lacks): an op that takes both gets today's case, or today's skip. The skip sentence gives every
    variant's reason."""
    __tracebackhide__ = True
    pages = (page,) if page is not None else page_order(op)
    spec = dict(lens=lens, h_q=h_q, dtypes=dtypes, kv_formats=kv_formats, topk=topk, attn_sink=attn_sink,
                causal=causal, device=device, rows_without_keys=rows_without_keys,
                zero_length_rows=zero_length_rows, padding_rows=padding_rows)
    reasons: list[str] = []
    for case in _cases(s_q=s_q, page=pages[0], **spec):
        reason = unsupported(op, case)
        if not reason:
            return case
        if reason not in reasons:
            reasons.append(reason)
    variants = [(s_q, p) for p in pages[1:]]
    if s_q > 1 and not multi_token:
        variants += [(1, p) for p in pages]
    case = _variant_case(op, variants, s_q, pages[0], spec, reasons)
    if case is not None:
        return case
    pytest.skip(f"{op.name}: {'; '.join(reasons)}")


def _cases(*, lens, s_q, page, h_q, dtypes, kv_formats, topk, attn_sink, causal, device, rows_without_keys,
           zero_length_rows, padding_rows) -> list[OpCase]:
    """make_case's cases at one s_q and page size: ``kv_formats`` x ``dtypes`` (an FP8 cache: bfloat16 q)."""
    kinds = kinds_of_rows_without_keys(lens, s_q, causal, topk is not None)
    kinds["zero_length_rows"] |= bool(zero_length_rows)
    if rows_without_keys is None:
        rows_without_keys = any(kinds.values())
    elif not rows_without_keys:
        kinds = {}
    cases = []
    for fmt in kv_formats:
        for dt in (("bfloat16",) if fmt != "latent" else dtypes):
            cases.append(OpCase(batch=len(lens), s_q=s_q, h_q=h_q, page_block_size=page, dtype=getattr(torch, dt),
                                kv_format=fmt, topk=topk, attn_sink=attn_sink, causal=causal, device=device,
                                rows_without_keys=rows_without_keys, padding_rows=padding_rows, **kinds))
    return cases


def variant_label(s_q: int, page: int, own_s_q: int, own_page: int) -> str:
    """How a skip sentence names a variant of a test's case: what differs from the test's own s_q and page."""
    parts = ([f"s_q {s_q}"] if s_q != own_s_q else []) + ([f"pages of {page}"] if page != own_page else [])
    return ", ".join(parts)


def _variant_case(op, variants, own_s_q: int, own_page: int, spec: dict, reasons: list[str]) -> OpCase | None:
    """The first case of ``variants`` ((s_q, page) pairs, each over make_case's formats x dtypes) the op accepts
    where it declines the same case at the test's own s_q and page; the reasons of the declined ones are added to
    ``reasons``, each named by its variant (one already there by the same words is not repeated)."""
    __tracebackhide__ = True
    said = set(reasons)
    for s_q, page in variants:
        for case in _cases(s_q=s_q, page=page, **spec):
            reason = unsupported(op, case)
            if reason:
                if reason not in said:
                    said.add(reason)
                    reasons.append(f"{variant_label(s_q, page, own_s_q, own_page)}: {reason}")
                continue
            # the variant is what the op lacks: it declines this very case at the test's own s_q / page (an op
            # that takes it there too declined today's cases for another reason, e.g. a causal query before a
            # row's first key, which one query per row does not have: today's skip stands)
            if unsupported(op, dataclasses.replace(case, s_q=own_s_q, page_block_size=own_page)):
                return case
    return None


def make_case_and_lens(op, lens_options, **kw) -> tuple[OpCase, tuple[int, ...]]:
    """The first of ``lens_options`` (row lengths, e.g. with rows without keys first, then without) the op
    accepts a case of, and that case; else skip with the op's sentences."""
    __tracebackhide__ = True
    reasons = []
    for lens in lens_options:
        try:
            return make_case(op, lens=lens, **kw), tuple(lens)
        except pytest.skip.Exception as exc:
            reason = str(exc).removeprefix(f"{op.name}: ")
            if reason not in reasons:
                reasons.append(reason)
    pytest.skip(f"{op.name}: {'; '.join(reasons)}")

def require_declared(op, key: str, what: str) -> None:
    __tracebackhide__ = True
    if not declared(op, key):
        pytest.skip(f"{op.name}: {not_declared(key, what)}")



def require_invalid_kind(op, kind: str) -> None:
    """Skip unless the op's ``invalid_index`` rule makes an index of this kind (:data:`INVALID_KINDS`) invalid:
    -1 always; one past the cache and INT_MAX only under "out-of-range"."""
    __tracebackhide__ = True
    rule = declared(op, "invalid_index")
    if kind != "minus-one" and rule == "minus-one":
        said = "declares" if getattr(op, "invalid_index", None) is not None else "defaults to"
        article = "an" if kind[0] in "aeiou" else "a"
        pytest.skip(f"{op.name}: {said} invalid_index = 'minus-one' (FlashMLA's sparse decode: only -1 is "
                    f"invalid), so {article} {kind} index is never handed to it (declare invalid_index = "
                    "'out-of-range', FlashMLA's sparse prefill rule: every index outside the cache is invalid, to "
                    "have it tested)")


#: sparse decode's second cache (FlashMLA's extra_k_cache, extra_indices_in_kvcache, extra_topk_length), passed
#: where the op declares sparse_decode_extra_cache
EXTRA_CACHE_ARGS = ("extra_k_cache", "extra_indices", "extra_topk_length")


# --------------------------------------------------------------------------- canaried buffers


class Buffer:
    """A tensor handed to the op: a view at the start of a uint8 allocation with CANARY_BYTES after it."""

    def __init__(self, name: str, value: torch.Tensor, *, device, pad_last: int = 0, transpose12: bool = False):
        self.name = name
        shape = list(value.shape)
        alloc_shape = list(shape)
        if transpose12:  # allocate [B, h, s, D]: the view is its transpose, non-contiguous
            alloc_shape[1], alloc_shape[2] = alloc_shape[2], alloc_shape[1]
        alloc_shape[-1] += pad_last
        n = math.prod(alloc_shape) * value.element_size()
        self.base = torch.full((n + CANARY_BYTES,), CANARY_BYTE, dtype=torch.uint8, device=device)
        typed = self.base[:n].view(value.dtype).view(alloc_shape)
        if pad_last:  # the padding inside the allocation is NaN (or 0xFF): read it and it shows
            if value.is_floating_point():
                typed[..., shape[-1]:] = float("nan")
            else:
                typed[..., shape[-1]:].view(torch.uint8).fill_(0xFF)
        view = typed.transpose(1, 2) if transpose12 else typed
        self.view = view[..., :shape[-1]]
        self.view.copy_(value.to(device))
        self.snapshot = self.base.clone()

    def check(self, op, case: OpCase, check: str) -> None:
        """The view and the bytes around it are what they were before the call (restored, then failed)."""
        __tracebackhide__ = True
        if same_bits(self.base, self.snapshot):  # compared as int64 words: 8x fewer than bytes
            return
        diff = (self.base != self.snapshot).nonzero().flatten()
        changed_view = not torch.equal(self._bytes_of_view(self.base), self._bytes_of_view(self.snapshot))
        self.base.copy_(self.snapshot)  # later tests of the session share these inputs
        if changed_view:
            raise AssertionError(failure(
                f"{where(op, case, check)}: the op wrote its input {self.name} ({int(diff.numel())} byte(s) changed)",
                f"{self.name} {tuple(self.view.shape)} {dtype_name(self.view.dtype)}; inputs are read-only in the op "
                "contract"))
        first = int(diff[0])
        end = self.base.numel() - CANARY_BYTES
        at = (f"starting at byte {first - end} after its end" if first >= end else
              f"starting at byte {first} of its allocation, in the padding between its strided elements")
        raise AssertionError(failure(
            f"{where(op, case, check)}: the op wrote {int(diff.numel())} byte(s) outside its input {self.name}",
            f"{self.name} {tuple(self.view.shape)} {dtype_name(self.view.dtype)}: {at}; the canary region after the "
            "buffer changed; an op writes only the tensors it returns"))

    def _bytes_of_view(self, base: torch.Tensor) -> torch.Tensor:
        v = self.view
        n = self.base.numel() - CANARY_BYTES
        typed = base[:n].view(v.dtype)
        return torch.as_strided(typed, v.shape, v.stride(), v.storage_offset()).contiguous().view(torch.uint8)


# --------------------------------------------------------------------------- inputs


@dataclasses.dataclass(frozen=True)
class Spec:
    """What to build (hashable: inputs and oracles are cached per spec).

    ``content``: "random" (latent N(0, magnitude^2)), "zeros" (all-zero keys), "probe-336" (every 128-value tile
    of c has max |c| = 336 -- FP8 scale 1.0 under pow2, 0.75 under fp32 -- and every other token's last tile is
    all zero). ``invalid``: sparse indices of that kind (:data:`INVALID_KINDS`) in a quarter of the entries;
    ``all_invalid_rows``: rows whose every index is -1; ``topk_length``: pass topk_length (entries past it hold
    valid indices the op must ignore); ``sink``: attn_sink values per head (cycled).
    """

    case: OpCase
    lens: tuple[int, ...]
    seed: int = 0
    content: str = "random"
    magnitude: float = 1.0
    scale_format: str = "pow2"
    noncontig_q: bool = False
    invalid: str | None = None
    all_invalid_rows: tuple[int, ...] = ()
    topk_length: bool = False
    sink: tuple[float, ...] | None = None
    spare_pages: int = 2


@dataclasses.dataclass
class OpInputs:
    spec: Spec
    buffers: dict[str, Buffer]
    softmax_scale: float
    latent: list[torch.Tensor]          # per row: [L, 576] float64, the keys as the op should see them
    slots: list[torch.Tensor]           # per row: the flat slot (block * page + offset) of each key
    num_blocks: int

    @property
    def case(self) -> OpCase:
        return self.spec.case

    def tensor(self, name: str):
        buf = self.buffers.get(name)
        return None if buf is None else buf.view

    def args(self) -> tuple:
        return tuple(self.tensor(n) for n in ("q", "kv_cache", "block_table", "cache_seqlens"))

    def kwargs(self) -> dict:
        return {"softmax_scale": self.softmax_scale, "causal": self.case.causal,
                **{n: self.tensor(n) for n in ("indices", "topk_length", "attn_sink", *EXTRA_CACHE_ARGS)
                   if n in self.buffers}}

    def derive(self, **tensors) -> "OpInputs":
        """The same inputs with some tensors replaced (each in its own canaried buffer)."""
        buffers = dict(self.buffers)
        for name, value in tensors.items():
            buffers[name] = Buffer(name, value, device=self.case.device)
        return dataclasses.replace(self, buffers=buffers)


def _latent(spec: Spec, g: torch.Generator, L: int) -> torch.Tensor:
    if spec.content == "zeros":
        return torch.zeros(L, D_QK, dtype=torch.float64)
    x = torch.randn(L, D_QK, generator=g, dtype=torch.float64)
    if spec.content == "probe-336":
        tiles = x[:, :D_V].unflatten(-1, (-1, 128))
        tiles = tiles / tiles.abs().amax(-1, keepdim=True) * 336.0  # every tile's amax exactly 336
        tiles[1::2, -1] = 0.0                                       # every other token: an all-zero tile
        x = torch.cat([tiles.flatten(-2), x[:, D_V:] * 100.0], dim=-1)
        return x
    return x * spec.magnitude


@functools.lru_cache(maxsize=64)
def build(spec: Spec) -> OpInputs:
    """Deterministic inputs for a spec (cached: the op's calls are checked to leave them unchanged)."""
    case = spec.case
    g = torch.Generator().manual_seed(1000 + spec.seed)
    page, B = case.page_block_size, case.batch
    lens = spec.lens
    assert len(lens) == B, (lens, case)
    n_pages = [-(-L // page) for L in lens]
    num_blocks = sum(n_pages) + spec.spare_pages
    perm = torch.randperm(num_blocks, generator=g)
    max_blocks = max(n_pages) + 1
    block_table = torch.full((B, max_blocks), INVALID_BLOCK, dtype=torch.int32)
    fp8 = case.kv_format == "fp8-e4m3-flashmla"
    row_bytes = FP8_ROW_BYTES if fp8 else D_QK
    if fp8:
        cache = torch.full((num_blocks, page, 1, row_bytes), 0xFF, dtype=torch.uint8)
    else:
        cache = torch.full((num_blocks, page, 1, D_QK), float("nan"), dtype=case.dtype)
    latents, slots = [], []
    used = 0
    for b, L in enumerate(lens):
        ids = perm[used:used + n_pages[b]]
        used += n_pages[b]
        block_table[b, :n_pages[b]] = ids.to(torch.int32)
        lat = _latent(spec, g, L)
        pos = torch.arange(L)
        slot = ids[pos // page] * page + pos % page
        if fp8:
            rows = encode_fp8_656(lat, spec.scale_format)
            seen = decode_fp8_656(rows, torch.float64)
        else:
            rows = lat.to(case.dtype)
            seen = rows.to(torch.float64)
        cache.view(num_blocks * page, row_bytes)[slot] = rows
        latents.append(seen)
        slots.append(slot)
    q_scale = 1.0 / 110.0 if spec.content == "probe-336" else 1.0
    q = (torch.randn(B, case.s_q, case.h_q, D_QK, generator=g, dtype=torch.float64) * q_scale).to(case.dtype)
    dev = case.device
    buffers = {
        "q": Buffer("q", q, device=dev, pad_last=64 if spec.noncontig_q else 0, transpose12=spec.noncontig_q),
        "kv_cache": Buffer("kv_cache", cache, device=dev),
        "block_table": Buffer("block_table", block_table, device=dev),
        "cache_seqlens": Buffer("cache_seqlens", torch.tensor(lens, dtype=torch.int32), device=dev),
    }
    if case.topk is not None:
        idx, topk_length = _indices(spec, g, slots, num_blocks * page)
        buffers["indices"] = Buffer("indices", idx, device=dev)
        if topk_length is not None:
            buffers["topk_length"] = Buffer("topk_length", topk_length, device=dev)
    if case.attn_sink:
        values = spec.sink or (0.0, 2.0, 4.0, math.inf, -math.inf, 6.0)
        sink = torch.tensor([values[h % len(values)] for h in range(case.h_q)], dtype=torch.float32)
        buffers["attn_sink"] = Buffer("attn_sink", sink, device=dev)
    return OpInputs(spec, buffers, SOFTMAX_SCALE, latents, slots, num_blocks)


def _indices(spec: Spec, g: torch.Generator, slots, n_slots: int):
    """Sparse indices over every written slot of the cache (any row's: block_table does not restrict them)."""
    case = spec.case
    B, s_q, k = case.batch, case.s_q, case.topk
    written = torch.cat(slots)
    assert written.numel() >= k, f"the cache holds {written.numel()} keys, fewer than top-{k}"
    idx = torch.empty(B, s_q, k, dtype=torch.int64)
    for b in range(B):
        for i in range(s_q):
            idx[b, i] = written[torch.randperm(written.numel(), generator=g)[:k]]
    if spec.invalid is not None:
        bad = {"minus-one": -1, "past-end": n_slots, "int-max": INT_MAX}[spec.invalid]
        mask = torch.rand(B, s_q, k, generator=g) < 0.25
        mask[..., 0] = True   # at least one invalid entry per query, and never all of them
        mask[..., 1] = False
        idx[mask] = bad
    for b in spec.all_invalid_rows:
        idx[b] = -1
    topk_length = None
    if spec.topk_length:
        topk_length = torch.tensor([max(1, (k * (b + 1)) // (B + 1)) for b in range(B)], dtype=torch.int32)
        topk_length[0] = k  # one row uses every entry
    return idx.to(torch.int32), topk_length


def declared_spec(op, case: OpCase, lens, **kw) -> Spec:
    """A Spec of ``case`` over the first ``case.batch`` of ``lens``, its FP8 tiles scaled in the op's declared
    ``fp8_scale_format``."""
    return Spec(case, tuple(lens[:case.batch]), scale_format=declared(op, "fp8_scale_format"), **kw)


def check_fp8_probe_scales(inp: OpInputs, fmt: str, figures: dict) -> float:
    """The suite's own FP8 writer on the probe-336 content: the first written token's first tile scale is 1.0
    under pow2 and 0.75 under fp32 (amax 336), the next token's all-zero tile has the floor scale; returns the
    expected probe scale."""
    __tracebackhide__ = True
    stored = inp.tensor("kv_cache").cpu().reshape(-1, 656)[inp.slots[1][:2]][:, 512:528].contiguous().view(
        torch.float32)
    figures.update(scale_format=fmt, probe_scale=float(stored[0, 0]), zero_tile_scale=float(stored[1, 3]))
    expected = {"pow2": 1.0, "fp32": 0.75}[fmt]
    zero = float(fp8_scales(torch.zeros(1, 512), fmt)[0, 0])
    assert float(stored[0, 0]) == expected and float(stored[1, 3]) == zero, (
        f"the suite's FP8 writer stored scales {stored.tolist()} for the probe, expected {expected} (amax 336, "
        f"{fmt}) and {zero} (all-zero tile)")
    return expected


# --------------------------------------------------------------------------- derived inputs


def split_at_pages(inp: OpInputs) -> tuple[OpInputs, OpInputs]:
    """Each row's keys split at a page boundary (its first half of pages, rounded down, then the rest) into
    two inputs over the same cache: the first with block_table[:, :k] and cache_seqlens min(L, k * page), the
    second with the remaining pages and L - k * page keys. A row of one page has an empty first part."""
    case = inp.case
    page = case.page_block_size
    bt = inp.tensor("block_table").cpu()
    bt1 = torch.full_like(bt, INVALID_BLOCK)
    bt2 = torch.full_like(bt, INVALID_BLOCK)
    lens1, lens2 = [], []
    for b, L in enumerate(inp.spec.lens):
        n = -(-L // page)
        k = n // 2
        bt1[b, :k] = bt[b, :k]
        bt2[b, :n - k] = bt[b, k:n]
        lens1.append(min(L, k * page))
        lens2.append(L - min(L, k * page))
    one = inp.derive(block_table=bt1, cache_seqlens=torch.tensor(lens1, dtype=torch.int32))
    two = inp.derive(block_table=bt2, cache_seqlens=torch.tensor(lens2, dtype=torch.int32))
    return one, two


def single_row(inp: OpInputs, b: int) -> OpInputs:
    """Row b alone (the same pages, the same block-table width), for batch invariance."""
    case = dataclasses.replace(inp.case, batch=1)
    spec = dataclasses.replace(inp.spec, case=case, lens=(inp.spec.lens[b],))
    tensors = {n: inp.tensor(n)[b:b + 1].cpu() for n in ("q", "block_table", "cache_seqlens")}
    new = inp.derive(**tensors)
    return dataclasses.replace(new, spec=spec, latent=[inp.latent[b]], slots=[inp.slots[b]])


def selected_slots(inp: OpInputs, b: int, i: int = 0) -> torch.Tensor:
    """The valid flat slots a sparse query (b, i) selects (topk_length and invalid entries applied)."""
    idx = inp.tensor("indices")[b, i].cpu().long()
    tl = inp.tensor("topk_length")
    n = idx.numel() if tl is None else min(int(tl[b]), idx.numel())
    idx = idx[:n]
    return idx[(idx >= 0) & (idx < inp.num_blocks * inp.case.page_block_size)]


def dense_of_selection(inp: OpInputs, seed: int = 7) -> OpInputs:
    """Dense, non-causal inputs whose row b holds exactly the keys sparse query (b, 0) selects, copied byte for
    byte from the sparse cache into a new poisoned, shuffled paged cache (s_q must be 1)."""
    case = inp.case
    assert case.s_q == 1, "dense_of_selection needs one query per row"
    page = case.page_block_size
    g = torch.Generator().manual_seed(seed)
    kv = inp.tensor("kv_cache").cpu()
    flat = kv.reshape(-1, kv.shape[-1])
    sel = [selected_slots(inp, b) for b in range(case.batch)]
    lens = [int(s.numel()) for s in sel]
    n_pages = [-(-L // page) for L in lens]
    num_blocks = sum(n_pages) + 2
    perm = torch.randperm(num_blocks, generator=g)
    cache = torch.full((num_blocks, page, 1, kv.shape[-1]), 0xFF if kv.dtype == torch.uint8 else float("nan"),
                       dtype=kv.dtype)
    bt = torch.full((case.batch, max(n_pages) + 1), INVALID_BLOCK, dtype=torch.int32)
    used = 0
    for b, L in enumerate(lens):
        ids = perm[used:used + n_pages[b]]
        used += n_pages[b]
        bt[b, :n_pages[b]] = ids.to(torch.int32)
        pos = torch.arange(L)
        cache.view(num_blocks * page, kv.shape[-1])[ids[pos // page] * page + pos % page] = flat[sel[b]]
    dense_case = dataclasses.replace(case, topk=None, attn_sink=False, causal=False)
    spec = dataclasses.replace(inp.spec, case=dense_case, lens=tuple(lens), invalid=None, all_invalid_rows=(),
                               topk_length=False, sink=None)
    buffers = {n: Buffer(n, t, device=case.device) for n, t in
               (("q", inp.tensor("q").cpu()), ("kv_cache", cache), ("block_table", bt),
                ("cache_seqlens", torch.tensor(lens, dtype=torch.int32)))}
    return OpInputs(spec, buffers, inp.softmax_scale, [], sel, num_blocks)



def two_caches(inp: OpInputs, extra_page: int, *, extra_topk_length: bool, seed: int = 9) -> OpInputs:
    """The sparse case's selection split over two caches, as FlashMLA's two-cache sparse decode takes it: each
    query keeps the first half of its index entries into ``kv_cache`` (``indices``; ``topk_length`` cut to it);
    the keys the second half selects are copied byte for byte into a second poisoned paged cache of pages of
    ``extra_page`` tokens, at shuffled slots (``extra_k_cache``, ``extra_indices``; an invalid entry stays -1).
    The union of the keys both select is the case's own selection, so its oracle is the case's. A case with
    ``topk_length`` passes each cache its share of it (``extra_topk_length`` the second's); with
    ``extra_topk_length`` the second half is passed its length and holds 8 valid indices past it (to be ignored)."""
    case = inp.case
    g = torch.Generator().manual_seed(seed)
    idx = inp.tensor("indices").cpu().long()
    B, s_q, k = idx.shape
    k1 = k // 2
    n_slots = inp.num_blocks * case.page_block_size
    tl = inp.tensor("topk_length")
    counted = (torch.full((B,), k) if tl is None else tl.cpu().long()).clamp(0, k)
    kv = inp.tensor("kv_cache").cpu()
    flat = kv.reshape(n_slots, kv.shape[-1])
    second = idx[:, :, k1:]
    extra_len = (counted - k1).clamp(0, k - k1)
    if extra_topk_length:  # past each row's length: 8 more valid indices, which the op must ignore
        filler = torch.cat(inp.slots)
        second = torch.cat([second, filler[torch.randint(filler.numel(), (B, s_q, 8), generator=g)]], dim=-1)
    valid = (second >= 0) & (second < n_slots)
    n_rows = int(valid.sum())
    extra_blocks = -(-n_rows // extra_page) + 2
    positions = torch.randperm(extra_blocks * extra_page, generator=g)[:n_rows]
    fill = 0xFF if kv.dtype == torch.uint8 else float("nan")
    extra = torch.full((extra_blocks, extra_page, 1, kv.shape[-1]), fill, dtype=kv.dtype)
    extra.view(extra_blocks * extra_page, kv.shape[-1])[positions] = flat[second[valid]]
    extra_idx = torch.full(second.shape, -1, dtype=torch.int64)
    extra_idx[valid] = positions
    tensors = {"indices": idx[:, :, :k1].to(torch.int32), "extra_k_cache": extra,
               "extra_indices": extra_idx.to(torch.int32)}
    if tl is not None:
        tensors["topk_length"] = counted.clamp(max=k1).to(torch.int32)
    if tl is not None or extra_topk_length:
        tensors["extra_topk_length"] = extra_len.to(torch.int32)
    return inp.derive(**tensors)
