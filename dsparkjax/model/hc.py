"""Manifold-constrained hyper-connections (mHC): the residual of DS4 is n streams, mixed per sub-layer.

Pure-jnp reference of the HC op (`ds4_arch.md` §3.2, `quant_hc.md` §3). Everything here runs in float32
whatever the compute dtype, because 20 Sinkhorn iterations amplify rounding (`quant_hc.md` §3.5).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsparkjax.model import reduce


def _rms_scale(flat: jax.Array, eps: float) -> jax.Array:
    """1/rms of the last axis: `(mean(x²) + eps)^(-1/2)`, float32, keepdims."""
    return jax.lax.rsqrt(reduce.mean(jnp.square(flat), axis=-1, keepdims=True) + eps)


def hc_mix(streams: jax.Array, fn: jax.Array, *, norm_eps: float) -> jax.Array:
    """The HC mix `μ = (flat(X) @ fnᵀ) · rsqrt(mean(flat²) + eps)`.

    Args:
      streams: float32 `[..., n, D]`, the HC residual.
      fn: `[M, n·D]` mix weights (M = (2+n)·n for a sub-layer, n for the head).
    Returns:
      float32 `[..., M]`.
    """
    flat = streams.reshape(*streams.shape[:-2], -1).astype(jnp.float32)
    mix = reduce.contract(flat, fn)
    return mix * _rms_scale(flat, norm_eps)


def sinkhorn(logits: jax.Array, *, iters: int, eps: float) -> jax.Array:
    """Near doubly-stochastic `[..., n, n]` matrix from logits: row softmax, then alternate normalisations.

    Columns are normalised last, so columns sum to 1 within ~n·eps and rows approximately.
    """
    def normalise_columns(comb: jax.Array) -> jax.Array:
        return comb / (jnp.sum(comb, axis=-2, keepdims=True) + eps)

    def iteration(_: int, comb: jax.Array) -> jax.Array:
        return normalise_columns(comb / (jnp.sum(comb, axis=-1, keepdims=True) + eps))

    comb = normalise_columns(jax.nn.softmax(logits, axis=-1) + eps)
    return jax.lax.fori_loop(0, iters - 1, iteration, comb)  # a loop, not 20 unrolled copies: compile time


def hc_pre(
    streams: jax.Array,
    fn: jax.Array,
    base: jax.Array,
    scale: jax.Array,
    *,
    iters: int,
    hc_eps: float,
    norm_eps: float,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """HC-pre of one sub-layer: collapse the streams into the sub-layer input and return the post/comb gates.

    Args:
      streams: `[..., n, D]` HC residual (any float dtype; mixed in float32).
      fn: `[(2+n)·n, n·D]`; base: `[(2+n)·n]`; scale: `[3]`.
    Returns:
      (u `[..., D]` float32 collapsed input `Σ_j pre_j·X_j`,
       post `[..., n]` in (0, 2),
       comb `[..., n, n]`, row index = source stream j, column = destination k).
    """
    n = streams.shape[-2]
    mix = hc_mix(streams, fn, norm_eps=norm_eps)
    base = base.astype(jnp.float32)
    scale = scale.astype(jnp.float32)
    pre = jax.nn.sigmoid(mix[..., :n] * scale[0] + base[:n]) + hc_eps
    post = 2.0 * jax.nn.sigmoid(mix[..., n : 2 * n] * scale[1] + base[n : 2 * n])
    comb_logits = mix[..., 2 * n :] * scale[2] + base[2 * n :]
    comb = sinkhorn(comb_logits.reshape(*comb_logits.shape[:-1], n, n), iters=iters, eps=hc_eps)
    u = jnp.einsum("...j,...jd->...d", pre, streams.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return u, post, comb


def hc_post(block_out: jax.Array, streams: jax.Array, post: jax.Array, comb: jax.Array) -> jax.Array:
    """HC-post: `X'[k] = post[k]·F + Σ_j comb[j, k]·X[j]` (note the transpose; `ds4_arch.md` §6.3 item 6).

    Args:
      block_out: `[..., D]` sub-layer output F; streams: `[..., n, D]`; post: `[..., n]`; comb: `[..., n, n]`.
    Returns:
      float32 `[..., n, D]`.
    """
    mixed = jnp.einsum(
        "...jk,...jd->...kd", comb, streams.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST
    )
    return post[..., :, None] * block_out.astype(jnp.float32)[..., None, :] + mixed


def hc_head(
    streams: jax.Array, fn: jax.Array, base: jax.Array, scale: jax.Array, *, hc_eps: float, norm_eps: float
) -> jax.Array:
    """Final sigmoid collapse of the streams (no Sinkhorn): `Σ_j (sigmoid(μ_j·s + b_j) + eps)·X_j`.

    Args:
      streams: `[..., n, D]`; fn: `[n, n·D]`; base: `[n]`; scale: `[1]`.
    Returns:
      float32 `[..., D]`.
    """
    mix = hc_mix(streams, fn, norm_eps=norm_eps)
    pre = jax.nn.sigmoid(mix * scale.astype(jnp.float32)[0] + base.astype(jnp.float32)) + hc_eps
    return reduce.total(pre[..., :, None] * streams.astype(jnp.float32), axis=-2)
