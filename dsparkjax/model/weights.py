"""Weights as data: a dense array (dequantized at load) and the one matmul helper every layer calls.

A weight is stored in PyTorch orientation `[out, in]` (`[E, out, in]` for expert stacks), the numpy shape
of its GGUF tensor. `linear` accumulates in float32 and, for float32 weights, asks for full float32
precision so that GPUs do not silently use TF32.
"""

from __future__ import annotations

from typing import Union

import jax
import jax.numpy as jnp

Weight = Union[jax.Array]


def _precision(w: jax.Array) -> jax.lax.Precision:
    return jax.lax.Precision.HIGHEST if w.dtype == jnp.float32 else jax.lax.Precision.DEFAULT


def linear(x: jax.Array, w: Weight, *, groups: int | None = None) -> jax.Array:
    """`x·wᵀ` with float32 accumulation.

    Args:
      x: `[..., in]`, or `[..., g, in/g]` when `groups` is given (a grouped projection).
      w: `[out, in]`, or `[g·r, in/g]` when grouped (group j uses rows j·r..(j+1)·r).
    Returns:
      float32 `[..., out]`, or `[..., g, r]` when grouped.
    """
    x = x.astype(w.dtype)
    if groups is None:
        return jnp.einsum("...k,nk->...n", x, w, precision=_precision(w), preferred_element_type=jnp.float32)
    w = w.reshape(groups, -1, w.shape[-1])
    return jnp.einsum("...gk,grk->...gr", x, w, precision=_precision(w), preferred_element_type=jnp.float32)


def expert_linear(x: jax.Array, w: Weight, ids: jax.Array) -> jax.Array:
    """Each token against its own selected experts: `y[..., j, :] = x·w[ids[..., j]]ᵀ`.

    Args:
      x: `[..., in]` or `[..., k, in]` (one input per selected expert); w: `[E, out, in]`;
      ids: int32 `[..., k]`.
    Returns:
      float32 `[..., k, out]`.
    """
    picked = jnp.take(w, ids, axis=0)  # [..., k, out, in]
    x = x.astype(w.dtype)
    spec = "...k,...jnk->...jn" if x.ndim == ids.ndim else "...jk,...jnk->...jn"
    return jnp.einsum(spec, x, picked, precision=_precision(w), preferred_element_type=jnp.float32)
