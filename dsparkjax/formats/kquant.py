"""Writers for the ggml k-quant super-block formats Q2_K, Q4_K and IQ2_XXS (quant_hc.md §4.2, §4.3).

gguf-py 0.19 can only decode these types. Q2_K and IQ2_XXS have simple writers for test GGUF files: they pick
scales from the data's range and round each weight to the nearest representable value, NOT ggml's
(imatrix-weighted, search-based) quantizers, so their bytes differ from ggml's; the result is a sensible
approximation that gguf-py and ggml decode to the same values. Q4_K follows ggml's `quantize_row_q4_K_ref`
(per 32-weight sub-block a weighted least-squares search for scale and min, `make_qkx2_quants`; the
sub-blocks' scales and mins then as 6-bit multiples of two fp16 super-block scales), every step in float32 in
the C code's order with no fused multiply-adds.

All work on float32[n, 256] super-blocks and return uint8[n, type_size]. The fp16 super-block scales limit
the range: values beyond about 1e6 (Q2_K, Q4_K) / 2e6 (IQ2_XXS) in magnitude overflow them.
"""

from __future__ import annotations

import gguf
import numpy as np

QK_K = 256
_MAX_SUB_CODE = 15  # 4-bit sub-block scale / min codes (Q2_K) and group scale codes (IQ2_XXS)


def _fp16(x: np.ndarray) -> np.ndarray:
    """float32 -> the float32 value of its fp16 rounding (what the decoder will read back)."""
    return x.astype(np.float16).astype(np.float32)


def _safe_div(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    return np.divide(num, den, out=np.zeros(np.broadcast(num, den).shape, np.float32), where=den > 0)


def quantize_q2_k(values: np.ndarray) -> np.ndarray:
    """float32[n, 256] -> Q2_K bytes uint8[n, 84]: `scales[16] | qs[64] | half d | half dmin`.

    Each 16-weight sub-block j decodes as `d*sc_j*q - dmin*m_j` with q in 0..3 and 4-bit sc_j, m_j. We set
    the offset `dmin*m_j` to cover the sub-block minimum (rounded up), the step `d*sc_j` to span the rest of
    its range in 3 steps, and round each weight to the nearest of the 4 levels.
    """
    x = np.asarray(values, np.float32)
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    offset = np.maximum(-sub.min(axis=2), 0)  # [n, 16], >= 0
    dmin = _fp16(offset.max(axis=1) / _MAX_SUB_CODE)  # [n]
    m = np.clip(np.ceil(_safe_div(offset, dmin[:, None])), 0, _MAX_SUB_CODE)
    shift = dmin[:, None] * m  # the decoder's offset per sub-block
    step = (sub.max(axis=2) + shift) / 3  # [n, 16]: step spanning [-shift, max]
    d = _fp16(step.max(axis=1) / _MAX_SUB_CODE)
    sc = np.clip(np.rint(_safe_div(step, d[:, None])), 0, _MAX_SUB_CODE)
    real_step = d[:, None] * sc
    q = np.clip(np.rint(_safe_div(sub + shift[:, :, None], real_step[:, :, None])), 0, 3).astype(np.uint8)
    # Element 128h + 32g + l sits in qs[32h + l] at bits 2g (g = 0..3).
    q = q.reshape(n, 2, 4, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)).reshape(n, 64)
    scales = (sc.astype(np.uint8) | (m.astype(np.uint8) << 4)).reshape(n, 16)
    dd = np.stack([d, dmin], axis=1).astype(np.float16).view(np.uint8)  # [n, 4]
    return np.concatenate([scales, qs, dd], axis=1)


def _nearest_int(v: np.ndarray) -> np.ndarray:
    """ggml's nearest_int: round half to even (float32 values well inside ±2^22), as int64."""
    return np.rint(v).astype(np.int64)


def _sequential_sum(terms: np.ndarray) -> np.ndarray:
    """Σ over the last axis in float32, first term to last, as a C loop `acc += term` adds them."""
    acc = terms[..., 0].copy()
    for i in range(1, terms.shape[-1]):
        acc += terms[..., i]
    return acc


def _make_qkx2_quants(x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ggml's `make_qkx2_quants` (squared error) on each row of x, w float32 `[m, n]`.

    Fits x ≈ scale·L - the_min with integer L in 0..nmax, minimising Σ w·(scale·L + min - x)²: the range fit,
    then nstep + 1 trial grids (nmax + rmin + rdelta·is steps over the current range), each refitted by weighted
    least squares and kept where it lowers the error. As in the C code the current min moves with each kept fit
    and the later grids start from it. Returns (scale `[m]`, the_min `[m]` >= 0, L uint8 `[m, n]`).
    """
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):  # masked lanes divide by zero
        return _qkx2_search(x, w, nmax, np.float32(rmin), np.float32(rdelta), nstep)


def _qkx2_search(x: np.ndarray, w: np.ndarray, nmax: int, rmin: np.float32, rdelta: np.float32, nstep: int
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`_make_qkx2_quants`' body, with numpy's division warnings off."""
    f32 = np.float32
    mn = np.minimum(x.min(-1), f32(0))
    mx = x.max(-1)
    sum_w = _sequential_sum(w)
    sum_x = _sequential_sum(w * x)
    flat = mx == mn
    span = np.where(flat, f32(1), mx - mn)
    iscale = f32(nmax) / span
    scale = np.where(flat, f32(0), f32(1) / iscale)
    levels = np.clip(_nearest_int(iscale[:, None] * (x - mn[:, None])), 0, nmax).astype(f32)
    levels[flat] = 0
    diff = scale[:, None] * levels + mn[:, None] - x
    best = _sequential_sum(w * (diff * diff))
    for step in range(nstep + 1):
        iscale = (rmin + rdelta * f32(step) + f32(nmax)) / np.where(flat, f32(1), mx - mn)
        trial = np.clip(_nearest_int(iscale[:, None] * (x - mn[:, None])), 0, nmax).astype(f32)
        wl = w * trial
        sum_l, sum_l2, sum_xl = _sequential_sum(wl), _sequential_sum(wl * trial), _sequential_sum(wl * x)
        det = sum_w * sum_l2 - sum_l * sum_l
        fit = (det > 0) & ~flat
        safe = np.where(fit, det, f32(1))
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / safe
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / safe
        clamp = this_min > 0
        this_min = np.where(clamp, f32(0), this_min)
        this_scale = np.where(clamp, sum_xl / np.where(fit, sum_l2, f32(1)), this_scale)
        diff = this_scale[:, None] * trial + this_min[:, None] - x
        error = _sequential_sum(w * (diff * diff))
        better = fit & (error < best)
        levels[better] = trial[better]
        best = np.where(better, error, best)
        scale, mn = np.where(better, this_scale, scale), np.where(better, this_min, mn)
    return scale, -mn, levels.astype(np.uint8)


def quantize_q4_k(values: np.ndarray) -> np.ndarray:
    """float32[n, 256] -> Q4_K bytes uint8[n, 144]: `half d | half dmin | scales[12] | qs[128]`.

    Sub-block j (weights 32j..32j+31) decodes as `d*sc_j*q - dmin*m_j` with q in 0..15 and 6-bit sc_j, m_j
    (packing: `FmtQ4_K` in custom_calls/quant_formats.h). As ggml's `quantize_row_q4_K_ref`: each sub-block's
    scale and min from `make_qkx2_quants` (15 levels, weights rms + |x|, 21 grids from 14 to 16 steps), d and
    dmin the largest of them over 63, each sub-block's sc_j, m_j its own rounded to a multiple of those, then
    every weight rounded to the nearest level of the decoded scale and min.
    """
    f32 = np.float32
    x = np.asarray(values, f32)
    n = x.shape[0]
    sub = x.reshape(n * 8, 32)
    av_x = np.sqrt(_sequential_sum(sub * sub) / f32(32))
    scales, mins, levels = _make_qkx2_quants(sub, av_x[:, None] + np.abs(sub), 15, -1.0, 0.1, 20)
    scales, mins, levels = scales.reshape(n, 8), mins.reshape(n, 8), levels.reshape(n, 8, 32)
    max_scale = np.maximum(scales.max(1), f32(0))
    max_min = np.maximum(mins.max(1), f32(0))
    with np.errstate(divide="ignore"):
        inv_scale = np.where(max_scale > 0, f32(63) / max_scale, f32(0))
        inv_min = np.where(max_min > 0, f32(63) / max_min, f32(0))
    # the C code stores nearest_int in a uint8 before clamping to 63: a negative value wraps, then clamps to 63
    ls = np.minimum(_nearest_int(inv_scale[:, None] * scales) & 0xFF, 63).astype(np.uint8)
    lm = np.minimum(_nearest_int(inv_min[:, None] * mins) & 0xFF, 63).astype(np.uint8)
    d, dmin = (max_scale / f32(63)).astype(np.float16), (max_min / f32(63)).astype(np.float16)
    step = d.astype(f32)[:, None] * ls.astype(f32)  # the decoder's scale and min per sub-block
    shift = dmin.astype(f32)[:, None] * lm.astype(f32)
    with np.errstate(divide="ignore", invalid="ignore"):
        requant = np.clip(np.rint((x.reshape(n, 8, 32) + shift[..., None]) / step[..., None]), 0, 15)
    levels = np.where((step != 0)[..., None], requant, levels).astype(np.uint8)  # a zero scale keeps its levels
    packed = np.empty((n, 12), np.uint8)
    packed[:, 0:4] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    packed[:, 4:8] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (ls[:, 4:] & 15) | ((lm[:, 4:] & 15) << 4)
    qs = (levels[:, 0::2] | (levels[:, 1::2] << 4)).reshape(n, 128)  # sub-blocks 2i (low) and 2i+1 (high)
    dd = np.stack([d, dmin], axis=1).view(np.uint8)
    return np.concatenate([dd, packed, qs], axis=1)


def _iq2xxs_tables() -> tuple[np.ndarray, np.ndarray]:
    gguf.quants.IQ2_XXS.init_grid()
    grid = np.asarray(gguf.quants.IQ2_XXS.grid).reshape(256, 8).astype(np.uint8)
    ksigns = np.frombuffer(gguf.quants.IQ2_XXS.ksigns, dtype=np.uint8).copy()
    grid.flags.writeable = ksigns.flags.writeable = False
    return grid, ksigns


# IQ2XXS_GRID: uint8[256, 8], magnitudes in {8, 25, 43} (ggml `iq2xxs_grid`, taken from gguf-py).
# IQ2XXS_KSIGNS: uint8[128], sign byte of a 7-bit index: index | parity(index) << 7 (ggml `ksigns_iq2xs`).
IQ2XXS_GRID, IQ2XXS_KSIGNS = _iq2xxs_tables()


def _nearest_grid(mag: np.ndarray) -> np.ndarray:
    """float32[..., 8] target magnitudes (grid units) -> int64[...] index of the nearest grid row."""
    grid = IQ2XXS_GRID.astype(np.float32)
    dist = (mag**2).sum(-1, keepdims=True) - 2 * mag @ grid.T + (grid**2).sum(-1)
    return dist.argmin(axis=-1)


def quantize_iq2_xxs(values: np.ndarray) -> np.ndarray:
    """float32[n, 256] -> IQ2_XXS bytes uint8[n, 66]: `half d | 8 x (uint32 a0, uint32 a1)`.

    Per 32-weight group: a0 = 4 grid indices (one per 8 weights), a1 = 4 x 7-bit sign indices (bits 7l..7l+6)
    and a 4-bit scale s (bits 28..31); a weight decodes as `d*(0.5+s)/4 * grid * sign`. The sign byte must
    have even parity (ksigns), so in an 8-weight run with an odd number of negatives the smallest |x| takes
    the wrong sign. The magnitudes go to the nearest grid row at a per-group least-squares scale.
    """
    x = np.asarray(values, np.float32)
    n = x.shape[0]
    run = x.reshape(n, 8, 4, 8)  # [block, group, run, weight]
    neg = run < 0
    odd = (neg.sum(-1) % 2).astype(bool)
    smallest = np.abs(run).argmin(-1)
    flip = odd[..., None] & (np.arange(8) == smallest[..., None])
    neg ^= flip
    sign = np.where(neg, np.float32(-1), np.float32(1))
    target = run * sign  # what the grid magnitudes should approximate (negative for a flipped weight)

    def fit(group_scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Grid rows nearest to target/scale, and the least-squares group scale for those rows."""
        idx = _nearest_grid(_safe_div(target, group_scale[..., None, None]))
        g = IQ2XXS_GRID[idx].astype(np.float32)  # [n, 8, 4, 8]
        return idx, _safe_div((target * g).sum((-1, -2)), (g * g).sum((-1, -2)))

    _, group_scale = fit(np.abs(x).reshape(n, 8, 32).max(-1) / 43)
    # db = d*(0.5+s)/4 with s in 0..15 reaches 3.875 d at most.
    d = _fp16(np.maximum(group_scale, 0).max(axis=1) / 3.875)
    s = np.clip(np.rint(_safe_div(4 * group_scale, d[:, None]) - 0.5), 0, _MAX_SUB_CODE)
    idx, _ = fit(d[:, None] * (0.5 + s) / 4)  # re-pick grid rows at the scale the decoder will use

    sign_idx = (neg.astype(np.uint32) << np.arange(8, dtype=np.uint32)).sum(-1, dtype=np.uint32) & 0x7F
    a1 = (sign_idx << (7 * np.arange(4, dtype=np.uint32))).sum(-1, dtype=np.uint32) | (s.astype(np.uint32) << 28)
    a0 = idx.astype(np.uint8)  # [n, 8, 4]: the 4 index bytes of each group, in order
    groups = np.concatenate([a0, a1.astype("<u4")[..., None].view(np.uint8)], axis=-1).reshape(n, 64)
    return np.concatenate([d.astype(np.float16).view(np.uint8).reshape(n, 2), groups], axis=1)
