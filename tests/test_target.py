"""The target step: incremental == full, q-step == q single steps, rollback, and the named pitfalls.

All on the tiny config of `ds4_arch.md` §7 (window 8, CSA ratio 4, HCA ratio 8, indexer top-2, 2 hash
layers), fp32 on CPU. Sequences of one batch sit at different positions, so one batched run covers many
phases of the window ring and the compressors at once.
"""

from __future__ import annotations

import dataclasses

import chex
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from dsparkjax.decoding.forward import forward
from dsparkjax.errors import TokenIdError
from dsparkjax.model.state import commit, reset
from model_helpers import assert_states_close, decode_single, fresh_state, max_rel_err, prefill, random_tokens, step_fn, tiny_target_model, visible_state

EXACT_WIDTH = 6  # the fixed program width of exact verification (seed + 5 candidates)
T = 40


@pytest.fixture(scope="module")
def target():
    """QAT simulations off: FP8 rounding turns cross-program float noise into whole FP8 steps, so
    comparisons across programs (with a tolerance) run without it; bit-exact ones run with it too."""
    return tiny_target_model(simulate_qat=False)


def test_incremental_equals_full(target):
    """Prefill P tokens then decode token by token == the full forward, for P across wraps and boundaries."""
    rng = np.random.default_rng(1)
    seq = random_tokens(rng, (1, T), target.config.vocab_size)
    full = forward(target, seq)[0]
    prompt_lengths = np.arange(1, 34)  # every P across three window wraps and many CSA/HCA boundaries
    tokens = np.repeat(seq, len(prompt_lengths), axis=0)
    state, pre = prefill(target, fresh_state(target, len(prompt_lengths)), tokens, prompt_lengths, width=5)
    steps = T - int(prompt_lengths.min())
    padded = np.pad(tokens, ((0, 0), (0, steps)))
    _, dec = decode_single(target, state, padded, prompt_lengths, steps)
    for b, p in enumerate(prompt_lengths):
        assert max_rel_err(pre[b, :p], full[:p]) < 1e-5, f"chunked prefill P={p}"
        assert max_rel_err(dec[b, : T - p], full[p:]) < 1e-5, f"decode after P={p}"


def _q_rows(target, state, tokens, starts, q, width):
    """One step of `width` rows whose first q rows are tokens[b, starts[b] + 0..q-1]; commits q."""
    batch = tokens.shape[0]
    rows = np.zeros((batch, width), np.int32)
    rows[:, :q] = tokens[np.arange(batch)[:, None], starts[:, None] + np.arange(q)]
    out, _, state = step_fn(target)(target.params, state, jnp.asarray(rows))
    return commit(state, jnp.full((batch,), q, jnp.int32)), np.asarray(out[:, :q])


@pytest.mark.parametrize("q", [1, 2, 3, 4, 5])
def test_q_step_equals_single_steps(target, q):
    """A q-row step == q one-row steps (1e-5 across programs; bit-identical inside the exact-width program)."""
    rng = np.random.default_rng(q)
    starts = np.arange(0, 30)  # every phase of the window (8), CSA (4) and HCA (8) and a physical ring wrap
    batch = len(starts)
    tokens = random_tokens(rng, (batch, 30 + q), target.config.vocab_size)

    def prefilled(model):  # the step donates its state, so each path prefills its own
        return prefill(model, fresh_state(model, batch), tokens, starts, 16)[0]

    s_q, logits_q = _q_rows(target, prefilled(target), tokens, starts, q, q)
    s_1, logits_1 = decode_single(target, prefilled(target), tokens, starts, q)
    assert max_rel_err(logits_q, logits_1) < 1e-5
    assert_states_close(visible_state(s_q, target.config), visible_state(s_1, target.config))
    # Inside one fixed-shape program, a row does not depend on its neighbours: bit-identical (QAT on).
    exact = tiny_target_model()
    s_wide, logits_wide = _q_rows(exact, prefilled(exact), tokens, starts, q, EXACT_WIDTH)
    s_pad, logits_pad = decode_single(exact, prefilled(exact), tokens, starts, q, width=EXACT_WIDTH)
    np.testing.assert_array_equal(logits_wide, logits_pad)
    chex.assert_trees_all_equal(visible_state(s_wide, exact.config), visible_state(s_pad, exact.config))


def verify_then_continue(target, tokens, starts, q, accepted, cont):
    """Verify q rows at `starts`, commit `accepted`, then decode `cont` more tokens (all exact-width steps)."""
    batch = tokens.shape[0]
    state, _ = prefill(target, fresh_state(target, batch), tokens, starts, 16)
    rows = np.zeros((batch, EXACT_WIDTH), np.int32)
    rows[:, :q] = tokens[np.arange(batch)[:, None], starts[:, None] + np.arange(q)]
    drafts = np.where(np.arange(q)[None, :] < accepted[:, None], rows[:, :q], (rows[:, :q] + 7) % 500)
    rows[:, :q] = drafts  # rejected rows carry other tokens, as a wrong draft would
    _, _, state = step_fn(target)(target.params, state, jnp.asarray(rows))
    state = commit(state, jnp.asarray(accepted, jnp.int32))
    return decode_single(target, state, tokens, starts + accepted, cont, width=EXACT_WIDTH)


@settings(max_examples=8, deadline=None, derandomize=True)
@given(st.data())
def test_rollback_equals_sequential(data):
    """Verify q, commit a in 0..q, continue == decoding only the a accepted tokens (state and logits)."""
    target = tiny_target_model()
    batch = 6
    starts = np.array(data.draw(st.lists(st.integers(0, 40), min_size=batch, max_size=batch)))
    q = data.draw(st.integers(1, 5))
    accepted = np.array(data.draw(st.lists(st.integers(0, q), min_size=batch, max_size=batch)))
    tokens = random_tokens(np.random.default_rng(int(starts.sum()) + q), (batch, 56), target.config.vocab_size)
    s_spec, l_spec = verify_then_continue(target, tokens, starts, q, accepted, cont=4)
    state, _ = prefill(target, fresh_state(target, batch), tokens, starts, 16)
    # Reference: decode exactly the accepted tokens one by one (per sequence counts differ: pad with commits 0).
    step = step_fn(target)
    for i in range(int(accepted.max())):
        rows = np.zeros((batch, EXACT_WIDTH), np.int32)
        rows[:, 0] = tokens[np.arange(batch), np.minimum(starts + i, tokens.shape[1] - 1)]
        _, _, state = step(target.params, state, jnp.asarray(rows))
        state = commit(state, jnp.asarray((i < accepted).astype(np.int32)))
    s_ref, l_ref = decode_single(target, state, tokens, starts + accepted, 4, width=EXACT_WIDTH)
    np.testing.assert_array_equal(l_spec, l_ref)
    chex.assert_trees_all_equal(visible_state(s_spec, target.config), visible_state(s_ref, target.config))


def _one_case_step_vs_single(target, start, q):
    tokens = random_tokens(np.random.default_rng(start * 10 + q), (1, start + q), target.config.vocab_size)
    starts = np.array([start])
    s_q, l_q = _q_rows(target, prefill(target, fresh_state(target, 1), tokens, starts, 16)[0], tokens, starts, q, q)
    s_1, l_1 = decode_single(target, prefill(target, fresh_state(target, 1), tokens, starts, 16)[0], tokens, starts, q)
    assert max_rel_err(l_q, l_1) < 1e-5
    assert_states_close(visible_state(s_q, target.config), visible_state(s_1, target.config))


def test_ring_wrap_inside_step(target):
    """Positions 21..25 cross the physical end of the window ring (8 + 16 − 1 = 23 slots) inside one step."""
    _one_case_step_vs_single(target, 21, 5)


def test_several_csa_boundaries_in_one_step(target):
    """Positions 3..7 emit CSA entries 0 and 1 (and indexer keys) within one step."""
    _one_case_step_vs_single(target, 3, 5)


def test_hca_boundary_in_step(target):
    """Positions 13..17 cross the ratio-8 HCA boundary at 15."""
    _one_case_step_vs_single(target, 13, 5)


def test_indexer_top_k_selects_among_more_candidates():
    """From position 11 on there are 3+ CSA candidates for top-2: selection changes the logits from there."""
    rng = np.random.default_rng(5)
    seq = random_tokens(rng, (1, 32), 512)
    base = tiny_target_model()
    picky = forward(base, seq)[0]
    everything = dataclasses.replace(base, config=dataclasses.replace(base.config, index_topk=16))
    all_selected = forward(everything, seq)[0]
    assert max_rel_err(picky[:11], all_selected[:11]) < 1e-5  # <= 2 candidates: top-2 keeps them all
    assert np.abs(picky[11:] - all_selected[11:]).max() > 1e-3


def test_hash_routing_uses_each_rows_token(target):
    """A verify step routes hash layers by each row's own (draft) token, as sequential decoding does."""
    rng = np.random.default_rng(9)
    tokens = random_tokens(rng, (2, 12), target.config.vocab_size)
    tokens[1, :10] = tokens[0, :10]  # same prefix, different draft tokens at 10 and 11
    starts = np.array([9, 9])
    state, _ = prefill(target, fresh_state(target, 2), tokens, starts, 16)
    logits, _, _ = step_fn(target)(target.params, state, jnp.asarray(tokens[:, 9:12]))
    _, single = decode_single(target, prefill(target, fresh_state(target, 2), tokens, starts, 16)[0], tokens, starts, 3)
    assert max_rel_err(np.asarray(logits), single) < 1e-5
    assert np.abs(np.asarray(logits)[0, 1:] - np.asarray(logits)[1, 1:]).max() > 1e-3


def test_stale_state_across_requests(target):
    """A reset sequence behaves exactly like a fresh one, whatever the previous request left behind."""
    rng = np.random.default_rng(11)
    first, second = (random_tokens(rng, (1, 30), target.config.vocab_size) for _ in range(2))
    state, _ = prefill(target, fresh_state(target, 1), first, np.array([30]), 16)
    state = reset(state, jnp.array([True]))
    reused, l_reused = prefill(target, state, second, np.array([13]), 16)
    fresh, l_fresh = prefill(target, fresh_state(target, 1), second, np.array([13]), 16)
    np.testing.assert_array_equal(l_reused, l_fresh)
    _, d_reused = decode_single(target, reused, second, np.array([13]), 9)
    _, d_fresh = decode_single(target, fresh, second, np.array([13]), 9)
    np.testing.assert_array_equal(d_reused, d_fresh)


@pytest.mark.parametrize("bad", [512, -1])
def test_out_of_range_token_ids_are_rejected(target, bad):
    tokens = np.zeros((1, 4), np.int64)
    tokens[0, 2] = bad
    with pytest.raises(TokenIdError, match=f"id {bad} is outside the vocabulary"):
        forward(target, tokens)
