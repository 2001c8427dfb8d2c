"""lucebox ROCmFP4 / ROCmFPX block codecs in numpy, bit for bit as quant_hc.md §1.1-§1.3.

Every type packs 32 weights per block as `qs` (the codes) followed by one or two UE4M3-half scale bytes
(one per 32 weights, or one per 16-weight half). A weight decodes as `level(code) * scale(e)`, one fp32
multiply. The quantizer is the unweighted `_ref` path of LB `rocmfp4.c` / `rocmfpx.c` (no imatrix):

* FP4, FP2, FP3, FP6 try every scale byte e in 1..126 per scale group and keep the one with the least
  fp32 squared error, accumulated element by element; ties go to the lower e. When the error overflows to
  inf at every e (|x| beyond ~1e19), FP4 keeps e = 0 (its search starts from FLT_MAX and e = 0) and the
  FPX types keep e = 1 (their search starts from inf, and inf ties go to the lower e);
* FP8 takes the scale nearest to max|x| / 127 (fp32; ties to the lower e), and e = 0 when that quotient
  underflows to 0;
* FP2's code is the level nearest to x/scale by fp32 |v - level|, ties to the lower code, so a |v| so large
  that every distance rounds to the same float gets code 0 (level -1);
* a group whose finite max|x| is 0 gets e = 0 and zero codes; non-finite inputs get the zero code and are
  left out of the max and the error.

tests/test_formats.py checks quantize byte for byte against golden vectors made by LB's C reference
(tests/data/rocm_golden/README.md: random, tie, zero, subnormal, saturation and NaN/Inf blocks).

Arrays of blocks are `uint8[n_blocks, type_size]`; values are `float32[n_blocks, 32]`. Work runs in
chunks of blocks so a tensor of millions of blocks stays within a bounded amount of memory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import numpy as np

from dsparkjax.formats.types import GGMLType

BLOCK = 32
MAX_VALID_SCALE_BYTE = 0x7E
_CHUNK_BLOCKS = 1 << 16  # blocks per chunk when packing/unpacking
_SEARCH_GROUPS = 4096  # scale groups per chunk in the 126-scale search: arrays of 4096 x 126 floats


def _scale_table() -> np.ndarray:
    """UE4M3-half: E = e>>3 & 15, M = e & 7; M*2^-10 if E == 0 else (8+M)*2^(E-11); 0 for e > 0x7E."""
    e = np.arange(256)
    exp, man = (e >> 3) & 15, e & 7
    table = np.where(exp == 0, man * 2.0**-10, (8 + man) * 2.0 ** (exp - 11))
    table[MAX_VALID_SCALE_BYTE + 1 :] = 0.0
    return table.astype(np.float32)


# float32[256]: scale of each scale byte; exactly half the OCP E4M3FN value, zero for invalid bytes.
ROCM_SCALE_TABLE: np.ndarray = _scale_table()
# float32[256]: 1/scale in fp32 as the C quantizer computes it; 0 where the scale is 0.
_INV_SCALE = np.divide(np.float32(1), ROCM_SCALE_TABLE, out=np.zeros(256, np.float32), where=ROCM_SCALE_TABLE > 0)

# Integer level of each code (int8[2**bits]); multiply by the scale to decode.
FP4_LEVELS: np.ndarray = np.array([0, 1, 2, 3, 4, 6, 8, 10, 0, -1, -2, -3, -4, -6, -8, -10], np.int8)  # Codebook10
FP3_LEVELS: np.ndarray = np.array([0, 1, 2, 4, 0, -1, -2, -4], np.int8)  # bit 2 = sign
FP2_LEVELS: np.ndarray = np.array([-1, 0, 1, 2], np.int8)  # asymmetric, no sign bit
FP6_LEVELS: np.ndarray = np.concatenate([np.arange(32), -np.arange(32)]).astype(np.int8)  # bit 5 = sign
FP8_LEVELS: np.ndarray = np.arange(256, dtype=np.uint8).view(np.int8)  # the byte as int8

for _table in (ROCM_SCALE_TABLE, _INV_SCALE, FP4_LEVELS, FP3_LEVELS, FP2_LEVELS, FP6_LEVELS, FP8_LEVELS):
    _table.flags.writeable = False  # shared by every decoder and kernel: never modified in place

_FP4_THRESHOLDS = np.array([0.5, 1.5, 2.5, 3.5, 5.0, 7.0, 9.0], np.float32)
_FP3_THRESHOLDS = np.array([0.5, 1.5, 3.0], np.float32)


def _round_half_away(a: np.ndarray) -> np.ndarray:
    """lroundf of a non-negative fp32 array; the +0.5 is done in float64 so values just below .5 stay down."""
    return np.floor(a.astype(np.float64) + 0.5).astype(np.int64)


# Code rules of quant_hc.md §1.3, as functions of the scaled value v = x * inv (fp32): of a = |v| for the
# sign-magnitude types (the codec adds the sign bit), of v itself for FP2 and FP8. int64 codes out.
def _fp4_magnitude(a: np.ndarray) -> np.ndarray:
    # Thresholds are inclusive (a <= 0.5 -> 0, ...): searchsorted 'left' counts thresholds strictly below a.
    return np.searchsorted(_FP4_THRESHOLDS, a, side="left")


def _fp3_magnitude(a: np.ndarray) -> np.ndarray:
    return np.searchsorted(_FP3_THRESHOLDS, a, side="left")


def _fp6_magnitude(a: np.ndarray) -> np.ndarray:
    return _round_half_away(np.minimum(a, np.float32(31)))


def _fp2_code(v: np.ndarray) -> np.ndarray:
    # First level with the least fp32 |v - level|: -0.5 -> code 0 (-1), +0.5 -> code 1 (0), and a |v| so large
    # that all four distances round to the same float -> code 0.
    dist = np.abs(v[..., None] - FP2_LEVELS.astype(np.float32))
    return dist.argmin(axis=-1)


def _fp8_code(v: np.ndarray) -> np.ndarray:
    v = np.clip(v, np.float32(-127), np.float32(127))
    return (np.sign(v).astype(np.int64) * _round_half_away(np.abs(v))) & 0xFF


@dataclasses.dataclass(frozen=True)
class RocmCodec:
    """Geometry and code rules of one ROCm type.

    bits: code width; 4 = nibbles (low = element j, high = j+16), 8 = int8 bytes, 2/3/6 = LSB-first
    contiguous bitstream. n_scales: scale bytes per block (2 = one per 16-weight half). levels: int8 level
    of each code. scaled_code: code of |x*inv| when sign_bit != 0 (sign-magnitude codes: the sign bit is
    set for x < 0 unless the magnitude code is 0), else of x*inv. search: True for the exhaustive MSE scale
    search, False for FP8's nearest scale. zero_scale_on_overflow: True where the search keeps e = 0 when no
    scale has an error below FLT_MAX (rocmfp4.c); the rocmfpx.c search then keeps e = 1.
    """

    ggml_type: GGMLType
    bits: int
    n_scales: int
    levels: np.ndarray
    scaled_code: Callable[[np.ndarray], np.ndarray]
    sign_bit: int
    search: bool = True
    zero_scale_on_overflow: bool = False

    @property
    def qs_bytes(self) -> int:
        return BLOCK * self.bits // 8

    @property
    def type_size(self) -> int:
        return self.qs_bytes + self.n_scales

    def code(self, x: np.ndarray, inv: np.ndarray) -> np.ndarray:
        """int64 codes of finite fp32 x at fp32 inverse scale inv (broadcasting); inv = 0 gives the zero code."""
        v = x * inv
        if not self.sign_bit:
            return self.scaled_code(v)
        k = self.scaled_code(np.abs(v))
        return np.where((x < 0) & (k > 0), k | self.sign_bit, k)


CODECS: dict[GGMLType, RocmCodec] = {
    c.ggml_type: c
    for c in (
        RocmCodec(GGMLType.Q4_0_ROCMFP4, 4, 2, FP4_LEVELS, _fp4_magnitude, 8, zero_scale_on_overflow=True),
        RocmCodec(GGMLType.Q4_0_ROCMFP4_FAST, 4, 1, FP4_LEVELS, _fp4_magnitude, 8, zero_scale_on_overflow=True),
        RocmCodec(GGMLType.Q6_0_ROCMFPX, 6, 2, FP6_LEVELS, _fp6_magnitude, sign_bit=32),
        RocmCodec(GGMLType.Q8_0_ROCMFPX, 8, 1, FP8_LEVELS, _fp8_code, sign_bit=0, search=False),
        RocmCodec(GGMLType.Q3_0_ROCMFPX, 3, 2, FP3_LEVELS, _fp3_magnitude, sign_bit=4),
        RocmCodec(GGMLType.Q2_0_ROCMFP2, 2, 2, FP2_LEVELS, _fp2_code, sign_bit=0),
    )
}


def _chunks(n: int, size: int) -> Iterator[slice]:
    return (slice(i, min(i + size, n)) for i in range(0, n, size))


def _stream_group(bits: int) -> tuple[int, int]:
    """(codes, bytes) of the smallest whole-byte group of a `bits`-wide stream: 2 -> (4, 1), 3 -> (8, 3), 6 -> (4, 3)."""
    n_bytes = np.lcm(bits, 8) // 8
    return 8 * n_bytes // bits, n_bytes


def _pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """int codes [n, 32] -> qs bytes uint8[n, 32*bits/8] in the layout of quant_hc.md §1.2."""
    n = codes.shape[0]
    if bits == 8:
        return codes.astype(np.uint8)
    if bits == 4:
        return (codes[:, :16] | (codes[:, 16:] << 4)).astype(np.uint8)
    per_group, n_bytes = _stream_group(bits)
    shifts = (bits * np.arange(per_group)).astype(np.uint32)
    words = (codes.reshape(n, -1, per_group).astype(np.uint32) << shifts).sum(-1, dtype=np.uint32)
    return ((words[..., None] >> (8 * np.arange(n_bytes, dtype=np.uint32))) & 0xFF).astype(np.uint8).reshape(n, -1)


def _unpack_codes(qs: np.ndarray, bits: int) -> np.ndarray:
    """qs bytes uint8[n, 32*bits/8] -> int64 codes [n, 32]; inverse of `_pack_codes`."""
    n = qs.shape[0]
    if bits == 8:
        return qs.astype(np.int64)
    if bits == 4:
        return np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.int64)
    per_group, n_bytes = _stream_group(bits)
    words = (qs.reshape(n, -1, n_bytes).astype(np.uint32) << (8 * np.arange(n_bytes, dtype=np.uint32))).sum(
        -1, dtype=np.uint32
    )
    codes = (words[..., None] >> (bits * np.arange(per_group, dtype=np.uint32))) & ((1 << bits) - 1)
    return codes.reshape(n, BLOCK).astype(np.int64)


def dequantize_blocks(blocks: np.ndarray, codec: RocmCodec) -> np.ndarray:
    """uint8[n, type_size] -> float32[n, 32]. Scale bytes > 0x7E decode as scale 0 (LB CPU reference)."""
    n = blocks.shape[0]
    out = np.empty((n, BLOCK), np.float32)
    levels = codec.levels.astype(np.float32)
    for s in _chunks(n, _CHUNK_BLOCKS):
        b = blocks[s]
        level = levels[_unpack_codes(b[:, : codec.qs_bytes], codec.bits)]
        scale = ROCM_SCALE_TABLE[b[:, codec.qs_bytes :]]  # [m, n_scales]
        out[s] = (level.reshape(len(level), codec.n_scales, -1) * scale[:, :, None]).reshape(-1, BLOCK)
    return out


def _search_scale_bytes(groups: np.ndarray, codec: RocmCodec) -> np.ndarray:
    """Scale byte of each scale group: finite float32[g, G] (non-finite already zeroed) -> uint8[g]."""
    max_abs = np.abs(groups).max(axis=1)
    candidates = ROCM_SCALE_TABLE[1 : MAX_VALID_SCALE_BYTE + 1]  # e = 1..126, increasing
    if not codec.search:
        target = max_abs / np.float32(127)
        best = np.abs(candidates[None, :] - target[:, None]).argmin(axis=1)  # first minimum = lower e
        return np.where(target > 0, best + 1, 0).astype(np.uint8)  # a subnormal max/127 can underflow to 0
    inv = _INV_SCALE[None, 1 : MAX_VALID_SCALE_BYTE + 1]
    levels = codec.levels.astype(np.float32)
    # Sign-magnitude codebooks are symmetric: (x - level*s)^2 == (|x| - |level|*s)^2 exactly in fp32,
    # so the search runs on |x| and magnitude codes only.
    xs = np.abs(groups) if codec.sign_bit else groups
    err = np.zeros((groups.shape[0], candidates.size), np.float32)
    with np.errstate(over="ignore"):  # huge |x| overflow to inf in fp32 exactly as in C
        for i in range(groups.shape[1]):  # sequential fp32 accumulation, element by element as in C
            x = xs[:, i : i + 1]
            d = x - levels[codec.scaled_code(x * inv)] * candidates[None, :]
            err += d * d
    best = err.argmin(axis=1)  # first minimum = lower e; all inf -> e = 1
    e = best + 1
    if codec.zero_scale_on_overflow:
        e = np.where(err[np.arange(err.shape[0]), best] < np.finfo(np.float32).max, e, 0)
    return np.where(max_abs > 0, e, 0).astype(np.uint8)


def quantize_blocks(values: np.ndarray, codec: RocmCodec) -> np.ndarray:
    """float32[n, 32] -> uint8[n, type_size] with the unweighted `_ref` quantizer of LB (quant_hc.md §1.3)."""
    n = values.shape[0]
    x = np.asarray(values, np.float32)
    x = np.where(np.isfinite(x), x, np.float32(0))  # non-finite: zero code, excluded from max and error
    group = BLOCK // codec.n_scales
    e = np.empty(n * codec.n_scales, np.uint8)
    flat_groups = x.reshape(-1, group)
    for s in _chunks(flat_groups.shape[0], _SEARCH_GROUPS):
        e[s] = _search_scale_bytes(flat_groups[s], codec)
    e = e.reshape(n, codec.n_scales)
    out = np.empty((n, codec.type_size), np.uint8)
    for s in _chunks(n, _CHUNK_BLOCKS):
        inv = np.repeat(_INV_SCALE[e[s]], group, axis=1)  # [m, 32]
        with np.errstate(over="ignore"):  # x * inv may overflow to inf; the codes of inf match C
            codes = codec.code(x[s], inv)
        out[s, : codec.qs_bytes] = _pack_codes(codes, codec.bits)
        out[s, codec.qs_bytes :] = e[s]
    return out


def invalid_scale_blocks(blocks: np.ndarray, codec: RocmCodec) -> np.ndarray:
    """Indices (int64) of the blocks in uint8[n, type_size] that hold a scale byte > 0x7E."""
    return np.flatnonzero((blocks[:, codec.qs_bytes :] > MAX_VALID_SCALE_BYTE).any(axis=1))
