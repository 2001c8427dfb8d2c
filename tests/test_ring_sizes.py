"""Ring sizes at their limits (issue 41): the real window 128 with HCA ratio 128, and the tightest rings.

A state built for steps of at most `max_step` rows keeps `window + max_step - 1` window slots and
`span + max_step - 1` compressor slots (`model/state.py`); `max_step = 1` (`forward(chunk=1)`, one token per
step) is the tightest, with no slack at all. Tiny dims otherwise, fp32 on CPU, QAT simulations off (the
comparisons cross programs, so they allow float noise; see tests/test_target.py).
"""

from __future__ import annotations

import dataclasses
import functools
import os

import numpy as np
import pytest

from dsparkjax import generate
from dsparkjax.config import tiny_target
from dsparkjax.ggufio import write_model_gguf
from dsparkjax.decoding.forward import forward
from dsparkjax.target_api import Target, load_target
from dsparkjax.tiny import tiny_pair
from model_helpers import (decode_single, fresh_state, max_rel_err, prefill, random_tokens, scratch_dir,
                           tiny_target_model)

HCA_LAYER = 2  # tiny_target's layers: SWA, CSA, HCA, CSA


@functools.lru_cache(maxsize=None)
def real_window_target() -> Target:
    """The tiny target with DS4-Flash's window 128 and HCA ratio 128 (CSA stays at its fixed ratio 4). The CSA
    indexer keeps all of the 75 entries 300 tokens make: these comparisons cross state layouts (143 vs 128 window
    slots), whose float noise flipped a near tie of the tiny config's top-2 at one position on an AVX2 host."""
    cfg = dataclasses.replace(tiny_target(), sliding_window=128, compress_ratios=(0, 4, 128, 4), index_topk=128)
    cfg, params, _, _ = tiny_pair(0, target_cfg=cfg)
    path = os.path.join(scratch_dir("ring-"), "target.gguf")
    write_model_gguf(path, cfg, params, recipe="f32")
    return load_target(path, simulate_qat=False)


def test_real_window_and_hca_ratio_128():
    """300 tokens: two window wraps and HCA entries at positions 127 and 255. Steps of 16 rows (ring of 143
    slots), one-token steps (the exact ring of 128), and chunked prefill + single-token decode agree."""
    target = real_window_target()
    seq = random_tokens(np.random.default_rng(7), (1, 300), target.config.vocab_size)
    chunked, single = forward(target, seq, chunk=16)[0], forward(target, seq, chunk=1)[0]
    assert max_rel_err(single, chunked) < 1e-5
    prompt = np.array([250])  # prefill across the first HCA entry, decode across the second and a wrap
    state, pre = prefill(target, fresh_state(target, 1, max_len=320), seq, prompt, width=16)
    state, dec = decode_single(target, state, seq, prompt, 50)
    assert max_rel_err(pre[0], chunked[:250]) < 1e-5 and max_rel_err(dec[0], chunked[250:]) < 1e-5
    entries = np.asarray(state.layers[HCA_LAYER].comp_kv[0])
    assert np.all(np.any(entries[:2] != 0, axis=-1)) and not np.any(entries[2:])  # 2 entries, at 127 and 255


@pytest.mark.parametrize("chunk", [16, 5])
def test_tightest_ring_equals_wider_rings(chunk):
    """One-token steps in a state built for one-row steps (window ring of exactly 8 slots, compressor rings
    of exactly their span) == steps of `chunk` rows, over three window wraps and many CSA/HCA boundaries."""
    target = tiny_target_model(simulate_qat=False)
    seq = random_tokens(np.random.default_rng(9), (2, 40), target.config.vocab_size)
    assert max_rel_err(forward(target, seq, chunk=1), forward(target, seq, chunk=chunk)) < 1e-5


def test_generate_with_prefill_chunk_1_matches_default():
    """generate(prefill_chunk=1) prefills one token per step and emits the same greedy tokens as the default."""
    target = tiny_target_model(simulate_qat=False)
    prompts = [list(random_tokens(np.random.default_rng(10), (23,), target.config.vocab_size)), [3, 1, 4]]
    tight = generate(target, prompts, max_new_tokens=12, prefill_chunk=1)
    default = generate(target, prompts, max_new_tokens=12)
    assert [r.token_ids for r in tight] == [r.token_ids for r in default]
