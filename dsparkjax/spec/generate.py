"""Batched greedy generation: plain (AR) or speculative with a proposer, exact or fast verification.

One loop serves both modes. Each step feeds `[seed, c_1 .. c_{w-1}]` per sequence through the target step,
takes the greedy argmax of every row, accepts the longest prefix of candidates that match it and commits
seed + accepted rows (rolling back the rest by not committing them), all in one device program
(`spec/decode.py`); then it hands the verified rows' features to the proposer and emits the accepted
candidates plus the bonus token (the target's own next token, which becomes the next seed). Plain decoding
is the same step with no candidates. Prefill runs the bare target step in chunks.

Verification modes (`exactness.md`):
- "exact": every step, decode and verify alike, runs the one program of width 1 + block_size, with padding
  rows where there are fewer candidates. XLA computes a row of a fixed-shape program independently of its
  index and of the other rows, so speculative output equals plain greedy output bit for bit; a width-q
  program would not (XLA changes reduction order with the row count).
- "fast": a program per width q (plain decoding uses q = 1); cheaper, and may differ on near-tied logits.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
from typing import Callable, Literal, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dsparkjax.aot import AotFunction
from dsparkjax.errors import DsparkError, TokenIdError
from dsparkjax.model.state import commit, init_state
from dsparkjax.spec.decode import StepOutcome, decode_program, pick_token
from dsparkjax.spec.proposer import Proposer
from dsparkjax.spec.width import WidthPolicy
from dsparkjax.target_api import Target, compiled_step

DEFAULT_BLOCK = 5  # DSpark proposes 5 candidates; exact mode without a drafter uses the same program width
OnToken = Callable[[int, int], "bool | None"]  # (sequence index, token id) -> False to cancel the sequence


@dataclasses.dataclass
class Result:
    """One sequence's generation."""

    token_ids: list[int]
    matched: int = 0  # candidates accepted
    offered: int = 0  # candidates verified (width − 1 per step)
    steps: int = 0  # target steps after prefill
    tok_per_s: float = 0.0
    stop_reason: str = ""  # "eos" (a stop token), "length" or "cancelled"

    @property
    def mean_accepted(self) -> float:
        """Tokens committed per target step (accepted candidates + the bonus token)."""
        return (self.matched + self.steps) / self.steps if self.steps else 0.0


@functools.lru_cache(maxsize=None)
def _width_fn(policy: WidthPolicy) -> AotFunction:
    return AotFunction(policy.choose)


@functools.partial(AotFunction, static_argnums=(1,))
def _seed_padding(seeds: jax.Array, block: int) -> jax.Array:
    """Plain decoding's stand-in for a proposal: seeds int32 `[B]` repeated to `[B, block]`, never verified.

    Exact mode's padding rows cost what real rows do; repeating each sequence's seed routes them like real
    tokens. (One constant token for every padding row sent all 5 x B of them to the same experts: plain exact
    decoding took 4.83 instead of about 3.6 ms per step on the benchmark model, generation run 13.)"""
    return jnp.broadcast_to(seeds[:, None], (seeds.shape[0], block))


_pick = jax.jit(pick_token, static_argnames=("sample",))  # prefill's first token of each prompt


class _Sequence:
    """Host-side bookkeeping of one sequence: emitted tokens, counters, stopping."""

    def __init__(self, index: int, max_new: int, stop_tokens: frozenset[int], on_token: OnToken | None):
        self.index, self.max_new, self.stop_tokens, self.on_token = index, max_new, stop_tokens, on_token
        self.result = Result(token_ids=[])
        self.done = False
        self.finished_at = 0.0

    def emit(self, tokens: Sequence[int]) -> int:
        """Append tokens in order until a stop condition; returns how many were emitted."""
        count = 0
        for token in tokens:
            if self.done:
                break
            self.result.token_ids.append(int(token))
            count += 1
            if self.on_token is not None and self.on_token(self.index, int(token)) is False:
                self._stop("cancelled")
            elif token in self.stop_tokens:
                self._stop("eos")
            elif len(self.result.token_ids) >= self.max_new:
                self._stop("length")
        return count

    def _stop(self, reason: str) -> None:
        self.done, self.result.stop_reason, self.finished_at = True, reason, time.perf_counter()


def _policy(width: int | str | WidthPolicy, proposer: Proposer | None, max_q: int) -> WidthPolicy:
    if isinstance(width, WidthPolicy):
        return dataclasses.replace(width, max_q=min(width.max_q, max_q))
    if isinstance(width, int) or (isinstance(width, str) and width.isdigit()):
        q = int(width)
        if not 1 <= q <= max_q:
            raise DsparkError(f"width must be 'adaptive' or an integer in [1, {max_q}], got {width}")
        return WidthPolicy("fixed", fixed_q=q, max_q=max_q)
    if width != "adaptive":
        raise DsparkError(f"width must be 'adaptive' or an integer in [1, {max_q}], got {width!r}")
    kind = "confidence" if proposer is not None and proposer.has_confidence else "ewma"
    return WidthPolicy(kind, max_q=max_q)


def generate(
    target: Target,
    prompts: Sequence[Sequence[int]],
    *,
    drafter: Proposer | None = None,
    max_new_tokens: int = 64,
    verify: Literal["exact", "fast"] = "exact",
    width: int | str | WidthPolicy = "adaptive",
    on_token: OnToken | None = None,
    mode: Literal["spec", "ar"] | None = None,
    temperature: float = 0.0,
    prefill_chunk: int = 16,
    seed: int = 0,
    stop_tokens: Sequence[int] | None = None,
    progress: bool = False,
) -> list[Result]:
    """Generate up to `max_new_tokens` after each prompt (token ids), batched, greedy.

    Args:
      drafter: a Proposer (e.g. `load_drafter(...)`); with one, `mode` defaults to "spec", else "ar". An AR
        run given a drafter still captures its features, so AR and spec run identical target programs.
      verify: "exact" (one program width for every step; spec output == AR output token for token) or "fast".
      width: "adaptive" (confidence policy, or EWMA without a confidence head), a fixed q in 1..block+1, or
        a WidthPolicy with its own thresholds.
      on_token: called with (sequence index, token) for every emitted token; returning False cancels it.
      temperature: > 0 samples; speculative decoding is greedy-only, so this falls back to plain decoding.
      stop_tokens: tokens that end a sequence (emitted, then stop); default: the target's eos id.
    Returns:
      one Result per prompt, in order.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise DsparkError("every prompt needs at least one token")
    if verify not in ("exact", "fast"):
        raise DsparkError(f"verify must be 'exact' or 'fast', got {verify!r}")
    if max_new_tokens < 1:
        raise DsparkError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    mode = mode or ("spec" if drafter is not None else "ar")
    if mode == "spec" and drafter is None:
        raise DsparkError("mode 'spec' needs a drafter")
    if temperature > 0 and mode == "spec":
        print(f"notice: temperature {temperature} > 0: speculative decoding is greedy-only; "
              "falling back to plain (AR) decoding", file=sys.stderr)
        mode = "ar"
    prompt_arrays = [np.asarray(p, dtype=np.int64) for p in prompts]
    for i, p in enumerate(prompt_arrays):
        target.check_tokens(p, f"prompt {i}")

    cfg = target.config
    batch = len(prompt_arrays)
    proposer = drafter if mode == "spec" else None
    block = drafter.block_size if drafter is not None else DEFAULT_BLOCK
    exact_width = block + 1
    policy = _policy(width, proposer, exact_width)
    max_step = max(prefill_chunk, exact_width)
    lengths = np.array([len(p) for p in prompt_arrays])
    if int(lengths.max()) + max_new_tokens > cfg.context_length:
        raise DsparkError(f"prompt of {int(lengths.max())} tokens + {max_new_tokens} new tokens exceeds the "
                          f"context length {cfg.context_length} of {target.path}")
    # State capacity, rounded up to a power of two so that runs of similar sizes reuse compiled steps.
    max_len = 1 << max(6, (int(lengths.max()) + max_new_tokens + max_step).bit_length())
    # The target's own step options (its HC backend included): the program forward() and the drafter use.
    options = target.options(drafter.capture_layers if drafter is not None else ())
    step, decode = compiled_step(cfg, options), decode_program(cfg, options)
    state = init_state(cfg, batch, max_len, max_step, target.dtype)
    proposer_state = proposer.init_state(batch, max_step) if proposer is not None else None
    # The decode widths this run dispatches: exact mode's one; plain fast decoding's width 1; fast speculative
    # decoding's 1..block+1, one per proposer width. Every program it can need is compiled before the clock.
    if verify == "exact":
        widths = (exact_width,)
    elif proposer is None:
        widths = (1,)
    else:
        widths = tuple(range(1, exact_width + 1))
    sample, temperature = temperature > 0, jnp.float32(max(temperature, 1e-6))
    key = jax.random.PRNGKey(seed)
    step.compile(target.params, state, jax.ShapeDtypeStruct((batch, prefill_chunk), jnp.int32))
    ints = jax.ShapeDtypeStruct((batch,), jnp.int32)
    for w in widths:
        decode.compile(target.params, state, ints, jax.ShapeDtypeStruct((batch, block), jnp.int32), ints,
                       jax.ShapeDtypeStruct((batch,), jnp.bool_), jax.ShapeDtypeStruct((batch,), jnp.float32),
                       temperature, key, w, policy.ewma_decay, sample)
    if proposer is not None:
        proposer.precompile(proposer_state, tuple({prefill_chunk, *widths}))
    else:
        _seed_padding.compile(ints, block)
    _width_fn(policy).compile(jax.ShapeDtypeStruct((batch, block), jnp.float32),
                              jax.ShapeDtypeStruct((batch,), jnp.float32))
    stops = frozenset(stop_tokens if stop_tokens is not None else (cfg.eos_token_id,))
    sequences = [_Sequence(i, max_new_tokens, stops, on_token) for i in range(batch)]

    # Prefill in chunks through the same step; the argmax after each prompt's last token is its first token.
    committed = np.zeros(batch, np.int64)
    first = np.zeros(batch, np.int32)
    while (committed < lengths).any():
        rows = np.zeros((batch, prefill_chunk), np.int32)
        valid = np.clip(lengths - committed, 0, prefill_chunk)
        for b, p in enumerate(prompt_arrays):
            rows[b, : valid[b]] = p[committed[b] : committed[b] + valid[b]]
        positions = state.length[:, None] + jnp.arange(prefill_chunk, dtype=jnp.int32)
        logits, features, state = step(target.params, state, jnp.asarray(rows))
        if proposer is not None:
            proposer_state = proposer.absorb(proposer_state, features, positions)
        state = commit(state, jnp.asarray(valid, jnp.int32))
        ends = (valid > 0) & (committed + valid == lengths)
        key, sub = jax.random.split(key)
        picked = np.asarray(_pick(logits, jnp.asarray(np.maximum(valid - 1, 0), jnp.int32), temperature, sub,
                                  sample))
        first[ends] = picked[ends]
        committed += valid
    seeds = jnp.asarray(first)
    ewma = jnp.full((batch,), policy.ewma_init, jnp.float32)
    plain_widths = jnp.ones((batch,), jnp.int32)  # plain decoding verifies nothing
    running = np.ones(batch, bool)
    active = jnp.asarray(running)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=batch * max_new_tokens, desc=f"{mode} decode", unit="tok")
    start = time.perf_counter()
    for s in sequences:
        emitted = s.emit([first[s.index]])
        if bar is not None:
            bar.update(emitted)

    def dispatch() -> tuple[StepOutcome, jax.Array]:
        """Queue one step on the device; returns its outcome and widths (device arrays). Only fast speculative
        decoding syncs here (its program width is the proposer's widths, read on the host)."""
        nonlocal state, proposer_state, seeds, ewma, key
        if proposer is not None:
            drafts, confidences = proposer.propose(proposer_state, seeds, state.length)
            widths = _width_fn(policy)(confidences, ewma)
            program = exact_width if verify == "exact" else int(np.asarray(widths)[running].max())
        else:
            drafts, widths = _seed_padding(seeds, block), plain_widths
            program = exact_width if verify == "exact" else 1
        out = decode(target.params, state, seeds, drafts, widths, active, ewma, temperature, key, program,
                     policy.ewma_decay, sample)
        state, seeds, ewma, key = out.state, out.outcome.bonus, out.ewma, out.key
        if proposer is not None:
            proposer_state = proposer.absorb(proposer_state, out.features, out.positions)
        return out.outcome, widths

    def process(outputs: tuple[StepOutcome, jax.Array]) -> None:
        """Read one step's outcome back and emit its tokens."""
        outcome, host_widths = jax.device_get(outputs)
        if outcome.bad != -1:  # hash layers index tid2eid by token: an out-of-range draft must never be emitted
            raise TokenIdError(f"the proposer drafted token id {int(outcome.bad)}, outside the vocabulary and hash "
                               f"tables [0, {cfg.vocab_size}) of {target.path}")
        for s in sequences:
            if s.done:
                continue
            b = s.index
            m = int(outcome.matched[b])
            s.result.steps += 1
            s.result.matched += m
            s.result.offered += int(host_widths[b]) - 1
            emitted = s.emit([*outcome.candidates[b, :m], outcome.bonus[b]])
            if bar is not None:
                bar.update(emitted)

    # Step k+1 is queued before step k is read back, so the device never waits for the host; a sequence that
    # ended at step k gets one more (ignored) step. Only fast speculative decoding reads each step back first:
    # its next program width is the proposer's widths over the sequences still running. (Plain decoding's
    # program is fixed, so its fast mode queues ahead as exact mode does.)
    reads_widths = verify == "fast" and proposer is not None
    pending = None
    while not all(s.done for s in sequences):
        still = np.array([not s.done for s in sequences])
        if (still != running).any():  # a new mask only when a sequence ended: the same buffer otherwise
            running, active = still, jnp.asarray(still)
        queued = dispatch()
        if reads_widths:
            process(queued)
            continue
        if pending is not None:
            process(pending)
        pending = queued
    if pending is not None and not all(s.done for s in sequences):
        process(pending)
    if bar is not None:
        bar.close()
    for s in sequences:
        elapsed = max(s.finished_at - start, 1e-9)
        s.result.tok_per_s = len(s.result.token_ids) / elapsed
    return [s.result for s in sequences]
