"""The engine suite fails a broken engine configuration: vLLM's CPU MLA decode kernel handed 0.8 x the softmax
scale (tests/meta/impls/broken/engine_decode_scale.py) fails the log-probability test at the first decode position
(1), naming the decode path as the likely cause. (Its greedy tokens still match within the pinned answers: the
greedy test passes it, measured, so it is not run here.) Engine tier (needs vLLM: .ci/engine_tier); skips with
a sentence where vllm does not import. The suite runs in a pytest subprocess (the engine in its own subprocess
below it)."""

import importlib.util
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BROKEN = "tests.meta.impls.broken.engine_decode_scale.DecodeScaleTimes08:attention_backend=CPU_MLA,dtype=float32"

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vllm is not installed: the engine tier's test (bash .ci/engine_tier)")


def test_wrong_decode_scale_fails_at_the_first_decode_position(tmp_path):
    if not (ROOT / "fixtures" / "models" / "tiny-mla-576" / "config.json").is_file():
        pytest.skip("the pinned 576-dim model (fixtures/models/tiny-mla-576) is not in this checkout")
    xml = tmp_path / "engine.xml"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-n", "0", "-o", f"cache_dir={tmp_path / 'cache'}", "-q",
                           "suites/test_engine.py", "--mla-engine", BROKEN, "-k",
                           "tiny-mla-576 and logprobs", f"--junitxml={xml}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=1200)
    cases = {c.get("name").split("[")[0]: c for c in ET.parse(xml).iter("testcase")}
    assert sorted(cases) == ["test_engine_logprobs"], f"expected the test to run, got {sorted(cases)}\n{proc.stdout[-2000:]}"
    # the log-probabilities are off from the first decode step on (the prefill computes position 0 right)
    failure = cases["test_engine_logprobs"].find("failure")
    assert failure is not None, f"the log-probability test passed the decode's softmax scale x0.8\n{proc.stdout[-2000:]}"
    message = failure.get("message", "") + (failure.text or "")
    assert "the first diverging position is 1 of prompt" in message, \
        f"the first diverging position named is not the first decode step (position 1):\n{message[:1500]}"
    assert "the first generated token (the prefill) agrees and position 1 does not: the decode path" in message, \
        f"the cause (the decode path) is not named:\n{message[:1500]}"
