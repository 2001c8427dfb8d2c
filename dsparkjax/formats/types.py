"""ggml tensor type ids and their block geometry (quant_hc.md §1.2, §4.2).

A ggml type stores a row of K weights (K = ggml ne[0], the last numpy axis) as K / block_size blocks of
type_size bytes each. The standard ids are those of gguf-py 0.19 (`gguf.GGMLQuantizationType`); ids 100-107
are the lucebox ROCmFP4/ROCmFPX types (LB `ggml.h`), which gguf-py does not know.
"""

from __future__ import annotations

import enum

import gguf

from dsparkjax.errors import FormatError, UnsupportedTypeError


class GGMLType(enum.IntEnum):
    """On-disk GGUF tensor type ids: the standard ggml ids plus the six lucebox ROCm ids."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39
    NVFP4 = 40
    Q1_0 = 41
    Q4_0_ROCMFP4 = 100
    Q4_0_ROCMFP4_FAST = 101
    Q6_0_ROCMFPX = 102
    Q8_0_ROCMFPX = 103
    Q3_0_ROCMFPX = 104
    Q2_0_ROCMFP2 = 107


# (block_size, type_size) of the ROCm types: 32 weights per block, bytes per LB `type_traits`.
_ROCM_SIZES: dict[GGMLType, tuple[int, int]] = {
    GGMLType.Q4_0_ROCMFP4: (32, 18),
    GGMLType.Q4_0_ROCMFP4_FAST: (32, 17),
    GGMLType.Q6_0_ROCMFPX: (32, 26),
    GGMLType.Q8_0_ROCMFPX: (32, 33),
    GGMLType.Q3_0_ROCMFPX: (32, 14),
    GGMLType.Q2_0_ROCMFP2: (32, 10),
}

# gguf-py lists Q8_1 as (32, 40), an old float layout; ggml C uses 36 bytes (quant_hc.md §4.2).
_SIZE_OVERRIDES: dict[GGMLType, tuple[int, int]] = {GGMLType.Q8_1: (32, 36)}

ROCM_TYPES: frozenset[GGMLType] = frozenset(_ROCM_SIZES)

# Standard types gguf-py 0.19 can dequantize (`gguf.quants.dequantize`, quant_hc.md §4.4).
_GGUF_DEQUANTIZABLE: frozenset[GGMLType] = frozenset(
    {
        GGMLType.F32,
        GGMLType.F16,
        GGMLType.BF16,
        GGMLType.Q4_0,
        GGMLType.Q4_1,
        GGMLType.Q5_0,
        GGMLType.Q5_1,
        GGMLType.Q8_0,
        GGMLType.Q2_K,
        GGMLType.Q3_K,
        GGMLType.Q4_K,
        GGMLType.Q5_K,
        GGMLType.Q6_K,
        GGMLType.TQ1_0,
        GGMLType.TQ2_0,
        GGMLType.MXFP4,
        GGMLType.NVFP4,
        GGMLType.IQ2_XXS,
        GGMLType.IQ2_XS,
        GGMLType.IQ2_S,
        GGMLType.IQ3_XXS,
        GGMLType.IQ3_S,
        GGMLType.IQ1_S,
        GGMLType.IQ1_M,
        GGMLType.IQ4_NL,
        GGMLType.IQ4_XS,
    }
)

# Types `dsparkjax.formats.dequantize` can decode to float32.
DEQUANTIZABLE_TYPES: frozenset[GGMLType] = _GGUF_DEQUANTIZABLE | ROCM_TYPES

# Integer tensor types: valid in a GGUF, but not weights that dequantize to float.
INTEGER_TYPES: frozenset[GGMLType] = frozenset({GGMLType.I8, GGMLType.I16, GGMLType.I32, GGMLType.I64})
FLOAT_TYPES: frozenset[GGMLType] = frozenset({GGMLType.F32, GGMLType.F16, GGMLType.BF16})  # dense, unquantized

# Types `dsparkjax.formats.quantize` can write.
WRITABLE_TYPES: frozenset[GGMLType] = frozenset(
    {GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.Q8_0, GGMLType.Q2_K, GGMLType.Q4_K, GGMLType.IQ2_XXS}
    | ROCM_TYPES
)


def ggml_type(t: int) -> GGMLType:
    """`t` as a GGMLType; UnsupportedTypeError for an id that neither ggml nor lucebox defines."""
    try:
        return GGMLType(int(t))
    except ValueError:
        raise UnsupportedTypeError(f"unknown ggml type id {int(t)}") from None


def type_name(t: int) -> str:
    """Upper-case type name as gguf-py spells it (e.g. "Q8_0", "Q4_0_ROCMFP4"); never raises."""
    try:
        return GGMLType(int(t)).name
    except ValueError:
        return f"<unknown ggml type {int(t)}>"


def is_rocm_type(t: int) -> bool:
    """True for the six lucebox ROCmFP4/ROCmFPX type ids (100-104, 107)."""
    return int(t) in _ROCM_SIZES


def _sizes(t: int) -> tuple[int, int]:
    gt = ggml_type(t)
    if gt in _ROCM_SIZES:
        return _ROCM_SIZES[gt]
    if gt in _SIZE_OVERRIDES:
        return _SIZE_OVERRIDES[gt]
    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(gt))]


def block_size(t: int) -> int:
    """Weights per block of type `t` (1 for plain float/int types)."""
    return _sizes(t)[0]


def type_size(t: int) -> int:
    """Bytes per block of type `t`."""
    return _sizes(t)[1]


def row_bytes(t: int, k: int) -> int:
    """Bytes of one row of `k` weights of type `t`; FormatError if `k` is not a whole number of blocks."""
    bs, ts = _sizes(t)
    if k <= 0 or k % bs:
        raise FormatError(f"{type_name(t)}: row length {k} is not a positive multiple of the block size {bs}")
    return k // bs * ts
