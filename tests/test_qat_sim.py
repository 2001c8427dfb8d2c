"""The QAT simulations (FP8 KV, FP4 indexer; on by default) against an independent numpy model of DeepSeek's
rounding (`ds4_arch.md` §6.2; the official `act_quant` / `fp4_act_quant` kernels with `inplace=True`).

The model computes the power-of-two scale from the exponent bits (`2^ceil(log2(amax/qmax))` exactly, as the
official `fast_round_scale`), rounds to the e4m3 / e2m1 grid with numpy's round-half-even on the grid index
(ties to the even code), and rotates with a float64 fast Walsh-Hadamard transform.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from dsparkjax.model.block import kv_sim
from dsparkjax.model.layers import fp4_block_round, fp4_indexer_sim, fp8_kv_sim
from dsparkjax.model.state import init_state
from model_helpers import prefill, tiny_target_model

FP8_MAX, FP8_FLOOR, FP8_BLOCK = 448.0, 1e-4, 64
FP4_MAX, FP4_FLOOR, FP4_BLOCK = 6.0, 6.0 * 2.0**-126, 32


def ceil_log2(v: np.ndarray) -> np.ndarray:
    """Exact ceil(log2(v)) of positive float32 v, from frexp (v = m·2^e, m in [0.5, 1))."""
    m, e = np.frexp(v.astype(np.float32))
    return e - (m == 0.5)


def round_to_grid(v: np.ndarray, mantissa_bits: int, min_exponent: int) -> np.ndarray:
    """Round float32 v to the nearest value of a float grid (ties to even mantissa), no clipping.

    A binade [2^e, 2^(e+1)) holds steps of 2^(e - mantissa_bits); below 2^min_exponent the step stays
    2^(min_exponent - mantissa_bits) (subnormals).
    """
    a = np.abs(v).astype(np.float64)
    _, e = np.frexp(a)
    step = np.ldexp(1.0, np.maximum(e - 1, min_exponent) - mantissa_bits)
    return (np.sign(v) * np.round(a / step) * step).astype(np.float32)


def deepseek_block_round(x: np.ndarray, block: int, qmax: float, floor: float, mantissa_bits: int,
                         min_exponent: int) -> np.ndarray:
    """x [..., n] -> the official inplace block quant-dequant: amax floor, pow2 scale, clip, grid, rescale."""
    b = x.astype(np.float32).reshape(*x.shape[:-1], -1, block)
    amax = np.maximum(np.abs(b).max(-1, keepdims=True), np.float32(floor))
    scale = np.ldexp(np.float32(1), ceil_log2(amax / np.float32(qmax))).astype(np.float32)
    q = round_to_grid(np.clip(b / scale, -qmax, qmax), mantissa_bits, min_exponent)
    return (q * scale).astype(np.float32).reshape(x.shape)


def deepseek_fp8(x: np.ndarray) -> np.ndarray:
    return deepseek_block_round(x, FP8_BLOCK, FP8_MAX, FP8_FLOOR, mantissa_bits=3, min_exponent=-6)  # e4m3fn


def deepseek_fp4(x: np.ndarray) -> np.ndarray:
    return deepseek_block_round(x, FP4_BLOCK, FP4_MAX, FP4_FLOOR, mantissa_bits=1, min_exponent=0)  # e2m1


def walsh_hadamard(x: np.ndarray) -> np.ndarray:
    """Orthonormal Sylvester-order Hadamard transform of the last axis in float64, by butterflies."""
    a = x.astype(np.float64)
    n, h = a.shape[-1], 1
    while h < n:
        a = a.reshape(*a.shape[:-1], n // (2 * h), 2, h)
        a = np.stack([a[..., 0, :] + a[..., 1, :], a[..., 0, :] - a[..., 1, :]], axis=-2).reshape(*x.shape[:-1], n)
        h *= 2
    return (a / np.sqrt(n)).astype(np.float32)


def edge_blocks(rng: np.random.Generator, qmax: float, block: int, mantissa_bits: int, n: int = 256) -> np.ndarray:
    """float32 [5n, block]: wide random magnitudes; max|x| a few ulps around qmax·2^k (scale boundary); exact
    grid midpoints (rounding ties); blocks below the amax floor; zeros with -0."""
    wide = rng.standard_normal((n, block)) * 10.0 ** rng.uniform(-30, 30, (n, 1))
    k = rng.integers(-60, 60, n)
    power = (np.float32(qmax) * np.ldexp(1.0, k)).astype(np.float32)
    edge_max = power.view(np.int32) + rng.integers(-3, 4, n, dtype=np.int32)  # a few ulps either side
    boundary = rng.uniform(-1, 1, (n, block)) * edge_max.view(np.float32)[:, None].astype(np.float64)
    boundary[:, 0] = edge_max.view(np.float32)
    scale = np.ldexp(1.0, rng.integers(-40, 40, (n, 1)))
    index = rng.integers(-(2 ** (mantissa_bits + 3)), 2 ** (mantissa_bits + 3), (n, block)) + 0.5
    ties = index * 2.0 ** -mantissa_bits * scale  # half-way between grid values in some binade
    ties[:, 0] = qmax * scale[:, 0]  # pins the block scale so the ties stay ties after scaling
    tiny = rng.standard_normal((n, block)) * 10.0 ** rng.uniform(-45, -5, (n, 1))
    zeros = np.where(rng.random((n, block)) < 0.5, 0.0, -0.0)
    return np.concatenate([wide, boundary, ties, tiny, zeros]).astype(np.float32)


def test_fp8_kv_sim_matches_deepseek_rounding():
    x = edge_blocks(np.random.default_rng(1), FP8_MAX, FP8_BLOCK, mantissa_bits=3).reshape(-1, 4 * FP8_BLOCK)
    np.testing.assert_array_equal(np.asarray(fp8_kv_sim(jnp.asarray(x))), deepseek_fp8(x))


def flush_subnormals(x: np.ndarray) -> np.ndarray:
    return np.where(np.abs(x) < np.finfo(np.float32).tiny, np.float32(0), x)


def test_fp4_block_round_matches_deepseek_rounding():
    """Exact, up to fp32 subnormals, which XLA (on CPU and GPU) reads and writes as 0: the amax floor 6·2^-126
    gives blocks of tiny values the scale 2^-126, whose half step 2^-127 is subnormal, and subnormal inputs
    would otherwise round up to 2^-126."""
    x = edge_blocks(np.random.default_rng(2), FP4_MAX, FP4_BLOCK, mantissa_bits=1).reshape(-1, 4 * FP4_BLOCK)
    got = np.asarray(fp4_block_round(jnp.asarray(x)))
    np.testing.assert_array_equal(flush_subnormals(got), flush_subnormals(deepseek_fp4(flush_subnormals(x))))


def test_fp4_indexer_sim_is_hadamard_then_fp4():
    x = (np.random.default_rng(3).standard_normal((64, 4, 128)) * 3).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(fp4_indexer_sim(jnp.asarray(x))), deepseek_fp4(walsh_hadamard(x)))


@pytest.mark.parametrize("simulate_qat", [True, False])
def test_kv_sim_rounds_only_the_nope_dims(simulate_qat):
    kv = (np.random.default_rng(4).standard_normal((3, 5, 192)) * 7).astype(np.float32)
    out = np.asarray(kv_sim(jnp.asarray(kv), 128, simulate_qat))
    expected_nope = deepseek_fp8(kv[..., :128]) if simulate_qat else kv[..., :128]
    np.testing.assert_array_equal(out[..., :128], expected_nope)
    np.testing.assert_array_equal(out[..., 128:], kv[..., 128:])  # the 64 rope dims are never rounded


def test_default_model_stores_rounded_kv_and_indexer_keys():
    """With the default options the cached window kv and compressed entries lie on DeepSeek's FP8 grid (nope
    dims) and the indexer keys on its FP4 grid; with simulate_qat=False they do not."""
    tokens = np.random.default_rng(5).integers(0, 500, (1, 24)).astype(np.int32)
    for simulate_qat in (True, False):
        target = tiny_target_model(simulate_qat=simulate_qat)
        cfg = target.config
        state = init_state(cfg, 1, 64, 16, target.dtype)
        state, _ = prefill(target, state, tokens, np.array([24]), width=16)
        nope = cfg.nope_dim
        caches = [("window", np.asarray(c.window)[..., :nope], deepseek_fp8) for c in state.layers]
        caches += [("comp_kv", np.asarray(c.comp_kv)[..., :nope], deepseek_fp8) for c in state.layers
                   if c.comp_kv is not None]
        caches += [("index_keys", np.asarray(c.index_keys), deepseek_fp4) for c in state.layers
                   if c.index_keys is not None]
        assert {name for name, _, _ in caches} == {"window", "comp_kv", "index_keys"}
        on_grid = [np.array_equal(rounded(values), values) for _, values, rounded in caches]
        assert all(on_grid) if simulate_qat else not any(on_grid), [name for name, _, _ in caches]
