"""Sampling (decoding/sampling.py, decoding/verify.py): the parameters, the warped target distribution, keyed
noise, exact speculative sampling (token-identical to plain sampling with the same seeds) and the lossless
rule checked by exact enumeration on small synthetic distributions, including a deliberately broken rule.
The statistical test of lossless decoding on the trained pair is tests/test_sampling_stats.py."""

from __future__ import annotations

import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from model_helpers import VOCAB, random_prompts, tiny_pair_model, tiny_target_model

from dsparkjax.decoding import sampling, verify
from dsparkjax.decoding.decoder import Decoder
from dsparkjax.decoding.engine import Engine
from dsparkjax.decoding.generate import generate
from dsparkjax.decoding.sampling import RowSampling, SamplingParams
from dsparkjax.errors import ArgumentError
from dsparkjax.testing.oracle import oracle_for


def ids(results) -> list[list[int]]:
    return [r.token_ids for r in results]


# -- parameters ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.1), "temperature must be a finite number >= 0"),
    (dict(temperature=float("nan")), "temperature must be a finite number"),
    (dict(temperature=1e300), r"temperature 1e\+300 does not survive float32 \(it becomes inf\)"),
    (dict(temperature=1e-300), r"temperature 1e-300 does not survive float32 \(it becomes 0.0\)"),
    (dict(top_k=-1), "top_k must be an integer >= 0"),
    (dict(top_k=2.5), "top_k must be an integer >= 0"),
    (dict(top_k=2**31), r"top_k must be an integer >= 0 .*and < 2\*\*31"),  # the rows hold int32
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(min_p=-0.5), r"min_p must be in \[0, 1\]"),
    (dict(min_p="0.1"), "min_p must be a finite number"),
])
def test_sampling_params_refuse_bad_values(kwargs, message):
    with pytest.raises(ArgumentError, match=message):
        SamplingParams(**kwargs)


def test_generate_refuses_bad_sampling_arguments():
    target = tiny_target_model()
    with pytest.raises(ArgumentError, match="top_p must be in"):
        generate(target, [[1, 2]], temperature=1.0, top_p=2.0)
    with pytest.raises(ArgumentError, match="seed must be an integer or a list of one per prompt"):
        generate(target, [[1, 2], [3]], temperature=1.0, seed=[1])
    with pytest.raises(ArgumentError, match=r"seed 1 must be an integer in \[0, 2\*\*32\)"):
        generate(target, [[1, 2], [3]], temperature=1.0, seed=[1, -4])
    with pytest.raises(ArgumentError, match="verify must be one of"):
        generate(target, [[1, 2]], verify="strict")


def test_greedy_engine_refuses_a_sampling_row():
    engine = Engine(Decoder(tiny_target_model(), None, batch=1, max_len=64, max_step=6, prefill_chunk=4))
    with pytest.raises(ArgumentError, match="decodes greedily"):
        engine.admit([1, 2], SamplingParams(temperature=0.7))


# -- the warped distribution ---------------------------------------------------------------------------------


def reference_warp(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The warping order of sampling.py's docstring, written out in numpy float64 for one row."""
    if params.greedy:
        return np.where(np.arange(logits.size) == np.argmax(logits), 0.0, -np.inf)
    x = (logits.astype(np.float64) - logits.max()) / params.temperature
    keep = np.ones(x.size, bool)
    if 0 < params.top_k < x.size:
        keep &= x >= np.sort(x)[::-1][params.top_k - 1]
    if params.top_p < 1:
        order = np.argsort(-np.where(keep, x, -np.inf), kind="stable")
        probs = np.exp(np.where(keep, x, -np.inf) - x[keep].max())
        probs /= probs.sum()
        before = np.cumsum(probs[order]) - probs[order]
        last = x[order][np.sum(before < params.top_p) - 1]
        keep &= x >= last
    if params.min_p > 0:
        keep &= np.exp(x - x.max()) >= params.min_p
    return np.where(keep, x, -np.inf)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(seed=st.integers(0, 10**6), temperature=st.sampled_from([0.0, 0.3, 0.7, 1.0, 1.5]),
       top_k=st.sampled_from([0, 1, 3, 7, 16]), top_p=st.sampled_from([1.0, 0.95, 0.6, 0.2]),
       min_p=st.sampled_from([0.0, 0.05, 0.3]))
def test_warp_keeps_the_documented_tokens(seed, temperature, top_k, top_p, min_p):
    """Which tokens survive, and their tempered logits, match a float64 reference of the documented order.
    Logits are spaced 1/8 apart so float32 rounding cannot move a boundary."""
    rng = np.random.default_rng(seed)
    logits = rng.permutation(np.arange(16, dtype=np.float32) / 8.0 + rng.integers(-3, 3))
    params = SamplingParams(temperature, top_k, top_p, min_p)
    got = np.asarray(sampling.warp(jnp.asarray(logits)[None], RowSampling.of([params], [0])))[0]
    want = reference_warp(logits, params)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    np.testing.assert_allclose(got[np.isfinite(got)], want[np.isfinite(want)], rtol=1e-6)


def test_a_tiny_temperature_samples_the_argmax():
    """Dividing raw logits by 5e-38 made 49.9 and 50.0 both inf, and every draw took the first of the tie."""
    logits = jnp.broadcast_to(jnp.asarray([49.9, 50.0, 3.0, -2.0], jnp.float32), (1, 8, 4))
    tokens, warped = sampling.draw(logits, RowSampling.of([SamplingParams(5e-38)], [0]),
                                   jnp.arange(8, dtype=jnp.int32)[None], sampling.TARGET)
    np.testing.assert_array_equal(np.asarray(tokens), 1)
    assert not np.isposinf(np.asarray(warped)).any()


def test_neutral_filters_leave_the_logits_bit_for_bit():
    """A row without filters gets the same bits whether or not another row of the step filters."""
    logits = jax.random.normal(jax.random.PRNGKey(0), (2, 3, VOCAB), jnp.float32)
    plain = RowSampling.of([SamplingParams(0.8)] * 2, [1, 2])
    mixed = RowSampling.of([SamplingParams(0.8), SamplingParams(0.8, top_k=5, top_p=0.5, min_p=0.1)], [1, 2])
    chex.assert_trees_all_equal(sampling.warp(logits, plain)[0], sampling.warp(logits, mixed)[0])
    assert np.isfinite(np.asarray(sampling.warp(logits, mixed)[1])).sum(axis=-1).max() <= 5


def test_draws_are_keyed_by_seed_and_position_not_row():
    """Permuting rows permutes the tokens; a different seed or position gives other noise; greedy rows take
    the argmax."""
    logits = jax.random.normal(jax.random.PRNGKey(1), (4, 2, VOCAB), jnp.float32)
    params = [SamplingParams(1.0), SamplingParams(0.7, top_k=50), SamplingParams(0.0), SamplingParams(1.3)]
    seeds = [5, 6, 7, 5]
    positions = jnp.asarray([[10, 11], [3, 4], [8, 9], [10, 11]], jnp.int32)
    tokens, _ = sampling.draw(logits, RowSampling.of(params, seeds), positions, sampling.TARGET)
    perm = np.array([2, 0, 3, 1])
    permuted, _ = sampling.draw(logits[perm], RowSampling.of([params[i] for i in perm], [seeds[i] for i in perm]),
                                positions[perm], sampling.TARGET)
    chex.assert_trees_all_equal(np.asarray(permuted), np.asarray(tokens)[perm])
    np.testing.assert_array_equal(np.asarray(tokens)[2], np.argmax(np.asarray(logits)[2], axis=-1))
    noise = sampling.gumbel(RowSampling.of(params, seeds), positions, sampling.TARGET, VOCAB)
    assert not np.array_equal(noise[0, 0], noise[0, 1])  # another position
    assert not np.array_equal(noise[0, 0], noise[1, 0])  # another seed
    np.testing.assert_array_equal(noise[0], noise[3])  # same seed and positions: same noise
    other = sampling.gumbel(RowSampling.of(params, seeds), positions, sampling.DRAFT, VOCAB)
    assert not np.array_equal(noise[0, 0], other[0, 0])  # another purpose


def test_draw_follows_the_warped_distribution():
    """Gumbel-max over many seeds samples softmax(warp(logits)): a chi-square test at p = 0.001."""
    logits = jnp.asarray([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]], jnp.float32)
    n = 20000
    params = SamplingParams(0.8, top_k=4, top_p=0.95)
    rows = RowSampling.of([params] * n, list(range(n)))
    tokens, warped = sampling.draw(jnp.broadcast_to(logits, (n, 6)), rows, jnp.full((n,), 3, jnp.int32),
                                   sampling.TARGET)
    probs = np.asarray(jax.nn.softmax(warped[0]))
    counts = np.bincount(np.asarray(tokens), minlength=6)
    assert counts[probs == 0].sum() == 0
    kept = probs > 0
    assert chi_square_pvalue(counts[kept], probs[kept] * n) > 1e-3


def chi_square_pvalue(observed: np.ndarray, expected: np.ndarray) -> float:
    """Pearson's goodness-of-fit p-value (cells with expected counts >= 5)."""
    stat = float(np.sum((observed - expected) ** 2 / expected))
    return float(jax.scipy.special.gammaincc((len(observed) - 1) / 2, stat / 2))


# -- the lossless rule, by exact enumeration ------------------------------------------------------------------


class Conditionals:
    """A synthetic autoregressive law over a small vocabulary: a random distribution per context, with
    `zeros` tokens masked out (as top-k / top-p leave them) or one-hot (`one_hot`: T -> 0 or greedy drafts)."""

    def __init__(self, vocab: int, seed: int, zeros: int = 0, one_hot: bool = False):
        self.vocab, self.rng, self.zeros, self.one_hot, self.table = vocab, np.random.default_rng(seed), zeros, one_hot, {}

    def __call__(self, context: tuple[int, ...]) -> np.ndarray:
        if context not in self.table:
            if self.one_hot:
                probs = np.eye(self.vocab)[self.rng.integers(self.vocab)]
            else:
                probs = self.rng.dirichlet(np.ones(self.vocab))
                probs[self.rng.permutation(self.vocab)[: self.zeros]] = 0
                probs /= probs.sum()
            self.table[context] = probs.astype(np.float32)
        return self.table[context]


def emitted_law(p: Conditionals, q: Conditionals, gamma: int, width: int, length: int) -> dict[tuple, float]:
    """The exact law of the first `length` tokens that speculative steps emit after an empty context: every
    draft path weighted by q, every coin outcome weighted by its probability (coin 0 accepts whenever
    p(x) > 0, coin 1 rejects whenever p(x) < q(x), the only outcomes of positive weight), the token after
    the accepted prefix weighted by verify.lossless_rule's final distribution (one batched call per context)."""
    law: dict[tuple, float] = {}
    rule = jax.jit(lambda *args: verify.lossless_rule(*args))  # traced here: sees a patched verify.residual

    def step(context: tuple[int, ...], weight: float) -> None:
        if len(context) >= length:
            law[context[:length]] = law.get(context[:length], 0.0) + weight
            return
        cases = []  # (drafts, accepted count, weight)
        for drafts in itertools.product(range(p.vocab), repeat=gamma):
            w_draft = np.prod([q(context + drafts[:j])[x] for j, x in enumerate(drafts)], dtype=np.float64)
            if w_draft == 0:
                continue
            ratio = [min(1.0, float(p(context + drafts[:j])[drafts[j]] / q(context + drafts[:j])[drafts[j]]))
                     for j in range(width - 1)]
            for n in range(width):  # accept the first n, then reject (n < width - 1) or stop
                w = weight * w_draft * np.prod(ratio[:n]) * (1 - ratio[n] if n < width - 1 else 1.0)
                if w > 0:
                    cases.append((drafts, n, w))
        rows = np.stack([np.stack([p(context + d[:j]) for j in range(width)]) for d, _, _ in cases])
        qs = np.stack([np.stack([q(context + d[:j]) for j in range(width - 1)]) for d, _, _ in cases])
        coins = np.array([[0.0 if j < n else 1.0 for j in range(width - 1)] for _, n, _ in cases], np.float32)
        matched, _, final = rule(jnp.asarray(rows), jnp.asarray(qs),
                                 jnp.asarray([d[: width - 1] for d, _, _ in cases], jnp.int32),
                                 jnp.full((len(cases),), width, jnp.int32), jnp.asarray(coins))
        np.testing.assert_array_equal(np.asarray(matched), [n for _, n, _ in cases])
        for (drafts, n, w), law_y in zip(cases, np.asarray(final, np.float64)):
            for y in np.flatnonzero(law_y):
                step(context + drafts[:n] + (int(y),), w * law_y[y])

    step((), 1.0)
    return law


def target_law(p: Conditionals, length: int) -> dict[tuple, float]:
    return {seq: float(np.prod([p(seq[:i])[t] for i, t in enumerate(seq)], dtype=np.float64))
            for seq in itertools.product(range(p.vocab), repeat=length)}


def law_distance(a: dict[tuple, float], b: dict[tuple, float]) -> float:
    return max(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


@pytest.mark.parametrize("vocab, gamma, width, p_kw, q_kw", [
    (3, 2, 3, {}, {}),  # dense p and q, every candidate verified
    (3, 3, 3, {}, {}),  # fewer verified than drafted
    (3, 3, 4, {}, {}),  # more verified
    (3, 2, 3, dict(zeros=1), {}),  # p with masked tokens (top-k / top-p)
    (3, 2, 3, {}, dict(one_hot=True)),  # greedy (point-mass) drafts
    (3, 2, 3, dict(one_hot=True), {}),  # T -> 0 target
    (4, 2, 3, dict(zeros=2), dict(zeros=1)),
])
def test_lossless_rule_emits_the_target_law(vocab, gamma, width, p_kw, q_kw):
    """Output-prefix law of lossless speculative steps == product of the target conditionals."""
    p, q = Conditionals(vocab, 1, **p_kw), Conditionals(vocab, 2, **q_kw)
    assert law_distance(emitted_law(p, q, gamma, width, 3), target_law(p, 3)) < 1e-6


def test_enumeration_catches_a_residual_of_the_drafted_token_only(monkeypatch):
    """A broken rule (resampling from p itself at a rejection instead of max(0, p - q)) is caught."""
    p, q = Conditionals(3, 1), Conditionals(3, 2)
    monkeypatch.setattr(verify, "residual", lambda p, q: p)
    assert law_distance(emitted_law(p, q, 2, 3, 3), target_law(p, 3)) > 1e-2


# -- exact speculative sampling == plain sampling -------------------------------------------------------------


@settings(max_examples=6, deadline=None, derandomize=True)
@given(model=st.integers(0, 1), batch=st.sampled_from([1, 3]), width=st.sampled_from([2, 4, 6, "adaptive"]),
       params=st.sampled_from([SamplingParams(0.7), SamplingParams(1.0), SamplingParams(1.3, top_k=20),
                               SamplingParams(0.9, top_p=0.8, min_p=0.02)]),
       data=st.data())
def test_exact_spec_sampling_equals_plain_sampling(model, batch, width, params, data):
    """Same seeds: speculative output == plain sampled output token for token, with an oracle that proposes
    the plain run's tokens (acceptances) and is wrong at 40 % of positions (rejections)."""
    target = tiny_target_model(model)
    rng = np.random.default_rng(data.draw(st.integers(0, 10**6)))
    prompts = random_prompts(rng, batch, max_len=12)
    seeds = rng.integers(0, 2**32, batch).tolist()
    kwargs = dict(max_new_tokens=data.draw(st.integers(12, 20)), stop_tokens=(), temperature=params.temperature,
                  top_k=params.top_k, top_p=params.top_p, min_p=params.min_p, seed=seeds)
    plain = generate(target, prompts, **kwargs)
    oracle = oracle_for(prompts, plain, VOCAB, wrong_rate=0.4, seed=model)
    spec = generate(target, prompts, drafter=oracle, width=width, **kwargs)
    chex.assert_trees_all_equal([np.asarray(s.token_ids) for s in spec], [np.asarray(p.token_ids) for p in plain])
    assert sum(s.matched for s in spec) > 0, "no multi-token acceptance happened"
    assert sum(s.offered - s.matched for s in spec) > 0, "no rejection happened"


@pytest.mark.parametrize("width", ["adaptive", 5])
def test_exact_spec_sampling_with_the_dspark_drafter(width):
    """The real DSpark drafter sampling with the target's keyed noise: output == plain sampling."""
    target, drafter = tiny_pair_model()
    prompts = random_prompts(np.random.default_rng(9), 3, max_len=12)
    kwargs = dict(max_new_tokens=12, stop_tokens=(), temperature=0.8, top_k=40, seed=[3, 1, 4])
    plain = generate(target, prompts, drafter=drafter, mode="ar", **kwargs)
    spec = generate(target, prompts, drafter=drafter, width=width, **kwargs)
    assert ids(spec) == ids(plain)
    assert all(0 <= s.matched <= s.offered and s.offered > 0 for s in spec)


class ProposalLog:
    """A proposer passing every call to `inner` that keeps the third output of each sampled proposal."""

    def __init__(self, inner):
        self.inner, self.drawn_from = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose_sampled(self, *args, **kwargs):
        out = self.inner.propose_sampled(*args, **kwargs)
        self.drawn_from.append(out[2])
        return out


def test_only_the_lossless_proposal_returns_the_logits_it_drew_from():
    """Exact mode's sampled proposals return no [B, K, V] logits (only the lossless rule reads q); lossless
    mode's return them; the candidates and confidences are the same either way."""
    target, drafter = tiny_pair_model()
    prompts = random_prompts(np.random.default_rng(10), 2)
    for verify_mode, wanted in (("exact", False), ("lossless", True)):
        log = ProposalLog(drafter)
        generate(target, prompts, drafter=log, verify=verify_mode, width=6, max_new_tokens=6, stop_tokens=(),
                 temperature=0.9, seed=[5, 6])
        assert log.drawn_from and all((q is not None) == wanted for q in log.drawn_from), verify_mode
    decoder = Decoder.for_prompts(target, drafter, speculative=True, lengths=[len(p) for p in prompts],
                                  max_new_tokens=6, verify="exact", width=6, prefill_chunk=16, sample=True)
    loop = decoder.init().replace(sampling=RowSampling.of([SamplingParams(0.9)] * 2, [5, 6]))
    loop, _ = decoder.prefill(loop, {row: np.asarray(p) for row, p in enumerate(prompts)})
    args = (loop.proposer, loop.seeds, loop.state.length, loop.sampling, sampling.DRAFT)
    candidates, confidences, none = drafter.propose_sampled(*args, False, invariant=decoder.drafts_invariant)
    *same, logits = drafter.propose_sampled(*args, True, invariant=decoder.drafts_invariant)
    assert none is None
    chex.assert_shape(logits, (2, drafter.block_size, VOCAB))
    chex.assert_trees_all_equal(same, [candidates, confidences])


def test_a_sequence_samples_the_same_tokens_in_any_batch_and_row():
    """Same seed and prompt: the same tokens alone, in a batch of 4 at another row, and speculatively."""
    target = tiny_target_model()
    prompts = random_prompts(np.random.default_rng(11), 4, max_len=12)
    kwargs = dict(max_new_tokens=10, stop_tokens=(), temperature=1.0)
    batch = generate(target, prompts, seed=[10, 20, 30, 40], **kwargs)
    alone = generate(target, prompts[2:3], seed=[30], **kwargs)
    assert alone[0].token_ids == batch[2].token_ids
    shuffled = generate(target, prompts[::-1], seed=[40, 30, 20, 10], **kwargs)
    assert ids(shuffled)[::-1] == ids(batch)
    assert ids(generate(target, prompts, seed=[11, 21, 31, 41], **kwargs)) != ids(batch)


def test_rows_with_different_parameters_share_one_engine():
    """Per-row sampling parameters: greedy rows give greedy output, sampled rows their own seeded output,
    all in one engine whose programs compile once."""
    target = tiny_target_model()
    prompts = random_prompts(np.random.default_rng(12), 3, max_len=12)
    hot, cold = SamplingParams(1.2, top_p=0.9), SamplingParams(0.5, top_k=8)
    greedy = generate(target, prompts[:1], max_new_tokens=8, stop_tokens=())
    want_hot = generate(target, prompts[1:2], max_new_tokens=8, stop_tokens=(), temperature=1.2, top_p=0.9, seed=7)
    want_cold = generate(target, prompts[2:], max_new_tokens=8, stop_tokens=(), temperature=0.5, top_k=8, seed=9)
    decoder = Decoder.for_prompts(target, None, speculative=False, lengths=[len(p) for p in prompts],
                                  max_new_tokens=8, verify="exact", width="adaptive", prefill_chunk=16, sample=True)
    engine = Engine(decoder)
    rows = [engine.admit(prompts[0]), engine.admit(prompts[1], hot, 7), engine.admit(prompts[2], cold, 9)]
    out = {row: [] for row in rows}
    emitted = engine.prefill()
    while any(len(t) < 8 for t in out.values()):
        for row, e in emitted.items():
            out[row].extend(e.tokens)
        emitted = engine.step()
    assert [out[r][:8] for r in rows] == [greedy[0].token_ids, want_hot[0].token_ids, want_cold[0].token_ids]


def test_temperature_zero_is_greedy_in_every_mode():
    target, drafter = tiny_pair_model()
    prompts = random_prompts(np.random.default_rng(13), 2, max_len=12)
    greedy = generate(target, prompts, max_new_tokens=8, stop_tokens=())
    for verify_mode in ("exact", "lossless"):
        assert ids(generate(target, prompts, drafter=drafter, verify=verify_mode, max_new_tokens=8,
                            stop_tokens=())) == ids(greedy)


def test_lossless_spec_is_reproducible():
    """Lossless mode: tokens depend on the seeds only (same run twice, and a sequence alone, on the
    batch-invariant step); candidates are accepted."""
    target, drafter = tiny_pair_model()
    prompts = random_prompts(np.random.default_rng(14), 3, max_len=12)
    kwargs = dict(drafter=drafter, verify="lossless", max_new_tokens=12, stop_tokens=(), temperature=1.0, width=6)
    first = generate(target, prompts, seed=[1, 2, 3], **kwargs)
    assert ids(generate(target, prompts, seed=[1, 2, 3], **kwargs)) == ids(first)
    assert ids(generate(target, prompts[1:2], seed=[2], **kwargs)) == ids(first)[1:2]
    assert all(r.offered > 0 and len(r.token_ids) == 12 for r in first)
