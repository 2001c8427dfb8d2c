"""Random models: the deterministic tiny target + drafter pairs of the tests, random full-size models
generated on the device, and sparse all-zero files of any size.

`python -m dsparkjax.tiny --out DIR` writes `DIR/target.gguf` and `DIR/draft.gguf` in seconds;
`python -m dsparkjax.tiny --config ds4 --sparse --out DIR` writes DeepSeek-V4-Flash's published layout (86.7 GB
of target, all 43 layers, and its DSpark drafter) as all-zero sparse files, in seconds and with no disk use.

The weights are random but scaled as `ds4_arch.md` §7 recommends so that every mechanism matters:
projections with std ~2/sqrt(fan_in), comb bases near 4·I so Sinkhorn starts near identity, random HC
scales in [0.5, 1.5], non-zero compressor position biases, sinks ~ N(0, 1), router biases ~ N(0, 0.1) and
hash tables of distinct random experts per token.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging

from dsparkjax import formats, kernels
from dsparkjax.config import DrafterConfig, TargetConfig, deepseek_v4_flash, dspark_flash, tiny_drafter, tiny_target
from dsparkjax.formats import GGMLType
from dsparkjax.ggufio.contract import TensorSpec, drafter_tensor_specs, target_tensor_specs
from dsparkjax.ggufio.reader import TensorInfo
from dsparkjax.ggufio.writer import RECIPES, RawTensor, recipe_type, write_model_gguf, write_sparse_gguf
from dsparkjax.kernels import dequantize
from dsparkjax.model.params import load_target_params
from dsparkjax.model.sources import ShapeSource, packs, stored_form
from dsparkjax.target_api import Target
from dsparkjax.testing import synthetic

Params = dict[str, np.ndarray | RawTensor]


@dataclasses.dataclass(frozen=True)
class Draw:
    """How a float tensor's random values are drawn: `loc + scale·N(0, 1)`, or uniform in [loc, scale) when
    `uniform`; `comb_eye` adds 4·I to the comb part of a sub-layer's HC base (Sinkhorn starts near identity)."""

    loc: float
    scale: float
    uniform: bool = False
    comb_eye: bool = False


def draw_of(spec: TensorSpec, hc_mult: int) -> Draw:
    """The random values of one contract entry (not a hash table), scaled by its role."""
    name, shape = spec.name, spec.shape
    if name.endswith("_scale.weight"):
        return Draw(0.5, 1.5, uniform=True)
    if name.endswith("_base.weight"):
        return Draw(0.0, 0.5, comb_eye=shape[0] > hc_mult)  # a sub-layer's [pre | post | comb]
    if name.endswith("attn_sinks.weight"):
        return Draw(0.0, 1.0)
    if name.endswith("exp_probs_b.bias"):
        return Draw(0.0, 0.1)
    if spec.family == "vector":  # RMSNorm weights
        return Draw(1.0, 0.1)
    if name.endswith("_ape.weight"):
        return Draw(0.0, 0.5)
    if spec.family == "embedding" or name.endswith("markov.w1"):
        return Draw(0.0, 1.0)
    return Draw(0.0, 2.0 / np.sqrt(shape[-1]))  # projections: std 2/sqrt(fan_in)


def _init_tensor(spec: TensorSpec, rng: np.random.Generator, hc_mult: int, n_experts: int) -> np.ndarray:
    """A random tensor for one contract entry, drawn on the host as `draw_of` says."""
    if spec.family == "hash_table":  # each token routes to k distinct random experts
        vocab, k = spec.shape
        return np.stack([rng.permutation(n_experts)[:k] for _ in range(vocab)]).astype(np.int32)
    draw = draw_of(spec, hc_mult)
    if draw.uniform:
        values = rng.uniform(draw.loc, draw.scale, spec.shape)
    else:
        values = rng.normal(draw.loc, draw.scale, spec.shape)
    if draw.comb_eye:
        values[2 * hc_mult :] += 4.0 * np.eye(hc_mult).reshape(-1)
    return values.astype(np.float32)


def is_generated(spec: TensorSpec) -> bool:
    """Whether a generated model has this tensor: every one of the contract does, optional ones included, but
    the confidence bias (DeepSeek's confidence head has none, `dspark_reference.md` §3)."""
    return spec.name != "dflash.dspark.confidence.bias"


def random_params(specs: list[TensorSpec], seed: int, hc_mult: int, n_experts: int, *,
                  packed_recipe: str | None = None, drafter: bool = False) -> Params:
    """Random parameters for the `generated` tensors of a contract.

    With `packed_recipe`, the matrices that recipe stores quantized (`drafter`: the drafter's recipe) come
    already encoded: random valid blocks (`random_packed_matrix`), so that models at DS4's own size are
    written in about a minute (8 layers, 17 GB, on the H200's host) instead of quantized on the host.
    """
    rng = np.random.default_rng(seed)
    key = jax.random.key(seed)
    params: Params = {}
    for i, s in enumerate(specs):
        if not is_generated(s):
            continue
        ggml_type = recipe_type(packed_recipe, s, drafter=drafter) if packed_recipe else None
        if ggml_type is not None and packs(ggml_type):
            params[s.name] = random_packed_matrix(s, ggml_type, jax.random.fold_in(key, i))
        else:
            params[s.name] = _init_tensor(s, rng, hc_mult, n_experts)
    return params


@functools.cache
def _unit_std(ggml_type: int) -> float:
    """The std of `synthetic.random_packed`'s weights of a type at scale 1 (measured on 64 rows of 4096)."""
    sample = synthetic.random_packed(jax.random.key(0), ggml_type, (64,), 4096)
    return float(jnp.std(dequantize(sample, ggml_type, 4096)))


def random_blocks(spec: TensorSpec, ggml_type: int, key: jax.Array) -> jax.Array:
    """Random valid blocks of `ggml_type` for a matrix, on the device (uint8 `[..., out, row_bytes]`), scaled
    to the std `draw_of` gives projections (2/sqrt(fan_in)), so activations keep the float-initialised
    model's magnitudes layer after layer."""
    *rows, k = spec.shape
    scale = 2.0 / np.sqrt(k) / _unit_std(ggml_type)
    return synthetic.random_packed(key, ggml_type, tuple(rows), k, float(scale))


def random_packed_matrix(spec: TensorSpec, ggml_type: int, key: jax.Array) -> RawTensor:
    """`random_blocks` on the host, ready to be written."""
    return RawTensor(spec.name, ggml_type, spec.shape, np.asarray(random_blocks(spec, ggml_type, key)))


class DeviceRandomSource:
    """A random model's tensors generated on the device, in the stored form a loader reads
    (`model/sources.py`), with no file and no host copy: the recipe's quantized matrices as random valid
    blocks (`random_blocks`, the keys `random_params` gives them, so those are the blocks a file written with
    `random_blocks=True` holds), the float tensors drawn by role (`draw_of`) and cast to the recipe's type,
    hash tables of distinct random experts. DS4's 86.7 GB take seconds on a GPU.
    """

    def __init__(self, specs: list[TensorSpec], recipe: str, seed: int, *, hc_mult: int, n_experts: int,
                 drafter: bool = False, path: str = "<random weights on the device>"):
        self.path, self._hc_mult, self._n_experts = path, hc_mult, n_experts
        self._key = jax.random.key(seed)
        self._specs = {s.name: (i, s) for i, s in enumerate(specs) if is_generated(s)}
        self.tensors: dict[str, TensorInfo] = {}
        for name, (_, spec) in self._specs.items():
            ggml_type = recipe_type(recipe, spec, drafter=drafter)
            rows = int(np.prod(spec.shape[:-1], dtype=np.int64))
            self.tensors[name] = TensorInfo(name, ggml_type, spec.shape, 0,
                                            rows * formats.row_bytes(ggml_type, spec.shape[-1]))

    def fetch(self, name: str) -> jax.Array:
        index, spec = self._specs[name]
        info, key = self.tensors[name], jax.random.fold_in(self._key, index)
        if packs(info.ggml_type):
            return random_blocks(spec, info.ggml_type, key)
        if info.ggml_type == GGMLType.I32:
            return _hash_table(key, spec.shape, self._n_experts)
        return _drawn(key, spec.shape, draw_of(spec, self._hc_mult), self._hc_mult, stored_form(info)[1])


@functools.partial(jax.jit, static_argnums=(1, 2))
def _hash_table(key: jax.Array, shape: tuple[int, int], n_experts: int) -> jax.Array:
    """int32 `[V, k]`: k distinct random experts per token (the top k of V rows of uniform draws)."""
    vocab, k = shape
    return jax.lax.top_k(jax.random.uniform(key, (vocab, n_experts)), k)[1].astype(jnp.int32)


def _drawn(key: jax.Array, shape: tuple[int, ...], draw: Draw, hc_mult: int, dtype: Any) -> jax.Array:
    """Values drawn as `draw` says, on the device, in `dtype`."""
    return _draw_values(key, jnp.float32(draw.loc), jnp.float32(draw.scale), shape, draw.uniform,
                        hc_mult if draw.comb_eye else 0, dtype)


@functools.partial(jax.jit, static_argnums=(3, 4, 5, 6))  # loc and scale traced: one program per shape and kind
def _draw_values(key: jax.Array, loc: jax.Array, scale: jax.Array, shape: tuple[int, ...], uniform: bool,
                 comb_eye: int, dtype: Any) -> jax.Array:
    if uniform:
        values = jax.random.uniform(key, shape, jnp.float32, loc, scale)
    else:
        values = loc + scale * jax.random.normal(key, shape, jnp.float32)
    if comb_eye:
        values = values.at[2 * comb_eye :].add(4.0 * jnp.eye(comb_eye).reshape(-1))
    return values.astype(dtype)


def random_sources(target_cfg: TargetConfig, drafter_cfg: DrafterConfig, *, seed: int = 0,
                   recipe: str = "published") -> tuple[DeviceRandomSource, DeviceRandomSource]:
    """DeviceRandomSources of a target and its drafter (the seeds `tiny_pair` gives them)."""
    target = DeviceRandomSource(target_tensor_specs(target_cfg), recipe, seed, hc_mult=target_cfg.hc_mult,
                                n_experts=target_cfg.n_routed_experts)
    drafter = DeviceRandomSource(drafter_tensor_specs(drafter_cfg), recipe, seed + 1, hc_mult=drafter_cfg.hc_mult,
                                 n_experts=drafter_cfg.n_routed_experts, drafter=True)
    return target, drafter


def shapes_target(target_cfg: TargetConfig, drafter_cfg: DrafterConfig, dtype: Any, *,
                  recipe: str = "published", scan_layers: bool = False) -> Target:
    """The target of `random_sources` with `jax.ShapeDtypeStruct` parameters: the loader run on the tensor
    table alone, nothing allocated, so its programs lower and compile at DS4's full size on any host
    (scripts/step_census.py, scripts/startup_compile.py); `scan_layers` as `load_target`'s."""
    source, _ = random_sources(target_cfg, drafter_cfg, recipe=recipe)
    backend = kernels.default_backend()
    params = load_target_params(ShapeSource(source.path, source.tensors), target_cfg, dtype, backend,
                                scan_layers=scan_layers)
    return Target(f"shapes of a random {recipe} target", target_cfg, params, dtype, True, None, backend)


def write_sparse_pair(out_dir: str, target_cfg: TargetConfig, drafter_cfg: DrafterConfig, *,
                      recipe: str = "published") -> tuple[str, str]:
    """Write `out_dir/target.gguf` and `out_dir/draft.gguf` with the `generated` tensors of the configs and
    all-zero data, as sparse files (`write_sparse_gguf`: seconds, no disk); returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    target_path, draft_path = os.path.join(out_dir, "target.gguf"), os.path.join(out_dir, "draft.gguf")
    write_sparse_gguf(target_path, target_cfg, [s for s in target_tensor_specs(target_cfg) if is_generated(s)],
                      recipe=recipe, name="dsparkjax sparse target (all-zero data)")
    write_sparse_gguf(draft_path, drafter_cfg, [s for s in drafter_tensor_specs(drafter_cfg) if is_generated(s)],
                      recipe=recipe, name="dsparkjax sparse drafter (all-zero data)")
    return target_path, draft_path


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


def main(argv: list[str]) -> None:
    del argv
    logging.set_verbosity(logging.WARNING)  # gguf-py's writer logs every file at INFO
    flag = flags.FLAGS
    if flag.config == "ds4":
        if not flag.sparse:
            raise app.UsageError("--config ds4 writes sparse all-zero files only (--sparse): random weights of DS4's "
                                 "size are generated on the device by scripts/bench.py, never written")
        target_cfg, drafter_cfg = deepseek_v4_flash(flag.layers), dspark_flash(flag.layers)
    else:
        target_cfg = tiny_target()
        drafter_cfg = tiny_drafter(target_cfg)
    recipe = flag.recipe or ("published" if flag.config == "ds4" else "f32")
    if flag.sparse:
        paths = write_sparse_pair(flag.out, target_cfg, drafter_cfg, recipe=recipe)
    else:
        paths = write_tiny_pair(flag.out, seed=flag.seed, recipe=recipe)
    for path in paths:
        stat = os.stat(path)
        print(f"wrote {path}: {stat.st_size} bytes ({stat.st_size / 1e9:.1f} GB), {stat.st_blocks * 512} on disk")


if __name__ == "__main__":  # flags are defined only when run as a program, so importing never clashes
    flags.DEFINE_string("out", None, "Directory for target.gguf and draft.gguf.", required=True)
    flags.DEFINE_enum("config", "tiny", ["tiny", "ds4"], "tiny: the test pair; ds4: DeepSeek-V4-Flash and its "
                      "DSpark drafter at full size (--sparse only).")
    flags.DEFINE_integer("layers", 43, "--config ds4: how many of its 43 layers (the first ones).")
    flags.DEFINE_bool("sparse", False, "All-zero tensor data as sparse files: any size in seconds, no disk (the "
                      "load path's benchmark; zeros are valid data in every type).")
    flags.DEFINE_integer("seed", 0, "Random seed.")
    flags.DEFINE_enum("recipe", None, list(RECIPES), "Quant recipe (default: f32 for tiny, published for ds4).")
    app.run(main)
