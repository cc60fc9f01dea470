"""Seed 000's experiment on a checkpoint: the real layer-1 attention input and weights, 25-token prefill
plus 1-token decode through each backend, byte and error tables (BF16 and the FP32 audit).

CI proves the path on the embedded tiny model (same tensor names as DeepSeek-V2-Lite); a real
checkpoint runs with ``--mla-checkpoint DIR``.
"""

import functools
from pathlib import Path

import pytest
import torch

from mla_conformance import checks
from mla_conformance.generation.generate import DEFAULT_MODEL, episodes, load_prompts
from mla_conformance.model.probe import layer1_input, layer1_weights, tokenize
from mla_conformance.model.reference import reference_attention_f64

SEED_PROMPT_SET = "seed-000"


@functools.lru_cache(maxsize=2)
def probe_inputs(directory: str, source: str):
    if source == "fixture":
        ids = episodes(load_prompts(), ["tiny-long"])[0]["token_ids"][:26]
    else:
        seed = load_prompts()["sets"][SEED_PROMPT_SET][0]
        ids = tokenize(Path(directory), seed["text"])
    return ids, layer1_input(directory, ids), layer1_weights(directory)


@pytest.fixture(params=["fixture", pytest.param("checkpoint", marks=pytest.mark.needs_checkpoint)])
def probe(request):
    if request.param == "fixture":
        return "fixture", str(DEFAULT_MODEL)
    return "checkpoint", str(request.config.getoption("--mla-checkpoint"))


@pytest.mark.mla_section("checkpoint")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_prefill_decode_on_checkpoint(mla_backend, probe, dtype, mla_device, mla_figures):
    source, directory = probe
    ids, x, w = probe_inputs(directory, source)
    dt = checks.DTYPES[dtype]
    checks.require_support(mla_backend, w.config, dtype=dt, device=mla_device)
    T = len(ids)
    scenario = checks.Scenario("seed000", (T - 1,), decode_steps=1)
    out, cache = checks.run_scenario(mla_backend, w.to(dt, device=mla_device), x.to(torch.float64), scenario,
                                     device=mla_device, capacity=32)
    ref = reference_attention_f64(w, x.to(dt).to(torch.float64))
    m_all = checks.error_metrics(out[0], ref[0])
    m_decode = checks.error_metrics(out[0, -1], ref[0, -1])
    mla_figures.update(source=source, tokens=T, dtype=dtype, active_nbytes=int(cache.active_nbytes()),
                   allocated_nbytes=int(cache.allocated_nbytes()), decode=m_decode, all_tokens=m_all)
    tol = checks.TOLERANCES[dtype]
    assert m_all["rel_fro"] <= tol.rel_fro and m_all["max_rel"] <= tol.max_rel, (
        f"{mla_backend.name} on {source} layer 1, {dtype}: {checks.format_metrics(m_all)}")
