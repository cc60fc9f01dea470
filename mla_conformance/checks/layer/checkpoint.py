"""Checks on a checkpoint's real layer (seed 000's experiment), for suites/test_checkpoint.py: the layer-1
attention input and weights of the embedded tiny model ("fixture"), or of a real checkpoint (``--mla-checkpoint
DIR``), a 25-token prefill plus a 1-token decode through the backend, against the float64 reference."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from mla_conformance.checks.layer.driver import Scenario, require_support, run_scenario
from mla_conformance.checks.metrics import DTYPES, error_metrics, format_metrics
from mla_conformance.checks.tolerances import TOLERANCES
from mla_conformance.generation.generate import DEFAULT_MODEL, episodes, load_prompts
from mla_conformance.model.probe import layer1_input, layer1_weights, tokenize
from mla_conformance.model.reference import reference_attention_f64

SEED_PROMPT_SET = "seed-000"
#: the probe's sources: the embedded tiny model, and a real checkpoint (only with --mla-checkpoint)
PROBE_SOURCES = ["fixture", pytest.param("checkpoint", marks=pytest.mark.needs_checkpoint)]


def probe_source(request) -> tuple[str, str]:
    """(source, directory) of a ``PROBE_SOURCES`` fixture's parameter: the tiny model's directory, or
    ``--mla-checkpoint``."""
    if request.param == "fixture":
        return "fixture", str(DEFAULT_MODEL)
    return "checkpoint", str(request.config.getoption("--mla-checkpoint"))


@functools.lru_cache(maxsize=2)
def probe_inputs(directory: str, source: str):
    """(token ids, layer-1 attention input, layer-1 weights) of the seed prompt (the fixture: the first 26 tokens
    of the tiny-long prompts)."""
    if source == "fixture":
        ids = episodes(load_prompts(), ["tiny-long"])[0]["token_ids"][:26]
    else:
        seed = load_prompts()["sets"][SEED_PROMPT_SET][0]
        ids = tokenize(Path(directory), seed["text"])
    return ids, layer1_input(directory, ids), layer1_weights(directory)


def check_prefill_decode_on_checkpoint(backend, probe: tuple[str, str], dtype: str, device, figures: dict) -> None:
    """The probe's T - 1 tokens of prefill and one decode step within the dtype's tolerance of the float64
    reference (every token)."""
    __tracebackhide__ = True
    source, directory = probe
    ids, x, w = probe_inputs(directory, source)
    dt = DTYPES[dtype]
    require_support(backend, w.config, dtype=dt, device=device)
    T = len(ids)
    scenario = Scenario("seed000", (T - 1,), decode_steps=1)
    out, cache = run_scenario(backend, w.to(dt, device=device), x.to(torch.float64), scenario,
                              device=device, capacity=32)
    ref = reference_attention_f64(w, x.to(dt).to(torch.float64))
    m_all = error_metrics(out[0], ref[0])
    m_decode = error_metrics(out[0, -1], ref[0, -1])
    figures.update(source=source, tokens=T, dtype=dtype, active_nbytes=int(cache.active_nbytes()),
                   allocated_nbytes=int(cache.allocated_nbytes()), decode=m_decode, all_tokens=m_all)
    tol = TOLERANCES[dtype]
    assert m_all["rel_fro"] <= tol.rel_fro and m_all["max_rel"] <= tol.max_rel, (
        f"{backend.name} on {source} layer 1, {dtype}: {format_metrics(m_all)}")
