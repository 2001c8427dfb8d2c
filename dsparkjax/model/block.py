"""The pieces of a DS4 block shared by the target layers and the DSpark drafter stages.

A block is HC-pre → attention → HC-post → HC-pre → MoE → HC-post on the n HC streams (`ds4_arch.md` §3.1);
the attention differs between the target (window ring + compressed entries) and the drafter (context rows +
the bidirectional block), so `block_forward` takes it as a function. Configs are duck-typed: both
TargetConfig and DrafterConfig have the fields used here.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import jax
import jax.numpy as jnp

from dsparkjax.model import reduce
from dsparkjax.model.hc import hc_post, hc_pre
from dsparkjax.model.layers import apply_rope, fp8_kv_sim, grouped_output, sink_attention, swiglu
from dsparkjax.model.params import Attention, Block, HyperConnection, MoE
from dsparkjax.model.weights import expert_linear, expert_linear_rows, linear, linear_rows

Aux = TypeVar("Aux")


def query_heads(at: Attention, x: jax.Array, positions: jax.Array, freqs: Any, cfg: Any, simulate_qat: bool
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Low-rank queries: `qr = RMSNorm(x·wq_aᵀ)`, heads = per-head unweighted RMSNorm of `qr·wq_bᵀ`, roped;
    and the kv rows of the same input (`kv_rows`), whose projection shares the call with `wq_a`.

    Args:
      x: `[B, Q, D]` normalised input; positions: int32 `[B, Q]`.
    Returns:
      (qr float32 `[B, Q, r_q]` (the indexer reads it too), heads float32 `[B, Q, H, d]`, kv float32
      `[B, Q, d]`).
    """
    b, q = positions.shape
    q_low, kv = linear_rows(x, at.wq_a_kv)
    qr = reduce.rms_norm(q_low, at.q_norm, cfg.rms_norm_eps)
    heads = linear(qr, at.wq_b).reshape(b, q, cfg.num_heads, cfg.head_dim)
    heads = apply_rope(reduce.rms_norm(heads, None, cfg.rms_norm_eps), positions[..., None], freqs)
    return qr, heads, _kv_finish(at, kv, positions, freqs, cfg, simulate_qat)


def kv_sim(kv: jax.Array, nope_dim: int, simulate_qat: bool) -> jax.Array:
    """The official model's FP8 rounding of the non-RoPE dims of stored kv rows (`ds4_arch.md` §6.2)."""
    if not simulate_qat:
        return kv
    return jnp.concatenate([fp8_kv_sim(kv[..., :nope_dim]), kv[..., nope_dim:]], axis=-1)


def kv_rows(at: Attention, x: jax.Array, positions: jax.Array, freqs: Any, cfg: Any, simulate_qat: bool
            ) -> jax.Array:
    """The single shared K=V head alone: `RMSNorm(x·wkvᵀ)`, roped at `positions`, FP8-simulated. `[..., d]`
    float32. (Where wkv shares a weight with wq_a this multiplies both: `query_heads` is the call then.)"""
    (kv,) = linear_rows(x, at.wq_a_kv, only=(1,))
    return _kv_finish(at, kv, positions, freqs, cfg, simulate_qat)


def _kv_finish(at: Attention, kv: jax.Array, positions: jax.Array, freqs: Any, cfg: Any, simulate_qat: bool
               ) -> jax.Array:
    kv = apply_rope(reduce.rms_norm(kv, at.kv_norm, cfg.rms_norm_eps), positions, freqs)
    return kv_sim(kv, cfg.nope_dim, simulate_qat)


def attention_output(at: Attention, out: jax.Array, positions: jax.Array, freqs: Any, cfg: Any) -> jax.Array:
    """Inverse RoPE at the query positions (K = V carried RoPE into the values), then the grouped projection.

    Args:
      out: float32 `[B, Q, H, d]` attention output. Returns float32 `[B, Q, D]`.
    """
    out = apply_rope(out, positions[..., None], freqs, inverse=True)
    return grouped_output(out, at.wo_a, at.wo_b, cfg.o_groups)


def block_forward(blk: Block, streams: jax.Array, cfg: Any,
                  attention: Callable[[jax.Array], tuple[jax.Array, Aux]],
                  ffn: Callable[[jax.Array], jax.Array], hc_kernel: str | None = None) -> tuple[jax.Array, Aux]:
    """One block on the HC streams `[B, Q, n, D]`; `attention(x)` returns (output, aux), `ffn(x)` the output.

    `hc_kernel` None computes the HC mixes with the jnp reference (`model/hc.py`), "ffi" with the custom call.

    Returns (new streams float32 `[B, Q, n, D]`, the attention's aux value, e.g. its updated cache).
    """
    pre, post_fn = _hc_ops(hc_kernel, cfg)
    u, post, comb = pre(streams, blk.hc_attn)
    attn_out, aux = attention(reduce.rms_norm(u, blk.attn.norm, cfg.rms_norm_eps))
    streams = post_fn(attn_out, streams, post, comb)
    u, post, comb = pre(streams, blk.hc_ffn)
    ffn_out = ffn(reduce.rms_norm(u, blk.moe.norm, cfg.rms_norm_eps))
    return post_fn(ffn_out, streams, post, comb), aux


def _hc_ops(hc_kernel: str | None, cfg: Any) -> tuple[Callable, Callable]:
    """HC-pre/HC-post on `[B, Q, n, D]` streams: the jnp reference (`hc_kernel` None) or a kernel backend."""
    hp = dict(iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps)
    if hc_kernel is None:
        return (lambda x, h: hc_pre(x, h.fn, h.base, h.scale, **hp)), hc_post
    from dsparkjax import kernels

    def pre(x: jax.Array, h: HyperConnection) -> tuple[jax.Array, jax.Array, jax.Array]:
        lead = x.shape[:-2]
        # a scanned body's fn (reduce.StackedDense): the kernel reads its layer of the stack in place
        fn, layer = (h.fn.stack, h.fn.layer) if isinstance(h.fn, reduce.StackedDense) else (h.fn, None)
        u, post, comb = kernels.hc_pre(x.reshape(-1, *x.shape[-2:]), fn, h.base, h.scale, backend=hc_kernel,
                                       layer=layer, **hp)
        return u.reshape(*lead, -1), post.reshape(*lead, -1), comb.reshape(*lead, *comb.shape[-2:])

    def post_fn(f: jax.Array, x: jax.Array, post: jax.Array, comb: jax.Array) -> jax.Array:
        n, d = x.shape[-2:]
        out = kernels.hc_post(f.reshape(-1, d), x.reshape(-1, n, d), post.reshape(-1, n), comb.reshape(-1, n, n),
                              backend=hc_kernel)
        return out.reshape(x.shape)

    return pre, post_fn


def attend(heads: jax.Array, key_sets: list[tuple[reduce.Dense, jax.Array]], sinks: jax.Array | None, scale: float
           ) -> jax.Array:
    """One sink softmax over several key sets (K = V), e.g. window rows + compressed entries.

    Args:
      heads: float32 `[B, Q, H, d]` queries; key_sets: (keys `[B, K, d]` shared by every row (float, or a
        StackedDense layer of a scanned body's cache) or `[B, Q, K, d]` per row, valid bool `[B, Q, K]`); sinks:
        `[H]` or None.
    Returns:
      float32 `[B, Q, H, d]`.
    """
    b, q, h, d = heads.shape

    def per_group(x: jax.Array, keys: reduce.Dense, values: bool) -> jax.Array:
        """x `[B, Q, H, ·]` against keys shared by a sequence's rows `[B, N, d]` (or a stacked cache's layer of
        them) or per row `[B, Q, N, d]`: scores x·keysᵀ, or with `values` the weighted sum x·keys (K = V)."""
        if len(keys.shape) == 3:
            return reduce.grouped_contract(x.reshape(b, q * h, -1), keys, values).reshape(b, q, h, -1)
        return reduce.grouped_contract(x.reshape(b * q, h, -1), keys.reshape(b * q, *keys.shape[2:]), values
                                       ).reshape(b, q, h, -1)

    scores = [per_group(heads, keys, values=False) * scale for keys, _ in key_sets]
    valid = jnp.concatenate([v[:, :, None, :] for _, v in key_sets], axis=-1)
    probs = sink_attention(jnp.concatenate(scores, axis=-1), sinks, valid)
    out, start = None, 0
    for keys, _ in key_sets:
        width = keys.shape[-2]
        part = per_group(probs[..., start : start + width], keys, values=True)
        out, start = part if out is None else out + part, start + width
    return out


def moe_output(mo: MoE, x: jax.Array, ids: jax.Array, weights: jax.Array, limit: float, shared_limit: float
               ) -> jax.Array:
    """Weighted sum of the selected experts' clamped SwiGLU outputs plus the shared expert.

    Args:
      x: `[..., D]`; ids: int32 `[..., k]`; weights: float32 `[..., k]`.
    Returns:
      float32 `[..., D]`.
    """
    hidden = swiglu(*expert_linear_rows(x, mo.gate_up, ids), limit)
    routed = reduce.total(weights[..., :, None] * expert_linear(hidden, mo.down, ids), axis=-2)
    shared_hidden = swiglu(*linear_rows(x, mo.shared_gate_up), shared_limit)
    return routed + linear(shared_hidden, mo.shared_down)
