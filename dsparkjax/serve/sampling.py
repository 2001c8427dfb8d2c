"""The one adapter from a request's sampling fields to the engine's per-row admission options.

The engine samples engine-wide today (`Engine(temperature=...)`) and its speculative verification is greedy
only, so a server whose rows mix requests can serve greedy requests alone: a request with temperature > 0 gets
a 400 here rather than silently greedy output. Once the engine takes per-row sampling parameters and seeds in
`Engine.admit` (issue 43), `admission_options` is the one place that maps these fields onto them.
"""

from __future__ import annotations

from typing import Any

from dsparkjax.serve.protocol import RequestError, SamplingFields


def admission_options(fields: SamplingFields) -> dict[str, Any]:
    """Keyword arguments of `Engine.admit` for a request's sampling fields.

    Greedy requests (temperature 0) need none: top_p and seed do not change a greedy token. Raises a
    400 RequestError for temperature > 0, which the engine cannot yet sample per row.
    """
    if fields.temperature > 0:
        raise RequestError(
            f"temperature {fields.temperature} > 0 is not supported yet: this server's engine decodes greedily "
            "(per-request sampling needs issue 43); send temperature 0", param="temperature")
    return {}
