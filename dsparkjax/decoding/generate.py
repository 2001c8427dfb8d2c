"""Batched generation: plain (AR) or speculative with a proposer, exact, fast or lossless verification,
greedy or sampled.

A thin driver of the `Engine` (engine.py): it checks the arguments, builds the `Decoder` for the prompts,
admits every prompt, and steps until each sequence stops, emitting tokens through `on_token`. The decoding
itself (prefill, propose, verify, accept, commit) is in decoder.py and program.py.
"""

from __future__ import annotations

import dataclasses
import numbers
import time
from typing import Callable, Literal, Sequence

from dsparkjax import validation
from dsparkjax.decoding.decoder import Decoder
from dsparkjax.decoding.engine import Emitted, Engine
from dsparkjax.decoding.proposer import Proposer
from dsparkjax.decoding.sampling import SamplingParams, check_seed
from dsparkjax.decoding.width import WidthPolicy
from dsparkjax.errors import ArgumentError
from dsparkjax.target_api import Target

OnToken = Callable[[int, int], "bool | None"]  # (sequence index, token id) -> False to cancel the sequence


@dataclasses.dataclass
class Result:
    """One sequence's generation."""

    token_ids: list[int]
    logprobs: list[float] = dataclasses.field(default_factory=list)  # each token's, before temperature and filters
    matched: int = 0  # candidates accepted
    offered: int = 0  # candidates verified (width − 1 per step)
    steps: int = 0  # target steps after prefill
    tok_per_s: float = 0.0
    stop_reason: str = ""  # "eos" (a stop token), "length" or "cancelled"

    @property
    def mean_accepted(self) -> float:
        """Tokens committed per target step (accepted candidates + the bonus token)."""
        return (self.matched + self.steps) / self.steps if self.steps else 0.0


class _Sequence:
    """Host-side bookkeeping of one sequence: emitted tokens, counters, stopping."""

    def __init__(self, index: int, max_new: int, stop_tokens: frozenset[int], on_token: OnToken | None):
        self.index, self.max_new, self.stop_tokens, self.on_token = index, max_new, stop_tokens, on_token
        self.result = Result(token_ids=[])
        self.done = False
        self.finished_at = 0.0

    def take(self, out: Emitted) -> int:
        """Count a step's outcome and emit its tokens; returns how many were emitted."""
        self.result.steps += out.steps
        self.result.matched += out.matched
        self.result.offered += out.offered
        return self.emit(out.tokens, out.logprobs)

    def emit(self, tokens: Sequence[int], logprobs: Sequence[float]) -> int:
        """Append tokens (and their logprobs) in order until a stop condition; returns how many were emitted."""
        count = 0
        for token, logprob in zip(tokens, logprobs):
            if self.done:
                break
            self.result.token_ids.append(int(token))
            self.result.logprobs.append(logprob)
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


def generate(
    target: Target,
    prompts: Sequence[Sequence[int]],
    *,
    drafter: Proposer | None = None,
    max_new_tokens: int = 64,
    verify: Literal["exact", "fast", "lossless"] = "exact",
    width: int | str | WidthPolicy = "adaptive",
    on_token: OnToken | None = None,
    mode: Literal["spec", "ar"] | None = None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    prefill_chunk: int = 16,
    seed: int | Sequence[int] = 0,
    stop_tokens: Sequence[int] | None = None,
    progress: bool = False,
) -> list[Result]:
    """Generate up to `max_new_tokens` after each prompt (token ids), batched, greedy or sampled.

    Args:
      drafter: a Proposer (e.g. `load_drafter(...)`); with one, `mode` defaults to "spec", else "ar". An AR
        run given a drafter still captures its features, so AR and spec run identical target programs.
      verify: "exact" (one program width for every step; spec output == AR output token for token, greedy
        or sampled with the same seeds), "fast" (a program per width) or "lossless" (when sampling: the
        rejection-sampling rule, output with the target's distribution but not AR's tokens; greedy otherwise).
      width: "adaptive" (confidence policy, or EWMA without a confidence head), a fixed q in 1..block+1, or
        a WidthPolicy with its own thresholds.
      on_token: called with (sequence index, token) for every emitted token; returning False cancels it.
      temperature, top_k, top_p, min_p: the sampling parameters (`SamplingParams`; temperature 0: greedy).
      seed: a sequence's seed, or an int s giving sequence i the seed s + i; its sampled tokens depend on
        its seed, prompt and parameters, not on the batch.
      stop_tokens: tokens that end a sequence (emitted, then stop); default: the target's eos id.
    Returns:
      one Result per prompt, in order.
    Raises:
      ArgumentError naming the argument for a bad one, before anything runs.
    """
    arrays, mode, max_new_tokens, prefill_chunk, stops = validation.generate_arguments(
        target, prompts, drafter, max_new_tokens, verify, mode, temperature, prefill_chunk, on_token, stop_tokens)
    params = SamplingParams(temperature, top_k, top_p, min_p)
    seeds = _sequence_seeds(seed, len(arrays))
    decoder = Decoder.for_prompts(target, drafter, speculative=mode == "spec", lengths=[len(a) for a in arrays],
                                  max_new_tokens=max_new_tokens, verify=verify, width=width,
                                  prefill_chunk=prefill_chunk, sample=not params.greedy)
    engine = Engine(decoder)
    sequences = {engine.admit(a, params, s): _Sequence(i, max_new_tokens, stops, on_token)
                 for i, (a, s) in enumerate(zip(arrays, seeds))}
    results = [s.result for s in sequences.values()]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(arrays) * max_new_tokens, desc=f"{mode} decode", unit="tok")
    emitted = engine.prefill()
    start = time.perf_counter()
    finished = []
    while sequences:
        for row, out in emitted.items():
            count = sequences[row].take(out)
            if bar is not None:
                bar.update(count)
            if sequences[row].done:
                engine.release(row)
                finished.append(sequences.pop(row))
        emitted = engine.step() if sequences else {}
    if bar is not None:
        bar.close()
    for s in finished:
        s.result.tok_per_s = len(s.result.token_ids) / max(s.finished_at - start, 1e-9)
    return results


def _sequence_seeds(seed: int | Sequence[int], count: int) -> list[int]:
    """One seed per sequence: `seed` + i for an int, else the given ones (as many as prompts)."""
    if isinstance(seed, numbers.Integral) and not isinstance(seed, bool):
        return [check_seed(int(seed) + i, "seed") for i in range(count)]
    if isinstance(seed, (str, bytes)) or not isinstance(seed, Sequence) or len(seed) != count:
        raise ArgumentError(f"seed must be an integer or a list of one per prompt ({count}), got {seed!r}")
    return [check_seed(s, f"seed {i}") for i, s in enumerate(seed)]
