"""Position-indexed rings: the target's window and compressor rings and the drafter's context ring.

A ring of R slots keeps the row of position p at slot p % R. A step writes rows for a run of consecutive
positions ending at `last`; slot s then holds the largest p <= last with p ≡ s (mod R), so which position a
slot holds follows from `last` alone, with no tags to keep. A step may write rows that are later rejected
(positions at or past the committed length): with R = span + max_step − 1, such a row only overwrites a
position more than `span` behind every later query, so readers that look back at most `span` positions never
see one (`ring_size`). Rolling back is therefore only setting the committed length.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def ring_size(span: int, max_step: int) -> int:
    """Slots for readers that look back `span` positions, with steps of up to `max_step` rows."""
    return span + max_step - 1


def stack_index(layer: jax.Array | None) -> tuple[jax.Array, ...]:
    """The leading index of a buffer's layer: none for one layer's buffer, `(layer,)` into a stack `[L, ...]`."""
    return () if layer is None else (layer,)


def write(ring: jax.Array, rows: jax.Array, positions: jax.Array, layer: jax.Array | None = None) -> jax.Array:
    """Write `rows` `[B, Q, ...]` of positions int32 `[B, Q]` at slots `positions % R` of `ring` `[B, R, ...]`, or,
    given `layer` (int32 `[]`), of layer `layer` of a stack `ring` `[L, B, R, ...]` (a scatter into the stack,
    which a scanned body updates in place instead of slicing the layer out and writing it back)."""
    lead = stack_index(layer)
    batch = jnp.arange(rows.shape[0])[:, None]
    return ring.at[(*lead, batch, positions % ring.shape[len(lead) + 1])].set(rows.astype(ring.dtype))


def read(ring: jax.Array, positions: jax.Array, layer: jax.Array | None = None) -> jax.Array:
    """Rows of `ring` `[B, R, ...]` (with `layer`: of its layer of a stack `[L, B, R, ...]`) for positions int32
    `[B, *P]` -> `[B, *P, ...]` (any number of P axes)."""
    lead = stack_index(layer)
    batch = jnp.arange(positions.shape[0]).reshape((-1,) + (1,) * (positions.ndim - 1))
    return ring[(*lead, batch, positions % ring.shape[len(lead) + 1])]


def slot_positions(last_position: jax.Array, slots: int) -> jax.Array:
    """The position each slot holds once positions up to `last_position` (int32 `[B]`) were written.

    Slot s holds the largest p <= last_position with p ≡ s (mod slots); negative means never written.
    Returns int32 `[B, slots]`.
    """
    index = jnp.arange(slots, dtype=jnp.int32)
    return last_position[:, None] - jnp.mod(last_position[:, None] - index[None, :], slots)
