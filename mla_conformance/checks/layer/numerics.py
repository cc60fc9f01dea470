"""The layer backend's numerics: its outputs against the float64 expanded reference of the same weights and inputs
(:func:`numerics`, row by row, naming a known bug class when its oracle matches better), and incremental decode
against one prefill (:func:`incremental_equals_prefill`), each row to the dtype's row of TOLERANCES grown with the
row (:func:`mla_conformance.checks.tolerances.row_tolerance`: its length and its number of values)."""

from __future__ import annotations

import functools

import torch

from mla_conformance.checks.layer import diagnose
from mla_conformance.checks.layer.driver import (SCENARIOS, Scenario, diagnosis, inputs_for, master_weights, require_support,
                                           run_scenario, scenario_lengths, weights_for)
from mla_conformance.checks.metrics import dtype_name, error_metrics, margin, row_metrics
from mla_conformance.checks.tolerances import Tolerance, row_tolerance, tolerance_figures
from mla_conformance.messages import bound_line, failure, over
from mla_conformance.model.reference import reference_attention_f64

#: the presets the numerics tests run (suites/test_numerics.py's docstring says why these)
NUMERICS_PRESETS = ["tiny", "deepseek-v2-lite", "v3-mini"]

def numerics(backend, preset: str, scenario_name: str, dtype: torch.dtype, device="cpu",
             tolerance: Tolerance | None = None, figures: dict | None = None) -> dict[str, float]:
    """Backend output vs the float64 expanded reference; returns the metrics, raises on violation.

    ``figures`` (a dict) receives the metrics and the tolerance before any failure is raised, so a
    failing test still reports what it measured."""
    __tracebackhide__ = True
    figures = {} if figures is None else figures
    scenario = SCENARIOS[scenario_name]
    w = weights_for(preset, dtype, device)
    x = inputs_for(w.config, scenario)
    require_support(backend, w.config, dtype=dtype, device=device)
    trace: dict = {}
    out, _ = run_scenario(backend, w, x, scenario, device=device, trace=trace)
    lengths = scenario_lengths(scenario)
    x64 = x.to(dtype).to(torch.float64)
    ref = _oracle(preset, scenario_name, dtype)
    valid = torch.arange(x.shape[1])[None, :] < lengths[:, None]
    m = error_metrics(out[valid], ref[valid])
    figures.update(m)
    where = f"{backend.name} {preset} {scenario_name} {dtype_name(dtype)}"
    # per-row check too, so a bug confined to one row cannot hide in the batch average
    check_rows(out, ref, lengths, dtype, where=where, figures=figures, tolerance=tolerance,
               cause=lambda tol: likely_cause_message(out, master_weights(preset, 0), x64, lengths, trace["calls"],
                                                      correct=m["rel_fro"], tol=tol, figures=figures)
               + diagnosis(backend, w))
    return m


def row_tolerance_of(dtype: torch.dtype, out: torch.Tensor, lengths: torch.Tensor, b: int,
                     tolerance: Tolerance | None = None) -> Tolerance:
    """Row b's bounds: ``tolerance`` when given (a caller's own), else :func:`row_tolerance` of the dtype for its
    values (tokens x hidden) and its length (the keys its last token sees)."""
    if tolerance is not None:
        return tolerance
    tokens = int(lengths[b])
    return row_tolerance(dtype_name(dtype), elements=tokens * int(out.shape[-1]), keys=tokens)


def check_rows(out: torch.Tensor, ref: torch.Tensor, lengths: torch.Tensor, dtype: torch.dtype, *, where: str,
               figures: dict, cause=lambda tol: "", tolerance: Tolerance | None = None, detail=lambda b: "") -> None:
    """Each row of ``out`` [B, T, hidden] against ``ref`` on its first lengths[b] tokens within its own bounds
    (:func:`row_tolerance_of`): rel_fro and max_abs / rms. ``figures`` gets the bounds of the row closest to
    them (tolerance_rel_fro, tolerance_max_rel) and margin_rel_fro (that rel_fro bound over the whole output's
    ``rel_fro`` figure, when recorded). A failure's message names the row, both metrics and bounds and the
    worst token, then ``detail(b)`` and ``cause(tol)`` (called only then: a likely cause, a diagnosis)."""
    __tracebackhide__ = True
    closest = None
    for b in range(out.shape[0]):
        n = int(lengths[b])
        if n == 0:
            continue
        tol = row_tolerance_of(dtype, out, lengths, b, tolerance)
        mb = row_metrics(out[b, :n], ref[b, :n])
        closeness = max(mb["rel_fro"] / tol.rel_fro, mb["max_rel"] / tol.max_rel)
        if closest is None or closeness > closest[0]:
            closest = (closeness, tol)
        if not (mb["rel_fro"] <= tol.rel_fro and mb["max_rel"] <= tol.max_rel):
            _record(figures, tol)
            at = int((out[b, :n] - ref[b, :n]).abs().amax(-1).argmax())
            raise AssertionError(rows_failure(f"{where}: row {b} differs from the float64 reference", mb, tol,
                                              f"worst token at position {at} of {n}", detail(b).strip(),
                                              cause=cause(tol), key=tolerance_key(dtype, tolerance)))
    if closest is not None:
        _record(figures, closest[1])


def tolerance_key(dtype: torch.dtype, tolerance: Tolerance | None = None) -> str:
    """The key a failure names its bound by in docs/tolerances.md: the dtype's row of TOLERANCES, grown per row."""
    return "a caller's own tolerance" if tolerance is not None else \
        f'TOLERANCES["{dtype_name(dtype)}"], grown per row (row_tolerance)'


def rows_failure(what: str, m: dict, tol: Tolerance, where: str, *details: str, cause: str = "", key: str) -> str:
    """A row's failure: ``what`` and the metric furthest over its bound (rel_fro or max_abs / rms) against it and
    how many times, ``where`` its worst token is; the likely cause; the other metric and the bound's key."""
    metrics = [("rel_fro", m["rel_fro"], tol.rel_fro), ("max_abs/rms", m["max_rel"], tol.max_rel)]
    worst = max(metrics, key=lambda x: x[1] / x[2] if x[2] else float("inf"))
    other = next(x for x in metrics if x is not worst)
    return failure(f"{what}: {worst[0]} {over(worst[1], worst[2])} ({where})", *details,
                   f"{other[0]} {over(other[1], other[2])}", bound_line(key), cause=cause)


def _record(figures: dict, tol: Tolerance) -> None:
    figures.update(tolerance_figures(tol))
    if figures.get("rel_fro"):
        figures.update(margin_rel_fro=margin(figures["rel_fro"], tol.rel_fro))


@functools.lru_cache(maxsize=32)
def _oracle(preset: str, scenario_name: str, dtype: torch.dtype) -> torch.Tensor:
    """The float64 reference of a scenario's inputs rounded to ``dtype``: computed once per session."""
    scenario = SCENARIOS[scenario_name]
    w = master_weights(preset, 0)
    x = inputs_for(w.config, scenario).to(dtype).to(torch.float64)
    return reference_attention_f64(w, x, scenario_lengths(scenario))


def likely_cause_message(out, weights64, x64, lengths, calls, *, correct: float, tol: Tolerance,
                         figures: dict) -> str:
    """'; likely cause: ...' when an oracle of a known bug class matches the output far better."""
    found = diagnose.likely_cause(out, weights64, x64, lengths, calls, correct_rel_fro=correct,
                                  tolerance_rel_fro=tol.rel_fro)
    if not found:
        return ""
    figures["likely_cause"] = diagnose.format_cause(found)
    return "; " + figures["likely_cause"]


def incremental_equals_prefill(backend, preset: str, dtype: torch.dtype, device="cpu", *, prefill=12,
                               decode=8, figures: dict | None = None) -> dict[str, float]:
    """Prefill P then D single-token steps == one prefill of P + D tokens (same tokens)."""
    __tracebackhide__ = True
    figures = {} if figures is None else figures
    w = weights_for(preset, dtype, device)
    require_support(backend, w.config, dtype=dtype, device=device)
    inc = Scenario("incremental", (prefill,), decode_steps=decode)
    one = Scenario("one-shot", (prefill + decode,))
    x = inputs_for(w.config, one)
    out_inc, _ = run_scenario(backend, w, x, inc, device=device)
    out_one, _ = run_scenario(backend, w, x, one, device=device)
    m = error_metrics(out_inc, out_one)
    tol = row_tolerance(dtype_name(dtype), elements=out_one[0].numel(), keys=prefill + decode)
    figures.update(m)
    figures.update(tolerance_figures(tol))
    if not (m["rel_fro"] <= tol.rel_fro and m["max_rel"] <= tol.max_rel):
        worst = int((out_inc[0] - out_one[0]).abs().amax(-1).argmax())
        raise AssertionError(rows_failure(
            f"{backend.name} {preset} {dtype_name(dtype)}: prefill {prefill} + {decode} decode steps differs from one "
            f"{prefill + decode}-token prefill", m, tol, f"worst at position {worst}", key=tolerance_key(dtype)))
    return m
