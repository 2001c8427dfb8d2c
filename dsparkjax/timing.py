"""Device timing helpers shared by the benchmarks and the GPU bandwidth tests."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp


def median_seconds(fn: Callable[..., Any], *args: Any, reps: int) -> float:
    """Median wall time of `fn(*args)` to completion (block_until_ready), after one warm-up (compile) call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(mib: int = 1024, reps: int = 10) -> float:
    """Bytes/s of a device copy (bytes read + bytes written) of a `mib` MiB float32 buffer: the ceiling that
    memory-bound kernels are measured against."""
    buf = jnp.zeros((mib << 20) // 4, jnp.float32)
    return 2 * buf.nbytes / median_seconds(jax.jit(lambda b: b + 1.0), buf, reps=reps)
