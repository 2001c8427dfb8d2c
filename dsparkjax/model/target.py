"""The DS4 target forward as one step over q new tokens per sequence (`ds4_arch.md` §3, §4.4).

`step(params, state, tokens)` runs rows at positions `length .. length+q-1` of every sequence through all
layers, writes their rows into the state (write-then-read, so chunked == token-by-token), and returns the
logits of every row, the captured features for the drafter and the new state (length not advanced; see
`state.py`). Plain decode, verification and prefill chunks are all this one function, jitted once per q.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax
import jax.numpy as jnp

from dsparkjax import kernels
from dsparkjax.config import CSA_RATIO, TargetConfig, yarn_ramp
from dsparkjax.kernels.policy import KernelPolicy, routed
from dsparkjax.model.block import (
    attend,
    attention_output,
    block_forward,
    kv_sim,
    moe_output,
    query_heads,
)
from dsparkjax.model.hc import hc_head
from dsparkjax.model.layers import apply_rope, fp4_indexer_sim, rope_frequencies, route
from dsparkjax.errors import DsparkError
from dsparkjax.model.layer_plan import Segment
from dsparkjax.model.params import (Attention, Block, Compressor, HyperConnection, Indexer, LayerStack, MoE,
                                    TargetParams, plan_of)
from dsparkjax.model import reduce, ring
from dsparkjax.model.state import CacheStack, DecodeState, LayerCache
from dsparkjax.model.reduce import StackedDense
from dsparkjax.model.weights import PackedWeight, RowBlocks, linear


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """Static switches of the target step (part of the jit cache key)."""

    simulate_qat: bool = True  # FP8 KV and FP4+Hadamard indexer rounding of the official model (§6.2)
    capture_layers: tuple[int, ...] = ()  # layers whose HC streams feed the drafter
    capture_point: Literal["after", "entering"] = "after"  # V4-Flash: after (dspark_reference.md §1)
    policy: KernelPolicy = KernelPolicy()  # kernel routing: HC backend, dense-copy thresholds, tensor-core mode


# The matrices of each parameter struct: in a scanned body under an invariant policy they are read in place as
# StackedDense (the MoE call on the whole stack) when dense; everything else is sliced.
_MATRICES = {Attention: ("wq_a_kv", "wq_b", "wo_a", "wo_b"), Compressor: ("wkv", "wgate"),
             Indexer: ("wq_b", "weights_proj"), MoE: ("router", "gate_up", "down", "shared_gate_up", "shared_down")}
# Read in place (StackedDense) under every policy: the HC mixes' fn, which the mHC kernel indexes by layer itself.
_ALWAYS_IN_PLACE = {HyperConnection: ("fn",)}


def layer_view(tree: Any, r: jax.Array, dense_in_place: bool) -> Any:
    """Layer r of a stacked parameter tree (leaves `[L, ...]`), for a scanned body: packed weights read in place
    (`PackedWeight.at_layer`), the HC mixes' fn and, when `dense_in_place`, dense matrices too (`StackedDense`),
    other leaves sliced."""

    def walk(node: Any, in_place: bool = False) -> Any:
        if node is None:
            return None
        if isinstance(node, PackedWeight):
            return node.at_layer(r)
        if isinstance(node, jax.Array):
            return StackedDense(node, r) if in_place else node[r]
        if isinstance(node, RowBlocks):
            return node.replace(parts=tuple(walk(p, in_place) for p in node.parts))
        names = _ALWAYS_IN_PLACE.get(type(node), ()) + (_MATRICES.get(type(node), ()) if dense_in_place else ())
        return node.replace(**{f.name: walk(getattr(node, f.name), f.name in names)
                               for f in dataclasses.fields(node) if f.metadata.get("pytree_node", True)})

    return walk(tree)


def _batch_index(x: jax.Array) -> jax.Array:
    return jnp.arange(x.shape[0])[:, None]


def layer_of(buffer: jax.Array, at: jax.Array | None) -> jax.Array:
    """A cache buffer of one layer: `buffer` itself, or (`at` int32 `[]`) layer `at` of a stack `[L, ...]`, sliced
    where it is read (a scanned body writes the stack in place and never copies a layer back)."""
    return buffer if at is None else buffer[at]


def keys_of(buffer: jax.Array, at: jax.Array | None) -> reduce.Dense:
    """A cache buffer of one layer as attention's keys: `buffer` itself, or layer `at` of a stack as a StackedDense,
    which the invariant step's products read in place (a slice would be copied for their custom call every step)."""
    return buffer if at is None else StackedDense(buffer, at)


def compress(cp: Compressor, x: jax.Array, positions: jax.Array, ring_rows: jax.Array, ratio: int, overlap: bool,
             eps: float, at: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Gated per-channel pooling of windows of `ratio` tokens (`ds4_arch.md` §3.4), for every row.

    Writes each row's projections `(a, s + ape[p mod m])` into the projection ring, then, for every row,
    pools the window that ends at it: HCA (no overlap) over positions p−m+1..p; CSA (overlap) over 2m slots,
    the first-half channels of the previous window and the second-half channels of the current one, with
    missing slots (before position 0) at −inf. Only rows at a boundary ((p+1) mod m == 0) emit; the caller
    keeps those.

    Args:
      x: `[B, Q, D]` normalised attention input; positions: int32 `[B, Q]`; ring_rows: `[B, R, 2, c·w]`, or with
        `at` a stack `[L, B, R, 2, c·w]` whose layer `at` this is (written in place).
    Returns:
      (new ring, pooled and RMS-normalised entries float32 `[B, Q, w]`, entry index int32 `[B, Q]` which is
      `(p+1)/m − 1` at boundaries and −1 elsewhere).
    """
    values = linear(x, cp.wkv)
    scores = linear(x, cp.wgate) + cp.ape[positions % ratio]
    ring_rows = ring.write(ring_rows, jnp.stack([values, scores], axis=2), positions, at)
    span = 2 * ratio if overlap else ratio
    window_pos = positions[..., None] + jnp.arange(1 - span, 1)  # [B, Q, span]
    rows = ring.read(ring_rows, window_pos, at)  # [B, Q, span, 2, c·w]
    if overlap:
        width = rows.shape[-1] // 2
        rows = jnp.concatenate([rows[:, :, :ratio, :, :width], rows[:, :, ratio:, :, width:]], axis=2)
    values, scores = rows[..., 0, :], rows[..., 1, :]
    scores = jnp.where(window_pos[..., None] >= 0, scores, -jnp.inf)
    pooled = reduce.total(reduce.softmax(scores, axis=2) * values, axis=2)
    boundary = (positions + 1) % ratio == 0
    index = jnp.where(boundary, (positions + 1) // ratio - 1, -1)
    return ring_rows, reduce.rms_norm(pooled, cp.norm, eps), index


def store_entries(cache: jax.Array, entries: jax.Array, index: jax.Array, at: jax.Array | None = None) -> jax.Array:
    """Write `entries` `[B, Q, w]` at rows `index` `[B, Q]` of `cache` `[B, N, w]` (with `at`: of its layer `at` of a
    stack `[L, B, N, w]`, in place); index −1 or >= N is dropped."""
    lead = ring.stack_index(at)
    index = jnp.where(index < 0, cache.shape[-2], index)
    return cache.at[(*lead, _batch_index(index), index)].set(entries.astype(cache.dtype), mode="drop")


class TargetModel:
    """Static pieces of the target forward (config, options, RoPE tables); methods are pure functions."""

    def __init__(self, cfg: TargetConfig, options: StepOptions):
        self.cfg, self.options = cfg, options
        self.swa_freqs = rope_frequencies(cfg.rope_dim, cfg.rope_theta)
        lo, hi = yarn_ramp(cfg)
        self.compressed_freqs = rope_frequencies(cfg.rope_dim, cfg.compress_rope_theta, (cfg.yarn_factor, lo, hi))

    # -- attention ----------------------------------------------------------------------------------------

    def _indexer_select(self, ix: Indexer, x: jax.Array, qr: jax.Array, positions: jax.Array, cache: LayerCache,
                        freqs, at: jax.Array | None) -> tuple[LayerCache, jax.Array, jax.Array]:
        """Lightning Indexer (§3.5): update its keys, score visible compressed entries, pick the top-k.

        Returns (cache, selected entry ids int32 `[B, Q, k]`, whether each pick is a real candidate `[B, Q, k]`).
        """
        cfg = self.cfg
        b, q = positions.shape
        iq = linear(qr, ix.wq_b).reshape(b, q, cfg.index_heads, cfg.index_head_dim)
        iq = apply_rope(iq, positions[..., None], freqs)
        index_proj, keys, index = compress(ix.compressor, x, positions, cache.index_proj, CSA_RATIO, True,
                                           cfg.rms_norm_eps, at)
        keys = apply_rope(keys, jnp.maximum(index, 0) * CSA_RATIO, freqs)
        if self.options.simulate_qat:
            iq, keys = fp4_indexer_sim(iq), fp4_indexer_sim(keys)
        index_keys = store_entries(cache.index_keys, keys, index, at)
        head_weights = linear(x, ix.weights_proj) * (cfg.index_head_dim * cfg.index_heads) ** -0.5
        k = min(cfg.index_topk, index_keys.shape[-2])
        # ties -> lowest index (§6.3 item 4); entry w is visible from position 4(w+1)−1 on
        picks, real = kernels.indexer_topk(iq, index_keys, head_weights, (positions + 1) // CSA_RATIO, k,
                                           backend=self.options.policy.indexer_backend, layer=at)
        return cache.replace(index_proj=index_proj, index_keys=index_keys), picks, real

    def attention(self, layer: int, blk: Block, x: jax.Array, positions: jax.Array, cache: LayerCache,
                  at: jax.Array | None = None) -> tuple[jax.Array, LayerCache]:
        """MLA with a shared K=V head over the window ring plus compressed entries, with sinks (§3.3).

        With `at` (int32 `[]`, a scanned body), `cache`'s buffers are stacks `[L, B, ...]` of which this is layer
        `at`: the step's rows are written into them in place and each layer's buffers are read where used.
        """
        cfg, attn = self.cfg, blk.attn
        kind = cfg.layer_type(layer)
        freqs = self.swa_freqs if kind == "swa" else self.compressed_freqs
        qr, heads, kv = query_heads(attn, x, positions, freqs, cfg, self.options.simulate_qat)
        window = ring.write(cache.window, kv, positions, at)
        cache = cache.replace(window=window)

        slot_pos = ring.slot_positions(positions[:, -1], window.shape[-2])[:, None, :]  # [B, 1, R]
        p = positions[..., None]
        in_window = (slot_pos <= p) & (slot_pos > p - cfg.sliding_window) & (slot_pos >= 0)
        # keys [B, K, d] shared by all rows, or [B, Q, K, d]
        key_sets = [(keys_of(window, at), in_window)]
        if kind != "swa":
            m = cfg.compress_ratios[layer]
            comp_proj, entries, index = compress(blk.compressor, x, positions, cache.comp_proj, m, kind == "csa",
                                                 cfg.rms_norm_eps, at)
            entries = kv_sim(apply_rope(entries, jnp.maximum(index, 0) * m, freqs), cfg.nope_dim,
                             self.options.simulate_qat)
            comp_kv = store_entries(cache.comp_kv, entries, index, at)
            cache = cache.replace(comp_proj=comp_proj, comp_kv=comp_kv)
            if kind == "hca":
                visible = jnp.arange(comp_kv.shape[-2]) < ((positions + 1) // m)[..., None]
                key_sets.append((keys_of(comp_kv, at), visible))
            else:
                cache, picks, real = self._indexer_select(blk.indexer, x, qr, positions, cache, freqs, at)
                picked = layer_of(comp_kv, at)[_batch_index(picks)[..., None], picks]  # [B, Q, k, d]
                key_sets.append((picked.astype(jnp.float32), real))
        return attention_output(attn, attend(heads, key_sets, attn.sinks, cfg.head_dim ** -0.5), positions, freqs,
                                cfg), cache

    # -- MoE and block ------------------------------------------------------------------------------------

    def moe(self, layer: int, mo: MoE, x: jax.Array, tokens: jax.Array) -> jax.Array:
        """Routed top-k experts (or hash-routed) plus the shared expert, clamped SwiGLU (§3.6)."""
        cfg = self.cfg
        hashed = None if mo.tid2eid is None else mo.tid2eid[tokens]
        ids, weights = route(x, mo.router, mo.bias, hashed, cfg.n_active_experts, cfg.routed_scaling_factor)
        return moe_output(mo, x, ids, weights, cfg.swiglu_limit[layer], cfg.swiglu_limit_shared[layer])

    def block(self, layer: int, blk: Block, streams: jax.Array, tokens: jax.Array, positions: jax.Array,
              cache: LayerCache, at: jax.Array | None = None) -> tuple[jax.Array, LayerCache]:
        """One layer on the HC streams `[B, Q, n, D]` (`at`: its index into stacked caches, as `attention`'s)."""
        return block_forward(blk, streams, self.cfg,
                             lambda x: self.attention(layer, blk, x, positions, cache, at),
                             lambda x: self.moe(layer, blk.moe, x, tokens), self.options.policy.hc_backend)

    @property
    def policy(self) -> KernelPolicy:
        return self.options.policy

    @routed
    def step(self, params: TargetParams, state: DecodeState, tokens: jax.Array
             ) -> tuple[jax.Array, jax.Array, DecodeState]:
        """Process `tokens` int32 `[B, Q]` at positions `state.length + 0..Q-1`.

        Returns:
          (logits float32 `[B, Q, V]`, features float32 `[B, Q, n_capture, D]` (mean over HC streams of the
          capture layers), new state with the rows written and `length` unchanged).
        Raises CapacityError (while tracing) for a step wider than the state's `max_step`.
        """
        cfg, opts = self.cfg, self.options
        state.check_step(tokens.shape[1])
        if len(params.blocks) != len(state.layers) or any(
                isinstance(b, LayerStack) != isinstance(c, CacheStack) for b, c in zip(params.blocks, state.layers)):
            raise DsparkError("the decode state's layer layout does not match the target's: build it with "
                              "init_state(..., plan=plan_of(params))")
        positions = state.length[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
        embedded = params.embed[tokens].astype(jnp.float32)
        streams = jnp.broadcast_to(embedded[:, :, None, :], embedded.shape[:2] + (cfg.hc_mult, cfg.hidden_size))
        captured: dict[int, jax.Array] = {}
        caches = []
        for seg, blocks, cache in zip(plan_of(params), params.blocks, state.layers):
            if seg.scanned:
                streams, cache = self._scanned(seg, blocks, cache, streams, tokens, positions, captured)
            else:
                streams, cache, mean = self._layer(seg.start, blocks, cache, streams, tokens, positions,
                                                   seg.start in opts.capture_layers)
                if mean is not None:
                    captured[seg.start] = mean
            caches.append(cache)
        collapsed = hc_head(streams, params.hc_head.fn, params.hc_head.base, params.hc_head.scale,
                            hc_eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps)
        logits = linear(reduce.rms_norm(collapsed, params.norm, cfg.rms_norm_eps), params.head)
        features = (jnp.stack([captured[i] for i in opts.capture_layers], axis=2) if captured
                    else jnp.zeros(tokens.shape + (0, cfg.hidden_size), jnp.float32))
        return logits, features, state.replace(layers=tuple(caches))

    def _layer(self, layer: int, blk: Block, cache: LayerCache, streams: jax.Array, tokens: jax.Array,
               positions: jax.Array, capture: bool, at: jax.Array | None = None
               ) -> tuple[jax.Array, LayerCache, jax.Array | None]:
        """One layer (`at`: its index into stacked caches, as `attention`'s); with `capture`, also the mean over
        its HC streams (entering or after it, per the options)."""
        mean = None
        if capture and self.options.capture_point == "entering":
            mean = reduce.mean(streams, axis=2)
        streams, cache = self.block(layer, blk, streams, tokens, positions, cache, at)
        if capture and self.options.capture_point == "after":
            mean = reduce.mean(streams, axis=2)
        return streams, cache, mean

    def _scanned(self, seg: Segment, stack: LayerStack, caches: CacheStack, streams: jax.Array, tokens: jax.Array,
                 positions: jax.Array, captured: dict[int, jax.Array]) -> tuple[jax.Array, CacheStack]:
        """A scanned segment: one `lax.scan` over its repetitions r, the body one period of layers.

        The stacked weights stay whole in the body (the FFI kernels read layer r in place, `PackedWeight.at_layer`),
        and so do the stacked caches, carried through the loop: the step's rows are written into layer r of each
        stack in place, and layer r's buffers are read where attention uses them. Body positions holding a
        capture layer in some repetition emit their mean streams for every repetition, and the captured ones are
        kept (`captured`).
        """
        layers = self.options.capture_layers
        capture = {j for j in range(seg.period) if any(seg.start + r * seg.period + j in layers
                                                       for r in range(seg.count))}

        def body(carry, r):
            streams, stacks = carry
            stacks, means = list(stacks), {}
            for j in range(seg.period):
                blk = layer_view(stack.blocks[j], r, self.policy.invariant)
                streams, stacks[j], means[j] = self._layer(seg.start + j, blk, stacks[j], streams, tokens, positions,
                                                           j in capture, r)
            return (streams, tuple(stacks)), {j: m for j, m in means.items() if m is not None}

        (streams, stacks), means = jax.lax.scan(body, (streams, caches.layers), jnp.arange(seg.count))
        for j, per_rep in means.items():
            for r in range(seg.count):
                if seg.start + r * seg.period + j in layers:
                    captured[seg.start + r * seg.period + j] = per_rep[r]
        return streams, caches.replace(layers=stacks)
