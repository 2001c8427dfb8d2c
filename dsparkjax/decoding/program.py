"""The device programs of decoding, each compiled once per width: a prefill chunk and a decode step.

Both take and return one `LoopState`, donated, so the new state lives in the old state's buffers and the
committed state never leaves the device between steps. Their arguments are keywords; the step width, the
EWMA decay and whether to sample are static (part of the jit key); everything else is traced, so a width's
program is traced and compiled once and reused by every step of every run with the same shapes.

- `prefill_program`: one chunk of prompt tokens through the target step, committed, and for the rows whose
  prompt ends in the chunk their first token (the seed of decoding). `forward` and `generate` both run it.
- `decode_program`: one decode step. It builds the rows `[seed, c_1 .. c_{w-1}]`, runs the target step,
  takes the greedy argmax of every row, accepts the longest matching prefix of candidates, picks the bonus
  token and commits seed + accepted rows of the active sequences. One program rather than a chain of small
  ones: the host dispatches one executable per step. Plain and speculative decoding call the same
  executable (it never depends on the proposer), so a row's logits are computed by the same code whatever
  the other rows hold.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from dsparkjax.aot import AotFunction
from dsparkjax.config import TargetConfig
from dsparkjax.decoding.width import accepted_candidates, ewma_update
from dsparkjax.model.params import TargetParams
from dsparkjax.model.state import DecodeState, commit, reset
from dsparkjax.model.target import StepOptions, TargetModel


@struct.dataclass
class LoopState:
    """Everything decoding carries from step to step, on the device (B rows, one pytree)."""

    state: DecodeState  # the target's decode state
    proposer: Any  # the proposer's state pytree, None in plain decoding
    seeds: jax.Array  # int32 [B], each row's last emitted token, not yet in the decode state
    ewma: jax.Array  # float32 [B], acceptance EWMA: the width policy's statistic
    key: jax.Array  # PRNG key, advanced only when sampling
    temperature: jax.Array  # float32 [], the sampling temperature
    active: jax.Array  # bool [B], rows whose sequences are running: the others commit nothing


@struct.dataclass
class StepOutcome:
    """What the host reads back after a decode step (B sequences, width W)."""

    candidates: jax.Array  # int32 [B, W - 1], the verified candidates
    matched: jax.Array  # int32 [B], candidates accepted
    bonus: jax.Array  # int32 [B], the target's token after the accepted prefix: the next seed
    bad: jax.Array  # int32 [], the smallest candidate id outside the vocabulary, or -1 if none is


@struct.dataclass
class RowsOut:
    """What the proposer absorbs from a program's W rows."""

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


def _target_rows(model: TargetModel, params: TargetParams, state: DecodeState, tokens: jax.Array
                 ) -> tuple[jax.Array, RowsOut, DecodeState]:
    """The target step on `tokens` int32 `[B, W]`: (logits float32 `[B, W, V]`, RowsOut, state)."""
    positions = state.length[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)
    logits, features, state = model.step(params, state, tokens)
    return logits, RowsOut(features, positions), state


@functools.lru_cache(maxsize=None)
def prefill_program(cfg: TargetConfig, options: StepOptions) -> AotFunction:
    """`program(params, loop, *, tokens, valid, restart, ends, ewma_init, sample)`
    `-> (loop, RowsOut, logits float32 [B, C, V], first)`.

    tokens int32 `[B, C]`: the chunk, of which the first `valid` int32 `[B]` of each row count (0 for rows
    not being prefilled: they commit nothing); restart bool `[B]`: rows that start a new sequence here (their
    length is reset to 0 first); ends bool `[B]`: rows whose prompt ends in this chunk; their seed becomes
    `first` (int32 `[B]`, the token after the prompt) and their EWMA `ewma_init` (float32 []). `loop` is
    donated.
    """
    model = TargetModel(cfg, options)

    def program(params: TargetParams, loop: LoopState, *, tokens: jax.Array, valid: jax.Array,
                restart: jax.Array, ends: jax.Array, ewma_init: jax.Array, sample: bool
                ) -> tuple[LoopState, RowsOut, jax.Array, jax.Array]:
        logits, rows, state = _target_rows(model, params, reset(loop.state, restart), tokens)
        key, sub = jax.random.split(loop.key) if sample else (loop.key, loop.key)
        first = pick_token(logits, jnp.maximum(valid - 1, 0), loop.temperature, sub, sample)
        loop = loop.replace(state=commit(state, valid), key=key, seeds=jnp.where(ends, first, loop.seeds),
                            ewma=jnp.where(ends, ewma_init, loop.ewma))
        return loop, rows, logits, first

    return AotFunction(program, donate_argnames=("loop",), static_argnames=("sample",),
                       compiler_options=options.policy.compiler_options)


@functools.lru_cache(maxsize=None)
def decode_program(cfg: TargetConfig, options: StepOptions) -> AotFunction:
    """`program(params, loop, *, drafts, widths, width, ewma_decay, sample) -> (loop, RowsOut, StepOutcome)`.

    drafts int32 `[B, >= width - 1]` (the first width − 1 are verified after each row's seed); widths int32
    `[B]` (rows that count, 1 for plain decoding). With `sample`, plain decoding's next token is drawn from
    row 0 at the loop's temperature. `loop` is donated; its seeds become the bonus tokens, its EWMA is
    updated with `ewma_decay`. The EWMA decay, not the whole WidthPolicy, is static: policies that differ
    only in how they choose widths share one compiled step.
    """
    model = TargetModel(cfg, options)

    def program(params: TargetParams, loop: LoopState, *, drafts: jax.Array, widths: jax.Array, width: int,
                ewma_decay: float, sample: bool) -> tuple[LoopState, RowsOut, StepOutcome]:
        candidates = drafts[:, : width - 1]
        logits, rows, state = _target_rows(model, params, loop.state,
                                           jnp.concatenate([loop.seeds[:, None], candidates], axis=1))
        outcome = outcome_of(logits, candidates, widths)
        key = loop.key
        if sample:
            key, sub = jax.random.split(key)
            outcome = outcome.replace(bonus=pick_token(logits, jnp.zeros_like(loop.seeds), loop.temperature, sub,
                                                       True))
        loop = loop.replace(state=commit(state, jnp.where(loop.active, outcome.matched + 1, 0)), key=key,
                            seeds=outcome.bonus, ewma=ewma_update(loop.ewma, outcome.matched, ewma_decay))
        return loop, rows, outcome

    return AotFunction(program, donate_argnames=("loop",), static_argnames=("width", "ewma_decay", "sample"),
                       compiler_options=options.policy.compiler_options)


@functools.lru_cache(maxsize=None)
def step_program(cfg: TargetConfig, options: StepOptions) -> AotFunction:
    """The bare target step `step(params, state, tokens) -> (logits, features, state)`, one executable per
    width, with the state donated: the building block the programs above wrap, for tests and benchmarks."""
    return AotFunction(TargetModel(cfg, options).step, donate_argnums=(1,),
                       compiler_options=options.policy.compiler_options)
