"""Shared helpers for the model and speculative-decoding tests: a tiny target and pair, random prompts,
stepping, visible state.

The cached models here (`tiny_target_model`, `tiny_pair_model`) hold compiled programs; conftest.py clears
every lru_cache of this module when a test module ends, so each test module compiles its own and frees them.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import tempfile

import chex
import jax.numpy as jnp
import numpy as np

from dsparkjax.config import DrafterConfig, TargetConfig, tiny_drafter, tiny_target
from dsparkjax.decoding.program import step_program
from dsparkjax.decoding.proposer import Drafter
from dsparkjax.pair import load_pair
from dsparkjax.ggufio import write_model_gguf
from dsparkjax.model.state import DecodeState, commit, init_state
from dsparkjax.target_api import Target, load_target
from dsparkjax.tiny import tiny_pair, write_tiny_pair

MAX_STEP = 16
VOCAB = 512  # tiny_target()'s vocabulary, the tiny pair's

_SCRATCH = tempfile.TemporaryDirectory(prefix="dsparkjax-tests-")  # removed when the test process exits


def scratch_dir(prefix: str) -> str:
    """A new directory for the files a cached helper writes (models the helpers build), removed with the test
    process: plain `tempfile.mkdtemp` folders outlived it, a few MB per model and run, in /tmp."""
    return tempfile.mkdtemp(prefix=prefix, dir=_SCRATCH.name)


@functools.lru_cache(maxsize=None)
def tiny_target_model(seed: int = 0, simulate_qat: bool = True, swiglu_limit: float = 10.0) -> Target:
    """A loaded tiny target (written to a temp GGUF and read back, so the loader is exercised too)."""
    cfg = tiny_target(swiglu_limit=swiglu_limit)
    target_cfg, params, _, _ = tiny_pair(seed, target_cfg=cfg)
    path = os.path.join(scratch_dir("target-"), "target.gguf")
    write_model_gguf(path, target_cfg, params, recipe="f32")
    return load_target(path, simulate_qat=simulate_qat)


@functools.lru_cache(maxsize=None)
def tiny_pair_paths(seed: int = 0) -> tuple[str, str]:
    """Paths of a tiny target/drafter pair with a tokenizer."""
    return write_tiny_pair(scratch_dir("pair-"), seed=seed)


@functools.lru_cache(maxsize=None)
def tiny_pair_model(seed: int = 0) -> tuple[Target, Drafter]:
    """The loaded (target, DSpark drafter) of `tiny_pair_paths(seed)`: random weights, so the drafter mostly
    disagrees with the target."""
    target, drafter, _, _ = load_pair(*tiny_pair_paths(seed), need_drafter=True)
    return target, drafter


def random_prompts(rng: np.random.Generator, batch: int, max_len: int = 20) -> list[list[int]]:
    """`batch` prompts of 1..max_len token ids drawn uniformly from the tiny pair's vocabulary."""
    return [rng.integers(0, VOCAB, int(rng.integers(1, max_len + 1))).tolist() for _ in range(batch)]


def step_fn(target: Target, capture: tuple[int, ...] = ()):
    return step_program(target.config, target.options(capture))


def fresh_state(target: Target, batch: int, max_len: int = 96) -> DecodeState:
    return init_state(target.config, batch, max_len, MAX_STEP, target.dtype)


def prefill(target: Target, state: DecodeState, tokens: np.ndarray, lengths: np.ndarray, width: int
            ) -> tuple[DecodeState, np.ndarray]:
    """Feed each sequence its first `lengths[b]` tokens in steps of `width` rows (padding past its length).

    Returns (state, logits float32 `[B, max(lengths), V]` of the fed positions; rows past a length are junk).
    """
    step = step_fn(target)
    batch = tokens.shape[0]
    done = np.zeros(batch, np.int64)
    out = np.zeros((batch, int(lengths.max()) if len(lengths) else 0, target.config.vocab_size), np.float32)
    while (done < lengths).any():
        valid = np.clip(lengths - done, 0, width)
        rows = np.zeros((batch, width), np.int32)
        for b in range(batch):
            rows[b, : valid[b]] = tokens[b, done[b] : done[b] + valid[b]]
        logits, _, state = step(target.params, state, jnp.asarray(rows))
        logits = np.asarray(logits)
        for b in range(batch):
            out[b, done[b] : done[b] + valid[b]] = logits[b, : valid[b]]
        state = commit(state, jnp.asarray(valid, jnp.int32))
        done += valid
    return state, out


def visible_state(state: DecodeState, cfg: TargetConfig) -> dict[str, np.ndarray]:
    """What the next query of each sequence can depend on, gathered by position (rollback compares this).

    Window kv of the last `window` positions before `length`; compressed entries and indexer keys below
    `length // m`; compressor projections of the positions the next emissions will pool. Positions < 0 are
    zero-filled so sequences of different lengths stack.
    """
    length = np.asarray(state.length)
    view: dict[str, np.ndarray] = {}
    for i, cache in enumerate(state.layers):
        w = cfg.sliding_window
        pos = length[:, None] - w + np.arange(w)[None, :]
        ring = np.asarray(cache.window)
        rows = ring[np.arange(len(length))[:, None], pos % ring.shape[1]]
        view[f"layer{i}.window"] = np.where((pos >= 0)[..., None], rows, 0)
        if cache.comp_kv is None:
            continue
        m = cfg.compress_ratios[i]
        for name, buf, ratio in (("comp_kv", cache.comp_kv, m), ("index_keys", cache.index_keys, 4)):
            if buf is None:
                continue
            arr = np.asarray(buf)
            n = np.arange(arr.shape[1])[None, :] < (length // ratio)[:, None]
            view[f"layer{i}.{name}"] = np.where(n[..., None], arr, 0)
        overlap = cfg.layer_type(i) == "csa"
        for name, buf, ratio in (("comp_proj", cache.comp_proj, m), ("index_proj", cache.index_proj, 4)):
            if buf is None:
                continue
            view[f"layer{i}.{name}"] = _pending_projections(np.asarray(buf), length, ratio, overlap)
    return view


def _pending_projections(ring: np.ndarray, length: np.ndarray, ratio: int, overlap: bool) -> np.ndarray:
    """Projection rows later emissions will pool: the current partial window (and the previous one, CSA)."""
    span = 2 * ratio if overlap else ratio
    start = (length // ratio) * ratio - (ratio if overlap else 0)
    pos = start[:, None] + np.arange(span)[None, :]
    rows = ring[np.arange(len(length))[:, None], pos % ring.shape[1]]
    keep = (pos >= 0) & (pos < length[:, None])
    return np.where(keep[..., None, None], rows, 0)


def random_tokens(rng: np.random.Generator, shape: tuple[int, ...], vocab: int) -> np.ndarray:
    return rng.integers(0, vocab, shape).astype(np.int32)


def max_rel_err(a: np.ndarray, b: np.ndarray) -> float:
    """max|a − b| / max|b|: the error measure of the acceptance criteria (relative to the array's scale)."""
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def assert_states_close(a: dict[str, np.ndarray], b: dict[str, np.ndarray], tol: float = 1e-5) -> None:
    """Same structure, and every buffer within `tol` max relative error (see `max_rel_err`)."""
    chex.assert_trees_all_equal_shapes_and_dtypes(a, b)
    for key in a:
        err = max_rel_err(a[key], b[key]) if np.any(b[key]) else float(np.max(np.abs(a[key])))
        assert err < tol, f"{key}: max relative error {err:.2e} >= {tol}"


def decode_single(target, state, tokens, start, count, width=1):
    """Feed tokens[b, start[b] + i] one per step for `count` steps; steps of `width` rows pad with junk."""
    step = step_fn(target)
    batch = tokens.shape[0]
    logits = []
    for i in range(count):
        rows = np.zeros((batch, width), np.int32)
        rows[:, 0] = tokens[np.arange(batch), start + i]
        out, _, state = step(target.params, state, jnp.asarray(rows))
        logits.append(np.asarray(out[:, 0]))
        state = commit(state, jnp.ones((batch,), jnp.int32))
    return state, (np.stack(logits, axis=1) if logits else np.zeros((batch, 0, target.config.vocab_size), np.float32))


def recipe_configs(recipe: str) -> tuple[TargetConfig, DrafterConfig]:
    """Tiny configs whose quantized rows are whole blocks for `recipe`."""
    if recipe in ("published", "q4k_experts"):  # k-quant rows are 256 wide; 4 experts and 64 tokens keep it quick
        target = dataclasses.replace(tiny_target(vocab_size=64, hidden_size=256, moe_intermediate_size=256),
                                     n_routed_experts=4)
        return target, dataclasses.replace(tiny_drafter(target), n_routed_experts=4)
    target = tiny_target()  # rows of 64 and 32: whole Q8_0 and ROCm (32-wide) blocks
    return target, tiny_drafter(target)
