"""The DSpark drafter: three V4 blocks over a `[seed, MASK×4]` block conditioned on target features.

Per `dspark.md` §1.3 and DeepSeek's own code (`dspark_reference.md`):
- context: the captured target features of committed positions p (mean over HC streams after the capture
  layers, concatenated) go through `main_x = RMSNorm(main_proj(features))`, and each stage projects
  `main_x` with its own `wkv`/`kv_norm` into context kv rows, roped at p (base 10000, no YaRN). They are
  kept in a per-stage position ring (`model/ring.py`, as the target's window), so only accepted positions
  are ever visible;
- proposal: the block `[seed, MASK, …]` at positions seed_pos + j, embedded with the target's table,
  runs through the stages (attention over the ≤ window context rows before seed_pos plus all block rows,
  bidirectional, with sinks; a top-k MoE without hash routing), the sigmoid HC head, the drafter's own norm
  and the target's LM head; the Markov head adds `W2·W1[prev]` to each row's logits left to right, and the
  confidence head reads the pre-norm hidden and `W1[prev]`. One jitted call, no host round trip per token.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import struct

from dsparkjax.config import DrafterConfig
from dsparkjax.decoding import sampling
from dsparkjax.decoding.sampling import RowSampling
from dsparkjax.errors import CapacityError
from dsparkjax.kernels.policy import KernelPolicy, routed
from dsparkjax.model import reduce, ring
from dsparkjax.model.block import attend, attention_output, block_forward, kv_rows, moe_output, query_heads
from dsparkjax.model.hc import hc_head
from dsparkjax.model.layers import rope_frequencies, route
from dsparkjax.model.params import Block, DrafterParams
from dsparkjax.model.weights import linear


@struct.dataclass
class DrafterState:
    """Context kv rows of every stage, in position rings (`model/ring.py`) sized for steps of `max_step` rows."""

    context_kv: tuple[jax.Array, ...]  # per stage [B, R, d] (cache dtype), position p at slot p % R
    last_position: jax.Array  # int32 [B], the last position absorbed (−1: none)
    max_step: int = struct.field(pytree_node=False)  # the widest absorbed step the rings were built for


def init_drafter_state(cfg: DrafterConfig, batch: int, max_step: int, dtype: jnp.dtype) -> DrafterState:
    """Empty context rings sized window + widest absorbed step, so uncommitted rows never evict visible ones.

    A proposal at seed position s reads the window s − window .. s − 1, and a step may absorb rows from s on
    while committing none (a prefill chunk absorbs every row, also those it does not prefill): the ring spans
    the window plus such a step, one slot more than a reader that sees its own position (the target's window).
    """
    slots = ring.ring_size(cfg.sliding_window + 1, max_step)
    kv = tuple(jnp.zeros((batch, slots, cfg.head_dim), dtype) for _ in range(cfg.num_stages))
    return DrafterState(kv, jnp.full((batch,), -1, jnp.int32), max_step)


class DrafterModel:
    """Static pieces of the drafter (config, options, RoPE table); methods are pure functions."""

    def __init__(self, cfg: DrafterConfig, simulate_qat: bool, policy: KernelPolicy = KernelPolicy()):
        self.cfg, self.simulate_qat, self.policy = cfg, simulate_qat, policy
        self.freqs = rope_frequencies(cfg.rope_dim, cfg.rope_theta)

    @routed
    def absorb(self, params: DrafterParams, state: DrafterState, features: jax.Array, positions: jax.Array
               ) -> DrafterState:
        """Project target features of positions `[B, C]` into every stage's context ring.

        Args:
          features: float32 `[B, C, n_capture, D]` from the target step; positions: int32 `[B, C]`, consecutive
            per sequence. Rows of positions that will not be committed may be absorbed too: they are at or
            past the committed length, so they stay invisible until the same position is absorbed again.
        Raises CapacityError (while tracing) for more than `state.max_step` rows.
        """
        b, c = positions.shape
        if c > state.max_step:
            raise CapacityError(f"the drafter absorbed a step of {c} rows, wider than its context state's "
                                f"max_step {state.max_step}: build it with max_step >= {c}")
        main_x = reduce.rms_norm(linear(features.reshape(b, c, -1), params.fc), params.hidden_norm,
                                 self.cfg.rms_norm_eps)
        kv = tuple(ring.write(rows, kv_rows(stage.attn, main_x, positions, self.freqs, self.cfg, self.simulate_qat),
                              positions)
                   for stage, rows in zip(params.stages, state.context_kv))
        return state.replace(context_kv=kv, last_position=positions[:, -1])

    def _stage(self, stage: Block, streams: jax.Array, positions: jax.Array, context: jax.Array,
               context_valid: jax.Array) -> jax.Array:
        cfg = self.cfg

        def attention(x: jax.Array) -> tuple[jax.Array, None]:
            _, heads, block_kv = query_heads(stage.attn, x, positions, self.freqs, cfg, self.simulate_qat)
            block_kv = block_kv.astype(context.dtype)  # the block's keys as the context ring stores them
            all_rows = jnp.ones(positions.shape + positions.shape[1:], bool)
            key_sets = [(context, context_valid), (block_kv, all_rows)]  # read in their dtype (`attend` upcasts)
            out = attend(heads, key_sets, stage.attn.sinks, cfg.head_dim ** -0.5)
            return attention_output(stage.attn, out, positions, self.freqs, cfg), None

        def ffn(x: jax.Array) -> jax.Array:
            ids, weights = route(x, stage.moe.router, stage.moe.bias, None, cfg.n_active_experts,
                                 cfg.routed_scaling_factor)
            return moe_output(stage.moe, x, ids, weights, cfg.swiglu_limit, cfg.swiglu_limit)

        streams, _ = block_forward(stage, streams, cfg, attention, ffn, self.policy.hc_backend)
        return streams

    @routed
    def propose(self, params: DrafterParams, embed: jax.Array, head: jax.Array, state: DrafterState,
                seeds: jax.Array, seed_pos: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Draft `block_size` candidates after each seed, greedily.

        Args:
          embed, head: the target's token embedding and LM head `[V, D]` (tied with the drafter).
          seeds: int32 `[B]`, the last emitted token, not yet in the target cache; seed_pos: int32 `[B]`, its
            position (the committed length).
        Returns:
          (candidates int32 `[B, block_size]` (candidate i predicts position seed_pos + i + 1),
           confidences float32 `[B, block_size]` = sigmoid of the confidence head (ones if it has none)).
        """
        hidden = self.block_hidden(params, embed, state, seeds, seed_pos)
        greedy = lambda i, row: (jnp.argmax(row, axis=-1).astype(jnp.int32), row)  # noqa: E731
        candidates, confidences, _ = self._markov_chain(params, hidden, self.block_logits(params, hidden, head),
                                                        seeds, greedy)
        return candidates, confidences

    @routed
    def propose_sampled(self, params: DrafterParams, embed: jax.Array, head: jax.Array, state: DrafterState,
                        seeds: jax.Array, seed_pos: jax.Array, rows: RowSampling, purpose: int, with_logits: bool
                        ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        """Draft `block_size` candidates after each seed by sampling each row's warped logits (Markov bias
        included) with the keyed noise of `purpose` at its position (decoding/sampling.py).

        Returns (candidates int32 `[B, block_size]`, confidences float32 `[B, block_size]`, and with
        `with_logits` the warped logits float32 `[B, block_size, V]` each candidate was drawn from (softmax of
        them is the lossless rule's q), else None: exact mode never reads them, so its program neither stacks
        nor writes them out).
        """
        hidden = self.block_hidden(params, embed, state, seeds, seed_pos)

        def pick(i: int, row: jax.Array) -> tuple[jax.Array, jax.Array]:
            tokens, warped = sampling.draw(row[:, None], rows, seed_pos[:, None] + i + 1, purpose)
            return tokens[:, 0], warped[:, 0]

        candidates, confidences, drawn_from = self._markov_chain(
            params, hidden, self.block_logits(params, hidden, head), seeds, pick)
        return candidates, confidences, drawn_from if with_logits else None

    def block_logits(self, params: DrafterParams, hidden: jax.Array, head: jax.Array) -> jax.Array:
        """The base logits of the block rows before the Markov bias: the drafter's norm, then the target's
        LM head. hidden float32 `[..., D]` -> float32 `[..., V]`."""
        return linear(reduce.rms_norm(hidden, params.norm, self.cfg.rms_norm_eps), head)

    @staticmethod
    def markov_bias(params: DrafterParams, prev: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The Markov head for the previous tokens `prev` int32 `[...]`: (logit bias `W2·W1[prev]` float32
        `[..., V]`, the embedding `W1[prev]` float32 `[..., r]` that the confidence head also reads)."""
        prev_embed = params.markov_w1[prev].astype(jnp.float32)
        return linear(prev_embed, params.markov_w2), prev_embed

    @staticmethod
    def confidence_logit(params: DrafterParams, hidden: jax.Array, prev_embed: jax.Array) -> jax.Array | None:
        """The confidence head's raw logit float32 `[...]` from the pre-norm hidden `[..., D]` and `W1[prev]`
        `[..., r]` (only the hidden when the head is D wide); None for a drafter without the head."""
        if params.confidence_w is None:
            return None
        features = hidden
        if params.confidence_w.shape[0] != features.shape[-1]:
            features = jnp.concatenate([features, prev_embed], axis=-1)
        score = reduce.total(features * params.confidence_w.astype(jnp.float32), axis=-1)
        return score if params.confidence_b is None else score + params.confidence_b

    def block_hidden(self, params: DrafterParams, embed: jax.Array, state: DrafterState, seeds: jax.Array,
                     seed_pos: jax.Array) -> jax.Array:
        """The HC-head output of the block rows before the final norm, float32 `[B, block_size, D]`.

        This pre-norm hidden is what the confidence head reads (lucebox fix 27b93d1a; dspark.md §6 item 8).
        """
        cfg = self.cfg
        b, width = seeds.shape[0], cfg.block_size
        block = jnp.concatenate([seeds[:, None], jnp.full((b, width - 1), cfg.mask_token_id, jnp.int32)], 1)
        positions = seed_pos[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]
        ctx_pos = ring.slot_positions(state.last_position, state.context_kv[0].shape[1])[:, None, :]  # [B, 1, R]
        context_valid = jnp.broadcast_to(
            (ctx_pos >= 0) & (ctx_pos < seed_pos[:, None, None]) & (ctx_pos >= seed_pos[:, None, None] - cfg.sliding_window),
            (b, width, ctx_pos.shape[-1]))
        embedded = embed[block].astype(jnp.float32)
        streams = jnp.broadcast_to(embedded[:, :, None, :], (b, width, cfg.hc_mult, cfg.hidden_size))
        for stage, context in zip(params.stages, state.context_kv):
            streams = self._stage(stage, streams, positions, context, context_valid)
        return hc_head(streams, params.hc_head.fn, params.hc_head.base, params.hc_head.scale,
                       hc_eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps)

    def _markov_chain(self, params: DrafterParams, hidden: jax.Array, logits: jax.Array, seeds: jax.Array,
                      pick: Callable[[int, jax.Array], tuple[jax.Array, jax.Array]]
                      ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Left-to-right choice with the Markov bias: `pick(i, logits [B, V])` chooses row i's token and
        returns (tokens int32 `[B]`, the logits it chose from). Returns (candidates, confidences, the stacked
        chosen-from logits float32 `[B, block_size, V]`)."""
        prev, candidates, confidences, chosen_from = seeds, [], [], []
        for i in range(self.cfg.block_size):
            bias, prev_embed = self.markov_bias(params, prev)
            score = self.confidence_logit(params, hidden[:, i], prev_embed)
            confidences.append(jnp.ones(seeds.shape, jnp.float32) if score is None else jax.nn.sigmoid(score))
            prev, row = pick(i, logits[:, i] + bias)
            candidates.append(prev)
            chosen_from.append(row)
        return jnp.stack(candidates, axis=1), jnp.stack(confidences, axis=1), jnp.stack(chosen_from, axis=1)
