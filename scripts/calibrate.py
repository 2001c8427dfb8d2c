"""Calibration of a DSpark drafter's confidence head against real acceptance, and width thresholds from it.

    python scripts/calibrate.py --png docs/calibration.png --json_out docs/calibration.json --write_draft

Held-out prompts (`dsparkjax/training/corpus.py`) are continued greedily by the target; the drafter proposes
at every position of those continuations and each candidate is scored against the target's next tokens
(`dsparkjax/training/calibration.py`). For block slot i the plot shows, per confidence bin, how often
candidate i matched given that candidates 1..i-1 did (what the confidence head predicts), and the prefix
survival c_1·…·c_i against how often candidates 1..i all matched (what the width policy thresholds), with
its isotonic fit and the fitted threshold: the lowest c_1·…·c_i whose calibrated survival reaches
`--break_even`, and the thresholds the drafter GGUF already stores (`stored_thresholds`, dash-dotted), if any.
`--write_draft` stores the fitted thresholds in the drafter GGUF, where `load_drafter` reads them as its
adaptive width policy's defaults.
"""

from __future__ import annotations

import json

import numpy as np
from absl import flags, logging

from held_out import HeldOutFlags  # scripts/ is on sys.path
from dsparkjax.cli_inputs import run_main
from dsparkjax.training import calibration

_HELD_OUT = HeldOutFlags.define(calibration.PROMPTS, calibration.PROMPT_LEN, calibration.PROMPT_SEED)
_NEW = flags.DEFINE_integer("new_tokens", calibration.NEW_TOKENS,
                            "Greedy tokens per prompt (the positions drafted from).")
_BINS = flags.DEFINE_integer("bins", 10, "Confidence bins.")
_BREAK_EVEN = flags.DEFINE_float("break_even", calibration.BREAK_EVEN,
                                  "Calibrated survival a verified candidate must reach.")
_PNG = flags.DEFINE_string("png", None, "Write the calibration plot here.")
_JSON = flags.DEFINE_string("json_out", None, "Write the numbers and thresholds here.")
_WRITE = flags.DEFINE_bool("write_draft", False, "Store the fitted thresholds in the drafter GGUF.")


def report(proposals: calibration.Proposals, bins: int, break_even: float) -> dict:
    """Per slot: samples reaching it, acceptance there, reliability bins, ECE, AUC and the fitted threshold."""
    conf, match = proposals.confidences, proposals.matches
    predicted, survived = proposals.predicted, proposals.survived
    thresholds = calibration.fit_thresholds(proposals, break_even)
    edges = np.linspace(0.0, 1.0, bins + 1)
    slots = []
    for i in range(conf.shape[1]):
        reached = survived[:, i - 1] if i else np.ones(len(match), bool)
        conditional = calibration.reliability(conf[reached, i], match[reached, i], edges)
        xs, fit = calibration.isotonic(predicted[:, i], survived[:, i])
        keep = np.unique(np.linspace(0, len(xs) - 1, 50).astype(int))
        slots.append(dict(
            slot=i + 1, samples=int(reached.sum()),
            acceptance=float(match[reached, i].mean()) if reached.any() else None,
            conditional=conditional,
            conditional_ece=sum(r["count"] * abs(r["predicted"] - r["observed"]) for r in conditional)
            / max(int(reached.sum()), 1),
            conditional_auc=calibration.auc(conf[reached, i], match[reached, i]),
            prefix=calibration.reliability(predicted[:, i], survived[:, i], edges),
            prefix_auc=calibration.auc(predicted[:, i], survived[:, i]),
            prefix_isotonic=[[float(xs[j]), float(fit[j])] for j in keep],
            threshold=thresholds[i] if i < len(thresholds) else None))
    return dict(break_even=break_even, thresholds=list(thresholds), slots=slots)


def main(argv: list[str]) -> None:
    del argv
    logging.set_verbosity(logging.WARNING)
    pair, prompts = _HELD_OUT.load()
    drafter = pair.drafter
    proposals = calibration.proposals_on(pair.target, drafter, prompts, _NEW.value)
    result = dict(_HELD_OUT.header(pair, prompts), new_tokens=_NEW.value, positions=int(len(proposals.matches)),
                  stored_thresholds=list(drafter.width_thresholds) if drafter.width_thresholds is not None else None,
                  **report(proposals, _BINS.value, _BREAK_EVEN.value))
    print(json.dumps([{k: s[k] for k in ("slot", "samples", "acceptance", "conditional_ece", "conditional_auc",
                                         "prefix_auc", "threshold")} for s in result["slots"]], indent=1))
    print("thresholds:", result["thresholds"])
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            f.write(json.dumps(result, indent=2) + "\n")
    if _PNG.value:
        plot(result["slots"], result["stored_thresholds"] or [], _PNG.value)
    if _WRITE.value:
        calibration.write_thresholds(pair.draft_path, tuple(result["thresholds"]))
        print(f"wrote the thresholds to {pair.draft_path}")


def plot(slots: list[dict], stored: list[float], path: str) -> None:
    """Left: candidate i's acceptance against c_i; right: prefix survival against c_1·…·c_i, isotonic fits
    (thin), fitted thresholds (dotted) and the drafter's stored ones (`stored`, dash-dotted)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5))
    for s in slots:
        line, = left.plot([r["predicted"] for r in s["conditional"]], [r["observed"] for r in s["conditional"]],
                          "o-", label=f"slot {s['slot']}")
        color = line.get_color()
        right.plot([r["predicted"] for r in s["prefix"]], [r["observed"] for r in s["prefix"]], "o-", color=color,
                   label=f"slot {s['slot']}")
        right.plot(*zip(*s["prefix_isotonic"]), "-", color=color, lw=0.8, alpha=0.6)
        if s["threshold"] is not None:
            right.axvline(s["threshold"], color=color, ls=":", alpha=0.8)
        if s["slot"] <= len(stored):
            right.axvline(stored[s["slot"] - 1], color=color, ls="-.", alpha=0.8)
    left.set_title("candidate i accepted | 1..i-1 accepted, vs c_i")
    right.set_title("1..i all accepted, vs c_1·…·c_i\n"
                    "(thin: isotonic fit; dotted: fitted t_i; dash-dot: stored t_i)")
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
    run_main(main)
