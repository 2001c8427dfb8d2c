"""Weight formats: decode and encode ggml tensor bytes (standard ggml types and lucebox ROCm types).

`dequantize(raw, ggml_type, shape)` turns a tensor's bytes into float32 of its logical numpy `shape`
(last axis = the row length K = ggml ne[0]; blocks run along it). `quantize(values, ggml_type)` is the
inverse for the writable types and returns uint8[..., K // block_size * type_size]. Standard types go
through gguf-py (`gguf.quants`); the six ROCm types (ids 100-104, 107) through our numpy codecs
(`dsparkjax.formats.rocm`, bit-exact to quant_hc.md §1); Q2_K, Q4_K and IQ2_XXS are written by the
quantizers of `dsparkjax.formats.kquant`. The decoding tables that kernels need are re-exported here.
"""

from __future__ import annotations

import math

import gguf
import numpy as np

from dsparkjax.errors import FormatError, UnsupportedTypeError
from dsparkjax.formats import kquant, rocm
from dsparkjax.formats.kquant import IQ2XXS_GRID, IQ2XXS_KSIGNS
from dsparkjax.formats.rocm import (
    FP2_LEVELS,
    FP3_LEVELS,
    FP4_LEVELS,
    FP6_LEVELS,
    FP8_LEVELS,
    MAX_VALID_SCALE_BYTE,
    ROCM_SCALE_TABLE,
)
from dsparkjax.formats.types import (
    DEQUANTIZABLE_TYPES,
    FLOAT_TYPES,
    INTEGER_TYPES,
    ROCM_TYPES,
    WRITABLE_TYPES,
    GGMLType,
    block_size,
    is_rocm_type,
    row_bytes,
    type_name,
    type_size,
)
from dsparkjax.formats.types import ggml_type as _as_type

__all__ = [
    "DEQUANTIZABLE_TYPES",
    "FLOAT_TYPES",
    "FP2_LEVELS",
    "FP3_LEVELS",
    "FP4_LEVELS",
    "FP6_LEVELS",
    "FP8_LEVELS",
    "INTEGER_TYPES",
    "IQ2XXS_GRID",
    "IQ2XXS_KSIGNS",
    "MAX_VALID_SCALE_BYTE",
    "ROCM_SCALE_TABLE",
    "ROCM_TYPES",
    "WRITABLE_TYPES",
    "GGMLType",
    "block_size",
    "dequantize",
    "invalid_scale_blocks",
    "is_rocm_type",
    "quantize",
    "row_bytes",
    "type_name",
    "type_size",
]


def _label(t: GGMLType) -> str:
    return f"{t.name} (type {int(t)})"


def _as_bytes(raw: np.ndarray) -> np.ndarray:
    """Any array -> its bytes as flat uint8 (a view when `raw` is already contiguous)."""
    return np.ascontiguousarray(raw).view(np.uint8).reshape(-1)


def _blocks(raw: np.ndarray, t: GGMLType) -> np.ndarray:
    """Any array -> its bytes as uint8[n_blocks, type_size]; FormatError if not a whole number of blocks."""
    data = _as_bytes(raw)
    ts = type_size(t)
    if data.size % ts:
        raise FormatError(f"{_label(t)}: {data.size} bytes is not a multiple of the block size {ts} bytes")
    return data.reshape(-1, ts)


def dequantize(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
    """Decode tensor bytes to float32 of the logical numpy `shape` (last axis = row length K).

    `raw` holds the tensor's bytes in any array shape or dtype (e.g. uint8[rows, row_bytes] from gguf-py);
    only its byte count must match. ROCm scale bytes > 0x7E decode as scale 0 (find them with
    `invalid_scale_blocks`). For F32 the result may share memory with `raw`.
    Raises UnsupportedTypeError for integer or undecodable types, FormatError for bad sizes.
    """
    t = _check_type(ggml_type, DEQUANTIZABLE_TYPES, "dequantize")
    shape = tuple(int(d) for d in shape)
    if not shape:
        raise FormatError(f"{_label(t)}: a tensor shape needs at least one axis, got {shape}")
    n_rows, rb = math.prod(shape[:-1]), row_bytes(t, shape[-1])
    data = _as_bytes(raw)
    if data.size != n_rows * rb:
        raise FormatError(
            f"{_label(t)}: shape {shape} needs {n_rows * rb} bytes ({n_rows} rows x {rb}), got {data.size}"
        )
    if t in ROCM_TYPES:
        out = rocm.dequantize_blocks(data.reshape(-1, type_size(t)), rocm.CODECS[t])
    else:
        out = gguf.quants.dequantize(data.reshape(n_rows, rb), gguf.GGMLQuantizationType(int(t)))
    return out.astype(np.float32, copy=False).reshape(shape)


def quantize(values: np.ndarray, ggml_type: int) -> np.ndarray:
    """Encode float values [..., K] as uint8[..., K // block_size * type_size] of a type in WRITABLE_TYPES.

    F32/F16 are plain casts; BF16 and Q8_0 use gguf-py (bit-exact to ggml); the ROCm types use the
    byte-exact unweighted reference quantizer of lucebox; Q4_K follows ggml's `quantize_row_q4_K_ref`; Q2_K and
    IQ2_XXS use our simple nearest-value quantizers (valid blocks, sensible approximation, not ggml's bytes: see
    `dsparkjax.formats.kquant`).
    """
    t = _check_type(ggml_type, WRITABLE_TYPES, "quantize")
    x = np.asarray(values, np.float32)
    if x.ndim == 0:
        raise FormatError(f"{_label(t)}: cannot quantize a 0-d array; values need a row axis")
    out_shape = (*x.shape[:-1], row_bytes(t, x.shape[-1]))
    if t == GGMLType.F32:
        return np.ascontiguousarray(x).view(np.uint8).reshape(out_shape)
    if t == GGMLType.F16:
        return np.ascontiguousarray(x.astype(np.float16)).view(np.uint8).reshape(out_shape)
    if t in (GGMLType.BF16, GGMLType.Q8_0):
        return gguf.quants.quantize(x, gguf.GGMLQuantizationType(int(t))).reshape(out_shape)
    blocks = x.reshape(-1, block_size(t))
    if t == GGMLType.Q2_K:
        out = kquant.quantize_q2_k(blocks)
    elif t == GGMLType.Q4_K:
        out = kquant.quantize_q4_k(blocks)
    elif t == GGMLType.IQ2_XXS:
        out = kquant.quantize_iq2_xxs(blocks)
    else:
        out = rocm.quantize_blocks(blocks, rocm.CODECS[t])
    return out.reshape(out_shape)


def invalid_scale_blocks(raw: np.ndarray, ggml_type: int) -> np.ndarray:
    """Flat indices (int64) of the blocks whose scale byte(s) exceed 0x7E; empty for non-ROCm types.

    lucebox's CPU decoder reads such scales as 0 but its FP4 GPU decoder does not (quant_hc.md §1.1), so a
    reader should reject or report these blocks. FormatError if `raw` is not a whole number of blocks.
    """
    t = _as_type(ggml_type)
    blocks = _blocks(raw, t)
    if t not in ROCM_TYPES:
        return np.empty(0, np.int64)
    return rocm.invalid_scale_blocks(blocks, rocm.CODECS[t])


def _check_type(t: int, allowed: frozenset[GGMLType], what: str) -> GGMLType:
    gt = _as_type(t)
    if gt in INTEGER_TYPES:
        raise UnsupportedTypeError(f"{_label(gt)} is an integer type, not a float weight format; cannot {what}")
    if gt not in allowed:
        supported = ", ".join(sorted(x.name for x in allowed))
        raise UnsupportedTypeError(f"cannot {what} {_label(gt)}; supported types: {supported}")
    return gt
