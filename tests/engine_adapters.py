"""Engine adapters that die, for tests/test_engine_contract.py: the engine contract's subprocess must turn an abort,
a raise and a hang into a verdict naming the configuration, the phase and the cause (no vLLM needed)."""

import os
import time

from mla_conformance.engine.contract import Completion


class _Engine:
    name = "test-engine"

    def unsupported_reason(self, options):
        return None

    def load(self, model_dir, options):
        pass

    def effective_options(self):
        return {}

    def generate(self, prompts, max_new_tokens, top_k):
        return [Completion([1] * n, [-0.5] * n, [{1: -0.5}] * n) for n in max_new_tokens]

    def kv_cache(self):
        return None

    def close(self):
        pass


class Works(_Engine):
    pass


class AbortsAtFirstStep(_Engine):
    def generate(self, prompts, max_new_tokens, top_k):
        os.abort()  # as a C++ assertion in a kernel ends the process


class RaisesAtLoad(_Engine):
    def load(self, model_dir, options):
        raise ValueError("Head dimension 80 is not supported by MLA.")


class Hangs(_Engine):
    def generate(self, prompts, max_new_tokens, top_k):
        time.sleep(600)
