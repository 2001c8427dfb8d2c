"""The width policy: q = 1..6 from survival thresholds, thresholds that travel in the drafter GGUF, and their fit
from calibration data (`dsparkjax/training/calibration.py`)."""

from __future__ import annotations

import dataclasses
import functools
import os

import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGUFValueType
from model_helpers import scratch_dir, tiny_pair_paths

from dsparkjax.decoding.decoder import Decoder
from dsparkjax.decoding.generate import generate
from dsparkjax.decoding.proposer import load_drafter
from dsparkjax.decoding.width import (
    LUCEBOX_THRESHOLDS,
    SURVIVAL_THRESHOLDS_KEY,
    WidthPolicy,
    policy_for,
    thresholds_from_metadata,
)
from dsparkjax.errors import ArgumentError, GGUFContractError
from dsparkjax.ggufio.reader import GGUFFile
from dsparkjax.ggufio.writer import copy_with_metadata
from dsparkjax.target_api import load_target
from dsparkjax.training import calibration


def choose(policy: WidthPolicy, confidences) -> list[int]:
    conf = jnp.asarray(confidences, jnp.float32)
    return np.asarray(policy.choose(conf, jnp.zeros(conf.shape[0]))).tolist()


def test_confidence_policy_chooses_every_width_from_one_to_six():
    policy = WidthPolicy("confidence", thresholds=(0.5, 0.4, 0.3, 0.2, 0.1))
    conf = [[0.4, 1, 1, 1, 1],  # s1 < .5: plain step
            [0.9, 0.4, 1, 1, 1],  # s2 = .36 < .4, though s3 = .36 >= .3: the run stops at the first miss
            [0.9, 0.5, 0.6, 1, 1],  # s3 = .27 < .3
            [0.9, 0.9, 0.4, 0.5, 1],  # s4 = .162 < .2
            [0.9, 0.9, 0.9, 0.3, 0.3],  # s5 = .066 < .1
            [1, 1, 1, 1, 1]]
    assert choose(policy, conf) == [1, 2, 3, 4, 5, 6]
    assert choose(dataclasses.replace(policy, max_q=3), conf) == [1, 2, 3, 3, 3, 3]
    assert choose(WidthPolicy("confidence", thresholds=(0.5,)), conf) == [1, 2, 2, 2, 2, 2]
    assert choose(WidthPolicy("confidence", thresholds=()), conf) == [1] * 6


def test_lucebox_thresholds_are_its_p2_p3_rule():
    conf = [[0.5, 0.5, 0.9, 1, 1], [0.7, 0.6, 0.5, 1, 1], [0.7, 0.6, 0.8, 1, 1], [0.01, 0.01, 0.01, 0.01, 0.01]]
    # P2 = .25 -> 2;  P2 = .42, P3 = .21 -> 3;  P3 = .336 -> 4;  never below 2.
    assert choose(WidthPolicy(), conf) == [2, 3, 4, 2]
    assert WidthPolicy().thresholds == LUCEBOX_THRESHOLDS


@pytest.mark.parametrize("bad", [(0.5, 1.5), (-0.1,), (float("nan"),), ("0.5",), (True,), "0.5", 0.5])
def test_bad_thresholds_are_refused(bad):
    with pytest.raises(ArgumentError, match="thresholds"):
        WidthPolicy("confidence", thresholds=bad)


def test_thresholds_given_as_a_list_make_a_hashable_policy():
    policy = WidthPolicy("confidence", thresholds=[0.5, 0.25])
    assert policy.thresholds == (0.5, 0.25) and hash(policy) == hash(WidthPolicy("confidence", thresholds=(0.5, 0.25)))


@dataclasses.dataclass(frozen=True)
class _Proposer:
    has_confidence: bool = True
    width_thresholds: tuple[float, ...] | None = None


def test_adaptive_takes_the_proposers_thresholds_and_the_decoders_cost():
    fitted = _Proposer(width_thresholds=(0.3, 0.5))
    assert policy_for("adaptive", fitted, 6) == WidthPolicy("confidence", thresholds=(0.3, 0.5))
    assert policy_for("adaptive", _Proposer(), 6).thresholds == LUCEBOX_THRESHOLDS
    assert policy_for("adaptive", _Proposer(has_confidence=False), 6).kind == "ewma"
    given = WidthPolicy("confidence", thresholds=(0.1,), max_q=6)
    assert policy_for(given, fitted, 4) == dataclasses.replace(given, max_q=4)
    assert policy_for("3", fitted, 6) == WidthPolicy("fixed", fixed_q=3, max_q=6)
    assert policy_for(np.int64(3), fitted, 6) == WidthPolicy("fixed", fixed_q=3, max_q=6)


@pytest.mark.parametrize("width", [True, 2.0, "٣", "+3", "", None])
def test_a_width_that_is_no_integer_is_refused(width):
    """True is no width (it read as q = 1), nor a non-ASCII digit that int() reads as 3."""
    with pytest.raises(ArgumentError, match="width must be 'adaptive' or an integer in"):
        policy_for(width, _Proposer(), 6)


@pytest.mark.parametrize("value", [[0.5, 0.4, 0.3, 0.2, 0.1, 0.0], [0.5, 2.0], [float("nan")], ["x"], "0.5", 0.5])
def test_bad_threshold_metadata_names_the_key(value):
    with pytest.raises(GGUFContractError, match=SURVIVAL_THRESHOLDS_KEY):
        thresholds_from_metadata({SURVIVAL_THRESHOLDS_KEY: value}, 5, "draft.gguf")


def test_threshold_metadata_is_optional():
    assert thresholds_from_metadata({}, 5, "draft.gguf") is None
    assert thresholds_from_metadata({SURVIVAL_THRESHOLDS_KEY: []}, 5, "draft.gguf") == ()
    assert thresholds_from_metadata({SURVIVAL_THRESHOLDS_KEY: [0.25, 1]}, 5, "draft.gguf") == (0.25, 1.0)


@functools.lru_cache(maxsize=None)
def _fitted_pair() -> tuple[str, str, str]:
    """A tiny pair and a copy of its drafter with thresholds written as calibrate.py writes them."""
    target_path, draft_path = tiny_pair_paths()
    fitted = os.path.join(scratch_dir("width-"), "draft.gguf")
    copy_with_metadata(draft_path, fitted, {})
    calibration.write_thresholds(fitted, (0.25, 0.5))
    return target_path, draft_path, fitted


def test_thresholds_travel_in_the_drafter_gguf_with_its_bytes_unchanged():
    target_path, draft_path, fitted = _fitted_pair()
    before, after = GGUFFile(draft_path), GGUFFile(fitted)
    assert {k: v for k, v in after.metadata.items() if k != SURVIVAL_THRESHOLDS_KEY} == before.metadata
    assert list(after.tensors) == list(before.tensors)
    for name, info in before.tensors.items():
        assert after.tensors[name].ggml_type == info.ggml_type and after.tensors[name].shape == info.shape
        np.testing.assert_array_equal(after.raw(name), before.raw(name))
    target = load_target(target_path)
    assert load_drafter(draft_path, target).width_thresholds is None
    drafter = load_drafter(fitted, target)
    assert drafter.width_thresholds == (0.25, 0.5)
    fast = Decoder.for_prompts(target, drafter, speculative=True, lengths=[4], max_new_tokens=8, verify="fast",
                               width="adaptive", prefill_chunk=4, sample=False)
    assert fast.policy == WidthPolicy("confidence", thresholds=(0.25, 0.5))
    exact = Decoder.for_prompts(target, drafter, speculative=True, lengths=[4], max_new_tokens=8, verify="exact",
                                width="adaptive", prefill_chunk=4, sample=False)
    assert exact.policy == fast.policy  # exact mode runs the chosen width too (batch-invariant programs per width)


def test_a_fit_with_no_candidate_worth_verifying_is_stored_as_certainty_only(tmp_path):
    _, draft_path, _ = _fitted_pair()
    path = str(tmp_path / "draft.gguf")
    copy_with_metadata(draft_path, path, {})
    calibration.write_thresholds(path, ())
    assert GGUFFile(path).metadata[SURVIVAL_THRESHOLDS_KEY] == [1.0]


def test_a_drafter_with_bad_thresholds_is_refused_at_load(tmp_path):
    target_path, draft_path, _ = _fitted_pair()
    bad = str(tmp_path / "draft.gguf")
    copy_with_metadata(draft_path, bad, {SURVIVAL_THRESHOLDS_KEY: ([0.5, 1.5], GGUFValueType.FLOAT32)})
    with pytest.raises(GGUFContractError, match=SURVIVAL_THRESHOLDS_KEY):
        load_drafter(bad, load_target(target_path))


def test_exact_mode_offers_what_the_thresholds_choose():
    """The tiny pair's head is saturated (c ≈ [1, 0, ...]): the fitted (0.25, 0.5) offer about one candidate a
    step, not the whole block, and the output stays plain decoding's."""
    target_path, _, fitted = _fitted_pair()
    target = load_target(target_path)
    drafter = load_drafter(fitted, target)
    (out,) = generate(target, [[3, 4, 5]], drafter=drafter, max_new_tokens=10, stop_tokens=())
    (plain,) = generate(target, [[3, 4, 5]], max_new_tokens=10, stop_tokens=())
    assert 0 < out.offered < 2 * out.steps < drafter.block_size * out.steps and out.token_ids == plain.token_ids


def test_isotonic_threshold_is_where_calibrated_survival_reaches_break_even():
    rng = np.random.default_rng(0)
    predicted = rng.uniform(size=4000)
    observed = rng.uniform(size=4000) < np.where(predicted > 0.6, 0.8, 0.2)
    t = calibration.threshold(predicted, observed, 0.5)
    assert 0.55 < t < 0.65
    xs, fit = calibration.isotonic(predicted, observed)
    assert np.all(np.diff(xs) >= 0) and np.all(np.diff(fit) >= 0)
    assert calibration.threshold(predicted, np.ones(4000, bool), 0.5) == 0.0
    assert calibration.threshold(predicted, np.zeros(4000, bool), 0.5) is None


def test_fit_stops_at_the_first_candidate_never_worth_verifying():
    rng = np.random.default_rng(1)
    conf = rng.uniform(0.5, 1.0, size=(3000, 5)).astype(np.float32)
    matches = rng.uniform(size=(3000, 5)) < conf  # a calibrated head: P(match) = c
    matches[:, 2] = False  # candidate 3 never matches
    proposals = calibration.Proposals(conf, matches)
    thresholds = calibration.fit_thresholds(proposals, 0.5)
    assert len(thresholds) == 2
    assert 0.45 < thresholds[1] < 0.6  # calibrated: survival reaches 0.5 where c1·c2 does
    assert thresholds[0] < 0.55  # c1 >= 0.5 everywhere: (almost) every first candidate is worth it


def test_auc():
    assert calibration.auc(np.array([0.1, 0.2, 0.8, 0.9]), np.array([0, 0, 1, 1])) == 1.0
    assert calibration.auc(np.array([0.9, 0.8, 0.2, 0.1]), np.array([0, 0, 1, 1])) == 0.0
    assert calibration.auc(np.array([0.5, 0.5]), np.array([0, 1])) == 0.5
    assert calibration.auc(np.array([0.5, 0.6]), np.array([1, 1])) is None
