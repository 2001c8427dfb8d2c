"""Measure what speculation buys on a target/drafter pair: plain vs speculative greedy decoding of held-out
prompts (the standard library's held-out `.py` files, or those under `--prompt_dir`,
`dsparkjax/training/corpus.py`).

    python scripts/acceptance.py                                 # the embedded pair, JSON to stdout
    python scripts/acceptance.py --json_out docs/acceptance.json

Policies measured, each against plain decoding's target steps for the same tokens:
- `adaptive`: `generate`'s default (exact verification, width "adaptive"): the confidence policy with the
  drafter's own thresholds (`scripts/calibrate.py`, stored in its GGUF; lucebox's without them), exact mode
  running the chosen width (its programs are batch-invariant per width). The issue 39 goal is checked on it;
- `adaptive_fast`: the same policy in fast mode;
- `lucebox`: the confidence policy with lucebox's constant thresholds, exact;
- each fixed q of `--widths`, exact.
For each: candidates matched/offered, target steps, the reduction against plain decoding, tokens per step,
and whether the output is identical to plain decoding.
"""

from __future__ import annotations

from absl import flags, logging

from held_out import HeldOutFlags, print_json  # scripts/ is on sys.path
from dsparkjax.cli_inputs import run_main
from dsparkjax.decoding.generate import generate
from dsparkjax.decoding.width import LUCEBOX_THRESHOLDS, WidthPolicy

_HELD_OUT = HeldOutFlags.define()
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "Tokens generated per prompt.")
_WIDTHS = flags.DEFINE_list("widths", ["2", "6"], "Fixed verify widths q in 1..6 to measure as well.")
_JSON = flags.DEFINE_string("json_out", None, "Also write the results here.")
_GOAL_RATE, _GOAL_STEPS = 0.6, 1.5  # issue 39: matched/offered and the step reduction, with the defaults


def main(argv: list[str]) -> None:
    del argv
    logging.set_verbosity(logging.WARNING)
    pair, prompts = _HELD_OUT.load()
    target, drafter = pair.target, pair.drafter
    stop = ()  # no stop token: every run makes max_new_tokens tokens
    plain = generate(target, prompts, drafter=drafter, mode="ar", max_new_tokens=_MAX_NEW.value, stop_tokens=stop)
    plain_steps = sum(r.steps for r in plain)
    fitted = drafter.width_thresholds
    report = dict(_HELD_OUT.header(pair, prompts), max_new_tokens=_MAX_NEW.value, plain_steps=plain_steps,
                  thresholds=dict(fitted=list(fitted) if fitted is not None else None,
                                  lucebox=list(LUCEBOX_THRESHOLDS)), policies={})
    runs: dict[str, tuple[str, str | int | WidthPolicy]] = {"adaptive": ("exact", "adaptive"),
                                                              "adaptive_fast": ("fast", "adaptive")}
    runs["lucebox"] = ("exact", WidthPolicy("confidence", thresholds=LUCEBOX_THRESHOLDS))
    runs.update((w, ("exact", int(w))) for w in _WIDTHS.value)
    for name, (verify, width) in runs.items():
        spec = generate(target, prompts, drafter=drafter, mode="spec", verify=verify, width=width,
                        max_new_tokens=_MAX_NEW.value, stop_tokens=stop)
        matched, offered, steps = (sum(getattr(r, k) for r in spec) for k in ("matched", "offered", "steps"))
        report["policies"][name] = dict(
            verify=verify, matched=matched, offered=offered, matched_per_offered=round(matched / max(offered, 1), 4),
            steps=steps, step_reduction=round(plain_steps / max(steps, 1), 3),
            tokens_per_step=round(sum(len(r.token_ids) for r in spec) / max(steps, 1), 3),
            identical_to_plain=all(s.token_ids == p.token_ids for s, p in zip(spec, plain)))
    row = report["policies"]["adaptive"]
    report["goal"] = dict(policy="adaptive", matched_per_offered=_GOAL_RATE, step_reduction=_GOAL_STEPS,
                          met=row["matched_per_offered"] >= _GOAL_RATE and row["step_reduction"] >= _GOAL_STEPS
                          and row["identical_to_plain"])
    print_json(report, _JSON.value)


if __name__ == "__main__":
    run_main(main)
