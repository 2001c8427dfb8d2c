"""The numeric building blocks of DS4 blocks, shared by the target and the drafter stages.

Readable math over arrays; shapes in the docstrings use B = batch, Q = rows of the step (tokens per
sequence), D = hidden size, H = heads, d = head dim. Norms, softmax statistics, routing and the HC mixes
are float32 whatever the compute dtype (`ds4_arch.md` §6.1); matmuls take the compute dtype and accumulate
in float32. RMSNorm, sums and float32 contractions are `model/reduce.py`'s (which picks their invariant route).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from dsparkjax.model import reduce
from dsparkjax.model.weights import Weight, linear


# ---------------------------------------------------------------------------------------------------------
# Rotary embedding: interleaved pairs on the last `rope_dim` dims (`ds4_arch.md` §2).


def rope_frequencies(rope_dim: int, base: float, yarn: tuple[float, float, float] | None = None) -> np.ndarray:
    """Per-pair angular frequencies `f_i = base^(-2i/rope_dim)`, optionally YaRN-blended without mscale.

    Args:
      yarn: (factor, lo, hi): pairs below lo keep f_i, pairs above hi use f_i/factor, linear in between.
    Returns:
      float64 `[rope_dim // 2]`.
    """
    i = np.arange(rope_dim // 2, dtype=np.float64)
    freqs = base ** (-2.0 * i / rope_dim)
    if yarn is not None:
        factor, lo, hi = yarn
        ramp = np.clip((i - lo) / (hi - lo), 0.0, 1.0)
        freqs = freqs * (1.0 - ramp) + freqs / factor * ramp
    return freqs


def apply_rope(x: jax.Array, positions: jax.Array, freqs: np.ndarray, *, inverse: bool = False) -> jax.Array:
    """Rotate the last `2·len(freqs)` dims of `x` in interleaved pairs by `±positions·freqs`.

    Args:
      x: `[..., S, (heads,) dim]` float; positions: int `[..., S]` broadcastable to x's leading axes
        (a heads axis, if present, is handled by the caller passing `positions[..., None]`).
    Returns:
      float32, same shape as x.
    """
    rope_dim = 2 * len(freqs)
    x = x.astype(jnp.float32)
    angle = positions.astype(jnp.float32)[..., None] * jnp.asarray(freqs, jnp.float32)
    if inverse:
        angle = -angle
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    tail = x[..., -rope_dim:].reshape(*x.shape[:-1], rope_dim // 2, 2)
    even, odd = tail[..., 0], tail[..., 1]
    rotated = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1)
    return jnp.concatenate([x[..., :-rope_dim], rotated.reshape(*x.shape[:-1], rope_dim)], axis=-1)


# ---------------------------------------------------------------------------------------------------------
# QAT simulations of the official graph (`ds4_arch.md` §6.2).


def _pow2_scale(amax: jax.Array, qmax: float) -> jax.Array:
    """float32 `2^ceil(log2(amax / qmax))`, exact: from the exponent bits, as DeepSeek's `fast_round_scale`.

    jnp.log2/exp2 are not exact in fp32 (exp2 of an integer is off by ulps on CPU), which puts the rounded
    values off the e4m3/e2m1 grid; frexp/ldexp are bit operations.
    """
    mantissa, exponent = jnp.frexp(amax / jnp.float32(qmax))
    return jnp.ldexp(jnp.float32(1), exponent - (mantissa == 0.5).astype(exponent.dtype))


def fp8_kv_sim(x: jax.Array, block: int = 64) -> jax.Array:
    """Round-trip `[..., n]` (n a multiple of 64) through e4m3 with a power-of-two scale per 64-block.

    Per block: `amax = max(|x|, 1e-4)`, `s = 2^ceil(log2(amax/448))`, `x <- e4m3_rne(clip(x/s, ±448))·s`.
    """
    shape = x.shape
    blocks = x.astype(jnp.float32).reshape(*shape[:-1], shape[-1] // block, block)
    amax = jnp.maximum(jnp.max(jnp.abs(blocks), axis=-1, keepdims=True), 1e-4)
    scale = _pow2_scale(amax, 448.0)
    q = jnp.clip(blocks / scale, -448.0, 448.0).astype(jnp.float8_e4m3fn).astype(jnp.float32)
    return (q * scale).reshape(shape)


def hadamard_matrix(n: int) -> np.ndarray:
    """Sylvester-order Hadamard matrix scaled by 1/sqrt(n) (orthogonal, symmetric, self-inverse)."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    if h.shape[0] != n:
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    return h / math.sqrt(n)


def fp4_block_round(x: jax.Array, block: int = 32) -> jax.Array:
    """e2m1 round trip of `[..., n]` (n a multiple of 32) with a power-of-two scale per 32-block.

    Per block: `amax = max(|x|, 6·2^-126)`, `s = 2^ceil(log2(amax/6))`, `x <- e2m1_rne(clip(x/s, ±6))·s`.
    """
    blocks = x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // block, block)
    amax = jnp.maximum(jnp.max(jnp.abs(blocks), axis=-1, keepdims=True), 6.0 * 2.0**-126)
    scale = _pow2_scale(amax, 6.0)
    q = jnp.clip(blocks / scale, -6.0, 6.0).astype(jnp.float4_e2m1fn).astype(jnp.float32)
    return (q * scale).reshape(x.shape)


def fp4_indexer_sim(x: jax.Array) -> jax.Array:
    """Hadamard rotation of the last axis (`H/sqrt(n)`), then `fp4_block_round`."""
    n = x.shape[-1]
    rotated = reduce.contract(x, jnp.asarray(hadamard_matrix(n), jnp.float32))  # symmetric: H·x = Hᵀ·x
    return fp4_block_round(rotated)


# ---------------------------------------------------------------------------------------------------------
# Attention pieces.


def sink_attention(scores: jax.Array, sinks: jax.Array | None, valid: jax.Array) -> jax.Array:
    """Softmax over keys plus one value-less sink logit per head; returns the probabilities.

    Args:
      scores: float32 `[..., H, K]` scaled logits; valid: bool broadcastable to scores.
      sinks: `[H]` sink logits (None = no sink).
    Returns:
      float32 `[..., H, K]`; invalid keys get exactly 0.
    """
    scores = jnp.where(valid, scores, -jnp.inf)
    top = jnp.max(scores, axis=-1, keepdims=True)
    if sinks is not None:
        top = jnp.maximum(top, sinks.astype(jnp.float32)[:, None])
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    weights = jnp.where(valid, jnp.exp(scores - top), 0.0)
    denom = reduce.total(weights, axis=-1, keepdims=True)
    if sinks is not None:
        denom = denom + jnp.exp(sinks.astype(jnp.float32)[:, None] - top)
    return weights / denom


def grouped_output(o: jax.Array, wo_a: Weight, wo_b: Weight, groups: int) -> jax.Array:
    """Grouped low-rank output projection: per group of H/g heads `z_g = o_g·W_a,gᵀ`, then `concat(z)·W_bᵀ`.

    Args:
      o: `[..., H, d]` attention output (after inverse RoPE); wo_a: `[g·r_o, H·d/g]`; wo_b: `[D, g·r_o]`.
    Returns:
      float32 `[..., D]`.
    """
    lead = o.shape[:-2]
    o = o.reshape(*lead, groups, -1)
    z = linear(o, wo_a, groups=groups)
    return linear(z.reshape(*lead, -1), wo_b)


# ---------------------------------------------------------------------------------------------------------
# Mixture of experts (`ds4_arch.md` §3.6).


def route(x: jax.Array, router: jax.Array, bias: jax.Array | None, hashed_ids: jax.Array | None, k: int,
          scale: float) -> tuple[jax.Array, jax.Array]:
    """Pick k experts per token and their weights.

    Scores are `sqrt(softplus(x·routerᵀ))` in float32; selection is the top-k of `scores + bias` (ties to the
    lowest index) or the token's fixed experts on hash layers; weights are the selected scores normalised
    to sum 1, times the routed scaling factor.

    Args:
      x: `[..., D]`; router: `[E, D]`; bias: `[E]` or None; hashed_ids: int32 `[..., k]` or None.
    Returns:
      (expert ids int32 `[..., k]`, weights float32 `[..., k]`).
    """
    logits = reduce.contract(x, router)
    scores = jnp.sqrt(jax.nn.softplus(logits))
    if hashed_ids is None:
        choice = scores if bias is None else scores + bias.astype(jnp.float32)
        _, ids = jax.lax.top_k(choice, k)
    else:
        ids = hashed_ids
    picked = jnp.take_along_axis(scores, ids, axis=-1)
    return ids.astype(jnp.int32), picked / reduce.total(picked, axis=-1, keepdims=True) * scale


def swiglu(gate: jax.Array, up: jax.Array, limit: float) -> jax.Array:
    """DS4's clamped SwiGLU: `silu(min(gate, L)) · clip(up, −L, L)` (gate clamped above only)."""
    gate = jnp.minimum(gate, limit)
    return jax.nn.silu(gate) * jnp.clip(up, -limit, limit)
