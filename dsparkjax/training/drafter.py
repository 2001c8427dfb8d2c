"""Training the DSpark drafter on a frozen target (DeepSpec's objective, `dspark.md` §1.1).

Data: prompts from the corpus continued greedily by the target (what speculative decoding will verify),
then one full forward of each sequence for its logits and captured features. Each training example is an
anchor position s of a sequence: the drafter absorbs the features of every position (it sees only those
before s, within its window), runs the block `[x_s, MASK×4]` at positions s..s+4 through
`DrafterModel.block_hidden`, and slot i is scored against the target's distribution at position s+i (the
prediction of token s+i+1), with the Markov head fed the target's greedy token before it (teacher forcing):

    loss = Σ_i w_i·(0.1·CE(argmax p_target) + 0.9·TV(p_draft, p_target) + 1.0·BCE(conf_i, 1 − TV)),
    w_i = exp(−i/γ) / Σ_j exp(−j/γ).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dsparkjax.config import DrafterConfig, TargetConfig
from dsparkjax.model.drafter import DrafterModel, init_drafter_state
from dsparkjax.model.params import DrafterParams, TargetParams, load_drafter_params
from dsparkjax.model.state import commit, init_state
from dsparkjax.model.target import StepOptions, TargetModel
from dsparkjax.training.params import Arrays, ArraySource
from dsparkjax.training.target import forward

CE_WEIGHT, TV_WEIGHT, CONFIDENCE_WEIGHT = 0.1, 0.9, 1.0  # DeepSpec paper §3.3


@dataclasses.dataclass(frozen=True)
class FeatureSet:
    """Sequences with the frozen target's outputs: tokens int32 `[N, T]`, greedy tokens int32 `[N, T]`
    (argmax of the target's logits at each position), target log-probabilities float32 `[N, T, V]` and
    captured features float32 `[N, T, n_capture, D]`."""

    tokens: np.ndarray
    greedy: np.ndarray
    log_probs: np.ndarray
    features: np.ndarray


def greedy_continuations(params: TargetParams, cfg: TargetConfig, options: StepOptions, prompts: np.ndarray,
                         new_tokens: int) -> np.ndarray:
    """Prompts int32 `[N, P]` followed by the target's greedy continuation: int32 `[N, P + new_tokens]`."""
    n, p = prompts.shape
    step = jax.jit(TargetModel(cfg, options).step)
    state = init_state(cfg, n, p + new_tokens, p, jnp.float32)
    logits, _, state = step(params, state, jnp.asarray(prompts))
    state = commit(state, jnp.full((n,), p, jnp.int32))
    out = [jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)]
    for _ in range(new_tokens - 1):
        logits, _, state = step(params, state, out[-1][:, None])
        state = commit(state, jnp.ones((n,), jnp.int32))
        out.append(jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32))
    return np.concatenate([prompts, np.asarray(jnp.stack(out, axis=1))], axis=1)


def capture(params: TargetParams, cfg: TargetConfig, options: StepOptions, sequences: np.ndarray,
            batch: int = 32) -> FeatureSet:
    """The target's greedy tokens, log-probabilities and captured features for every position."""
    run = jax.jit(lambda toks: forward(params, cfg, options, toks))
    greedy, log_probs, features = [], [], []
    for start in range(0, len(sequences), batch):
        logits, feats = run(jnp.asarray(sequences[start : start + batch]))
        greedy.append(np.asarray(jnp.argmax(logits, axis=-1), np.int32))
        log_probs.append(np.asarray(jax.nn.log_softmax(logits, axis=-1)))
        features.append(np.asarray(feats))
    return FeatureSet(sequences, *(np.concatenate(x) for x in (greedy, log_probs, features)))


def sample_batch(data: FeatureSet, rng: np.random.Generator, sequences: int, anchors: int, block: int,
                 first_anchor: int) -> dict[str, np.ndarray]:
    """`sequences` random sequences with `anchors` random anchor positions each in [first_anchor, T − block)."""
    rows = rng.choice(len(data.tokens), size=sequences, replace=False)
    t = data.tokens.shape[1]
    starts = rng.integers(first_anchor, t - block, size=(sequences, anchors)).astype(np.int32)
    return dict(tokens=data.tokens[rows], greedy=data.greedy[rows], log_probs=data.log_probs[rows],
                features=data.features[rows], anchors=starts)


def position_weights(block: int, gamma: float) -> jax.Array:
    """Exponential decay over block slots, normalised to sum 1: float32 `[block]`."""
    w = jnp.exp(-jnp.arange(block, dtype=jnp.float32) / gamma)
    return w / jnp.sum(w)


def drafter_params(trainable: Arrays, cfg: DrafterConfig) -> DrafterParams:
    return load_drafter_params(ArraySource(trainable), cfg, jnp.float32)


def block_outputs(params: DrafterParams, model: DrafterModel, embed: jax.Array, head: jax.Array,
                  batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array | None, jax.Array, jax.Array]:
    """The drafter on every anchor of a batch, teacher-forced.

    Returns (logits with the Markov bias float32 `[B·A, W, V]`, confidence logits `[B·A, W]` or None,
    target log-probabilities `[B·A, W, V]`, target greedy tokens int32 `[B·A, W]`), slot i of anchor s being
    the prediction of token s+i+1.
    """
    cfg = model.cfg
    tokens, anchors = batch["tokens"], batch["anchors"]
    (b, t), a, w = tokens.shape, anchors.shape[1], cfg.block_size
    state = init_drafter_state(cfg, b, t, jnp.float32)
    state = model.absorb(params, state, batch["features"], jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)))
    state = jax.tree.map(lambda x: jnp.repeat(x, a, axis=0), state)
    seeds = jnp.take_along_axis(tokens, anchors, axis=1).reshape(-1)
    hidden = model.block_hidden(params, embed, state, seeds, anchors.reshape(-1))  # [B·A, W, D]
    slots = (anchors[..., None] + jnp.arange(w)).reshape(b, a * w)  # positions s+i
    greedy = jnp.take_along_axis(batch["greedy"], slots, axis=1).reshape(b * a, w)
    log_p = jnp.take_along_axis(batch["log_probs"], slots[..., None], axis=1).reshape(b * a, w, -1)
    prev = jnp.concatenate([seeds[:, None], greedy[:, :-1]], axis=1)
    bias, prev_embed = model.markov_bias(params, prev)
    logits = model.block_logits(params, hidden, head) + bias
    return logits, model.confidence_logit(params, hidden, prev_embed), log_p, greedy


def dspark_loss(trainable: Arrays, batch: dict[str, jax.Array], *, model: DrafterModel, embed: jax.Array,
                head: jax.Array, gamma: float) -> tuple[jax.Array, dict]:
    """DeepSpec's drafter objective (module docstring); terms reported per slot-weighted mean."""
    logits, conf, log_p, greedy = block_outputs(drafter_params(trainable, model.cfg), model, embed, head, batch)
    weights = position_weights(model.cfg.block_size, gamma)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, greedy)  # [N, W]
    tv = 0.5 * jnp.sum(jnp.abs(jax.nn.softmax(logits, axis=-1) - jnp.exp(log_p)), axis=-1)
    terms = {"ce": ce, "tv": tv}
    total = CE_WEIGHT * ce + TV_WEIGHT * tv
    if conf is not None:
        bce = optax.sigmoid_binary_cross_entropy(conf, jax.lax.stop_gradient(1.0 - tv))
        terms["bce"] = bce
        total = total + CONFIDENCE_WEIGHT * bce
    terms["match"] = (jnp.argmax(logits, axis=-1) == greedy).astype(jnp.float32)
    reduce = lambda x: jnp.sum(jnp.mean(x, axis=0) * weights)
    return reduce(total), {k: reduce(v) for k, v in terms.items()}
