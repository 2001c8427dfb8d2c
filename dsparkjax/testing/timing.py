"""Device timing helpers shared by the benchmarks and the GPU bandwidth tests."""

from __future__ import annotations

import time
from typing import Any, Callable

import jax
import jax.numpy as jnp


def run_seconds(fn: Callable[..., Any], *args: Any, reps: int) -> list[float]:
    """Wall times of `reps` runs of `fn(*args)` to completion (block_until_ready), after one warm-up (compile)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return times


def min_seconds(fn: Callable[..., Any], *args: Any, reps: int) -> float:
    """Fastest of `run_seconds`: the estimate of what the device can do, for ceilings (clock ramps and host
    hiccups only ever add time)."""
    return min(run_seconds(fn, *args, reps=reps))


@jax.jit
def device_copy(buf: jax.Array) -> jax.Array:
    """`buf + 1`: one kernel that reads and writes every byte of float32 `buf` (XLA's loop_add_fusion), the
    copy that the bandwidth probes time."""
    return buf + 1.0


def copy_bandwidth(mib: int = 1024, reps: int = 10) -> float:
    """Bytes/s of a device copy (bytes read + bytes written) of a `mib` MiB float32 buffer: the ceiling that
    memory-bound kernels are measured against, timed like them (`seconds_per_call`: the slope between
    programs of four and eight copies of distinct buffers, each the fastest of `reps`; 16 buffers of `mib` MiB
    in all), so that dispatch and synchronisation count in neither: a copy timed alone by wall clock, or a slope
    over one extra copy, reads far from the copy kernel's own rate (docs/perf_log/kernels.md)."""
    n = (mib << 20) // 4
    bufs = [jnp.full((n,), float(i), jnp.float32) for i in range(8)]
    copies = jax.jit(lambda bs: [device_copy(b) for b in bs])
    return 2 * bufs[0].nbytes / seconds_per_call(lambda m: copies, lambda m: (bufs[:m],), 4, reps)


def seconds_per_call(make_program: Callable[[int], Callable[..., Any]], make_args: Callable[[int], tuple], n: int,
                     reps: int) -> float:
    """Device time of one call in a stream of calls: (time of a program of 2n calls - time of n calls) / n,
    each the fastest of `reps` runs (host and clock hiccups only add time, and a difference of medians is
    noisy at these sizes). The difference removes the program's fixed dispatch and synchronisation cost and
    keeps what every call pays in a decode step, its launch gaps included. NaN when the difference is not
    positive (below the timer's resolution).

    make_program(m) returns a jitted function of make_args(m) that makes m independent calls."""
    t1 = min_seconds(make_program(n), *make_args(n), reps=reps)
    t2 = min_seconds(make_program(2 * n), *make_args(2 * n), reps=reps)
    return (t2 - t1) / n if t2 > t1 else float("nan")
