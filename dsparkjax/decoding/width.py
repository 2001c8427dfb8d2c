"""How many rows to verify per step: confidence thresholds, an EWMA of acceptance, or a fixed width.

The width q counts the seed: q = 1 is plain decoding, q = 2 offers one candidate. Everything here is jnp
over the batch so the choice stays on the device (`dspark.md` §2.5).

The confidence policy thresholds the drafter's predicted prefix survival s_k = c_1·…·c_k: candidate k is
offered while s_1 .. s_k all reach their thresholds t_1 .. t_k, so q = 1 + that leading run (q = 1 when even
the first candidate is unlikely). A drafter GGUF may carry thresholds fitted on its own pair
(`scripts/calibrate.py`, metadata key `SURVIVAL_THRESHOLDS_KEY`); without them the policy uses lucebox's
constants, `LUCEBOX_THRESHOLDS`.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Literal, Mapping, Sequence

import jax
import jax.numpy as jnp

from dsparkjax.errors import ArgumentError, GGUFContractError

# lucebox's constants as survival thresholds: always one candidate, a second if c1·c2 >= 0.40, a third if also
# c1·c2·c3 >= 0.30 (dspark.md §2.5).
LUCEBOX_THRESHOLDS = (0.0, 0.40, 0.30)
SURVIVAL_THRESHOLDS_KEY = "dsparkjax.width.survival_thresholds"  # drafter GGUF: float32[k], t_1 .. t_k


@dataclasses.dataclass(frozen=True)
class WidthPolicy:
    """Static width policy (hashable, a jit static argument).

    kind: "confidence" (q = 1 + the leading run of k with c_1·…·c_k >= thresholds[k − 1]), "ewma" (drafters
      without a confidence head: ewma ← decay·ewma + (1−decay)·matched, q = int(ewma) + 2), or "fixed"
      (q = fixed_q every step). The result is clamped to [1, max_q].
    """

    kind: Literal["confidence", "ewma", "fixed"] = "confidence"
    fixed_q: int = 4
    max_q: int = 6
    thresholds: tuple[float, ...] = LUCEBOX_THRESHOLDS
    ewma_decay: float = 0.7
    ewma_init: float = 1.5

    def __post_init__(self) -> None:
        object.__setattr__(self, "thresholds", check_thresholds(self.thresholds, "WidthPolicy.thresholds"))

    def choose(self, confidences: jax.Array, ewma: jax.Array) -> jax.Array:
        """Width per sequence, int32 `[B]`, from the candidates' confidences `[B, K]` and the EWMA `[B]`."""
        if self.kind == "fixed":
            q = jnp.full(ewma.shape, self.fixed_q, jnp.int32)
        elif self.kind == "ewma":
            q = jnp.floor(ewma).astype(jnp.int32) + 2
        else:
            depth = min(len(self.thresholds), confidences.shape[-1])
            survive = jnp.cumprod(confidences[:, :depth], axis=-1)
            offered = survive >= jnp.asarray(self.thresholds[:depth], jnp.float32)
            q = 1 + jnp.sum(jnp.cumprod(offered.astype(jnp.int32), axis=-1), axis=-1)
        return jnp.clip(q, 1, self.max_q).astype(jnp.int32)


def check_thresholds(thresholds: Sequence[float], name: str) -> tuple[float, ...]:
    """`thresholds` as a tuple of floats in [0, 1]; ArgumentError naming `name` otherwise."""
    if isinstance(thresholds, (str, bytes)) or not isinstance(thresholds, Sequence):
        raise ArgumentError(f"{name} must be a sequence of survival thresholds in [0, 1], got {thresholds!r}")
    values = tuple(float(t) for t in thresholds if isinstance(t, (int, float)) and not isinstance(t, bool))
    if len(values) != len(thresholds) or not all(math.isfinite(t) and 0.0 <= t <= 1.0 for t in values):
        raise ArgumentError(f"{name} must be survival thresholds in [0, 1], got {list(thresholds)!r}")
    return values


def thresholds_from_metadata(metadata: Mapping[str, Any], block_size: int, path: str) -> tuple[float, ...] | None:
    """A drafter GGUF's fitted survival thresholds (`SURVIVAL_THRESHOLDS_KEY`), or None when it has none.

    GGUFContractError naming the key for anything but a list of at most block_size numbers in [0, 1] (an empty
    one: never offer a candidate).
    """
    if SURVIVAL_THRESHOLDS_KEY not in metadata:
        return None
    value = metadata[SURVIVAL_THRESHOLDS_KEY]
    expected = f"at most {block_size} survival thresholds in [0, 1] (one per candidate it may offer)"
    if not isinstance(value, list) or len(value) > block_size:
        raise GGUFContractError(path, f"metadata key {SURVIVAL_THRESHOLDS_KEY}", expected, repr(value)[:200])
    try:
        return check_thresholds(value, SURVIVAL_THRESHOLDS_KEY)
    except ArgumentError:
        raise GGUFContractError(path, f"metadata key {SURVIVAL_THRESHOLDS_KEY}", expected, repr(value)[:200]) from None


def policy_for(width: int | str | WidthPolicy, proposer: Any, max_q: int) -> WidthPolicy:
    """`generate`'s `width` argument as a policy.

    "adaptive": the confidence policy (the proposer's fitted thresholds, else `LUCEBOX_THRESHOLDS`) if the
    proposer has a confidence head, else the EWMA. A fixed q in [1, max_q] (an int or its digits). A WidthPolicy is
    taken as given, its max_q capped at max_q.
    """
    if isinstance(width, WidthPolicy):
        return dataclasses.replace(width, max_q=min(width.max_q, max_q))
    # bools are ints to Python and non-ASCII digits to int(): neither is a width
    integer = isinstance(width, numbers.Integral) and not isinstance(width, bool)
    if integer or (isinstance(width, str) and width.isascii() and width.isdigit()):
        q = int(width)
        if not 1 <= q <= max_q:
            raise ArgumentError(f"width must be 'adaptive' or an integer in [1, {max_q}], got {width}")
        return WidthPolicy("fixed", fixed_q=q, max_q=max_q)
    if width != "adaptive":
        raise ArgumentError(f"width must be 'adaptive' or an integer in [1, {max_q}], got {width!r}")
    if proposer is None or not proposer.has_confidence:
        return WidthPolicy("ewma", max_q=max_q)
    return WidthPolicy("confidence", max_q=max_q, thresholds=proposer.width_thresholds or LUCEBOX_THRESHOLDS)


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
