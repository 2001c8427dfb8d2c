"""Pure-jnp reference of every kernel op: what the FFI kernels must compute (up to fp32 summation order).

Packed matmuls dequantize with `dsparkjax.kernels.packed` and multiply in float32 at HIGHEST precision. The
HC ops are the model's own reference, `dsparkjax.model.hc` (there is deliberately no second jnp HC).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsparkjax.kernels import packed
from dsparkjax.model.hc import hc_post, hc_pre

__all__ = ["grouped_matmul", "hc_post", "hc_pre", "indexer_topk", "qmatmul", "qmatmul_id"]

_HI = jax.lax.Precision.HIGHEST


def qmatmul(x: jax.Array, w_packed: jax.Array, ggml_type: int) -> jax.Array:
    """`y[t, n] = Σ_k x[t, k] · W[n, k]`: x float `[T, K]`, w_packed uint8 `[N, row_bytes]` -> float32 `[T, N]`."""
    w = packed.dequantize(w_packed, ggml_type, x.shape[-1])
    return jnp.einsum("tk,nk->tn", x.astype(jnp.float32), w, precision=_HI)


def qmatmul_id(x: jax.Array, w_packed: jax.Array, ids: jax.Array, ggml_type: int) -> jax.Array:
    """MoE form: `y[t, j, :] = W[ids[t, j]] · x[t]`; rows for ids outside `[0, E)` are zero.

    x float `[T, K]`, w_packed uint8 `[E, N, row_bytes]`, ids int32 `[T, k]` -> float32 `[T, k, N]`.
    Only the selected experts are gathered and dequantized.
    """
    n_experts = w_packed.shape[0]
    if n_experts == 0:  # every id is outside [0, 0): nothing to gather
        return jnp.zeros((*ids.shape, w_packed.shape[1]), jnp.float32)
    valid = (ids >= 0) & (ids < n_experts)
    w = packed.dequantize(w_packed[jnp.where(valid, ids, 0)], ggml_type, x.shape[-1])  # [T, k, N, K]
    y = jnp.einsum("tk,tjnk->tjn", x.astype(jnp.float32), w, precision=_HI)
    return jnp.where(valid[..., None], y, 0.0)


def grouped_matmul(x: jax.Array, w: jax.Array, transposed: bool) -> jax.Array:
    """`y[g, m, n] = Σ_k x[g, m, k] · w[g][n, k]`: x float `[G, M, K]`, w float `[G, N, K]` (or `[G, K, N]` when
    `transposed`) -> float32 `[G, M, N]`."""
    spec = "gmk,gkn->gmn" if transposed else "gmk,gnk->gmn"
    return jnp.einsum(spec, x.astype(jnp.float32), w.astype(jnp.float32), precision=_HI)


def indexer_topk(queries: jax.Array, keys: jax.Array, head_weights: jax.Array, lengths: jax.Array, k: int
                 ) -> tuple[jax.Array, jax.Array]:
    """The Lightning Indexer's selection over every entry the key buffer holds, masked to the visible ones.

    `score[b, q, n] = Σ_h w[b, q, h] · relu(queries[b, q, h] · keys[b, n])`; entries n >= lengths[b, q] score
    −inf; the k highest are returned by score descending, ties to the lowest entry (`ds4_arch.md` §6.3 item 4),
    so a row with fewer than k visible entries gets entries len, len+1, ... in its last slots.

    queries float32 `[B, Q, H, d]`, keys float32 `[B, N, d]`, head_weights float32 `[B, Q, H]`, lengths int32
    `[B, Q]` -> (picks int32 `[B, Q, k]`, real bool `[B, Q, k]`: whether each pick is a visible entry).
    """
    dots = jnp.einsum("bqhd,bnd->bqhn", queries, keys, precision=_HI)
    scores = jnp.einsum("bqh,bqhn->bqn", head_weights, jax.nn.relu(dots), precision=_HI)
    visible = jnp.arange(keys.shape[1]) < lengths[..., None]
    _, picks = jax.lax.top_k(jnp.where(visible, scores, -jnp.inf), k)
    return picks, jnp.take_along_axis(visible, picks, axis=-1)
