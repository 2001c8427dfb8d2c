"""Kernels (`dsparkjax.kernels`): FFI vs jnp reference vs numpy dequantize-then-matmul, and batch invariance.

Every op runs on each available platform: "cpu" always (CI), "gpu" (marked `gpu`) when JAX sees a GPU.
Packed weights are random bytes made valid (finite fp16 scales, ROCm scale bytes <= 0x7E), so every code
of every format is exercised, not only what a quantizer would produce.
"""

from __future__ import annotations

import _ctypes
import functools
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsparkjax import formats, kernels
from dsparkjax.errors import DsparkError, FormatError, UnsupportedTypeError
from dsparkjax.formats import GGMLType, block_size, type_size
from dsparkjax.kernels import rowwise
from dsparkjax.model import hc as hc_ref
from dsparkjax.testing import synthetic, timing

TYPES = sorted(kernels.KERNEL_TYPES)
INT_PATH_TYPES = [GGMLType.Q8_0, GGMLType.Q2_K, GGMLType.Q4_K, GGMLType.IQ2_XXS]  # the formats of the GPU integer path


def random_packed(rng: np.random.Generator, t: GGMLType, rows: tuple[int, ...], k: int) -> np.ndarray:
    """Random valid packed rows uint8 `[*rows, row_bytes]` of type t, as a host array."""
    return np.asarray(synthetic.random_packed(jax.random.PRNGKey(int(rng.integers(2**31))), t, rows, k))


def _block_k(t: GGMLType) -> int:
    return 8 if block_size(t) == 1 else block_size(t)


def assert_matmul_close(got: np.ndarray, want: np.ndarray, bound: np.ndarray) -> None:
    """|got - want| <= 2e-5 · Σ|x||w| + 1e-6: fp32 sums of the same products in a different order."""
    err = np.abs(np.asarray(got, np.float64) - want)
    assert np.all(err <= 2e-5 * bound + 1e-6), f"max err {err.max()}, bound {bound.max()}"


def assert_matches_dense(got: np.ndarray, x: np.ndarray, dense: np.ndarray) -> None:
    """assert_matmul_close against float64 `x [T, K] @ dense[N, K]ᵀ`."""
    x64, dense = np.asarray(x, np.float64), np.asarray(dense, np.float64)
    assert_matmul_close(got, x64 @ dense.T, np.abs(x64) @ np.abs(dense).T)


def assert_moe_matches_dense(got: np.ndarray, x: np.ndarray, chosen: np.ndarray) -> None:
    """assert_matmul_close against float64 `got[t, j] = chosen[t, j] @ x[t]`, chosen `[T, k, N, K]` (each
    token's selected expert matrices)."""
    x64, chosen = np.asarray(x, np.float64), np.asarray(chosen, np.float64)
    want = np.einsum("tk,tjnk->tjn", x64, chosen)
    assert_matmul_close(got, want, np.einsum("tk,tjnk->tjn", np.abs(x64), np.abs(chosen)))


def _put(dev: jax.Device, *arrays: np.ndarray):
    return [jax.device_put(a, dev) for a in arrays]


# Jitted entry points: one compile per shape instead of op-by-op dispatch of the jnp reference.
@functools.partial(jax.jit, static_argnames=("ggml_type", "backend", "mma"))
def _qmatmul(x, w, ggml_type, backend, mma="auto"):
    return kernels.qmatmul(x, w, ggml_type, backend=backend, mma=mma)


@functools.partial(jax.jit, static_argnames=("ggml_type", "backend"))
def _qmatmul_id(x, w, ids, ggml_type, backend):
    return kernels.qmatmul_id(x, w, ids, ggml_type, backend=backend)


# --------------------------------------------------------------------------- packed matmul
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_dequantize_gives_the_formats_bits(ggml_type):
    """The jnp decoders the reference kernels use give `formats.dequantize`'s values bit for bit (gguf-py's for the
    standard types, Q4_K included), on random valid blocks."""
    k = 2 * _block_k(ggml_type)
    w = random_packed(np.random.default_rng(int(ggml_type)), ggml_type, (3, 5), k)
    got = np.asarray(jax.jit(kernels.dequantize, static_argnums=(1, 2))(w, ggml_type, k))
    np.testing.assert_array_equal(got.view(np.uint32), formats.dequantize(w, ggml_type, (3, 5, k)).view(np.uint32))


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    n=st.sampled_from([1, 3, 7, 16]),
    nblocks=st.sampled_from([1, 3, 4]),  # 4: Q8_0, IQ2_XXS rows 4-byte aligned (GPU integer path; K-quants' always)
    t_rows=st.integers(1, 8),
    bf16=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_qmatmul_matches_references(device, ggml_type, n, nblocks, t_rows, bf16, seed):
    rng = np.random.default_rng(seed)
    k = nblocks * _block_k(ggml_type)
    w = random_packed(rng, ggml_type, (n,), k)
    x = rng.standard_normal((t_rows, k)).astype(np.float32)
    if bf16:
        x = np.asarray(jnp.asarray(x, jnp.bfloat16))
    xd, wd = _put(device, x, w)
    got = np.asarray(_qmatmul(xd, wd, ggml_type, "ffi"))
    ref = np.asarray(_qmatmul(xd, wd, ggml_type, "reference"))
    dense = formats.dequantize(w, ggml_type, (n, k))
    assert got.shape == (t_rows, n) and got.dtype == np.float32
    assert_matches_dense(got, x, dense)
    assert_matches_dense(ref, x, dense)


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_qmatmul_batch_invariant(device, ggml_type):
    rng = np.random.default_rng(int(ggml_type))
    k = 2 * _block_k(ggml_type) if block_size(ggml_type) > 32 else 1024 + 64
    w = random_packed(rng, ggml_type, (37,), k)
    x = rng.standard_normal((11, k)).astype(np.float32)
    (wd,) = _put(device, w)
    f = functools.partial(_qmatmul, ggml_type=ggml_type, backend="ffi")
    full = np.asarray(f(jax.device_put(x, device), wd))
    for t_rows in (1, 2, 3, 4, 5, 8, 11):
        part = np.asarray(f(jax.device_put(x[:t_rows], device), wd))
        np.testing.assert_array_equal(part, full[:t_rows])
    # other neighbours, other positions
    y = np.asarray(f(jax.device_put(np.roll(x, 3, axis=0)[:6], device), wd))
    np.testing.assert_array_equal(y, np.roll(full, 3, axis=0)[:6])


# --------------------------------------------------------------------------- MoE matmul by id
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    n=st.sampled_from([3, 8]),
    t_rows=st.integers(1, 8),
    topk=st.sampled_from([1, 3, 6]),
    seed=st.integers(0, 2**31 - 1),
)
def test_qmatmul_id_matches_references(device, ggml_type, n, t_rows, topk, seed):
    rng = np.random.default_rng(seed)
    n_experts, k = 5, 2 * _block_k(ggml_type)
    w = random_packed(rng, ggml_type, (n_experts, n), k)
    x = rng.standard_normal((t_rows, k)).astype(np.float32)
    ids = rng.integers(0, n_experts, (t_rows, topk)).astype(np.int32)  # duplicates across and within tokens
    xd, wd, idd = _put(device, x, w, ids)
    got = np.asarray(_qmatmul_id(xd, wd, idd, ggml_type, "ffi"))
    ref = np.asarray(_qmatmul_id(xd, wd, idd, ggml_type, "reference"))
    chosen = formats.dequantize(w, ggml_type, (n_experts, n, k))[ids]  # [T, k, N, K]
    assert got.shape == (t_rows, topk, n)
    assert_moe_matches_dense(got, x, chosen)
    assert_moe_matches_dense(ref, x, chosen)


def test_qmatmul_id_invalid_ids_give_zero_rows(device):
    rng = np.random.default_rng(1)
    t = GGMLType.Q8_0
    w = random_packed(rng, t, (3, 4), 64)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    ids = np.array([[0, 3], [-1, 2]], np.int32)
    for backend in ("ffi", "reference"):
        y = np.asarray(_qmatmul_id(*_put(device, x, w, ids), t, backend))
        assert np.all(y[0, 1] == 0) and np.all(y[1, 0] == 0) and np.any(y[0, 0] != 0)


@pytest.mark.parametrize("ggml_type", INT_PATH_TYPES, ids=lambda t: t.name)
def test_qmatmul_id_without_experts_gives_zero_rows(device, ggml_type):
    """A weight of zero experts: every id is out of range, so every row is zero (not an error, not a crash)."""
    rng = np.random.default_rng(2)
    k = 256
    w = random_packed(rng, ggml_type, (0, 5), k)
    x = rng.standard_normal((3, k)).astype(np.float32)
    ids = np.array([[0, 1], [2, -1], [7, 0]], np.int32)
    for backend in ("ffi", "reference"):
        y = np.asarray(_qmatmul_id(*_put(device, x, w, ids), ggml_type, backend))
        assert y.shape == (3, 2, 5) and np.all(y == 0), backend


@pytest.mark.parametrize("ggml_type", [*INT_PATH_TYPES, GGMLType.Q2_0_ROCMFP2], ids=lambda t: t.name)
def test_qmatmul_id_batch_invariant(device, ggml_type):
    rng = np.random.default_rng(7)
    k = 4 * _block_k(ggml_type) if block_size(ggml_type) > 32 else 2048
    w = random_packed(rng, ggml_type, (6, 9), k)
    x = rng.standard_normal((8, k)).astype(np.float32)
    ids = rng.integers(0, 6, (8, 4)).astype(np.int32)
    ids[3] = ids[2]  # two tokens with the same experts
    ids[5, 1] = ids[5, 0]  # one token choosing an expert twice
    (wd,) = _put(device, w)
    full = np.asarray(_qmatmul_id(jax.device_put(x, device), wd, jax.device_put(ids, device), ggml_type, "ffi"))
    np.testing.assert_array_equal(full[5, 1], full[5, 0])
    for i in range(8):
        xi, ii = _put(device, x[i : i + 1], ids[i : i + 1])
        one = np.asarray(_qmatmul_id(xi, wd, ii, ggml_type, "ffi"))
        np.testing.assert_array_equal(one[0], full[i])


def test_qmatmul_id_more_tokens_than_a_pass(device):
    """Eleven tokens choosing one expert twice each: 22 columns, several passes over the expert's rows."""
    rng = np.random.default_rng(11)
    t = GGMLType.IQ2_XXS
    k = 4 * _block_k(t)
    w = random_packed(rng, t, (3, 5), k)
    x = rng.standard_normal((11, k)).astype(np.float32)
    ids = np.ones((11, 2), np.int32)
    xd, wd, idd = _put(device, x, w, ids)
    got = np.asarray(_qmatmul_id(xd, wd, idd, t, "ffi"))
    dense = formats.dequantize(w, t, (3, 5, k))[1]
    for j in range(2):
        assert_matches_dense(got[:, j], x, dense)
    np.testing.assert_array_equal(got[:, 0], got[:, 1])


@pytest.mark.parametrize("ggml_type", INT_PATH_TYPES, ids=lambda t: t.name)
def test_qmatmul_grouped_equals_one_call_per_group(device, ggml_type):
    """The grouped op (one MoE-form call) gives bit for bit what one dense call per group gives, and matches
    numpy; T = 1 and 3, three groups of 11 rows."""
    rng = np.random.default_rng(12)
    g, n, k = 3, 11, 4 * _block_k(ggml_type)
    w = random_packed(rng, ggml_type, (g, n), k)
    dense = formats.dequantize(w, ggml_type, (g, n, k))
    (wd,) = _put(device, w)
    grouped = jax.jit(functools.partial(kernels.qmatmul_grouped, ggml_type=ggml_type, backend="ffi"))
    for t_rows in (1, 3):
        x = rng.standard_normal((t_rows, g, k)).astype(np.float32)
        got = np.asarray(grouped(jax.device_put(x, device), wd))
        assert got.shape == (t_rows, g, n)
        for j in range(g):
            one = np.asarray(_qmatmul(jax.device_put(x[:, j], device), wd[j], ggml_type, "ffi"))
            np.testing.assert_array_equal(got[:, j], one)
            assert_matches_dense(got[:, j], x[:, j], dense[j])


def test_qmatmul_id_refuses_groups_its_ids_cannot_be(device):
    """`groups` = G promises ids[p] = p mod G (the GPU may not read them), so the op refuses a G that the
    shapes contradict: E other than G, several ids per row, rows not a multiple of G, a negative G."""
    rng = np.random.default_rng(15)
    w = random_packed(rng, GGMLType.Q8_0, (3, 5), 64)
    x = rng.standard_normal((6, 64)).astype(np.float32)
    for rows, per_row, groups in ((6, 1, 2), (6, 2, 3), (4, 1, 3), (6, 1, -1)):
        ids = (np.arange(rows * per_row).reshape(rows, per_row) % 3).astype(np.int32)
        with pytest.raises(jax.errors.JaxRuntimeError, match=f"groups = {groups} needs E = groups"):
            kernels.ffi.qmatmul_id(*_put(device, x[:rows], w, ids), int(GGMLType.Q8_0), groups, 1
                                   ).block_until_ready()
    ids = (np.arange(6) % 3).astype(np.int32)[:, None]
    got = kernels.ffi.qmatmul_id(*_put(device, x, w, ids), int(GGMLType.Q8_0), 3, 1)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(kernels.ffi.qmatmul_id(*_put(device, x, w, ids),
                                                                                     int(GGMLType.Q8_0), 0, 1)))


@pytest.mark.parametrize("ggml_type", INT_PATH_TYPES, ids=lambda t: t.name)
def test_qmatmul_grouped_ds4_output_shape(device, ggml_type):
    """DS4's grouped output projection (8 groups of 4096 -> 1024) at T = 4: on GPU the tensor-core kernel takes
    Q8_0 and IQ2_XXS, the MoE kernel's 16-warp CTAs Q2_K and Q4_K (one-token calls its 8-warp CTAs); each token's rows
    equal its 1-token call, and numpy."""
    rng = np.random.default_rng(13)
    g, n, k = 8, 1024, 4096
    w = random_packed(rng, ggml_type, (g, n), k)
    x = rng.standard_normal((4, g, k)).astype(np.float32)
    (wd,) = _put(device, w)
    grouped = jax.jit(functools.partial(kernels.qmatmul_grouped, ggml_type=ggml_type, backend="ffi"))
    full = np.asarray(grouped(jax.device_put(x, device), wd))
    dense = formats.dequantize(w, ggml_type, (g, n, k))
    for j in (0, g - 1):
        assert_matches_dense(full[:, j], x[:, j], dense[j])
    for t in range(4):
        np.testing.assert_array_equal(np.asarray(grouped(jax.device_put(x[t : t + 1], device), wd)), full[t : t + 1])


@pytest.mark.parametrize("ggml_type", INT_PATH_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("bad", [np.nan, np.inf], ids=["nan", "inf"])
def test_qmatmul_non_finite_activation(device, ggml_type, bad):
    """A NaN or inf activation makes its token's outputs non-finite (never a silent finite value) and leaves
    the other tokens' outputs exactly as without it."""
    rng = np.random.default_rng(8)
    k = 4 * _block_k(ggml_type)
    w = random_packed(rng, ggml_type, (5,), k)
    x = rng.standard_normal((2, k)).astype(np.float32)
    (wd,) = _put(device, w)
    clean = np.asarray(_qmatmul(jax.device_put(x, device), wd, ggml_type, "ffi"))
    x[0, 37] = bad
    got = np.asarray(_qmatmul(jax.device_put(x, device), wd, ggml_type, "ffi"))
    assert not np.any(np.isfinite(got[0]))
    np.testing.assert_array_equal(got[1], clean[1])


@pytest.mark.parametrize("ggml_type", INT_PATH_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize(
    "n, k", [(32771, 1024), (2048, 8192), (4096, 8192)], ids=["many_rows", "wide_tokens", "ds4_dense"]
)
def test_qmatmul_launch_geometries(device, ggml_type, n, k):
    """Shapes that take the GPU integer path's other launch geometries (on an H200): 32771 rows of 1024 weights
    group 2 or 4 rows per warp, the last group partial (4 for several tokens, where Q8_0 chunks hold one
    sub-block per lane); 2048 rows of 8192 run one CTA of 16 warps per SM for T > 1 (it stages four such tokens
    at once) and two CTAs of 8 warps for one token; 4096 rows of 8192 (DS4's 8192 -> 4096) group two rows per
    warp for three or four tokens and one for eight. For T = 8, 4, 3 and 1: right against numpy, and every row
    equal to the same token's row of the 8-token call."""
    rng = np.random.default_rng(5)
    w = random_packed(rng, ggml_type, (n,), k)
    x = rng.standard_normal((8, k)).astype(np.float32)
    dense = formats.dequantize(w, ggml_type, (n, k))
    (wd,) = _put(device, w)
    full = None
    for t_rows in (8, 4, 3, 1):
        got = np.asarray(_qmatmul(jax.device_put(x[:t_rows], device), wd, ggml_type, "ffi"))
        assert_matches_dense(got, x[:t_rows], dense)
        full = got if full is None else full
        np.testing.assert_array_equal(got, full[:t_rows])


@pytest.mark.parametrize("ggml_type", INT_PATH_TYPES, ids=lambda t: t.name)
def test_qmatmul_id_shared_experts(device, ggml_type):
    """MoE with enough rows per expert that the GPU spreads each expert over several CTAs and groups rows per
    warp (1059 rows: a partial last group), the experts chosen by 5, 3, 1 and 3 of the 12 slots: every token
    equals its own one-token call bit for bit, whichever slots' CTAs served its experts, and matches numpy."""
    rng = np.random.default_rng(6)
    n_experts, n, k = 4, 1059, 1024
    w = random_packed(rng, ggml_type, (n_experts, n), k)
    x = rng.standard_normal((6, k)).astype(np.float32)
    ids = np.array([[0, 1], [0, 3], [1, 0], [3, 2], [0, 3], [1, 0]], np.int32)
    (wd,) = _put(device, w)
    xd, idd = _put(device, x, ids)
    got = np.asarray(_qmatmul_id(xd, wd, idd, ggml_type, "ffi"))
    assert_moe_matches_dense(got, x, formats.dequantize(w, ggml_type, (n_experts, n, k))[ids])
    for i in range(len(x)):
        xi, ii = _put(device, x[i : i + 1], ids[i : i + 1])
        np.testing.assert_array_equal(np.asarray(_qmatmul_id(xi, wd, ii, ggml_type, "ffi"))[0], got[i])


@pytest.mark.parametrize("ggml_type", INT_PATH_TYPES, ids=lambda t: t.name)
def test_qmatmul_long_rows(device, ggml_type):
    """K = 65536: on GPU one token's activations no longer fit next to the integer path's buffers, so the call
    takes the float path; results stay right and batch invariant."""
    rng = np.random.default_rng(3)
    k = 65536
    w = random_packed(rng, ggml_type, (3,), k)
    x = rng.standard_normal((3, k)).astype(np.float32)
    xd, wd = _put(device, x, w)
    got = np.asarray(_qmatmul(xd, wd, ggml_type, "ffi"))
    assert_matches_dense(got, x, formats.dequantize(w, ggml_type, (3, k)))
    np.testing.assert_array_equal(np.asarray(_qmatmul(xd[1:2], wd, ggml_type, "ffi")), got[1:2])


# --------------------------------------------------------------------------- attention's products on the float path
def _attention_products(x: jax.Array, keys_w: jax.Array, keys_c: jax.Array, picks: jax.Array, probs_w: jax.Array,
                        probs_c: jax.Array, probs_p: jax.Array) -> tuple[jax.Array, ...]:
    """An invariant step's attention products (model/block.py `attend`) as `rowwise.grouped_rows` calls, for
    B sequences of q rows of H heads: queries x `[B, q, H, d]` against each sequence's window keys `[B, 128, d]`
    and compressed entries `[B, C, d]` and each row's CSA picks `[B, q, P, d]`, and the probabilities `[B, q, H, ·]`
    times the same keys as values (K = V, read transposed). Returns the six float32 results, heads as rows."""
    b, q, h, d = x.shape
    seq = lambda a: a.reshape(b, q * h, a.shape[-1])  # noqa: E731 (one group per sequence)
    row = lambda a: a.reshape(b * q, h, a.shape[-1])  # noqa: E731 (one group per step row)
    per_row_keys = picks.reshape(b * q, *picks.shape[2:])
    return (rowwise.grouped_rows(seq(x), keys_w), rowwise.grouped_rows(seq(x), keys_c),
            rowwise.grouped_rows(row(x), per_row_keys),
            rowwise.grouped_rows(seq(probs_w), keys_w, transposed=True),
            rowwise.grouped_rows(seq(probs_c), keys_c, transposed=True),
            rowwise.grouped_rows(row(probs_p), per_row_keys, transposed=True))


def _sequential_products(x: np.ndarray, w: np.ndarray, transposed: bool) -> np.ndarray:
    """The CPU kernel's arithmetic in numpy: each output `acc = acc + x[k]·w[k]` over k in order, float32 with a
    rounding after the multiply and after the add (the host's dspark_mad). x `[G, M, K]`, w `[G, N, K]` (or
    `[G, K, N]`) -> float32 `[G, M, N]`."""
    w = np.asarray(w, np.float32)
    wk = w if transposed else np.swapaxes(w, 1, 2)  # [G, K, N]
    acc = np.zeros((x.shape[0], x.shape[1], wk.shape[2]), np.float32)
    for k in range(x.shape[2]):
        acc = acc + x[:, :, k, None] * wk[:, None, k, :]
    return acc


@pytest.mark.parametrize("transposed", [False, True], ids=["keys", "values"])
@pytest.mark.parametrize("w_dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=lambda t: jnp.dtype(t).name)
@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(g=st.integers(1, 4), m=st.integers(1, 70), n=st.integers(1, 140), k=st.integers(0, 100))
def test_grouped_matmul_matches_the_reference_and_keeps_each_rows_bits(device, transposed, w_dtype, g, m, n, k):
    """`ffi.grouped_matmul` (the invariant step's attention products) equals the jnp reference to fp32 rounding, its
    first group's rows computed alone give the same bits (whatever G, M or N, tiles cut anywhere, K = 0
    included), and on the CPU it is exactly the sequential multiply-add chain it promises."""
    rng = np.random.default_rng(g * 1000 + m * 10 + n + k)
    x = rng.standard_normal((g, m, k)).astype(np.float32)
    w = np.asarray(jnp.asarray(rng.standard_normal((g, k, n) if transposed else (g, n, k)), w_dtype))
    f = jax.jit(functools.partial(kernels.ffi.grouped_matmul, transposed=transposed))
    got = np.asarray(f(*_put(device, x, w)))
    want = np.asarray(kernels.reference.grouped_matmul(jnp.asarray(x), jnp.asarray(w), transposed), np.float64)
    w64 = np.abs(np.asarray(w, np.float64))
    assert_matmul_close(got, want, np.abs(x.astype(np.float64)) @ (w64 if transposed else np.swapaxes(w64, 1, 2)))
    rows = slice(m // 2, m // 2 + 1)
    np.testing.assert_array_equal(np.asarray(f(*_put(device, x[:1, rows], w[:1]))), got[:1, rows])
    if device.platform == "cpu":
        np.testing.assert_array_equal(got, _sequential_products(x, w, transposed))


@pytest.mark.parametrize("transposed", [False, True], ids=["keys", "values"])
def test_grouped_matmul_reads_one_layer_of_a_stack(device, transposed):
    """With a layer operand the call reads that layer of a stack `[L, G, ...]` in place (a scanned body's cache),
    with the bits of a call on the layer alone; out-of-range layers clamp as XLA's dynamic-slice does."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 7, 40)).astype(np.float32)
    stack = np.asarray(jnp.asarray(rng.standard_normal((4, 3, 40, 9) if transposed else (4, 3, 9, 40)), jnp.bfloat16))
    f = jax.jit(functools.partial(kernels.ffi.grouped_matmul, transposed=transposed))
    xd, sd = _put(device, x, stack)
    for layer, read in ((0, 0), (2, 2), (3, 3), (-1, 0), (9, 3)):
        got = np.asarray(f(xd, sd, layer=jax.device_put(np.int32(layer), device)))
        np.testing.assert_array_equal(got, np.asarray(f(xd, jax.device_put(stack[read], device))), err_msg=f"layer {layer}")


def test_grouped_matmul_refuses_mismatched_operands(cpu_device):
    """A w whose G or K differs from x's, or a transposed flag other than 0/1, is an error naming the op; a w the
    kernels cannot read as float rows is refused before the call."""
    x = jnp.zeros((2, 3, 8), jnp.float32)
    with pytest.raises(Exception, match="grouped_matmul: w must be float \\[G, N, K\\] \\(or a stack"):
        jax.jit(functools.partial(kernels.ffi.grouped_matmul, transposed=False))(x, jnp.zeros((2, 5, 7)))
    with pytest.raises(Exception, match="grouped_matmul: w must be float \\[G, K, N\\]"):
        jax.jit(functools.partial(kernels.ffi.grouped_matmul, transposed=True))(x, jnp.zeros((3, 8, 5)))
    with pytest.raises(DsparkError, match="float32, float16 or bfloat16 matrices, got int32"):
        rowwise.grouped_rows(x, jnp.zeros((2, 5, 8), jnp.int32))
    with pytest.raises(Exception, match="transposed must be 0"):
        kernels.ffi._call("dspark_grouped_matmul", jax.ShapeDtypeStruct((2, 3, 5), jnp.float32), x,
                          jnp.zeros((2, 5, 8)), jnp.int32(0), transposed=np.int32(2))


@pytest.mark.gpu
@pytest.mark.parametrize("ggml_type", [GGMLType.F32, GGMLType.Q8_0], ids=lambda t: t.name)
def test_gpu_calls_past_the_grid_limit_keep_each_rows_bits(gpu_device, ggml_type):
    """Calls whose slots or token tiles exceed CUDA's 65535 grid rows (a batch-64 prefill of DS4's 64 heads in the
    invariant step's attention products) run in row chunks: every row has the bits of a small call. MoE: 33000
    rows of 2 ids, grouped: 3 groups of 22000 rows, dense: 524296 rows (the float path's tiles of 8 rows)."""
    rng = np.random.default_rng(21)
    k = 64
    w = jax.device_put(random_packed(rng, ggml_type, (3, 4), k), gpu_device)
    x = rng.standard_normal((524296, k)).astype(np.float32)
    ids = rng.integers(0, 3, (33000, 2)).astype(np.int32)
    edges = np.r_[0:8, 32760:32776, 32992:33000]  # rows around the first chunk's end (32767 rows of 2 slots)

    def moe(rows: np.ndarray) -> np.ndarray:
        xd, idd = _put(gpu_device, x[rows], ids[rows])
        return np.asarray(_qmatmul_id(xd, w, idd, ggml_type, "ffi"))

    np.testing.assert_array_equal(moe(np.arange(33000))[edges], moe(edges))
    grouped = jax.jit(functools.partial(kernels.qmatmul_grouped, ggml_type=ggml_type, backend="ffi"))
    xg = x[:66000].reshape(22000, 3, k)
    got = np.asarray(grouped(jax.device_put(xg, gpu_device), w))
    edges = np.r_[0:4, 21840:21850, 21996:22000]  # around 21845 rows of 3 groups
    np.testing.assert_array_equal(got[edges], np.asarray(grouped(jax.device_put(xg[edges], gpu_device), w)))
    if ggml_type == GGMLType.F32:
        dense_rows = np.r_[0:8, 524280:524296]
        got = np.asarray(_qmatmul(jax.device_put(x, gpu_device), w[0], ggml_type, "ffi"))
        np.testing.assert_array_equal(got[dense_rows],
                                      np.asarray(_qmatmul(jax.device_put(x[dense_rows], gpu_device), w[0], ggml_type, "ffi")))


@pytest.mark.gpu
def test_gpu_attention_products_keep_each_rows_bits(gpu_device):
    """The invariant step's attention products at DS4's attention shapes (64 heads of 512, a 128-row window, 64
    compressed entries, 512 CSA picks per row) on the GPU's grouped products: every row has the same bits at widths
    1..6 and batches 1, 3 and 8, with its sequences in reverse order, and computed alone (a one-row call, which the
    kernel tiles smaller than the batch-8 calls), and matches numpy. The reference is the device's own width-6,
    batch-8 call: its fused multiply-adds round once where the CPU's round twice."""
    rng = np.random.default_rng(42)
    bmax, qmax, h, d, win, comp, npick = 8, 6, 64, 512, 128, 64, 512
    f32 = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    x, keys_w, keys_c, picks = f32(bmax, qmax, h, d), f32(bmax, win, d), f32(bmax, comp, d), f32(bmax, qmax, npick, d)
    probs = f32(bmax, qmax, h, win), f32(bmax, qmax, h, comp), f32(bmax, qmax, h, npick)
    f = jax.jit(_attention_products)

    def call(b: int, q: int, order: np.ndarray | None = None) -> list[np.ndarray]:
        """The six products of sequences [:b] (in `order`) at width q, as `[b, q, H, ·]`."""
        order = np.arange(b) if order is None else order
        cut = [x[order][:, :q], keys_w[order], keys_c[order], picks[order][:, :q], *(p[order][:, :q] for p in probs)]
        return [np.asarray(y).reshape(b, q, h, -1) for y in f(*jax.device_put(cut, gpu_device))]

    full = call(bmax, qmax)
    for b in (1, 3, 8):
        for q in range(1, qmax + 1):
            for i, got in enumerate(call(b, q)):
                np.testing.assert_array_equal(got, full[i][:b, :q], err_msg=f"product {i}, batch {b}, width {q}")
    order = np.arange(bmax)[::-1]
    for i, got in enumerate(call(bmax, qmax, order)):
        np.testing.assert_array_equal(got, full[i][order], err_msg=f"product {i}, sequences reversed")
    alone = jax.jit(lambda row, keys, transposed: rowwise.grouped_rows(row[None, None], keys[None], transposed)[0, 0],
                    static_argnums=2)
    for b, t, head in ((0, 0, 0), (5, 3, 17), (7, 5, 63)):
        for i, row, keys, transposed in ((0, x[b, t, head], keys_w[b], False), (2, x[b, t, head], picks[b, t], False),
                                         (3, probs[0][b, t, head], keys_w[b], True)):
            got = np.asarray(alone(*jax.device_put((row, keys), gpu_device), transposed))
            np.testing.assert_array_equal(got, full[i][b, t, head], err_msg=f"row alone, product {i}")
    x64 = np.asarray(x, np.float64).reshape(bmax, qmax * h, d)
    assert_matmul_close(full[0].reshape(bmax, qmax * h, win), x64 @ np.swapaxes(keys_w, 1, 2),
                        np.abs(x64) @ np.abs(np.swapaxes(keys_w, 1, 2)))
    pc = np.asarray(probs[1], np.float64).reshape(bmax, qmax * h, comp)
    assert_matmul_close(full[4].reshape(bmax, qmax * h, d), pc @ keys_c, np.abs(pc) @ np.abs(keys_c))


# --------------------------------------------------------------------------- the GPU integer path's model
@functools.partial(jax.jit, static_argnames=("ggml_type",))
def _i8_model(x, w, ggml_type):
    return kernels.ffi.qmatmul_i8_model(x, w, ggml_type)


def _aligned_blocks(t: GGMLType, nblocks: int) -> int:
    """The fewest blocks >= nblocks whose row is a multiple of 4 bytes (the integer path stages such rows)."""
    while (nblocks * type_size(t)) % 4:
        nblocks += 1
    return nblocks


@pytest.mark.parametrize("ggml_type", INT_PATH_TYPES, ids=lambda t: t.name)
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    n=st.sampled_from([1, 5, 33]),
    nblocks=st.sampled_from([1, 3, 9]),
    t_rows=st.integers(1, 3),
    bf16=st.booleans(),
    log2_scale=st.sampled_from([0, -60, -135, 90]),  # subnormal activations, and block exponents past 2^127
    zero_block=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_i8_model_matches_dense(cpu_device, ggml_type, n, nblocks, t_rows, bf16, log2_scale, zero_block, seed):
    """The GPU integer path's arithmetic (int8-limb activations, exact int32 sub-block products, its fp32 order)
    modelled on the CPU matches float64 numpy within the fp32 bound, at any activation exponent."""
    rng = np.random.default_rng(seed)
    k = _aligned_blocks(ggml_type, nblocks) * block_size(ggml_type)
    w = random_packed(rng, ggml_type, (n,), k)
    x = (rng.standard_normal((t_rows, k)) * 2.0**log2_scale).astype(np.float32)
    if zero_block:
        x[:, 32:64] = 0.0
    if bf16:
        x = np.asarray(jnp.asarray(x, jnp.bfloat16))
    got = np.asarray(_i8_model(*_put(cpu_device, x, w), int(ggml_type)))
    assert got.shape == (t_rows, n)
    assert_matches_dense(got, x, formats.dequantize(w, ggml_type, (n, k)))


@pytest.mark.parametrize("t", INT_PATH_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("bad", [np.nan, np.inf], ids=["nan", "inf"])
def test_i8_model_non_finite_activation(cpu_device, t, bad):
    """A NaN or inf makes its token's outputs NaN (Q2_K's and Q4_K's mins included) and leaves the other token's exactly
    as without it."""
    rng = np.random.default_rng(9)
    k = 512
    w = random_packed(rng, t, (4,), k)
    x = rng.standard_normal((2, k)).astype(np.float32)
    clean = np.asarray(_i8_model(*_put(cpu_device, x, w), int(t)))
    x[0, 300] = bad
    got = np.asarray(_i8_model(*_put(cpu_device, x, w), int(t)))
    assert np.all(np.isnan(got[0]))
    np.testing.assert_array_equal(got[1], clean[1])


def test_i8_model_rejects_what_the_integer_path_does_not_serve(cpu_device):
    x = np.ones((1, 64), np.float32)
    for k in (64, 32):  # 20- and 10-byte rows: the format is the reason, whatever the row length
        q2 = random_packed(np.random.default_rng(0), GGMLType.Q2_0_ROCMFP2, (2,), k)
        with pytest.raises(jax.errors.JaxRuntimeError, match="serves Q8_0, Q2_K, Q4_K and IQ2_XXS"):
            _i8_model(*_put(cpu_device, x[:, :k], q2), int(GGMLType.Q2_0_ROCMFP2)).block_until_ready()
    q8 = random_packed(np.random.default_rng(0), GGMLType.Q8_0, (2,), 32)  # 34-byte rows
    with pytest.raises(jax.errors.JaxRuntimeError, match="multiple of 4 bytes"):
        _i8_model(*_put(cpu_device, x[:, :32], q8), int(GGMLType.Q8_0)).block_until_ready()


@pytest.mark.gpu
@pytest.mark.parametrize("ggml_type", INT_PATH_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n, k", [(37, 1536), (300, 4096), (1059, 2048), (4100, 2048)],
                         ids=["partial_chunk", "ds4_k", "many_rows", "tensor_cores"])
def test_gpu_integer_path_equals_its_model(gpu_device, cpu_device, ggml_type, n, k):
    """The GPU's dense, MoE and grouped calls give the CPU model's bits for every row and token (T = 1, 4, 8):
    the integer path computes what cpu_i8_model.h says, in every launch geometry these shapes take (4100 rows:
    dense calls of 8 Q8_0 or IQ2_XXS tokens on the tensor-core kernel by default)."""
    rng = np.random.default_rng(10)
    w = random_packed(rng, ggml_type, (3, n), k)
    x = rng.standard_normal((8, k)).astype(np.float32)
    model = [np.asarray(_i8_model(*_put(cpu_device, x, w[e]), int(ggml_type))) for e in range(3)]
    wd = jax.device_put(w, gpu_device)
    for t_rows in (1, 4, 8):
        xd = jax.device_put(x[:t_rows], gpu_device)
        np.testing.assert_array_equal(np.asarray(_qmatmul(xd, wd[1], ggml_type, "ffi")), model[1][:t_rows])
        ids = np.stack([np.arange(t_rows) % 3, (np.arange(t_rows) + 1) % 3], axis=1).astype(np.int32)
        got = np.asarray(_qmatmul_id(xd, wd, jax.device_put(ids, gpu_device), ggml_type, "ffi"))
        for t in range(t_rows):
            for j in range(2):
                np.testing.assert_array_equal(got[t, j], model[ids[t, j]][t])
        grouped = np.asarray(kernels.qmatmul_grouped(jax.device_put(np.repeat(x[:t_rows, None], 3, 1), gpu_device), wd,
                                                     ggml_type, backend="ffi"))
        for g in range(3):
            np.testing.assert_array_equal(grouped[:, g], model[g][:t_rows])


@pytest.mark.gpu
@pytest.mark.parametrize("mma", ["auto", "force"])
@pytest.mark.parametrize("ggml_type, n, k", [
    (GGMLType.Q8_0, 37, 256), (GGMLType.Q8_0, 300, 1280), (GGMLType.Q8_0, 1059, 4096), (GGMLType.Q8_0, 33, 8192),
    (GGMLType.IQ2_XXS, 37, 2048), (GGMLType.IQ2_XXS, 300, 6144), (GGMLType.IQ2_XXS, 1059, 4096),
    (GGMLType.IQ2_XXS, 33, 8192),
], ids=lambda v: v.name if isinstance(v, GGMLType) else str(v))
def test_gpu_dense_calls_of_several_tokens_equal_the_model(gpu_device, cpu_device, ggml_type, n, k, mma):
    """Dense calls of 2-8, 12 and 17 tokens (one to three token tiles), float32 and bfloat16, give the CPU model's
    bits: rows past a tile's end, K below, at and past one chunk, K = 8192 (where 8 tokens do not fit one tile).
    mma="auto" takes the matvec for all of these shapes (fewer than 48 tiles of 32 rows, tuning.h); "force" (the
    `mma` FFI attribute) runs every one of them on the tensor-core kernel."""
    rng = np.random.default_rng(12)
    w = random_packed(rng, ggml_type, (n,), k)
    wd, wc = jax.device_put(w, gpu_device), jax.device_put(w, cpu_device)
    for dtype in (jnp.float32, jnp.bfloat16):
        x = np.asarray(jnp.asarray(rng.standard_normal((17, k)), dtype))
        model = np.asarray(_i8_model(jax.device_put(x, cpu_device), wc, int(ggml_type)))
        for t_rows in (2, 3, 4, 5, 8, 12, 17):
            got = np.asarray(_qmatmul(jax.device_put(x[:t_rows], gpu_device), wd, ggml_type, "ffi", mma))
            np.testing.assert_array_equal(got, model[:t_rows], err_msg=f"{dtype.__name__}, T = {t_rows}")


@pytest.mark.gpu
@pytest.mark.parametrize("mma", ["off", "auto", "force"])
@pytest.mark.parametrize("ggml_type, groups, n, k", [
    (GGMLType.Q8_0, 3, 37, 256), (GGMLType.Q8_0, 2, 300, 4096), (GGMLType.Q8_0, 8, 256, 4096),
    (GGMLType.IQ2_XXS, 3, 37, 2048), (GGMLType.IQ2_XXS, 2, 100, 8192), (GGMLType.IQ2_XXS, 8, 256, 4096),
], ids=lambda v: v.name if isinstance(v, GGMLType) else str(v))
def test_gpu_grouped_calls_of_several_tokens_equal_the_model(gpu_device, cpu_device, ggml_type, groups, n, k, mma):
    """Grouped projections of 2-8, 12 and 17 tokens, each group its own activations, give the CPU model's bits
    for every (token, group). 8 groups of 256 rows at K = 4096 (64 tiles of 32 rows) take the tensor-core kernel
    under mma="auto" from T = 4 (tuning.h), the other shapes the MoE kernel; under "force", all of them; under "off", none."""
    rng = np.random.default_rng(14)
    w = random_packed(rng, ggml_type, (groups, n), k)
    wd = jax.device_put(w, gpu_device)
    x = rng.standard_normal((17, groups, k)).astype(np.float32)
    model = [np.asarray(_i8_model(*_put(cpu_device, x[:, g], w[g]), int(ggml_type))) for g in range(groups)]
    for t_rows in (2, 3, 4, 5, 8, 12, 17):
        got = np.asarray(kernels.qmatmul_grouped(jax.device_put(x[:t_rows], gpu_device), wd, ggml_type, backend="ffi",
                                                 mma=mma))
        for g in range(groups):
            np.testing.assert_array_equal(got[:, g], model[g][:t_rows], err_msg=f"T = {t_rows}, group {g}")


@pytest.mark.gpu
@pytest.mark.parametrize("ggml_type", INT_PATH_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("experts, chosen, n, k, dtype",
                         [(8, 8, 300, 2048, jnp.float32), (64, 48, 40, 512, jnp.bfloat16)],
                         ids=["several_ctas_per_expert", "one_cta_per_expert"])
def test_gpu_expert_major_moe_equals_its_model(gpu_device, cpu_device, ggml_type, experts, chosen, n, k, dtype):
    """A MoE call of more slots than twice the resident CTAs, on no more experts than resident CTAs, takes the
    expert-major grid: four experts per token for (SMs + 8) tokens exceeds that for every launch geometry. Each
    slot's row equals the CPU model's, duplicate ids included; invalid ids (-1, E) give zero rows even where a
    previous call left numbers behind; 40 rows make one CTA per expert, and the tokens choose among the first
    `chosen` experts only, so the others' CTAs find no work."""
    rng = np.random.default_rng(11)
    t_rows, topk = gpu_device.core_count + 8, 4
    w = random_packed(rng, ggml_type, (experts, n), k)
    x = np.asarray(jnp.asarray(rng.standard_normal((t_rows, k)), dtype))
    ids = rng.integers(0, chosen, (t_rows, topk)).astype(np.int32)
    ids[3, 1] = ids[3, 0]  # a token choosing one expert twice
    for (t, j), bad_id in zip([(0, 2), (5, 0), (t_rows - 1, 3)], (-1, experts, -1)):
        ids[t, j] = bad_id
    xd, wd = jax.device_put(x, gpu_device), jax.device_put(w, gpu_device)
    _qmatmul_id(xd, wd, jax.device_put(np.abs(ids) % experts, gpu_device), ggml_type, "ffi").block_until_ready()
    got = np.asarray(_qmatmul_id(xd, wd, jax.device_put(ids, gpu_device), ggml_type, "ffi"))
    xc = jax.device_put(x, cpu_device)
    model = {e: np.asarray(_i8_model(xc, jax.device_put(w[e], cpu_device), int(ggml_type)))
             for e in {int(e) for e in ids.ravel() if 0 <= e < experts}}
    for t in range(t_rows):
        for j in range(topk):
            want = model[ids[t, j]][t] if 0 <= ids[t, j] < experts else np.zeros(n, np.float32)
            np.testing.assert_array_equal(got[t, j], want, err_msg=f"token {t}, slot {j}, expert {ids[t, j]}")


# --------------------------------------------------------------------------- mHC
HC = {"iters": 20, "hc_eps": 1e-6, "norm_eps": 1e-6}


# a stream width whose n·D = 4400 values (n = 4) the GPU's mix sums in three chunks, the last one partial
SEVERAL_MIX_CHUNKS_D = 1100


def test_several_mix_chunks_width():
    """SEVERAL_MIX_CHUNKS_D, which the HC tests use for the mix's chunked sums, gives three chunks at the chunk
    the plugin was built with, the last one partial."""
    assert kernels.ffi.hc_mix_chunks(4, SEVERAL_MIX_CHUNKS_D) == 3
    assert 4 * SEVERAL_MIX_CHUNKS_D % kernels.ffi.hc_mix_chunk() != 0


def _hc_inputs(rng: np.random.Generator, t_rows: int, n: int = 4, d: int = 96):
    return synthetic.random_hc_inputs(rng, t_rows, n, d)


@pytest.mark.parametrize("dtypes", ["f32", "bf16_streams_f16_fn"])
@pytest.mark.parametrize(
    "t_rows, n, d",
    [(1, 4, 96), (3, 4, 96), (8, 4, 96), (3, 6, 96), (2, 8, 96), (2, 1, 96), (2, 2, 96), (2, 3, 96), (2, 5, 96),
     (2, 7, 96), (3, 4, SEVERAL_MIX_CHUNKS_D)],
)
def test_hc_pre_matches_model_reference(device, t_rows, n, d, dtypes):
    """hc_pre against the model's jnp code, for DS4's 4 streams and for every other count the kernels take, 1 to 8
    (the GPU's collapse kernel is compiled once per count; 6 and 8 give comb matrices of 36 and 64 elements, more
    than a warp has lanes), and for streams wide enough that the GPU sums the mix in several chunks."""
    rng = np.random.default_rng(t_rows)
    streams, fn, base, scale = _hc_inputs(rng, t_rows, n, d)
    if dtypes != "f32":
        streams = np.asarray(jnp.asarray(streams, jnp.bfloat16))
        fn = fn.astype(np.float16)
    args = _put(device, streams, fn, base, scale)
    got = kernels.hc_pre(*args, **HC, backend="ffi")
    want = jax.jit(functools.partial(hc_ref.hc_pre, **HC))(*args)
    for g, w in zip(got, want):
        assert g.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)
    comb = np.asarray(got[2])
    np.testing.assert_allclose(comb.sum(axis=-2), 1.0, atol=1e-4)  # columns
    np.testing.assert_allclose(comb.sum(axis=-1), 1.0, atol=1e-4)  # rows


@pytest.mark.parametrize("t_rows", [1, 5])
def test_hc_post_matches_model_reference(device, t_rows):
    rng = np.random.default_rng(10 + t_rows)
    streams, fn, base, scale = _hc_inputs(rng, t_rows)
    block_out = rng.standard_normal((t_rows, streams.shape[-1])).astype(np.float32)
    _, post, comb = jax.jit(functools.partial(hc_ref.hc_pre, **HC))(streams, fn, base, scale)
    args = _put(device, block_out, streams, np.asarray(post), np.asarray(comb))
    got = np.asarray(kernels.hc_post(*args, backend="ffi"))
    np.testing.assert_allclose(got, np.asarray(jax.jit(hc_ref.hc_post)(*args)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("d", [96, SEVERAL_MIX_CHUNKS_D])
def test_hc_batch_invariant(device, d):
    rng = np.random.default_rng(3)
    streams, fn, base, scale = _hc_inputs(rng, 8, d=d)
    block_out = rng.standard_normal((8, streams.shape[-1])).astype(np.float32)
    pre = jax.jit(lambda s, f, b, c: kernels.hc_pre(s, f, b, c, **HC, backend="ffi"))
    post = jax.jit(lambda o, s, p, c: kernels.hc_post(o, s, p, c, backend="ffi"))
    fnd, based, scaled = _put(device, fn, base, scale)
    full = [np.asarray(a) for a in pre(jax.device_put(streams, device), fnd, based, scaled)]
    full_post = np.asarray(post(*_put(device, block_out, streams, full[1], full[2])))
    for i in (0, 3, 7):
        one = [np.asarray(a) for a in pre(jax.device_put(streams[i : i + 1], device), fnd, based, scaled)]
        for a, b in zip(one, full):
            np.testing.assert_array_equal(a[0], b[i])
        one_post = post(*_put(device, block_out[i : i + 1], streams[i : i + 1], full[1][i : i + 1], full[2][i : i + 1]))
        np.testing.assert_array_equal(np.asarray(one_post)[0], full_post[i])


@pytest.mark.parametrize("d", [96, SEVERAL_MIX_CHUNKS_D])
def test_hc_pre_reads_one_layer_of_a_stacked_fn(device, d):
    """With `layer`, hc_pre uses that layer of a stack of fn matrices `[L, M, n·D]` (a scanned body's, which the
    kernel reads in place): the bits of the call on that layer's own matrix, on the kernel and on the reference. The
    kernel clamps an index outside the stack into it, as XLA's dynamic-slice does, and never reads past it."""
    streams, fn, base, scale = _hc_inputs(np.random.default_rng(6), 3, d=d)
    stack = np.stack([fn, fn[::-1].copy(), 0.5 * fn])
    for backend, layers in (("ffi", [(0, 0), (1, 1), (2, 2), (-1, 0), (7, 2)]), ("reference", [(1, 1), (2, 2)])):
        call = jax.jit(functools.partial(kernels.hc_pre, **HC, backend=backend))
        for layer, held in layers:
            got = call(*_put(device, streams, stack, base, scale), layer=jax.device_put(np.int32(layer), device))
            want = call(*_put(device, streams, stack[held], base, scale))
            for g, w in zip(got, want):
                np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=f"{backend} layer {layer}")


def test_hc_pre_rejects_a_missized_workspace(cpu_device):
    """The kernels write the workspace hc_pre's caller allocates; one sized for another chunking is refused by
    name, never written past."""
    streams, fn, base, scale = _hc_inputs(np.random.default_rng(4), 2)
    f32 = jnp.float32
    outs = (jax.ShapeDtypeStruct((2, 96), f32), jax.ShapeDtypeStruct((2, 4), f32),
            jax.ShapeDtypeStruct((2, 4, 4), f32), jax.ShapeDtypeStruct((2, fn.shape[0]), f32))
    call = functools.partial(kernels.ffi._call, "dspark_hc_pre", outs, iters=np.int32(20),
                             hc_eps=np.float32(1e-6), norm_eps=np.float32(1e-6))
    with pytest.raises(jax.errors.JaxRuntimeError, match="hc_pre workspace must be float32"):
        jax.block_until_ready(call(*_put(cpu_device, streams, fn, np.zeros((), np.int32), base, scale)))


# --------------------------------------------------------------------------- RMSNorm (invariant steps)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("k", [64, 200, 4096])
def test_rms_norm_matches_jnp_and_keeps_each_rows_bits(device, dtype, k):
    """The FFI RMSNorm equals the jnp formula (reduce.rms_norm's fast route) to rounding, and every row of a call
    of T rows has the bits it has alone or among other rows."""
    from dsparkjax.kernels import ffi

    rng = np.random.default_rng(k)
    x = (rng.standard_normal((13, k)) * rng.uniform(0.1, 30.0, (13, 1))).astype(np.float32)
    w = rng.uniform(0.5, 1.5, k).astype(np.float32)
    xd, wd = jax.device_put(jnp.asarray(x, dtype), device), jax.device_put(w, device)
    f = jax.jit(functools.partial(ffi.rms_norm, eps=1e-6))
    full = np.asarray(f(xd, wd))
    xf = np.asarray(jnp.asarray(x, dtype).astype(jnp.float32))
    want = xf / np.sqrt(np.mean(xf.astype(np.float64) ** 2, axis=-1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(full, want, rtol=2e-6, atol=1e-6)
    for rows in (slice(0, 1), slice(4, 5), slice(0, 3), slice(5, 13)):
        np.testing.assert_array_equal(np.asarray(f(xd[rows], wd)), full[rows])


# --------------------------------------------------------------------------- API behaviour
def test_reference_backend_and_errors():
    w = random_packed(np.random.default_rng(0), GGMLType.Q8_0, (4,), 64)
    x = np.ones((2, 64), np.float32)
    assert kernels.qmatmul(x, w, GGMLType.Q8_0, backend="reference").shape == (2, 4)
    with pytest.raises(ValueError, match="backend"):
        kernels.qmatmul(x, w, GGMLType.Q8_0, backend="triton")
    with pytest.raises(FormatError, match="bytes"):
        kernels.qmatmul(np.ones((2, 96), np.float32), w, GGMLType.Q8_0)
    with pytest.raises(UnsupportedTypeError, match="Q5_K"):
        kernels.qmatmul(x, w, GGMLType.Q5_K)


def test_missing_plugin_message(monkeypatch):
    monkeypatch.setitem(kernels.ffi._STATUS, "cpu", kernels.PluginError("plugin was not built; build it with pip"))
    monkeypatch.setattr(kernels.ffi, "platform_kind", lambda: "cpu")
    x, w = np.ones((1, 32), np.float32), random_packed(np.random.default_rng(0), GGMLType.Q8_0, (2,), 32)
    with pytest.raises(kernels.PluginError, match="build"):
        kernels.qmatmul(x, w, GGMLType.Q8_0, backend="ffi")
    assert kernels.qmatmul(x, w, GGMLType.Q8_0).shape == (1, 2)  # default falls back to the reference


def test_foreign_or_stale_plugin_message(monkeypatch, tmp_path):
    """A library under the plugin's name that lacks its symbols (another library, or a plugin built from older
    sources) is refused with a PluginError that names it, not an AttributeError from ctypes."""
    shutil.copy(_ctypes.__file__, tmp_path / "libdspark_cpu_ffi.so")  # a shared library, not ours
    monkeypatch.setenv("DSPARKJAX_LIB_DIR", str(tmp_path))
    with pytest.raises(kernels.PluginError, match="exports no DsparkPluginAbi"):
        kernels.ffi._load("cpu")


def test_plugin_of_another_abi_is_refused(tmp_path):
    """A plugin whose handlers take other attributes than ffi.py passes (an older build) is refused by name."""
    kernels.ffi.check_plugin_abi(tmp_path, kernels.ffi.PLUGIN_ABI)
    with pytest.raises(kernels.PluginError, match=f"speaks plugin ABI 1 but this dsparkjax speaks {kernels.ffi.PLUGIN_ABI}"):
        kernels.ffi.check_plugin_abi(tmp_path, 1)


def test_mma_mode_is_checked(cpu_device):
    """The tensor-core mode is one of off/auto/force: checked by name in Python and by code in the plugin."""
    x, w = _put(cpu_device, np.ones((2, 32), np.float32), random_packed(np.random.default_rng(0), GGMLType.Q8_0,
                                                                        (2,), 32))
    with pytest.raises(DsparkError, match="mma must be one of"):
        kernels.qmatmul(x, w, GGMLType.Q8_0, backend="ffi", mma="fast")
    with pytest.raises(jax.errors.JaxRuntimeError, match="mma must be 0"):
        kernels.ffi.qmatmul(x, w, int(GGMLType.Q8_0), 3).block_until_ready()
    with pytest.raises(DsparkError, match="KernelPolicy.mma"):
        kernels.KernelPolicy(mma="fast")
    same = [np.asarray(kernels.qmatmul(x, w, GGMLType.Q8_0, backend="ffi", mma=m)) for m in ("off", "auto", "force")]
    np.testing.assert_array_equal(same[0], same[1])
    np.testing.assert_array_equal(same[0], same[2])


def test_plugin_ffi_api_not_newer_than_runtime():
    runtime = kernels.ffi.runtime_ffi_api_version()
    built = kernels.ffi.PLUGINS["cpu"].ffi_api
    assert built[0] == runtime[0] and built[1] <= runtime[1]


# --------------------------------------------------------------------------- GPU bandwidth
@pytest.mark.gpu
@pytest.mark.parametrize(
    "ggml_type",
    [
        GGMLType.Q8_0,
        pytest.param(
            GGMLType.IQ2_XXS,
            marks=pytest.mark.xfail(strict=False, reason="IQ2_XXS is below 50%: docs/PERFORMANCE.md"),
        ),
    ],
    ids=lambda t: t.name,
)
def test_gpu_matvec_bandwidth(gpu_device, ggml_type):
    """T=1 matvec over a large weight reads at >= 50% of the device copy bandwidth (read + write of 1 GiB).

    The time per call is the slope between programs of 2 and 4 calls, each call with its own 0.5 GB weight
    and activations (so no call finds another's weights in L2, even if the GPU overlaps them), so the host's
    dispatch of the program is not counted against the kernel."""
    n, k = 32768, 16384
    ws = [jax.device_put(synthetic.random_packed(jax.random.PRNGKey(c), ggml_type, (n,), k), gpu_device)
          for c in range(4)]
    xs = [jax.device_put(np.random.default_rng(c).standard_normal((1, k)).astype(np.float32), gpu_device)
          for c in range(4)]

    calls = jax.jit(lambda xs, ws: [kernels.qmatmul(x, w, ggml_type, backend="ffi") for x, w in zip(xs, ws)])
    copy_bw = timing.copy_bandwidth(1024, reps=20)
    mv_bw = ws[0].nbytes / timing.seconds_per_call(lambda m: calls, lambda m: (xs[:m], ws[:m]), 2, reps=20)
    print(f"{ggml_type.name}: {mv_bw / 1e9:.0f} GB/s, copy {copy_bw / 1e9:.0f} GB/s")
    assert mv_bw >= 0.5 * copy_bw, f"{ggml_type.name}: {mv_bw / 1e9:.0f} GB/s vs copy {copy_bw / 1e9:.0f} GB/s"
