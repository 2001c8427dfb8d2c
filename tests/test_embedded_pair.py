"""The shipped trained pair (`dsparkjax/data`, made by `scripts/train_tiny.py`): it loads, its tokenizer round
trips the prompt, and a short greedy continuation of a fixed prompt is the recorded one, plain and
speculative alike (exact verification), with the drafter's candidates actually accepted."""

from __future__ import annotations

import pytest

from dsparkjax.embedded import embedded_pair
from dsparkjax.decoding.generate import generate
from dsparkjax.decoding.proposer import load_drafter
from dsparkjax.target_api import load_target

PROMPT = "class Parser:\n    def __init__(self, text):\n"
# Recorded from the shipped pair with this prompt (BOS first), 16 greedy tokens, float32 on the CPU.
PROMPT_IDS = [0, 507, 226, 53, 293, 266, 87, 279, 264, 353, 226, 318, 268, 333, 318, 13, 282, 17, 270, 423, 89, 314]
CONTINUATION = [267, 317, 399, 411, 279, 288, 287, 226, 473, 73, 68, 85, 434, 19, 226, 473]


@pytest.fixture(scope="module")
def pair():
    target_path, draft_path = embedded_pair()
    target = load_target(target_path)
    return target, load_drafter(draft_path, target)


def test_embedded_pair_continues_the_prompt_as_recorded(pair):
    target, drafter = pair
    ids = target.tokenizer.encode(PROMPT, add_bos=True)
    assert ids == PROMPT_IDS
    assert target.tokenizer.decode(ids[1:]) == PROMPT
    plain = generate(target, [ids], drafter=drafter, mode="ar", max_new_tokens=len(CONTINUATION), stop_tokens=())
    spec = generate(target, [ids], drafter=drafter, mode="spec", verify="exact", max_new_tokens=len(CONTINUATION),
                    stop_tokens=())
    assert plain[0].token_ids == CONTINUATION
    assert spec[0].token_ids == CONTINUATION
    assert spec[0].matched > 0 and spec[0].steps < plain[0].steps
