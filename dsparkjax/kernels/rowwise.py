"""Row-invariant products and sums on the packed matmul custom calls.

XLA's own dots and reductions may change a row's bits with the number of rows of the call (exactness.md §1).
The packed matmul custom calls compute every output with an accumulation order fixed by K alone
(custom_calls/cpu_ffi.cc: 8 lanes and a fixed tree; the CUDA float path likewise per row), and they read dense
float rows as the pseudo-formats F32/F16/BF16. So every contraction of a decode step goes through them here:

- a dense matrix is passed as its own bytes (`packed_dense`), no conversion;
- a sum over an axis is a product with a row of ones (`row_sum`: 1·x is exact, so only the order rounds);
- products whose "weights" differ per sequence or per row (attention's keys and values) are the grouped-product
  call, one multiply-add chain per output (`grouped_rows`);
- RMSNorm is its own call (`rms_norm`): the sum of squares, the scale and the weight in one launch.

K is padded with zeros to the pseudo-formats' block of 8 (adding 0·x changes nothing). Everything here is
float32 out and needs the FFI plugin; `dsparkjax/model/reduce.py` picks these or plain jnp per policy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dsparkjax.errors import DsparkError
from dsparkjax.formats.types import GGMLType
from dsparkjax.kernels import ffi

BLOCK = 8  # the dense pseudo-formats' block: K must be a multiple of it
DENSE_TYPES = {jnp.dtype(jnp.float32): int(GGMLType.F32), jnp.dtype(jnp.float16): int(GGMLType.F16),
               jnp.dtype(jnp.bfloat16): int(GGMLType.BF16)}


def _padded(x: jax.Array) -> jax.Array:
    """x with its last axis zero-padded to a multiple of BLOCK."""
    pad = -x.shape[-1] % BLOCK
    return x if pad == 0 else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])


def _check_dense(w: jax.Array) -> jnp.dtype:
    """w's dtype, refused (DsparkError) unless the kernels read it as float rows."""
    dtype = jnp.dtype(w.dtype)
    if dtype not in DENSE_TYPES:
        raise DsparkError(f"row-invariant products take float32, float16 or bfloat16 matrices, got {dtype}")
    return dtype


def packed_dense(w: jax.Array) -> tuple[jax.Array, int]:
    """A dense float matrix `[..., N, K]` (K padded to BLOCK) as packed rows: (uint8 `[..., N, K·itemsize]`,
    its ggml type)."""
    dtype = _check_dense(w)
    w = _padded(w)
    raw = jax.lax.bitcast_convert_type(w, jnp.uint8)  # [..., N, K, itemsize], little-endian as the kernels read
    return raw.reshape(*w.shape[:-1], -1), DENSE_TYPES[dtype]


def matmul(x: jax.Array, w: jax.Array, mma: int = 1) -> jax.Array:
    """`x·wᵀ`: x `[..., K]` (cast to w's dtype), w dense `[N, K]` -> float32 `[..., N]`."""
    packed, ggml_type = packed_dense(w)
    flat = _padded(x.reshape(-1, x.shape[-1]).astype(w.dtype))
    y = ffi.qmatmul(flat, packed, ggml_type, mma)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def matmul_id(x: jax.Array, w: jax.Array, ids: jax.Array, groups: int = 0) -> jax.Array:
    """`y[t, j] = x[t]·w[ids[t, j]]ᵀ`: x `[T, K]` (cast to w's dtype), w dense `[E, N, K]`, ids int32 `[T, k]`
    -> float32 `[T, k, N]`. `groups` = G > 0 declares ids[t] = t mod G (`ffi.qmatmul_id`): the GPU then lays the
    call out for that pattern rather than for long runs of one id (`grouped_rows`)."""
    packed, ggml_type = packed_dense(w)
    return ffi.qmatmul_id(_padded(x.astype(w.dtype)), packed, ids.astype(jnp.int32), ggml_type, groups, 1)


def grouped_rows(x: jax.Array, w: jax.Array, transposed: bool = False, layer: jax.Array | None = None) -> jax.Array:
    """Per-group products `y[g, m] = x[g, m]·w[g]ᵀ`: x `[G, M, K]` (as float32), w float `[G, N, K]`, or `[G, K, N]`
    when `transposed` (attention's values, read in place), or with `layer` (int32 `[]`) a stack `[L, G, ...]` of
    which layer `layer` is read in place -> float32 `[G, M, N]`.

    One grouped-product call (`ffi.grouped_matmul`): each output is a multiply-add chain over K in order, so no
    row's bits depend on G, M or N.
    """
    _check_dense(w)
    return ffi.grouped_matmul(x.astype(jnp.float32), w, transposed, layer)


def row_sum(x: jax.Array) -> jax.Array:
    """Σ over the last axis of float x `[..., K]` in a fixed order -> float32 `[...]`."""
    ones = jnp.asarray(np.ones((1, x.shape[-1]), np.float32))
    return matmul(x.astype(jnp.float32), ones)[..., 0]


def rms_norm(x: jax.Array, weight: jax.Array | None, eps: float) -> jax.Array:
    """`w ⊙ x·(mean(x²)+eps)^(-1/2)` over the last axis of x `[..., K]` (weight `[K]`, None = unweighted), each
    row alone in an order fixed by K -> float32 `[..., K]`."""
    k = x.shape[-1]
    flat = x.reshape(-1, k)
    if flat.dtype != jnp.bfloat16:
        flat = flat.astype(jnp.float32)
    w = jnp.ones((k,), jnp.float32) if weight is None else weight.astype(jnp.float32)
    return ffi.rms_norm(flat, w, eps).reshape(x.shape)
