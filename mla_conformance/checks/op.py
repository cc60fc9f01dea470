"""Checks of the op contract (:mod:`mla_conformance.contract.op`) shared by ``suites/test_op_*.py``.

Three parts:

* **inputs** (:func:`build`): paged caches behind shuffled block tables, NaN (0xFF bytes for the FP8 layout)
  in every unused page and in the unfilled tail of each row's last page, unused block-table entries set to
  :data:`INVALID_BLOCK`; every buffer the op is handed is a view at the start of a larger allocation whose
  remaining bytes (the canary) are checked after the call, as are the inputs themselves (the op must not
  write them). Inputs are deterministic (seeded) and built once per session (:func:`build` is cached), as is
  the float64 oracle of each (:func:`oracle_of`);
* **running** (:func:`run_op`): the op declines a case with ``unsupported_reason`` (the test skips with its
  sentence); an op that raises or returns the wrong type, shape or dtype is a
  :class:`~mla_conformance.errors.BackendError` / ``BackendOutputError`` (an *error*, not a failure);
* **comparing** (:func:`compare`): out and lse against the oracle (lse converted from the op's declared
  ``lse_base``; a query with no keys must give out exactly 0 and the declared ``empty_row`` infinity; NaN in a
  query with keys fails), within :data:`mla_conformance.checks.OP_TOLERANCES`.

Every failure message names the op, the case (:meth:`OpCase.describe`), the check and the measured numbers;
``figures`` (the test's ``mla_figures``) is filled before anything is raised.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch

from mla_conformance.errors import BackendError, BackendOutputError
from mla_conformance.contract.op import D_QK, D_V, FP8_ROW_BYTES, OpCase, declared
from mla_conformance.impl.ops.reference import decode_fp8_656, encode_fp8_656, lse_to_natural, merge_by_lse, oracle

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

NAN_HINT = ("either poison was read -- the suite fills unused pages, the unfilled tail of each row's last page "
            "(0xFF bytes in the FP8 layout) and a non-contiguous q's padding with NaN, as a reused pool may hold: an "
            "op that reads keys past cache_seqlens and masks them by multiplying with 0 or adding -inf to their "
            "scores gets NaN; select with torch.where or read only the row's keys -- or the op's own arithmetic "
            "overflowed (exp without the running max, 0/0)")


def dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def where(op, case: OpCase, check: str) -> str:
    return f"{op.name} [{case.describe()}] {check}"


# --------------------------------------------------------------------------- choosing cases


def page_sizes(op) -> tuple[int, ...]:
    """The page sizes the op declares that the suite knows how to build."""
    return tuple(p for p in declared(op, "page_block_sizes") if p in KNOWN_PAGE_SIZES)


def pick_page(op, prefer=(16, 64, 1)) -> int:
    sizes = page_sizes(op)
    for p in prefer:
        if p in sizes:
            return p
    pytest.skip(f"{op.name}: declares page_block_sizes {declared(op, 'page_block_sizes')}, none of which the suite "
                f"builds ({', '.join(map(str, KNOWN_PAGE_SIZES))})")


def unsupported(op, case: OpCase) -> str | None:
    """The op's sentence for a case it declines (a raising unsupported_reason is a BackendError)."""
    __tracebackhide__ = True
    # the op's own sentence first: on a host its kernel cannot run on, that is the support matrix's sentence
    # (the same for every case), not a remark about the case's format
    try:
        reason = op.unsupported_reason(case)
    except Exception as exc:
        raise BackendError(f"{op.name}: unsupported_reason({case.describe()}) raised {type(exc).__name__}: "
                           f"{exc}") from exc
    if reason:
        return reason
    if case.sparse and not declared(op, "sparse_decode"):
        return (f"does not declare sparse_decode (the op contract's optional declaration `sparse_decode = True`), so "
                f"sparse decode (top-{case.topk} indices) is not tested")
    if case.attn_sink and not declared(op, "attn_sink"):
        return ("does not declare attn_sink (the op contract's optional declaration `attn_sink = True`), so the "
                "attention sink is not tested")
    for key, value in (("kv_formats", case.kv_format), ("page_block_sizes", case.page_block_size)):
        if value not in declared(op, key):
            src = "declared" if getattr(op, key, None) is not None else "the default: not declared"
            return f"{key} is {declared(op, key)} ({src}), not {value!r}: declare {key} with {value!r} to have it tested"
    return None


def require(op, case: OpCase) -> OpCase:
    __tracebackhide__ = True
    reason = unsupported(op, case)
    if reason:
        pytest.skip(f"{op.name}: {reason}")
    return case


def first_supported(op, cases) -> OpCase:
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
    return not sparse and any(L == 0 or (causal and L < s_q) for L in lens)


def make_case(op, *, lens, s_q=1, h_q=8, page=None, dtypes=("float32", "bfloat16", "float16"), kv_formats=("latent",),
              topk=None, attn_sink=False, causal=False, device="cpu", rows_without_keys=None) -> OpCase:
    """The first case the op accepts over ``kv_formats`` x ``dtypes`` (an FP8 cache takes a bfloat16 q).
    ``rows_without_keys`` defaults to what the lengths say (:func:`has_rows_without_keys`)."""
    __tracebackhide__ = True
    page = pick_page(op) if page is None else page
    if rows_without_keys is None:
        rows_without_keys = has_rows_without_keys(lens, s_q, causal, topk is not None)
    cases = []
    for fmt in kv_formats:
        for dt in (("bfloat16",) if fmt != "latent" else dtypes):
            cases.append(OpCase(batch=len(lens), s_q=s_q, h_q=h_q, page_block_size=page, dtype=getattr(torch, dt),
                                kv_format=fmt, topk=topk, attn_sink=attn_sink, causal=causal, device=device,
                                rows_without_keys=rows_without_keys))
    return first_supported(op, cases)


def make_case_and_lens(op, lens_options, **kw) -> tuple[OpCase, tuple[int, ...]]:
    """The first of ``lens_options`` (row lengths, e.g. with rows without keys first, then without) the op
    accepts a case of, and that case; else skip with the op's sentences."""
    __tracebackhide__ = True
    reasons = []
    for lens in lens_options:
        try:
            return make_case(op, lens=lens, **kw), tuple(lens)
        except pytest.skip.Exception as exc:
            if str(exc) not in reasons:
                reasons.append(str(exc).removeprefix(f"{op.name}: "))
    pytest.skip(f"{op.name}: {'; '.join(reasons)}")


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
        if torch.equal(self.base, self.snapshot):
            return
        diff = (self.base != self.snapshot).nonzero().flatten()
        changed_view = not torch.equal(self._bytes_of_view(self.base), self._bytes_of_view(self.snapshot))
        self.base.copy_(self.snapshot)  # later tests of the session share these inputs
        if changed_view:
            raise AssertionError(f"{where(op, case, check)}: the op wrote its input {self.name} "
                                 f"{tuple(self.view.shape)} {dtype_name(self.view.dtype)} ({int(diff.numel())} "
                                 "byte(s) changed); inputs are read-only in the op contract")
        first = int(diff[0])
        end = self.base.numel() - CANARY_BYTES
        at = (f"starting at byte {first - end} after its end" if first >= end else
              f"starting at byte {first} of its allocation, in the padding between its strided elements")
        raise AssertionError(f"{where(op, case, check)}: the op wrote {int(diff.numel())} byte(s) outside its input "
                             f"{self.name} {tuple(self.view.shape)} {dtype_name(self.view.dtype)} ({at}): the canary "
                             "region after the buffer changed; an op writes only the tensors it returns")

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
                **{n: self.tensor(n) for n in ("indices", "topk_length", "attn_sink") if n in self.buffers}}

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


def _oracle_inputs(inp: OpInputs) -> dict:
    t = {n: b.view.detach().cpu() for n, b in inp.buffers.items()}
    return dict(q=t["q"], kv_cache=t["kv_cache"], block_table=t["block_table"], cache_seqlens=t["cache_seqlens"],
                softmax_scale=inp.softmax_scale, causal=inp.case.causal, indices=t.get("indices"),
                topk_length=t.get("topk_length"), attn_sink=t.get("attn_sink"))


@functools.lru_cache(maxsize=64)
def oracle_of(spec: Spec) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The float64 oracle of a spec, computed once: (out [B, s_q, h_q, 512], natural lse [B, h_q, s_q] with
    +inf for no keys, the magnitudes the error bounds scale with: see ``oracle(magnitudes=True)``)."""
    return oracle(**_oracle_inputs(build(spec)), magnitudes=True)


@functools.lru_cache(maxsize=16)
def top_left_oracle_of(spec: Spec) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The oracle of a causal spec aligned top-left (query i sees keys 0..i): asked only once a causal check
    has failed, to name the likely cause."""
    return oracle(**_oracle_inputs(build(spec)), magnitudes=True, align="top-left")


# --------------------------------------------------------------------------- running the op


def run_op(op, inp: OpInputs, check: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Call ``op.decode`` on the inputs (the test skips with the op's sentence when it declines the case);
    returns (out, lse) after checking their types, shapes and dtypes (BackendOutputError) and that no input
    and no canary changed (AssertionError)."""
    __tracebackhide__ = True
    case = inp.case
    require(op, case)
    try:
        result = op.decode(*inp.args(), **inp.kwargs())
    except Exception as exc:
        for buf in inp.buffers.values():
            buf.base.copy_(buf.snapshot)
        raise BackendError(f"{where(op, case, check)}: decode() raised {type(exc).__name__}: {exc}") from exc
    for buf in inp.buffers.values():
        buf.check(op, case, check)
    return validate(op, case, result, check)


def validate(op, case: OpCase, result, check: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out, lse) checked for type, shape and dtype (BackendOutputError); lse is None for an op that declares
    ``returns_lse = False`` (whatever it returned in its place is not looked at)."""
    __tracebackhide__ = True
    w = where(op, case, check)
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise BackendOutputError(f"{w}: decode() returned {type(result).__name__}, not (out, lse)")
    out, lse = result
    B, s_q, h_q = case.batch, case.s_q, case.h_q
    returns_lse = declared(op, "returns_lse")
    if not returns_lse:
        lse = None
    if not isinstance(out, torch.Tensor) or (returns_lse and not isinstance(lse, torch.Tensor)):
        hint = ("; an op that returns no lse declares returns_lse = False" if returns_lse and lse is None else "")
        raise BackendOutputError(f"{w}: decode() returned ({type(out).__name__}, {type(lse).__name__}), not two "
                                 f"Tensors{hint}")
    if tuple(out.shape) != (B, s_q, h_q, D_V) or not out.is_floating_point():
        raise BackendOutputError(f"{w}: out is {dtype_name(out.dtype)} {tuple(out.shape)}, expected a floating "
                                 f"[B, s_q, h_q, 512] = {(B, s_q, h_q, D_V)}")
    if lse is None:
        return out, None
    if tuple(lse.shape) != (B, h_q, s_q):
        raise BackendOutputError(f"{w}: lse is {dtype_name(lse.dtype)} {tuple(lse.shape)}, expected float32 "
                                 f"[B, h_q, s_q] = {(B, h_q, s_q)}")
    if lse.dtype != torch.float32:
        raise BackendOutputError(f"{w}: lse is {dtype_name(lse.dtype)}, not float32: {_lse_precision_loss(lse)}")
    return out, lse


def _lse_precision_loss(lse: torch.Tensor) -> str:
    """What an lse held in a narrower dtype than float32 costs where it is merged (a sentence with numbers)."""
    if not lse.is_floating_point():
        return "the op contract's lse is float32 (the log-sum-exp, in the declared base)"
    finite = lse.detach().cpu().to(torch.float64)
    finite = finite[torch.isfinite(finite)]
    top = float(finite.abs().max()) if finite.numel() else 0.0
    info = torch.finfo(lse.dtype)
    if info.bits >= 32:
        return "the op contract's lse is float32 (a float64 lse is converted by the op, not by the caller)"
    half_step = (2.0 ** math.floor(math.log2(top)) * info.eps / 2) if top > 0 else info.eps / 2
    return (f"{dtype_name(lse.dtype)} keeps {-round(math.log2(info.eps)) + 1} significant bits, so this lse (|lse| "
            f"up to {top:.3g}) is off by up to {half_step:.2g}, and a split-KV partial merged with it (weight "
            f"exp(lse_i - lse)) by up to {math.expm1(half_step) * 100:.2g}%; keep lse in float32 (vLLM's forward_mqa "
            "allocated it in q's dtype)")


# --------------------------------------------------------------------------- comparing


def tolerance_for(case: OpCase):
    from mla_conformance.checks import OP_TOLERANCES

    key = "fp8-e4m3-flashmla" if case.kv_format == "fp8-e4m3-flashmla" else dtype_name(case.dtype)
    return key, OP_TOLERANCES[key]


def bounds(tol, mags: dict, ref_out: torch.Tensor, ref_lse: torch.Tensor, out_dtype, *, merged: bool = False):
    """Per-element bound on |out - oracle| [B, s_q, h, d] and per-query bound on |lse - oracle| [B, h, s_q]
    (natural log) of one side of a comparison (:class:`mla_conformance.checks.OpTolerance` derives them).

    ``out_dtype``: the dtype that side returned out in (its rounding: half a step of it). ``merged``: that side
    is two partial calls merged by LSE: each part's out rounding is relative to the part's |out| (sum: u_out S,
    not u_out |ref|), the parts' lse errors move their weights (2 x the lse bound x S), and their score terms
    use A_max (T already does)."""
    from mla_conformance.checks import OP_LSE_ROUNDING, unit_roundoff

    u_out = unit_roundoff(out_dtype)
    abs_v, score_v = mags["abs_v"], mags["score_v"]
    finite = torch.where(torch.isfinite(ref_lse), ref_lse.abs(), torch.zeros_like(ref_lse))
    score = mags["score_max"] if merged else mags["score_abs"]
    lse_b = tol.dot * score + (tol.acc + OP_LSE_ROUNDING) * (1.0 + finite + (1.0 if merged else 0.0))
    per_q = lambda x: x.transpose(1, 2)[..., None]                                   # [B, h, s] -> [B, s, h, 1]
    out_b = (tol.p_round + tol.acc) * abs_v + tol.dot * score_v + per_q(mags["sink_rel"] * lse_b) * ref_out.abs()
    out_b = out_b + (u_out * abs_v + 2.0 * per_q(lse_b) * abs_v if merged else u_out * ref_out.abs())
    return out_b, lse_b


def compare(op, case: OpCase, out, lse, ref_out, ref_lse, *, check: str, figures: dict, oracle, lse_base=None,
            empty_lse=None, merged: bool = False, out_dtype=None, ref_dtype=None,
            against: str = "the float64 oracle") -> dict:
    """out / lse of the op against a reference (out float64, lse natural float64 with +inf for no keys).

    ``oracle``: (out, lse, magnitudes) of the float64 oracle of the case (what the bounds scale with; see
    :func:`bounds`). The reference is the oracle itself, or another result of the op (``ref_dtype``: the dtype
    of its out; its own bound is added) -- ``merged``: ``out`` / ``lse`` are two partial calls merged by LSE
    (``out_dtype``: the dtype the parts returned out in; default: ``out``'s).
    ``lse`` is converted from ``lse_base`` (default: the op's declaration); None (an op that declares
    ``returns_lse = False``) compares out only. A query with no keys must return out exactly 0 and lse
    ``empty_lse`` (default: the op's ``empty_row``). Fills ``figures`` first, then raises AssertionError
    naming the op, case, check, the measured error, its bound and where."""
    __tracebackhide__ = True
    key, tol = tolerance_for(case)
    base = declared(op, "lse_base") if lse_base is None else lse_base
    if empty_lse is None:
        empty_lse = math.inf if declared(op, "empty_row") == "+inf" else -math.inf
    w = where(op, case, check)
    o_out, o_lse, mags = oracle
    out_dtype = out.dtype if out_dtype is None else out_dtype
    out_b, lse_b = bounds(tol, mags, o_out, o_lse, out_dtype, merged=merged)
    if ref_dtype is not None:
        ref_out_b, ref_lse_b = bounds(tol, mags, o_out, o_lse, ref_dtype)
        out_b, lse_b = out_b + ref_out_b, lse_b + ref_lse_b
    out = out.detach().cpu().to(torch.float64)
    ref_out = ref_out.to(torch.float64)
    ref_lse = None if ref_lse is None else ref_lse.to(torch.float64)
    if ref_lse is None:
        lse = None
    empty = torch.isinf(o_lse) & (o_lse > 0)                      # [B, h, s_q]: the oracle says no keys
    has_keys = ~empty
    empty_q = empty.transpose(1, 2)                                # [B, s_q, h]
    valid_out = ~empty_q[..., None].expand_as(out)
    ref_valid = ref_out[valid_out]
    err = (out - ref_out).abs()
    err = torch.where(valid_out, err, torch.zeros_like(err))
    ratio = torch.where(valid_out, err / out_b.clamp_min(1e-300), torch.zeros_like(err)).nan_to_num(nan=math.inf)
    figures.update({
        "case": case.describe(), "check": check, "op": op.name,
        "out_max_abs": float(torch.nan_to_num(err, nan=math.inf).max()) if err.numel() else 0.0,
        "out_rel_fro": float((torch.nan_to_num(out, nan=0.0)[valid_out] - ref_valid).norm() / ref_valid.norm())
        if ref_valid.numel() and float(ref_valid.norm()) else 0.0,
        "out_error_over_bound": float(ratio.max()) if ratio.numel() else 0.0,
        "queries": int(empty.numel()), "queries_without_keys": int(empty.sum()),
        "tolerance": key, "tolerance_p_round": tol.p_round, "tolerance_dot": tol.dot, "tolerance_acc": tol.acc,
        "tolerance_u_out": torch.finfo(out_dtype).eps / 2, "lse_base": base, "lse_compared": lse is not None,
    })
    # NaN / inf in a query that has keys
    bad = ~torch.isfinite(out) & valid_out
    if bool(bad.any()):
        b, s, h, d = (int(i) for i in bad.nonzero()[0])
        kind = "NaN" if math.isnan(float(out[b, s, h, d])) else "inf"
        raise AssertionError(f"{w}: out has {int(bad.sum())} non-finite value(s) in queries with keys: {kind} at "
                             f"(b, s, h, d) = ({b}, {s}, {h}, {d}) (cache_seqlens[{b}] of the case: keys exist); "
                             f"{NAN_HINT}")
    if lse is not None:
        raw_lse = lse.detach().cpu().to(torch.float64)
        nat = lse_to_natural(raw_lse, base)
        lse_err = torch.where(has_keys, (nat - ref_lse).abs(), torch.zeros_like(nat))
        figures["lse_max_abs"] = float(torch.nan_to_num(lse_err, nan=math.inf).max()) if lse_err.numel() else 0.0
        bad = ~torch.isfinite(raw_lse) & has_keys
        if bool(bad.any()):
            b, h, s = (int(i) for i in bad.nonzero()[0])
            raise AssertionError(f"{w}: lse has {int(bad.sum())} non-finite value(s) in queries with keys: "
                                 f"{float(raw_lse[b, h, s])} at (b, h, s) = ({b}, {h}, {s}), expected "
                                 f"{float(ref_lse[b, h, s]):.6g} (natural log); {NAN_HINT}")
    # queries with no keys: out exactly 0, lse the declared infinity
    if bool(empty.any()):
        nonzero = (out != 0) & ~valid_out
        if bool(nonzero.any()):
            b, s, h, d = (int(i) for i in nonzero.nonzero()[0])
            raise AssertionError(f"{w}: query (b={b}, s={s}) has no keys, so out must be exactly 0; got "
                                 f"{float(out[b, s, h, d])} at head {h}, channel {d} ({int(nonzero.sum())} value(s) "
                                 "not 0)")
        wrong = ((raw_lse != empty_lse) & empty) if lse is not None else torch.zeros_like(empty)
        if bool(wrong.any()):
            b, h, s = (int(i) for i in wrong.nonzero()[0])
            got = float(raw_lse[b, h, s])
            said = ("declared" if getattr(op, "empty_row", None) is not None else
                    "the op contract's default: the op declares no empty_row")
            other = {math.inf: "+inf", -math.inf: "-inf"}.get(got)
            hint = (f"; if {other} is the op's convention for a query with no keys, declare empty_row = {other!r}"
                    if other and other != declared(op, "empty_row") else "")
            raise AssertionError(f"{w}: query (b={b}, s={s}) has no keys: lse must be {empty_lse} (empty_row = "
                                 f"{declared(op, 'empty_row')!r}, {said}), got {got} at head {h} "
                                 f"({int(wrong.sum())} such value(s)){hint}")
    # lse of queries with keys
    if lse is not None:
        over = lse_err > lse_b
        if bool(over.any()):
            b, h, s = _unravel(int((lse_err / lse_b).nan_to_num(nan=math.inf).flatten().argmax()), lse_err.shape)
            got, exp = float(nat[b, h, s]), float(ref_lse[b, h, s])
            hint = ""
            if exp and abs(float(raw_lse[b, h, s]) * math.log(2.0) - exp) <= 1e-3 * (1 + abs(exp)) and base == "e":
                hint = "; the lse matches base 2 (lse x ln 2 equals the oracle): declare lse_base = '2'"
            elif exp and abs(float(raw_lse[b, h, s]) / math.log(2.0) - exp) <= 1e-3 * (1 + abs(exp)) and base == "2":
                hint = "; the lse matches the natural log: declare lse_base = 'e' (or return base 2)"
            raise AssertionError(
                f"{w}: lse differs from {against}: max abs error {float(lse_err.max()):.3e} (natural log) at (b, h, s) "
                f"= ({b}, {h}, {s}): got {got:.6g} (raw {float(raw_lse[b, h, s]):.6g}, declared base {base}), expected "
                f"{exp:.6g}; bound {float(lse_b[b, h, s]):.3e} ({key}: dot {tol.dot:.3g} x Abar "
                f"{float(mags['score_abs'][b, h, s]):.3g} + ({tol.acc:.3g} + 2^-24) x (1 + |lse|)); {int(over.sum())} "
                f"of {int(has_keys.sum())} queries over{hint}")
    # out of queries with keys
    over = (err > out_b) & valid_out
    if bool(over.any()):
        b, s, h, d = _unravel(int(ratio.flatten().argmax()), err.shape)
        at = (b, s, h, d)
        raise AssertionError(
            f"{w}: out differs from {against}: max abs error {float(err.max()):.3e}; worst against its bound at "
            f"(b, s, h, d) = {at}: got {float(out[at]):.6g}, expected {float(ref_out[at]):.6g}, error "
            f"{float(err[at]):.3e} = {float(ratio[at]):.3g} x the bound {float(out_b[at]):.3e} ({key}: u_out "
            f"{figures['tolerance_u_out']:.3g} x |ref| + "
            f"(p_round {tol.p_round:.3g} + acc {tol.acc:.3g}) x S {float(mags['abs_v'][at]):.3g} + dot {tol.dot:.3g} "
            f"x T {float(mags['score_v'][at]):.3g}; S = softmax @ |V|, T = sum_t p_t (A_t + A_max) |v_t| from the "
            f"float64 oracle{'; both sides bounded' if ref_dtype is not None else ''}); {int(over.sum())} of "
            f"{int(valid_out.sum())} values over, rel_fro {figures['out_rel_fro']:.3e}")
    return figures


def _unravel(flat: int, shape) -> tuple[int, ...]:
    out = []
    for n in reversed(tuple(shape)):
        out.append(flat % n)
        flat //= n
    return tuple(reversed(out))


def check_against_oracle(op, spec: Spec, *, check: str, figures: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Build (cached), run, compare with the oracle (cached); returns the op's (out, lse). A causal case that
    fails is compared once more with the oracle aligned top-left, to name that as the likely cause."""
    __tracebackhide__ = True
    require(op, spec.case)
    figures.update(case=spec.case.describe(), check=check, op=op.name)
    inp = build(spec)
    out, lse = run_op(op, inp, check)
    ref = oracle_of(spec)
    try:
        compare(op, spec.case, out, lse, ref[0], ref[1], check=check, figures=figures, oracle=ref)
    except AssertionError as exc:
        hint = _top_left_hint(op, spec, out, lse)
        if hint:
            figures["likely_cause"] = "top-left causal alignment"
            raise AssertionError(f"{exc}{hint}") from None
        raise
    return out, lse


def _top_left_hint(op, spec: Spec, out, lse) -> str:
    """'; likely cause: top-left causal alignment ...' when a failing causal multi-token case matches the
    oracle aligned top-left within the bounds."""
    case = spec.case
    if not case.causal or case.s_q < 2 or case.sparse:
        return ""
    tl = top_left_oracle_of(spec)
    try:
        compare(op, case, out, lse, tl[0], tl[1], check="top-left", figures={}, oracle=tl)
    except AssertionError:
        return ""
    return ("; likely cause: top-left causal alignment -- the op matches the oracle in which query i sees keys 0..i; "
            "the contract aligns multi-token decode bottom-right (the s_q queries are the row's last s_q tokens: "
            "query i attends keys < cache_seqlens[b] - s_q + i + 1)")


def bitwise_equal(op, case: OpCase, a, b, *, check: str, what: str, figures: dict) -> None:
    """Two (out, lse) pairs bitwise equal (NaN equal to NaN of the same bits)."""
    __tracebackhide__ = True
    figures.setdefault("check", check)
    figures.setdefault("case", case.describe())
    for name, x, y in (("out", a[0], b[0]), ("lse", a[1], b[1])):
        if x is None or y is None:  # an op that declares returns_lse = False
            continue
        x, y = x.detach().cpu(), y.detach().cpu()
        same = x.shape == y.shape and x.dtype == y.dtype and torch.equal(
            x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))
        if not same:
            diff = (x.to(torch.float64) - y.to(torch.float64)).abs()
            n = int((x != y).sum()) if x.shape == y.shape else -1
            figures.update({f"{name}_differing_values": n, f"{name}_max_abs_difference": float(diff.max())})
            raise AssertionError(f"{where(op, case, check)}: {what}: {name} is not bitwise the same: {n} of {x.numel()} "
                                 f"values differ, max abs difference {float(diff.max()):.3e}")
    figures.update({"out_differing_values": 0, "lse_differing_values": 0})


def require_declared(op, key: str, what: str) -> None:
    __tracebackhide__ = True
    if not declared(op, key):
        pytest.skip(f"{op.name}: does not declare {key} (the op contract's optional declaration `{key} = True`), "
                    f"so {what} is not checked")


__all__ = ["KNOWN_PAGE_SIZES", "INVALID_BLOCK", "INT_MAX", "INVALID_KINDS", "SOFTMAX_SCALE", "Spec", "OpInputs",
           "Buffer", "build", "oracle_of", "run_op", "validate", "compare", "check_against_oracle", "bitwise_equal",
           "make_case", "make_case_and_lens", "has_rows_without_keys", "bounds", "top_left_oracle_of", "pick_page", "page_sizes", "require", "require_declared", "first_supported", "unsupported",
           "tolerance_for", "merge_by_lse", "lse_to_natural"]


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


def as_reference(out: torch.Tensor, lse: torch.Tensor | None, base: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """An op's (out, lse) as a comparison reference: float64 out, natural lse with +inf for no keys."""
    if lse is None:
        return out.detach().cpu().to(torch.float64), None
    nat = lse_to_natural(lse.detach().cpu().to(torch.float64), base)
    nat = torch.where(torch.isinf(nat), torch.full_like(nat, math.inf), nat)
    return out.detach().cpu().to(torch.float64), nat
