"""The suite testing itself: every broken backend is caught by the check named for it, and a correct
backend written independently of the reference (tests/meta/impls/independent/backend.py) passes."""

import re

import pytest
import torch

from mla_conformance import checks
from mla_conformance.checks.layer.conventions import check_yarn_rope_attention_factor_convention

from mla_conformance.errors import BackendError

from .impls.broken import caches as broken_caches
from .impls.broken.backends import CAUGHT_BY, ERRORS_BY
from .impls.independent.backend import IndependentMLA

pytestmark = pytest.mark.meta

F32, BF16 = torch.float32, torch.bfloat16
CHECKS = {
    "numerics-fp32-tiny-prefill": lambda b: checks.numerics(b, "tiny", "prefill", F32),
    "numerics-fp32-tiny-prefill_decode": lambda b: checks.numerics(b, "tiny", "prefill_decode", F32),
    "numerics-fp32-tiny-varlen_batch": lambda b: checks.numerics(b, "tiny", "varlen_batch", F32),
    "numerics-fp32-tiny-long_context": lambda b: checks.numerics(b, "tiny", "long_context", F32),
    "numerics-fp32-lite-prefill_decode": lambda b: checks.numerics(b, "deepseek-v2-lite", "prefill_decode", F32),
    "numerics-bf16-lite-varlen_batch": lambda b: checks.numerics(b, "deepseek-v2-lite", "varlen_batch", BF16),
    "incremental-fp32-tiny": lambda b: checks.incremental_equals_prefill(b, "tiny", F32),
    "bytes-bf16-lite": lambda b: checks.v2_lite_cache_probe(b),
    "bytes-f32-tiny-batch3": lambda b: checks.cache_bytes(b, "tiny", F32, prefill=6, decode=2, batch=3, capacity=16),
    "conventions-fp32": lambda b: check_yarn_rope_attention_factor_convention(b, "cpu", {}),
    "codec-bytes-int8-g32": lambda b: checks.cache_bytes(b, "tiny", BF16, prefill=4, decode=1, batch=2, capacity=12,
                                                         kv_codec="int8-g32"),
}

#: broken backends of tests/meta/impls/broken/caches.py -> (check, a phrase its failure must say)
CACHE_BUGS = {
    broken_caches.ExpandedUint8ClaimsLatent: ("bytes-bf16-lite", r"'pool' \(327680,\) uint8: 10,240 B/token.*the format is wrong"),
    broken_caches.ShortAllocation: ("bytes-bf16-lite", r"room for 28 tokens.*the slot count is wrong"),
    broken_caches.CopiesTensors: ("bytes-bf16-lite", r"tensors\(\) must return the cache's own buffers, not copies"),
    broken_caches.MasksByMultiply: ("numerics-fp32-tiny-varlen_batch", r"NaN at row 1, position 0.*zero-filled cache gives finite outputs: the backend reads cache slots no "
                                                   r"token was written to.*multiplying with 0"),
    broken_caches.MutatesWeights: ("numerics-fp32-tiny-prefill_decode", r"changed the weights tensor\(s\) \['o_proj.weight'\]"),
    broken_caches.ScalesNotCounted: ("codec-bytes-int8-g32", r"active_nbytes\(\) says 960 B .* 1,040 B"),
}


def _fails(check, backend) -> AssertionError:
    """The check's verdict on the backend: an AssertionError that is not a crash (BackendError)."""
    try:
        CHECKS[check](backend)
    except BackendError as exc:
        raise AssertionError(f"{check} on {backend.name}: the backend crashed ({exc}) instead of being failed "
                             "by the check") from exc
    except AssertionError as exc:
        return exc
    raise AssertionError(f"{check} passed {backend.name}")


@pytest.mark.parametrize("broken", list(CAUGHT_BY), ids=lambda cls: cls.name)
def test_broken_backend_is_caught(broken):
    backend = broken()
    for check in CAUGHT_BY[broken]:
        info = _fails(check, backend)
        assert backend.name in str(info), f"{check}'s failure message does not name the backend"


@pytest.mark.parametrize("broken", list(CACHE_BUGS), ids=lambda cls: cls.name)
def test_cache_bug_is_failed_with_its_cause(broken):
    check, phrase = CACHE_BUGS[broken]
    info = _fails(check, broken())
    assert re.search(phrase, str(info), re.S), str(info)  # a phrase may span the message's lines


@pytest.mark.parametrize("broken", list(ERRORS_BY), ids=lambda cls: cls.name)
def test_crash_is_an_error_not_a_failure(broken):
    for check in ERRORS_BY[broken]:
        with pytest.raises(BackendError):
            CHECKS[check](broken())


def test_overallocating_backend_passes_and_reports_overhead():
    """4x the requested slots is an allocation policy: every byte check passes, the overhead is a figure."""
    for check in ("bytes-bf16-lite", "bytes-f32-tiny-batch3"):
        got = CHECKS[check](broken_caches.OverAllocating())
        assert got["slot_overhead"] == 4.0 and got["allocated_slots"] == 4 * got["requested_slots"], got
        assert got["bytes_per_token"] == got["format_bytes_per_token"]


def test_every_check_catches_something():
    used = ({c for names in CAUGHT_BY.values() for c in names} | {c for c, _ in CACHE_BUGS.values()}
            | {c for _, c, _ in CAUSES})
    assert used <= set(CHECKS)
    unused = set(CHECKS) - used
    assert not unused, f"checks no broken backend fails: {sorted(unused)}"


@pytest.mark.parametrize("check", list(CHECKS))
def test_independent_backend_passes(check):
    CHECKS[check](IndependentMLA())


def test_nan_message_says_nan():
    from .impls.broken.backends import NaNOutput

    with pytest.raises(AssertionError, match=r"NaN at row 0, position 20, channel 3") as info:
        CHECKS["numerics-fp32-tiny-prefill_decode"](NaNOutput())
    # its own arithmetic made the NaN (out[..] = nan), not a read of the poison: the message must not blame the poison
    assert "zero-filled cache gives non-finite outputs too: not a read of unwritten slots" in str(info.value)
    assert "reads cache slots no token was written to" not in str(info.value)


@pytest.mark.parametrize("broken,message", [
    ("WrongShape", r"attend\(\) returned shape \(1, 128\), expected \(1, 24, 128\)"),
    ("WrongDtype", r"attend\(\) returned torch.float32, expected hidden_states' torch.bfloat16"),
    ("RaisesOnDecode", r"attend\(\) raised RuntimeError: kernel launch failed"),
])
def test_contract_violations_are_named(broken, message):
    from .impls.broken import backends as broken_backends

    check = "numerics-bf16-lite-varlen_batch" if broken == "WrongDtype" else (
        "numerics-fp32-tiny-prefill_decode" if broken == "RaisesOnDecode" else "numerics-fp32-tiny-prefill")
    with pytest.raises(BackendError, match=message):
        CHECKS[check](getattr(broken_backends, broken)())


def test_independent_backend_generates_the_golden_tokens():
    """The contract-only backend, driving all layers of the tiny model, reproduces the shared goldens."""
    from mla_conformance.generation.generate import DEFAULT_MODEL, load_model, numerics_class, run_generation
    from mla_conformance.generation.golden import golden_path, read_golden

    model = load_model(DEFAULT_MODEL, torch.float32, "cpu")
    for prompt_set in ("tiny-short", "tiny-long"):
        golden = read_golden(golden_path(numerics_class("cpu", torch.float32), prompt_set, "none"))
        assert golden is not None, f"no cpu-float32 golden for {prompt_set}"
        result = run_generation(DEFAULT_MODEL, IndependentMLA(), prompt_sets=[prompt_set], model=model)
        assert result["accuracy"] >= 0.99
        assert [o["tokens"] for o in result["outputs"]] == [o["tokens"] for o in golden["outputs"]]


#: broken backend (name in impls/broken/backends.py) -> the check whose failure must name its likely cause, and the phrase
CAUSES = [
    ("MissingMscaleSquared", "numerics-fp32-tiny-prefill", r"likely cause: matches the reference without YaRN mscale²"),
    ("RopeLayoutMixup", "numerics-fp32-tiny-prefill", r"likely cause: matches the reference with rotate-half RoPE"),
    ("ChunkMaskTopLeft", "numerics-fp32-tiny-long_context",
     r"likely cause: matches the reference with each call's mask aligned top-left"),
    ("ShiftedDecodePosition", "numerics-fp32-tiny-prefill_decode",
     r"likely cause: matches the reference with one-token \(decode\) calls rotated at position - 1"),
    ("CausalExcludesSelf", "numerics-fp32-tiny-prefill",
     r"likely cause: matches the reference with the causal mask off by one, key < query"),
    # the convention test names a bug of another class, not a RoPE convention it does not have
    ("MissingMscaleSquared", "conventions-fp32",
     r"not a RoPE-convention mismatch: under the transformers convention the output matches the reference without "
     r"YaRN mscale²"),
]


@pytest.mark.parametrize("broken,check,phrase", CAUSES)
def test_failure_names_the_likely_cause(broken, check, phrase):
    """The numerics check itself (not only mla_conformance.checks.layer.diagnose) says which bug the output matches."""
    from .impls.broken import backends as broken_backends

    info = _fails(check, getattr(broken_backends, broken)())
    assert re.search(phrase, str(info), re.S), str(info)  # a phrase may span the message's lines


def test_correct_failure_message_has_no_cause_for_an_unknown_bug():
    """A bug of no known class (a row reading row 0's cache) fails without a made-up cause."""
    from .impls.broken.backends import RowsShareCache

    info = _fails("numerics-fp32-tiny-varlen_batch", RowsShareCache())
    assert "likely cause" not in str(info), str(info)
