"""Run packed-matmul calls at DS4-Flash decode shapes for a profiler, and tabulate their kernel durations.

Each (format, shape, T) call runs twice, once to compile and warm up and once to be profiled, and nothing
else that launches a `qmatmul` or `qmma` kernel runs, so Nsight Compute can be pointed at the second launches. One call
in depth:

  ncu --clock-control none -k regex:'qmatmul|qmma' --launch-skip 1 --launch-count 1 --set full \\
      python3 scripts/profile_kernel.py --formats=IQ2_XXS --shapes=exp_up24

Kernel durations of many calls (ncu flushes the caches before each profiled launch, so every call reads its
weights from DRAM, and each launch runs alone: no overlap with neighbouring calls, no launch gap), against the
duration of a 1 GiB copy kernel timed the same way (XLA names it loop_add_fusion):

  ncu --clock-control none -k regex:'qmatmul|qmma|loop_add_fusion' --metrics gpu__time_duration.sum --csv \\
      --log-file /tmp/d.csv python3 scripts/profile_kernel.py --formats=Q8_0,IQ2_XXS --t_rows=1,4 \\
      --configs_out=/tmp/c.json
  python3 scripts/profile_kernel.py --table_from=/tmp/d.csv --configs_in=/tmp/c.json

--formats, --shapes, --t_rows and --copy_mib are those of scripts/bench_kernels.py (by default every format and
shape, T = 1 and a 1024 MiB copy).
"""

from __future__ import annotations

import csv
import json

import jax
import jax.numpy as jnp
from absl import app, flags
from bench_kernels import (  # scripts/ is on sys.path
    SHAPES,
    call_kernel,
    distinct_expert_ids,
    input_shape,
    weight_bytes,
    weight_rows,
)

from dsparkjax.formats import GGMLType
from dsparkjax.testing import synthetic
from dsparkjax.testing.timing import device_copy

FLAGS = flags.FLAGS
# --formats, --shapes and --t_rows are bench_kernels.py's flags.
flags.DEFINE_string("configs_out", None, "write the calls made, in launch order, to this JSON file")
flags.DEFINE_string("table_from", None, "instead of running: an ncu --csv log of gpu__time_duration.sum to tabulate")
flags.DEFINE_string("configs_in", None, "with --table_from: the --configs_out file of the profiled run")
flags.DEFINE_float("copy_gbps", None, "with --table_from: device copy bandwidth (GB/s) for the % column "
                   "(default: from the run's copy launches: after its calls the run copies a --copy_mib buffer "
                   "twice (timing.device_copy), so that the same profiler times the copy)")
flags.DEFINE_list("copy_sizes_mb", [], "after the bandwidth copy, copies moving these many MB (read + write) twice "
                  "each: what a kernel of a call's size costs at least (launch, ramp and DRAM latency included)")


def run_call(ggml_type: GGMLType, shape: str, t_rows: int) -> int:
    """Runs one call at `shape` twice; returns the weight bytes it reads (each distinct expert once)."""
    key = jax.random.PRNGKey(0)
    x = jax.random.normal(key, input_shape(shape, t_rows), jnp.float32)
    w = synthetic.random_packed(key, ggml_type, weight_rows(shape), SHAPES[shape].k)
    ids = distinct_expert_ids(key, t_rows, shape) if SHAPES[shape].topk else None
    call = jax.jit(lambda x, w, ids: call_kernel(shape, ggml_type, x, w, ids, "ffi"))
    for _ in range(2):
        jax.block_until_ready(call(x, w, None if ids is None else jnp.asarray(ids)))
    return weight_bytes(w, ids)


def run_copy(nbytes: int) -> int:
    """Copies a float32 buffer of `nbytes` bytes twice (one kernel each); returns the bytes each copy moves
    (read + write)."""
    buf = jnp.zeros((nbytes // 4,), jnp.float32)
    for _ in range(2):
        jax.block_until_ready(device_copy(buf))
    return 2 * buf.nbytes


def read_durations(durations_csv: str) -> list[tuple[str, float]]:
    """(kernel name, microseconds) of each profiled launch of an ncu `--csv` gpu__time_duration.sum log."""
    with open(durations_csv) as f:
        rows = [r for r in csv.DictReader(line for line in f if line.startswith('"'))
                if r.get("Metric Name") == "gpu__time_duration.sum"]
    scale = {"ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3, "nsecond": 1e-3}
    return [(r["Kernel Name"], float(r["Metric Value"].replace(",", "")) * scale[r["Metric Unit"]]) for r in rows]


def is_matmul(kernel_name: str) -> bool:
    """Whether a profiled kernel is a packed matmul: the dp4a matvec (qmatmul*) or the tensor-core kernel
    (qmma_kernel), which takes dense calls of several tokens."""
    return "qmatmul" in kernel_name or "qmma" in kernel_name


def print_table(durations_csv: str, configs_json: str, copy_gbps: float | None) -> None:
    """Durations of the second launch of each call, GB/s, % of copy bandwidth and time(T) / time(T=1), after
    the copies' durations. The copy launches are the last profiled launches that are not a matmul: two of
    the bandwidth copy, then two per size probe. The copy bandwidth is `copy_gbps` or, when None, that of the
    faster bandwidth-copy launch."""
    launches = read_durations(durations_csv)
    with open(configs_json) as f:
        configs = json.load(f)
    calls = [us for name, us in launches if is_matmul(name)]
    if len(calls) != 2 * len(configs["calls"]):
        raise SystemExit(f"{durations_csv}: {len(calls)} profiled launches, expected 2 per call "
                         f"({len(configs['calls'])} calls)")
    probes = configs.get("copy_sizes", [])
    n_copies = 2 * (bool(configs.get("copy_bytes")) + len(probes))
    copies = [us for name, us in launches if not is_matmul(name)][-n_copies:] if n_copies else []
    if len(copies) < n_copies:
        if copy_gbps is None or probes:
            raise SystemExit(f"{durations_csv}: {len(copies)} copy launches profiled, expected {n_copies} (run "
                             "with an ncu kernel filter that takes the copies, or pass --copy_gbps)")
        copies = []  # the given bandwidth stands in for the copy the profiler left out
    if copies and configs.get("copy_bytes"):
        measured = configs["copy_bytes"] / min(copies[:2]) / 1e3
        print(f"device copy bandwidth (kernel duration, read + write of {configs['copy_bytes'] / 2**21:.0f} MiB): "
              f"{measured:.0f} GB/s")
        copy_gbps = copy_gbps or measured
        copies = copies[2:]
    if copy_gbps is None:
        raise SystemExit(f"{durations_csv}: no copy launches profiled (run with --copy_mib and an ncu kernel "
                         "filter that takes the copy), or pass --copy_gbps")
    for i, nbytes in enumerate(probes):
        us = min(copies[2 * i:2 * i + 2])
        print(f"copy of {nbytes / 1e6:.1f} MB (read + write): {us:.1f} us, {nbytes / us / 1e3:.0f} GB/s "
              f"({100 * nbytes / us / 1e3 / copy_gbps:.0f}% of the copy bandwidth)")
    print(f"{'format':8s} {'shape':11s} {'T':>2s} {'us':>8s} {'GB/s':>7s} {'%copy':>6s} {'T/T1':>5s}")
    base = {}
    for c, us in zip(configs["calls"], calls[1::2]):
        key = (c["format"], c["shape"])
        base.setdefault(key, us)
        gbps = c["bytes"] / us / 1e3
        print(f"{c['format']:8s} {c['shape']:11s} {c['T']:2d} {us:8.1f} {gbps:7.0f} {100 * gbps / copy_gbps:5.0f}% "
              f"{us / base[key]:5.2f}")


def main(argv: list[str]) -> None:
    del argv
    if FLAGS.table_from:
        print_table(FLAGS.table_from, FLAGS.configs_in, FLAGS.copy_gbps)
        return
    configs = []
    for fmt in FLAGS.formats:
        for shape in FLAGS.shapes:
            for t_rows in map(int, FLAGS.t_rows or [1]):
                moved = run_call(GGMLType[fmt], shape, t_rows)
                configs.append({"format": fmt, "shape": shape, "T": t_rows, "bytes": moved})
    copy_bytes = run_copy(FLAGS.copy_mib << 20) if FLAGS.copy_mib else 0
    copy_sizes = [run_copy(int(float(mb) * 1e6 / 2) // 4 * 4) for mb in FLAGS.copy_sizes_mb]
    print(f"ran {len(configs)} calls twice each on {jax.devices()[0].device_kind}"
          + (f", then a {FLAGS.copy_mib} MiB copy twice" if copy_bytes else "")
          + (f", then copies of {', '.join(FLAGS.copy_sizes_mb)} MB twice each" if copy_sizes else ""))
    if FLAGS.configs_out:
        with open(FLAGS.configs_out, "w") as f:
            json.dump({"calls": configs, "copy_bytes": copy_bytes, "copy_sizes": copy_sizes}, f, indent=1)


if __name__ == "__main__":
    app.run(main)
