"""One optax training loop for both models: AdamW with warm-up and cosine decay, gradient clipping, a tqdm
bar, a held-out loss every `eval_every` steps, and optionally a wall-clock budget that fixes the step count.

The learning rate is a traced input of the compiled update (`optax.inject_hyperparams`), computed on the host
each step, so the step count can be decided after training started without compiling again: with
`Schedule.seconds`, the steps of the warm-up are timed and the run is cut to what fits the budget. The
warm-up's rates do not depend on the step count, so the schedule is the one a run of that many steps gets.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable

import jax
import numpy as np
import optax
from tqdm import tqdm

from dsparkjax.training.params import Arrays


@dataclasses.dataclass(frozen=True)
class Schedule:
    steps: int  # optimizer steps; with `seconds`, the most
    learning_rate: float  # peak
    seconds: float | None = None  # wall-clock budget of the loop (compiling included), or None
    warmup: int = 50
    weight_decay: float = 0.01
    clip: float = 1.0
    eval_every: int = 50
    final_fraction: float = 0.05  # the cosine decays to this fraction of the peak


def learning_rate(s: Schedule, step: int, total: int) -> float:
    """Linear warm-up from 0 over `s.warmup` steps, then cosine decay to `final_fraction` of the peak at
    `total`."""
    if step < s.warmup:
        return s.learning_rate * step / s.warmup
    progress = min(1.0, (step - s.warmup) / max(total - s.warmup, 1))
    floor = s.learning_rate * s.final_fraction
    return floor + (s.learning_rate - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclasses.dataclass
class History:
    """Losses along training: (step, value) pairs, and per-term components of the last training batch."""

    train: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    held_out: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    last_terms: dict[str, float] = dataclasses.field(default_factory=dict)
    steps: int = 0
    seconds: float = 0.0


def optimizer(s: Schedule) -> optax.GradientTransformation:
    adamw = optax.inject_hyperparams(optax.adamw)(learning_rate=0.0, weight_decay=s.weight_decay)
    return optax.chain(optax.clip_by_global_norm(s.clip), adamw)


def _set_rate(state: Any, rate: float) -> Any:
    clip_state, adamw_state = state
    adamw_state.hyperparams["learning_rate"] = np.float32(rate)
    return clip_state, adamw_state


def fitted_steps(s: Schedule, step: int, elapsed: float, per_step: float) -> int:
    """The step count that ends the loop within `s.seconds`, given `elapsed` seconds at `step` and `per_step`
    seconds per further step (10% kept for evaluations and the last read-back); at most `s.steps`."""
    assert s.seconds is not None
    return max(step + 1, min(s.steps, step + int(0.9 * (s.seconds - elapsed) / max(per_step, 1e-9))))


def train(params: Arrays, loss: Callable[[Arrays, Any], tuple[jax.Array, dict]], batches: Callable[[int], Any],
          held_out: Any, schedule: Schedule, desc: str) -> tuple[Arrays, History]:
    """Minimise `loss(params, batch)` (scalar, dict of named terms) over `batches(step)`.

    Returns the trained parameters and the loss history (`held_out` is one fixed batch).
    """
    opt = optimizer(schedule)

    @jax.jit
    def update(p: Arrays, state: Any, batch: Any) -> tuple[Arrays, Any, jax.Array, dict]:
        (value, terms), grads = jax.value_and_grad(loss, has_aux=True)(p, batch)
        updates, state = opt.update(grads, state, p)
        return optax.apply_updates(p, updates), state, value, terms

    evaluate = jax.jit(lambda p, batch: loss(p, batch)[0])
    state, history, start = opt.init(params), History(), time.perf_counter()
    total = schedule.steps
    # With a budget, time the warm-up's steps after the first (which compiles), then fix the step count.
    probe_from, probe_at = 1, max(2, min(schedule.warmup, total) // 2)
    bar = tqdm(total=total, desc=desc)
    step, probe_start = 0, 0.0
    while step < total:
        state = _set_rate(state, learning_rate(schedule, step, total))
        params, state, value, terms = update(params, state, batches(step))
        if schedule.seconds is not None and step in (probe_from, probe_at):
            jax.block_until_ready(params)
            now = time.perf_counter()
            if step == probe_from:
                probe_start = now
            else:
                total = fitted_steps(schedule, step, now - start, (now - probe_start) / (probe_at - probe_from))
                bar.total = total
        if step % 10 == 0 or step == total - 1:
            history.train.append((step, float(value)))
            bar.set_postfix(loss=f"{float(value):.3f}")
        if step % schedule.eval_every == 0 or step == total - 1:
            history.held_out.append((step, float(evaluate(params, held_out))))
        bar.update(1)
        step += 1
    bar.close()
    history.last_terms = {k: float(np.asarray(v)) for k, v in terms.items()}
    history.steps, history.seconds = total, time.perf_counter() - start
    return params, history
