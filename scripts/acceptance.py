"""Measure what speculation buys on a target/drafter pair: plain vs speculative greedy decoding of held-out
prompts (the standard library's held-out `.py` files, `dsparkjax/training/corpus.py`).

    python scripts/acceptance.py                                 # the embedded pair, JSON to stdout
    python scripts/acceptance.py --json_out docs/acceptance.json

For each verify width (`--widths`: "adaptive" and fixed q; `--thresholds p2,p3`: the confidence policy with
calibrated thresholds), it reports candidates matched/offered, target
steps against plain decoding's for the same tokens, tokens per step, and whether the output is identical
to plain decoding (exact verification).
"""

from __future__ import annotations

import json

from absl import app, flags, logging

from dsparkjax.embedded import embedded_pair
from dsparkjax.decoding.generate import generate
from dsparkjax.decoding.proposer import load_drafter
from dsparkjax.decoding.width import WidthPolicy
from dsparkjax.target_api import load_target
from dsparkjax.training.corpus import held_out_prompts

_TARGET = flags.DEFINE_string("target", None, "Target GGUF (default: the embedded target).")
_DRAFT = flags.DEFINE_string("draft", None, "Drafter GGUF (default: the embedded drafter).")
_PROMPTS = flags.DEFINE_integer("prompts", 16, "Held-out prompts.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 32, "Tokens per prompt.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "Tokens generated per prompt.")
_SEED = flags.DEFINE_integer("seed", 7, "Seed of the prompt positions.")
_WIDTHS = flags.DEFINE_list("widths", ["adaptive", "6"], "Verify widths to measure: 'adaptive' or q in 2..6.")
_THRESHOLDS = flags.DEFINE_list("thresholds", [], "p2,p3 of the confidence policy (e.g. from scripts/calibrate.py): "
                                 "also measures adaptive widths with them, as 'calibrated'.")
_JSON = flags.DEFINE_string("json_out", None, "Also write the results here.")


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
    stop = ()  # no stop token: every run makes max_new_tokens tokens
    plain = generate(target, prompts, drafter=drafter, mode="ar", max_new_tokens=_MAX_NEW.value, stop_tokens=stop)
    plain_steps = sum(r.steps for r in plain)
    report = dict(target=target_path, draft=draft_path, prompts=len(prompts), prompt_len=_PROMPT_LEN.value,
                  max_new_tokens=_MAX_NEW.value, seed=_SEED.value, plain_steps=plain_steps, widths={})
    widths: dict[str, str | int | WidthPolicy] = {w: w if w == "adaptive" else int(w) for w in _WIDTHS.value}
    if _THRESHOLDS.value:
        p2, p3 = (float(x) for x in _THRESHOLDS.value)
        widths["calibrated"] = WidthPolicy(p2_threshold=p2, p3_threshold=p3)
        report["thresholds"] = dict(p2=p2, p3=p3)
    for width, policy in widths.items():
        spec = generate(target, prompts, drafter=drafter, mode="spec", verify="exact", width=policy,
                        max_new_tokens=_MAX_NEW.value, stop_tokens=stop)
        matched, offered, steps = (sum(getattr(r, k) for r in spec) for k in ("matched", "offered", "steps"))
        report["widths"][width] = dict(
            matched=matched, offered=offered, matched_per_offered=round(matched / max(offered, 1), 4),
            steps=steps, step_reduction=round(plain_steps / max(steps, 1), 3),
            tokens_per_step=round(sum(len(r.token_ids) for r in spec) / max(steps, 1), 3),
            identical_to_plain=all(s.token_ids == p.token_ids for s, p in zip(spec, plain)))
    text = json.dumps(report, indent=2)
    print(text)
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    app.run(main)
