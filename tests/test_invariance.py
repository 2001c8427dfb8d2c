"""Batch invariance (issue 42): a row's bits do not depend on the step's width or batch, on the CPU in float32.

The kernel-level properties (`kernels/rowwise.py`) over row counts, then the model's step over widths, batch
sizes, neighbours and positions (ring wraps, compressor boundaries) against plain decoding, through the same
checks `scripts/check_invariance.py` runs (`dsparkjax/testing/invariance.py`).
"""

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

from dsparkjax.decoding.decoder import Decoder
from dsparkjax.embedded import embedded_pair
from dsparkjax.decoding.proposer import load_drafter
from dsparkjax.errors import DsparkError
from dsparkjax.testing.oracle import OracleProposer
from dsparkjax.kernels import ffi, rowwise
from dsparkjax.target_api import load_target
from dsparkjax.testing import invariance

from model_helpers import tiny_target_model

pytestmark = pytest.mark.skipif(not ffi.available("cpu"), reason="needs the CPU FFI plugin")


def _rows_alone(f, x: np.ndarray) -> np.ndarray:
    """f applied to each row of x alone (a 1-row call each), stacked."""
    return np.concatenate([np.asarray(f(jnp.asarray(x[i : i + 1]))) for i in range(x.shape[0])])


@settings(max_examples=8, deadline=None, derandomize=True)
@given(rows=st.integers(1, 40), k=st.integers(1, 300), seed=st.integers(0, 100))
def test_rowwise_ops_give_each_row_its_one_row_bits(rows, k, seed):
    """row_sum, rms_norm and matmul (f32 and bf16 weights) of T rows == the same rows computed alone."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, k)).astype(np.float32)
    w = rng.normal(size=(24, k)).astype(np.float32)
    for f in (jax.jit(rowwise.row_sum), jax.jit(lambda a: rowwise.rms_norm(a, None, 1e-6)),
              jax.jit(lambda a: rowwise.matmul(a, jnp.asarray(w))),
              jax.jit(lambda a: rowwise.matmul(a, jnp.asarray(w, jnp.bfloat16)))):
        chex.assert_trees_all_equal(np.asarray(f(jnp.asarray(x))), _rows_alone(f, x))


def test_grouped_rows_do_not_depend_on_the_other_groups():
    """A group's products are the same bits whatever the number of groups and rows beside it."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, 12, 40)).astype(np.float32)
    w = rng.normal(size=(5, 9, 40)).astype(np.float32)
    f = jax.jit(rowwise.grouped_rows)
    full = np.asarray(f(jnp.asarray(x), jnp.asarray(w)))
    for g in range(5):
        alone = np.asarray(f(jnp.asarray(x[g : g + 1, :3]), jnp.asarray(w[g : g + 1])))
        chex.assert_trees_all_equal(full[g, :3], alone[0])
    np.testing.assert_allclose(full, np.einsum("gmk,gnk->gmn", x, w), rtol=1e-5, atol=1e-5)


@settings(max_examples=8, deadline=None, derandomize=True)
@given(rows=st.integers(1, 40), n=st.integers(1, 16), seed=st.integers(0, 100))
def test_tree_sum_gives_each_row_its_one_row_bits(rows, n, seed):
    """The invariant sums over short axes (reduce.tree_sum, fused by XLA) keep each row's bits, and are sums."""
    from dsparkjax.model import reduce

    x = np.random.default_rng(seed).normal(size=(rows, n, 3)).astype(np.float32)
    f = jax.jit(lambda a: reduce.tree_sum(a, 1))
    chex.assert_trees_all_equal(np.asarray(f(jnp.asarray(x))), _rows_alone(f, x))
    np.testing.assert_allclose(np.asarray(f(jnp.asarray(x))), x.sum(axis=1), rtol=1e-5, atol=1e-5)


def test_bit_differences_counts_bits():
    a = np.array([1.0, 2.0], np.float32)
    b = a.copy()
    b.view(np.uint32)[1] ^= 0b101
    assert invariance.bit_differences(a, b).tolist() == [0, 2]


@functools.lru_cache(maxsize=None)
def _setup(seed: int):
    target = tiny_target_model(seed)
    return target, invariance.prefilled(target, None, invariance.default_lengths(target, 6), seed)


@settings(max_examples=4, deadline=None, derandomize=True)
@given(seed=st.integers(0, 1), width=st.integers(2, 6), batch=st.integers(2, 5), order=st.integers(0, 10**6))
def test_step_rows_equal_plain_decoding(seed, width, batch, order):
    """Every row of a width-q step of B sequences (drawn with neighbours in random order, at positions past
    the window and across compressor boundaries) has plain decoding's logits, features and state bits."""
    target, setup = _setup(seed)
    diffs = invariance.check_target(target, setup, widths=(width,), batches=(batch,), seed=order)
    assert all(d.max_bits == 0 for d in diffs), invariance.report(diffs)
    assert {d.what for d in diffs} >= {"logits", "features", "state.layer1.comp_kv"}


def test_embedded_pair_is_batch_invariant():
    """The CI run of the checker on the embedded pair, target and drafter (widths 1, 3, 6; batches 1, 3)."""
    target_path, draft_path = embedded_pair()
    target = load_target(target_path)
    drafter = load_drafter(draft_path, target)
    setup = invariance.prefilled(target, drafter, invariance.default_lengths(target, 4), 0)
    diffs = invariance.check_target(target, setup, widths=(1, 3, 6), batches=(1, 3))
    diffs += invariance.check_drafter(drafter, setup, widths=(1, 3), batches=(1, 3))
    assert all(d.max_bits == 0 for d in diffs), invariance.report(diffs)
    assert invariance.report(diffs).endswith("max bit differences: 0")


def test_exact_mode_refuses_a_target_on_the_jnp_kernels():
    """Exact speculative verification needs the invariant step, which the jnp kernel reference cannot give;
    plain decoding has nothing to reproduce and runs there in any mode."""
    target = tiny_target_model()
    reference = dataclasses.replace(target, kernels="reference")
    oracle = OracleProposer(np.zeros((1, 64), np.int32), np.zeros((1, 64), bool), target.config.vocab_size)
    for verify in ("exact", "lossless"):
        with pytest.raises(DsparkError, match=f"verify='{verify}'"):
            Decoder(reference, oracle, batch=1, max_len=64, max_step=8, prefill_chunk=8, verify=verify)
    Decoder(reference, oracle, batch=1, max_len=64, max_step=8, prefill_chunk=8, verify="fast")
    Decoder(reference, None, batch=1, max_len=64, max_step=8, prefill_chunk=8)
