"""The decoding core: ring capacity, programs traced once per width, donation, and the step-level engine."""

from __future__ import annotations

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from model_helpers import VOCAB, fresh_state, step_fn, tiny_pair_model, tiny_target_model

from dsparkjax.decoding.decoder import Decoder
from dsparkjax.decoding.engine import Emitted, Engine
from dsparkjax.decoding.forward import forward
from dsparkjax.decoding.generate import generate
from dsparkjax.decoding.sampling import GREEDY, SamplingParams
from dsparkjax.decoding.width import WidthPolicy
from dsparkjax.errors import ArgumentError, CapacityError, DsparkError, TokenIdError
from dsparkjax.model import ring
from dsparkjax.testing.oracle import OracleProposer, oracle_for


# -- rings and capacity ------------------------------------------------------------------------------------


def test_ring_slots_hold_the_last_written_positions():
    """After writing positions 3..12 into 4 slots, each slot holds the largest of them congruent to it."""
    rows = jnp.zeros((1, 4, 1))
    positions = jnp.arange(3, 13, dtype=jnp.int32)[None, :]
    for p in range(3, 13):
        rows = ring.write(rows, jnp.full((1, 1, 1), float(p)), positions[:, p - 3 : p - 2])
    held = ring.slot_positions(jnp.asarray([12], jnp.int32), 4)
    np.testing.assert_array_equal(np.asarray(held[0]), [12, 9, 10, 11])
    np.testing.assert_array_equal(np.asarray(ring.read(rows, held))[0, :, 0], [12, 9, 10, 11])
    assert np.all(np.asarray(ring.slot_positions(jnp.asarray([1], jnp.int32), 4))[0, 2:] < 0)  # never written


def test_target_step_wider_than_the_state_is_refused():
    """A state built for steps of 16 rows refuses 17 (its window ring would overwrite visible rows)."""
    target = tiny_target_model()
    state = fresh_state(target, 1)
    assert (state.max_step, state.max_len) == (16, 96)
    with pytest.raises(CapacityError, match="17 rows is wider than the decode state's max_step 16"):
        step_fn(target)(target.params, state, jnp.zeros((1, 17), jnp.int32))


def test_step_past_max_len_is_refused():
    state = fresh_state(tiny_target_model(), 2)
    state.check_step(6, np.array([10, 90]))  # fits exactly: positions 90..95
    with pytest.raises(CapacityError, match="passes the decode state's max_len 96"):
        state.check_step(6, np.array([10, 91]))


def test_drafter_absorb_wider_than_its_rings_is_refused():
    _, drafter = tiny_pair_model()
    state = drafter.init_state(1, 6)
    features = jnp.zeros((1, 7, len(drafter.capture_layers), drafter.config.hidden_size), jnp.float32)
    with pytest.raises(CapacityError, match="7 rows, wider than its context state's max_step 6"):
        drafter.absorb(state, features, jnp.arange(7, dtype=jnp.int32)[None, :], invariant=True)


def test_a_prefill_leaves_the_other_rows_proposals_as_they_were():
    """A prefill chunk writes rows of every sequence from its seed's position on, committing none for those it
    does not prefill. With chunks as wide as the state's steps (generate's default, 16), the drafter's rings
    lost the oldest position of a running row's context to them, so another row's admission changed its
    proposals: in lossless mode, its sampled tokens."""
    target, drafter = tiny_pair_model()
    decoder = Decoder(target, drafter, batch=2, max_len=64, max_step=6, prefill_chunk=6, verify="lossless",
                      sample=True, capture_layers=drafter.capture_layers)

    def proposal(loop):  # row 0's candidates and confidences, from the policy that decides lossless output
        drafts = drafter.propose(loop.proposer, loop.seeds, loop.state.length, invariant=decoder.drafts_invariant)
        return [np.asarray(x)[0] for x in drafts]

    loop, _ = decoder.prefill(decoder.init(), {0: np.arange(1, 23)})  # a context of 22 > the drafter's window 16
    alone = proposal(loop)
    loop, _ = decoder.prefill(loop, {1: np.arange(30, 39)})
    chex.assert_trees_all_equal(proposal(loop), alone)


# -- programs: traced once per width, state donated --------------------------------------------------------


def test_each_width_is_traced_once_across_a_generation(monkeypatch):
    """Fast speculative decoding dispatches widths 1..6 over many steps, plus the prefill chunk: the target
    step is traced once per width (at ahead-of-time compilation), never again while decoding."""
    from dsparkjax.decoding import program
    from dsparkjax.model.target import TargetModel

    target = tiny_target_model()
    prompts = [[3, 4, 5, 6], [7, 8]]
    plain = generate(target, prompts, max_new_tokens=16, stop_tokens=())
    oracle = oracle_for(prompts, plain, VOCAB, wrong_rate=0.3, seed=2)
    traces: dict[int, int] = {}
    real_step = TargetModel.step

    def counted_step(self, params, state, tokens):
        traces[tokens.shape[1]] = traces.get(tokens.shape[1], 0) + 1
        return real_step(self, params, state, tokens)

    monkeypatch.setattr(TargetModel, "step", counted_step)
    program.prefill_program.cache_clear()  # fresh programs, so this run's traces are all counted
    program.decode_program.cache_clear()
    spec = generate(target, prompts, drafter=oracle, max_new_tokens=16, verify="fast", stop_tokens=(),
                    prefill_chunk=8)
    assert [s.token_ids for s in spec] == [p.token_ids for p in plain]
    assert sum(s.steps for s in spec) > 7  # more steps than programs
    assert traces == {8: 1, 1: 1, 2: 1, 3: 1, 4: 1, 5: 1, 6: 1}


def test_the_drafter_is_batch_invariant_only_where_its_drafts_decide_the_output(monkeypatch):
    """Exact mode emits the target's tokens whatever is drafted, so the drafter's absorb and proposal trace under
    the target's XLA-ordered policy; lossless mode's sampling rows sample against the drafts' distribution, so
    there both trace under the batch-invariant one (its greedy rows decode as exact mode's)."""
    from dsparkjax.decoding import proposer
    from dsparkjax.kernels import policy as kernel_policy
    from dsparkjax.model.drafter import DrafterModel

    seen: set[tuple[str, bool]] = set()

    def recorded(name):
        method = getattr(DrafterModel, name).__wrapped__  # inside `routed`, where the weights read the policy

        def traced(self, *args, **kwargs):
            seen.add((name, kernel_policy.active().invariant))
            return method(self, *args, **kwargs)

        return kernel_policy.routed(traced)

    for name in ("absorb", "propose", "propose_sampled"):
        monkeypatch.setattr(DrafterModel, name, recorded(name))
    target, drafter = tiny_pair_model()
    assert target.invariant
    for verify, temperature, invariant in (("exact", 0.0, False), ("exact", 0.9, False), ("lossless", 0.0, False),
                                           ("lossless", 0.9, True)):
        # Fresh drafter programs, so this run's are all traced.
        monkeypatch.setattr(proposer, "_compiled", functools.lru_cache(proposer._compiled.__wrapped__))
        seen.clear()
        generate(target, [[5, 6, 7, 8], [9, 10]], drafter=drafter, verify=verify, temperature=temperature, seed=[1, 2],
                 width=6, max_new_tokens=3, stop_tokens=())
        proposal = "propose_sampled" if temperature else "propose"
        assert seen == {("absorb", invariant), (proposal, invariant)}, (verify, temperature)


def test_prefill_and_step_donate_the_loop_state():
    target = tiny_target_model()
    decoder = Decoder(target, None, batch=2, max_len=64, max_step=8, prefill_chunk=8)
    before = decoder.init()
    after, first = decoder.prefill(before, {0: np.array([1, 2, 3]), 1: np.array([4])})
    assert sorted(first) == [0, 1]
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(before.state))
    stepped, outcome, _ = decoder.step(after, np.array([True, True]), np.array([3, 1]))
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(after))
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(stepped))
    np.testing.assert_array_equal(np.asarray(outcome.bonus), np.asarray(stepped.seeds))


# -- the engine --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("speculative", [False, True])
def test_engine_admits_and_releases_mid_run_with_each_sequences_own_tokens(speculative):
    """Two rows, three sequences: B joins while A runs, C takes the first row released. Each sequence's
    tokens equal `generate` on it alone (exact mode: a row's tokens do not depend on the other rows)."""
    target, drafter = tiny_pair_model()
    prompts = {"A": [5, 6, 7, 8, 9], "B": [11, 12, 13], "C": [20, 21, 22, 23, 24, 25, 26]}
    wanted = {"A": 9, "B": 7, "C": 8}
    decoder = Decoder.for_prompts(target, drafter, speculative=speculative, lengths=[7, 7], max_new_tokens=12,
                                  verify="exact", width="adaptive", prefill_chunk=4, sample=False)
    engine = Engine(decoder)
    rows = {engine.admit(prompts["A"]): "A"}
    got: dict[str, list[int]] = {name: [] for name in prompts}
    waiting = ["B", "C"]
    for _ in range(60):
        for row, out in engine.step().items():
            name = rows[row]
            got[name] += out.tokens
            if len(got[name]) >= wanted[name]:
                engine.release(row)
                del rows[row]
        if waiting and engine.free_rows and (waiting[0] == "C" or len(got["A"]) >= 3):
            name = waiting.pop(0)
            rows[engine.admit(prompts[name])] = name
        if not rows and not waiting:
            break
    assert not rows and not waiting
    for name, prompt in prompts.items():
        alone = generate(target, [prompt], max_new_tokens=wanted[name], stop_tokens=())[0].token_ids
        assert got[name][: wanted[name]] == alone, name


def test_engine_refuses_a_prompt_when_no_row_is_free():
    target = tiny_target_model()
    engine = Engine(Decoder(target, None, batch=1, max_len=64, max_step=6, prefill_chunk=4))
    engine.admit([1, 2])
    with pytest.raises(CapacityError, match="no free row"):
        engine.admit([3])


@pytest.mark.parametrize("prompt, error, match", [
    ([1.7, 2.2], ArgumentError, "prompt must hold integer token ids, got dtype float64"),  # was truncated to [1, 2]
    ([True], ArgumentError, "prompt must hold integer token ids, got dtype bool"),
    ("abc", ArgumentError, "prompt must be token ids .*got a string"),
    ([], ArgumentError, "prompt needs at least one token"),
    ([[1, 2]], ArgumentError, "prompt must have 1 axes of token ids"),
])
def test_engine_refuses_a_prompt_that_is_not_token_ids(prompt, error, match):
    engine = Engine(Decoder(tiny_target_model(), None, batch=1, max_len=64, max_step=6, prefill_chunk=4))
    with pytest.raises(error, match=match):
        engine.admit(prompt)
    assert engine.free_rows == [0]


@pytest.mark.parametrize("field, value", [("batch", 0), ("batch", -1), ("max_len", 0), ("max_step", 2.5),
                                          ("prefill_chunk", 0), ("block", True)])
def test_decoder_sizes_must_be_positive_integers(field, value):
    """Refused naming the field, not a ZeroDivisionError or a negative shape while the state is built."""
    sizes = dict(batch=1, max_len=64, max_step=6, prefill_chunk=4)
    with pytest.raises(ArgumentError, match=f"{field} must be an integer >= 1, got {value!r}"):
        Decoder(tiny_target_model(), None, **{**sizes, field: value})


def test_a_row_without_room_is_refused_before_the_step_changes_anything():
    """A row that reaches max_len (its prompt filled max_len minus the step room) while another is admitted: the
    step is refused naming the row before the prefill runs (it ran first, and the refused step lost the first
    token it emitted); once the row is released, the other one steps on with its own tokens."""
    target = tiny_target_model()
    decoder = Decoder(target, None, batch=2, max_len=64, max_step=8, prefill_chunk=8)
    engine = Engine(decoder)
    row = engine.admit([7, 8, 9])
    alone = []
    while len(alone) < 4:
        alone += engine.step().get(row, Emitted([])).tokens
    engine = Engine(decoder)
    full = engine.admit(list(range(1, 57)))  # 56 tokens: max_len - max_step, the longest prompt admitted
    with pytest.raises(CapacityError, match=rf"running rows \[{full}\].* max_len 64; release them"):
        for _ in range(64):
            engine.step()
    row = engine.admit([7, 8, 9])
    with pytest.raises(CapacityError, match=rf"running rows \[{full}\]"):
        engine.step()
    engine.release(full)
    got = []
    while len(got) < 4:
        got += engine.step().get(row, Emitted([])).tokens
    assert got[:4] == alone[:4]


def test_an_engine_whose_step_raised_part_way_refuses_to_go_on():
    """A draft outside the vocabulary is found when its step is read back, after the device committed the step:
    the engine went on without that step's tokens (silently wrong output); now it refuses every later step."""
    target = tiny_target_model()
    bad = OracleProposer(np.zeros((1, 64), np.int32), np.zeros((1, 64), bool), VOCAB, bad_id=VOCAB + 5)
    engine = Engine(Decoder(target, bad, batch=1, max_len=64, max_step=6, prefill_chunk=4,
                            policy=WidthPolicy("fixed", fixed_q=2, max_q=2)))
    engine.admit([1, 2, 3])
    with pytest.raises(TokenIdError, match=f"drafted token id {VOCAB + 5}"):
        engine.step()
    with pytest.raises(DsparkError, match="raised part way.*build a new Engine"):
        engine.step()


# -- the engine under random schedules ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class TableProposer:
    """Proposes `table[p, s]`, the token after token s at position p in a known run, whichever row the sequence
    is in, with confidence `confidence[p, s]`: acceptances and rejections for sequences admitted at any time."""

    table: np.ndarray  # int32 [P, V]
    confidence: np.ndarray  # float32 [P, V]
    block_size: int = 5
    capture_layers: tuple[int, ...] = ()
    has_confidence: bool = True
    width_thresholds: tuple[float, ...] | None = None

    def init_state(self, batch, max_step):
        return jnp.asarray(self.table), jnp.asarray(self.confidence)

    def precompile(self, state, widths, sampled=None, *, invariant):
        pass

    def absorb(self, state, features, positions, *, invariant):
        return state

    def propose(self, state, seeds, seed_pos, *, invariant):
        return _table_lookup(*state, seeds, seed_pos, self.block_size)

    def propose_sampled(self, state, seeds, seed_pos, rows, purpose, with_logits, *, invariant):
        assert not with_logits  # exact mode: a candidate is accepted iff it is the target's keyed sample
        return (*self.propose(state, seeds, seed_pos, invariant=invariant), None)


@functools.partial(jax.jit, static_argnums=(4,))
def _table_lookup(table, confidence, seeds, seed_pos, block):
    previous, candidates, confidences = seeds, [], []
    for i in range(block):
        at = jnp.minimum(seed_pos + i, table.shape[0] - 1)
        candidates.append(table[at, previous])
        confidences.append(confidence[at, previous])
        previous = candidates[-1]
    return jnp.stack(candidates, axis=1), jnp.stack(confidences, axis=1)


SCHEDULE_PARAMS = [GREEDY, SamplingParams(0.8), SamplingParams(1.0, top_p=0.8), SamplingParams(1.3, top_k=20)]


@pytest.mark.parametrize("speculative", [False, True])
@settings(max_examples=3, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**32 - 1))
def test_engine_rows_follow_random_schedules_with_each_sequences_own_tokens(speculative, seed):
    """Sequences admitted at random steps and released at random points (right after admission, mid-run, a row
    freed and taken again in the same gap), greedy and sampled rows mixed, prompts of one to four prefill chunks,
    runs across window wraps and compressor boundaries: each finished sequence's tokens equal `generate` on it
    alone, and a released one's are a prefix of them (a released sequence may be admitted again). Speculative
    engines propose the plain runs' tokens (wrong at 30 %) at widths 1..3 that the other rows' widths widen, so
    steps accept and reject."""
    target, _ = tiny_pair_model()
    rng = np.random.default_rng(seed)
    sequences = []
    for _ in range(int(rng.integers(4, 8))):
        prompt = rng.integers(0, VOCAB, int(rng.integers(1, 14))).tolist()
        params = SCHEDULE_PARAMS[int(rng.integers(0, len(SCHEDULE_PARAMS)))]
        sequences.append((prompt, int(rng.integers(1, 25)), params, int(rng.integers(0, 2**32))))
    alone = [generate(target, [prompt], max_new_tokens=n, stop_tokens=(), prefill_chunk=4, seed=seed,
                      temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)[0].token_ids
             for prompt, n, params, seed in sequences]
    proposer, policy = None, WidthPolicy("fixed", fixed_q=1, max_q=1)
    if speculative:
        table = np.zeros((64, VOCAB), np.int32)
        confidence = np.full((64, VOCAB), 0.2, np.float32)
        for (prompt, _, _, _), tokens in zip(sequences, alone):
            run = prompt + tokens
            for p in range(len(run) - 1):
                wrong = rng.random() < 0.3
                table[p, run[p]] = (run[p + 1] + wrong) % VOCAB
                confidence[p, run[p]] = 0.3 if wrong else 0.95
        proposer, policy = TableProposer(table, confidence), WidthPolicy("confidence", max_q=3)
    engine = Engine(Decoder(target, proposer, batch=3, max_len=64, max_step=6, prefill_chunk=4, policy=policy,
                            sample=True))
    waiting, rows, got, done = list(range(len(sequences))), {}, {}, 0

    def admit():
        i = waiting.pop(0)
        prompt, _, params, seed = sequences[i]
        row = engine.admit(prompt, params, seed)
        rows[row], got[i] = i, []
        return row

    def release(row):
        engine.release(row)
        i = rows.pop(row)
        n = min(len(got[i]), len(alone[i]))  # a step may emit more than the tokens asked for
        assert got[i][:n] == alone[i][:n], f"sequence {i} {sequences[i]}"
        return i

    while rows or waiting:
        while waiting and engine.free_rows and rng.random() < 0.8:
            admit()
        action = rng.random()
        if action < 0.03 and rows:  # mid-run, and maybe again later from its start
            i = release(list(rows)[int(rng.integers(0, len(rows)))])
            if rng.random() < 0.5:
                waiting.append(i)
        elif action < 0.08 and waiting and engine.free_rows:  # right after admission
            waiting.append(rows[admit()])
            release(next(reversed(rows)))
        elif action < 0.13 and rows and waiting:  # and the row taken again at once
            release(list(rows)[int(rng.integers(0, len(rows)))])
            admit()
        for row, out in engine.step().items():
            i = rows[row]
            got[i] += out.tokens
            if len(got[i]) >= sequences[i][1]:
                release(row)
                done += 1
    assert done > 0


# -- logprobs --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_are_the_same_bits_plain_and_speculative_and_the_forwards_log_softmax(temperature):
    """Exact mode: each emitted token's logprob (the target's distribution, before temperature) has the same bits
    whether a plain step or a speculative step of any width emitted it, and equals log_softmax of `forward`."""
    target = tiny_target_model()
    prompts, new = [[5, 6, 7, 8, 9], [11, 12, 13]], 12
    kwargs = dict(max_new_tokens=new, stop_tokens=(), temperature=temperature, seed=3)
    plain = generate(target, prompts, **kwargs)
    spec = generate(target, prompts, drafter=oracle_for(prompts, plain, VOCAB, wrong_rate=0.3, seed=2), **kwargs)
    assert sum(s.matched for s in spec) > new  # most tokens came from accepted candidates, at several widths
    for prompt, p, s in zip(prompts, plain, spec):
        assert s.token_ids == p.token_ids and len(p.logprobs) == new
        assert s.logprobs == p.logprobs  # float32 values as Python floats: equal iff the same bits
        logits = forward(target, [prompt + p.token_ids])[0, len(prompt) - 1 : -1]
        want = np.asarray(jax.nn.log_softmax(logits, axis=-1))[np.arange(new), p.token_ids]
        np.testing.assert_allclose(p.logprobs, want, rtol=1e-5, atol=1e-5)
