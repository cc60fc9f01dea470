"""The layer backend's numerics: its outputs against the float64 expanded reference of the same weights and inputs
(:func:`numerics`, row by row, naming a known bug class when its oracle matches better), and incremental decode
against one prefill (:func:`incremental_equals_prefill`), to the dtype's row of TOLERANCES."""

from __future__ import annotations

import functools

import torch

from mla_conformance.checks import diagnose
from mla_conformance.checks.driver import (SCENARIOS, Scenario, diagnosis, inputs_for, master_weights, require_support,
                                           run_scenario, scenario_lengths, weights_for)
from mla_conformance.checks.metrics import dtype_name, error_metrics, margin, row_metrics
from mla_conformance.checks.tolerances import TOLERANCES, Tolerance, tolerance_figures
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
    tol = tolerance or TOLERANCES[dtype_name(dtype)]
    figures.update(m)
    figures.update(tolerance_figures(tol),
                   margin_rel_fro=margin(m["rel_fro"], tol.rel_fro) if m["rel_fro"] else None)
    where = f"{backend.name} {preset} {scenario_name} {dtype_name(dtype)}"
    # per-row check too, so a bug confined to one row cannot hide in the batch average
    for b in range(scenario.batch):
        mb = row_metrics(out[b, : lengths[b]], ref[b, : lengths[b]])
        if not (mb["rel_fro"] <= tol.rel_fro and mb["max_rel"] <= tol.max_rel):
            worst = int((out[b, : lengths[b]] - ref[b, : lengths[b]]).abs().amax(-1).argmax())
            cause = likely_cause_message(out, master_weights(preset, 0), x64, lengths, trace["calls"],
                                         correct=m["rel_fro"], tol=tol, figures=figures)
            raise AssertionError(
                f"{where}: row {b} differs from the float64 reference beyond the {dtype_name(dtype)} tolerance: "
                f"rel_fro {mb['rel_fro']:.3e} (tolerance {tol.rel_fro:g}), max_abs/rms {mb['max_rel']:.3e} "
                f"(tolerance {tol.max_rel:g}); worst token at position {worst} of {int(lengths[b])}"
                f"{cause}{diagnosis(backend, w)}")
    return m


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
    tol = TOLERANCES[dtype_name(dtype)]
    figures.update(m)
    figures.update(tolerance_figures(tol))
    if not (m["rel_fro"] <= tol.rel_fro and m["max_rel"] <= tol.max_rel):
        worst = int((out_inc[0] - out_one[0]).abs().amax(-1).argmax())
        raise AssertionError(f"{backend.name} {preset} {dtype_name(dtype)}: prefill {prefill} + {decode} decode "
                             f"steps differs from one {prefill + decode}-token prefill: rel_fro {m['rel_fro']:.3e} "
                             f"(tolerance {tol.rel_fro:g}), max_abs/rms {m['max_rel']:.3e} (tolerance "
                             f"{tol.max_rel:g}); worst at position {worst}")
    return m
