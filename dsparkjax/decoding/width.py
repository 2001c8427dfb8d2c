"""How many rows to verify per step: confidence thresholds, an EWMA of acceptance, or a fixed width.

The width q counts the seed: q = 1 is plain decoding, q = 2 offers one candidate. Everything here is jnp
over the batch so the choice stays on the device (`dspark.md` §2.5).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax
import jax.numpy as jnp

from dsparkjax.errors import ArgumentError


@dataclasses.dataclass(frozen=True)
class WidthPolicy:
    """Static width policy (hashable, a jit static argument).

    kind: "confidence" (lucebox: q = 3 if c1·c2 >= p2, q = 4 if also c1·c2·c3 >= p3, at least 2),
      "ewma" (drafters without a confidence head: ewma ← decay·ewma + (1−decay)·matched, q = int(ewma) + 2),
      or "fixed" (q = fixed_q every step). The result is clamped to [1, max_q].
    """

    kind: Literal["confidence", "ewma", "fixed"] = "confidence"
    fixed_q: int = 4
    max_q: int = 6
    p2_threshold: float = 0.40
    p3_threshold: float = 0.30
    ewma_decay: float = 0.7
    ewma_init: float = 1.5

    def choose(self, confidences: jax.Array, ewma: jax.Array) -> jax.Array:
        """Width per sequence, int32 `[B]`, from the candidates' confidences `[B, K]` and the EWMA `[B]`."""
        if self.kind == "fixed":
            q = jnp.full(ewma.shape, self.fixed_q, jnp.int32)
        elif self.kind == "ewma":
            q = jnp.floor(ewma).astype(jnp.int32) + 2
        else:
            survive = jnp.cumprod(confidences, axis=-1)
            q = 2 + (survive[:, 1] >= self.p2_threshold).astype(jnp.int32)
            q = q + ((q == 3) & (survive[:, 2] >= self.p3_threshold)).astype(jnp.int32)
        return jnp.clip(q, 1, self.max_q)


def policy_for(width: int | str | WidthPolicy, proposer: Any, max_q: int) -> WidthPolicy:
    """`generate`'s `width` argument as a policy: "adaptive" (confidences if the proposer has them, else the
    EWMA), a fixed q in [1, max_q] (an int or its digits), or a WidthPolicy (its max_q capped at max_q)."""
    if isinstance(width, WidthPolicy):
        return dataclasses.replace(width, max_q=min(width.max_q, max_q))
    if isinstance(width, int) or (isinstance(width, str) and width.isdigit()):
        q = int(width)
        if not 1 <= q <= max_q:
            raise ArgumentError(f"width must be 'adaptive' or an integer in [1, {max_q}], got {width}")
        return WidthPolicy("fixed", fixed_q=q, max_q=max_q)
    if width != "adaptive":
        raise ArgumentError(f"width must be 'adaptive' or an integer in [1, {max_q}], got {width!r}")
    kind = "confidence" if proposer is not None and proposer.has_confidence else "ewma"
    return WidthPolicy(kind, max_q=max_q)


def ewma_update(ewma: jax.Array, matched: jax.Array, decay: float) -> jax.Array:
    """The acceptance EWMA after a step: ewma float32 `[B]` ← decay·ewma + (1 − decay)·matched (int32 `[B]`),
    with a WidthPolicy's `ewma_decay`."""
    return decay * ewma + (1.0 - decay) * matched.astype(jnp.float32)


def accepted_candidates(candidates: jax.Array, target_argmax: jax.Array, widths: jax.Array) -> jax.Array:
    """Greedy acceptance: how many leading candidates equal the target's argmax of the row before them.

    Args:
      candidates: int32 `[B, K]`, candidate j verified at row j + 1; target_argmax: int32 `[B, K + 1]`, row r's
        greedy token (a prediction for position seed_pos + r + 1); widths: int32 `[B]`, rows that count.
    Returns:
      int32 `[B]` matched count in [0, widths − 1].
    """
    k = candidates.shape[1]
    match = (candidates == target_argmax[:, :k]) & (jnp.arange(k)[None, :] < (widths - 1)[:, None])
    return jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
