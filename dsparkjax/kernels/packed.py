"""Pure-jnp dequantization of packed ggml / lucebox weight rows (the reference side of the kernels).

`dequantize(w_packed, ggml_type, k)` turns uint8 `[..., row_bytes]` (rows exactly as stored in the GGUF) into
float32 `[..., k]`, with the same fp32 operations as the format's reference dequantizer, so the values are
bit-identical to `dsparkjax.formats.dequantize` (layouts: quant_hc.md §1.2, §4.2, §4.3; Q4_K: `FmtQ4_K` in
custom_calls/quant_formats.h). It is jit-friendly (`ggml_type` and `k` static) and used by
`dsparkjax.kernels.reference` and by tests.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from dsparkjax.errors import FormatError, UnsupportedTypeError
from dsparkjax.formats import (
    FP2_LEVELS,
    FP3_LEVELS,
    FP4_LEVELS,
    FP6_LEVELS,
    IQ2XXS_GRID,
    IQ2XXS_KSIGNS,
    ROCM_SCALE_TABLE,
    GGMLType,
    block_size,
    type_name,
    type_size,
)

_F32 = jnp.float32


def _bitcast(b: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """uint8 `[..., m·w]` -> dtype `[..., m]` for a w-byte dtype (little-endian, as stored)."""
    width = np.dtype(dtype).itemsize
    if width == 1:
        return jax.lax.bitcast_convert_type(b, dtype)
    return jax.lax.bitcast_convert_type(b.reshape(*b.shape[:-1], -1, width), dtype)


def _half(b: jax.Array) -> jax.Array:
    """The binary16 stored in the 2 bytes of the last axis, as float32 `[...]`."""
    return jax.lax.bitcast_convert_type(b, jnp.float16).astype(_F32)


def _dense(dtype: jnp.dtype) -> Callable[[jax.Array], jax.Array]:
    return lambda b: _bitcast(b, dtype).astype(_F32)


def _q8_0(b: jax.Array) -> jax.Array:
    return _half(b[..., 0:2])[..., None] * _bitcast(b[..., 2:], jnp.int8).astype(_F32)


def _q2_k(b: jax.Array) -> jax.Array:
    lead = b.shape[:-1]
    sc = b[..., 0:16].reshape(*lead, 2, 4, 2, 1)  # [half n, shift group j, l >= 16]
    qs = b[..., 16:80].reshape(*lead, 2, 1, 32)
    shifts = jnp.arange(0, 8, 2, dtype=jnp.uint8).reshape(4, 1)
    q = ((qs >> shifts) & 3).reshape(*lead, 2, 4, 2, 16).astype(_F32)
    d = _half(b[..., 80:82])[..., None, None, None, None]
    dmin = _half(b[..., 82:84])[..., None, None, None, None]
    dl = d * (sc & 15).astype(_F32)
    ml = dmin * (sc >> 4).astype(_F32)
    return (dl * q - ml).reshape(*lead, 256)


def _q4_k(b: jax.Array) -> jax.Array:
    lead = b.shape[:-1]
    d, dmin = _half(b[..., 0:2])[..., None], _half(b[..., 2:4])[..., None]
    low, mid, high = (b[..., 4 + 4 * i : 8 + 4 * i] for i in range(3))  # scales[0:4], [4:8], [8:12]
    sc = jnp.concatenate([low & 63, (high & 15) | ((low >> 6) << 4)], axis=-1).astype(_F32)  # [..., 8]
    m = jnp.concatenate([mid & 63, (high >> 4) | ((mid >> 6) << 4)], axis=-1).astype(_F32)
    qs = b[..., 16:144].reshape(*lead, 4, 1, 32)
    q = ((qs >> jnp.array([[0], [4]], jnp.uint8)) & 15).reshape(*lead, 8, 32).astype(_F32)  # sub-block 2i: low
    return ((d * sc)[..., None] * q - (dmin * m)[..., None]).reshape(*lead, 256)


def _iq2_xxs(b: jax.Array) -> jax.Array:
    lead = b.shape[:-1]
    d = _half(b[..., 0:2])[..., None]
    groups = b[..., 2:].reshape(*lead, 8, 8)
    a1 = _bitcast(groups[..., 4:8], jnp.uint32)[..., 0]  # [..., 8]
    db = d * (0.5 + (a1 >> 28).astype(_F32)) * 0.25
    grid = jnp.asarray(IQ2XXS_GRID, _F32)[groups[..., 0:4].astype(jnp.int32)]  # [..., 8, 4, 8]
    sign_idx = (a1[..., None] >> jnp.arange(0, 28, 7, dtype=jnp.uint32)) & 127
    signs = jnp.asarray(IQ2XXS_KSIGNS)[sign_idx.astype(jnp.int32)]  # [..., 8, 4]
    neg = ((signs[..., None] >> jnp.arange(8, dtype=jnp.uint8)) & 1).astype(bool)
    v = db[..., None, None] * grid
    return jnp.where(neg, -v, v).reshape(*lead, 256)


def _rocm_scales(e: jax.Array) -> jax.Array:
    """Scale bytes `[..., s]` -> per-element scales `[..., 32]` (s = 1 or 2 halves)."""
    s = jnp.asarray(ROCM_SCALE_TABLE)[e.astype(jnp.int32)]
    return jnp.repeat(s, 32 // e.shape[-1], axis=-1)


def _fp4(n_scales: int) -> Callable[[jax.Array], jax.Array]:
    def dec(b: jax.Array) -> jax.Array:
        qs = b[..., 0:16]
        codes = jnp.concatenate([qs & 15, qs >> 4], axis=-1).astype(jnp.int32)
        return jnp.asarray(FP4_LEVELS, _F32)[codes] * _rocm_scales(b[..., 16 : 16 + n_scales])

    return dec


def _bitstream(bits: int, levels: np.ndarray) -> Callable[[jax.Array], jax.Array]:
    def dec(b: jax.Array) -> jax.Array:
        qs = b[..., 0 : 4 * bits]
        stream = (qs[..., None] >> jnp.arange(8, dtype=jnp.uint8)) & 1  # [..., 4·bits, 8], LSB first
        stream = stream.reshape(*b.shape[:-1], 32, bits).astype(jnp.int32)
        codes = jnp.sum(stream << jnp.arange(bits, dtype=jnp.int32), axis=-1)
        return jnp.asarray(levels, _F32)[codes] * _rocm_scales(b[..., 4 * bits : 4 * bits + 2])

    return dec


def _fp8(b: jax.Array) -> jax.Array:
    return _bitcast(b[..., 0:32], jnp.int8).astype(_F32) * _rocm_scales(b[..., 32:33])


# ggml type -> decoder of uint8 [..., n_blocks, type_size] blocks into float32 [..., n_blocks, block_size].
_DECODERS: dict[GGMLType, Callable[[jax.Array], jax.Array]] = {
    GGMLType.F32: _dense(jnp.float32),
    GGMLType.F16: _dense(jnp.float16),
    GGMLType.BF16: _dense(jnp.bfloat16),
    GGMLType.Q8_0: _q8_0,
    GGMLType.Q2_K: _q2_k,
    GGMLType.Q4_K: _q4_k,
    GGMLType.IQ2_XXS: _iq2_xxs,
    GGMLType.Q4_0_ROCMFP4: _fp4(2),
    GGMLType.Q4_0_ROCMFP4_FAST: _fp4(1),
    GGMLType.Q6_0_ROCMFPX: _bitstream(6, FP6_LEVELS),
    GGMLType.Q8_0_ROCMFPX: _fp8,
    GGMLType.Q3_0_ROCMFPX: _bitstream(3, FP3_LEVELS),
    GGMLType.Q2_0_ROCMFP2: _bitstream(2, FP2_LEVELS),
}

KERNEL_TYPES: frozenset[GGMLType] = frozenset(_DECODERS)
"""The ggml types the packed kernels (FFI and reference) accept."""


def kernel_type(ggml_type: int) -> GGMLType:
    """`ggml_type` as a GGMLType the kernels support; UnsupportedTypeError otherwise."""
    try:
        t = GGMLType(int(ggml_type))
    except ValueError:
        t = None
    if t not in KERNEL_TYPES:
        names = ", ".join(sorted(x.name for x in KERNEL_TYPES))
        raise UnsupportedTypeError(
            f"packed kernels do not support ggml type {type_name(ggml_type)} ({int(ggml_type)}); supported: {names}"
        )
    return t


def check_row_bytes(ggml_type: int, k: int, row_bytes: int) -> None:
    """FormatError unless a packed row of `row_bytes` bytes holds `k` weights of `ggml_type`.

    The dense float types are handled by the kernels as pseudo-blocks of 8, so their K must be a multiple of 8.
    """
    t = kernel_type(ggml_type)
    blk = 8 if block_size(t) == 1 else block_size(t)
    if k <= 0 or k % blk:
        raise FormatError(f"{t.name}: K={k} is not a positive multiple of {blk}")
    expected = k // block_size(t) * type_size(t)
    if row_bytes != expected:
        raise FormatError(f"{t.name}: packed rows have {row_bytes} bytes, expected {expected} for K={k}")


def dequantize(w_packed: jax.Array, ggml_type: int, k: int) -> jax.Array:
    """uint8 `[..., row_bytes]` packed rows -> float32 `[..., k]` (bit-identical to the format's reference)."""
    t = kernel_type(ggml_type)
    check_row_bytes(t, k, w_packed.shape[-1])
    nb = k // block_size(t)
    blocks = jnp.asarray(w_packed, jnp.uint8).reshape(*w_packed.shape[:-1], nb, type_size(t))
    return _DECODERS[t](blocks).reshape(*w_packed.shape[:-1], k)
