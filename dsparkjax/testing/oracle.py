"""An oracle proposer: proposes the target's own continuation, known from a plain (greedy or sampled) run.

It is a measuring instrument, not a drafter: the tests use it to force acceptances and rejections where
they want them (a "drafter constructed to agree"), and the benchmark uses it to run the speculative loop
at a chosen acceptance rate, so verify costs can be measured independently of a drafter's quality.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dsparkjax.decoding.generate import Result


@dataclasses.dataclass(frozen=True, eq=False)
class OracleProposer:
    """Proposes the target's own continuation, known from a plain run, but wrong where `wrong` is set.

    `truth[b, p]` is the token at position p of sequence b (prompt, then the plain run's output). A wrong
    position proposes another token (and a low confidence), so a run sees both acceptances and rejections.
    `bad_id` makes every proposal an out-of-range id (for the hash-table bounds test).
    """

    truth: np.ndarray  # int32 [B, L]
    wrong: np.ndarray  # bool [B, L]
    vocab: int
    block_size: int = 5
    capture_layers: tuple[int, ...] = ()
    has_confidence: bool = True
    width_thresholds: tuple[float, ...] | None = None
    bad_id: int | None = None

    def init_state(self, batch: int, max_step: int) -> Any:
        del max_step
        assert batch == self.truth.shape[0]
        return jnp.asarray(self.truth, jnp.int32), jnp.asarray(self.wrong)

    # Its proposals are integer lookups, the same bits under any kernel policy: `invariant` changes nothing.
    def precompile(self, state: Any, widths: tuple[int, ...], sampled: Any = None, *, invariant: bool) -> None:
        del state, widths, sampled, invariant  # nothing to compile ahead: propose is a few jnp ops

    def absorb(self, state: Any, features: jax.Array, positions: jax.Array, *, invariant: bool) -> Any:
        del features, positions, invariant
        return state

    def propose(self, state: Any, seeds: jax.Array, seed_pos: jax.Array, *, invariant: bool
                ) -> tuple[jax.Array, jax.Array]:
        del invariant
        truth, wrong = state
        return _propose(truth, wrong, seed_pos, self.block_size, self.vocab, self.bad_id)

    def propose_sampled(self, state: Any, seeds: jax.Array, seed_pos: jax.Array, rows: Any, purpose: int,
                        with_logits: bool, *, invariant: bool) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        """The same candidates, each drawn from a point mass on itself: logits 0 there, −inf elsewhere (a valid
        q for the lossless rule, which then accepts a candidate with the target's probability of it)."""
        del rows, purpose
        candidates, confidences = self.propose(state, seeds, seed_pos, invariant=invariant)
        return candidates, confidences, _point_mass(candidates, self.vocab) if with_logits else None


@functools.partial(jax.jit, static_argnums=(3, 4, 5))
def _propose(truth: jax.Array, wrong: jax.Array, seed_pos: jax.Array, block: int, vocab: int, bad_id: int | None
             ) -> tuple[jax.Array, jax.Array]:
    idx = jnp.minimum(seed_pos[:, None] + 1 + jnp.arange(block), truth.shape[1] - 1)
    rows = jnp.arange(truth.shape[0])[:, None]
    candidates = jnp.where(wrong[rows, idx], (truth[rows, idx] + 1) % vocab, truth[rows, idx])
    if bad_id is not None:
        candidates = jnp.full_like(candidates, bad_id)
    return candidates, jnp.where(wrong[rows, idx], 0.3, 0.95).astype(jnp.float32)


@functools.partial(jax.jit, static_argnums=(1,))
def _point_mass(candidates: jax.Array, vocab: int) -> jax.Array:
    return jnp.where(jnp.arange(vocab) == candidates[..., None], 0.0, -jnp.inf).astype(jnp.float32)


def oracle_for(prompts: list[list[int]], reference: list[Result], vocab: int, wrong_rate: float, seed: int,
               **kwargs: Any) -> OracleProposer:
    """An oracle proposing the `reference` run's outputs after `prompts`, wrong at `wrong_rate` of positions.

    Its arrays are padded to a power-of-two length (zeros, never wrong, beyond the 16 positions of slack after
    the longest sequence, which no proposal reads): they are the proposer's loop state, whose shapes key the
    compiled step programs, so runs of similar lengths share them."""
    length = max(len(p) + len(r.token_ids) for p, r in zip(prompts, reference)) + 16
    padded = 1 << (length - 1).bit_length()
    truth = np.zeros((len(prompts), padded), np.int32)
    for b, (p, r) in enumerate(zip(prompts, reference)):
        seq = list(p) + r.token_ids
        truth[b, : len(seq)] = seq
    wrong = np.zeros(truth.shape, bool)
    wrong[:, :length] = np.random.default_rng(seed).random((len(prompts), length)) < wrong_rate
    return OracleProposer(truth, wrong, vocab, **kwargs)
