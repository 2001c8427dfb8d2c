"""Deterministic tiny target + drafter pairs: the embedded default model and the test models.

`python -m dsparkjax.tiny --out DIR` writes `DIR/target.gguf` and `DIR/draft.gguf` in seconds.

The weights are random but scaled as `ds4_arch.md` §7 recommends so that every mechanism matters:
projections with std ~2/sqrt(fan_in), comb bases near 4·I so Sinkhorn starts near identity, random HC
scales in [0.5, 1.5], non-zero compressor position biases, sinks ~ N(0, 1), router biases ~ N(0, 0.1) and
hash tables of distinct random experts per token.
"""

from __future__ import annotations

import functools
import os
import shutil
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from dsparkjax.config import DrafterConfig, TargetConfig, tiny_drafter, tiny_target
from dsparkjax.formats import FLOAT_TYPES
from dsparkjax.ggufio.contract import TensorSpec, drafter_tensor_specs, target_tensor_specs
from dsparkjax.ggufio.writer import RECIPES, RawTensor, recipe_type, write_model_gguf
from dsparkjax.kernels import KERNEL_TYPES, dequantize, synthetic

Params = dict[str, np.ndarray | RawTensor]
GENERATOR_VERSION = 1  # bump when the generated weights change


def _init_tensor(spec: TensorSpec, rng: np.random.Generator, hc_mult: int, n_experts: int) -> np.ndarray:
    """A random tensor for one contract entry, scaled by its role."""
    name, shape = spec.name, spec.shape
    if spec.family == "hash_table":  # each token routes to k distinct random experts
        vocab, k = shape
        return np.stack([rng.permutation(n_experts)[:k] for _ in range(vocab)]).astype(np.int32)
    if name.endswith("_scale.weight"):
        return rng.uniform(0.5, 1.5, shape).astype(np.float32)
    if name.endswith("_base.weight"):
        base = rng.normal(0.0, 0.5, shape)
        if shape[0] > hc_mult:  # a sub-layer's [pre | post | comb]: comb starts near 4·I
            base[2 * hc_mult :] += 4.0 * np.eye(hc_mult).reshape(-1)
        return base.astype(np.float32)
    if name.endswith("attn_sinks.weight"):
        return rng.normal(0.0, 1.0, shape).astype(np.float32)
    if name.endswith("exp_probs_b.bias"):
        return rng.normal(0.0, 0.1, shape).astype(np.float32)
    if spec.family == "vector":  # RMSNorm weights
        return (1.0 + 0.1 * rng.normal(size=shape)).astype(np.float32)
    if name.endswith("_ape.weight"):
        return rng.normal(0.0, 0.5, shape).astype(np.float32)
    if spec.family == "embedding" or name.endswith("markov.w1"):
        return rng.normal(0.0, 1.0, shape).astype(np.float32)
    fan_in = shape[-1]
    return rng.normal(0.0, 2.0 / np.sqrt(fan_in), shape).astype(np.float32)


def random_params(specs: list[TensorSpec], seed: int, hc_mult: int, n_experts: int, *,
                  packed_recipe: str | None = None, drafter: bool = False) -> Params:
    """Random parameters for every tensor of a contract, optional ones included.

    The one exception is the confidence bias: DeepSeek's confidence head has none (`dspark_reference.md` §3).
    With `packed_recipe`, the matrices that recipe stores quantized (`drafter`: the drafter's recipe) come
    already encoded: random valid blocks (`random_packed_matrix`), so that models at DS4's own size are
    written in about a minute (8 layers, 17 GB, on the H200's host) instead of quantized on the host.
    """
    rng = np.random.default_rng(seed)
    key = jax.random.key(seed)
    params: Params = {}
    for i, s in enumerate(specs):
        if s.name == "dflash.dspark.confidence.bias":
            continue
        ggml_type = recipe_type(packed_recipe, s, drafter=drafter) if packed_recipe else None
        if ggml_type is not None and ggml_type in KERNEL_TYPES and ggml_type not in FLOAT_TYPES:
            params[s.name] = random_packed_matrix(s, ggml_type, jax.random.fold_in(key, i))
        else:
            params[s.name] = _init_tensor(s, rng, hc_mult, n_experts)
    return params


@functools.cache
def _unit_std(ggml_type: int) -> float:
    """The std of `synthetic.random_packed`'s weights of a type at scale 1 (measured on 64 rows of 4096)."""
    sample = synthetic.random_packed(jax.random.key(0), ggml_type, (64,), 4096)
    return float(jnp.std(dequantize(sample, ggml_type, 4096)))


def random_packed_matrix(spec: TensorSpec, ggml_type: int, key: jax.Array) -> RawTensor:
    """Random valid blocks of `ggml_type` for a matrix, scaled to the std `_init_tensor` gives projections
    (2/sqrt(fan_in)), so activations keep the float-initialised model's magnitudes layer after layer."""
    *rows, k = spec.shape
    scale = 2.0 / np.sqrt(k) / _unit_std(ggml_type)
    data = synthetic.random_packed(key, ggml_type, tuple(rows), k, float(scale))
    return RawTensor(spec.name, ggml_type, spec.shape, np.asarray(data))


def tiny_pair(seed: int = 0, *, target_cfg: TargetConfig | None = None, drafter_cfg: DrafterConfig | None = None,
              packed_recipe: str | None = None) -> tuple[TargetConfig, Params, DrafterConfig, Params]:
    """Configs and random parameters of a tiny target and a drafter that fits it (`packed_recipe`: see
    `random_params`)."""
    target_cfg = target_cfg or tiny_target()
    drafter_cfg = drafter_cfg or tiny_drafter(target_cfg)
    target = random_params(target_tensor_specs(target_cfg), seed, target_cfg.hc_mult, target_cfg.n_routed_experts,
                           packed_recipe=packed_recipe)
    draft = random_params(drafter_tensor_specs(drafter_cfg), seed + 1, drafter_cfg.hc_mult,
                          drafter_cfg.n_routed_experts, packed_recipe=packed_recipe, drafter=True)
    return target_cfg, target, drafter_cfg, draft


def write_tiny_pair(out_dir: str, *, seed: int = 0, recipe: str = "f32", target_cfg: TargetConfig | None = None,
                    drafter_cfg: DrafterConfig | None = None, tokenizer: Any = "default",
                    random_blocks: bool = False) -> tuple[str, str]:
    """Write `out_dir/target.gguf` and `out_dir/draft.gguf`; returns their paths. random_blocks: the recipe's
    quantized matrices as random valid blocks (`random_params`' packed_recipe) instead of quantized floats."""
    target_cfg, target, drafter_cfg, draft = tiny_pair(seed, target_cfg=target_cfg, drafter_cfg=drafter_cfg,
                                                       packed_recipe=recipe if random_blocks else None)
    if tokenizer == "default":
        from dsparkjax.tokenizer import build_tiny_tokenizer

        tokenizer = build_tiny_tokenizer(target_cfg.vocab_size)
    os.makedirs(out_dir, exist_ok=True)
    target_path, draft_path = os.path.join(out_dir, "target.gguf"), os.path.join(out_dir, "draft.gguf")
    write_model_gguf(target_path, target_cfg, target, recipe=recipe, tokenizer=tokenizer, name="dsparkjax tiny target")
    write_model_gguf(draft_path, drafter_cfg, draft, recipe=recipe, name="dsparkjax tiny drafter")
    return target_path, draft_path


def default_pair() -> tuple[str, str]:
    """The embedded default pair (seed 0, f32, with a tokenizer), generated on first use into the cache dir.

    The directory is `$DSPARKJAX_CACHE` or `~/.cache/dsparkjax`, under a name that changes with the
    generator, so a stale pair is never picked up.
    """
    root = os.environ.get("DSPARKJAX_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "dsparkjax"))
    out = os.path.join(root, f"tiny-{GENERATOR_VERSION}")
    target, draft = os.path.join(out, "target.gguf"), os.path.join(out, "draft.gguf")
    if not (os.path.exists(target) and os.path.exists(draft)):
        tmp = f"{out}.tmp{os.getpid()}"
        write_tiny_pair(tmp)
        os.makedirs(root, exist_ok=True)
        try:
            os.replace(tmp, out)
        except OSError:  # another process won the race; its pair is identical
            shutil.rmtree(tmp, ignore_errors=True)
    return target, draft


def main(argv: list[str]) -> None:
    del argv
    flag = flags.FLAGS
    target_path, draft_path = write_tiny_pair(flag.out, seed=flag.seed, recipe=flag.recipe)
    print(f"wrote {target_path} ({os.path.getsize(target_path)} bytes)")
    print(f"wrote {draft_path} ({os.path.getsize(draft_path)} bytes)")


if __name__ == "__main__":  # flags are defined only when run as a program, so importing never clashes
    flags.DEFINE_string("out", None, "Directory for target.gguf and draft.gguf.", required=True)
    flags.DEFINE_integer("seed", 0, "Random seed.")
    flags.DEFINE_enum("recipe", "f32", list(RECIPES), "Quant recipe.")
    app.run(main)
