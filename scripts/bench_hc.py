"""Time the mHC custom calls (HC-pre, HC-post) at decode shapes; save their outputs to compare two plugin builds.

    python scripts/bench_hc.py --shapes=64x512,384x512,1x4096,6x4096,384x4096 --save=/tmp/new.npz
    python scripts/bench_hc.py --compare=/tmp/old.npz,/tmp/new.npz

A shape TxD is T tokens of n = --streams HC streams of width D (DS4: n = 4, D = 4096; the generation benchmark's
wide model: D = 512). For each, the time per call of `kernels.hc_pre` and `kernels.hc_post` on the chosen backend
is the slope between programs of --calls and 2·--calls calls on distinct inputs (`timing.seconds_per_call`: a
stream's cost per call, launch gaps included). --save writes every output of one call per shape, on fixed seeded
inputs, so that runs with two builds of the plugins (DSPARKJAX_LIB_DIR) can be compared bit for bit with
--compare, which prints each array as equal or by how much it differs, and exits non-zero if any differs.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from dsparkjax import kernels
from dsparkjax.testing import synthetic
from dsparkjax.testing.timing import seconds_per_call

FLAGS = flags.FLAGS
flags.DEFINE_list("shapes", ["64x512", "384x512", "1x4096", "6x4096", "384x4096"], "TxD shapes")
flags.DEFINE_integer("streams", 4, "HC streams n")
flags.DEFINE_integer("iters", 20, "Sinkhorn iterations")
flags.DEFINE_integer("calls", 16, "calls of the shorter timed program (the longer one makes twice as many)")
flags.DEFINE_integer("reps", 10, "timed repetitions of each program (the fastest is used)")
flags.DEFINE_enum("backend", "ffi", ["ffi", "reference"], "kernel backend")
flags.DEFINE_string("save", None, "write every output of one call per shape to this .npz")
flags.DEFINE_list("compare", [], "two .npz files written by --save: compare them bit for bit (nothing is timed)")

HC_EPS, NORM_EPS = 1e-6, 1e-6


def hc_pre(streams: jax.Array, fn: jax.Array, base: jax.Array, scale: jax.Array) -> tuple[jax.Array, ...]:
    return kernels.hc_pre(streams, fn, base, scale, iters=FLAGS.iters, hc_eps=HC_EPS, norm_eps=NORM_EPS,
                          backend=FLAGS.backend)


def compare(a_path: str, b_path: str) -> int:
    """Print each array of two --save files as equal or by its largest difference; 1 if any differs."""
    a, b = np.load(a_path), np.load(b_path)
    if sorted(a.files) != sorted(b.files):
        print(f"the files hold different arrays: {sorted(a.files)} and {sorted(b.files)}")
        return 1
    differ = 0
    for name in sorted(a.files):
        x, y = a[name], b[name]
        if x.shape == y.shape and np.array_equal(x.view(np.uint32), y.view(np.uint32)):
            print(f"{name}: bits equal")
        else:
            differ += 1
            gap = np.abs(x - y).max() if x.shape == y.shape else float("nan")
            print(f"{name}: differs (largest difference {gap:.3g})")
    return 1 if differ else 0


def main(argv: list[str]) -> None:
    del argv
    if FLAGS.compare:
        sys.exit(compare(*FLAGS.compare))
    n = FLAGS.streams
    print(f"jax {jax.__version__}, device {jax.devices()[0].device_kind}, backend {FLAGS.backend}, n = {n}")
    saved = {}
    for index, shape in enumerate(FLAGS.shapes):
        t, d = (int(v) for v in shape.split("x"))
        # one set of mix weights per shape, distinct streams and block outputs per call (seeded per shape)
        rng = np.random.default_rng(index)
        first, fn, base, scale = (jnp.asarray(a) for a in synthetic.random_hc_inputs(rng, t, n, d))
        streams = [first] + [jnp.asarray(rng.standard_normal((t, n, d)), jnp.float32)
                             for _ in range(2 * FLAGS.calls - 1)]
        block_out = [jnp.asarray(rng.standard_normal((t, d)), jnp.float32) for _ in range(2 * FLAGS.calls)]
        u, post, comb = hc_pre(streams[0], fn, base, scale)
        out = kernels.hc_post(block_out[0], streams[0], post, comb, backend=FLAGS.backend)
        saved.update({f"{shape}.u": u, f"{shape}.post": post, f"{shape}.comb": comb, f"{shape}.out": out})
        pre_s = seconds_per_call(
            lambda m: jax.jit(lambda xs: [hc_pre(x, fn, base, scale)[0] for x in xs]),
            lambda m: (streams[:m],), FLAGS.calls, FLAGS.reps)
        post_s = seconds_per_call(
            lambda m: jax.jit(lambda fs, xs: [kernels.hc_post(f, x, post, comb, backend=FLAGS.backend)
                                              for f, x in zip(fs, xs)]),
            lambda m: (block_out[:m], streams[:m]), FLAGS.calls, FLAGS.reps)
        print(f"T = {t:4d}, D = {d:5d}: hc_pre {pre_s * 1e6:8.1f} us, hc_post {post_s * 1e6:8.1f} us per call",
              flush=True)
    if FLAGS.save:
        np.savez(FLAGS.save, **{k: np.asarray(v) for k, v in saved.items()})


if __name__ == "__main__":
    app.run(main)
