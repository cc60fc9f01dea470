"""Padded decode batches (suites/test_op_padding.py): real rows followed by, or interleaved with, padding rows as
an engine pads a batch for a captured CUDA graph -- ``cache_seqlens`` 0, block-table rows of -1 (vLLM), of 0, or
of stale ids of an earlier batch (pages now NaN-poisoned, or pages other rows use); a sparse padding row has every
index -1 and ``topk_length`` 0.

The padded inputs (:func:`build_padded`, cached per :class:`Padded`) are the real rows' inputs (:func:`build`)
over a copy of their cache with NaN-poisoned pages added where padding rows point: block 0 (a row of 0s), the last
block (a row of -1s: ``kv_cache[-1]`` on a CPU, a negative offset on a GPU) and stale pages; the real rows'
pages are the same bytes. Held (:func:`check_padded`), in the order the causes are told apart:

1. each padding row is a zero-length row: out exactly 0, lse the declared ``empty_row`` (not where the op
   declares ``padding_rows = "undefined"``); a NaN there is told apart by rerunning with the poisoned pages
   zeroed (a read through the padding row: vLLM #35969) and with the long row cut short (NaN only at a long
   max length: FlashInfer #2883 / vLLM #37815); a padding row holding a real row's output is metadata sized to
   the real rows (xLLM #1939);
2. no NaN in a real row;
3. each real row's out and lse equal the same rows run unpadded over the same cache, within both calls' bounds
   (bitwise where the op declares ``batch_invariant``);
4. and the float64 oracle.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from mla_conformance.checks.op.compare import as_reference, bitwise_equal, compare, empty_row_sentences, oracle_of
from mla_conformance.checks.op.inputs import INVALID_BLOCK, Buffer, OpInputs, Spec, build, where
from mla_conformance.checks.op.run import run_op
from mla_conformance.contract.op import declared
from mla_conformance.messages import failure, with_cause

#: what padding rows' block-table rows hold, one padding row of each in a batch (in this order, cycled): vLLM's -1,
#: 0, stale ids of an earlier batch's pages (NaN-poisoned since), stale ids of pages another row uses now
FILLS = ("minus-one", "zero", "stale", "live")
#: where the padding rows go: after the real rows (vLLM, SGLang), or between them
LAYOUTS = ("trailing", "interleaved")
#: stale pages (NaN, freed since an earlier batch) added to the cache for the "stale" fill
STALE_PAGES = 2
#: the length the longest row is cut to when telling a NaN "only at a long max length" apart
SHORT = 16


@dataclasses.dataclass(frozen=True)
class Padded:
    """A padded batch: the real rows of ``spec``, ``pad`` padding rows placed per ``layout``, their block-table
    rows filled per ``fills`` (cycled: the k-th padding row gets the k-th fill)."""

    spec: Spec
    layout: str = "trailing"
    fills: tuple[str, ...] = FILLS
    pad: int = len(FILLS)

    def positions(self) -> tuple[list[int], list[int]]:
        """(real rows' positions, padding rows' positions) in the padded batch."""
        n = len(self.spec.lens)
        B = n + self.pad
        if self.layout == "trailing":
            pads = list(range(n, B))
        else:  # every other row from row 1 (between real rows, and the last row where pad <= n)
            pads = list(range(1, B, 2))[:self.pad]
            pads = sorted(pads + [b for b in range(B - 1, -1, -1) if b not in pads][:self.pad - len(pads)])
        return [b for b in range(B) if b not in pads], pads


@dataclasses.dataclass
class PaddedInputs:
    padded: OpInputs           # the padded batch
    unpadded: OpInputs         # the real rows alone, over the same cache
    real: list[int]            # positions of the real rows in the padded batch
    pads: list[int]            # positions of the padding rows
    poisoned: list[int]        # block ids of the NaN pages padding rows may point at
    fills: dict[int, str]      # padding row -> what its block-table row holds (for messages)
    live: dict[int, int]       # padding row -> the real row whose pages its stale entries point at


def _poison_like(kv: torch.Tensor, n: int) -> torch.Tensor:
    shape = (n, *kv.shape[1:])
    return torch.full(shape, 0xFF, dtype=torch.uint8) if kv.dtype == torch.uint8 else \
        torch.full(shape, math.nan, dtype=kv.dtype)


@functools.lru_cache(maxsize=16)
def build_padded(p: Padded) -> PaddedInputs:
    """The padded inputs of ``p`` (cached; the op's calls are checked to leave them unchanged)."""
    inp = build(p.spec)
    case, page = inp.case, inp.case.page_block_size
    g = torch.Generator().manual_seed(2000 + p.spec.seed)
    kv = inp.tensor("kv_cache").cpu()
    nb = kv.shape[0]
    # block 0 poisoned, the real pages shifted by one, STALE_PAGES stale pages, the last block poisoned
    cache = torch.cat([_poison_like(kv, 1), kv, _poison_like(kv, STALE_PAGES + 1)])
    stale = list(range(nb + 1, nb + 1 + STALE_PAGES))
    last = cache.shape[0] - 1
    real_bt = inp.tensor("block_table").cpu()
    real_bt = torch.where(real_bt == INVALID_BLOCK, real_bt, real_bt + 1)
    real, pads = p.positions()
    B, W = len(real) + len(pads), real_bt.shape[1]
    lens = [0] * B
    bt = torch.empty(B, W, dtype=torch.int32)
    q = torch.randn(B, *inp.tensor("q").shape[1:], generator=g, dtype=torch.float64).to(case.dtype)
    longest = max(range(len(real)), key=lambda r: p.spec.lens[r])
    fills, live = {}, {}
    for r, b in enumerate(real):
        lens[b] = p.spec.lens[r]
        bt[b] = real_bt[r]
        q[b] = inp.tensor("q")[r].cpu()
    for k, b in enumerate(pads):
        fill = p.fills[k % len(p.fills)]
        if fill == "minus-one":
            bt[b], fills[b] = -1, f"block-table row of -1: kv_cache[-1] is block {last}, NaN"
        elif fill == "zero":
            bt[b], fills[b] = 0, "block-table row of 0: block 0, NaN"
        elif fill == "stale":
            bt[b] = torch.tensor([stale[j % STALE_PAGES] for j in range(W)], dtype=torch.int32)
            fills[b] = f"stale block ids {stale} of an earlier batch's pages, NaN since"
        else:  # every entry a page the longest row uses now
            pages = real_bt[longest][real_bt[longest] != INVALID_BLOCK]
            bt[b] = pages[torch.arange(W) % pages.numel()]
            fills[b] = f"the stale block ids of real row {real[longest]}'s pages"
            live[b] = real[longest]
    if case.sparse:
        fills = {b: f"every index -1, topk_length 0, {f}" for b, f in fills.items()}
    padded_case = dataclasses.replace(case, batch=B, padding_rows=len(pads))
    dev = case.device
    kv_buf = Buffer("kv_cache", cache, device=dev)
    tensors = {"q": q, "block_table": bt, "cache_seqlens": torch.tensor(lens, dtype=torch.int32)}
    if case.sparse:
        idx = inp.tensor("indices").cpu()
        shifted = torch.where(idx >= 0, idx + page, idx)           # the real pages moved up one block
        tensors["indices"] = torch.full((B, *idx.shape[1:]), -1, dtype=torch.int32)
        tensors["topk_length"] = torch.zeros(B, dtype=torch.int32)
        tl = inp.tensor("topk_length")
        for r, b in enumerate(real):
            tensors["indices"][b] = shifted[r]
            tensors["topk_length"][b] = idx.shape[-1] if tl is None else int(tl[r])
    buffers = {n: Buffer(n, t, device=dev) for n, t in tensors.items()}
    buffers["kv_cache"] = kv_buf
    slots = [torch.zeros(0, dtype=torch.long)] * B
    latent = [torch.zeros(0, inp.latent[0].shape[-1], dtype=torch.float64)] * B
    for r, b in enumerate(real):
        slots[b], latent[b] = inp.slots[r] + page, inp.latent[r]
    padded = OpInputs(dataclasses.replace(p.spec, case=padded_case, lens=tuple(lens)), buffers, inp.softmax_scale,
                      latent, slots, cache.shape[0])
    rows = torch.tensor(real)
    alone = {n: buffers[n].view[rows].cpu() for n in tensors}
    if case.sparse and inp.tensor("topk_length") is None:
        del alone["topk_length"]     # the unpadded call as the real rows' own inputs have it
    ub = {n: Buffer(n, t, device=dev) for n, t in alone.items()}
    ub["kv_cache"] = kv_buf
    unpadded = OpInputs(p.spec, ub, inp.softmax_scale, [latent[b] for b in real], [slots[b] for b in real],
                        cache.shape[0])
    return PaddedInputs(padded, unpadded, real, pads, [0, *stale, last], fills, live)


def padded_oracle(p: Padded, pinp: PaddedInputs):
    """The oracle of the real rows (cached with their spec) scattered into the padded batch: a padding row is a
    query without keys (out 0, lse +inf, magnitudes 0)."""
    out, lse, mags = oracle_of(p.spec)
    B = len(pinp.real) + len(pinp.pads)
    idx = torch.tensor(pinp.real)

    def scatter(t, fill=0.0):
        full = torch.full((B, *t.shape[1:]), fill, dtype=t.dtype)
        full[idx] = t
        return full

    return scatter(out), scatter(lse, math.inf), {k: scatter(v) for k, v in mags.items()}


def _rows(oracle, b: int):
    out, lse, mags = oracle
    return out[b:b + 1], lse[b:b + 1], {k: v[b:b + 1] for k, v in mags.items()}


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.to(torch.float64), b.to(torch.float64)
    return bool(torch.isfinite(a).all()) and float((a - b).abs().max()) <= 1e-3 * (float(b.abs().max()) + 1e-30)


def check_padded(op, p: Padded, *, check: str, figures: dict) -> None:
    """Run the padded batch and the real rows unpadded; hold 1-4 of the module docstring."""
    __tracebackhide__ = True
    pinp = build_padded(p)
    case = pinp.padded.case
    longest = max(p.spec.lens)
    figures.update(case=case.describe(), check=check, op=op.name, layout=p.layout, padding_fill=list(p.fills),
                   padding_rows=len(pinp.pads), padding_positions=pinp.pads, longest_row=longest)
    out, lse = run_op(op, pinp.padded, check)
    undefined = declared(op, "padding_rows") == "undefined"
    figures["padding_rows_compared"] = not undefined
    if not undefined:
        _check_padding_rows(op, p, pinp, out, lse, check)
    w = where(op, case, check)
    for b in pinp.real:
        bad = ~torch.isfinite(out[b].detach().cpu())
        if bool(bad.any()):
            raise AssertionError(failure(
                f"{w}: real row {b} (cache_seqlens {int(pinp.padded.tensor('cache_seqlens')[b])}) has "
                f"{int(bad.sum())} non-finite out value(s)",
                f"the batch is padded with rows {pinp.pads} (cache_seqlens 0)",
                cause="NaN leaked into a real row from the padding rows (a reduction or workspace shared across rows?)"))
    alone = run_op(op, pinp.unpadded, check + " (the real rows unpadded)")
    base = declared(op, "lse_base")
    oracle = padded_oracle(p, pinp)
    for r, b in enumerate(pinp.real):
        L = p.spec.lens[r]
        got = (out[b:b + 1], None if lse is None else lse[b:b + 1])
        ref = (alone[0][r:r + 1], None if alone[1] is None else alone[1][r:r + 1])
        what = f"real row {b} (cache_seqlens {L}) changed when padding rows were added"
        if declared(op, "batch_invariant"):
            try:
                bitwise_equal(op, case, got, ref, check=check, what=f"declares batch_invariant = True but {what}",
                              figures=figures)
            except AssertionError as exc:
                raise AssertionError(with_cause(str(exc), _other_row_hint(pinp, out, alone[0], b))) from None
            continue
        try:
            compare(op, case, *got, *as_reference(*ref, base), check=f"{check}: {what}", figures=figures,
                    oracle=_rows(oracle, b), ref_dtype=alone[0].dtype, against="the same rows run unpadded")
        except AssertionError as exc:
            raise AssertionError(with_cause(str(exc), _other_row_hint(pinp, out, alone[0], b))) from None
    compare(op, case, *real_rows_only(op, out, lse, pinp.pads), oracle[0], oracle[1], check=check, figures=figures,
            oracle=oracle)


def real_rows_only(op, out, lse, pads: list[int]):
    """(out, lse) as compared with the oracle: where the op declares ``padding_rows = "undefined"`` its padding
    rows are not looked at (set to what a zero-length row gives); else as returned."""
    if declared(op, "padding_rows") != "undefined" or not pads:
        return out, lse
    out = out.detach().cpu().clone()
    out[pads] = 0
    if lse is not None:
        lse = lse.detach().cpu().clone()
        lse[pads] = math.inf if declared(op, "empty_row") == "+inf" else -math.inf
    return out, lse


def _other_row_hint(pinp: PaddedInputs, out, alone_out, b: int) -> str:
    for r, other in enumerate(pinp.real):
        if other != b and _close(out[b].detach().cpu(), alone_out[r].detach().cpu()):
            return (f"its out is real row {other}'s: the op computed row {b} with another row's metadata (a plan "
                    "or work list sized or indexed by the real rows, read past its end when the batch is padded: "
                    "xLLM #1939)")
    return ""


def _check_padding_rows(op, p: Padded, pinp: PaddedInputs, out, lse, check: str) -> None:
    __tracebackhide__ = True
    case = pinp.padded.case
    w = where(op, case, check)
    empty = math.inf if declared(op, "empty_row") == "+inf" else -math.inf
    tail = ("a padding row (cache_seqlens 0) is a zero-length row of the base contract: out 0 and lse the declared "
            "empty_row, whatever its block-table row holds (an op whose padding rows are garbage by design declares "
            "padding_rows = 'undefined')")
    for b in pinp.pads:
        o = out[b].detach().cpu().to(torch.float64)
        row = f"row {b} is a padding row"
        fill = f"row {b}: cache_seqlens 0, {pinp.fills[b]}; {tail}"
        bad = ~torch.isfinite(o)
        if bool(bad.any()):
            kind = "NaN" if bool(torch.isnan(o).any()) else "inf"
            raise AssertionError(failure(f"{w}: {row} and its out is {kind} ({int(bad.sum())} of {o.numel()} values)",
                                         fill, cause=f"{_trailing_only(pinp, out, b)}{_nan_cause(op, p, pinp, check)}"))
        if bool((o != 0).any()):
            s, h, d = (int(i) for i in (o != 0).nonzero()[0])
            raise AssertionError(failure(f"{w}: {row} but its out is not 0: {float(o[s, h, d]):.6g} at (s, h, d) = "
                                         f"({s}, {h}, {d})", f"{int((o != 0).sum())} value(s) not 0", fill,
                                         cause=_nonzero_cause(op, pinp, out, b, check)))
        if lse is not None:
            l = lse[b].detach().cpu().to(torch.float64)
            wrong = l != empty
            if bool(wrong.any()):
                h, s = (int(i) for i in wrong.nonzero()[0])
                got = float(l[h, s])
                said, hint = empty_row_sentences(op, "empty_row", got)
                raise AssertionError(failure(f"{w}: {row} but its lse is {got} at head {h}, expected {empty}",
                                             f"{empty} is {said}; {int(wrong.sum())} such value(s)", fill, cause=hint))


def _trailing_only(pinp: PaddedInputs, out, b: int) -> str:
    """'...; ' when the padding rows after the last real row are 0 and this one, between real rows, is not."""
    after = [t for t in pinp.pads if t > max(pinp.real)]
    if b > max(pinp.real) or not after or bool(out[after].detach().cpu().ne(0).any()):
        return ""
    return (f"the padding rows after the last real row ({after}) are 0 and this one, between real rows, is not: "
            "the op zeroes the rows past the number of real ones (out[num_real:] = 0), as if padding always trailed "
            "the batch; ")


def _nonzero_cause(op, pinp: PaddedInputs, out, b: int, check: str) -> str:
    """Why a padding row's out is not 0: it is a real row's (in this call, or run unpadded), or it attended the
    live pages its stale block-table entries point at."""
    alone = run_op(op, pinp.unpadded, check + " (telling the cause apart)")[0].detach().cpu()
    mine = out[b].detach().cpu()
    for r, real in enumerate(pinp.real):
        if _close(mine, out[real].detach().cpu()) or _close(mine, alone[r]):
            return (f"it is real row {real}'s out: the op gave the padding row another row's work (a plan or "
                    "per-row metadata sized to the real rows and read past its end: xLLM #1939, 112 captured rows "
                    "for 100 real ones)")
    if b in pinp.live:
        return (f"its stale block-table entries point at real row {pinp.live[b]}'s pages: the op attended them "
                "although the row has no keys")
    return ""


def _nan_cause(op, p: Padded, pinp: PaddedInputs, check: str) -> str:
    """Why a padding row is NaN, told apart by rerunning: with the NaN pages padding rows point at zeroed (a read
    through the padding row), then with the longest row cut to SHORT keys (NaN only at a long max length)."""
    def pads_finite(inp: OpInputs) -> bool:
        got = run_op(op, inp, check + " (telling the cause apart)")[0].detach().cpu()
        return bool(torch.isfinite(got[pinp.pads]).all())

    kv = pinp.padded.tensor("kv_cache").cpu().clone()
    kv[pinp.poisoned] = 0
    clean = pads_finite(pinp.padded.derive(kv_cache=kv))
    if clean and pinp.padded.case.sparse:
        return ("with the poisoned pages zeroed the NaN is gone: the op read a key through a padding row (an index "
                "-1 read as flattened slot -1, the last block's last token, or an entry past topk_length 0)")
    if clean:
        return ("with the poisoned pages its block-table entries point at zeroed the NaN is gone: the op read a page "
                "through a padding row (vLLM #35969: FlashMLA's decode read block_table[n_block] with n_block = -1 for "
                "seq_lens 0; a -1 entry is a negative offset on a GPU, kv_cache[-1] here)")
    lens = pinp.padded.tensor("cache_seqlens").cpu().clone()
    longest = int(lens.max())
    if longest > SHORT:
        lens[lens > SHORT] = SHORT
        if pads_finite(pinp.padded.derive(cache_seqlens=lens)):
            return (f"the NaN is gone when the batch's longest row ({longest} keys) is cut to {SHORT}: only at a long "
                    "max length, as a kernel that splits every row's keys by the batch's max_seq_len and merges a "
                    "zero-length row's empty partials as 0/0 (FlashInfer #2883 / vLLM #37815: NaN in CUDA-graph "
                    "padded rows at large max_seq_len; vLLM now zeroes them after every call)")
    return "the op computes 0/0 for a row with no keys (an unguarded softmax: acc / e_sum)"
