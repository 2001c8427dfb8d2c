"""The Lightning Indexer's top-k op (`kernels.indexer_topk`): FFI against the jnp reference, ties, short and empty
rows, batch invariance, and that entries past a row's length are never read.

Inputs are small integers, so every score is exact in float32 whatever the summation order: the FFI and the
reference must then agree pick for pick, ties included. Each test runs on the CPU plugin (CI) and, marked `gpu`,
on the CUDA plugin when JAX sees a GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsparkjax import kernels
from dsparkjax.errors import DsparkError


def integer_inputs(rng: np.random.Generator, b: int, q: int, heads: int, dim: int, n: int, distinct_keys: int
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(queries, keys, head_weights) float32 of small integers; keys repeat `distinct_keys` rows, so scores tie."""
    queries = rng.integers(-3, 4, (b, q, heads, dim)).astype(np.float32)
    table = rng.integers(-3, 4, (b, distinct_keys, dim)).astype(np.float32)
    keys = np.take_along_axis(table, rng.integers(0, distinct_keys, (b, n, 1)), axis=1)
    weights = rng.integers(-2, 3, (b, q, heads)).astype(np.float32)
    return queries, keys, weights


def run(device: jax.Device, backend: str, queries, keys, weights, lengths, k: int) -> tuple[np.ndarray, np.ndarray]:
    put = lambda a: jax.device_put(np.asarray(a), device)  # noqa: E731
    picks, real = kernels.indexer_topk(put(queries), put(keys), put(weights), put(np.asarray(lengths, np.int32)), k,
                                       backend=backend)
    return np.asarray(picks), np.asarray(real)


@pytest.mark.parametrize("heads,dim,distinct", [(4, 8, 3), (9, 16, 40), (64, 128, 5)])
def test_indexer_topk_matches_reference(device, cpu_device, heads, dim, distinct):
    """Lengths 0, 1, k−1, k, k+1 and N in one call (rows of different lengths), with many tied scores."""
    rng = np.random.default_rng(heads)
    n, k = 40, 6
    queries, keys, weights = integer_inputs(rng, 2, 3, heads, dim, n, distinct)
    lengths = np.array([[0, 1, k - 1], [k, k + 1, n]], np.int32)
    want = run(cpu_device, "reference", queries, keys, weights, lengths, k)
    got = run(device, "ffi", queries, keys, weights, lengths, k)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(got[1], np.arange(k) < lengths[..., None])


def test_indexer_topk_all_tied_picks_lowest_entries(device):
    """Equal scores everywhere: the first k visible entries, in ascending order."""
    queries, weights = np.ones((1, 1, 2, 4), np.float32), np.ones((1, 1, 2), np.float32)
    keys = np.ones((1, 50, 4), np.float32)
    picks, real = run(device, "ffi", queries, keys, weights, [[30]], 8)
    np.testing.assert_array_equal(picks[0, 0], np.arange(8))
    assert real.all()


@pytest.mark.parametrize("length", [300, 2047, 4100])
def test_indexer_topk_long_rows_match_reference(device, cpu_device, length):
    """Rows longer than a GPU tile and than k = 512, with ties across tiles."""
    rng = np.random.default_rng(length)
    queries, keys, weights = integer_inputs(rng, 1, 2, 8, 32, 4160, 64)
    lengths = np.array([[length, length // 3]], np.int32)
    want = run(cpu_device, "reference", queries, keys, weights, lengths, 512)
    got = run(device, "ffi", queries, keys, weights, lengths, 512)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


def test_indexer_topk_batch_invariant_and_blind_past_length(device):
    """Each row alone gives the same picks as in the batch, and NaN keys past every length change nothing."""
    rng = np.random.default_rng(7)
    n, k = 64, 5
    queries, keys, weights = integer_inputs(rng, 3, 2, 8, 16, n, 6)
    lengths = np.array([[3, 4], [17, 20], [40, 41]], np.int32)
    poisoned = keys.copy()
    poisoned[:, 41:] = np.nan
    together = run(device, "ffi", queries, poisoned, weights, lengths, k)
    for b in range(3):
        for q in range(2):
            alone = run(device, "ffi", queries[b:b + 1, q:q + 1], keys[b:b + 1, :41], weights[b:b + 1, q:q + 1],
                        lengths[b:b + 1, q:q + 1], k)
            np.testing.assert_array_equal(alone[0][0, 0], together[0][b, q])


def test_indexer_topk_reads_one_layer_of_stacked_keys(device):
    """With `layer`, the op uses that layer of a stack of keys `[L, B, N, d]` (a scanned body's, which the FFI op
    reads in place): the picks of the call on that layer's own keys, on the kernel and on the reference. The
    kernel clamps an index outside the stack into it, as XLA's dynamic-slice does, and never reads past it."""
    rng = np.random.default_rng(11)
    queries, keys, weights = integer_inputs(rng, 2, 3, 4, 8, 24, 24)
    stack = np.stack([keys, keys[:, ::-1].copy(), -keys])
    lengths = np.array([[5, 9, 24], [1, 12, 20]], np.int32)
    put = lambda a: jax.device_put(np.asarray(a), device)  # noqa: E731
    for backend, layers in (("ffi", [(0, 0), (1, 1), (2, 2), (-1, 0), (9, 2)]), ("reference", [(1, 1), (2, 2)])):
        for layer, held in layers:
            got = kernels.indexer_topk(put(queries), put(stack), put(weights), put(lengths), 4, backend=backend,
                                       layer=put(np.int32(layer)))
            want = run(device, backend, queries, stack[held], weights, lengths, 4)
            for g, w in zip(got, want):
                np.testing.assert_array_equal(np.asarray(g), w, err_msg=f"{backend} layer {layer}")


def test_indexer_topk_rejects_k_outside_the_buffer():
    queries, keys, weights = np.zeros((1, 1, 2, 4), np.float32), np.zeros((1, 3, 4), np.float32), np.zeros((1, 1, 2))
    with pytest.raises(DsparkError, match="k = 4 must be in 1..N = 3"):
        kernels.indexer_topk(queries, keys, jnp.asarray(weights), jnp.zeros((1, 1), jnp.int32), 4, backend="reference")
