"""Shared timing for the benchmarks: warm up, then the median wall time of N runs.

JAX: the caller passes an already compiled function, so no compile is timed, and every
timed call is followed by `jax.block_until_ready`, so the time is the computation's, not the
dispatch.
PyTorch (CPU, eager): the same warm-up and median; results are synchronous on the CPU.
"""
from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any


def cpu_cores() -> int:
    """The cores this process may run on: what XLA's CPU thread pool sizes itself to."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _median_ms(call: Callable[[], Any], repeats: int, warmup: int) -> float:
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for _ in range(warmup):
        call()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def time_jax(fn: Callable, *args, repeats: int = 10, warmup: int = 1) -> float:
    """Median milliseconds of `fn(*args)`, `fn` already compiled (`jax.jit(f).lower(*args).compile()`),
    after a first call and `warmup` untimed runs; each run waits for every output with
    `block_until_ready`."""
    import jax

    # never timed, even with warmup=0: a compiled executable's first call builds its dispatch path
    jax.block_until_ready(fn(*args))
    return _median_ms(lambda: jax.block_until_ready(fn(*args)), repeats, warmup)


def time_torch(fn: Callable[[], Any], repeats: int = 10, warmup: int = 1) -> float:
    """Median milliseconds of `fn()` after `warmup` untimed runs (PyTorch CPU is synchronous)."""
    return _median_ms(fn, repeats, max(1, warmup))
