"""Scanned layers (issue 38): the layer plan, and the scanned step against the unrolled one, bit for bit.

The model is the tiny config with DS4's layer pattern at 7 layers (SWA, SWA, CSA hash-routed, then HCA/CSA pairs),
written with the `rocmfpx` recipe so its matrices stay packed for the FFI kernels: the plan scans layers 0-1 and
the pair 3-6 twice, and the capture layers 4, 5, 6 sit inside the scanned pair.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsparkjax import kernels
from dsparkjax.config import deepseek_v4_flash, tiny_target
from dsparkjax.decoding.program import step_program
from dsparkjax.errors import CapacityError, DsparkError
from dsparkjax.ggufio import write_model_gguf
from dsparkjax.model.layer_plan import Segment, plan_layers
from dsparkjax.model.params import LayerStack
from dsparkjax.model.state import CacheStack, commit, init_state, per_layer
from dsparkjax.target_api import load_target
from dsparkjax.tiny import tiny_pair
from model_helpers import scratch_dir

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
from step_census import loop_moves, shape_key, stacked_shapes  # noqa: E402

needs_plugin = pytest.mark.skipif(not kernels.ffi.available(), reason="FFI plugin for this platform not built")
LAYERS = 7
CAPTURE = (4, 5, 6)


def deep_tiny(layers: int):
    """The tiny target's dims with DS4's layer pattern: two SWA layers, then CSA/HCA alternating, 3 hash layers."""
    ratios = (0, 0) + tuple(4 if i % 2 == 0 else 8 for i in range(2, layers))
    return dataclasses.replace(tiny_target(), num_layers=layers, compress_ratios=ratios, num_hash_layers=3,
                               swiglu_limit=(10.0,) * layers, swiglu_limit_shared=(10.0,) * layers)


@functools.lru_cache(maxsize=None)
def deep_tiny_path(recipe: str = "rocmfpx") -> str:
    cfg, params, _, _ = tiny_pair(0, target_cfg=deep_tiny(LAYERS))
    path = os.path.join(scratch_dir("scan-"), "target.gguf")
    write_model_gguf(path, cfg, params, recipe=recipe)
    return path


def test_plan_of_ds4_has_three_bodies():
    assert plan_layers(deepseek_v4_flash(43)) == (Segment(0, 1, 2), Segment(2, 1, 1), Segment(3, 2, 20))
    assert plan_layers(deepseek_v4_flash(32)) == (Segment(0, 1, 2), Segment(2, 1, 1), Segment(3, 2, 14),
                                                  Segment(31, 1, 1))
    assert all(not s.scanned for s in plan_layers(tiny_target()))  # SWA, CSA, HCA, CSA: nothing repeats


def test_plan_splits_layers_stored_differently():
    cfg = deepseek_v4_flash(8)
    keys = ["q8"] * 8
    keys[5] = "q4"  # layer 5 (HCA) stored in another format: the pairs 3-4 and 5-6 no longer match
    plan = plan_layers(cfg, keys)
    assert Segment(3, 2, 2) not in plan and sum(s.period * s.count for s in plan) == 8
    limits = dataclasses.replace(cfg, swiglu_limit=(10.0,) * 7 + (7.0,))
    assert plan_layers(limits)[-1] == Segment(7, 1, 1)


@functools.lru_cache(maxsize=None)
def targets(kernel: str):
    path = deep_tiny_path()
    return load_target(path, kernels=kernel), load_target(path, kernels=kernel, scan_layers=True)


def test_scanned_target_stacks_its_layers():
    _, scanned = targets("reference")
    assert scanned.plan == (Segment(0, 1, 2), Segment(2, 1, 1), Segment(3, 2, 2))
    stack = scanned.params.blocks[2]
    assert isinstance(stack, LayerStack) and stack.count == 2 and len(stack.blocks) == 2
    assert stack.blocks[1].moe.down.data.shape[0] == 2  # the packed experts of layers 4 and 6, stacked
    state = init_state(scanned.config, 3, 64, 6, scanned.dtype, scanned.plan)
    assert isinstance(state.layers[2], CacheStack) and len(per_layer(state)) == LAYERS


def _run(target, invariant: bool, width: int, batch: int = 2):
    """Steps of `width` rows, committing fewer rows than stepped (rollback), from sequences at different
    positions; returns every step's logits and features and the final state's per-layer caches."""
    cfg = target.config
    program = step_program(cfg, target.options(CAPTURE, invariant=invariant))
    state = init_state(cfg, batch, 64, 6, target.dtype, target.plan)
    rng = np.random.default_rng(width)
    out = []
    for i in range(5):
        tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, width)), jnp.int32)
        logits, features, state = program(target.params, state, tokens)
        out += [np.asarray(logits), np.asarray(features)]
        state = commit(state, jnp.asarray([width, max(1, width - 1 - i % 2)][:batch], jnp.int32))
    out += [np.asarray(x) for x in jax.tree.leaves(per_layer(state))] + [np.asarray(state.length)]
    return out


def _check_same(invariant: bool, width: int, kernel: str = "ffi", same_bits: bool = True):
    """The scanned target's outputs against the unrolled one's: the same bits, or (`same_bits` False) within
    float32 rounding's reach (a wrong layer or cache would be off by far more)."""
    unrolled, scanned = targets(kernel)
    a, b = _run(unrolled, invariant, width), _run(scanned, invariant, width)
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        if same_bits:
            np.testing.assert_array_equal(x, y, err_msg=f"output {i}")
        else:
            np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-4, err_msg=f"output {i}")


@needs_plugin
def test_scanned_step_equals_unrolled():
    """Logits, captured features and every layer's caches are the same bits after steps with partial commits.

    The invariant step at width 6 (the FFI matrices, HC mixes and indexer inside the scanned body); the
    contractions XLA orders itself, inside a scan as unrolled, are test_scanned_step_on_the_reference_kernels_
    equals_unrolled's (and the FFI target's non-invariant step is in the slow test below)."""
    _check_same(True, 6)


@needs_plugin
@pytest.mark.slow
@pytest.mark.parametrize("invariant", [False, True])
@pytest.mark.parametrize("width", [1, 2, 3, 4, 5])
def test_scanned_step_equals_unrolled_every_width(invariant, width):
    _check_same(invariant, width)


def test_scanned_step_on_the_reference_kernels_equals_unrolled():
    """XLA's own contractions: the same bits on the CPU; on the GPU XLA fuses a scanned body's ops otherwise than
    the unrolled layers' (G29: 1986 of 2048 logits differ, by at most 6.2e-6), which the fast mode allows."""
    _check_same(False, 2, kernel="reference", same_bits=jax.default_backend() == "cpu")


def test_scanned_step_refuses_what_the_unrolled_refuses():
    unrolled, scanned = targets("reference")
    program = step_program(scanned.config, scanned.options(CAPTURE, invariant=False))
    narrow = init_state(scanned.config, 1, 64, 2, scanned.dtype, scanned.plan)
    with pytest.raises(CapacityError):
        program.compile(scanned.params, narrow, jnp.zeros((1, 3), jnp.int32))
    unrolled_state = init_state(scanned.config, 1, 64, 2, scanned.dtype)
    with pytest.raises(DsparkError, match="layer layout"):
        program.compile(scanned.params, unrolled_state, jnp.zeros((1, 1), jnp.int32))


@pytest.mark.parametrize("kernel,invariant", [pytest.param("ffi", True, marks=needs_plugin), ("reference", False)])
def test_scanned_body_reads_and_writes_in_place(kernel, invariant):
    """The scanned bodies copy no cache they write (the optimized HLO's loop bodies, `step_census.loop_moves`): the
    step's rows go into the stacked caches in place, and a layer's buffer is sliced out only where XLA's dots read
    it whole (the reference kernels: the window, the compressed entries and the indexer's keys), one slice per
    reading layer. A body that sliced each layer's caches out and wrote them back copies the rings too, and
    buffers more than once. On the FFI kernels nothing of the caches is copied, nor any HC mix matrix: the mHC
    and indexer kernels read their layer of the stacks themselves."""
    _, scanned = targets(kernel)
    state = init_state(scanned.config, 2, 64, 6, scanned.dtype, scanned.plan)
    program = step_program(scanned.config, scanned.options(CAPTURE, invariant=invariant))
    moves = loop_moves(program.lower(scanned.params, state, jnp.zeros((2, 6), jnp.int32)).compile().as_text())
    stacks = [c for c in state.layers if isinstance(c, CacheStack)]
    readers = collections.Counter()
    for layer in (c for stack in stacks for c in stack.layers):
        for name in () if kernel == "ffi" else ("index_keys", "window", "comp_kv"):
            leaf = getattr(layer, name)
            if leaf is not None:
                readers[shape_key(leaf.shape[1:], leaf.dtype)] += 1
    written = stacked_shapes(stacks)
    moved = collections.Counter(m.key for m in moves if m.key in written)
    assert moves and moved <= readers, (moved, readers)  # moves: the census sees the bodies' other slices
    if kernel == "ffi":
        fns = {shape_key(h.fn.shape[1:], h.fn.dtype) for stack in scanned.params.blocks
               if isinstance(stack, LayerStack) for blk in stack.blocks for h in (blk.hc_attn, blk.hc_ffn)}
        assert not [m for m in moves if m.key in fns]
