"""Weights as data, and the two matmul helpers every layer calls.

A weight is either a dense array (dequantized at load) or a `PackedWeight`: the tensor's bytes exactly as
stored in the GGUF, multiplied by the packed quantized matmul kernels (`dsparkjax.kernels`, FFI or their
jnp reference). Both are held in PyTorch orientation `[out, in]` (`[E, out, in]` for expert stacks), the
numpy shape of the GGUF tensor. Results are float32; float32 dense weights ask for full float32 precision
so that GPUs do not silently use TF32.

Packed kernels are matvecs: they read the weights once per tile of at most 8 tokens. A call with many rows
(batched generation sends batch x width rows to every matmul) therefore multiplies a packed non-expert weight
through a dense copy made in the graph, in the activation dtype: the numbers of `kernels="dequantize"`, on
XLA's GEMM, which reads the weight a few times per call (the dequantization, then the GEMM) but not once per
tile of tokens. Expert stacks keep the kernel, which serves each expert only
the tokens that chose it. The row thresholds and the GPU's tensor-core mode come from the KernelPolicy the
step traces under (`dsparkjax.kernels.policy`, part of its jit key). The row count is a static shape, so a
program takes one route for all its steps. Under an invariant policy (exact decoding) there is no dense copy.
Dense weights (and dense copies) are multiplied by `model/reduce.py`, which picks XLA's dots or, under an
invariant policy, the packed kernels with the matrices as their own bytes (`kernels/rowwise.py`).
"""

from __future__ import annotations

from typing import Callable, Union

import jax
import jax.numpy as jnp
from flax import struct

from dsparkjax import kernels
from dsparkjax.kernels import policy as kernel_policy
from dsparkjax.model import reduce
from dsparkjax.model.reduce import StackedDense
from dsparkjax.model.stacked import MoeWeight, layer_ids


@struct.dataclass
class PackedWeight(MoeWeight):
    """A quantized weight kept packed: uint8 `[out, row_bytes]` or `[E, out, row_bytes]` plus its format.

    In a scanned step (`model/target.py`) `data` may be a whole layer stack `[L, ...]` with `layer` the traced
    index of the layer meant: the FFI kernels then read that layer in place (the MoE call, the layer index
    folded into the ids), since slicing it would make XLA copy the weight for the custom call every step.
    """

    data: jax.Array
    ggml_type: int = struct.field(pytree_node=False)
    in_features: int = struct.field(pytree_node=False)
    dtype: jnp.dtype = struct.field(pytree_node=False)  # activation dtype fed to the kernel
    backend: str = struct.field(pytree_node=False)  # "ffi" or "reference"
    layer: jax.Array | None = None  # int32 [] index into data's leading layer axis, or None (data is the weight)

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.data.shape[int(self.layer is not None) : -1], self.in_features)

    @property
    def nbytes(self) -> int:
        """Bytes of the (one layer's) weight."""
        return self.data.nbytes // (self.data.shape[0] if self.layer is not None else 1)

    def at_layer(self, layer: jax.Array) -> "PackedWeight":
        """Layer `layer` of a stacked weight (data `[L, ...]`): read in place by the FFI kernels, sliced for the
        jnp reference (whose gather-and-dequantize XLA fuses, so no copy is made)."""
        if self.backend == "ffi":
            return self.replace(layer=layer)
        return self.replace(data=self.data[layer])

    def matmul_id(self, x: jax.Array, ids: jax.Array, per_layer: int) -> jax.Array:
        """The MoE call `y[t, j] = x[t]·w[ids[t, j]]ᵀ` on the packed kernels: x `[T, K]`, ids int32 `[T, k]` among
        the `per_layer` matrices of this weight (of its layer, for a stack) -> float32 `[T, k, N]`."""
        data, ids = (self.data, ids) if self.layer is None else layer_ids(self.data, self.layer, ids, per_layer)
        return kernels.qmatmul_id(x.astype(self.dtype), data, ids, self.ggml_type, backend=self.backend)

    def dense(self) -> jax.Array:
        """The packed bytes of this weight alone (a slice of a stack, which XLA fuses into an elementwise user)."""
        return self.data if self.layer is None else self.data[self.layer]


Weight = Union[jax.Array, PackedWeight, StackedDense]


@struct.dataclass
class RowBlocks:
    """Matrices that multiply the same input, their rows stacked at load into as few weights as their formats
    allow, so that each stacked part is one matmul: one kernel launch and one staging of the activations
    instead of one per matrix (docs/kernels.md#tuning-stacked-matrices). The packed kernels compute each row in an order of its own, so there a stacked matrix's
    outputs are its own call's bits; XLA's dots (dense weights, the jnp reference, the dense-copy route) may
    round the wider product differently. Exact decoding does not mind: its invariant steps multiply every
    weight, dense or packed, on the kernels.

    parts[i] holds the matrices of out-sizes sizes[i], in order, along its out axis (`[..., out, in]`).
    """

    parts: tuple[Weight, ...]
    sizes: tuple[tuple[int, ...], ...] = struct.field(pytree_node=False)


def takes_dense_copy(w: PackedWeight, rows: int) -> bool:
    """Whether a call of `rows` rows multiplies w through its dense copy, by the active KernelPolicy's thresholds."""
    policy = kernel_policy.active()
    if w.backend != "ffi" or policy.gemm_min_rows <= 0 or reduce.invariant():
        return False
    return rows >= policy.gemm_min_rows or (
        rows >= policy.gemm_min_rows_large and w.nbytes >= policy.large_weight_bytes)


def dense_copy(w: PackedWeight) -> jax.Array:
    """w dequantized in the graph, in its activation dtype: `[..., out, in]`."""
    return kernels.dequantize(w.dense(), w.ggml_type, w.in_features).astype(w.dtype)


def _packed_linear(x: jax.Array, w: PackedWeight) -> jax.Array:
    flat = x.reshape(-1, x.shape[-1]).astype(w.dtype)
    y = kernels.qmatmul(flat, w.data, w.ggml_type, backend=w.backend, mma=kernel_policy.active().mma)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _packed_grouped_linear(x: jax.Array, w: PackedWeight, groups: int) -> jax.Array:
    """x `[..., g, in/g]` against the g row blocks of w, in one kernel call."""
    flat = x.reshape(-1, groups, x.shape[-1]).astype(w.dtype)
    stack = w.data.reshape(groups, -1, w.data.shape[-1])
    y = kernels.qmatmul_grouped(flat, stack, w.ggml_type, backend=w.backend,
                                mma=kernel_policy.active().mma)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def linear(x: jax.Array, w: Weight, *, groups: int | None = None) -> jax.Array:
    """`x·wᵀ` with float32 accumulation.

    Args:
      x: `[..., in]`, or `[..., g, in/g]` when `groups` is given (a grouped projection).
      w: `[out, in]`, or `[g·r, in/g]` when grouped (group j uses rows j·r..(j+1)·r).
    Returns:
      float32 `[..., out]`, or `[..., g, r]` when grouped.
    """
    if isinstance(w, PackedWeight):
        if not takes_dense_copy(w, x.size // (x.shape[-1] * (groups or 1))):
            if w.layer is not None:
                return w.layer_linear(x, groups)
            return _packed_linear(x, w) if groups is None else _packed_grouped_linear(x, w, groups)
        w = dense_copy(w)
    return reduce.dense_linear(x, w, groups)


def expert_linear(x: jax.Array, w: Weight, ids: jax.Array) -> jax.Array:
    """Each token against its own selected experts: `y[..., j, :] = x·w[ids[..., j]]ᵀ` (packed stacks on the MoE
    kernel, dense ones by `reduce.dense_expert_linear`).

    Args:
      x: `[..., in]` (one input per token) or `[..., k, in]` (one input per selected expert);
      w: `[E, out, in]`; ids: int32 `[..., k]`.
    Returns:
      float32 `[..., k, out]`.
    """
    if isinstance(w, PackedWeight):
        return w.expert_linear(x, ids)
    return reduce.dense_expert_linear(x, w, ids)


def _split_rows(rb: RowBlocks, multiply: Callable[[Weight], jax.Array], only: tuple[int, ...] | None
                ) -> tuple[jax.Array, ...]:
    """The outputs `multiply(part)` gives for each matrix of rb (or for those numbered in `only`), split off
    their parts' outputs along the last axis; parts holding none of them are not multiplied."""
    wanted = range(sum(len(s) for s in rb.sizes)) if only is None else only
    outputs, first = {}, 0
    for part, sizes in zip(rb.parts, rb.sizes):
        mine = range(first, first + len(sizes))
        if any(i in mine for i in wanted):
            y, start = multiply(part), 0
            for i, size in zip(mine, sizes):
                outputs[i], start = y[..., start : start + size], start + size
        first += len(sizes)
    return tuple(outputs[i] for i in wanted)


def linear_rows(x: jax.Array, rb: RowBlocks, *, only: tuple[int, ...] | None = None) -> tuple[jax.Array, ...]:
    """`linear(x, w)` for each matrix w of rb (or those numbered in `only`): float32 `[..., out_i]` each."""
    return _split_rows(rb, lambda w: linear(x, w), only)


def expert_linear_rows(x: jax.Array, rb: RowBlocks, ids: jax.Array) -> tuple[jax.Array, ...]:
    """`expert_linear(x, w, ids)` for each expert stack w of rb: float32 `[..., k, out_i]` each."""
    return _split_rows(rb, lambda w: expert_linear(x, w, ids), None)
