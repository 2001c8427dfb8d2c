"""One decode step as one device program: the verify rows, the target step, acceptance and the commit.

`generate` dispatches this program once per step (plus the proposer's calls in speculative decoding). It
builds the rows `[seed, c_1 .. c_{w-1}]`, runs the target step on them, takes the greedy argmax of every
row, accepts the longest matching prefix of candidates, picks the bonus token, and commits seed + accepted
rows of the active sequences, with the decode state donated: the new state lives in the old state's buffers.

Why one program rather than the step between small helpers: the host then dispatches one executable per step
instead of a chain of five (padding, rows, step, acceptance, commit), and the committed state never leaves
the device between programs. On the H200 this made plain fast decoding 14% faster and steadier (2.12 -> 1.83
ms/step, best of four same-process runs; generation run 13 in docs/PERFORMANCE.md) and left the other modes
unchanged. A plausible part of the gain: XLA's GPU command buffers re-record the commands that read an
argument whose address changed since the last run, and here the rows are internal and the committed length
aliases the old one; that part was not measured separately.

Exact mode runs one width for every step, and plain and speculative decoding call the same executable (the
program depends on the width, the EWMA decay and whether it samples, never on the proposer), so a row's
logits are computed by the same code whatever the other rows hold.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from dsparkjax.aot import AotFunction
from dsparkjax.config import TargetConfig
from dsparkjax.model.params import TargetParams
from dsparkjax.model.state import DecodeState, commit
from dsparkjax.model.target import StepOptions, TargetModel
from dsparkjax.spec.width import accepted_candidates, ewma_update


@struct.dataclass
class StepOutcome:
    """What the host reads back after a decode step (B sequences, width W)."""

    candidates: jax.Array  # int32 [B, W - 1], the verified candidates
    matched: jax.Array  # int32 [B], candidates accepted
    bonus: jax.Array  # int32 [B], the target's token after the accepted prefix: the next seed
    bad: jax.Array  # int32 [], the smallest candidate id outside the vocabulary, or -1 if none is


@struct.dataclass
class DecodeOutputs:
    """A decode step's device outputs: the committed state, what the host reads, and what the loop threads on."""

    state: DecodeState
    outcome: StepOutcome
    ewma: jax.Array  # float32 [B], acceptance EWMA after this step
    key: jax.Array  # the PRNG key after this step (advanced only when sampling)
    features: jax.Array  # float32 [B, W, n_capture, D], the target's captured features of the W rows
    positions: jax.Array  # int32 [B, W], the rows' positions


def pick_token(logits: jax.Array, rows: jax.Array, temperature: jax.Array, key: jax.Array, sample: bool) -> jax.Array:
    """The next token int32 `[B]` after row `rows[b]` (int32 `[B]`) of logits float32 `[B, W, V]`: the argmax,
    or when `sample` a draw at `temperature` with `key`."""
    picked = jnp.take_along_axis(logits, rows[:, None, None], axis=1)[:, 0]
    if sample:
        return jax.random.categorical(key, picked / temperature).astype(jnp.int32)
    return jnp.argmax(picked, axis=-1).astype(jnp.int32)


def outcome_of(logits: jax.Array, candidates: jax.Array, widths: jax.Array) -> StepOutcome:
    """Greedy acceptance of candidates int32 `[B, W - 1]` against logits float32 `[B, W, V]`, counting the
    first `widths` int32 `[B]` rows of each sequence."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    matched = accepted_candidates(candidates, greedy, widths)
    bad = (candidates < 0) | (candidates >= logits.shape[-1])
    never = jnp.iinfo(jnp.int32).max
    first_bad = jnp.where(jnp.any(bad), jnp.min(jnp.where(bad, candidates, never), initial=never), -1)
    bonus = jnp.take_along_axis(greedy, matched[:, None], axis=1)[:, 0]
    return StepOutcome(candidates, matched, bonus, first_bad)


@functools.lru_cache(maxsize=None)
def decode_program(cfg: TargetConfig, options: StepOptions) -> AotFunction:
    """The decode step for (config, step options), one executable per (width, EWMA decay, sampling):

    `program(params, state, seeds, drafts, widths, active, ewma, temperature, key, width, ewma_decay, sample)`
    with seeds int32 `[B]`, drafts int32 `[B, >= width - 1]` (the first width − 1 are verified), widths int32
    `[B]` (rows that count, 1 for plain decoding), active bool `[B]` (sequences still running: the others
    commit nothing), ewma float32 `[B]`, temperature float32 `[]` and a PRNG key (used when `sample`: plain
    decoding's next token is then sampled from row 0). Returns `DecodeOutputs`; `state` is donated.

    The EWMA decay, not the whole WidthPolicy, is the static argument: runs whose policies differ only in
    how they choose widths (the oracle's fixed q, the drafter's confidences) share one compiled target step.
    """
    model = TargetModel(cfg, options)

    def program(params: TargetParams, state: DecodeState, seeds: jax.Array, drafts: jax.Array, widths: jax.Array,
                active: jax.Array, ewma: jax.Array, temperature: jax.Array, key: jax.Array, width: int,
                ewma_decay: float, sample: bool) -> DecodeOutputs:
        candidates = drafts[:, : width - 1]
        rows = jnp.concatenate([seeds[:, None], candidates], axis=1)
        positions = state.length[:, None] + jnp.arange(width, dtype=jnp.int32)
        logits, features, state = model.step(params, state, rows)
        outcome = outcome_of(logits, candidates, widths)
        if sample:
            key, sub = jax.random.split(key)
            outcome = outcome.replace(bonus=pick_token(logits, jnp.zeros_like(seeds), temperature, sub, True))
        state = commit(state, jnp.where(active, outcome.matched + 1, 0))
        return DecodeOutputs(state, outcome, ewma_update(ewma, outcome.matched, ewma_decay), key, features, positions)

    return AotFunction(program, donate_argnums=(1,), static_argnums=(9, 10, 11))
