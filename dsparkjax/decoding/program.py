"""The device programs of decoding, each compiled once per width: a prefill chunk and a decode step.

Both take and return one `LoopState`, donated, so the new state lives in the old state's buffers and the
committed state never leaves the device between steps. Their arguments are keywords; the step width, the
EWMA decay, whether to sample and the verification rule are static (part of the jit key); everything else
is traced, so a width's program is traced and compiled once and reused by every step of every run with the
same shapes. Sampling parameters are per-row arrays of the loop state, so rows that sample differently (or
not at all) share one program.

- `prefill_program`: one chunk of prompt tokens through the target step, committed, and for the rows whose
  prompt ends in the chunk their first token (the seed of decoding). `forward` and `generate` both run it.
- `decode_program`: one decode step. It builds the rows `[seed, c_1 .. c_{w-1}]`, runs the target step,
  takes the target's token at every row (the greedy argmax, or when sampling the keyed sample of
  decoding/sampling.py), accepts the longest prefix of candidates equal to them (or, with the lossless
  rule, by decoding/verify.py), picks the bonus token, takes the emitted tokens' logprobs
  (decoding/logprobs.py) and commits seed + accepted rows of the active sequences. One program rather than a chain of small
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
from dsparkjax.decoding import sampling
from dsparkjax.decoding.logprobs import token_logprobs
from dsparkjax.decoding.sampling import RowSampling
from dsparkjax.decoding.verify import lossless_rule
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
    sampling: RowSampling  # per-row sampling parameters and sequence seeds (greedy rows: temperature 0)
    active: jax.Array  # bool [B], rows whose sequences are running: the others commit nothing


@struct.dataclass
class StepOutcome:
    """What the host reads back after a decode step (B sequences, width W)."""

    candidates: jax.Array  # int32 [B, W - 1], the verified candidates
    matched: jax.Array  # int32 [B], candidates accepted
    bonus: jax.Array  # int32 [B], the target's token after the accepted prefix: the next seed
    bad: jax.Array  # int32 [], the smallest candidate id outside the vocabulary, or -1 if none is
    logprobs: jax.Array | None = None  # float32 [B, W], the logprob of the token emitted at each of the first
    # matched + 1 rows (decode_program sets it: the rule functions below leave it to the program)


@struct.dataclass
class RowsOut:
    """What the proposer absorbs from a program's W rows."""

    features: jax.Array  # float32 [B, W, n_capture, D], the target's captured features of the W rows
    positions: jax.Array  # int32 [B, W], the rows' positions


def outcome_of(logits: jax.Array, candidates: jax.Array, widths: jax.Array) -> StepOutcome:
    """Greedy acceptance of candidates int32 `[B, W - 1]` against logits float32 `[B, W, V]`, counting the
    first `widths` int32 `[B]` rows of each sequence."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return outcome_of_tokens(greedy, candidates, widths, logits.shape[-1])


def outcome_of_tokens(tokens: jax.Array, candidates: jax.Array, widths: jax.Array, vocab: int) -> StepOutcome:
    """Acceptance of candidates int32 `[B, W - 1]` equal to the target's tokens int32 `[B, W]` (its argmax, or
    its keyed samples), counting the first `widths` int32 `[B]` rows; the bonus is the token after them."""
    matched = accepted_candidates(candidates, tokens, widths)
    bonus = jnp.take_along_axis(tokens, matched[:, None], axis=1)[:, 0]
    return StepOutcome(candidates, matched, bonus, first_bad(candidates, vocab))


def first_bad(candidates: jax.Array, vocab: int) -> jax.Array:
    """The smallest candidate id outside [0, vocab), or −1 if none is: int32 []."""
    bad = (candidates < 0) | (candidates >= vocab)
    never = jnp.iinfo(jnp.int32).max
    return jnp.where(jnp.any(bad), jnp.min(jnp.where(bad, candidates, never), initial=never), -1)


def lossless_outcome(logits: jax.Array, draft_logits: jax.Array, candidates: jax.Array, widths: jax.Array,
                     rows: RowSampling, positions: jax.Array) -> StepOutcome:
    """The lossless rule (decoding/verify.py) on a step's logits float32 `[B, W, V]`, the (warped) logits
    float32 `[B, >= W - 1, V]` the candidates int32 `[B, W - 1]` were drawn from (q is their softmax), and the positions int32 `[B, W]`
    each row predicts. Coins, residual and bonus draws use the sequences' keyed noise; a bonus after
    accepted candidates is the target's own keyed sample, as plain sampling draws it."""
    samples, warped = sampling.draw(logits, rows, positions, sampling.TARGET)
    k = candidates.shape[1]
    coins = sampling.uniform(rows, positions[:, :k], sampling.ACCEPT)
    q = jax.nn.softmax(draft_logits[:, :k], axis=-1)
    matched, rejected, final = lossless_rule(jax.nn.softmax(warped, axis=-1), q, candidates, widths, coins)
    position = jnp.take_along_axis(positions, matched[:, None], axis=1)
    redrawn = sampling.gumbel_argmax(jnp.log(final)[:, None], rows, position, sampling.RESIDUAL)[:, 0]
    bonus = jnp.where(rejected, redrawn, jnp.take_along_axis(samples, matched[:, None], axis=1)[:, 0])
    return StepOutcome(candidates, matched, bonus, first_bad(candidates, logits.shape[-1]))


def _target_rows(model: TargetModel, params: TargetParams, state: DecodeState, tokens: jax.Array
                 ) -> tuple[jax.Array, RowsOut, DecodeState]:
    """The target step on `tokens` int32 `[B, W]`: (logits float32 `[B, W, V]`, RowsOut, state)."""
    positions = state.length[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)
    logits, features, state = model.step(params, state, tokens)
    return logits, RowsOut(features, positions), state


@functools.lru_cache(maxsize=None)
def prefill_program(cfg: TargetConfig, options: StepOptions) -> AotFunction:
    """`program(params, loop, *, tokens, valid, restart, ends, ewma_init, sample)`
    `-> (loop, RowsOut, logits float32 [B, C, V], first, first_logprob)`.

    tokens int32 `[B, C]`: the chunk, of which the first `valid` int32 `[B]` of each row count (0 for rows
    not being prefilled: they commit nothing); restart bool `[B]`: rows that start a new sequence here (their
    length is reset to 0 first); ends bool `[B]`: rows whose prompt ends in this chunk; their seed becomes
    `first` (int32 `[B]`, the token after the prompt; `first_logprob` float32 `[B]` its logprob) and their
    EWMA `ewma_init` (float32 []). `loop` is donated.
    """
    model = TargetModel(cfg, options)

    def program(params: TargetParams, loop: LoopState, *, tokens: jax.Array, valid: jax.Array,
                restart: jax.Array, ends: jax.Array, ewma_init: jax.Array, sample: bool
                ) -> tuple[LoopState, RowsOut, jax.Array, jax.Array, jax.Array]:
        logits, rows, state = _target_rows(model, params, reset(loop.state, restart), tokens)
        last = jnp.maximum(valid - 1, 0)[:, None]
        picked = jnp.take_along_axis(logits, last[:, :, None], axis=1)[:, 0]
        if sample:  # the first token's position is the prompt's length
            position = jnp.take_along_axis(rows.positions, last, axis=1) + 1
            first = sampling.draw(picked[:, None], loop.sampling, position, sampling.TARGET)[0][:, 0]
        else:
            first = jnp.argmax(picked, axis=-1).astype(jnp.int32)
        loop = loop.replace(state=commit(state, valid), seeds=jnp.where(ends, first, loop.seeds),
                            ewma=jnp.where(ends, ewma_init, loop.ewma))
        return loop, rows, logits, first, token_logprobs(picked, first, options.policy)

    return AotFunction(program, donate_argnames=("loop",), static_argnames=("sample",),
                       compiler_options=options.policy.compiler_options, cache_name=f"prefill {cfg!r} {options!r}")


@functools.lru_cache(maxsize=None)
def decode_program(cfg: TargetConfig, options: StepOptions) -> AotFunction:
    """`program(params, loop, *, drafts, widths, width, ewma_decay, sample, draft_logits=None, lossless=False)`
    `-> (loop, RowsOut, StepOutcome)`.

    drafts int32 `[B, >= width - 1]` (the first width − 1 are verified after each row's seed); widths int32
    `[B]` (rows that count, 1 for plain decoding). Without `sample` the target's tokens are its argmax; with
    it, each row's keyed sample at the position it predicts (greedy rows: the argmax), and a candidate is
    accepted iff it equals that sample — or, with `lossless`, by the lossless rule against `draft_logits`
    float32 `[B, >= width - 1, V]` (what the candidates were drawn from). `loop` is donated; its seeds
    become the bonus tokens, its EWMA is updated with `ewma_decay`. The EWMA decay, not the whole
    WidthPolicy, is static: policies that differ only in how they choose widths share one compiled step.
    """
    model = TargetModel(cfg, options)

    def program(params: TargetParams, loop: LoopState, *, drafts: jax.Array, widths: jax.Array, width: int,
                ewma_decay: float, sample: bool, draft_logits: jax.Array | None = None, lossless: bool = False
                ) -> tuple[LoopState, RowsOut, StepOutcome]:
        candidates = drafts[:, : width - 1]
        logits, rows, state = _target_rows(model, params, loop.state,
                                           jnp.concatenate([loop.seeds[:, None], candidates], axis=1))
        positions = rows.positions + 1  # row r predicts the token at position length + r + 1
        if not sample:
            outcome = outcome_of(logits, candidates, widths)
        elif lossless:
            outcome = lossless_outcome(logits, draft_logits, candidates, widths, loop.sampling, positions)
        else:
            samples, _ = sampling.draw(logits, loop.sampling, positions, sampling.TARGET)
            outcome = outcome_of_tokens(samples, candidates, widths, logits.shape[-1])
        rows_emitted = jnp.arange(width) < outcome.matched[:, None]  # accepted candidates, then the bonus
        emitted = jnp.where(rows_emitted, jnp.pad(candidates, ((0, 0), (0, 1))), outcome.bonus[:, None])
        outcome = outcome.replace(logprobs=token_logprobs(logits, emitted, options.policy))
        loop = loop.replace(state=commit(state, jnp.where(loop.active, outcome.matched + 1, 0)),
                            seeds=outcome.bonus, ewma=ewma_update(loop.ewma, outcome.matched, ewma_decay))
        return loop, rows, outcome

    return AotFunction(program, donate_argnames=("loop",),
                       static_argnames=("width", "ewma_decay", "sample", "lossless"),
                       compiler_options=options.policy.compiler_options, cache_name=f"decode {cfg!r} {options!r}")


@functools.lru_cache(maxsize=None)
def step_program(cfg: TargetConfig, options: StepOptions) -> AotFunction:
    """The bare target step `step(params, state, tokens) -> (logits, features, state)`, one executable per
    width, with the state donated: the building block the programs above wrap, for tests and benchmarks."""
    return AotFunction(TargetModel(cfg, options).step, donate_argnums=(1,),
                       compiler_options=options.policy.compiler_options, cache_name=f"step {cfg!r} {options!r}")
