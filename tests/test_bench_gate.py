"""The benchmark's correctness gate (mla_conformance.perf.gate): its decode-step oracle is the reference's, its
bounds are the suite's plus the score-rounding term (mla_conformance.perf.score_rounding), which bounds the rounding it
models, and a step that failed it cannot be timed by any path."""

import pytest
import torch

from mla_conformance.checks.layer.driver import master_weights
from mla_conformance.checks.tolerances import TOLERANCES
from mla_conformance.kv.codecs import ERROR_BOUNDS
from mla_conformance.checks.metrics import row_metrics
from mla_conformance.model import reference as ref
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
    terms = rec["bound"]["score_rounding"]["rows"]
    assert len(terms) == 2 and rec["bound"]["score_rounding"]["failure_probability"] == 1e-6
    for got, lim, term in zip(rec["measured"]["rows"], rec["bound"]["rows"], terms):
        assert lim["rel_fro"] == TOLERANCES["bfloat16"].rel_fro + term["rel_fro"]
        assert lim["max_rel"] == TOLERANCES["bfloat16"].max_rel + term["max_rel"]
        assert got["rel_fro"] <= lim["rel_fro"] and got["max_rel"] <= lim["max_rel"]


@pytest.fixture(scope="module")
def long_row():
    """reference-absorbed's bf16 decode step over 1016 cached tokens (v3-mini, 2 rows), its float64 oracle and the
    score-rounding term of each row."""
    p = prepare("reference-absorbed", "v3-mini", "bfloat16", 1016, 2, "cpu", steps=2, **QUIET)
    return p, gate.oracle_step(p), gate.oracle_and_score_rounding(p)[2]


def rounded_scores_only(o: gate.Oracle, dtype: torch.dtype) -> torch.Tensor:
    """The oracle's decode step in float64 except the logits, rounded to ``dtype`` where the absorbed path rounds them
    (score_rounding.PARTIALS, then AFTER): the rounding the term models, simulated exactly."""
    cfg = o.weights.config
    w_uk, w_uv = ref.split_kv_b(o.weights)
    q_lat = torch.einsum("bshd,hdc->bshc", o.q_nope, w_uk)
    r = lambda t: t.to(dtype).to(torch.float64)  # noqa: E731
    scores = r(r(o.c @ q_lat[:, 0].transpose(1, 2)) + r(o.k_pe @ o.q_pe[:, 0].transpose(1, 2)))  # [B, T, H]
    logits = r(scores.transpose(1, 2)[:, None] * cfg.softmax_scale)
    p = ref.masked_softmax(logits, o.allowed, torch.float64)
    heads = torch.einsum("bshc,hdc->bshd", torch.einsum("bsht,btc->bshc", p, o.c), w_uv)
    return heads.flatten(-2) @ o.weights["o_proj.weight"].T


def test_score_rounding_term_bounds_the_rounding_it_models(long_row):
    """Rounding only the logits to bf16, as the absorbed path does, errs by more than TOLERANCES' whole bf16 layer bound
    on one of the rows (why the term exists) and by less than the term on every row, rel_fro and max_abs/rms; rounding
    them to e4m3 instead (u 16x coarser) errs by more than the bf16 term (it is not vacuous)."""
    _, o, terms = long_row
    bf16 = [row_metrics(y, ref_y) for y, ref_y in zip(rounded_scores_only(o, torch.bfloat16), o.out)]
    assert max(m["rel_fro"] for m in bf16) > TOLERANCES["bfloat16"].rel_fro, bf16
    for b, (m, t) in enumerate(zip(bf16, terms)):
        assert m["rel_fro"] <= t["rel_fro"] and m["max_rel"] <= t["max_rel"], (b, m, t)
    e4m3 = [row_metrics(y, ref_y) for y, ref_y in zip(rounded_scores_only(o, torch.float8_e4m3fn), o.out)]
    for b, (m, t) in enumerate(zip(e4m3, terms)):
        assert m["rel_fro"] > t["rel_fro"], (b, m, t)


def test_score_rounding_term_scales_with_the_unit_roundoff(long_row):
    """At float32 (u = 2^-24 against bfloat16's 2^-8) the first-order spread is 2^-16 of bfloat16's, and the whole term
    (its second-order parts shrink as u^2) at most that fraction."""
    _, o, bf16 = long_row
    f32 = gate.score_rounding.score_rounding(o.weights, o.q_nope, o.q_pe, o.c, o.k_pe, o.allowed, o.out, torch.float32)
    for a, b in zip(f32, bf16):
        assert a["sigma_rel"] == pytest.approx(b["sigma_rel"] * 2.0 ** -16, rel=1e-9)
        assert a["rel_fro"] <= b["rel_fro"] * 2.0 ** -16 and a["max_rel"] <= b["max_rel"] * 2.0 ** -16


def test_a_correct_long_row_passes_with_the_term(long_row):
    """reference-absorbed at 1016 keys in bf16: above TOLERANCES' rel_fro alone on a row, within suite + term on all."""
    p, _, terms = long_row
    c = p.correctness
    assert c.passed, c.failure
    assert max(r["rel_fro"] for r in c.measured["rows"]) > TOLERANCES["bfloat16"].rel_fro, c.measured
