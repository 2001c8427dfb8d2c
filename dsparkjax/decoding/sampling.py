"""Sampling: the parameters, the one definition of the target distribution, and keyed noise.

Every sampled token of a sequence is `argmax(warp(logits) + Gumbel(seed, position, purpose))`: the noise is
keyed by the sequence's own seed and the token's absolute position (the prompt's first token is position
0), never by the batch row or the step counter, so a sequence's tokens do not depend on its batch, its row,
the verify width or its neighbours (`spec_sampling.md` §3). Plain sampling, the drafter's candidates, the
exact verifier and the lossless verifier all warp logits with the one `warp` below.

Warping order (vLLM's, `spec_sampling.md` §2): temperature → top-k → top-p → min-p.
- temperature T: (logits − max) / T, the same distribution as logits / T, kept finite for any T float32 holds
  (5e-38 would overflow 10.0 / T to inf, and a tie of infinities is no longer the argmax). T = 0 is greedy:
  the warped logits are 0 at the argmax (lowest index on ties, as `jnp.argmax`) and −inf elsewhere, so the
  distribution is one-hot and every rule reduces to greedy;
- top_k k > 0: keep the logits >= the k-th largest (ties at the boundary are all kept);
- top_p p < 1: of what top-k kept, keep the most probable tokens, in order, until the kept mass reaches p
  (the smallest such set, plus every token tied with its last);
- min_p m > 0: keep the tokens whose probability is >= m times the most probable one's.
Neutral values (k = 0, p = 1, m = 0) leave the logits bit for bit as they are, so rows with and without
filters can share one compiled program.

Noise purposes: TARGET draws the target's token at a position (plain sampling, the exact verifier's sample,
the lossless rule's bonus token); the exact mode's drafter draws with TARGET noise too (the coupling of
Daliri et al., arXiv 2408.07978); the lossless mode's drafter draws with DRAFT noise, its acceptance coins
are ACCEPT and its residual sample RESIDUAL, so the four are independent.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dsparkjax import validation
from dsparkjax.errors import ArgumentError

TARGET, DRAFT, ACCEPT, RESIDUAL = 0, 1, 2, 3  # noise purposes (the last fold_in of a draw's key)
MAX_SEED = 2**32 - 1
MAX_TOP_K = 2**31 - 1  # the rows hold top_k as int32; a k of the vocabulary or more keeps every token


def _real(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ArgumentError(f"{name} must be a finite number, got {value!r}")
    return float(value)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How a sequence samples (module docstring: the warping order). The defaults are greedy decoding.

    temperature: >= 0, 0 is greedy, one that float32 holds (`validation.temperature`); top_k: an integer in
    [0, 2**31), 0 keeps every token; top_p: in (0, 1], 1 keeps every token; min_p: in [0, 1], 0 keeps every token.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        validation.temperature(self.temperature)
        if (isinstance(self.top_k, bool) or not isinstance(self.top_k, numbers.Integral)
                or not 0 <= self.top_k <= MAX_TOP_K):
            raise ArgumentError(f"top_k must be an integer >= 0 (0: off) and < 2**31, got {self.top_k!r}")
        if not 0 < _real(self.top_p, "top_p") <= 1:
            raise ArgumentError(f"top_p must be in (0, 1] (1: off), got {self.top_p!r}")
        if not 0 <= _real(self.min_p, "min_p") <= 1:
            raise ArgumentError(f"min_p must be in [0, 1] (0: off), got {self.min_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = SamplingParams()


def check_seed(seed: Any, name: str = "seed") -> int:
    """A sequence seed: an integer in [0, 2**32)."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed <= MAX_SEED:
        raise ArgumentError(f"{name} must be an integer in [0, 2**32), got {seed!r}")
    return int(seed)


@struct.dataclass
class RowSampling:
    """Per-row sampling parameters on the device, one entry per batch row (B rows), so one compiled program
    serves rows that sample differently. Rows without a sequence hold greedy values."""

    temperature: jax.Array  # float32 [B], 0 = greedy
    top_k: jax.Array  # int32 [B], 0 = off
    top_p: jax.Array  # float32 [B], 1 = off
    min_p: jax.Array  # float32 [B], 0 = off
    seed: jax.Array  # uint32 [B], the sequence's seed

    @classmethod
    def of(cls, params: Sequence[SamplingParams], seeds: Sequence[int]) -> RowSampling:
        """Rows from one SamplingParams and one seed per row."""
        return cls(temperature=jnp.asarray([p.temperature for p in params], jnp.float32),
                   top_k=jnp.asarray([p.top_k for p in params], jnp.int32),
                   top_p=jnp.asarray([p.top_p for p in params], jnp.float32),
                   min_p=jnp.asarray([p.min_p for p in params], jnp.float32),
                   seed=jnp.asarray(np.asarray(seeds, np.uint32)))

    @classmethod
    def greedy(cls, batch: int) -> RowSampling:
        return cls.of([GREEDY] * batch, [0] * batch)


def _per_row(value: jax.Array, like: jax.Array) -> jax.Array:
    """A per-row value `[B]` shaped to broadcast against `like` `[B, ..., V]`."""
    return value.reshape(value.shape + (1,) * (like.ndim - 1))


def _filter(x: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array) -> jax.Array:
    """Top-k, then top-p, then min-p of tempered logits x float32 `[B, ..., V]` (per-row parameters shaped to
    broadcast); dropped tokens become −inf, kept ones keep their bits."""
    vocab = x.shape[-1]
    ordered = -jnp.sort(-x, axis=-1)  # descending
    kth = jnp.take_along_axis(ordered, jnp.broadcast_to(jnp.clip(top_k, 1, vocab) - 1, x.shape[:-1] + (1,)), -1)
    off_k = (top_k <= 0) | (top_k >= vocab)
    ordered = jnp.where(off_k | (ordered >= kth), ordered, -jnp.inf)
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # the mass of the more probable tokens
    n_keep = jnp.sum(before < top_p, axis=-1, keepdims=True)  # a prefix: `before` never decreases
    last = jnp.take_along_axis(ordered, jnp.maximum(n_keep - 1, 0), -1)
    off_p = top_p >= 1  # explicit: the summed mass may round to 1 before the last token
    relative = x - jnp.max(x, axis=-1, keepdims=True)
    keep = ((off_k | (x >= kth)) & (off_p | (x >= last))
            & (relative >= jnp.log(min_p)))  # log 0 = −inf keeps everything
    return jnp.where(keep, x, -jnp.inf)


def warp(logits: jax.Array, rows: RowSampling) -> jax.Array:
    """The target distribution's logits, float32 `[B, ..., V]`, from raw logits `[B, ..., V]` and each row's
    parameters (module docstring: the order). softmax of the result is the distribution that is sampled."""
    temperature = _per_row(rows.temperature, logits)
    greedy = temperature <= 0
    x = logits.astype(jnp.float32)
    x = (x - jnp.max(x, axis=-1, keepdims=True)) / jnp.where(greedy, 1.0, temperature)
    filtered = jnp.any((rows.top_k > 0) | (rows.top_p < 1) | (rows.min_p > 0))
    # The sort runs only in steps where some row filters; a neutral row's logits are the same either way.
    x = jax.lax.cond(filtered, _filter, lambda x, *_: x, x, _per_row(rows.top_k, logits),
                     _per_row(rows.top_p, logits), _per_row(rows.min_p, logits))
    top = jnp.argmax(logits, axis=-1)[..., None]
    one_hot = jnp.where(jnp.arange(logits.shape[-1]) == top, 0.0, -jnp.inf)
    return jnp.where(greedy, one_hot, x)


def _keys(seed: jax.Array, positions: jax.Array, purpose: int) -> jax.Array:
    """PRNG keys `[B, ...]` of the draws at absolute positions int32 `[B, ...]` of rows with seeds uint32 `[B]`."""
    def key(s: jax.Array, p: jax.Array) -> jax.Array:
        return jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(s), p), purpose)

    seeds = jnp.broadcast_to(_per_row(seed, positions), positions.shape)
    flat = jax.vmap(key)(seeds.reshape(-1), positions.reshape(-1))
    return flat.reshape(positions.shape + flat.shape[1:])


def gumbel(rows: RowSampling, positions: jax.Array, purpose: int, vocab: int) -> jax.Array:
    """Gumbel noise float32 `[B, ..., V]` for the tokens at positions int32 `[B, ...]`."""
    keys = _keys(rows.seed, positions, purpose)
    flat = jax.vmap(lambda k: jax.random.gumbel(k, (vocab,), jnp.float32))(keys.reshape(-1, keys.shape[-1]))
    return flat.reshape(positions.shape + (vocab,))


def uniform(rows: RowSampling, positions: jax.Array, purpose: int) -> jax.Array:
    """Uniform [0, 1) draws float32 `[B, ...]` for the tokens at positions int32 `[B, ...]`."""
    keys = _keys(rows.seed, positions, purpose)
    flat = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys.reshape(-1, keys.shape[-1]))
    return flat.reshape(positions.shape)


def gumbel_argmax(log_weights: jax.Array, rows: RowSampling, positions: jax.Array, purpose: int) -> jax.Array:
    """A draw int32 `[B, ...]` from softmax(log_weights `[B, ..., V]`) with the keyed noise of `positions`."""
    noise = gumbel(rows, positions, purpose, log_weights.shape[-1])
    return jnp.argmax(log_weights + noise, axis=-1).astype(jnp.int32)


def draw(logits: jax.Array, rows: RowSampling, positions: jax.Array, purpose: int) -> tuple[jax.Array, jax.Array]:
    """Sample the tokens at positions int32 `[B, ...]` from raw logits float32 `[B, ..., V]`.

    Returns (tokens int32 `[B, ...]`, the warped logits float32 `[B, ..., V]` they were drawn from). A greedy
    row's token is the argmax of its logits.
    """
    warped = warp(logits, rows)
    return gumbel_argmax(warped, rows, positions, purpose), warped
