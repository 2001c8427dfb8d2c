"""An OpenAI-compatible HTTP server with continuous batching: `python -m dsparkjax.serve`.

Modules, in the order a request meets them:
- `protocol`: request bodies parsed and validated into a `GenerationRequest`; OpenAI response and chunk bodies.
- `sampling`: the one adapter from a request's sampling fields to the engine's admission options.
- `text`: token ids to text deltas, cut before the first stop string.
- `scheduler`: the thread that owns the `Engine` (the only one that touches it) and feeds each request's
  asyncio queue.
- `metrics`: the Prometheus metrics of `/metrics`.
- `app`: the starlette application (routes, server-sent events, disconnects, errors).
- `__main__`: the command line (absl flags, uvicorn).

Design and measured numbers: docs/serving.md.
"""

EMBEDDED_MODEL = "dsparkjax-tiny"  # the model id the embedded pair is served as
