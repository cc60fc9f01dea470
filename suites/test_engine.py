"""A serving engine runs the pinned models end to end (``--mla-engine SPEC``, docs/engines.md): its greedy tokens,
log-probabilities and KV cache bytes against the project's float64 reference.

Each engine configuration runs once per session in a subprocess of its own (an engine that aborts is a verdict
naming the configuration, the other configurations' results are kept); every test reads the runs it needs. Without
``--mla-engine`` every test skips with one sentence. Run it serially (``-n 0``): each xdist worker would
start the engines again.
"""

import pytest

from mla_conformance.engine import suite as engine_suite
from mla_conformance.engine.session import ENGINE_MODELS


def pytest_generate_tests(metafunc):
    engine_suite.parametrize(metafunc)


@pytest.fixture(scope="session")
def engine_session():
    return engine_suite.new_session()


pytestmark = [pytest.mark.mla_section("engine"), pytest.mark.parametrize("model", list(ENGINE_MODELS))]


def test_engine_greedy_tokens(mla_engine, model, engine_session, mla_figures):
    """Greedy tokens equal the float64 reference's until the first position whose reference top-1 / top-2 margin is
    below the tie bound (a tie is reported in the figures, not failed)."""
    engine_suite.check_greedy_tokens(engine_session, mla_engine, model, mla_figures)


def test_engine_logprobs(mla_engine, model, engine_session, mla_figures):
    """Chosen and top-k log-probabilities within the dtype's tolerance of the reference's (docs/tolerances.md)."""
    engine_suite.check_logprobs(engine_session, mla_engine, model, mla_figures)


def test_engine_prefix_cache(mla_engine, model, engine_session, mla_figures):
    """The same prompts again in the same engine, their prefixes from its cache: the cold run's log-probabilities."""
    engine_suite.check_prefix_cache(engine_session, mla_engine, model, mla_figures)


def test_engine_chunked_prefill(mla_engine, model, engine_session, mla_figures):
    """Long prompts prefilled in chunks: the cold run's log-probabilities."""
    engine_suite.check_chunked_prefill(engine_session, mla_engine, model, mla_figures)


def test_engine_kv_cache_fp8(mla_engine, model, engine_session, mla_figures):
    """kv_cache_dtype=fp8: the engine runs it (an engine that dies is an error naming the option) and its greedy
    tokens follow the float64 reference through the project's FP8 codec until a tie."""
    engine_suite.check_fp8(engine_session, mla_engine, model, mla_figures)


def test_engine_kv_bytes(mla_engine, model, engine_session, mla_figures):
    """Bytes per token per layer from the engine's own cache tensors: the latent (kv_lora_rank + qk_rope_head_dim
    elements), beside the engine's expanded K/V (mla=off) where it runs it."""
    engine_suite.check_kv_bytes(engine_session, mla_engine, model, mla_figures)
