"""What one compiled target step costs on the device, without the generation loop around it.

    python scripts/bench_step.py --config wide --dtype bfloat16 --recipe published --prompts 64 --widths 1,6
    python scripts/bench_step.py --recipe published --widths 1 --trace
    python scripts/bench_step.py --config ds4 --layers 8 --recipe published --prompts 1 --cases 1k:1k,1k:64k,8k:64k

Builds bench_generate.py's model (its flags: `--config`, `--layers`, `--dtype`, `--recipe`, `--kernels`;
`--prompts` is the batch), then for each width q runs the jitted step `--steps` times back to back, the state donated and
threaded through (the tokens fixed, nothing committed, so every call does the same work), timed from the
first call to the last result, the fastest of `--reps`. That is the device program's cost plus jit dispatch:
generation's ms/step (bench_generate.py) adds its host loop to it (accept, commit, the next tokens). With
`--trace`, one more run of each width under the profiler gives the device's busy fraction, the kernels per
step and the gaps between them (profile_generate.py's summary), which tell a launch-bound step from a
compute-bound one. `--programs invariant,fast` times exact decoding's batch-invariant step and then XLA's
own (fast mode's) on the same model. XLA_FLAGS apply as usual, so flags that change how steps launch can be
compared in one device call.

`--cases CONTEXT:CAPACITY,...` times each width in states of each capacity whose last step row sees CONTEXT
tokens (length CONTEXT − q), and prints each case's time against the first case of the same context:
a step's cost should follow its context, not the capacity the state was sized for (issue 38, item 3).
"""

from __future__ import annotations

import dataclasses
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
flags.DEFINE_list("programs", ["invariant"], "which step programs to time, one after the other on the same model: "
                  "invariant (exact decoding's batch-invariant step, where the target can run it) and/or fast "
                  "(XLA's own contractions)")
flags.DEFINE_integer("steps", 32, "steps per timed run")
# --reps (timed runs per width; the fastest is reported) is bench_generate's flag, defined with bench_model's.
flags.DEFINE_integer("context", 256, "state capacity in tokens (the cache sizes)")
flags.DEFINE_bool("trace", False, "also run each width once under the profiler and summarise the trace")
flags.DEFINE_enum("indexer", "auto", ["auto", "ffi", "reference"], "the CSA indexer's top-k: auto = the target's "
                  "own choice (ffi with the ffi kernels); reference = the jnp path that scores every entry the "
                  "state holds (what the step ran before the length-bound op)")
flags.DEFINE_list("cases", [], "CONTEXT:CAPACITY pairs in tokens, k = 1024 (e.g. 1k:1k,1k:64k): time each width "
                  "with the state sized for CAPACITY and CONTEXT tokens visible to the step's last row; empty: "
                  "one case, an empty state of capacity --context")


def parse_tokens(text: str) -> int:
    """'1k' -> 1024, '64k' -> 65536, '300' -> 300."""
    text = text.strip().lower()
    try:
        return int(text[:-1]) * 1024 if text.endswith("k") else int(text)
    except ValueError:
        raise app.UsageError(f"--cases: {text!r} is not a token count such as 1k or 300") from None


def parse_cases(cases: list[str]) -> list[tuple[int, int]]:
    """`--cases` as (context, capacity) pairs; the context must fit the capacity."""
    parsed = []
    for case in cases:
        context, sep, capacity = case.partition(":")
        if not sep:
            raise app.UsageError(f"--cases: {case!r} is not CONTEXT:CAPACITY")
        pair = parse_tokens(context), parse_tokens(capacity)
        if not 0 < pair[0] <= pair[1]:
            raise app.UsageError(f"--cases: {case!r} needs 0 < CONTEXT <= CAPACITY")
        parsed.append(pair)
    return parsed


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
    bad = set(FLAGS.programs) - {"invariant", "fast"}
    if bad:
        raise app.UsageError(f"--programs: {sorted(bad)} are not invariant or fast")
    cases = parse_cases(FLAGS.cases) or [(None, FLAGS.context)]
    target, _, prompts = bench_model()
    cfg, batch = target.config, len(prompts)
    for program in FLAGS.programs:
        options = target.options(invariant=program == "invariant")
        if FLAGS.indexer != "auto":
            policy = dataclasses.replace(options.policy, indexer_backend=FLAGS.indexer)
            options = dataclasses.replace(options, policy=policy)
        print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, {FLAGS.config} model, {FLAGS.dtype}, "
              f"recipe {FLAGS.recipe} ({target.kernels} matrices, {options.policy.indexer_backend} indexer), batch "
              f"{batch}, {'batch-invariant' if options.policy.invariant else 'fast (XLA contractions)'} step")
        time_widths(target, step_program(cfg, options), batch, cases)


def time_widths(target, step, batch: int, cases: list[tuple[int | None, int]]) -> None:
    """Print the ms per step of the compiled `step` of `target` for `batch` sequences at each --widths width and
    each (context, capacity) case."""
    cfg = target.config
    for q in (int(w) for w in FLAGS.widths):
        rng = np.random.default_rng(q)
        tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, q)), jnp.int32)
        by_context: dict[int, tuple[int, float]] = {}  # context -> (its first case's capacity, its ms)
        for context, capacity in cases:
            state = init_state(cfg, batch, capacity, q, target.dtype, target.plan)
            if context is not None:
                if context < q:
                    raise app.UsageError(f"--cases: context {context} is shorter than width {q}")
                state = state.replace(length=jnp.full((batch,), context - q, jnp.int32))
            start = time.perf_counter()
            step.compile(target.params, state, tokens)
            compile_s = time.perf_counter() - start
            _, state = run_steps(step, target.params, state, tokens, 2)  # warm-up
            best = float("inf")
            for _ in range(FLAGS.reps):
                seconds, state = run_steps(step, target.params, state, tokens, FLAGS.steps)
                best = min(best, seconds)
            ms = best / FLAGS.steps * 1e3
            label = f"width {q}" if context is None else f"width {q}, context {context} in capacity {capacity}"
            base = by_context.setdefault(context, (capacity, ms)) if context is not None else None
            versus = f", {ms / base[1]:.3f}x capacity {base[0]}" if base and base[0] != capacity else ""
            print(f"{label}: {batch * q} rows per matmul, {ms:.3f} ms per step{versus} "
                  f"(fastest of {FLAGS.reps} runs of {FLAGS.steps} steps; compiled in {compile_s:.1f} s)", flush=True)
            if FLAGS.trace:
                folder = tempfile.mkdtemp(prefix="dsparkjax-step-trace-")
                with jax.profiler.trace(folder):
                    _, state = run_steps(step, target.params, state, tokens, FLAGS.steps)
                (path,) = glob.glob(f"{folder}/**/*.xplane.pb", recursive=True)
                print(f"trace of {FLAGS.steps} steps of {label}:")
                print("\n".join(summarise(path, FLAGS.top)), flush=True)


if __name__ == "__main__":
    app.run(main)
