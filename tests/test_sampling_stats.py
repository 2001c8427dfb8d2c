"""Lossless speculative sampling on the trained pair (dsparkjax/data), tested statistically: a thousand
sequences of one prompt in one batch, each with its own seed, sample three tokens; the second and third are
decided by verification (an accepted candidate, a residual draw or the bonus token). Their joint law must be
the target's (softmax of `sampling.warp` of the logits `forward` computes), and plain sampling's must be
too: Pearson's chi-square must not reject at p = 0.001. A deliberately broken rule (resampling from p
instead of max(0, p − q) at a rejection) must be rejected, so the test can fail.

Power, and why 1024 sequences: at 2048 the broken rule's statistic was 264.0 on 38 degrees of freedom, a
noncentrality of 226, so 0.110 per sequence. At 1024 sequences (30 degrees of freedom once cells expecting
fewer than 5 are pooled, noncentrality 113) a deviation that size exceeds the p = 0.001 critical value
(59.7) with probability 0.999997 (noncentral chi-square), against 1 − 8e-17 at 2048: the same power
against it, from half the sampling (at 512 it would fall to 0.98). The lossless and plain runs gave p = 0.63
and 0.20 at 2048."""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsparkjax.decoding import program, verify
from dsparkjax.decoding.forward import forward
from dsparkjax.decoding.generate import generate
from dsparkjax.decoding.proposer import load_drafter
from dsparkjax.decoding.sampling import RowSampling, SamplingParams, warp
from dsparkjax.embedded import embedded_pair
from dsparkjax.target_api import load_target

PROMPT = [0, 507, 226, 53, 293, 266, 87, 279]  # "class Parser:\n" (BOS first), one prefill chunk
SEQUENCES = 1024  # the power argument above
PARAMS = SamplingParams(temperature=1.0, top_k=4)  # few enough outcomes (<= 64) for every cell to be counted


@pytest.fixture(scope="module")
def pair():
    target_path, draft_path = embedded_pair()
    target = load_target(target_path)
    return target, load_drafter(draft_path, target)


def sample_triples(target, drafter, **kwargs) -> collections.Counter:
    results = generate(target, [PROMPT] * SEQUENCES, drafter=drafter, max_new_tokens=3, stop_tokens=(),
                       temperature=PARAMS.temperature, top_k=PARAMS.top_k, seed=0, prefill_chunk=len(PROMPT),
                       **kwargs)
    return collections.Counter(tuple(r.token_ids) for r in results)


def target_law(target) -> dict[tuple[int, ...], float]:
    """P(t1, t2, t3) under the target for every triple, from forward's logits (top-k keeps at most 4^3):
    one batched forward per prefix length."""
    rows = RowSampling.of([PARAMS], [0])
    law = {(): 1.0}
    for _ in range(3):
        prefixes = sorted(law)
        logits = forward(target, [PROMPT + list(prefix) for prefix in prefixes], chunk=len(PROMPT))[:, -1]
        probs = np.asarray(jax.vmap(lambda x: jax.nn.softmax(warp(x[None], rows), axis=-1)[0])(jnp.asarray(logits)),
                           np.float64)
        law = {prefix + (int(t),): law[prefix] * probs[i, t] for i, prefix in enumerate(prefixes)
               for t in np.flatnonzero(probs[i])}
    return law


def chi_square_pvalue(counts: collections.Counter, law: dict[tuple[int, ...], float]) -> float:
    """Pearson's goodness of fit of `counts` to `law`; cells expecting fewer than 5 are pooled into one."""
    assert set(counts) <= set(law), "a sampled triple the target cannot produce"
    total = sum(counts.values())
    big = [k for k, p in law.items() if p * total >= 5]
    observed = np.array([counts.get(k, 0) for k in big] + [total - sum(counts.get(k, 0) for k in big)], np.float64)
    expected = np.array([law[k] * total for k in big] + [total - sum(law[k] * total for k in big)])
    if expected[-1] < 1e-9:
        observed, expected = observed[:-1], expected[:-1]
    stat = float(np.sum((observed - expected) ** 2 / expected))
    return float(jax.scipy.special.gammaincc((len(observed) - 1) / 2, stat / 2))


@pytest.fixture(scope="module")
def law(pair):
    return target_law(pair[0])


def test_lossless_spec_and_plain_sampling_follow_the_target_law(pair, law):
    target, drafter = pair
    spec = sample_triples(target, drafter, verify="lossless", width=3)
    plain = sample_triples(target, drafter, mode="ar")  # width-1 steps, sharing the lossless run's prefill
    assert chi_square_pvalue(spec, law) > 1e-3
    assert chi_square_pvalue(plain, law) > 1e-3


def test_the_statistical_test_rejects_a_broken_rule(pair, law, monkeypatch):
    target, drafter = pair
    monkeypatch.setattr(verify, "residual", lambda p, q: p)
    program.decode_program.cache_clear()  # a new decode program, traced with the broken rule
    try:
        broken = sample_triples(target, drafter, verify="lossless", width=3)
    finally:
        monkeypatch.undo()
        program.decode_program.cache_clear()
    assert chi_square_pvalue(broken, law) < 1e-3
