"""A backend whose module crashes (a segfault) any pytest process that imports it (pytest sets PYTEST_VERSION): a
crash during collection. ``mla-conformance run``, which checks the spec before starting pytest, loads it when
started without PYTEST_VERSION in its environment. For tests/meta/test_isolation.py."""

import ctypes
import os

if "PYTEST_VERSION" in os.environ:
    ctypes.string_at(0)


class CollectionCrash:
    name = "collection-crash"

    def unsupported_reason(self, config, *, dtype, device, kv_codec):
        return None

    def attend(self, weights, hidden_states, positions, cache, lengths=None):
        return "ok"
