"""The engine contract without an engine: spec parsing, a configuration that dies (abort, raise, hang) reported as a
verdict naming it, and the greedy / log-probability rules on hand-made distributions (a tie passes and is reported,
a forced divergence fails naming the position and the cause)."""

import math

import pytest
import torch

from mla_conformance.engine import checks
from mla_conformance.engine.contract import Completion, parse_engine_spec
from mla_conformance.engine.reference import ReferenceCompletion
from mla_conformance.engine.run import run_engine
from mla_conformance.errors import BackendSpecError


def test_spec_parses_options_and_names_a_bad_one():
    spec = parse_engine_spec("vllm:attention_backend=CPU_MLA,dtype=float32,prefix_caching=off,page_size=64")
    assert spec.engine == "vllm" and spec.options.prefix_caching is False and spec.options.page_size == 64
    assert spec.text() == "vllm:dtype=float32,attention_backend=CPU_MLA,page_size=64,prefix_caching=off"
    for bad, says in (("tgi", "unknown engine 'tgi'"), ("vllm:flash=1", "unknown option 'flash'"),
                      ("vllm:page_size=x", "page_size=x: expected an integer"), ("vllm:mla=maybe", "expected on or off"),
                      ("vllm:dtype", "'dtype' is not key=value")):
        with pytest.raises(BackendSpecError, match=says):
            parse_engine_spec(bad)


def _run(cls, **kw):
    return run_engine(parse_engine_spec(f"tests.engine_adapters.{cls}:dtype=float32,kv_cache_dtype=fp8"), "/nonexistent",
                      [[1, 2, 3]], [2], **kw)


def test_a_configuration_that_works_returns_its_completions():
    run = _run("Works", passes=2)
    assert run.ok and run.phase == "done" and [c.tokens for c in run.passes[1]] == [[1, 1]], run.stderr_tail


def test_an_abort_at_the_first_step_is_a_verdict_naming_the_option():
    run = _run("AbortsAtFirstStep", varied="kv_cache_dtype=fp8")
    assert run.error == ("engine tests.engine_adapters.AbortsAtFirstStep:dtype=float32 with kv_cache_dtype=fp8 died "
                         "while generating, before returning any output: signal SIGABRT: "
                         + run.error_line), run.stderr_tail


def test_a_raise_at_load_names_the_engine_error():
    run = _run("RaisesAtLoad")
    assert "died while loading the model: exit status 1: ValueError: Head dimension 80 is not supported by MLA." \
        in run.error


def test_a_hang_is_killed_at_the_timeout():
    run = _run("Hangs", timeout_s=2)
    # the verdict says the runner killed it at its own 2 s timeout: no clock is read here
    assert run.error.endswith("died while generating, before returning any output: no result after 2 s (killed)")


def _dist(top1: int, margin: float, vocab: int = 8) -> torch.Tensor:
    """log_softmax of logits with top1 ahead of token (top1 + 1) % vocab by ``margin``, spread 1."""
    z = torch.linspace(-2.0, 0.0, vocab, dtype=torch.float64)
    z[top1], z[(top1 + 1) % vocab] = 1.0, 1.0 - margin
    return torch.log_softmax(z, -1)


def _compare(ref_tokens, margins, got_tokens, got_lp_shift=0.0):
    ref = ReferenceCompletion(ref_tokens, [_dist(t, m) for t, m in zip(ref_tokens, margins)])
    lps = [float(ref.logprobs[i][t]) + got_lp_shift for i, t in enumerate(got_tokens)]
    got = Completion(got_tokens, lps, [{t: lp} for t, lp in zip(got_tokens, lps)])
    return checks.compare_greedy("p0", ref, got, dtype="float32", layers=2)


def test_a_divergence_at_a_tie_passes_and_is_reported():
    c = _compare([3, 4, 5], [0.5, 1e-6, 0.5], [3, 5, 6])  # at position 1 the reference's top-2 are 1e-6 apart
    assert c.tie and c.diverged_at == 1 and c.matched == 1
    checks.assert_greedy_tokens([c], dtype="float32")
    checks.assert_logprobs([c], dtype="float32")


def test_a_forced_divergence_fails_naming_the_position_and_the_decode_path():
    c = _compare([3, 4, 5], [0.5, 0.5, 0.5], [3, 5, 6])
    with pytest.raises(AssertionError, match=r"(?s)diverge from the float64 reference at position 1 of prompt p0 "
                                             r"\(engine 5, reference 4\).*the decode path"):
        checks.assert_greedy_tokens([c], dtype="float32")


def test_logprobs_off_from_the_first_token_name_the_prefill():
    c = _compare([3, 4], [0.5, 0.5], [3, 4], got_lp_shift=1e-2)
    assert not c.failed_tokens and c.first_out_of_tolerance == 0
    with pytest.raises(AssertionError, match=r"(?s)beyond the float32 tolerance.*position 0.*prefill"):
        checks.assert_logprobs([c], dtype="float32")
    tau = checks.logprob_tolerance("float32", 2, _dist(3, 0.5))
    assert math.isclose(tau, 2 * math.sqrt(3) * checks.TOLERANCES["float32"].rel_fro * math.log(8) *
                        float(_dist(3, 0.5).std()))


def test_a_warm_run_off_the_cold_one_fails_naming_what_differs():
    ref = ReferenceCompletion([3, 4], [_dist(3, 0.5), _dist(4, 0.5)])
    cold = Completion([3, 4], [-0.4, -0.4], [{3: -0.4, 2: -0.9}, {4: -0.4, 5: -0.9}])
    same = Completion([3, 4], [-0.4, -0.4], [{3: -0.4, 2: -0.9}, {4: -0.4, 5: -0.9}])
    assert checks.assert_same_as_cold(["p0"], [ref], [cold], [same], dtype="float32", layers=2,
                                      what="chunked prefill") == 0.0
    off = Completion([3, 4], [-0.4, -0.41], [{3: -0.4, 2: -0.9}, {4: -0.41, 5: -0.9}])
    with pytest.raises(AssertionError, match=r"chunked prefill: log-probabilities differ from the cold run by 0.01 "
                                             r"> .* at position 1 of prompt p0"):
        checks.assert_same_as_cold(["p0"], [ref], [cold], [off], dtype="float32", layers=2, what="chunked prefill")
    other = Completion([3, 5], [-0.4, -0.9], [{3: -0.4, 2: -0.9}, {5: -0.9, 4: -0.4}])
    with pytest.raises(AssertionError, match=r"token 5 at position 1 of prompt p0, the cold run chose 4 by a margin 0.5"):
        checks.assert_same_as_cold(["p0"], [ref], [cold], [other], dtype="float32", layers=2, what="prefix-cache reuse")


def test_an_expanded_cache_fails_the_latent_bytes():
    kv = {"bytes_per_token_per_layer": 3072.0, "layout": "expanded",
          "tensors": [{"layer": "model.layers.0.self_attn.attn", "shape": [85, 2, 128, 384], "dtype": "float32"}]}
    with pytest.raises(AssertionError, match=r"(?s)KV cache bytes per token per layer 3072 != the latent's 2304 \(576 "
                                             r"elements x 4 bytes\) by 1.33x.*caches the expanded K/V"):
        checks.assert_latent_cache(kv, latent_elements=576, dtype_bytes=4)
    assert checks.assert_latent_cache({**kv, "bytes_per_token_per_layer": 2304.0}, latent_elements=576,
                                      dtype_bytes=4) == 2304.0
