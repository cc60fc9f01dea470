"""Conventions the published DeepSeek code bases disagree on, for suites/test_conventions.py (its docstring says
why): stated and recorded, not imposed. YaRN's cos/sin factor with ``mscale != mscale_all_dim``: a backend passes
when it matches either float64 oracle (``mla_conformance.schema.ROPE_CONVENTIONS``), and the figures say
which."""

from __future__ import annotations

import torch

from mla_conformance.checks.layer import diagnose
from mla_conformance.checks.layer.driver import (Scenario, diagnosis, inputs_for, require_support, run_scenario,
                                           scenario_lengths)
from mla_conformance.checks.metrics import error_metrics
from mla_conformance.checks.tolerances import TOLERANCES
from mla_conformance.messages import bound_line, failure, over
from mla_conformance.model.config import MLAConfig
from mla_conformance.model.reference import reference_attention_f64
from mla_conformance.model.weights import MLAWeights
from mla_conformance.schema import ROPE_CONVENTIONS

#: tiny-sized, q_lora + YaRN from 16 positions, mscale (1.0) != mscale_all_dim (0.8): cos/sin factor 1.025
MSCALE_SPLIT = MLAConfig(hidden_size=64, num_attention_heads=2, q_lora_rank=32, kv_lora_rank=32,
                         qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                         rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                       "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8},
                         max_position_embeddings=64)

#: one varlen batch (rows of 34 and 19 prefill tokens) and 6 decode steps: positions 0..39, past 16
SCENARIO = Scenario("mscale_split", (34, 19), decode_steps=6)


def check_yarn_rope_attention_factor_convention(backend, device, figures: dict) -> None:
    """The backend on MSCALE_SPLIT (float32) matches the transformers or the DeepSeek-V3 RoPE convention within the
    float32 tolerance; ``figures["rope_convention"]`` says which ("neither": a failure)."""
    __tracebackhide__ = True
    dtype = torch.float32
    tol = TOLERANCES["float32"]
    w64 = MLAWeights.random(MSCALE_SPLIT, seed=3, dtype=torch.float64)
    w = w64.to(dtype, device=device)
    x = inputs_for(MSCALE_SPLIT, SCENARIO, seed=4)
    require_support(backend, MSCALE_SPLIT, dtype=dtype, device=device)
    trace: dict = {}
    out, _ = run_scenario(backend, w, x, SCENARIO, device=device, trace=trace)
    lengths = scenario_lengths(SCENARIO)
    x_in = x.to(dtype).to(torch.float64)

    errors = {}  # convention -> (worst row's rel_fro, worst row's max_rel)
    refs = {}
    for convention in ROPE_CONVENTIONS:
        refs[convention] = ref = reference_attention_f64(w64, x_in, lengths, rope_convention=convention)
        rows = [error_metrics(out[b, : lengths[b]], ref[b, : lengths[b]]) for b in range(SCENARIO.batch)]
        errors[convention] = (max(m["rel_fro"] for m in rows), max(m["max_rel"] for m in rows))
    figures["rel_fro_transformers"] = errors["transformers"][0]
    figures["rel_fro_deepseek_v3"] = errors["deepseek-v3"][0]

    # the two oracles must be far apart on this config, or the verdict below would mean nothing
    valid = torch.arange(x.shape[1])[None, :] < lengths[:, None]
    apart = error_metrics(refs["deepseek-v3"][valid], refs["transformers"][valid])["rel_fro"]
    assert apart > 100 * tol.rel_fro, f"the two RoPE conventions differ by only rel_fro={apart:.2e} on this config"

    matches = [c for c, (fro, mx) in errors.items() if fro <= tol.rel_fro and mx <= tol.max_rel]
    if matches:
        figures["rope_convention"] = min(matches, key=lambda c: errors[c][0])
        return
    figures["rope_convention"] = "neither"
    found = _other_bug(out, w64, x_in, lengths, trace["calls"], errors, tol)
    said = "matches neither RoPE convention"
    cause = ""
    if found:
        convention, text = found
        said = "matches neither RoPE convention's oracle"
        figures["likely_cause"] = text
        cause = (f"not a RoPE-convention mismatch: under the {convention} convention the output {text} -- a bug "
                 "of its own, which the numerics tests name too")
    closest = min(errors, key=lambda c: errors[c][0] / tol.rel_fro)
    raise AssertionError(failure(
        f"{backend.name}: the output {said} (YaRN, mscale != mscale_all_dim): rel_fro "
        f"{over(errors[closest][0], tol.rel_fro)} (closer: {closest})",
        f"transformers / DeepSeek-V2 modeling rel_fro={errors['transformers'][0]:.3e} "
        f"max_rel={errors['transformers'][1]:.3e}; DeepSeek-V3 reference rel_fro={errors['deepseek-v3'][0]:.3e} "
        f"max_rel={errors['deepseek-v3'][1]:.3e} (cos/sin factor {MSCALE_SPLIT.rope_attention_factor:.4f} under "
        "transformers' convention)",
        bound_line('TOLERANCES["float32"]', f"rel_fro <= {tol.rel_fro:g}, max_abs/rms <= {tol.max_rel:g}"),
        cause=cause + diagnosis(backend, w)))


def _other_bug(out, w64, x64, lengths, calls, errors: dict, tol) -> tuple[str, str] | None:
    """(RoPE convention, "matches the reference without YaRN mscale² ...") when, under one of the two conventions,
    the output matches a known bug class's oracle (mla_conformance.checks.layer.diagnose) far better than the correct
    one -- the best such match -- else None."""
    best = None
    for convention in ROPE_CONVENTIONS:
        found = diagnose.likely_cause(out, w64, x64, lengths, calls, correct_rel_fro=errors[convention][0],
                                      tolerance_rel_fro=tol.rel_fro, rope_convention=convention)
        if found and (best is None or found["rel_fro"] < best[1]["rel_fro"]):
            best = (convention, found)
    if best is None:
        return None
    return best[0], diagnose.format_cause(best[1]).removeprefix("likely cause: ")
