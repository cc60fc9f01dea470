"""The timing loop: wall seconds of decode steps, the device's copy bandwidth, and timing ratios held to a floor.

Every step timed here goes through ``prepared.step()``, which refuses (:class:`mla_conformance.perf.gate.NotTimed`)
unless the step's output passed the correctness gate first: a kernel that is fast because it is wrong gets no
figure.

**Bandwidth of this device** is measured in the same run: the median time of ``dst.copy_(src)`` over a
256 MiB buffer, bandwidth = 2 x bytes / time (read + write); ``bandwidth_fraction`` = achieved GB/s over it.
On CUDA the timer synchronizes the device around each call.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

#: Bytes of the buffer the bandwidth probe copies.
BANDWIDTH_PROBE_BYTES = 256 * 1024 * 1024

#: A copy-bandwidth reading below this fraction of the run's best one means the machine was busy.
BUSY_FRACTION = 0.8


def synchronize(device) -> None:
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def time_call(fn: Callable[[], Any], device) -> float:
    """Wall seconds of one call, the device synchronized before and after."""
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - t0


_BANDWIDTH: dict[str, float] = {}


def measure_bandwidth(device="cpu", nbytes: int = BANDWIDTH_PROBE_BYTES, reps: int = 7, *,
                      refresh: bool = False) -> float:
    """Bytes/s of ``dst.copy_(src)`` over ``nbytes`` (2 x nbytes moved per copy), median of ``reps``.

    Measured once per device and process unless ``refresh``.
    """
    key = str(torch.device(device))
    if key in _BANDWIDTH and not refresh:
        return _BANDWIDTH[key]
    n = nbytes // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch the pages
    times = [time_call(lambda: dst.copy_(src), device) for _ in range(reps)]
    bw = 2 * n * 4 / statistics.median(times)
    del src, dst
    _BANDWIDTH[key] = bw
    return bw


def default_rounds(context: int) -> int:
    """Few rounds for long contexts: 10 up to 4k, 5 up to 16k, 3 beyond."""
    return 10 if context <= 4096 else 5 if context <= 16384 else 3


def time_steps(prepared, rounds: int, warmup: int = 1) -> list[float]:
    """Seconds of ``rounds`` decode steps (after ``warmup``), each after a reset (not timed)."""
    return time_interleaved([prepared], rounds, warmup)[0]


def time_interleaved(prepared: list, rounds: int, warmup: int = 1,
                     progress: Callable[[str], None] | None = None) -> list[list[float]]:
    """Like :func:`time_steps` for several prepared steps, round-robin so noise hits all alike."""
    for p in prepared:  # refuse before any step: one wrong output stops the whole comparison
        p.require_correct()
    for _ in range(warmup):
        for p in prepared:
            p.reset()
            p.step()
    times: list[list[float]] = [[] for _ in prepared]
    for r in range(rounds):
        for i, p in enumerate(prepared):
            p.reset()
            times[i].append(time_call(p.step, p.device))
        if progress is not None:
            progress(f"round {r + 1}/{rounds}: " + ", ".join(
                f"{p.backend.name} {t[-1] * 1e3:.1f} ms" for p, t in zip(prepared, times)))
    return times


def measure(prepared, rounds: int | None = None, warmup: int = 1, *,
            bandwidth: float | None = None) -> dict[str, Any]:
    """Median time of one decode step and its figures (bandwidth measured unless given)."""
    rounds = rounds or default_rounds(prepared.context)
    times = time_steps(prepared, rounds, warmup)
    bw = bandwidth if bandwidth is not None else measure_bandwidth(prepared.device)
    fig = prepared.figures(statistics.median(times), bw)
    fig.update(rounds=rounds, warmup=warmup, times_s=times)
    return fig


def bandwidth_fraction(readings: list[float]) -> float:
    """The worst copy-bandwidth reading of a run over its best (1.0: the machine stayed as fast)."""
    readings = [r for r in readings if r and r > 0]
    return min(readings) / max(readings) if readings else 1.0


def ratio_verdict(ratio: float, floor: float, fraction: float, *, what: str = "ratio") -> tuple[str, str]:
    """A timing ratio against a stated floor: ("ok" | "inconclusive" | "below floor", one sentence).

    Below the floor is "inconclusive (machine busy: N% of copy bandwidth measured)" when the machine's
    own copy bandwidth dropped under :data:`BUSY_FRACTION` of its best reading in the same run: a load
    spike is not a property of the code under test.
    """
    if ratio >= floor:
        return "ok", f"{what} {ratio:.2f}x >= stated floor {floor:.3g}x"
    if fraction < BUSY_FRACTION:
        return "inconclusive", (f"{what} {ratio:.2f}x < stated floor {floor:.3g}x: inconclusive (machine busy: "
                                f"{fraction:.0%} of copy bandwidth measured)")
    return "below floor", (f"{what} {ratio:.2f}x < stated floor {floor:.3g}x with the machine's copy bandwidth "
                           f"steady ({fraction:.0%} of its best reading)")
