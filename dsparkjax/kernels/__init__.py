"""Batch-invariant kernels: packed quantized matmul (dense, MoE by expert id, grouped), mHC pre/post and the
CSA Lightning Indexer's top-k selection.

Every op has two backends with one signature:
  * "ffi": the compiled XLA FFI plugin (`custom_calls/`, CPU and CUDA). Weights stay packed exactly as stored
    in the GGUF, accumulation is fp32, and each output row is computed with an order that does not depend
    on T or on the other rows of the call, so row i of a T-row call is bit-identical to a 1-row call.
    On the GPU, Q8_0, Q2_K and IQ2_XXS multiply int8 weights with an int8-limb form of the activations (each
    kept to 2^-23 of its 32-block's largest magnitude), exactly in int32 per 32-block, then in fp32.
  * "reference": pure jnp (`dsparkjax.kernels.reference`), always available; equal to the FFI result up to
    fp32 summation order, but XLA's own reductions are not batch-invariant (exactness.md §1).
`backend=None` picks "ffi" when the plugin for the default JAX platform is loaded, else "reference".
All ops work inside `jax.jit`; `ggml_type`, the HC hyper-parameters and all shapes are static.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsparkjax.errors import DsparkError
from dsparkjax.kernels import ffi, reference
from dsparkjax.kernels.ffi import PluginError
from dsparkjax.kernels.packed import KERNEL_TYPES, check_row_bytes, dequantize
from dsparkjax.kernels.policy import MMA_CODES, KernelPolicy, MmaMode

__all__ = [
    "KERNEL_TYPES",
    "KernelPolicy",
    "PluginError",
    "default_backend",
    "dequantize",
    "hc_post",
    "hc_pre",
    "indexer_topk",
    "qmatmul",
    "qmatmul_grouped",
    "qmatmul_id",
]


def default_backend() -> str:
    """'ffi' if the plugin for the default JAX platform is loaded, else 'reference'."""
    return "ffi" if ffi.available() else "reference"


def _use_ffi(backend: str | None) -> bool:
    if backend is None:
        return ffi.available()
    if backend == "ffi":
        ffi.require()
        return True
    if backend == "reference":
        return False
    raise ValueError(f"backend must be None, 'ffi' or 'reference', got {backend!r}")


def _check_2d(name: str, a: jax.Array) -> None:
    if a.ndim != 2:
        raise DsparkError(f"{name} must be 2-D [T, ...], got shape {a.shape}")


def _mma_code(mma: MmaMode) -> int:
    if mma not in MMA_CODES:
        raise DsparkError(f"mma must be one of {sorted(MMA_CODES)}, got {mma!r}")
    return MMA_CODES[mma]


def qmatmul(x: jax.Array, w_packed: jax.Array, ggml_type: int, *, backend: str | None = None,
            mma: MmaMode = "auto") -> jax.Array:
    """`y = x · Wᵀ` with W packed: x float32|bfloat16 `[T, K]`, w_packed uint8 `[N, row_bytes]` -> f32 `[T, N]`.

    `mma` is the GPU's tensor-core mode for this call (`KernelPolicy.mma`); every mode gives the same bits.
    """
    _check_2d("x", x)
    if w_packed.ndim != 2:
        raise DsparkError(f"w_packed must be uint8 [N, row_bytes], got shape {w_packed.shape}")
    check_row_bytes(ggml_type, x.shape[1], w_packed.shape[1])
    code = _mma_code(mma)
    if _use_ffi(backend):
        return ffi.qmatmul(x, w_packed, int(ggml_type), code)
    return reference.qmatmul(x, w_packed, int(ggml_type))


def qmatmul_id(
    x: jax.Array, w_packed: jax.Array, ids: jax.Array, ggml_type: int, *, backend: str | None = None
) -> jax.Array:
    """MoE matmul: `y[t, j] = W[ids[t, j]] · x[t]`; ids outside `[0, E)` give zero rows.

    x float32|bfloat16 `[T, K]`, w_packed uint8 `[E, N, row_bytes]`, ids int32 `[T, k]` -> float32 `[T, k, N]`.
    The GPU kernel reads each selected expert once per call, however many tokens chose it.
    """
    return _qmatmul_id(x, w_packed, ids, ggml_type, backend=backend, groups=0, mma="auto")


def _qmatmul_id(
    x: jax.Array, w_packed: jax.Array, ids: jax.Array, ggml_type: int, *, backend: str | None, groups: int,
    mma: MmaMode,
) -> jax.Array:
    """`qmatmul_id`; groups > 0 tells the FFI op that ids[p] = p mod groups (a grouped projection)."""
    _check_2d("x", x)
    _check_2d("ids", ids)
    if w_packed.ndim != 3:
        raise DsparkError(f"w_packed must be uint8 [E, N, row_bytes], got shape {w_packed.shape}")
    if ids.shape[0] != x.shape[0]:
        raise DsparkError(f"ids {ids.shape} and x {x.shape} disagree on T")
    check_row_bytes(ggml_type, x.shape[1], w_packed.shape[2])
    code = _mma_code(mma)
    if _use_ffi(backend):
        return ffi.qmatmul_id(x, w_packed, ids.astype("int32"), int(ggml_type), groups, code)
    return reference.qmatmul_id(x, w_packed, ids.astype("int32"), int(ggml_type))


def qmatmul_grouped(
    x: jax.Array, w_packed: jax.Array, ggml_type: int, *, backend: str | None = None, mma: MmaMode = "auto"
) -> jax.Array:
    """Grouped matmul in one call: `y[t, g] = W[g] · x[t, g]`.

    x float32|bfloat16 `[T, G, K]`, w_packed uint8 `[G, N, row_bytes]` -> float32 `[T, G, N]`. It is the MoE
    op with each (token, group) row choosing expert g, so the G matrices are read once per call in one
    launch instead of G launches of a G-times smaller matmul (a decode step's grouped output projection).
    Each output is computed as by `qmatmul_id`, so it stays batch invariant; the GPU may take the dense calls'
    tensor-core kernel for several tokens per group (`mma`, as in `qmatmul`), which gives the same bits.
    """
    if x.ndim != 3 or w_packed.ndim != 3 or x.shape[1] != w_packed.shape[0]:
        raise DsparkError(f"qmatmul_grouped: x {x.shape} must be [T, G, K] and w_packed {w_packed.shape} [G, N, row_bytes]")
    t, g, k = x.shape
    ids = jnp.tile(jnp.arange(g, dtype=jnp.int32), t).reshape(t * g, 1)
    y = _qmatmul_id(x.reshape(t * g, k), w_packed, ids, ggml_type, backend=backend, groups=g, mma=mma)
    return y.reshape(t, g, -1)


def hc_pre(
    streams: jax.Array,
    fn: jax.Array,
    base: jax.Array,
    scale: jax.Array,
    *,
    iters: int,
    hc_eps: float,
    norm_eps: float,
    backend: str | None = None,
    layer: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """HC-pre of `dsparkjax.model.hc.hc_pre` with a leading token axis, fp32 inside.

    streams float `[T, n, D]`, fn float `[(2+n)·n, n·D]`, base `[(2+n)·n]`, scale `[3]` ->
    (u `[T, D]`, post `[T, n]`, comb `[T, n, n]`), float32; comb rows = source stream, columns = destination.
    With `layer` (int32 `[]`), fn is a stack `[L, (2+n)·n, n·D]` and layer `layer` of it is used: the kernel
    reads it in place (a scanned body's layer), the reference slices it.
    """
    if streams.ndim != 3:
        raise DsparkError(f"streams must be [T, n, D], got shape {streams.shape}")
    _t, n, d = streams.shape
    lead = () if layer is None else fn.shape[:1]
    if fn.shape != (*lead, (2 + n) * n, n * d) or base.shape != ((2 + n) * n,) or scale.shape != (3,):
        raise DsparkError(f"hc_pre: fn {fn.shape}, base {base.shape}, scale {scale.shape} do not fit n={n}, D={d}"
                          f"{'' if layer is None else ' and a stack of layers'}")
    hp = dict(iters=iters, hc_eps=hc_eps, norm_eps=norm_eps)
    if _use_ffi(backend):
        return ffi.hc_pre(streams, fn, base, scale, layer=layer, **hp)
    return reference.hc_pre(streams, fn if layer is None else fn[layer], base, scale, **hp)


def hc_post(
    block_out: jax.Array, streams: jax.Array, post: jax.Array, comb: jax.Array, *, backend: str | None = None
) -> jax.Array:
    """HC-post `X'[t, k] = post[t, k]·F[t] + Σ_j comb[t, j, k]·X[t, j]`.

    block_out float `[T, D]`, streams float `[T, n, D]`, post `[T, n]`, comb `[T, n, n]` -> float32 `[T, n, D]`.
    """
    if streams.ndim != 3:
        raise DsparkError(f"streams must be [T, n, D], got shape {streams.shape}")
    t, n, d = streams.shape
    if block_out.shape != (t, d) or post.shape != (t, n) or comb.shape != (t, n, n):
        raise DsparkError(
            f"hc_post: block_out {block_out.shape}, post {post.shape}, comb {comb.shape} do not fit streams {streams.shape}"
        )
    impl = ffi if _use_ffi(backend) else reference
    return impl.hc_post(block_out, streams, post, comb)


def indexer_topk(
    queries: jax.Array, keys: jax.Array, head_weights: jax.Array, lengths: jax.Array, k: int, *,
    backend: str | None = None, layer: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The Lightning Indexer's top-k of the first `lengths[b, q]` entries of `keys` for each query row.

    `score[b, q, n] = Σ_h w[b, q, h] · relu(queries[b, q, h] · keys[b, n])` for n < lengths[b, q]; returns the k
    best by score descending with ties to the lowest entry, and for a row with fewer than k visible entries,
    entry j in each slot j >= length (marked not real). The FFI op reads only the visible entries, so its cost
    grows with the lengths, not with the buffer's capacity N; the reference scores all N.

    queries float32 `[B, Q, H, d]`, keys float32 `[B, N, d]`, head_weights float32 `[B, Q, H]`, lengths int32
    `[B, Q]` (clamped to [0, N]), k static in 1..N -> (picks int32 `[B, Q, k]`, real bool `[B, Q, k]`).
    With `layer` (int32 `[]`), keys is a stack `[L, B, N, d]` and layer `layer` of it is used: the FFI op reads it in
    place (a scanned body's layer), the reference slices it.
    """
    lead = 0 if layer is None else 1
    if (queries.ndim != 4 or keys.ndim != 3 + lead or keys.shape[lead] != queries.shape[0]
            or keys.shape[-1] != queries.shape[3]):
        raise DsparkError(f"indexer_topk: queries {queries.shape} must be [B, Q, H, d] and keys {keys.shape} "
                          f"{'[B, N, d]' if layer is None else '[L, B, N, d]'}")
    if head_weights.shape != queries.shape[:3] or lengths.shape != queries.shape[:2]:
        raise DsparkError(f"indexer_topk: head_weights {head_weights.shape} must be [B, Q, H] and lengths "
                          f"{lengths.shape} [B, Q] for queries {queries.shape}")
    n = keys.shape[-2]
    if not 1 <= k <= n:
        raise DsparkError(f"indexer_topk: k = {k} must be in 1..N = {n}")
    f32 = jnp.float32
    queries, head_weights, keys = queries.astype(f32), head_weights.astype(f32), keys.astype(f32)
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, n)
    if _use_ffi(backend):
        return ffi.indexer_topk(queries, keys, head_weights, lengths, int(k), layer)
    return reference.indexer_topk(queries, keys if layer is None else keys[layer], head_weights, lengths, int(k))
