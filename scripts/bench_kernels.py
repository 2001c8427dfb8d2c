"""Benchmark the packed matmul kernels at DS4-Flash decode shapes against the device's copy bandwidth.

For each format, shape and T = 1..--t_max: device time per call, achieved GB/s of weight bytes read (each
distinct expert counted once), that as a fraction of the device copy bandwidth measured in the same run
(read + write of --copy_mib buffers, timed by the same slope: `dsparkjax.testing.timing.copy_bandwidth`), and the
ratio time(T) / time(first T).

The time per call is the slope between a program of --calls and one of 2·--calls calls (so the program's
fixed dispatch cost drops out and each call's launch gap stays in), and the calls rotate over distinct
weight copies (dense shapes) or distinct expert ids (MoE shapes) so the weights each call reads are not in
the 50 MB L2 from an earlier call. The calls are independent, so the GPU may overlap neighbouring small
calls (XLA runs them as one command buffer): the slope is a stream's cost per call, not one kernel's
duration; `profile_kernel.py` tabulates each kernel alone under Nsight Compute.
Prints a table; --json_out writes the rows. With --dense_copy the dense and grouped shapes run the model's
route for calls of many rows instead (`dsparkjax.model.weights`: the weight dequantized in the graph to
bfloat16, then XLA's GEMM), which sets KernelPolicy.gemm_min_rows: compare it with the kernel at the same --t_rows.
--mma picks the GPU's tensor-core mode (off: the matvec, force: the tensor-core kernel wherever it can run).

  python scripts/bench_kernels.py --formats=Q8_0,IQ2_XXS --t_max=5 --json_out=/tmp/bench.json
  python scripts/bench_kernels.py --formats=Q8_0 --shapes=attn_a,dense_8k --t_rows=16,64,384 --dense_copy
"""

from __future__ import annotations

import json
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from dsparkjax import kernels
from dsparkjax.formats import GGMLType
from dsparkjax.model import weights as model_weights
from dsparkjax.testing import synthetic
from dsparkjax.testing.timing import copy_bandwidth, seconds_per_call

FLAGS = flags.FLAGS
flags.DEFINE_list(
    "formats",
    "Q8_0,Q2_K,Q4_K,IQ2_XXS,Q4_0_ROCMFP4_FAST,Q4_0_ROCMFP4,Q2_0_ROCMFP2,Q3_0_ROCMFPX,Q6_0_ROCMFPX,Q8_0_ROCMFPX",
    "GGMLType names to benchmark",
)
flags.DEFINE_list("shapes", "attn_a,wide_b,grouped_o,dense_8k,exp_up6,exp_up24,exp_down6,exp_down24",
                  "shape names (SHAPES; also bench_up4, bench_down4: the generation benchmark model's experts)")
flags.DEFINE_integer("t_max", 5, "largest T (rows per call): T = 1..t_max")
flags.DEFINE_list("t_rows", [], "the T values instead of 1..t_max")
flags.DEFINE_bool("dense_copy", False, "dense and grouped shapes: dense copy + XLA GEMM instead of the kernel")
flags.DEFINE_integer("calls", 64, "calls of the shorter timed program (the longer one makes twice as many)")
flags.DEFINE_integer("rotate_mib", 256, "dense shapes rotate over weight copies totalling at least this much")
flags.DEFINE_integer("reps", 20, "timed repetitions of each program (the fastest is used)")
flags.DEFINE_integer("copy_mib", 1024, "buffer size of the copy-bandwidth probe")
flags.DEFINE_enum("backend", "ffi", ["ffi", "reference"], "kernel backend")
flags.DEFINE_enum("mma", "auto", ["off", "auto", "force"], "the GPU's tensor-core mode (KernelPolicy.mma)")
flags.DEFINE_string("json_out", None, "write the result rows to this JSON file")

class Shape(NamedTuple):
    """One benchmarked call: K -> N in `groups` groups; for MoE shapes `topk` of `experts` selected per token."""

    k: int
    n: int
    groups: int = 1
    topk: int = 0  # 0: dense (or grouped)
    experts: int = 256


SHAPES = {
    "attn_a": Shape(4096, 1024),  # 4096 -> 1024
    "wide_b": Shape(1024, 32768),  # 1024 -> 32768
    "grouped_o": Shape(4096, 1024, groups=8),  # 32768 in 8 groups of 4096 -> 1024 each, one qmatmul_grouped call
    "dense_8k": Shape(8192, 4096),  # 8192 -> 4096
    "exp_up6": Shape(4096, 2048, topk=6),  # routed expert gate/up, 6 of 256 per token
    "exp_up24": Shape(4096, 2048, topk=24),
    "exp_down6": Shape(2048, 4096, topk=6),  # routed expert down
    "exp_down24": Shape(2048, 4096, topk=24),
    # an expert's gate and up projections in one call (their rows stacked), against two calls of exp_up*
    "exp_gate_up6": Shape(4096, 4096, topk=6),
    "exp_gate_up24": Shape(4096, 4096, topk=24),
    # attention's kv projection (4096 -> 512), and attn_a's wq_a with it in one call
    "attn_kv": Shape(4096, 512),
    "attn_a_kv": Shape(4096, 1536),
    # the shared expert's gate or up (4096 -> 2048), and both in one call
    "shexp_up": Shape(4096, 2048),
    "shexp_gate_up": Shape(4096, 4096),
    # bench_generate.py's wide model: 4 of 32 experts, hidden 512, expert width 256. At its batch of 64 rows
    # (or 384 in the width-6 program) each expert serves 8 (48) tokens, over rows of one or two Q2_K blocks.
    "bench_up4": Shape(512, 256, topk=4, experts=32),
    "bench_down4": Shape(256, 512, topk=4, experts=32),
}


def distinct_expert_ids(key: jax.Array, t_rows: int, name: str) -> np.ndarray:
    """ids int32 [t_rows, topk] of MoE shape `name`: each token's experts are distinct (a top-k never repeats
    an expert)."""
    shape = SHAPES[name]
    keys = jax.random.split(key, t_rows)
    return np.stack([np.asarray(jax.random.permutation(kk, shape.experts))[:shape.topk]
                     for kk in keys]).astype(np.int32)


def weight_rows(name: str) -> tuple[int, int]:
    """Leading shape of a shape's packed weight: (experts, N) for MoE shapes, (groups, N) otherwise."""
    shape = SHAPES[name]
    return (shape.experts if shape.topk else shape.groups, shape.n)


def input_shape(name: str, t_rows: int) -> tuple[int, ...]:
    """Activations of one call: `[T, K]` for MoE shapes, `[T, groups, K]` otherwise."""
    shape = SHAPES[name]
    return (t_rows, shape.k) if shape.topk else (t_rows, shape.groups, shape.k)


def call_kernel(name: str, t: GGMLType, x: jax.Array, w: jax.Array, ids: jax.Array | None, backend: str) -> jax.Array:
    """One call at shape `name` as the model makes it: MoE by expert id, one grouped call for all groups
    (the grouped output projection), or a dense matmul; with --dense_copy the latter two through the dense
    copy the model multiplies for calls of many rows."""
    shape = SHAPES[name]
    k_dim, groups = shape.k, shape.groups
    if shape.topk:
        return kernels.qmatmul_id(x, w, ids, t, backend=backend)
    if FLAGS.dense_copy:
        rows = w.reshape(-1, w.shape[-1])  # [groups * N, row_bytes], as the model holds a grouped weight
        packed = model_weights.PackedWeight(rows, int(t), k_dim, jnp.dtype(jnp.bfloat16), backend)
        dense = model_weights.dense_copy(packed)
        return model_weights.linear(x if groups > 1 else x[:, 0], dense, groups=groups if groups > 1 else None)
    if groups > 1:
        return kernels.qmatmul_grouped(x, w, t, backend=backend, mma=FLAGS.mma)
    return kernels.qmatmul(x[:, 0], w[0], t, backend=backend, mma=FLAGS.mma)


def weight_bytes(w: jax.Array, ids: np.ndarray | None) -> int:
    """Weight bytes one call reads: each distinct selected expert once, or the whole (grouped) weight."""
    return int(len(np.unique(ids)) * w.shape[1] * w.shape[2]) if ids is not None else int(w.size)


def bench_shape(t: GGMLType, name: str, t_values: list[int]) -> list[dict]:
    """Rows of results for one format and shape, one per T."""
    topk = SHAPES[name].topk
    key = jax.random.PRNGKey(int(t))
    experts, backend, calls = topk > 0, FLAGS.backend, FLAGS.calls
    one = synthetic.random_packed(key, t, weight_rows(name), SHAPES[name].k)
    # Dense and grouped shapes rotate through weights so that L2 holds none between calls; through the dense
    # copy every call needs its own, since XLA dequantizes each distinct weight once per program and merges
    # the GEMMs that share one (shared weights time below the bandwidth floor).
    if experts:
        copies = 1
    elif FLAGS.dense_copy:
        copies = 2 * calls
    else:
        copies = max(1, min(2 * calls, math.ceil((FLAGS.rotate_mib << 20) / one.nbytes)))
    weights = [one] + [synthetic.random_packed(jax.random.fold_in(key, i), t, weight_rows(name), SHAPES[name].k)
                       for i in range(1, copies)]

    def make_program(m: int):
        @jax.jit
        def prog(ws: list[jax.Array], xs: list[jax.Array], ids: list[jax.Array]) -> list[jax.Array]:
            return [call_kernel(name, t, xs[c], ws[c % len(ws)], ids[c] if experts else None, backend)
                    for c in range(m)]
        return prog

    rows, base = [], None
    for t_rows in t_values:
        data_key = jax.random.fold_in(key, t_rows)
        xs = [jax.random.normal(jax.random.fold_in(data_key, c), input_shape(name, t_rows), jnp.float32)
              for c in range(2 * calls)]
        ids = [distinct_expert_ids(jax.random.fold_in(data_key, 10_000 + c), t_rows, name)
               for c in range(2 * calls)] if experts else []
        id_arrays = [jnp.asarray(i) for i in ids]
        sec = seconds_per_call(make_program, lambda m: (weights, xs[:m], id_arrays[:m]), calls, FLAGS.reps)
        # averaged over the calls (each call's experts differ)
        moved = np.mean([weight_bytes(weights[0], i) for i in ids]) if experts else weight_bytes(weights[0], None)
        base = base if base is not None else sec
        rows.append(
            {"format": t.name, "shape": name, "T": t_rows, "us": sec * 1e6, "bytes": int(moved),
             "gbps": moved / sec / 1e9, "ratio_vs_first": sec / base, "dense_copy": FLAGS.dense_copy and not topk}
        )
    return rows


def main(argv: list[str]) -> None:
    del argv
    print(f"jax {jax.__version__}, device {jax.devices()[0].device_kind}, backend {FLAGS.backend}"
          + (", dense and grouped shapes through the dense copy" if FLAGS.dense_copy else ""))
    t_values = [int(v) for v in FLAGS.t_rows] or list(range(1, FLAGS.t_max + 1))
    copy_bw = copy_bandwidth(FLAGS.copy_mib, FLAGS.reps)
    print(f"device copy bandwidth (read + write of {FLAGS.copy_mib} MiB buffers, slope of 4 vs 8 copies): "
          f"{copy_bw / 1e9:.0f} GB/s")
    print(f"{'format':20s} {'shape':11s} {'T':>3s} {'us':>9s} {'GB/s':>7s} {'%copy':>6s} {'ratio':>5s}")
    results = []
    for fmt in FLAGS.formats:
        for name in FLAGS.shapes:
            for r in bench_shape(GGMLType[fmt], name, t_values):
                r["frac_copy"] = r["gbps"] * 1e9 / copy_bw
                results.append(r)
                print(f"{r['format']:20s} {r['shape']:11s} {r['T']:3d} {r['us']:9.1f} {r['gbps']:7.1f} "
                      f"{100 * r['frac_copy']:5.0f}% {r['ratio_vs_first']:5.2f}", flush=True)
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump({"jax": jax.__version__, "device": jax.devices()[0].device_kind, "copy_gbps": copy_bw / 1e9,
                       "backend": FLAGS.backend, "dense_copy": FLAGS.dense_copy, "calls": FLAGS.calls,
                       "rotate_mib": FLAGS.rotate_mib, "rows": results}, f, indent=1)


if __name__ == "__main__":
    app.run(main)
