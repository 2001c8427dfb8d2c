"""Finding NaN and inf in a tensor's stored bytes without decoding it.

A NaN weight, or a NaN f16 scale in a quantized block, poisons every logit it reaches: generation then emits
token 0 forever. Float tensors are scanned value by value; block formats by their f16 scale fields (a block's
values are small integers times those scales, so they are finite exactly when the scales are). ROCm scale
bytes decode through a table of finite values; their invalid bytes are `formats.invalid_scale_blocks`' job.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from dsparkjax import formats
from dsparkjax.formats import GGMLType
from dsparkjax.formats.types import ggml_type as as_ggml_type

# Byte offsets of the f16 scale fields inside one block (ggml's block_q8_0, block_q2_K, block_q4_K,
# block_iq2_xxs layouts). A block's fields are consecutive and aligned to their total size (2 or 4 bytes), so one
# strided read of a uint16 or uint32 per block gathers them.
F16_SCALE_OFFSETS: dict[GGMLType, tuple[int, ...]] = {
    GGMLType.Q8_0: (0,),
    GGMLType.Q2_K: (80, 82),  # scales[16], qs[64], then d, dmin
    GGMLType.Q4_K: (0, 2),  # d, dmin, then scales[12], qs[128]
    GGMLType.IQ2_XXS: (0,),
}
# A float is NaN or inf exactly when its exponent bits are all ones: (unsigned view, exponent mask) per type.
_EXPONENT_BITS: dict[GGMLType, tuple[type, int]] = {
    GGMLType.F32: (np.uint32, 0x7F800000), GGMLType.F16: (np.uint16, 0x7C00), GGMLType.BF16: (np.uint16, 0x7F80)}
_F16_EXPONENT = 0x7C00
# Values or blocks tested at a time: the scratch stays in the CPU's cache (a few MB) and no tensor-sized
# temporary is made.
_CHUNK_UNITS = 1 << 20


@dataclasses.dataclass(frozen=True)
class NonFinite:
    """Where a tensor's bytes hold NaN or inf: how many values (or block scales) and the first one's index."""

    count: int
    first: int
    unit: str  # "value" or "block scale"


@dataclasses.dataclass(frozen=True)
class _Fields:
    """The floats of a tensor to test: `column` holds one entry per unit (a value, or a block's `per_unit`
    consecutive f16 scale fields read as one wider unsigned word, so a block is gathered in one strided read);
    `mask` keeps each float's exponent bits; read as `narrow`, a float is NaN/inf where it equals `bits`."""

    column: np.ndarray  # 1-D unsigned view of the tensor's bytes
    mask: int
    bits: int
    narrow: type
    per_unit: int
    unit: str  # "value" or "block scale"


def _fields(data: np.ndarray, t: GGMLType) -> _Fields:
    """`data`'s (flat uint8) floats to test: the values of a float type, the f16 scales of a block type."""
    if t in _EXPONENT_BITS:
        dtype, bits = _EXPONENT_BITS[t]
        return _Fields(data.view(dtype), bits, bits, dtype, 1, "value")
    offsets = F16_SCALE_OFFSETS[t]
    word = {1: np.uint16, 2: np.uint32}[len(offsets)]
    size = np.dtype(word).itemsize
    column = data.view(word).reshape(-1, formats.type_size(t) // size)[:, offsets[0] // size]
    mask = int.from_bytes(_F16_EXPONENT.to_bytes(2, "little") * len(offsets), "little")
    return _Fields(column, mask, _F16_EXPONENT, np.uint16, len(offsets), "block scale")


def find_nonfinite(raw: np.ndarray, ggml_type: int) -> NonFinite | None:
    """The NaN/inf values of a tensor's bytes (uint8 of any shape), or None when all are finite or the type
    holds none (integer and ROCm types).

    Each chunk is first tested for any all-ones exponent (one AND and one max, a few GB/s per core: the load
    path checks every tensor); only a chunk that has one is counted exactly."""
    t = as_ggml_type(ggml_type)
    if t not in _EXPONENT_BITS and t not in F16_SCALE_OFFSETS:
        return None
    data = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    fields = _fields(data, t)
    units = len(fields.column)
    scratch = np.empty(min(_CHUNK_UNITS, units), fields.column.dtype)
    count, first = 0, -1
    for start in range(0, units, _CHUNK_UNITS):
        exponents = scratch[: min(_CHUNK_UNITS, units - start)]
        np.bitwise_and(fields.column[start : start + _CHUNK_UNITS], fields.mask, out=exponents)
        floats = exponents.view(fields.narrow)
        if int(floats.max()) != fields.bits:  # no all-ones exponent in the chunk: the common case
            continue
        hits = np.flatnonzero((floats == fields.bits).reshape(-1, fields.per_unit).any(axis=1))
        if first < 0:
            first = start + int(hits[0])
        count += len(hits)
    return NonFinite(count, first, fields.unit) if count else None
