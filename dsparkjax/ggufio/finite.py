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
# block_iq2_xxs layouts).
F16_SCALE_OFFSETS: dict[GGMLType, tuple[int, ...]] = {
    GGMLType.Q8_0: (0,),
    GGMLType.Q2_K: (80, 82),  # scales[16], qs[64], then d, dmin
    GGMLType.Q4_K: (0, 2),  # d, dmin, then scales[12], qs[128]
    GGMLType.IQ2_XXS: (0,),
}
_FLOAT_VIEWS = {GGMLType.F32: np.float32, GGMLType.F16: np.float16}
_CHUNK_BYTES = 64 << 20  # scanned at a time, so a large tensor needs no tensor-sized temporary


@dataclasses.dataclass(frozen=True)
class NonFinite:
    """Where a tensor's bytes hold NaN or inf: how many values (or block scales) and the first one's index."""

    count: int
    first: int
    unit: str  # "value" or "block scale"


def _bf16_nonfinite(halves: np.ndarray) -> np.ndarray:
    return (halves & 0x7F80) == 0x7F80  # exponent all ones: inf or NaN


def _nonfinite_mask(chunk: np.ndarray, t: GGMLType) -> tuple[np.ndarray, str]:
    """Flat bytes of whole values or blocks -> a mask per value (float types) or per block."""
    if t in _FLOAT_VIEWS:
        return ~np.isfinite(chunk.view(_FLOAT_VIEWS[t])), "value"
    if t == GGMLType.BF16:
        return _bf16_nonfinite(chunk.view(np.uint16)), "value"
    blocks = chunk.reshape(-1, formats.type_size(t))
    mask = np.zeros(len(blocks), bool)
    for offset in F16_SCALE_OFFSETS[t]:
        mask |= ~np.isfinite(np.ascontiguousarray(blocks[:, offset : offset + 2]).view(np.float16)[:, 0])
    return mask, "block scale"


def find_nonfinite(raw: np.ndarray, ggml_type: int) -> NonFinite | None:
    """The NaN/inf values of a tensor's bytes (uint8 of any shape), or None when all are finite or the type
    holds none (integer and ROCm types)."""
    t = as_ggml_type(ggml_type)
    if t not in _FLOAT_VIEWS and t != GGMLType.BF16 and t not in F16_SCALE_OFFSETS:
        return None
    data = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    unit_bytes = formats.type_size(t)
    step = max(_CHUNK_BYTES // unit_bytes, 1) * unit_bytes
    count, first, unit = 0, -1, "value"
    for start in range(0, data.size, step):
        mask, unit = _nonfinite_mask(data[start : start + step], t)
        hits = np.flatnonzero(mask)
        if len(hits) and first < 0:
            first = start // unit_bytes + int(hits[0])  # a float type's "block" is one value
        count += len(hits)
    return NonFinite(count, first, unit) if count else None
