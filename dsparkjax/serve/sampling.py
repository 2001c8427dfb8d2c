"""The one adapter from a request's sampling fields to the engine's per-row admission options.

The engine samples per row (`Engine.admit(prompt, sampling=SamplingParams(...), seed=...)`, issue 43), so
requests that sample and requests that decode greedily share its rows and its compiled programs. A sampled
request's tokens depend on its prompt, its parameters and its seed only, never on the other requests or its
row, so a request with a seed gets the text `dsparkjax.generate(..., temperature, top_k, top_p, min_p, seed)`
gives on its prompt alone. A request without a seed gets a fresh random one, so two such requests sample
independently.
"""

from __future__ import annotations

import secrets
from typing import Any

from dsparkjax.decoding.sampling import MAX_SEED, SamplingParams
from dsparkjax.serve.protocol import SamplingFields


def admission_options(fields: SamplingFields) -> dict[str, Any]:
    """Keyword arguments of `Engine.admit` for a request's (validated) sampling fields.

    Greedy requests (temperature 0) need none: the filters and the seed do not change a greedy token. A sampled
    request gets its `sampling` parameters and its `seed` (a fresh one from `secrets` when it sent none).
    """
    if fields.temperature == 0:
        return {}
    seed = fields.seed if fields.seed is not None else secrets.randbelow(MAX_SEED + 1)
    params = SamplingParams(temperature=fields.temperature, top_k=fields.top_k, top_p=fields.top_p, min_p=fields.min_p)
    return {"sampling": params, "seed": seed}
