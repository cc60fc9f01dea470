"""Graph-replay-shaped calls (suites/test_op_replay.py): an engine captures a decode step in a CUDA graph once and
replays it on the *same* tensors -- the same storage, shapes sized for its largest batch -- refilled in place with
every step's batch, smaller ones padded up with rows of cache_seqlens 0 whose block-table rows, queries (and
sparse indices, -1 then) are whatever the engine left there. :class:`Replay` says the batches; :func:`check_replay`
refills one set of canaried buffers of its own (not the cached, shared ones of :func:`build`) before each call and
holds each call's result to what a fresh call on that batch gives: the float64 oracle of the tensors as they are
at that call, and bitwise a fresh call on copies of them (new storage) where the op declares ``deterministic``.
A result that misses the oracle while a fresh call on copies matches it is state kept from an earlier call, and
the message says which earlier batch's lengths and block table the result is what of, where it is (xLLM #1939;
a plan keyed on the tensors' storage or identity).

Between batches a page no row uses any more keeps its stale contents (an engine frees pages, it does not clear
them); the unwritten tail of each row's last page and the pages never written are NaN.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from mla_conformance.checks.op.compare import bitwise_equal, compare, oracle_of_inputs
from mla_conformance.checks.op.inputs import (INVALID_BLOCK, SOFTMAX_SCALE, Buffer, OpInputs, Spec,
                                              kinds_of_rows_without_keys)
from mla_conformance.checks.op.padding import real_rows_only
from mla_conformance.checks.op.run import run_op
from mla_conformance.contract.op import D_QK, OpCase, declared
from mla_conformance.impl.ops.reference import encode_fp8_656
from mla_conformance.messages import with_cause


@dataclasses.dataclass(frozen=True)
class Replay:
    """A graph-replay sequence: ``case`` the captured shape (``batch`` rows: the largest batch), ``batches`` each
    call's row lengths (0: a padding row), ``spare`` pages of the pool beyond the largest batch's."""

    case: OpCase
    batches: tuple[tuple[int, ...], ...]
    seed: int = 40
    scale_format: str = "pow2"
    spare: int = 6


class ReplayBuffers:
    """The one set of tensors every call of a :class:`Replay` is handed, refilled in place per batch."""

    def __init__(self, r: Replay):
        case = r.case
        page = case.page_block_size
        self.r, self.page = r, page
        self.g = torch.Generator().manual_seed(r.seed)
        pages = lambda lens: [-(-L // page) for L in lens]
        self.width = max(max(pages(lens)) for lens in r.batches) + 1
        self.num_blocks = max(sum(pages(lens)) for lens in r.batches) + r.spare
        fp8 = case.kv_format == "fp8-e4m3-flashmla"
        self.row_bytes = 656 if fp8 else D_QK
        B, dev = case.batch, case.device
        kv = torch.full((self.num_blocks, page, 1, self.row_bytes), 0xFF, dtype=torch.uint8) if fp8 else \
            torch.full((self.num_blocks, page, 1, D_QK), math.nan, dtype=case.dtype)
        tensors = {"q": torch.zeros(B, case.s_q, case.h_q, D_QK, dtype=case.dtype), "kv_cache": kv,
                   "block_table": torch.full((B, self.width), INVALID_BLOCK, dtype=torch.int32),
                   "cache_seqlens": torch.zeros(B, dtype=torch.int32)}
        if case.sparse:
            tensors["indices"] = torch.full((B, case.s_q, case.topk), -1, dtype=torch.int32)
            tensors["topk_length"] = torch.zeros(B, dtype=torch.int32)
        self.buffers = {n: Buffer(n, t, device=dev) for n, t in tensors.items()}
        self.history: list[dict[str, torch.Tensor]] = []  # per call: its block table and lengths, as handed over

    def refill(self, k: int) -> OpInputs:
        """Batch k written into the buffers in place (each buffer's snapshot taken again after); the inputs of
        its call, on the same storage as every other call's."""
        r, page, g = self.r, self.page, self.g
        lens = r.batches[k]
        v = {n: b.view for n, b in self.buffers.items()}
        flat = v["kv_cache"].view(self.num_blocks * page, self.row_bytes)
        perm = torch.randperm(self.num_blocks, generator=g)
        used, slots = 0, []
        for b, L in enumerate(lens):
            if L == 0:  # a padding row: length 0, the rest left as the engine left it
                v["cache_seqlens"][b] = 0
                if r.case.sparse:
                    v["indices"][b] = -1
                    v["topk_length"][b] = 0
                slots.append(torch.zeros(0, dtype=torch.long))
                continue
            n = -(-L // page)
            ids = perm[used:used + n]
            used += n
            v["block_table"][b] = INVALID_BLOCK
            v["block_table"][b, :n] = ids.to(torch.int32)
            v["cache_seqlens"][b] = L
            pos = torch.arange(n * page)
            row_slots = ids[pos // page] * page + pos % page
            lat = torch.randn(L, D_QK, generator=g, dtype=torch.float64)
            rows = encode_fp8_656(lat, r.scale_format) if self.row_bytes == 656 else lat.to(r.case.dtype)
            flat[row_slots[:L]] = rows.to(flat.device)
            flat[row_slots[L:]] = 0xFF if self.row_bytes == 656 else math.nan   # the last page's unwritten tail
            slots.append(row_slots[:L])
            v["q"][b] = torch.randn(r.case.s_q, r.case.h_q, D_QK, generator=g, dtype=torch.float64).to(r.case.dtype)
        if r.case.sparse:
            written = torch.cat(slots)
            for b, L in enumerate(lens):
                if L:
                    pick = written[torch.randperm(written.numel(), generator=g)[:r.case.topk]]
                    v["indices"][b] = pick.to(torch.int32).view(1, -1).expand(r.case.s_q, -1)
                    v["topk_length"][b] = r.case.topk
        for buf in self.buffers.values():
            buf.snapshot = buf.base.clone()
        self.history.append({n: v[n].detach().cpu().clone() for n in ("block_table", "cache_seqlens", "indices",
                                                                        "topk_length") if n in v})
        pads = sum(1 for L in lens if L == 0)
        kinds = kinds_of_rows_without_keys(lens, r.case.s_q, r.case.causal, r.case.sparse)
        case = dataclasses.replace(r.case, padding_rows=pads, rows_without_keys=any(kinds.values()) or bool(pads),
                                   **kinds)
        return OpInputs(Spec(case, tuple(lens)), self.buffers, SOFTMAX_SCALE, [], slots, self.num_blocks)


def describe_batch(lens) -> str:
    real = [b for b, L in enumerate(lens) if L]
    return f"{len(real)} real rows {tuple(lens[b] for b in real)} padded to {len(lens)}"


def check_replay(op, r: Replay, *, check: str, figures: dict) -> None:
    """Every batch of ``r`` through one set of buffers; each call held to the oracle of its batch and, where the op
    declares deterministic, bitwise to a fresh call on copies of its inputs."""
    __tracebackhide__ = True
    bufs = ReplayBuffers(r)
    deterministic = bool(declared(op, "deterministic"))
    figures.update(op=op.name, check=check, case=r.case.describe(), replay_calls=len(r.batches),
                   replay_batches=[sum(1 for L in lens if L) for lens in r.batches], replay_bitwise=deterministic)
    keep = []   # the fresh calls' tensors, alive to the end: a freed one's address may come back to a later one
    for k, lens in enumerate(r.batches):
        inp = bufs.refill(k)
        pads = [b for b, L in enumerate(lens) if L == 0]
        label = f"{check}, call {k + 1} of {len(r.batches)}: {describe_batch(lens)}"
        ref = oracle_of_inputs(inp)
        out, lse = run_op(op, inp, label)
        fresh = None
        try:
            compare(op, inp.case, *real_rows_only(op, out, lse, pads), ref[0], ref[1], check=label, figures=figures,
                    oracle=ref)
        except AssertionError as exc:
            fresh = _fresh(op, inp, label, keep)
            raise AssertionError(with_cause(str(exc), _kept_state(op, bufs, inp, k, (out, lse), fresh, ref))) from None
        if deterministic:
            fresh = _fresh(op, inp, label, keep)
            bitwise_equal(op, inp.case, (out, lse), fresh, check=label,
                          what=f"declares deterministic = True but call {k + 1} on the refilled tensors and a fresh "
                               "call on copies of them (new storage) differ (state kept between calls?)",
                          figures=figures)


def _fresh(op, inp: OpInputs, label: str, keep: list):
    copy = inp.derive(**{n: b.view.detach().cpu().clone() for n, b in inp.buffers.items()})
    keep.append(copy)
    return run_op(op, copy, label + " (a fresh call on copies)")


def _kept_state(op, bufs: ReplayBuffers, inp: OpInputs, k: int, got, fresh, ref) -> str:
    """'; ...' naming state kept from an earlier call when a fresh call on copies of the inputs passes, and which
    earlier batch's lengths and block table the result is what of."""
    pads = [b for b, L in enumerate(inp.spec.lens) if L == 0]
    try:
        compare(op, inp.case, *real_rows_only(op, *fresh, pads), ref[0], ref[1], check="fresh", figures={},
                oracle=ref)
    except AssertionError:
        return ""
    said = ""
    for j in range(k):
        old = bufs.history[j]
        then = inp.derive(**old)
        try:
            stale = oracle_of_inputs(then)
            compare(op, inp.case, *real_rows_only(op, *got, pads), stale[0], stale[1], check="stale", figures={},
                    oracle=stale)
        except AssertionError:
            continue
        kept = "indices and topk_length" if inp.case.sparse else "block table"
        said = (f"; it is what call {j + 1}'s cache_seqlens {tuple(int(x) for x in old['cache_seqlens'])} and {kept} "
                f"give on call {k + 1}'s queries and cache")
        break
    return (f"; a fresh call on copies of the same inputs (new tensors) matches the oracle: the result of call "
            f"{k + 1} carries state the op kept from an earlier call on these tensors{said} (a plan or metadata "
            "keyed on the tensors' storage (data_ptr) or identity is stale once an engine refills them for the next "
            "graph replay)")
