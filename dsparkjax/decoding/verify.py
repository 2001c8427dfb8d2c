"""The lossless acceptance rule of speculative sampling (Leviathan et al. 2023, Chen et al. 2023), as a pure
function of the distributions, the candidates and the acceptance coins (`spec_sampling.md` §1).

Per verified candidate x_j in order: accept iff u_j · q_j(x_j) < p_j(x_j) (u_j < min(1, p/q) without a
division); at the first rejection the next token is drawn from normalised max(0, p_j − q_j), the whole
vector; if every verified candidate is accepted, from the target's p after them (the bonus token). The
emitted token then has exactly the law p, whatever q is, provided q is the distribution x_j was drawn from.
The exact-sampling rule needs no function of its own: accept iff x_j equals the target's keyed sample at
that position, which is greedy acceptance (`width.accepted_candidates`) of the sampled tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def residual(p: jax.Array, q: jax.Array) -> jax.Array:
    """Normalised max(0, p − q) float32 `[..., V]`; p itself where nothing is left (p ≤ q everywhere only
    by rounding, since rejection has probability Σ max(0, p − q))."""
    left = jnp.maximum(p - q, 0.0)
    mass = jnp.sum(left, axis=-1, keepdims=True)
    return jnp.where(mass > 0, left / jnp.where(mass > 0, mass, 1.0), p)


def lossless_rule(p: jax.Array, q: jax.Array, candidates: jax.Array, widths: jax.Array, coins: jax.Array
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Accept or reject the candidates of B sequences and give the law of the token after the accepted ones.

    Args:
      p: float32 `[B, W, V]`, the target's distribution at each verified row (row j predicts candidate j's
        position; row W − 1 the position after the last candidate).
      q: float32 `[B, W − 1, V]`, the distribution candidate j was drawn from.
      candidates: int32 `[B, W − 1]`; widths: int32 `[B]`, rows that count (widths − 1 candidates verified).
      coins: float32 `[B, W − 1]`, uniforms in [0, 1), one per candidate.
    Returns:
      (matched int32 `[B]` candidates accepted, rejected bool `[B]` whether a verified candidate was
      rejected, final float32 `[B, V]`: the residual at the rejection, else p at row `matched`).
    """
    k = candidates.shape[1]
    p_c = jnp.take_along_axis(p[:, :k], candidates[..., None], axis=-1)[..., 0]
    q_c = jnp.take_along_axis(q, candidates[..., None], axis=-1)[..., 0]
    verified = jnp.arange(k)[None, :] < (widths - 1)[:, None]
    accept = (coins * q_c < p_c) & verified
    matched = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
    rejected = matched < widths - 1
    p_n = jnp.take_along_axis(p, matched[:, None, None], axis=1)[:, 0]
    q_padded = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)  # no candidate after the last row
    q_n = jnp.take_along_axis(q_padded, matched[:, None, None], axis=1)[:, 0]
    final = jnp.where(rejected[:, None], residual(p_n, q_n), p_n)
    return matched, rejected, final
