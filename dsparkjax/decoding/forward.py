"""`forward`: logits of whole sequences from position 0, through the same prefill as `generate`."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from dsparkjax import validation
from dsparkjax.decoding.decoder import Decoder
from dsparkjax.errors import ArgumentError
from dsparkjax.target_api import Target


def forward(target: Target, token_ids: Any, *, chunk: int = 16) -> np.ndarray:
    """Full-sequence forward from position 0.

    Args:
      token_ids: int `[B, T]`, 1 <= T <= the target's context length.
      chunk: tokens per step (the prefill program decoding uses).
    Returns:
      float32 numpy `[B, T, V]` logits.
    """
    validation.target(target)
    tokens = validation.token_ids(token_ids, "token_ids", 2)
    chunk = validation.positive_int(chunk, "chunk")
    target.check_tokens(tokens)
    batch, length = tokens.shape
    if batch < 1:
        raise ArgumentError(f"token_ids: no sequences (shape {tokens.shape}); forward runs one or more")
    if not 1 <= length <= target.config.context_length:
        raise ArgumentError(f"token_ids: {length} positions; forward runs 1 to the context length "
                            f"{target.config.context_length} of {target.path}")
    chunk = min(chunk, length)
    decoder = Decoder(target, None, batch=batch, max_len=-(-length // chunk) * chunk, max_step=chunk,
                      prefill_chunk=chunk)
    logits = []
    decoder.prefill(decoder.init(), dict(enumerate(tokens)), on_logits=lambda out, valid: logits.append(out))
    return np.asarray(jnp.concatenate(logits, axis=1))[:, :length]
