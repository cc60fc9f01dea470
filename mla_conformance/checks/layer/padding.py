"""The layer contract's padded batches (suites/test_layer_padding.py): what engines hand a layer that the
prefill + decode scenarios do not.

* **Idle rows** (:func:`idle_rows`): rows with ``lengths = 0`` in a running batch -- a sequence not started yet,
  one whose prompt is done while another row's chunked prefill goes on, one paused mid-decode, and a row that is
  never started (an empty slot of a batch padded to a captured size). ``lengths`` [B] counts each row's valid new
  tokens (right padding), so 0 is a count like any other: every backend is held to it, no declaration.
* **Multi-token steps** (:func:`multi_token_steps`): after the prefill, calls of S = 4 and 3 new tokens per row,
  right padded (rows with 1..S valid), as a speculative verify step hands them (vLLM #51848 / #51065: causal
  multi-token decode), then a one-token step.

Held on every call (:class:`CacheWatch`): ``seq_lens`` advances by exactly ``lengths`` (an idle row's stays);
``active_nbytes()`` covers the stored tokens, as the byte tests hold it; and, for a cache that preallocates its
storage (the same buffers before and after the call), the call changes no more token-storage bytes than its new
tokens take in the declared format -- so a token written for an idle row, or the padding of a short row, shows
(the row named where the buffer is [batch, ...]). A cache that grows (transformers' DynamicCache appends a slot
for every row of a call) is held on ``seq_lens`` and ``active_nbytes()`` only. Then every row's outputs against
the float64 reference (:func:`mla_conformance.checks.layer.numerics.check_rows`, with the likely cause), and for
idle rows the neighbours against the same rows run in a batch without idle rows, within the layer bound.
"""

from __future__ import annotations

import functools

import torch

from mla_conformance.checks.layer.bytes import format_bytes_per_token
from mla_conformance.checks.layer.driver import (Scenario, diagnosis, inputs_for, master_weights, require_support,
                                           run_scenario, scenario_lengths, weights_for)
from mla_conformance.checks.layer.numerics import check_rows, likely_cause_message, rows_failure, tolerance_key
from mla_conformance.checks.metrics import dtype_name, error_metrics, row_metrics
from mla_conformance.checks.tolerances import row_tolerance, tolerance_figures
from mla_conformance.contract.calls import call_backend, tensors_of_checked
from mla_conformance.contract.layer import cache_format_of
from mla_conformance.kv.caches.measure import bookkeeping_limit, is_bookkeeping
from mla_conformance.messages import failure
from mla_conformance.model.reference import reference_attention_f64

PRESET = "tiny"

#: rows 0-2 each active in four of five calls, row 3 never: call 1 a prefill with row 1 not started (and row 3
#: empty), call 2 a chunked prefill with row 2's prompt done, calls 3-4 decode steps with rows 2 and 0 paused
IDLE = Scenario.of_calls("idle_rows", ((6, 0, 5, 0), (3, 4, 1, 0), (1, 1, 0, 0), (0, 1, 1, 0), (1, 1, 1, 0)))
#: the same rows' tokens in the same calls with every idle entry taken out (rows 0-2, none of them ever idle)
IDLE_CONTROL = Scenario.of_calls("idle_rows_control", ((6, 4, 5), (3, 1, 1), (1, 1, 1), (1, 1, 1)))
#: a prefill, then speculative-verify steps of 4 and 3 tokens, right padded (1..S valid per row), then one token
MULTI = Scenario.of_calls("multi_token_steps", ((9, 5, 12, 7), (4, 1, 3, 2), (1, 3, 2, 3), (1, 1, 1, 1)))


def _int_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as integers of the same width (bitwise comparison; NaN equals itself)."""
    t = t.detach().contiguous()
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(t.element_size())
    return t.view(width) if width is not None and t.dtype != torch.bool else t.view(torch.uint8)


class CacheWatch:
    """What each attend() call did to the cache (the module docstring): run_scenario's ``watch``."""

    def __init__(self, backend, config, dtype, *, batch: int, capacity: int, figures: dict):
        self.backend, self.config, self.dtype = backend, config, dtype
        self.batch, self.capacity, self.figures = batch, capacity, figures
        self.stored = torch.zeros(batch, dtype=torch.int64)     # the tokens the suite handed each row so far
        figures.setdefault("cache_storage_checked", True)

    def __call__(self, cache, lengths: torch.Tensor, where: str):
        name = f"{self.backend.name} {PRESET} {dtype_name(self.dtype)} {where}"
        seq_before = self._seq_lens(cache, name)
        before = self._storage(cache, name)
        lengths = lengths.to("cpu", torch.int64)

        def after():
            __tracebackhide__ = True
            self.stored += lengths
            self._check_seq_lens(cache, seq_before, lengths, name)
            self._check_active(cache, name)
            self._check_storage(cache, before, lengths, name)
        return after

    def _seq_lens(self, cache, name) -> torch.Tensor:
        seq = getattr(cache, "seq_lens", None)
        if not isinstance(seq, torch.Tensor) or seq.shape != (self.batch,):
            raise AssertionError(f"{name}: cache.seq_lens is {seq!r}, not an int64 tensor [{self.batch}] (the contract)")
        return seq.detach().to("cpu", torch.int64).clone()

    def _check_seq_lens(self, cache, seq_before, lengths, name) -> None:
        __tracebackhide__ = True
        got = self._seq_lens(cache, name)
        bad = [b for b in range(self.batch) if int(got[b]) != int(seq_before[b] + lengths[b])]
        if not bad:
            return
        b = bad[0]
        S = int(lengths.max())
        if int(lengths[b]) == 0:
            what = (f"row {b} was idle (lengths 0) but its seq_lens went {int(seq_before[b])} -> {int(got[b])}: an idle "
                    "row's cache must not change (a row with lengths 0 appends nothing)")
        else:
            what = (f"row {b} got {int(lengths[b])} new token(s) (lengths) but its seq_lens went {int(seq_before[b])} "
                    f"-> {int(got[b])}: attend appends lengths[b] tokens, not the padded width"
                    + (f"; likely cause: the right padding counted as tokens (the call's width S = {S})"
                       if int(got[b] - seq_before[b]) == S else ""))
        raise AssertionError(failure(f"{name}: {what}",
                                     f"rows off: {bad}; lengths {lengths.tolist()}"))

    def _bytes_per_token(self, cache) -> int:
        return format_bytes_per_token(self.config, cache_format_of(self.backend, cache), self.dtype)

    def _bookkeeping(self, cache, tensors) -> tuple[int, set[str]]:
        limit = bookkeeping_limit(self.batch, self.capacity, getattr(cache, "page_block_size", None))
        book = {k for k, t in tensors.items() if is_bookkeeping(t, limit, self.batch, self.capacity)}
        return sum(tensors[k].numel() * tensors[k].element_size() for k in book), book

    def _check_active(self, cache, name) -> None:
        __tracebackhide__ = True
        tokens = int(self.stored.sum())
        per = self._bytes_per_token(cache)
        active = int(call_backend(cache, "active_nbytes"))
        book, _ = self._bookkeeping(cache, tensors_of_checked(call_backend(cache, "tensors"), name))
        if not tokens * per <= active <= tokens * per + book:
            raise AssertionError(failure(
                f"{name}: active_nbytes() says {active:,} B after this call but the {tokens} tokens the rows were "
                f"handed take {tokens * per:,} B" + (f" (+ at most {book:,} B of bookkeeping)" if book else ""),
                f"seq_lens {self.stored.tolist()}; {per} B per token in the declared format",
                cause=("an idle row (lengths 0) counted as holding a token"
                       if active > tokens * per + book and active - tokens * per - book <= per * self.batch else "")))

    def _storage(self, cache, name) -> dict[str, torch.Tensor]:
        tensors = tensors_of_checked(call_backend(cache, "tensors"), name)
        _, book = self._bookkeeping(cache, tensors)
        return {k: _int_view(t).cpu().clone() for k, t in tensors.items() if k not in book}

    def _check_storage(self, cache, before: dict[str, torch.Tensor], lengths, name) -> None:
        __tracebackhide__ = True
        after = self._storage(cache, name)
        if set(after) != set(before) or any(after[k].shape != before[k].shape for k in after):
            self.figures["cache_storage_checked"] = False   # a cache that grows: seq_lens and active_nbytes only
            return
        changed = {k: before[k] != after[k] for k in after}
        elem = {k: t.element_size() for k, t in after.items()}
        nbytes = {k: int(m.sum()) * elem[k] for k, m in changed.items() if bool(m.any())}
        per = self._bytes_per_token(cache)
        allowed = int(lengths.sum()) * per
        if sum(nbytes.values()) <= allowed:
            return
        idle = [b for b in range(self.batch) if int(lengths[b]) == 0]
        rows = sorted({b for k, m in changed.items() if m.dim() >= 1 and m.shape[0] == self.batch
                       for b in idle if bool(m[b].any())})
        cause = (f"the token storage of idle row(s) {rows} (lengths 0) changed: an idle row's cache must not change"
                 if rows else "a writer sets only the slots of each row's lengths[b] valid new tokens (an idle row "
                 "writes nothing; right padding is not a token)")
        raise AssertionError(failure(
            f"{name}: the call changed {sum(nbytes.values()):,} B of token storage but its {int(lengths.sum())} new "
            f"tokens take {allowed:,} B; {cause}",
            f"changed: {nbytes}; lengths {lengths.tolist()}; {per} B per token in the declared format"))


@functools.lru_cache(maxsize=8)
def _oracle(scenario: Scenario, dtype: torch.dtype) -> torch.Tensor:
    """The float64 reference of the scenario's inputs rounded to ``dtype`` (one causal row per sequence: how the
    tokens were split into calls does not change it)."""
    w = master_weights(PRESET, 0)
    x = inputs_for(w.config, scenario).to(dtype).to(torch.float64)
    return reference_attention_f64(w, x, scenario_lengths(scenario))


def _run_checked(backend, scenario: Scenario, dtype, device, figures, x=None):
    w = weights_for(PRESET, dtype, device)
    x = inputs_for(w.config, scenario) if x is None else x
    trace: dict = {}
    watch = CacheWatch(backend, w.config, dtype, batch=scenario.batch, capacity=x.shape[1], figures=figures)
    out, _ = run_scenario(backend, w, x, scenario, device=device, trace=trace, watch=watch)
    return w, x, out, trace


def same_output_cause(out: torch.Tensor, ref: torch.Tensor, calls, figures: dict) -> str:
    """'; likely cause: ...' when, in a multi-token call over a filled row, every valid position of the row got the
    same output while the reference's differ (ROCm aiter #2720: every query position the same output)."""
    for c, (start, n) in enumerate(calls):
        for b in range(out.shape[0]):
            a, k = int(start[b]), int(n[b])
            if a == 0 or k < 2:
                continue
            got, want = out[b, a:a + k], ref[b, a:a + k]
            scale = float(want.pow(2).mean().sqrt()) or 1.0
            if float((got - got[:1]).abs().max()) <= 1e-6 * scale < float((want - want[:1]).abs().max()):
                figures["likely_cause"] = "every query position of a multi-token step gets the same output"
                return (f"; likely cause: every query position of a multi-token step gets the same output (row {b}, "
                        f"call {c + 1}: positions {a}..{a + k - 1} equal, the reference's differ; ROCm aiter #2720): "
                        "query i of a step sees the keys up to its own position")
    return ""


def _check_reference(backend, w, x, out, trace, scenario: Scenario, dtype, figures, detail) -> None:
    __tracebackhide__ = True
    lengths = scenario_lengths(scenario)
    ref = _oracle(scenario, dtype)
    valid = torch.arange(x.shape[1])[None, :] < lengths[:, None]
    m = error_metrics(out[valid], ref[valid])
    figures.update(m)
    x64 = x.to(dtype).to(torch.float64)
    check_rows(out, ref, lengths, dtype, where=f"{backend.name} {PRESET} {scenario.name} {dtype_name(dtype)}",
               figures=figures, detail=detail,
               cause=lambda tol: (same_output_cause(out, ref, trace["calls"], figures)
                                  or likely_cause_message(out, master_weights(PRESET, 0), x64, lengths, trace["calls"],
                                                          correct=m["rel_fro"], tol=tol, figures=figures))
               + diagnosis(backend, w))


def _calls_of(scenario: Scenario, b: int) -> str:
    return ", ".join(str(c[b]) for c in scenario.schedule)


def idle_rows(backend, dtype: torch.dtype = torch.float32, device="cpu", figures: dict | None = None) -> None:
    """:data:`IDLE` (the module docstring): each call's cache changes, the neighbours against :data:`IDLE_CONTROL`
    within the layer bound, every row against the float64 reference."""
    __tracebackhide__ = True
    figures = {} if figures is None else figures
    w = weights_for(PRESET, dtype, device)
    require_support(backend, w.config, dtype=dtype, device=device)
    w, x, out, trace = _run_checked(backend, IDLE, dtype, device, figures)
    rows = [b for b in range(IDLE.batch) if IDLE.total(b)]
    control = run_scenario(backend, w, x[rows], IDLE_CONTROL, device=device)[0]
    where = f"{backend.name} {PRESET} {IDLE.name} {dtype_name(dtype)}"
    worst = 0.0
    for j, b in enumerate(rows):
        n = IDLE.total(b)
        tol = row_tolerance(dtype_name(dtype), elements=n * int(out.shape[-1]), keys=n)
        mb = row_metrics(out[b, :n], control[j, :n])
        worst = max(worst, mb["rel_fro"] / tol.rel_fro)
        if not (mb["rel_fro"] <= tol.rel_fro and mb["max_rel"] <= tol.max_rel):
            figures.update(tolerance_figures(tol))
            at = int((out[b, :n] - control[j, :n]).abs().amax(-1).argmax())
            raise AssertionError(rows_failure(
                f"{where}: row {b}'s outputs differ from the same row run in a batch without idle rows", mb, tol,
                f"worst token at position {at} of {n}",
                f"its calls' new tokens: {_calls_of(IDLE, b)}; the batch's: {[list(c) for c in IDLE.schedule]}",
                cause="the idle rows (lengths 0) change their neighbours (an output written back to the wrong row, a "
                      "batch-wide length or mask)", key=tolerance_key(dtype)))
    figures["neighbours_over_tolerance"] = worst
    _check_reference(backend, w, x, out, trace, IDLE, dtype, figures,
                     detail=lambda b: f" (its calls' new tokens: {_calls_of(IDLE, b)}; 0 = idle)")


def multi_token_steps(backend, dtype: torch.dtype = torch.float32, device="cpu", figures: dict | None = None) -> None:
    """:data:`MULTI` (the module docstring): each call's cache changes, every row against the float64 reference."""
    __tracebackhide__ = True
    figures = {} if figures is None else figures
    w = weights_for(PRESET, dtype, device)
    require_support(backend, w.config, dtype=dtype, device=device)
    w, x, out, trace = _run_checked(backend, MULTI, dtype, device, figures)
    _check_reference(backend, w, x, out, trace, MULTI, dtype, figures,
                     detail=lambda b: f" (its calls' new tokens: {_calls_of(MULTI, b)}, right padded to each call's S)")


__all__ = ["IDLE", "IDLE_CONTROL", "MULTI", "CacheWatch", "idle_rows", "multi_token_steps", "same_output_cause"]
