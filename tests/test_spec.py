"""Speculative generation: exact mode equals plain greedy decoding, and lucebox's bugs as named tests.

Exact mode's steps are batch invariant (plain decoding at width 1, verification at the chosen width), so the
property is checked bit for bit: speculative token ids == plain greedy token ids, on random tiny targets, prompts,
batch sizes and widths, with an oracle drafter that agrees most of the time (acceptances) and is
deliberately wrong elsewhere (rejections), and with the real DSpark drafter (random, disagreeing).
"""

from __future__ import annotations

import dataclasses
import time

import chex
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from model_helpers import (
    VOCAB,
    decode_single,
    fresh_state,
    max_rel_err,
    prefill,
    random_prompts,
    random_tokens,
    step_fn,
    tiny_pair_model,
    tiny_target_model,
    visible_state,
)

from dsparkjax.decoding.generate import generate
from dsparkjax.errors import DsparkError, TokenIdError
from dsparkjax.model.drafter import DrafterModel
from dsparkjax.model.reduce import rms_norm
from dsparkjax.decoding.width import WidthPolicy, accepted_candidates, ewma_update
from dsparkjax.testing.oracle import oracle_for


# -- exactness ---------------------------------------------------------------------------------------------


@settings(max_examples=4, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2), batch=st.sampled_from([1, 3]), width=st.sampled_from([2, 3, 4, 5, 6, "adaptive"]),
       data=st.data())
def test_exact_spec_equals_greedy_with_agreeing_drafter(seed, batch, width, data):
    """Spec output == plain greedy output, with acceptances and rejections in every run.

    4 examples (each compiles its batch's exact program per width): the property is checked at fixed widths
    too, by test_width_one_is_plain_decoding_through_the_verifier (q = 1), test_exact_spec_equals_greedy_with_
    dspark_drafter (adaptive and 4), test_eos_inside_accepted_run_stops_at_once and test_cancellation_mid_step
    (6, batch 2), and test_decoding's engine test (adaptive)."""
    target = tiny_target_model(seed)
    rng = np.random.default_rng(data.draw(st.integers(0, 10**6)))
    prompts = random_prompts(rng, batch)
    max_new = data.draw(st.integers(12, 24))
    plain = generate(target, prompts, max_new_tokens=max_new, stop_tokens=())
    oracle = oracle_for(prompts, plain, VOCAB, wrong_rate=0.3, seed=seed)
    spec = generate(target, prompts, drafter=oracle, max_new_tokens=max_new, width=width, stop_tokens=())
    chex.assert_trees_all_equal([np.asarray(s.token_ids) for s in spec], [np.asarray(p.token_ids) for p in plain])
    for s in spec:
        assert s.matched <= s.offered
    assert sum(s.matched for s in spec) > 0, "no multi-token acceptance happened"
    assert sum(s.offered - s.matched for s in spec) > 0, "no rejection happened"


def test_width_one_is_plain_decoding_through_the_verifier():
    target = tiny_target_model()
    prompts = random_prompts(np.random.default_rng(3), 3)
    plain = generate(target, prompts, max_new_tokens=10, stop_tokens=())
    oracle = oracle_for(prompts, plain, VOCAB, wrong_rate=0.0, seed=0)
    spec = generate(target, prompts, drafter=oracle, max_new_tokens=10, width=1, stop_tokens=())
    assert [s.token_ids for s in spec] == [p.token_ids for p in plain]
    assert all(s.offered == 0 and s.steps == len(s.token_ids) - 1 for s in spec)


@pytest.mark.parametrize("width", ["adaptive", 4])
def test_exact_spec_equals_greedy_with_dspark_drafter(width):
    """The real (random, so mostly disagreeing) DSpark drafter: exact mode still reproduces greedy output."""
    target, drafter = tiny_pair_model()
    prompts = random_prompts(np.random.default_rng(7), 3)
    plain = generate(target, prompts, drafter=drafter, mode="ar", max_new_tokens=16, stop_tokens=())
    spec = generate(target, prompts, drafter=drafter, max_new_tokens=16, width=width, stop_tokens=())
    for p, s in zip(plain, spec):
        assert s.token_ids == p.token_ids
        assert 0 <= s.matched <= s.offered and s.offered > 0


@pytest.mark.slow
def test_fast_mode_runs_per_width_programs_and_matches_on_cpu():
    """fast verification uses a program per width; on CPU fp32 the tiny model shows no near-tie flips.

    Slow (about 90 s on a loaded 2-core machine): CI checks the same property in test_decoding.py's
    test_each_width_is_traced_once_across_a_generation (fast speculative output == plain output, batch 2,
    an oracle wrong at 30 %, one program per width 1..6)."""
    target = tiny_target_model()
    prompts = random_prompts(np.random.default_rng(4), 2)
    plain = generate(target, prompts, max_new_tokens=12, verify="fast", stop_tokens=())
    oracle = oracle_for(prompts, plain, VOCAB, wrong_rate=0.3, seed=1)
    spec = generate(target, prompts, drafter=oracle, max_new_tokens=12, verify="fast", stop_tokens=())
    assert [s.token_ids for s in spec] == [p.token_ids for p in plain]


def test_plain_fast_mode_queues_ahead_and_stops_each_sequence_on_time():
    """Plain fast decoding queues step k+1 before reading step k (its program is always width 1): a sequence
    that stops early still gets exactly its tokens, the others run on, as with exact mode's width."""
    target = tiny_target_model()
    prompts = random_prompts(np.random.default_rng(5), 3)
    exact = generate(target, prompts, max_new_tokens=10, stop_tokens=())
    stop = exact[1].token_ids[3]  # sequence 1 stops at its 4th token (the others too, if they emit it)
    want = generate(target, prompts, max_new_tokens=10, stop_tokens=(stop,))
    fast = generate(target, prompts, max_new_tokens=10, verify="fast", stop_tokens=(stop,))
    assert [r.token_ids for r in fast] == [r.token_ids for r in want]
    assert [r.stop_reason for r in fast] == [r.stop_reason for r in want]
    assert len(fast[1].token_ids) <= 4 and fast[1].stop_reason == "eos"
    assert max(len(r.token_ids) for r in fast) == 10 or all(r.stop_reason == "eos" for r in fast)


def _watch_programs(monkeypatch, on_call, on_compile=lambda width: None) -> None:
    """Patch generate's target programs (the prefill chunk and the decode step) so that every call and compile
    first reports its row count to on_call / on_compile."""
    import dsparkjax.decoding.decoder as decoder

    def watched(make, width_of):
        def make_watched(*args):
            program = make(*args)

            def call(*call_args, **kwargs):
                on_call(width_of(kwargs))
                return program(*call_args, **kwargs)

            def compile(*compile_args, **kwargs):
                on_compile(width_of(kwargs))
                return program.compile(*compile_args, **kwargs)

            call.compile = compile
            return call

        return make_watched

    monkeypatch.setattr(decoder, "prefill_program", watched(decoder.prefill_program, lambda kw: kw["tokens"].shape[1]))
    monkeypatch.setattr(decoder, "decode_program", watched(decoder.decode_program, lambda kw: kw["width"]))


@pytest.mark.parametrize("verify", ["exact", "fast"])
def test_plain_decoding_queues_a_step_before_reading_one_back(monkeypatch, verify):
    """The device never waits for the host in plain decoding, either mode: the second decode step is queued
    before the first one's outcome is read back (fast mode used to read each step first, generation run 11)."""
    import dsparkjax.decoding.engine as gen

    events = []
    real_get = gen.jax.device_get

    def logged_get(tree):
        events.append("get")
        return real_get(tree)

    _watch_programs(monkeypatch, on_call=lambda width: events.append("step"))
    monkeypatch.setattr(gen.jax, "device_get", logged_get)
    target = tiny_target_model()
    prompts = [[3, 4, 5], [6, 7]]  # one prefill chunk
    generate(target, prompts, max_new_tokens=4, verify=verify, stop_tokens=())
    assert events[:4] == ["step", "step", "step", "get"], events  # prefill, decode 1, decode 2, read decode 1


@pytest.mark.parametrize("verify", ["exact", "fast"])
def test_plain_decoding_compiles_only_the_widths_it_dispatches(monkeypatch, verify):
    """Before its clock starts, plain decoding compiles the prefill chunk's program and the one width it
    decodes with (1, in both modes: exact mode's steps are batch invariant), not every width speculative
    decoding needs (each width of a DS4-sized model takes tens of seconds to compile), and it dispatches no
    width it did not compile."""
    compiled, dispatched = set(), set()
    _watch_programs(monkeypatch, on_call=dispatched.add, on_compile=compiled.add)
    generate(tiny_target_model(), [[3, 4, 5], [6, 7]], max_new_tokens=4, verify=verify, stop_tokens=(),
             prefill_chunk=8)
    assert compiled == {8, 1}
    assert dispatched <= compiled


@pytest.mark.parametrize("mode, verify, temperature, width", [("ar", "exact", 0.0, "adaptive"),
                                                               ("spec", "fast", 0.0, "adaptive"),
                                                               ("ar", "fast", 0.8, "adaptive"),
                                                               ("spec", "exact", 0.8, 3),
                                                               ("spec", "lossless", 0.8, 3)])
def test_generate_compiles_nothing_after_its_clock_starts(monkeypatch, mode, verify, temperature, width):
    """tok/s measures decoding: every XLA program a run dispatches (the step, the proposer's calls and the
    decode loop's own helpers) is compiled before generate reads its clock, even in a process that has not
    seen these shapes (7 sequences: a batch no other test uses).

    The cases cover each decode loop (plain or speculative, greedy or sampled, lossless) and each verify mode
    of both plain and speculative decoding: `verify` changes only what the step programs compute
    (`Decoder._options`), not which programs the loop compiles and dispatches, so plain fast greedy
    decoding (the loop of the ar/exact case, the programs of the ar/fast sampled one) and speculative exact
    greedy decoding (the loop of spec/fast, the programs of spec/exact sampled) would repeat what these check.
    The width policy sets only which widths the loop dispatches (`Decoder.widths`, the same for greedy and
    sampled runs), so the adaptive policy's six widths are checked once (spec/fast) and the sampled speculative
    cases take one fixed width: one decode program each to compile, not six."""
    import jax

    import dsparkjax.decoding.generate as gen

    target, drafter = tiny_pair_model()
    clock, late = {"started": False}, []

    class Clock:  # generate's `time`: its first perf_counter() call starts the clock
        @staticmethod
        def perf_counter() -> float:
            clock["started"] = True
            return time.perf_counter()

    def on_event(event: str, duration: float, **kwargs) -> None:
        if clock["started"] and event == "/jax/core/compile/backend_compile_duration":
            late.append(event)

    monkeypatch.setattr(gen, "time", Clock)
    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        generate(target, random_prompts(np.random.default_rng(8), 7), drafter=drafter, mode=mode, verify=verify,
                 temperature=temperature, width=width, max_new_tokens=5, stop_tokens=())
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)
    assert not late, f"{len(late)} XLA compiles after the clock started"


# -- named tests from dspark.md §6 -------------------------------------------------------------------------


@pytest.mark.parametrize("q", [2, 5])
def test_batched_verify_causality(q):
    """§6.1: a q-row verify at kv_start 0, 126, 127, 128, 129, 300 equals q sequential steps (all rows).

    q = 2 and 5 only: a 5-row verify from 126..129 has the compressor boundary at 128 (ratio 4) or 132 at row
    offsets 2, 1, 0 and 3, and test_invariance's test_step_rows_equal_plain_decoding checks every row of widths
    drawn from 2..6 against plain decoding bit for bit, across compressor boundaries, in the invariant step this
    test runs too."""
    target = tiny_target_model(simulate_qat=False)
    starts = np.array([0, 126, 127, 128, 129, 300])
    tokens = random_tokens(np.random.default_rng(q), (len(starts), 300 + q), VOCAB)
    state, _ = prefill(target, fresh_state(target, len(starts), 512), tokens, starts, 16)
    rows = tokens[np.arange(len(starts))[:, None], starts[:, None] + np.arange(q)]
    logits, _, state = step_fn(target)(target.params, state, jnp.asarray(rows))
    assert logits.shape == (len(starts), q, VOCAB)  # §6.7: every row's logits, not only the last
    seq_state, _ = prefill(target, fresh_state(target, len(starts), 512), tokens, starts, 16)
    _, single = decode_single(target, seq_state, tokens, starts, q)
    assert max_rel_err(np.asarray(logits), single) < 1e-5


def test_ring_rollback_after_wrap():
    """§6.2: with an 8-row window, write positions 10..13, commit 12, then 10: state as if never written."""
    target = tiny_target_model()
    tokens = random_tokens(np.random.default_rng(2), (1, 16), VOCAB)
    for commit_to in (12, 10):
        state, _ = prefill(target, fresh_state(target, 1), tokens, np.array([10]), 16)
        rows = np.zeros((1, 6), np.int32)
        rows[0, :4] = tokens[0, 10:14]
        _, _, state = step_fn(target)(target.params, state, jnp.asarray(rows))
        state = state.replace(length=jnp.asarray([commit_to], jnp.int32))
        ref, _ = prefill(target, fresh_state(target, 1), tokens, np.array([10]), 16)
        ref, _ = decode_single(target, ref, tokens, np.array([10]), commit_to - 10, width=6)
        assert int(state.length[0]) == commit_to
        got, want = visible_state(state, target.config), visible_state(ref, target.config)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)
        # n_comp = n_index_comp = length // 4: entries 0..2 at 12, 0..1 at 10 are the only visible ones.
        assert got["layer1.comp_kv"][0, : commit_to // 4].any(axis=-1).all()
        assert not got["layer1.comp_kv"][0, commit_to // 4 :].any()


def test_compressor_boundary_inside_rejected_span():
    """§6.3: a verify from 2 crosses the CSA boundary at 3 and the HCA one at 7; reject before them; continue."""
    target = tiny_target_model()
    prompts = [random_tokens(np.random.default_rng(8), (2,), VOCAB).tolist()]
    plain = generate(target, prompts, max_new_tokens=20, stop_tokens=())
    wrong = np.zeros((1, 64), bool)
    wrong[0, [4, 9, 14]] = True  # rejections right after CSA/HCA boundaries inside wide verifies
    oracle = oracle_for(prompts, plain, VOCAB, 0.0, 0)
    oracle = dataclasses.replace(oracle, wrong=wrong[:, : oracle.truth.shape[1]])
    spec = generate(target, prompts, drafter=oracle, max_new_tokens=20, width=6, stop_tokens=())
    assert spec[0].token_ids == plain[0].token_ids
    assert spec[0].offered > spec[0].matched > 0


def test_capture_order_mean_over_streams_and_no_perturbation():
    """§6.4: features are the mean over HC streams of each capture layer, in the requested order; taking
    them does not change the logits; 'entering layer i' equals 'after layer i-1'."""
    target = tiny_target_model()
    tokens = jnp.asarray(random_tokens(np.random.default_rng(6), (2, 6), VOCAB))
    from dsparkjax.model.target import StepOptions, TargetModel

    def run(capture, point="after"):
        model = TargetModel(target.config, StepOptions(capture_layers=capture, capture_point=point))
        return model.step(target.params, fresh_state(target, 2), tokens)

    logits_none, _, _ = run(())
    logits_cap, feats, _ = run((3, 1))
    np.testing.assert_array_equal(np.asarray(logits_none), np.asarray(logits_cap))
    assert feats.shape == (2, 6, 2, target.config.hidden_size)
    _, feats_entering, _ = run((2, 4 - 2), "entering")  # entering 2 == after 1
    np.testing.assert_array_equal(np.asarray(feats_entering[:, :, 0]), np.asarray(feats[:, :, 1]))
    # Mean over the four streams, recomputed layer by layer.
    model = TargetModel(target.config, StepOptions())
    state = fresh_state(target, 2)
    positions = jnp.broadcast_to(jnp.arange(6, dtype=jnp.int32), (2, 6))
    streams = jnp.broadcast_to(target.params.embed[tokens][:, :, None, :], (2, 6, 4, target.config.hidden_size))
    for layer in range(4):
        streams, _ = model.block(layer, target.params.blocks[layer], streams, tokens, positions, state.layers[layer])
        if layer == 3:
            np.testing.assert_allclose(np.asarray(feats[:, :, 0]), np.asarray(streams.mean(axis=2)), rtol=1e-5,
                                       atol=1e-6)


def test_hash_table_bounds_on_draft_tokens():
    """§6.5: a proposer drafting an id outside the vocabulary (and hash tables) is an error, never emitted.

    At one fixed width (one decode program to compile, not the adaptive policy's six): the check reads every
    step's candidates, whatever its width."""
    target = tiny_target_model()
    prompts = [[1, 2, 3]]
    plain = generate(target, prompts, max_new_tokens=4, stop_tokens=())
    oracle = oracle_for(prompts, plain, VOCAB, 0.0, 0, bad_id=VOCAB + 5)
    seen = []
    with pytest.raises(TokenIdError, match=f"drafted token id {VOCAB + 5}"):
        generate(target, prompts, drafter=oracle, max_new_tokens=4, width=2, on_token=lambda i, t: seen.append(t))
    assert all(0 <= t < VOCAB for t in seen)


def test_confidence_reads_pre_norm_hidden():
    """§6.8: with a one-hot confidence weight, confidence == sigmoid(pre-norm hidden[0]), not the normed one."""
    target, drafter = tiny_pair_model()
    cfg = drafter.config
    onehot = jnp.zeros((cfg.confidence_dim,), jnp.float32).at[0].set(1.0)
    params = drafter.params.replace(confidence_w=onehot, confidence_b=None)
    model = DrafterModel(cfg, target.simulate_qat)
    state = drafter.init_state(1, 16)
    seeds, pos = jnp.asarray([5], jnp.int32), jnp.asarray([0], jnp.int32)
    _, conf = model.propose(params, target.params.embed, target.params.head, state, seeds, pos)
    hidden = model.block_hidden(params, target.params.embed, state, seeds, pos)
    np.testing.assert_allclose(np.asarray(conf), np.asarray(1 / (1 + np.exp(-hidden[..., 0]))), rtol=1e-6)
    normed = rms_norm(hidden, params.norm, cfg.rms_norm_eps)
    assert not np.allclose(np.asarray(conf), np.asarray(1 / (1 + np.exp(-normed[..., 0]))), rtol=1e-3)


def test_eos_inside_accepted_run_stops_at_once():
    """§6.12: a stop token in the middle of an accepted run ends the sequence right there."""
    target = tiny_target_model()
    prompts = random_prompts(np.random.default_rng(12), 2)
    plain = generate(target, prompts, max_new_tokens=24, stop_tokens=())
    stop = plain[0].token_ids[6]
    oracle = oracle_for(prompts, plain, VOCAB, wrong_rate=0.0, seed=0)
    spec = generate(target, prompts, drafter=oracle, max_new_tokens=24, width=6, stop_tokens=(stop,))
    for p, s in zip(plain, spec):
        cut = p.token_ids.index(stop) + 1 if stop in p.token_ids else len(p.token_ids)
        assert s.token_ids == p.token_ids[:cut]
        assert s.stop_reason == ("eos" if stop in p.token_ids else "length")


def test_cancellation_mid_step():
    """§6.12: a callback returning False stops that sequence at once, even inside an accepted run.

    The prompts, lengths and width of test_eos_inside_accepted_run_stops_at_once: the same shapes, so this test
    runs the programs that one compiled."""
    target = tiny_target_model()
    prompts = random_prompts(np.random.default_rng(12), 2)
    plain = generate(target, prompts, max_new_tokens=24, stop_tokens=())
    oracle = oracle_for(prompts, plain, VOCAB, wrong_rate=0.0, seed=0)
    counts = [0, 0]

    def on_token(index: int, token: int) -> bool:
        counts[index] += 1
        return not (index == 0 and counts[0] == 4)

    spec = generate(target, prompts, drafter=oracle, max_new_tokens=24, width=6, on_token=on_token, stop_tokens=())
    assert spec[0].token_ids == plain[0].token_ids[:4] and spec[0].stop_reason == "cancelled"
    assert spec[1].token_ids == plain[1].token_ids and spec[1].stop_reason == "length"
    assert counts == [4, 24]


def test_bad_arguments_are_rejected():
    target = tiny_target_model()
    with pytest.raises(DsparkError, match="at least one token"):
        generate(target, [[]])
    with pytest.raises(DsparkError, match="needs a drafter"):
        generate(target, [[1]], mode="spec")
    with pytest.raises(DsparkError, match="width must be"):
        generate(target, [[1]], drafter=tiny_pair_model()[1], width=9)
    with pytest.raises(TokenIdError, match="prompt 1: id 600"):
        generate(target, [[1], [600]])


# -- width policy ------------------------------------------------------------------------------------------


def test_confidence_width_policy():
    policy = WidthPolicy("confidence", max_q=6)
    conf = jnp.asarray([[0.5, 0.5, 0.9, 1, 1], [0.7, 0.6, 0.5, 1, 1], [0.7, 0.6, 0.8, 1, 1], [0.9, 0.9, 0.9, 1, 1]])
    # P2 = .25 -> 2;  P2 = .42 but P3 = .21 -> 3;  P2 = .42, P3 = .336 -> 4;  -> 4 (the policy's top).
    np.testing.assert_array_equal(np.asarray(policy.choose(conf, jnp.zeros(4))), [2, 3, 4, 4])
    assert int(WidthPolicy("confidence", max_q=3).choose(conf[3:], jnp.zeros(1))[0]) == 3


def test_ewma_and_fixed_width_policies():
    policy = WidthPolicy("ewma", max_q=6)
    ewma = jnp.full((2,), policy.ewma_init)
    assert np.asarray(policy.choose(jnp.ones((2, 5)), ewma)).tolist() == [3, 3]  # int(1.5) + 2
    ewma = ewma_update(ewma, jnp.asarray([4, 0]), policy.ewma_decay)
    np.testing.assert_allclose(np.asarray(ewma), [0.7 * 1.5 + 1.2, 0.7 * 1.5])
    assert np.asarray(policy.choose(jnp.ones((2, 5)), ewma)).tolist() == [4, 3]
    assert np.asarray(WidthPolicy("fixed", fixed_q=5).choose(jnp.ones((1, 5)), ewma[:1])).tolist() == [5]


def test_accepted_candidates_counts_the_leading_matches():
    candidates = jnp.asarray([[4, 5, 6], [4, 9, 6], [1, 5, 6], [4, 5, 6]])
    greedy = jnp.asarray([[4, 5, 6, 7]] * 4)
    widths = jnp.asarray([4, 4, 4, 2])
    np.testing.assert_array_equal(np.asarray(accepted_candidates(candidates, greedy, widths)), [3, 1, 0, 1])
