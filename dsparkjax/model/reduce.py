"""The model's contractions and sums, in a batch-invariant order when the traced policy asks for it.

Under `KernelPolicy.invariant` every sum and product over a feature, key or expert axis is computed in an
order fixed by its length alone, so a row's bits do not depend on how many rows share the step (issue 42):
sums over at most TREE_MAX entries (the k routed experts, the HC streams, CSA's pooling window) as a fixed
pairwise tree of elementwise adds, which XLA fuses into the neighbouring ops with no launch of its own (it does
not reassociate float adds); longer sums and the products on the row-invariant custom calls
(`dsparkjax.kernels.rowwise`). Otherwise they are plain jnp (XLA picks the order; differentiable, for
training). Maxima, top-k and elementwise ops need no care: they are exact per element.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsparkjax.kernels import policy as kernel_policy


def invariant() -> bool:
    """Whether the current trace computes every row in a batch-invariant order."""
    return kernel_policy.active().invariant


# Invariant sums over at most this many entries are a tree of adds: the step's short axes (k = 6 experts, 4 HC
# streams, CSA's 8-slot window), each a launch of its own on the custom call (docs/ARCHITECTURE.md, "Exactness").
TREE_MAX = 16


def tree_sum(x: jax.Array, axis: int) -> jax.Array:
    """Σ of x over `axis` in float32 as a balanced pairwise tree of its slices ((x0 + x1) + (x2 + x3)) + ...:
    every output element is the same expression of its own inputs, whatever the other axes' sizes."""
    axis = axis % x.ndim
    parts = [jax.lax.index_in_dim(x.astype(jnp.float32), i, axis, keepdims=False) for i in range(x.shape[axis])]
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] if i + 1 < len(parts) else parts[i] for i in range(0, len(parts), 2)]
    return parts[0]


def total(x: jax.Array, axis: int = -1, keepdims: bool = False) -> jax.Array:
    """Σ of x over `axis`, float32."""
    if not invariant():
        return jnp.sum(x.astype(jnp.float32), axis=axis, keepdims=keepdims)
    if x.shape[axis] <= TREE_MAX:
        s = tree_sum(x, axis)
    else:
        from dsparkjax.kernels import rowwise

        s = rowwise.row_sum(jnp.moveaxis(x, axis, -1))
    return jnp.expand_dims(s, axis) if keepdims else s


def mean(x: jax.Array, axis: int = -1, keepdims: bool = False) -> jax.Array:
    """The mean of x over `axis`, float32."""
    return total(x, axis, keepdims) / x.shape[axis]


def softmax(x: jax.Array, axis: int = -1) -> jax.Array:
    """Softmax over `axis`, float32 (−inf entries get 0; a row of only −inf gives NaN, as jax.nn.softmax)."""
    x = x.astype(jnp.float32)
    e = jnp.exp(x - jax.lax.stop_gradient(jnp.max(x, axis=axis, keepdims=True)))
    return e / total(e, axis, keepdims=True)


def contract(x: jax.Array, w) -> jax.Array:
    """`x·wᵀ` in float32 at full precision: x `[..., K]`, w dense `[N, K]` (or a `weights.StackedDense` layer of
    float32 matrices) -> `[..., N]`."""
    from dsparkjax.model.weights import StackedDense

    if isinstance(w, StackedDense):
        if not invariant() or w.dtype != jnp.float32:
            return contract(x, w.value())
        return w.layer_linear(x.astype(jnp.float32))
    if not invariant():
        return jnp.einsum("...k,nk->...n", x.astype(jnp.float32), w.astype(jnp.float32),
                          precision=jax.lax.Precision.HIGHEST)
    from dsparkjax.kernels import rowwise

    return rowwise.matmul(x.astype(jnp.float32), w.astype(jnp.float32))


def grouped_contract(x: jax.Array, w: jax.Array) -> jax.Array:
    """Per-group `y[g, m] = x[g, m]·w[g]ᵀ` in float32: x `[G, M, K]`, w `[G, N, K]` -> `[G, M, N]`."""
    if not invariant():
        return jnp.einsum("gmk,gnk->gmn", x.astype(jnp.float32), w.astype(jnp.float32),
                          precision=jax.lax.Precision.HIGHEST)
    from dsparkjax.kernels import rowwise

    return rowwise.grouped_rows(x.astype(jnp.float32), w.astype(jnp.float32))
