"""One optax training loop for both models: AdamW with warm-up and cosine decay, gradient clipping, a tqdm
bar, and a held-out loss every `eval_every` steps."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import jax
import numpy as np
import optax
from tqdm import tqdm

from dsparkjax.training.params import Arrays


@dataclasses.dataclass(frozen=True)
class Schedule:
    steps: int
    learning_rate: float
    warmup: int = 50
    weight_decay: float = 0.01
    clip: float = 1.0
    eval_every: int = 50


@dataclasses.dataclass
class History:
    """Losses along training: (step, value) pairs, and per-term components of the last training batch."""

    train: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    held_out: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    last_terms: dict[str, float] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0


def optimizer(s: Schedule) -> optax.GradientTransformation:
    lr = optax.warmup_cosine_decay_schedule(0.0, s.learning_rate, s.warmup, max(s.steps, s.warmup + 1),
                                            s.learning_rate * 0.05)
    return optax.chain(optax.clip_by_global_norm(s.clip), optax.adamw(lr, weight_decay=s.weight_decay))


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
    bar = tqdm(range(schedule.steps), desc=desc)
    for step in bar:
        params, state, value, terms = update(params, state, batches(step))
        if step % 10 == 0 or step == schedule.steps - 1:
            history.train.append((step, float(value)))
            bar.set_postfix(loss=f"{float(value):.3f}")
        if step % schedule.eval_every == 0 or step == schedule.steps - 1:
            history.held_out.append((step, float(evaluate(params, held_out))))
    history.last_terms = {k: float(np.asarray(v)) for k, v in terms.items()}
    history.seconds = time.perf_counter() - start
    return params, history
