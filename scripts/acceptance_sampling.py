"""What speculation buys when sampling: plain vs speculative sampled decoding of held-out prompts, in exact
and lossless verification, and the drafter's confidence against real acceptance at each temperature.

    python scripts/acceptance_sampling.py                        # the embedded pair, JSON to stdout
    python scripts/acceptance_sampling.py --json_out docs/acceptance_sampling.json

For each temperature (`--temperatures`), plain sampling of `--prompts` held-out prompts (the standard library's
held-out `.py` files, or those under `--prompt_dir`, `dsparkjax/training/corpus.py`) is the baseline: target
steps for `--max_new_tokens` tokens per prompt (no stop token). Each verify mode and width (`--widths`) then
reports candidates matched/offered, target steps, the factor plain steps / speculative steps, and for exact mode
whether the output equals plain sampling's (it must). Runs at the widest fixed width verify every candidate, so
they also give, per block slot i and confidence bin, how often candidate i was accepted given that candidates
1..i-1 were (the calibration the width policy thresholds; `scripts/calibrate.py` does it greedily), and the width
policy refitted on them: the survival thresholds `calibration.fit_thresholds` gives with its break-even (what
`scripts/calibrate.py` stores in the drafter, fitted there on greedy continuations), then a run of the adaptive
policy with those thresholds (width "fitted"; fitted and run on the same prompts).
`--markdown_out` writes the tables of docs/sampling.md from the same results.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from absl import flags, logging

from held_out import HeldOutFlags, print_json  # scripts/ is on sys.path
from dsparkjax.cli_inputs import run_main
from dsparkjax.decoding.decoder import Decoder
from dsparkjax.decoding.engine import Engine
from dsparkjax.decoding.generate import generate
from dsparkjax.decoding.proposer import Proposer
from dsparkjax.decoding.sampling import RowSampling, SamplingParams
from dsparkjax.decoding.width import WidthPolicy
from dsparkjax.training import calibration as fit

_HELD_OUT = HeldOutFlags.define(seed_help="Seed of the prompt positions; prompt i samples with seed + i.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "Tokens generated per prompt.")
_TEMPERATURES = flags.DEFINE_list("temperatures", ["0.7", "1.0"], "Sampling temperatures.")
_MODES = flags.DEFINE_list("modes", ["exact", "lossless"], "Verify modes.")
_WIDTHS = flags.DEFINE_list("widths", ["adaptive", "6"], "Verify widths: 'adaptive' or q in 2..6.")
_BINS = flags.DEFINE_integer("bins", 5, "Confidence bins of the calibration.")
_JSON = flags.DEFINE_string("json_out", None, "Also write the results here.")
_MARKDOWN = flags.DEFINE_string("markdown_out", None, "Write the results as docs/sampling.md's tables here.")


class Recorder:
    """A Proposer that passes every call to `inner` and keeps each sampled proposal's confidences, in order."""

    def __init__(self, inner: Proposer):
        self.inner, self.confidences = inner, []
        self.block_size, self.capture_layers = inner.block_size, inner.capture_layers
        self.has_confidence = inner.has_confidence

    def __getattr__(self, name: str) -> Any:  # init_state, precompile, absorb, propose
        return getattr(self.inner, name)

    def propose_sampled(self, state: Any, seeds: jax.Array, seed_pos: jax.Array, rows: RowSampling, purpose: int,
                        with_logits: bool, *, invariant: bool) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        out = self.inner.propose_sampled(state, seeds, seed_pos, rows, purpose, with_logits, invariant=invariant)
        self.confidences.append(out[1])
        return out


def run_recorded(target, drafter, prompts: list[list[int]], params: SamplingParams, verify: str, width: int
                 ) -> tuple[list[list[int]], list[tuple[np.ndarray, int]]]:
    """Speculative sampling driven step by step: (tokens per prompt, [(confidences [K], matched)] per
    sequence-step). A speculative engine reads each step back before queueing the next (its width is read
    back), so the outcome read at the k-th `step()` call is the k-th proposal's."""
    recorder = Recorder(drafter)
    decoder = Decoder.for_prompts(target, recorder, speculative=True, lengths=[len(p) for p in prompts],
                                  max_new_tokens=_MAX_NEW.value, verify=verify, width=width, prefill_chunk=16,
                                  sample=True)
    engine = Engine(decoder)
    rows = {engine.admit(p, params, _HELD_OUT.seed.value + i): i for i, p in enumerate(prompts)}
    tokens = [[] for _ in prompts]
    steps: list[tuple[np.ndarray, int]] = []
    emitted, calls = engine.prefill(), 0
    while rows:
        for row, out in emitted.items():
            tokens[rows[row]].extend(out.tokens)
            if out.steps:
                steps.append((np.asarray(recorder.confidences[calls - 1])[row], out.matched))
            if len(tokens[rows[row]]) >= _MAX_NEW.value:
                engine.release(row)
                del rows[row]
        emitted, calls = (engine.step(), calls + 1) if rows else ({}, calls)
    return [t[: _MAX_NEW.value] for t in tokens], steps


def calibration(steps: list[tuple[np.ndarray, int]], bins: int) -> list[dict]:
    """Per block slot i: how often candidate i was accepted given 1..i-1 were, overall and per confidence bin."""
    conf = np.stack([c for c, _ in steps])
    matched = np.array([m for _, m in steps])
    edges = np.linspace(0.0, 1.0, bins + 1)
    slots = []
    for i in range(conf.shape[1]):
        reached, accepted = matched >= i, matched > i
        per_bin = []
        for lo, hi in zip(edges[:-1], edges[1:]):
            inside = reached & (conf[:, i] >= lo) & ((conf[:, i] < hi) | (hi == 1.0))
            if inside.any():
                per_bin.append(dict(lo=round(float(lo), 2), hi=round(float(hi), 2), count=int(inside.sum()),
                                    confidence=round(float(conf[inside, i].mean()), 3),
                                    accepted=round(float(accepted[inside].mean()), 3)))
        slots.append(dict(slot=i + 1, reached=int(reached.sum()),
                          acceptance=round(float(accepted[reached].mean()), 3) if reached.any() else None,
                          bins=per_bin))
    return slots


def refit(steps: list[tuple[np.ndarray, int]]) -> tuple[float, ...]:
    """Survival thresholds fitted, with `calibrate.py`'s break-even, on sampled steps that verified every
    candidate: candidates 1..k all survived iff more than k - 1 were matched."""
    conf = np.stack([c for c, _ in steps])
    matched = np.array([m for _, m in steps])
    matches = np.arange(conf.shape[1])[None, :] < matched[:, None]
    return fit.fit_thresholds(fit.Proposals(conf, matches), fit.BREAK_EVEN)


def main(argv: list[str]) -> None:
    del argv
    logging.set_verbosity(logging.WARNING)
    pair, prompts = _HELD_OUT.load()
    target, drafter = pair.target, pair.drafter
    report: dict[str, Any] = dict(_HELD_OUT.header(pair, prompts), max_new_tokens=_MAX_NEW.value,
                                  stored_thresholds=list(drafter.width_thresholds or ()),
                                  break_even=fit.BREAK_EVEN, temperatures={})
    widest = drafter.block_size + 1
    for temperature in map(float, _TEMPERATURES.value):
        params = SamplingParams(temperature)
        seeds = [_HELD_OUT.seed.value + i for i in range(len(prompts))]
        plain = generate(target, prompts, drafter=drafter, mode="ar", max_new_tokens=_MAX_NEW.value,
                         stop_tokens=(), temperature=temperature, seed=seeds)
        plain_steps = sum(r.steps for r in plain)
        entry: dict[str, Any] = dict(plain_steps=plain_steps, modes={})

        def measure(verify: str, width: str | WidthPolicy) -> dict[str, Any]:
            spec = generate(target, prompts, drafter=drafter, mode="spec", verify=verify, width=width,
                            max_new_tokens=_MAX_NEW.value, stop_tokens=(), temperature=temperature, seed=seeds)
            matched, offered, steps = (sum(getattr(r, k) for r in spec) for k in ("matched", "offered", "steps"))
            row = dict(matched=matched, offered=offered, matched_per_offered=round(matched / max(offered, 1), 4),
                       steps=steps, step_reduction=round(plain_steps / max(steps, 1), 3),
                       tokens_per_step=round(sum(len(r.token_ids) for r in spec) / max(steps, 1), 3))
            if verify == "exact":
                row["identical_to_plain"] = all(s.token_ids == p.token_ids for s, p in zip(spec, plain))
            if width == str(widest):
                tokens, records = run_recorded(target, drafter, prompts, params, verify, widest)
                if verify == "exact":
                    assert tokens == [s.token_ids for s in spec]
                row["calibration"] = calibration(records, _BINS.value)
                row["fitted_thresholds"] = [round(t, 4) for t in refit(records)]
            return row

        for verify in _MODES.value:
            rows = entry["modes"][verify] = {width: measure(verify, width) for width in _WIDTHS.value}
            if str(widest) in rows:
                policy = WidthPolicy("confidence", max_q=widest, thresholds=rows[str(widest)]["fitted_thresholds"])
                rows["fitted"] = measure(verify, policy)
        report["temperatures"][str(temperature)] = entry
    print_json(report, _JSON.value)
    if _MARKDOWN.value:
        with open(_MARKDOWN.value, "w") as f:
            f.write(markdown(report))


def markdown(report: dict[str, Any]) -> str:
    """docs/sampling.md's tables: steps against plain sampling per temperature, mode and width; the width policy's
    thresholds, stored and refitted; acceptance per slot and confidence bin at the widest width."""
    steps = ["| T | mode | width | matched / offered | target steps | fewer steps than plain | output == plain |",
             "|---|---|---|---|---|---|---|"]
    fits = ["| T | mode | survival thresholds t_1.. |", "|---|---|---|",
            f"| (any) | stored (greedy, `scripts/calibrate.py`) | {_numbers(report['stored_thresholds'])} |"]
    bins = ["| T | mode | slot | reached | accepted | accepted (count) per mean confidence |",
            "|---|---|---|---|---|---|"]
    for temperature, entry in report["temperatures"].items():
        for verify, rows in entry["modes"].items():
            for width, row in rows.items():
                same = {True: "yes", False: "NO"}.get(row.get("identical_to_plain"), "(another sample)")
                steps.append(f"| {temperature} | {verify} | {width} | {row['matched']} / {row['offered']} "
                             f"({row['matched_per_offered']:.2f}) | {row['steps']} (plain: {entry['plain_steps']}) "
                             f"| {row['step_reduction']:.2f}x | {same} |")
                if "fitted_thresholds" in row:
                    fits.append(f"| {temperature} | {verify} | {_numbers(row['fitted_thresholds'])} |")
                for slot in row.get("calibration", []):
                    cells = ", ".join(f"{b['confidence']:.2f}: {b['accepted']:.2f} ({b['count']})"
                                      for b in slot["bins"])
                    bins.append(f"| {temperature} | {verify} | {slot['slot']} | {slot['reached']} | "
                                f"{'-' if slot['acceptance'] is None else slot['acceptance']} | {cells} |")
    return "\n\n".join("\n".join(table) for table in (steps, fits, bins)) + "\n"


def _numbers(values: list[float]) -> str:
    return ", ".join(f"{v:.2f}" for v in values) if values else "(none: no candidate offered)"


if __name__ == "__main__":
    run_main(main)
