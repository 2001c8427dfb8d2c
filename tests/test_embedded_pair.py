"""The shipped trained pair (`dsparkjax/data`, made by `scripts/train_tiny.py`): it loads, its tokenizer round
trips the prompt, and a short greedy continuation of a fixed prompt is the recorded one, plain and
speculative alike (exact verification), with the drafter's candidates actually accepted.

A new pair changes the continuation; record it again with

    PYTHONPATH=$PWD python tests/test_embedded_pair.py --record

which writes `tests/data/embedded_pair.json` (the prompt's ids and the continuation) from the shipped pair.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from dsparkjax.decoding.generate import generate
from dsparkjax.pair import load_pair

PROMPT = "class Parser:\n    def __init__(self, text):\n"
NEW_TOKENS = 16  # greedy, float32 on the CPU
RECORD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "embedded_pair.json")


def continuation(target, drafter, ids: list[int], mode: str) -> tuple[list[int], object]:
    (out,) = generate(target, [ids], drafter=drafter, mode=mode, verify="exact", max_new_tokens=NEW_TOKENS,
                      stop_tokens=())
    return out.token_ids, out


@pytest.fixture(scope="module")
def pair():
    return load_pair(None, None)[:2]


def test_embedded_pair_continues_the_prompt_as_recorded(pair):
    target, drafter = pair
    with open(RECORD) as f:
        recorded = json.load(f)
    assert recorded["prompt"] == PROMPT
    ids = target.tokenizer.encode(PROMPT, add_bos=True)
    assert ids == recorded["prompt_ids"]
    assert target.tokenizer.decode(ids[1:]) == PROMPT
    plain_ids, plain = continuation(target, drafter, ids, "ar")
    spec_ids, spec = continuation(target, drafter, ids, "spec")
    assert plain_ids == recorded["continuation"]
    assert spec_ids == recorded["continuation"]
    assert spec.matched > 0 and spec.steps < plain.steps


def record() -> None:
    """Write the shipped pair's prompt ids and greedy continuation to RECORD."""
    target, drafter, _, _ = load_pair(None, None)
    ids = target.tokenizer.encode(PROMPT, add_bos=True)
    tokens, _ = continuation(target, drafter, ids, "ar")
    fields = dict(prompt=PROMPT, prompt_ids=ids, continuation=tokens, text=target.tokenizer.decode(tokens))
    with open(RECORD, "w") as f:  # one key per line, each list on its line
        f.write("{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in fields.items()) + "\n}\n")
    print(f"recorded {len(tokens)} tokens to {RECORD}: {target.tokenizer.decode(tokens)!r}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit(f"usage: PYTHONPATH=$PWD python {sys.argv[0]} --record")
    record()
