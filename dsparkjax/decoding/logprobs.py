"""Log-probabilities of emitted tokens: the target's distribution before temperature and filters (as vLLM
reports by default), computed inside the programs that emit the tokens.

Exactness is the product: under the step's invariant policy (exact and lossless modes) the sum over the
vocabulary runs on `reduce.total` (the row-invariant custom call), and the max and exp are exact per element,
so a token's logprob has the same bits whatever the batch, the step width or the other rows hold: plain and
speculative decoding report identical logprobs, as they emit identical tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsparkjax.kernels import policy as kernel_policy
from dsparkjax.kernels.policy import KernelPolicy
from dsparkjax.model import reduce


def token_logprobs(logits: jax.Array, tokens: jax.Array, policy: KernelPolicy) -> jax.Array:
    """`log_softmax(logits)[token]`: logits float32 `[..., V]`, tokens int32 `[...]` -> float32 `[...]`, the
    vocabulary's sum in `policy`'s order."""
    with kernel_policy.use(policy):
        x = logits.astype(jnp.float32)
        top = jnp.max(x, axis=-1)
        log_total = jnp.log(reduce.total(jnp.exp(x - top[..., None]), axis=-1))
        picked = jnp.take_along_axis(x, tokens[..., None], axis=-1)[..., 0]
        return picked - top - log_total
