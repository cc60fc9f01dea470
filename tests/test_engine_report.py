"""The engine rows of the report (mla_conformance.engine.report): each test's figures land in its configuration's
row; the quantized cache's apart from the cold run's, each comparison with the cold run under its check."""

from mla_conformance.engine.report import engine_rows

SPEC = "vllm:attention_backend=CPU_MLA,dtype=float32"


def _test(name: str, variant: str, outcome: str = "passed", **figures) -> dict:
    return {"nodeid": f"suites/test_engine.py::{name}[{SPEC}-tiny-mla-576]", "outcome": outcome,
            "figures": {"engine": {"spec": SPEC, "model": "tiny-mla-576", "variant": variant, **figures}}}


def test_every_check_keeps_its_figures_in_the_order_the_suite_runs_them():
    results = {"tests": [
        _test("test_engine_greedy_tokens", "cold", tokens_matched=179, tokens_compared=179),
        _test("test_engine_logprobs", "cold", tokens_matched=179, tokens_compared=179, worst_logprob_delta=1.5e-5),
        _test("test_engine_prefix_cache", "cold", worst_logprob_delta_vs_cold=0.0),
        _test("test_engine_chunked_prefill", "chunked", worst_logprob_delta_vs_cold=2e-6),
        _test("test_engine_kv_cache_fp8", "fp8", "failed", tokens_matched=170, tokens_compared=179),
    ]}
    (row,) = engine_rows(results)
    assert (row["tokens_matched"], row["worst_logprob_delta"]) == (179, 1.5e-5)  # the cold run's
    assert row["fp8"] == {"tokens_matched": 170, "tokens_compared": 179}
    assert row["vs_cold"] == {"prefix_cache": 0.0, "chunked_prefill": 2e-6}
    assert row["checks"]["kv_cache_fp8"]["outcome"] == "failed"


def test_an_fp8_run_that_died_is_said_on_the_row():
    (row,) = engine_rows({"tests": [_test("test_engine_greedy_tokens", "cold", tokens_matched=179),
                                    _test("test_engine_kv_cache_fp8", "fp8", "error", died="engine died")]})
    assert row["died"] == "engine died" and row["tokens_matched"] == 179 and "fp8" not in row


def test_a_test_skipped_before_any_run_is_its_configuration_s_row():
    """No figures: the spec and the model come from the test id (the longest model name that ends it)."""
    rows = engine_rows({"tests": [
        {"nodeid": f"suites/test_engine.py::test_engine_greedy_tokens[{SPEC}-tiny-mla-576]", "outcome": "skipped",
         "reason": "no vllm"},
        {"nodeid": f"suites/test_engine.py::test_engine_greedy_tokens[{SPEC}-tiny-mla]", "outcome": "skipped",
         "reason": "no vllm"}]})
    assert [(r["spec"], r["model"]) for r in rows] == [(SPEC, "tiny-mla"), (SPEC, "tiny-mla-576")]
    assert rows[0]["checks"]["greedy"] == {"outcome": "skipped", "reason": "no vllm"}
