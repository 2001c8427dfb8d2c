"""What one compiled target step costs on the device, without the generation loop around it.

    python scripts/bench_step.py --config wide --dtype bfloat16 --recipe published --prompts 64 --widths 1,6
    python scripts/bench_step.py --recipe published --widths 1 --trace

Builds bench_generate.py's model (its flags: `--config`, `--layers`, `--dtype`, `--recipe`, `--kernels`;
`--prompts` is the batch), then for each width q runs the jitted step `--steps` times back to back, the state donated and
threaded through (the tokens fixed, nothing committed, so every call does the same work), timed from the
first call to the last result, the fastest of `--reps`. That is the device program's cost plus jit dispatch:
generation's ms/step (bench_generate.py) adds its host loop to it (accept, commit, the next tokens). With
`--trace`, one more run of each width under the profiler gives the device's busy fraction, the kernels per
step and the gaps between them (profile_generate.py's summary), which tell a launch-bound step from a
compute-bound one. XLA_FLAGS apply as usual, so flags that change how steps launch can be compared in one
device call.
"""

from __future__ import annotations

import glob
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging
from bench_generate import bench_model  # scripts/ is on sys.path
from profile_generate import summarise

from dsparkjax.decoding.program import step_program
from dsparkjax.model.state import init_state

FLAGS = flags.FLAGS
flags.DEFINE_list("widths", ["1", "6"], "step widths q to time")
flags.DEFINE_integer("steps", 32, "steps per timed run")
# --reps (timed runs per width; the fastest is reported) is bench_generate's flag, defined with bench_model's.
flags.DEFINE_integer("context", 256, "state capacity in tokens (the cache sizes)")
flags.DEFINE_bool("trace", False, "also run each width once under the profiler and summarise the trace")


def run_steps(step, params, state, tokens: jax.Array, n: int):
    """`n` steps from `state` (donated), the last step's logits blocked on; returns (seconds, final state)."""
    start = time.perf_counter()
    for _ in range(n):
        logits, _, state = step(params, state, tokens)
    jax.block_until_ready(logits)
    return time.perf_counter() - start, state


def main(argv: list[str]) -> None:
    del argv
    logging.set_verbosity(logging.WARNING)
    target, _, prompts = bench_model()
    cfg, batch = target.config, len(prompts)
    step = step_program(cfg, target.options())
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, {FLAGS.config} model, {FLAGS.dtype}, "
          f"recipe {FLAGS.recipe} ({target.kernels} matrices), batch {batch}")
    for q in (int(w) for w in FLAGS.widths):
        state = init_state(cfg, batch, FLAGS.context, q, target.dtype)
        rng = np.random.default_rng(q)
        tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, q)), jnp.int32)
        start = time.perf_counter()
        step.compile(target.params, state, tokens)
        compile_s = time.perf_counter() - start
        _, state = run_steps(step, target.params, state, tokens, 2)  # warm-up
        best = float("inf")
        for _ in range(FLAGS.reps):
            seconds, state = run_steps(step, target.params, state, tokens, FLAGS.steps)
            best = min(best, seconds)
        print(f"width {q}: {batch * q} rows per matmul, {best / FLAGS.steps * 1e3:.3f} ms per step "
              f"(fastest of {FLAGS.reps} runs of {FLAGS.steps} steps; compiled in {compile_s:.1f} s)", flush=True)
        if FLAGS.trace:
            folder = tempfile.mkdtemp(prefix="dsparkjax-step-trace-")
            with jax.profiler.trace(folder):
                _, state = run_steps(step, target.params, state, tokens, FLAGS.steps)
            (path,) = glob.glob(f"{folder}/**/*.xplane.pb", recursive=True)
            print(f"trace of {FLAGS.steps} steps of width {q}:")
            print("\n".join(summarise(path, FLAGS.top)), flush=True)


if __name__ == "__main__":
    app.run(main)
