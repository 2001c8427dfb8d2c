"""Calibration of a DSpark drafter's confidence head against real acceptance, and width thresholds from it.

    python scripts/calibrate.py --png docs/calibration.png --json_out docs/calibration.json

Held-out prompts (`dsparkjax/training/corpus.py`) are continued greedily by the target; the drafter then
proposes at every position of those continuations, as speculative decoding would after accepting everything
before it, and each candidate is scored against the target's own next tokens. For block slot i the plot
shows, per confidence bin, how often candidate i matched given that candidates 1..i-1 did (what the
confidence head predicts), and the prefix survival ∏ c against how often candidates 1..i all matched (what
a width policy thresholds). The chosen threshold for verifying i candidates is the lowest predicted prefix
survival above which candidates 1..i all matched at least `--break_even` of the time.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging

from dsparkjax.embedded import embedded_pair
from dsparkjax.model.state import init_state
from dsparkjax.decoding.generate import generate
from dsparkjax.decoding.proposer import load_drafter
from dsparkjax.decoding.program import step_program
from dsparkjax.target_api import load_target
from dsparkjax.training.corpus import held_out_prompts

_TARGET = flags.DEFINE_string("target", None, "Target GGUF (default: the embedded target).")
_DRAFT = flags.DEFINE_string("draft", None, "Drafter GGUF (default: the embedded drafter).")
_PROMPTS = flags.DEFINE_integer("prompts", 32, "Held-out prompts.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 32, "Tokens per prompt.")
_NEW = flags.DEFINE_integer("new_tokens", 64, "Greedy tokens per prompt (the positions drafted from).")
_SEED = flags.DEFINE_integer("seed", 11, "Seed of the prompt positions.")
_BINS = flags.DEFINE_integer("bins", 10, "Confidence bins.")
_BREAK_EVEN = flags.DEFINE_float("break_even", 0.5, "Survival rate a verified candidate must reach.")
_PNG = flags.DEFINE_string("png", None, "Write the calibration plot here.")
_JSON = flags.DEFINE_string("json_out", None, "Write the numbers and thresholds here.")


def draft_everywhere(target, drafter, sequences: np.ndarray, first: int) -> tuple[np.ndarray, np.ndarray]:
    """Confidences float `[N, W]` and matches bool `[N, W]` of the drafter's proposals at every position
    s >= first of the sequences int `[B, T]` (seed = token s, context = positions < s)."""
    b, t = sequences.shape
    width = drafter.block_size
    step = step_program(target.config, target.options(drafter.capture_layers))
    _, features, _ = step(target.params, init_state(target.config, b, t, t, target.dtype), jnp.asarray(sequences))
    state = drafter.absorb(drafter.init_state(b, t), features, jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)))
    confidences, matches = [], []
    for s in range(first, t - width):
        seeds, pos = jnp.asarray(sequences[:, s], jnp.int32), jnp.full((b,), s, jnp.int32)
        candidates, conf = drafter.propose(state, seeds, pos)
        confidences.append(np.asarray(conf))
        matches.append(np.asarray(candidates) == sequences[:, s + 1 : s + 1 + width])
    return np.concatenate(confidences), np.concatenate(matches)


def reliability(predicted: np.ndarray, observed: np.ndarray, edges: np.ndarray) -> list[dict]:
    """Per bin of `predicted`: count, mean prediction and observed rate."""
    rows = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        inside = (predicted >= lo) & ((predicted < hi) | (hi == edges[-1]))
        if inside.any():
            rows.append(dict(lo=float(lo), hi=float(hi), count=int(inside.sum()),
                             predicted=float(predicted[inside].mean()), observed=float(observed[inside].mean())))
    return rows


def threshold(predicted: np.ndarray, observed: np.ndarray, break_even: float) -> float | None:
    """The lowest t such that samples predicted >= t survive at a rate >= break_even (None if none does)."""
    order = np.argsort(-predicted)
    rates = np.cumsum(observed[order]) / np.arange(1, len(order) + 1)
    good = np.nonzero(rates >= break_even)[0]
    return float(predicted[order][good[-1]]) if len(good) else None


def main(argv: list[str]) -> None:
    del argv
    logging.set_verbosity(logging.WARNING)
    target_path, draft_path = _TARGET.value, _DRAFT.value
    if target_path is None:
        target_path, embedded_draft = embedded_pair()
        draft_path = draft_path or embedded_draft
    target = load_target(target_path)
    drafter = load_drafter(draft_path, target)
    prompts = held_out_prompts(target.tokenizer, _PROMPTS.value, _PROMPT_LEN.value, _SEED.value)
    plain = generate(target, prompts, mode="ar", max_new_tokens=_NEW.value, stop_tokens=())
    sequences = np.array([p + r.token_ids for p, r in zip(prompts, plain)], np.int32)
    conf, match = draft_everywhere(target, drafter, sequences, _PROMPT_LEN.value)
    survived = np.cumprod(match, axis=1).astype(bool)
    predicted = np.cumprod(conf, axis=1)
    edges = np.linspace(0.0, 1.0, _BINS.value + 1)
    slots = []
    for i in range(drafter.block_size):
        reached = survived[:, i - 1] if i else np.ones(len(match), bool)
        slots.append(dict(
            slot=i + 1, samples=int(reached.sum()),
            acceptance=float(match[reached, i].mean()) if reached.any() else None,
            conditional=reliability(conf[reached, i], match[reached, i], edges),
            prefix=reliability(predicted[:, i], survived[:, i], edges),
            prefix_threshold=threshold(predicted[:, i], survived[:, i], _BREAK_EVEN.value)))
        ece = sum(r["count"] * abs(r["predicted"] - r["observed"]) for r in slots[-1]["conditional"])
        slots[-1]["conditional_ece"] = ece / max(slots[-1]["samples"], 1)
    report = dict(target=target_path, draft=draft_path, prompts=len(prompts), new_tokens=_NEW.value,
                  positions=int(len(match)), break_even=_BREAK_EVEN.value, slots=slots)
    text = json.dumps(report, indent=2)
    print(json.dumps([{k: s[k] for k in ("slot", "samples", "acceptance", "conditional_ece", "prefix_threshold")}
                      for s in slots], indent=1))
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            f.write(text + "\n")
    if _PNG.value:
        plot(slots, _PNG.value)


def plot(slots: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5))
    for s in slots:
        for ax, key in ((left, "conditional"), (right, "prefix")):
            rows = s[key]
            ax.plot([r["predicted"] for r in rows], [r["observed"] for r in rows], "o-", label=f"slot {s['slot']}")
        if s["prefix_threshold"] is not None:
            right.axvline(s["prefix_threshold"], color=right.lines[-1].get_color(), ls=":", alpha=0.6)
    left.set_title("candidate i accepted | 1..i-1 accepted, vs confidence c_i")
    right.set_title("candidates 1..i all accepted, vs c_1·…·c_i (dotted: thresholds)")
    for ax in (left, right):
        ax.plot([0, 1], [0, 1], "k--", lw=0.8)
        ax.set_xlabel("predicted")
        ax.set_ylabel("observed")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    app.run(main)
