"""Check that a decode step is batch invariant: every row of a step of width q = 1..6 and batch B in {1, 3, 8}
carries the bits of plain decoding (q = 1, B = 1) of its sequence, for the target and the drafter. The drafter is
checked under its batch-invariant policy, the one lossless mode runs it with (its drafts decide that mode's tokens);
exact and fast modes run it in XLA's order (docs/decoding.md, "The drafter's policy").

    python scripts/check_invariance.py                                   # the embedded pair
    python scripts/check_invariance.py --target T.gguf --draft D.gguf
    python scripts/check_invariance.py --config ds4 --layers 4 --dtype bfloat16   # random DS4 weights (GPU)

Sequences are prefilled with random tokens to lengths past the sliding window and next to the compressor
boundaries (dsparkjax/testing/invariance.py). Prints the quantities that differ per width and batch, then
`max bit differences: N`; exits 0 only when N is 0.
"""

from __future__ import annotations

import sys

from absl import app, flags

_TARGET = flags.DEFINE_string("target", None, "Target GGUF (default: the embedded pair's).")
_DRAFT = flags.DEFINE_string("draft", None, "Drafter GGUF (default: the embedded pair's when --target is unset).")
_CONFIG = flags.DEFINE_enum("config", None, ["ds4"], "Instead of files: DeepSeek-V4-Flash's dims with random packed "
                            "weights made on the device and its DSpark drafter (the published recipe, as "
                            "scripts/bench.py builds them).")
_LAYERS = flags.DEFINE_integer("layers", 4, "With --config ds4: the target's first N layers.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Compute dtype.")
_KERNELS = flags.DEFINE_enum("kernels", "auto", ["auto", "dequantize", "ffi", "reference"],
                             "How matrices run (load_target's `kernels`).")
_SEQUENCES = flags.DEFINE_integer("sequences", 8, "Prefilled sequences the batches are drawn from.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the prompts, the stepped tokens and the batches.")


def load(config: str | None):
    """(target, drafter) of the flags."""
    import jax.numpy as jnp

    from dsparkjax import kernels
    from dsparkjax.decoding.proposer import Drafter
    from dsparkjax.pair import load_pair
    from dsparkjax.target_api import DTYPES, Target

    if config == "ds4":
        from dsparkjax.config import deepseek_v4_flash, dspark_flash
        from dsparkjax.model.params import load_drafter_params, load_target_params
        from dsparkjax.tiny import random_sources

        tcfg, dcfg = deepseek_v4_flash(_LAYERS.value), dspark_flash(_LAYERS.value)
        backend = kernels.default_backend() if _KERNELS.value == "auto" else _KERNELS.value
        pack, dtype = (None if backend == "dequantize" else backend), DTYPES[_DTYPE.value]
        tsrc, dsrc = random_sources(tcfg, dcfg, seed=_SEED.value, recipe="published")
        target = Target("random ds4", tcfg, load_target_params(tsrc, tcfg, dtype, pack), dtype, True, None, backend)
        return target, Drafter("random ds4", dcfg, load_drafter_params(dsrc, dcfg, jnp.dtype(dtype), pack), target)
    pair = load_pair(_TARGET.value, _DRAFT.value, dtype=_DTYPE.value, kernels=_KERNELS.value)
    return pair.target, pair.drafter


def main(argv: list[str]) -> None:
    del argv
    from dsparkjax import runtime

    runtime.configure()
    import jax

    from dsparkjax.testing import invariance

    target, drafter = load(_CONFIG.value)
    print(f"{jax.devices()[0].device_kind}, {_DTYPE.value}, kernels={target.kernels}, "
          f"{target.config.num_layers} layers")
    setup = invariance.prefilled(target, drafter, invariance.default_lengths(target, _SEQUENCES.value), _SEED.value)
    diffs = invariance.check_target(target, setup, seed=_SEED.value)
    if drafter is not None:
        print("drafter: under its batch-invariant policy (lossless mode's; exact and fast modes run XLA's order)")
        diffs += invariance.check_drafter(drafter, setup, seed=_SEED.value)
    print(invariance.report(diffs))
    sys.exit(0 if all(d.max_bits == 0 for d in diffs) else 1)


if __name__ == "__main__":
    app.run(main)
