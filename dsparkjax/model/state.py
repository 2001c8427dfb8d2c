"""The target's decode state: position-indexed rings and append-only compressed entries (`ds4_arch.md` §4.6).

Every buffer is a pure function of "which positions < length were processed". A step of q tokens writes
rows for positions `length .. length+q-1` but does not advance `length`; `commit` advances it by the
accepted count. Rejected rows stay in the buffers, and visibility is computed from positions, so they are
never read: ring slots are attributed to positions by `ring.slot_positions`, and the ring sizes
(`ring.ring_size`: window + widest step − 1, and likewise for the compressor projections) guarantee that a
rejected row only ever overwrote a position no future query can see. Compressed entry w is read only by queries at
positions >= m(w+1)−1, and is rewritten at that boundary before any such query runs. Rollback is therefore
setting the length, and nothing else.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dsparkjax.config import CSA_RATIO, TargetConfig
from dsparkjax.errors import CapacityError
from dsparkjax.model.layer_plan import LayerPlan, unrolled_plan
from dsparkjax.model.ring import ring_size


@struct.dataclass
class LayerCache:
    """Per-layer buffers, leading axis = batch. Absent pieces are None (sliding-window layers)."""

    window: jax.Array  # [B, R_w, d] kv of position p at slot p % R_w (cache dtype)
    comp_proj: jax.Array | None  # [B, R_p, 2, c·d] float32 (a_p, s_p + ape) at slot p % R_p
    comp_kv: jax.Array | None  # [B, N, d] emitted compressed entry w at row w (cache dtype)
    index_proj: jax.Array | None  # [B, R_p, 2, 2·di] float32, CSA indexer projections
    index_keys: jax.Array | None  # [B, N, di] emitted indexer keys (float32)


@struct.dataclass
class CacheStack:
    """The caches of a scanned segment (`layer_plan.Segment`): layers[j] holds body position j of every
    repetition, each buffer stacked along a leading axis (repetition r at index r, then the batch)."""

    layers: tuple[LayerCache, ...]
    count: int = struct.field(pytree_node=False)  # the segment's repetitions (the stacks' leading size)


@struct.dataclass
class DecodeState:
    """Decode state of a batch: committed lengths and per-layer caches (an immutable pytree).

    Its capacity is static (part of the jit key): steps of at most `max_step` rows (the rings' size) and
    sequences of at most `max_len` positions (the compressed entries' rows).
    """

    length: jax.Array  # int32 [B] committed tokens per sequence
    layers: tuple[LayerCache | CacheStack, ...]  # one per segment of the layer plan (the params' layout)
    max_len: int = struct.field(pytree_node=False)
    max_step: int = struct.field(pytree_node=False)

    def check_step(self, width: int, lengths: np.ndarray | None = None) -> None:
        """Refuse a step of `width` rows wider than the rings, or, given the host's committed `lengths`
        (int `[B]`), one whose rows could be committed past `max_len` (their entries would be dropped)."""
        if width > self.max_step:
            raise CapacityError(f"a step of {width} rows is wider than the decode state's max_step "
                                f"{self.max_step}: its window ring would overwrite visible rows; build the "
                                f"state with max_step >= {width}")
        if lengths is not None and len(lengths) and int(np.max(lengths)) + width > self.max_len:
            raise CapacityError(f"a step of {width} rows after {int(np.max(lengths))} committed tokens passes "
                                f"the decode state's max_len {self.max_len}")


def init_state(cfg: TargetConfig, batch: int, max_len: int, max_step: int, dtype: jnp.dtype,
               plan: LayerPlan | None = None) -> DecodeState:
    """Empty state for `batch` sequences of up to `max_len` tokens, for steps of up to `max_step` rows.

    Args:
      dtype: the cache dtype of window and compressed kv (the compute dtype).
      plan: the layer plan of the target's parameters (`params.plan_of`; None: every layer unrolled): a
        scanned segment's caches are stacked as a CacheStack.
    """
    d, di = cfg.head_dim, cfg.index_head_dim

    def cache(i: int, lead: tuple[int, ...]) -> LayerCache:
        kind, m = cfg.layer_type(i), cfg.compress_ratios[i]
        window = jnp.zeros((*lead, batch, ring_size(cfg.sliding_window, max_step), d), dtype)
        comp_proj = comp_kv = index_proj = index_keys = None
        if kind != "swa":
            entries = -(-max_len // m)
            span = 2 * m if kind == "csa" else m
            width = (2 if kind == "csa" else 1) * d
            comp_proj = jnp.zeros((*lead, batch, ring_size(span, max_step), 2, width), jnp.float32)
            comp_kv = jnp.zeros((*lead, batch, entries, d), dtype)
            if kind == "csa":
                index_proj = jnp.zeros((*lead, batch, ring_size(span, max_step), 2, 2 * di), jnp.float32)
                index_keys = jnp.zeros((*lead, batch, -(-max_len // CSA_RATIO), di), jnp.float32)
        return LayerCache(window, comp_proj, comp_kv, index_proj, index_keys)

    layers = tuple(CacheStack(tuple(cache(seg.start + j, (seg.count,)) for j in range(seg.period)), seg.count)
                   if seg.scanned else cache(seg.start, ())
                   for seg in (plan or unrolled_plan(cfg)))
    return DecodeState(jnp.zeros((batch,), jnp.int32), layers, max_len, max_step)


def per_layer(state: DecodeState) -> tuple[LayerCache, ...]:
    """Every layer's caches in layer order, whatever the layout (a CacheStack's repetitions sliced out)."""
    out = []
    for entry in state.layers:
        if isinstance(entry, CacheStack):
            out += [jax.tree.map(lambda c: c[r], entry.layers[j]) for r in range(entry.count)
                    for j in range(len(entry.layers))]
        else:
            out.append(entry)
    return tuple(out)


def commit(state: DecodeState, accepted: jax.Array) -> DecodeState:
    """Advance each sequence by its accepted count (int32 [B]); everything past it is rolled back."""
    return state.replace(length=state.length + accepted.astype(jnp.int32))


def reset(state: DecodeState, rows: jax.Array) -> DecodeState:
    """Start the sequences where `rows` (bool [B]) is true afresh (length 0; old rows become invisible)."""
    return state.replace(length=jnp.where(rows, 0, state.length))
