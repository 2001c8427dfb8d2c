"""Start-up cost of one target step program: seconds to trace and lower it, then to compile it, in this process.

Run it twice on one cache (`$DSPARKJAX_CACHE`, or `$DSPARKJAX_XLA_CACHE`): the first start traces, exports and
compiles the step; the second loads the exported module (`dsparkjax.exported`) and the executable
(docs/bench.md, "Start-up"). The model is built on shapes alone (nothing is allocated), as
scripts/step_census.py builds it, so DS4's full dims run on a CPU:

    python scripts/startup_compile.py --config=ds4 --layers=43   # twice

Prints one JSON line: trace_lower_s, compile_s, total_s, and the entries this process wrote to the exported
directory and to the compilation cache (0 and 0 on a warm start). `--noexported` runs a plain jit of the step
instead: its second start is what every warm start cost before the exported-program cache.
"""

from __future__ import annotations

import json
import time

from absl import app, flags
from bench_results import count_files

_CONFIG = flags.DEFINE_enum("config", "ds4", ["ds4", "tiny"], "DS4's dims, or the tiny test target's.")
_LAYERS = flags.DEFINE_integer("layers", 43, "The config's first N layers.")
_WIDTH = flags.DEFINE_integer("width", 1, "Rows per sequence of the step.")
_BATCH = flags.DEFINE_integer("batch", 1, "Sequences per step.")
_CONTEXT = flags.DEFINE_integer("context", 1024, "State capacity in tokens.")
_INVARIANT = flags.DEFINE_bool("invariant", False, "The exact (row-invariant) program instead of the fast one.")
_EXPORTED = flags.DEFINE_bool("exported", True, "Through the exported-program cache (step_program); false: a plain "
                              "jit of the step, as every start traced and lowered it before dsparkjax/exported.py.")


def main(argv: list[str]) -> None:
    del argv
    from dsparkjax import runtime

    cache = runtime.configure().cache_dir  # before JAX touches a device
    import jax
    import jax.numpy as jnp

    from dsparkjax import exported
    from dsparkjax.aot import AotFunction
    from dsparkjax.config import deepseek_v4_flash, dspark_flash, tiny_drafter, tiny_target
    from dsparkjax.decoding.program import step_program
    from dsparkjax.model.state import init_state
    from dsparkjax.model.target import TargetModel
    from dsparkjax.tiny import shapes_target

    if _CONFIG.value == "ds4":
        cfg, dtype, recipe = deepseek_v4_flash(_LAYERS.value), jnp.bfloat16, "published"
        drafter_cfg = dspark_flash(_LAYERS.value)
    else:  # the published formats need wider rows than the tiny target's
        cfg, dtype, recipe = tiny_target(layers=_LAYERS.value), jnp.float32, "f32"
        drafter_cfg = tiny_drafter(cfg)
    target = shapes_target(cfg, drafter_cfg, dtype, recipe=recipe)
    state = jax.eval_shape(lambda: init_state(cfg, _BATCH.value, _CONTEXT.value, _WIDTH.value, dtype))
    tokens = jax.ShapeDtypeStruct((_BATCH.value, _WIDTH.value), jnp.int32)
    options = target.options(invariant=_INVARIANT.value)
    step = step_program(cfg, options) if _EXPORTED.value else AotFunction(
        TargetModel(cfg, options).step, donate_argnums=(1,), compiler_options=options.policy.compiler_options)

    folder = exported.directory()
    before = count_files(cache), count_files(folder)
    start = time.perf_counter()
    lowered = step.lower(target.params, state, tokens)
    lowered_at = time.perf_counter()
    lowered.compile()
    done = time.perf_counter()
    exported_written = count_files(folder) - before[1]
    print(json.dumps(dict(config=_CONFIG.value, layers=_LAYERS.value, width=_WIDTH.value, invariant=_INVARIANT.value,
                          exported=_EXPORTED.value,
                          backend=jax.default_backend(), trace_lower_s=round(lowered_at - start, 2),
                          compile_s=round(done - lowered_at, 2), total_s=round(done - start, 2),
                          exported_written=exported_written,
                          compiled_written=count_files(cache) - before[0] - exported_written)))


if __name__ == "__main__":
    app.run(main)
