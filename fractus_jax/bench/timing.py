"""Shared timing for the benchmarks: warm up, then the median wall time of N runs.

JAX: the caller passes an already compiled function, so no compile is timed, and every
timed call is followed by `jax.block_until_ready`, so the time is the computation's, not the
dispatch.
PyTorch (CPU, eager): the same warm-up and median; results are synchronous on the CPU.
The machine's peak, which the benchmarks divide by: `measure_peak`, a large dense matmul.
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


def peak_sampler(backend: str):
    """(sample, flops, kind): `sample(n)` times n runs of a large dense matmul (float32 on a
    CPU, bfloat16 on an accelerator), seconds each, after compiling and two warm-up runs."""
    import jax
    import jax.numpy as jnp

    n, dtype = (2048, jnp.float32) if backend == "cpu" else (8192, jnp.bfloat16)
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), dtype)
    b = jax.random.normal(jax.random.PRNGKey(1), (n, n), dtype)
    matmul = jax.jit(lambda x, y: x @ y).lower(a, b).compile()
    for _ in range(2):
        jax.block_until_ready(matmul(a, b))

    def sample(runs: int) -> list[float]:
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            jax.block_until_ready(matmul(a, b))
            times.append(time.perf_counter() - t0)
        return times
    return sample, 2 * n ** 3, f"{jnp.dtype(dtype).name} {n}x{n} matmul"


def measure_peak(backend: str, repeats: int = 10) -> dict:
    """FLOP/s of a large dense matmul: the best of `repeats` timed runs, and their median.
    The best is the peak: on a shared machine the median of the same matmul moved between
    60% and 100% of it in one run."""
    sample, flops, kind = peak_sampler(backend)
    times = sorted(sample(repeats))
    return {"peak": flops / times[0], "median": flops / times[len(times) // 2],
            "kind": f"{kind}, best of {repeats}"}
