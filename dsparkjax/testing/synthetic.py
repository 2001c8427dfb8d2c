"""Random valid packed weights, generated on the device, and random mHC inputs (tests and benchmarks).

Random bytes exercise every code of every format; only the scale fields are constrained so the blocks are
valid: finite fp16 `d`/`dmin` (Q8_0, Q2_K, Q4_K, IQ2_XXS) and ROCm scale bytes in 0..0x7E (quant_hc.md §1.1).
Dense float types are random normal values. Generating with jax.random keeps multi-GB expert stacks on the
accelerator instead of the host.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from dsparkjax.formats import GGMLType, block_size, type_size
from dsparkjax.formats.rocm import CODECS

_DENSE = {GGMLType.F32: jnp.float32, GGMLType.F16: jnp.float16, GGMLType.BF16: jnp.bfloat16}
# byte offsets of the fp16 scale fields of the standard block types, and the range they are drawn from
_HALF_FIELDS = {
    GGMLType.Q8_0: ((0, -0.05, 0.05),),
    GGMLType.Q2_K: ((80, 0.0, 0.05), (82, 0.0, 0.05)),
    GGMLType.Q4_K: ((0, 0.0, 0.05), (2, 0.0, 0.375)),  # dmin 7.5x d: the mins offset the mean code (7.5)
    GGMLType.IQ2_XXS: ((0, 0.0, 0.05),),
}


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def random_packed(key: jax.Array, ggml_type: int, rows: tuple[int, ...], k: int, scale: float = 1.0) -> jax.Array:
    """Random valid packed rows: uint8 `[*rows, k // block_size · type_size]` of `ggml_type`.

    scale multiplies the weights' magnitude (the fp16 scale fields' ranges, to which the weights are linear, or
    the dense types' std): random models pick it for the std they want. The ROCm types' scale bytes are
    exponents and take only 1.0.
    """
    t = GGMLType(int(ggml_type))
    kv, ks = jax.random.split(key)
    if t in _DENSE:
        vals = (scale * jax.random.normal(kv, (*rows, k), jnp.float32)).astype(_DENSE[t])
        width = jnp.dtype(_DENSE[t]).itemsize
        raw = jax.lax.bitcast_convert_type(vals, jnp.uint8) if width > 1 else vals
        return raw.reshape(*rows, k * width)
    if k % block_size(t):
        raise ValueError(f"{t.name}: rows of {k} values are not whole blocks of {block_size(t)}")
    nb, ts = k // block_size(t), type_size(t)
    total = math.prod(rows) * nb * ts  # drawn as uint32 words: uint8 draws cost 4x the memory
    words = jax.random.bits(kv, (-(-total // 4),), jnp.uint32)
    raw = jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(-1)[:total].reshape(*rows, nb, ts)
    if t in _HALF_FIELDS:
        for i, (off, lo, hi) in enumerate(_HALF_FIELDS[t]):
            half = scale * jax.random.uniform(jax.random.fold_in(ks, i), (*rows, nb), jnp.float32, lo, hi)
            raw = raw.at[..., off : off + 2].set(jax.lax.bitcast_convert_type(half.astype(jnp.float16), jnp.uint8))
    else:
        if scale != 1.0:
            raise ValueError(f"{t.name}: scale bytes are exponents; random_packed draws them with scale 1.0 only")
        ns = CODECS[t].n_scales
        raw = raw.at[..., ts - ns :].set(jax.random.randint(ks, (*rows, nb, ns), 0, 0x7F, jnp.int32).astype(jnp.uint8))
    return raw.reshape(*rows, nb * ts)


def random_hc_inputs(rng: np.random.Generator, t_rows: int, n: int, d: int
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Inputs of `kernels.hc_pre`, float32: streams `[T, n, D]` standard normal, fn `[(2+n)n, nD]` scaled by
    1/sqrt(nD) (mixes of order one), base `[(2+n)n]` standard normal, scale `[3]` in [0.5, 2)."""
    m = (2 + n) * n
    streams = rng.standard_normal((t_rows, n, d)).astype(np.float32)
    fn = (rng.standard_normal((m, n * d)) / np.sqrt(n * d)).astype(np.float32)
    base = rng.standard_normal(m).astype(np.float32)
    scale = rng.uniform(0.5, 2.0, 3).astype(np.float32)
    return streams, fn, base, scale
