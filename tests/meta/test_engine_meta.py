"""The engine suite fails a broken engine configuration: vLLM's CPU MLA decode kernel handed 0.8 x the softmax
scale (tests/meta/impls/broken/engine_decode_scale.py) fails the greedy-token and log-probability tests at the first
decode position, naming the decode path as the likely cause. Engine tier (needs vLLM: .ci/engine_tier); skips with
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
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", "-q",
                           "suites/test_engine.py", "--mla-engine", BROKEN, "-k",
                           "tiny-mla-576 and (greedy_tokens or logprobs)", f"--junitxml={xml}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=1200)
    cases = {c.get("name"): c for c in ET.parse(xml).iter("testcase")}
    assert len(cases) == 2, f"expected the two tests to run, got {sorted(cases)}\n{proc.stdout[-2000:]}"
    for name, case in cases.items():
        failure = case.find("failure")
        assert failure is not None, f"{name} did not fail with the decode's softmax scale x0.8\n{proc.stdout[-2000:]}"
        message = failure.get("message", "") + failure.text
        assert "position 1 of prompt" in message, f"{name}: the first diverging position is not the first decode " \
                                                  f"step (position 1):\n{message[:1500]}"
        assert "the decode path" in message and "the first generated token (the prefill) agrees" in message, \
            f"{name}: the cause (the decode path) is not named:\n{message[:1500]}"
