"""The benchmark's correctness gate (mla_conformance.perf.gate): its decode-step oracle is the reference's, its
bounds are the suite's, and a step that failed it cannot be timed by any path."""

import pytest
import torch

from mla_conformance.checks.driver import master_weights
from mla_conformance.checks.tolerances import TOLERANCES
from mla_conformance.kv.codecs import ERROR_BOUNDS
from mla_conformance.model.reference import reference_attention_f64
from mla_conformance.perf import gate
from mla_conformance.perf import fill
from mla_conformance.perf.fill import hidden_chunk
from mla_conformance.perf.step import prepare
from mla_conformance.perf.timing import measure, time_interleaved, time_steps

QUIET = dict(progress=lambda m: None)


def test_decode_oracle_is_the_reference_at_the_last_position(monkeypatch):
    """The absorbed float64 decode-step oracle equals the expanded one-shot ``reference_attention_f64`` of the
    whole sequence at its last position, to float64 rounding (over the fill's chunk boundaries, 16 tokens here)."""
    monkeypatch.setattr(fill, "FILL_CHUNK", 16)
    monkeypatch.setattr(fill, "_LATENTS", {})  # the caches hold chunks of the default size
    monkeypatch.setattr(gate, "_KEYS", {})
    ctx = 37
    p = prepare("reference-absorbed", "tiny", "float32", ctx, 2, "cpu", steps=2, **QUIET)
    got, keys = gate.decode_oracle(p)
    x = torch.cat([hidden_chunk(p.config, s, n, 2, 0, "cpu", p.dtype)[0] for s, n in fill.chunk_starts(ctx)]
                  + [p.hidden], 1).to(torch.float64)
    want = reference_attention_f64(master_weights("tiny", 0), x)[:, ctx:]
    assert keys == f"every key (0..{ctx})"
    assert (got - want).abs().max() <= 1e-12 * want.abs().max()


def test_bounds_are_the_suites():
    assert gate.bound_for(torch.bfloat16, "none")["rel_fro"] == TOLERANCES["bfloat16"].rel_fro
    assert gate.bound_for(torch.bfloat16, "none")["max_rel"] == TOLERANCES["bfloat16"].max_rel
    tol, att = TOLERANCES["bfloat16"].rel_fro, ERROR_BOUNDS["int8-g32"].attention
    codec = gate.bound_for(torch.bfloat16, "int8-g32")
    assert codec["rel_fro"] == tol + att * (1 + tol) and codec["max_rel"] is None


@pytest.fixture(scope="module")
def refused():
    """reference-absorbed's prepared step with its gate outcome replaced by a failed one."""
    p = prepare("reference-absorbed", "tiny", "float32", 8, 1, "cpu", steps=2, **QUIET)
    assert p.correctness.passed
    p.correctness = gate.Correctness(False, p.correctness.checked, p.correctness.bound, {}, failure="rel_fro 1 vs 2")
    return p


@pytest.mark.parametrize("path", ["step", "time_steps", "time_interleaved", "measure", "figures"])
def test_a_failed_step_is_never_timed(refused, path):
    run = {"step": lambda: refused.step(), "time_steps": lambda: time_steps(refused, 1, 0),
           "time_interleaved": lambda: time_interleaved([refused], 1, 0),
           "measure": lambda: measure(refused, 1, 0, bandwidth=1.0), "figures": lambda: refused.figures(1.0, 1.0)}[path]
    with pytest.raises(gate.NotTimed, match=r"^not timed: wrong output \(rel_fro 1 vs 2\)$"):
        run()


def test_the_record_names_the_configuration_checked():
    p = prepare("reference-naive", "tiny", "bfloat16", 20, 2, "cpu", steps=2, **QUIET)
    rec = p.figures(1e-3, 1e9)["correctness"]
    assert rec["outcome"] == "pass" and len(rec["measured"]["rows"]) == 2
    assert {k: rec["checked"][k] for k in ("backend", "preset", "dtype", "context", "batch", "kv_codec")} == {
        "backend": "reference-naive", "preset": "tiny", "dtype": "bfloat16", "context": 20, "batch": 2,
        "kv_codec": "none"}
    assert rec["measured"]["rel_fro"] <= rec["bound"]["rel_fro"]
