"""Calibrating a DSpark drafter's confidences against real acceptance, and fitting the width policy's thresholds.

Prompts are continued greedily by the target; the drafter then proposes at every position of those
continuations, as speculative decoding would after accepting everything before it, and each candidate is
scored against the target's own next tokens. Candidate k is worth verifying where the prefix survival the
head predicts, s_k = c_1·…·c_k, goes with candidates 1..k all being accepted at least `break_even` of the
time. That rate, as a function of s_k, is fitted monotone (isotonic regression: calibration that keeps the
head's order), and the threshold t_k is the lowest s_k whose calibrated rate reaches `break_even`
(`decoding/width.py` offers candidate k while s_1..s_k all reach t_1..t_k).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from gguf import GGUFValueType

from dsparkjax.decoding.generate import generate
from dsparkjax.decoding.program import step_program
from dsparkjax.decoding.proposer import Drafter
from dsparkjax.decoding.width import SURVIVAL_THRESHOLDS_KEY, check_thresholds
from dsparkjax.ggufio.writer import copy_with_metadata
from dsparkjax.model.state import init_state
from dsparkjax.target_api import Target


# The held-out sample thresholds are fitted on, by scripts/calibrate.py and scripts/train_tiny.py alike.
PROMPTS, PROMPT_LEN, NEW_TOKENS, PROMPT_SEED = 32, 32, 64, 11
BREAK_EVEN = 0.5  # a verified candidate is then more likely kept than wasted


@dataclasses.dataclass(frozen=True)
class Proposals:
    """The drafter's proposals at N positions: confidences float32 `[N, K]` and whether each candidate equals
    the target's greedy token there, bool `[N, K]`."""

    confidences: np.ndarray
    matches: np.ndarray

    @property
    def predicted(self) -> np.ndarray:
        """Predicted prefix survival c_1·…·c_k, float `[N, K]`."""
        return np.cumprod(self.confidences, axis=1)

    @property
    def survived(self) -> np.ndarray:
        """Whether candidates 1..k all matched, bool `[N, K]`."""
        return np.cumprod(self.matches, axis=1).astype(bool)


def propose_everywhere(target: Target, drafter: Drafter, sequences: np.ndarray, first: int) -> Proposals:
    """The drafter's proposals at every position s >= first of `sequences` int `[B, T]` (seed = token s, context
    = positions < s), scored against the tokens that follow s in the sequences."""
    b, t = sequences.shape
    width = drafter.block_size
    step = step_program(target.config, target.options(drafter.capture_layers))
    _, features, _ = step(target.params, init_state(target.config, b, t, t, target.dtype, target.plan), jnp.asarray(sequences))
    # Greedy decoding's drafter (exact mode's, in XLA's order: `Decoder.drafts_invariant`).
    state = drafter.absorb(drafter.init_state(b, t), features, jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)),
                           invariant=False)
    confidences, matches = [], []
    for s in range(first, t - width):
        seeds, pos = jnp.asarray(sequences[:, s], jnp.int32), jnp.full((b,), s, jnp.int32)
        candidates, conf = drafter.propose(state, seeds, pos, invariant=False)
        confidences.append(np.asarray(conf))
        matches.append(np.asarray(candidates) == sequences[:, s + 1 : s + 1 + width])
    return Proposals(np.concatenate(confidences), np.concatenate(matches))


def proposals_on(target: Target, drafter: Drafter, prompts: list[list[int]], new_tokens: int) -> Proposals:
    """Greedy continuations of `prompts` (all of one length) by the target, and the drafter's proposals at every
    position after the prompts."""
    plain = generate(target, prompts, mode="ar", max_new_tokens=new_tokens, stop_tokens=())
    sequences = np.array([p + r.token_ids for p, r in zip(prompts, plain)], np.int32)
    return propose_everywhere(target, drafter, sequences, len(prompts[0]))


def isotonic(predicted: np.ndarray, observed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The non-decreasing least-squares fit of `observed` (0/1) against `predicted` (pool adjacent violators).

    Returns (predicted sorted ascending, the fitted rate at each), float `[N]` each.
    """
    order = np.argsort(predicted, kind="stable")
    means: list[float] = []
    sizes: list[int] = []
    for value in observed[order].astype(np.float64):
        means.append(value)
        sizes.append(1)
        while len(means) > 1 and means[-2] > means[-1]:
            size = sizes[-2] + sizes[-1]
            means[-2:] = [(means[-2] * sizes[-2] + means[-1] * sizes[-1]) / size]
            sizes[-2:] = [size]
    return predicted[order].astype(np.float64), np.repeat(means, sizes)


def threshold(predicted: np.ndarray, observed: np.ndarray, break_even: float) -> float | None:
    """The lowest prediction whose calibrated rate (`isotonic`) reaches `break_even`: 0.0 when every prediction
    does, None when none does."""
    xs, fit = isotonic(predicted, observed)
    good = np.nonzero(fit >= break_even)[0]
    if not len(good):
        return None
    return 0.0 if good[0] == 0 else float(xs[good[0]])


def fit_thresholds(proposals: Proposals, break_even: float) -> tuple[float, ...]:
    """Survival thresholds t_1..t_k for the width policy: one per candidate up to the first that never reaches
    `break_even` (the policy then never offers it)."""
    predicted, survived = proposals.predicted, proposals.survived
    thresholds: list[float] = []
    for k in range(predicted.shape[1]):
        t = threshold(predicted[:, k], survived[:, k], break_even)
        if t is None:
            break
        thresholds.append(t)
    return tuple(thresholds)


def reliability(predicted: np.ndarray, observed: np.ndarray, edges: np.ndarray) -> list[dict]:
    """Per bin of `predicted` (bin edges `edges`): count, mean prediction and observed rate."""
    rows = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        inside = (predicted >= lo) & ((predicted < hi) | (hi == edges[-1]))
        if inside.any():
            rows.append(dict(lo=float(lo), hi=float(hi), count=int(inside.sum()),
                             predicted=float(predicted[inside].mean()), observed=float(observed[inside].mean())))
    return rows


def auc(score: np.ndarray, label: np.ndarray) -> float | None:
    """How often a positive outranks a negative by `score` (ties count half); None without both classes.
    0.5 is a head that carries no information about `label`."""
    label = label.astype(bool)
    positives, negatives = int(label.sum()), int((~label).sum())
    if not positives or not negatives:
        return None
    _, inverse, counts = np.unique(score, return_inverse=True, return_counts=True)
    ranks = (np.cumsum(counts) - (counts - 1) / 2.0)[inverse]  # average ranks, 1-based
    return float((ranks[label].sum() - positives * (positives + 1) / 2.0) / (positives * negatives))


def write_thresholds(draft_path: str, thresholds: tuple[float, ...]) -> None:
    """Store fitted thresholds in the drafter GGUF (`SURVIVAL_THRESHOLDS_KEY`), its weights' bytes unchanged.

    A fit with no candidate worth verifying is stored as (1.0,): offer one only where the head is certain
    (GGUF has no empty arrays)."""
    values = list(check_thresholds(thresholds, "thresholds")) or [1.0]
    copy_with_metadata(draft_path, draft_path, {SURVIVAL_THRESHOLDS_KEY: (values, GGUFValueType.FLOAT32)})
