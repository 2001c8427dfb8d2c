"""The target's decode state: position-indexed rings and append-only compressed entries (`ds4_arch.md` §4.6).

Every buffer is a pure function of "which positions < length were processed". A step of q tokens writes
rows for positions `length .. length+q-1` but does not advance `length`; `commit` advances it by the
accepted count. Rejected rows stay in the buffers, and visibility is computed from positions, so they are
never read: ring slots are attributed to positions by the formula of `window_slot_positions`, and the ring
sizes (window + widest step − 1, and likewise for the compressor projections) guarantee that a rejected row
only ever overwrote a position no future query can see. Compressed entry w is read only by queries at
positions >= m(w+1)−1, and is rewritten at that boundary before any such query runs. Rollback is therefore
setting the length, and nothing else.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from dsparkjax.config import CSA_RATIO, TargetConfig


@struct.dataclass
class LayerCache:
    """Per-layer buffers, leading axis = batch. Absent pieces are None (sliding-window layers)."""

    window: jax.Array  # [B, R_w, d] kv of position p at slot p % R_w (cache dtype)
    comp_proj: jax.Array | None  # [B, R_p, 2, c·d] float32 (a_p, s_p + ape) at slot p % R_p
    comp_kv: jax.Array | None  # [B, N, d] emitted compressed entry w at row w (cache dtype)
    index_proj: jax.Array | None  # [B, R_p, 2, 2·di] float32, CSA indexer projections
    index_keys: jax.Array | None  # [B, N, di] emitted indexer keys (float32)


@struct.dataclass
class DecodeState:
    """Decode state of a batch: committed lengths and per-layer caches (an immutable pytree)."""

    length: jax.Array  # int32 [B] committed tokens per sequence
    layers: tuple[LayerCache, ...]


def init_state(cfg: TargetConfig, batch: int, max_len: int, max_step: int, dtype: jnp.dtype) -> DecodeState:
    """Empty state for `batch` sequences of up to `max_len` tokens, for steps of up to `max_step` rows.

    Args:
      dtype: the cache dtype of window and compressed kv (the compute dtype).
    """
    d, di = cfg.head_dim, cfg.index_head_dim
    layers = []
    for i in range(cfg.num_layers):
        kind, m = cfg.layer_type(i), cfg.compress_ratios[i]
        window = jnp.zeros((batch, cfg.sliding_window + max_step - 1, d), dtype)
        comp_proj = comp_kv = index_proj = index_keys = None
        if kind != "swa":
            entries = -(-max_len // m)
            span = 2 * m if kind == "csa" else m
            width = (2 if kind == "csa" else 1) * d
            comp_proj = jnp.zeros((batch, span + max_step - 1, 2, width), jnp.float32)
            comp_kv = jnp.zeros((batch, entries, d), dtype)
            if kind == "csa":
                index_proj = jnp.zeros((batch, span + max_step - 1, 2, 2 * di), jnp.float32)
                index_keys = jnp.zeros((batch, -(-max_len // CSA_RATIO), di), jnp.float32)
        layers.append(LayerCache(window, comp_proj, comp_kv, index_proj, index_keys))
    return DecodeState(jnp.zeros((batch,), jnp.int32), tuple(layers))


def commit(state: DecodeState, accepted: jax.Array) -> DecodeState:
    """Advance each sequence by its accepted count (int32 [B]); everything past it is rolled back."""
    return state.replace(length=state.length + accepted.astype(jnp.int32))


def reset(state: DecodeState, rows: jax.Array) -> DecodeState:
    """Start the sequences where `rows` (bool [B]) is true afresh (length 0; old rows become invisible)."""
    return state.replace(length=jnp.where(rows, 0, state.length))


def window_slot_positions(last_position: jax.Array, ring: int) -> jax.Array:
    """The position each ring slot holds once positions up to `last_position` (int32 [B]) were written.

    Slot s holds the largest p <= last_position with p ≡ s (mod ring); negative means never written.
    Returns int32 [B, ring].
    """
    slots = jnp.arange(ring, dtype=jnp.int32)
    return last_position[:, None] - jnp.mod(last_position[:, None] - slots[None, :], ring)
