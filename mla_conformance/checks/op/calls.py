"""Kernels called as engines call them (issue 26), for suites/test_op_out_buffers.py and suites/test_op_speculative.py:

* **preallocated outputs** (the ``out_buffers`` declaration, FlashInfer's ``run(..., out=, lse=)`` and vLLM's
  preallocated output under a captured CUDA graph): :func:`check_out_buffers` hands decode caller-owned ``out=`` /
  ``lse=`` views (:data:`LAYOUTS`) filled with 0xFF bytes (NaN in every float dtype) inside allocations whose
  other bytes and a canary after them must stay bitwise untouched; the op must return the buffers themselves,
  write every element of them, and be right there. An op that raises on a legal buffer but runs without one
  *fails* its declaration (FlashInfer #2856 / #2876); one that raises either way is an error, as everywhere.
* **speculative verification** (causal multi-token decode at any q_len): :func:`engine_tables` hands the op
  ``block_table`` / ``cache_seqlens`` as the first B rows of tables sized for a larger batch (an engine's
  persistent tables), whose later rows name the cache's NaN spare pages; :func:`check_speculative` holds the
  op against the bottom-right oracle and, when it fails, names the likely cause: every query position of a row
  given one output (ROCm aiter #2720), rows past B read (vLLM #51848 / #51065), top-left alignment.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from mla_conformance.checks.metrics import dtype_name
from mla_conformance.checks.op.compare import bounds, check_against_oracle, compare, oracle_of, tolerance_for
from mla_conformance.checks.op.inputs import (CANARY_BYTE, CANARY_BYTES, INVALID_BLOCK, Buffer, OpInputs, Spec, build,
                                              require, require_declared, where)
from mla_conformance.checks.op.run import validate
from mla_conformance.contract.op import D_V, OpCase, declared
from mla_conformance.errors import BackendError
from mla_conformance.messages import failure, with_cause

#: what an out / lse buffer holds before the call: 0xFF bytes, NaN in every float dtype and never a value a
#: kernel writes (its NaN is the canonical 0x7FC0...), so an element still holding it was not written
FILL_BYTE = 0xFF
#: the caller-owned buffer layouts of test_out_buffers_strided -> (what it is, where engines keep it)
LAYOUTS = {
    "contiguous": "out [B, s_q, h_q, 512] and lse [B, h_q, s_q], contiguous",
    "capacity": "out and lse the first B rows of buffers sized for B + 3 rows (a captured graph's largest batch)",
    "tokens-first": "out a [..., :512] slice of [B, s_q, h_q, 576] (gaps between heads); lse the transpose of a "
                    "[B, s_q, h_q] buffer (FlashInfer's [tokens, heads])",
    "heads-first": "out the transpose of [B, h_q, s_q, 512]; lse a view of an [h_q, B, s_q] buffer (vLLM keeps lse "
                   "heads-first)",
}
#: engine tables: rows per batch row of the persistent block table / lengths (an engine's are sized for
#: max_num_seqs); at least the largest q_len, so a kernel that reads a row per query token stays inside them
TABLE_ROWS_PER_ROW = 8


# --------------------------------------------------------------------------- preallocated outputs


class OutBuffer(Buffer):
    """A caller-owned output: ``view`` (of ``shape``) a strided view into a typed allocation of ``alloc_shape``
    filled with FILL_BYTE, CANARY_BYTES of CANARY_BYTE after it. The op may write the view, nothing else."""

    def __init__(self, name: str, dtype, alloc_shape, view_of, *, device):
        self.name = name
        n = math.prod(alloc_shape) * torch.empty(0, dtype=dtype).element_size()
        self.base = torch.full((n + CANARY_BYTES,), CANARY_BYTE, dtype=torch.uint8, device=device)
        self.base[:n].fill_(FILL_BYTE)
        self.view = view_of(self.base[:n].view(dtype).view(alloc_shape))
        self.snapshot = self.base.clone()

    def written_outside(self) -> str | None:
        """Where the op wrote outside the view (None: nowhere): the snapshot with the view's current values put
        in through its strides must be the allocation now."""
        n = self.base.numel() - CANARY_BYTES
        expected = self.snapshot.clone()
        v = self.view
        torch.as_strided(expected[:n].view(v.dtype), v.shape, v.stride(), v.storage_offset()).copy_(v)
        diff = (expected != self.base).nonzero().flatten()
        if not diff.numel():
            return None
        first = int(diff[0])
        at = (f"starting at byte {first - n} of the canary after the allocation" if first >= n else
              f"starting at byte {first} of the allocation, outside the view (a gap between its strided elements or "
              "a row past it)")
        return f"{int(diff.numel())} byte(s) {at}"

    def unwritten(self) -> torch.Tensor:
        """bool [view's shape]: elements still holding the fill (every byte FILL_BYTE)."""
        v = self.view.detach()  # flattened: a size-1 dim (s_q 1) may keep any stride, even in a contiguous tensor
        flat = v.contiguous().reshape(-1)
        return (flat.view(torch.uint8).view(*v.shape, v.element_size()) == FILL_BYTE).all(-1).cpu()


def out_buffers(case: OpCase, layout: str, *, with_lse: bool) -> dict[str, OutBuffer]:
    """The ``out`` (q's dtype) and, ``with_lse``, ``lse`` (float32) buffers of a layout of :data:`LAYOUTS`."""
    B, s, h, dev = case.batch, case.s_q, case.h_q, case.device
    out_layout, lse_layout = {
        "contiguous": (((B, s, h, D_V), lambda t: t), ((B, h, s), lambda t: t)),
        "capacity": (((B + 3, s, h, D_V), lambda t: t[:B]), ((B + 3, h, s), lambda t: t[:B])),
        "tokens-first": (((B, s, h, D_V + 64), lambda t: t[..., :D_V]), ((B, s, h), lambda t: t.transpose(1, 2))),
        "heads-first": (((B, h, s, D_V), lambda t: t.transpose(1, 2)), ((h, B, s), lambda t: t.permute(1, 0, 2))),
    }[layout]
    bufs = {"out": OutBuffer("out", case.dtype, *out_layout, device=dev)}
    if with_lse:
        bufs["lse"] = OutBuffer("lse", torch.float32, *lse_layout, device=dev)
    return bufs


def _describe(t: torch.Tensor) -> str:
    return f"{dtype_name(t.dtype)} {tuple(t.shape)} strides {tuple(t.stride())}"


def _call_with_buffers(op, inp: OpInputs, given: dict, check: str):
    """decode(..., out=, lse=); a raise is the declaration's failure when the same call runs without the buffers
    (AssertionError), an error (BackendError) when it does not."""
    __tracebackhide__ = True
    w = where(op, inp.case, check)
    try:
        return op.decode(*inp.args(), **inp.kwargs(), **{n: b.view for n, b in given.items()})
    except Exception as exc:
        for buf in inp.buffers.values():
            buf.base.copy_(buf.snapshot)
        handed = ", ".join(f"{n}= {_describe(b.view)}" for n, b in given.items())
        try:
            op.decode(*inp.args(), **inp.kwargs())
        except Exception:
            raise BackendError(f"{w}: decode() raised {type(exc).__name__}: {exc} (with {handed}, and without "
                               "them)") from exc
        finally:
            for buf in inp.buffers.values():
                buf.base.copy_(buf.snapshot)
        raise AssertionError(failure(
            f"{w}: decode() raised {type(exc).__name__} when handed out= / lse= buffers, and ran without them",
            f"{type(exc).__name__}: {exc}", f"handed: {handed}",
            cause="the op declares out_buffers = True but rejects a legal preallocated buffer (FlashInfer #2856 / "
                  "#2876 rejected an out of [B, q_len, H, 512] at q_len > 1)")) from None


def _positions(mask: torch.Tensor) -> str:
    """(b, s) pairs of a [B, s_q] mask, shortened."""
    pairs = [tuple(int(i) for i in p) for p in mask.nonzero()]
    return ", ".join(map(str, pairs[:8])) + (f", ... ({len(pairs)} in all)" if len(pairs) > 8 else "")


def _unwritten_sentence(name: str, buf: OutBuffer) -> tuple[str, str, str] | None:
    missing = buf.unwritten()
    if not bool(missing.any()):
        return None
    per_query = missing.flatten(2).any(-1) if name == "out" else missing.any(1)        # [B, s_q]
    B, s_q = per_query.shape
    only_first = s_q > 1 and not bool(per_query[:, 0].any()) and bool(per_query[:, 1:].all())
    cause = ("only query position 0 of each row was written: a kernel that writes a multi-token out as if s_q "
             "were 1 (FlashInfer #2856 / #2876: a preallocated [B, q_len, H, 512] out at q_len > 1)"
             if only_first else "")
    return (f"the op left {int(missing.sum())} of {missing.numel()} elements of its {name} buffer unwritten (still the "
            f"suite's 0xFF fill)", f"buffer {_describe(buf.view)}; queries (b, s) = {_positions(per_query)}", cause)


def check_out_buffers(op, spec: Spec, layout: str, *, check: str, figures: dict) -> None:
    """decode into caller-owned buffers of ``layout``: inputs untouched; the returned out / lse are the buffers
    (same data_ptr, shape, strides); nothing of their allocations outside the views and no canary changed; every
    element of the views written; the values in the buffers right against the oracle."""
    __tracebackhide__ = True
    require_declared(op, "out_buffers", "decode into caller-owned out= / lse= buffers")
    case = require(op, spec.case)
    figures.update(case=case.describe(), check=check, op=op.name, buffer_layout=layout)
    inp = build(spec)
    given = out_buffers(case, layout, with_lse=declared(op, "returns_lse"))
    result = _call_with_buffers(op, inp, given, check)
    for buf in inp.buffers.values():
        buf.check(op, case, check)
    returned = dict(zip(("out", "lse"), validate(op, case, result, check)))
    w = where(op, case, check)
    for name, buf in given.items():
        got, v = returned[name], buf.view
        if got.data_ptr() != v.data_ptr() or tuple(got.shape) != tuple(v.shape) or got.stride() != v.stride():
            written = int((~buf.unwritten()).sum())
            raise AssertionError(failure(
                f"{w}: decode(..., {name}=) returned an {name} that is not the buffer it was handed",
                f"returned {_describe(got)} at 0x{got.data_ptr():x}; the buffer: {_describe(v)} at 0x{v.data_ptr():x}; "
                f"{written} of {v.numel()} of the buffer's elements written",
                "an op that declares out_buffers = True writes into the caller's buffer and returns it (a captured CUDA "
                "graph's consumers read the buffer; a new tensor is never seen)"))
    ref = oracle_of(spec)
    views = {n: b.view for n, b in given.items()}
    for name, buf in given.items():
        outside = buf.written_outside()
        if outside:
            raise AssertionError(failure(
                f"{w}: the op wrote {outside} of its {name} buffer",
                f"{_describe(buf.view)} ({layout}: {LAYOUTS[layout]}); the caller owns the rest of the allocation",
                cause=_strides_ignored(op, case, views, ref, figures)))
    for name, buf in given.items():
        missing = _unwritten_sentence(name, buf)
        if missing:
            head, detail, cause = missing
            raise AssertionError(failure(f"{w}: {head}", detail, cause=cause))
    try:
        compare(op, case, views["out"], views.get("lse"), ref[0], ref[1], check=check, figures=figures, oracle=ref,
                against="the float64 oracle (read from the out / lse buffers)")
    except AssertionError as exc:
        raise AssertionError(with_cause(str(exc), _strides_ignored(op, case, views, ref, figures))) from None


def _strides_ignored(op, case: OpCase, views: dict, ref, figures: dict) -> str:
    """'; likely cause: ... strides ignored' when the buffers' bytes, read as if they were contiguous from their
    first element, hold the right values."""
    if all(v.is_contiguous() for v in views.values()):
        return ""
    flat = {n: torch.as_strided(v, v.shape, v.contiguous().stride(), v.storage_offset()) for n, v in views.items()}
    try:
        compare(op, case, flat["out"], flat.get("lse"), ref[0], ref[1], check="", figures={}, oracle=ref)
    except AssertionError:
        return ""
    figures["likely_cause"] = "buffer strides ignored"
    return ("; likely cause: the op wrote its out / lse buffers as if they were contiguous (read that way from their "
            "first element, they hold the right values): their strides ignored")


# --------------------------------------------------------------------------- speculative verification


def engine_tables(inp: OpInputs, *, hidden_keys: bool = True) -> OpInputs:
    """The inputs with ``block_table`` and ``cache_seqlens`` the first B rows of tables of TABLE_ROWS_PER_ROW x B
    rows, as an engine's persistent tables are (legal: a tensor's storage past it is not part of it); the rows past
    B name the cache's spare pages, all NaN, with lengths that fill them (``hidden_keys``; else length 0). The keys
    are the spec's: its oracle holds."""
    case = inp.case
    bt = inp.tensor("block_table").cpu()
    B, width = bt.shape
    used = set(bt[bt != INVALID_BLOCK].tolist())
    spare = [i for i in range(inp.num_blocks) if i not in used][:width]
    assert spare, "engine_tables needs a spec with spare pages"
    rows = TABLE_ROWS_PER_ROW * B
    table = torch.full((rows, width), INVALID_BLOCK, dtype=torch.int32)
    table[:B], table[B:, :len(spare)] = bt, torch.tensor(spare, dtype=torch.int32)
    lens = torch.full((rows,), len(spare) * case.page_block_size if hidden_keys else 0, dtype=torch.int32)
    lens[:B] = inp.tensor("cache_seqlens").cpu()
    buffers = dict(inp.buffers)
    for name, value in (("block_table", table), ("cache_seqlens", lens)):
        buffers[name] = Buffer(name, value, device=case.device)
        buffers[name].view = buffers[name].view[:B]
    return dataclasses.replace(inp, buffers=buffers)


def _same_output_hint(op, spec: Spec, out, lse) -> tuple[str, str] | None:
    """Every query position of a row holding bitwise one (finite) output where the positions' keys differ (their
    causal key counts): the cause named, and the position whose oracle it is, if any."""
    case = spec.case
    if case.s_q < 2:
        return None
    o_out, o_lse, mags = oracle_of(spec)
    keys = mags["keys"][:, 0]                                                    # [B, s_q]
    got = out.detach().cpu()
    raw = got.contiguous().view(torch.uint8).view(*got.shape, got.element_size())
    tol = tolerance_for(case)[1]
    out_b, _ = bounds(tol, mags, o_out, o_lse, got.dtype)
    for b in range(case.batch):
        same = all(torch.equal(raw[b, i], raw[b, 0]) for i in range(1, case.s_q))
        if not same or not bool(torch.isfinite(got[b]).all()) or len(set(keys[b].tolist())) < 2:
            continue
        shared = got[b, 0].to(torch.float64)
        match = [i for i in range(case.s_q) if bool(((shared - o_out[b, i]).abs() <= out_b[b, i]).all())]
        it_is = f"; it is the oracle's output of position {match[0]}" if match else ""
        counts = ", ".join(str(int(k)) for k in keys[b])
        return "every query position shares one output", (
            f"; likely cause: every query position of row {b} has the same output (position 0's{it_is}), though "
            f"their keys differ (causal key counts {counts}): the op computes one output per row and gives it to all "
            f"{case.s_q} positions; each causal query position attends its own keys (query i: keys < cache_seqlens[b] "
            "- s_q + i + 1; ROCm aiter #2720: every position the same output when q_len is not a power of two)")
    return None


def _rows_past_b_hint(op, inp: OpInputs, out, check: str) -> tuple[str, str] | None:
    """Whether the op's result moves when the engine tables' rows past B change (their lengths set to 0): then it
    reads block_table / cache_seqlens rows past B."""
    other = engine_tables(build(inp.spec), hidden_keys=False)
    try:
        out2 = op.decode(*other.args(), **other.kwargs())[0].detach().cpu()
    except Exception:
        return None
    finally:
        for buf in other.buffers.values():
            buf.base.copy_(buf.snapshot)
    o_out, o_lse, mags = oracle_of(inp.spec)
    a = out.detach().cpu()
    out_b, _ = bounds(tolerance_for(inp.case)[1], mags, o_out, o_lse, a.dtype)
    a, b = a.to(torch.float64), out2.to(torch.float64)
    moved = (torch.isfinite(a) != torch.isfinite(b)) | ((a - b).abs() > out_b)
    if not bool(moved.any()):
        return None
    queries = moved.flatten(2).any(-1)                                          # [B, s_q]
    return "reads block-table rows past B", (
        f"; likely cause: the op reads block_table / cache_seqlens rows past the batch's B = {inp.case.batch}: they "
        f"are handed as the first B rows of larger tables (an engine's persistent ones), and setting the later rows' "
        f"lengths to 0 changes queries (b, s) = {_positions(queries)}; a causal multi-token batch flattened to "
        f"B x q_len query rows against B table rows (vLLM #51848 / #51065: Triton MLA indexes past the block table "
        "on speculative verification)")


def check_speculative(op, spec: Spec, *, check: str, figures: dict):
    """Causal multi-token decode over engine tables (:func:`engine_tables`) against the bottom-right oracle; a
    failure names the likely cause where one fits (top-left alignment, one output for every position, rows past
    B read)."""
    __tracebackhide__ = True
    inp = engine_tables(build(spec))
    hints = (lambda out, lse: _same_output_hint(op, spec, out, lse),
             lambda out, lse: _rows_past_b_hint(op, inp, out, check))
    return check_against_oracle(op, spec, check=check, figures=figures, inp=inp, hints=hints)


__all__ = ["LAYOUTS", "FILL_BYTE", "TABLE_ROWS_PER_ROW", "OutBuffer", "out_buffers", "check_out_buffers",
           "engine_tables", "check_speculative"]
