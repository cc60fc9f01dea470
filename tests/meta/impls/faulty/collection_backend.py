"""A backend whose module crashes (a segfault) the process that imports it: with ``MLA_FAULTY_IMPORT=always``
any process (``mla-conformance run`` checks the spec before pytest starts), with ``worker`` an xdist worker only
(a crash while the worker collects, after the controller and ``run`` loaded it). For tests/meta/test_isolation.py."""

import ctypes
import os

if os.environ.get("MLA_FAULTY_IMPORT") == "always" or (
        os.environ.get("MLA_FAULTY_IMPORT") == "worker" and os.environ.get("PYTEST_XDIST_WORKER")):
    ctypes.string_at(0)


class CollectionCrash:
    name = "collection-crash"

    def unsupported_reason(self, config, *, dtype, device, kv_codec):
        return None

    def new_cache(self, config, *, batch_size, capacity, dtype, device, kv_codec="none"):
        raise NotImplementedError("the isolation meta suite never builds a cache")

    def attend(self, weights, hidden_states, positions, cache, lengths=None):
        return "ok"
