"""Run one packed-matmul call at a DS4-Flash decode shape, for a profiler to look at.

The call runs twice, once to compile and warm up and once to be profiled, and nothing else runs on the
device (no copy probe, no weight rotation), so Nsight Compute can be pointed at the second launch:

  ncu --clock-control none -k regex:qmatmul --launch-skip 1 --launch-count 1 --set full \\
      python3 scripts/profile_kernel.py --format=IQ2_XXS --shape=exp_up24

Shapes are those of scripts/bench_kernels.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from absl import app, flags

from bench_kernels import N_EXPERTS, SHAPES, distinct_expert_ids  # scripts/ is on sys.path
from dsparkjax import kernels
from dsparkjax.formats import GGMLType
from dsparkjax.kernels import synthetic

FLAGS = flags.FLAGS
flags.DEFINE_string("format", "IQ2_XXS", "GGMLType name")
flags.DEFINE_enum("shape", "exp_up24", list(SHAPES), "shape name (bench_kernels.py)")
flags.DEFINE_integer("t_rows", 1, "tokens per call (T)")


def main(argv: list[str]) -> None:
    del argv
    ggml_type = GGMLType[FLAGS.format]
    k_dim, n, _, topk = SHAPES[FLAGS.shape]
    key = jax.random.PRNGKey(0)
    x = jax.random.normal(key, (FLAGS.t_rows, k_dim), jnp.float32)
    if topk:
        w = synthetic.random_packed(key, ggml_type, (N_EXPERTS, n), k_dim)
        ids = jnp.asarray(distinct_expert_ids(key, FLAGS.t_rows, topk))
        call = jax.jit(lambda x, w, ids: kernels.qmatmul_id(x, w, ids, ggml_type, backend="ffi"))
        args = (x, w, ids)
    else:
        w = synthetic.random_packed(key, ggml_type, (n,), k_dim)
        call = jax.jit(lambda x, w: kernels.qmatmul(x, w, ggml_type, backend="ffi"))
        args = (x, w)
    for _ in range(2):
        jax.block_until_ready(call(*args))
    print(f"ran {FLAGS.format} {FLAGS.shape} T={FLAGS.t_rows} twice on {jax.devices()[0].device_kind}")


if __name__ == "__main__":
    app.run(main)
