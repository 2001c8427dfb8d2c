"""Load a running `python -m dsparkjax.serve` with concurrent streaming clients; print tok/s and TTFT.

    python -m dsparkjax.serve --port 8000 &
    python scripts/bench_serve.py --url http://127.0.0.1:8000/v1 --clients 32 --max_tokens 64

The clients are the server load test's mix (dsparkjax/testing/serve_load.py): chat and text completions of the
embedded pair's Python prompts, max_tokens spread up to --max_tokens, every --leave_every-th leaving after its
first text. Prints one JSON object: clients, completion tokens of the finished streams, wall time, aggregate
tok/s, TTFT p50/p99 (ms). Needs the test extra (openai).
"""

from __future__ import annotations

import json

from absl import app, flags, logging

from dsparkjax.testing.serve_load import mixed_clients, run_load

_URL = flags.DEFINE_string("url", "http://127.0.0.1:8000/v1", "The server's OpenAI base URL.")
_MODEL = flags.DEFINE_string("model", "dsparkjax-tiny", "The served model id (GET /v1/models).")
_CLIENTS = flags.DEFINE_integer("clients", 32, "Concurrent streaming clients.", lower_bound=1)
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 64, "The longest client's max_tokens.", lower_bound=8)
_LEAVE = flags.DEFINE_integer("leave_every", 4, "Every n-th client leaves after its first text (0: none).",
                              lower_bound=0)


def main(argv: list[str]) -> None:
    del argv
    logging.set_verbosity(logging.WARNING)  # keep the client's per-request INFO lines off the output
    report = run_load(_URL.value, _MODEL.value, mixed_clients(_CLIENTS.value, _MAX_TOKENS.value, _LEAVE.value))
    print(json.dumps({k: round(v, 2) for k, v in report.summary().items()}))


if __name__ == "__main__":
    app.run(main)
