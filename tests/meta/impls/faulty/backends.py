"""Backends that kill, hang or poison the process that runs them, on their Nth ``attend`` call (counted per
process, so a fresh worker starts again at 1). Correct otherwise: ``attend`` returns ``"ok"``. For the
isolation meta tests (``tests/meta/test_isolation.py``); the counting is per process, the N per class.

``NativeHang`` blocks every catchable signal and calls libc ``pause()``: no signal handler can run, so only
the C-level watchdog (faulthandler) ends it -- a stand-in for a hung kernel or a deadlocked C++ extension.
``Stopped`` stops its own process (SIGSTOP): not even the C watchdog runs, so only ``run``'s watch over the
whole run ends it. ``SegfaultFirst`` crashes on the first call of every process: each of its tests crashes, one
after another, each in a fresh worker. ``CollectionCrash`` (``faulty_collection_backend.py``) crashes every
pytest process that imports it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time


class _Faulty:
    name = "faulty"
    on_call = 2  # misbehave on this attend call of the process

    def __init__(self):
        self.calls = 0

    def unsupported_reason(self, config, *, dtype, device, kv_codec):
        return None

    def new_cache(self, config, *, batch_size, capacity, dtype, device, kv_codec="none"):
        raise NotImplementedError("the isolation meta suite never builds a cache")

    def attend(self, weights, hidden_states, positions, cache, lengths=None):
        self.calls += 1
        if self.calls == self.on_call:
            self.misbehave()
        return "ok"

    def misbehave(self):
        raise NotImplementedError


class Good(_Faulty):
    name = "good"

    def misbehave(self):
        pass


class Segfault(_Faulty):
    name = "segfault"

    def misbehave(self):
        os.kill(os.getpid(), signal.SIGSEGV)


class SegfaultFirst(Segfault):
    name = "segfault-first"
    on_call = 1


class Abort(_Faulty):
    name = "abort"

    def misbehave(self):
        os.abort()


class Stopped(_Faulty):
    name = "stopped"

    def misbehave(self):
        os.kill(os.getpid(), signal.SIGSTOP)


class Exit(_Faulty):
    name = "exit3"

    def misbehave(self):
        os._exit(3)


class PythonHang(_Faulty):
    name = "hang-python"

    def misbehave(self):
        time.sleep(3600)


class NativeHang(_Faulty):
    name = "hang-native"

    def misbehave(self):
        signal.pthread_sigmask(signal.SIG_BLOCK, set(signal.Signals) - {signal.SIGKILL, signal.SIGSTOP})
        ctypes.CDLL(None).pause()


class CudaIllegalAccess(_Faulty):
    name = "cuda-illegal"

    def misbehave(self):
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be "
                           "asynchronously reported at some other API call")


class CudaOOM(_Faulty):
    name = "cuda-oom"

    def misbehave(self):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.15 GiB total capacity)")
