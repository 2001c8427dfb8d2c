"""The target's next-token loss, through the decode step itself on a fresh state (prefill of the window)."""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dsparkjax.config import TargetConfig
from dsparkjax.model.params import TargetParams, load_target_params
from dsparkjax.model.state import init_state
from dsparkjax.model.target import StepOptions, TargetModel
from dsparkjax.training.params import Arrays, ArraySource


def target_params(trainable: Arrays, frozen: Mapping[str, np.ndarray], cfg: TargetConfig) -> TargetParams:
    """The inference pytree (float32, dense) of trainable arrays plus the frozen hash tables."""
    tables = {k: jax.lax.stop_gradient(jnp.asarray(v)) for k, v in frozen.items()}  # traced under jit: no host check
    return load_target_params(ArraySource({**trainable, **tables}), cfg, jnp.float32)


def forward(params: TargetParams, cfg: TargetConfig, options: StepOptions, tokens: jax.Array
            ) -> tuple[jax.Array, jax.Array]:
    """Logits float32 `[B, T, V]` and captured features `[B, T, n_capture, D]` of `tokens` int32 `[B, T]`
    from position 0: one step of width T on an empty state (the step is chunk-invariant, so this is the
    prefill decoding runs)."""
    b, t = tokens.shape
    state = init_state(cfg, b, t, t, jnp.float32)
    logits, features, _ = TargetModel(cfg, options).step(params, state, tokens)
    return logits, features


def next_token_loss(trainable: Arrays, tokens: jax.Array, *, frozen: Mapping[str, np.ndarray], cfg: TargetConfig,
                    options: StepOptions) -> tuple[jax.Array, dict]:
    """Mean cross-entropy (nats/token) of predicting tokens[:, 1:] from tokens[:, :-1]."""
    logits, _ = forward(target_params(trainable, frozen, cfg), cfg, options, tokens[:, :-1])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    return ce, {"ce": ce}
