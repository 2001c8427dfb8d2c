"""Weights multiplied through the kernels' MoE call, and one layer of a weight stack read in place by it.

A scanned body (`model/target.py`) gets its layer as a traced index into weights stacked `[L, ...]`. Slicing that
layer out would make XLA copy the weight for a custom call every step, so the MoE call
(`y[t, j] = x[t]·w[ids[t, j]]ᵀ`) reads the whole stack instead, the layer folded into the ids. `weights.PackedWeight`
(packed bytes) and `reduce.StackedDense` (dense matrices under an invariant policy) share what is here.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp


def layer_ids(stack: jax.Array, layer: jax.Array, ids: jax.Array, per_layer: int) -> tuple[jax.Array, jax.Array]:
    """The MoE call's operands for layer `layer` of a stack `[L, ..., cols]`: the stack as `[L·per_layer, n, cols]`
    (each layer's rows split into its `per_layer` matrices of n rows), and ids int32 among that layer's matrices
    offset to index it."""
    return stack.reshape(stack.shape[0] * per_layer, -1, stack.shape[-1]), ids + layer.astype(jnp.int32) * per_layer


class MoeWeight:
    """A weight whose products are its `matmul_id`, the MoE call on its matrices (its layer's, for a stack)."""

    # x [T, K], ids int32 [T, k] among the (layer's) `per_layer` matrices, per_layer -> float32 [T, k, N]
    matmul_id: Callable[[jax.Array, jax.Array, int], jax.Array]
    shape: tuple[int, ...]  # of the (layer's) weight: [N, K] or [E, N, K]

    def layer_linear(self, x: jax.Array, groups: int | None = None) -> jax.Array:
        """`weights.linear(x, w)` with w this weight's matrix `[N, K]`, as the MoE call in which every row chooses
        that matrix (grouped: row (t, g) its rows of group g).

        Args:
          x: `[..., K]`, or `[..., g, K/g]` when `groups` is given.
        Returns:
          float32 `[..., N]`, or `[..., g, N/g]` when grouped.
        """
        flat = x.reshape(-1, x.shape[-1])
        if groups is None:
            ids, per_layer = jnp.zeros((flat.shape[0], 1), jnp.int32), 1
        else:
            ids = jnp.tile(jnp.arange(groups, dtype=jnp.int32), flat.shape[0] // groups)[:, None]
            per_layer = groups
        return self.matmul_id(flat, ids, per_layer)[:, 0].reshape(*x.shape[:-1], -1)

    def expert_linear(self, x: jax.Array, ids: jax.Array) -> jax.Array:
        """`weights.expert_linear(x, w, ids)` with w this weight's expert stack `[E, N, K]`, as one MoE call.

        Args:
          x: `[..., K]` (one input per token) or `[..., k, K]` (one input per selected expert, a row each);
          ids: int32 `[..., k]`.
        Returns:
          float32 `[..., k, N]`.
        """
        flat_ids = ids.reshape(-1, 1) if x.ndim > ids.ndim else ids.reshape(-1, ids.shape[-1])
        y = self.matmul_id(x.reshape(-1, x.shape[-1]), flat_ids, self.shape[0])
        return y.reshape(*ids.shape, y.shape[-1])
