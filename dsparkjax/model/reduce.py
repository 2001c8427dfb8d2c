"""The model's dense contractions, norms and sums, in a batch-invariant order when the traced policy asks for it.

This module is where a step's routing between XLA and the row-invariant custom calls is decided, once for every
dense operand. Under `KernelPolicy.invariant` every sum and product over a feature, key or expert axis is computed
in an order fixed by its length alone, so a row's bits do not depend on how many rows share the step (issue 42):
sums over at most TREE_MAX entries (the k routed experts, the HC streams, CSA's pooling window) as a fixed
pairwise tree of elementwise adds, which XLA fuses into the neighbouring ops with no launch of its own (it does
not reassociate float adds); longer sums, RMSNorm and the products on the row-invariant custom calls
(`dsparkjax.kernels.rowwise`), dense matrices of a scanned body read in place (`StackedDense`). Otherwise they are
plain jnp (XLA picks the order; differentiable, for training). Maxima, top-k and elementwise ops need no care:
they are exact per element. Packed weights are `model/weights.py`'s, which hands dense ones (and its dense copies)
to `dense_linear` and `dense_expert_linear` here.
"""

from __future__ import annotations

from typing import Union

import jax
import jax.numpy as jnp
from flax import struct

from dsparkjax.kernels import policy as kernel_policy
from dsparkjax.kernels import rowwise
from dsparkjax.model.stacked import MoeWeight, layer_ids


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
    s = tree_sum(x, axis) if x.shape[axis] <= TREE_MAX else rowwise.row_sum(jnp.moveaxis(x, axis, -1))
    return jnp.expand_dims(s, axis) if keepdims else s


def mean(x: jax.Array, axis: int = -1, keepdims: bool = False) -> jax.Array:
    """The mean of x over `axis`, float32."""
    return total(x, axis, keepdims) / x.shape[axis]


def softmax(x: jax.Array, axis: int = -1) -> jax.Array:
    """Softmax over `axis`, float32 (−inf entries get 0; a row of only −inf gives NaN, as jax.nn.softmax)."""
    x = x.astype(jnp.float32)
    e = jnp.exp(x - jax.lax.stop_gradient(jnp.max(x, axis=axis, keepdims=True)))
    return e / total(e, axis, keepdims=True)


def rms_norm(x: jax.Array, weight: jax.Array | None, eps: float) -> jax.Array:
    """`w ⊙ x·(mean(x²)+eps)^(-1/2)` over the last axis, in float32 (weight None = unweighted)."""
    if invariant():  # one row-invariant launch instead of a sum call between two fusions
        return rowwise.rms_norm(x, weight, eps)
    x = x.astype(jnp.float32)
    y = x * jax.lax.rsqrt(mean(jnp.square(x), axis=-1, keepdims=True) + eps)
    return y if weight is None else y * weight.astype(jnp.float32)


@struct.dataclass
class StackedDense(MoeWeight):
    """Layer `layer` of a dense matrix stack `[L, ..., out, in]` in a scanned step: dense matrices under an invariant
    policy, the HC mixes' fn under any (`block._hc_ops` hands the stack and the layer to the mHC kernel), and a
    stacked cache's keys for attention's products (`grouped_contract` hands them to the grouped-product call).

    The row-invariant products read dense matrices as their bytes on the FFI kernels (`kernels/rowwise.py`); a
    sliced stack would be copied for that custom call every step, so the MoE call reads the whole stack with
    the layer index folded into its ids instead. Anything else takes `value()`, the slice.
    """

    stack: jax.Array
    layer: jax.Array  # int32 []

    @property
    def shape(self) -> tuple[int, ...]:
        return self.stack.shape[1:]

    @property
    def dtype(self) -> jnp.dtype:
        return self.stack.dtype

    def value(self) -> jax.Array:
        return self.stack[self.layer]

    def matmul_id(self, x: jax.Array, ids: jax.Array, per_layer: int) -> jax.Array:
        """`rowwise.matmul_id` of x `[T, K]` against this layer's `per_layer` matrices (ids int32 `[T, k]` among
        them) -> float32 `[T, k, N]`."""
        return rowwise.matmul_id(x, *layer_ids(self.stack, self.layer, ids, per_layer))


Dense = Union[jax.Array, StackedDense]

# dense_expert_linear's jnp route multiplies every expert when E <= this · k (no per-row weight gather).
ALL_EXPERTS_MAX_RATIO = 4


def _precision(w: jax.Array) -> jax.lax.Precision:
    return jax.lax.Precision.HIGHEST if w.dtype == jnp.float32 else jax.lax.Precision.DEFAULT


def dense_linear(x: jax.Array, w: Dense, groups: int | None = None) -> jax.Array:
    """`weights.linear` of a dense w: `x·wᵀ` in w's dtype with float32 accumulation (shapes as there); on the
    row-invariant custom calls under an invariant policy (w's bytes as packed F32/BF16/F16 rows)."""
    if isinstance(w, StackedDense):
        if invariant():
            return w.layer_linear(x, groups)
        w = w.value()
    if invariant():
        mma = kernel_policy.active().mma_code
        if groups is None:
            return rowwise.matmul(x, w, mma)
        ids = jnp.tile(jnp.arange(groups, dtype=jnp.int32), x.size // (x.shape[-1] * groups))[:, None]
        y = rowwise.matmul_id(x.reshape(-1, x.shape[-1]), w.reshape(groups, -1, w.shape[-1]), ids, groups)
        return y.reshape(*x.shape[:-2], groups, -1)
    x = x.astype(w.dtype)
    if groups is None:
        return jnp.einsum("...k,nk->...n", x, w, precision=_precision(w), preferred_element_type=jnp.float32)
    w = w.reshape(groups, -1, w.shape[-1])
    return jnp.einsum("...gk,grk->...gr", x, w, precision=_precision(w), preferred_element_type=jnp.float32)


def dense_expert_linear(x: jax.Array, w: Dense, ids: jax.Array) -> jax.Array:
    """`weights.expert_linear` of a dense expert stack w `[E, out, in]` (shapes as there); one MoE call on the
    row-invariant custom calls under an invariant policy.

    Otherwise stacks of at most ALL_EXPERTS_MAX_RATIO·k experts multiply every expert and keep the selected
    outputs (at most that many times the work, but no gathered weight copy per row, whose gradient is a
    scatter the size of every row's weights); larger stacks gather the selected experts' weights.
    """
    if isinstance(w, StackedDense):
        if invariant():
            return w.expert_linear(x, ids)
        w = w.value()
    per_expert = x.ndim > ids.ndim
    if invariant():
        flat_ids = ids.reshape(-1, 1) if per_expert else ids.reshape(-1, ids.shape[-1])
        y = rowwise.matmul_id(x.reshape(-1, x.shape[-1]), w, flat_ids)
        return y.reshape(*ids.shape, y.shape[-1])
    x = x.astype(w.dtype)
    if w.shape[0] <= ALL_EXPERTS_MAX_RATIO * ids.shape[-1]:  # few experts: no per-row weight copies (training)
        spec = "...jk,enk->...jen" if per_expert else "...k,enk->...en"
        every = jnp.einsum(spec, x, w, precision=_precision(w), preferred_element_type=jnp.float32)
        if per_expert:
            return jnp.take_along_axis(every, ids[..., None, None], axis=-2)[..., 0, :]
        return jnp.take_along_axis(every, ids[..., None], axis=-2)
    picked = jnp.take(w, ids, axis=0)  # [..., k, out, in]
    spec = "...jk,...jnk->...jn" if per_expert else "...k,...jnk->...jn"
    return jnp.einsum(spec, x, picked, precision=_precision(w), preferred_element_type=jnp.float32)


def contract(x: jax.Array, w: Dense) -> jax.Array:
    """`x·wᵀ` in float32 at full precision: x `[..., K]`, w dense `[N, K]` -> `[..., N]` (`dense_linear` of the
    float32 operands; a StackedDense layer of other matrices is sliced and cast)."""
    if isinstance(w, StackedDense) and w.dtype != jnp.float32:
        w = w.value()
    return dense_linear(x.astype(jnp.float32), w if isinstance(w, StackedDense) else w.astype(jnp.float32))


def grouped_contract(x: jax.Array, w: Dense, transposed: bool = False) -> jax.Array:
    """Per-group `y[g, m] = x[g, m]·w[g]ᵀ` in float32: x `[G, M, K]`, w `[G, N, K]`, or `[G, K, N]` when
    `transposed` (attention's values: the keys, read in place), or a StackedDense layer of either (a scanned
    body's cache, which the invariant call reads in place) -> `[G, M, N]`."""
    if invariant():
        if isinstance(w, StackedDense):
            return rowwise.grouped_rows(x, w.stack, transposed, w.layer)
        return rowwise.grouped_rows(x, w, transposed)
    if isinstance(w, StackedDense):
        w = w.value()
    spec = "gmk,gkn->gmn" if transposed else "gmk,gnk->gmn"
    return jnp.einsum(spec, x.astype(jnp.float32), w.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
