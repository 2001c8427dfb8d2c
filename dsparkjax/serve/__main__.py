"""Serve a target (and drafter) over OpenAI's HTTP API with continuous batching.

    python -m dsparkjax.serve                                   # the embedded pair on 127.0.0.1:8000
    python -m dsparkjax.serve --target T.gguf --draft D.gguf --port 8080 --max_batch 16 --max_context 8192

Needs the `serve` extra (starlette, uvicorn, prometheus_client). Without `--draft` a given target decodes
plainly; the embedded pair is used when no `--target` is given.
"""

from __future__ import annotations

import os
import sys

from absl import flags, logging

from dsparkjax import runtime
from dsparkjax.cli_inputs import run_main
from dsparkjax.pair import load_pair
from dsparkjax.errors import DsparkError
from dsparkjax.serve import EMBEDDED_MODEL
from dsparkjax.serve.protocol import MAX_BODY_BYTES

_TARGET = flags.DEFINE_string("target", None, "Target GGUF (default: the embedded tiny target).")
_DRAFT = flags.DEFINE_string("draft", None, "DSpark drafter GGUF (default with the embedded target: its drafter).")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Address to listen on.")
_PORT = flags.DEFINE_integer("port", 8000, "Port to listen on.", lower_bound=0, upper_bound=65535)
_MAX_BATCH = flags.DEFINE_integer("max_batch", 16, "Engine rows: requests decoded together.", lower_bound=1)
_MAX_CONTEXT = flags.DEFINE_integer("max_context", None, "Positions per row: prompt plus generated tokens "
                                    "(default: the model's context length, at most 4096).", lower_bound=64)
_MAX_QUEUE = flags.DEFINE_integer("max_queue", 64, "Requests that may wait for a row; more get 429.", lower_bound=0)
_MAX_BODY_BYTES = flags.DEFINE_integer("max_body_bytes", MAX_BODY_BYTES, "The largest request body accepted; a "
                                      "larger Content-Length gets 413 before the body is read.", lower_bound=1)
_PREFILL_CHUNK = flags.DEFINE_integer("prefill_chunk", 16, "Prompt tokens per prefill step.", lower_bound=1)
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Compute dtype.")
_MODEL_NAME = flags.DEFINE_string("served_model_name", None, "The model id clients send (default: the target "
                                  f"file's name without .gguf, {EMBEDDED_MODEL!r} for the embedded pair).")


def main(argv: list[str]) -> None:
    del argv
    try:  # the serve extra, imported here so that --help works without it
        import uvicorn

        from dsparkjax.serve.app import build_app
    except ImportError as e:
        raise DsparkError(f"the server needs the serve extra ({e.name} is missing): pip install 'dsparkjax[serve]'"
                          ) from None
    from dsparkjax.serve.metrics import Metrics
    from dsparkjax.serve.scheduler import Scheduler, serving_engine

    logging.set_verbosity(logging.WARNING)
    runtime.configure()  # before JAX starts: device memory for a full-size model, the compilation cache
    target, drafter, target_path, _ = load_pair(_TARGET.value, _DRAFT.value, progress=True, dtype=_DTYPE.value)
    if target.tokenizer is None:
        raise DsparkError(f"{target_path}: the server needs the tokenizer in the target GGUF, and it has none")
    default_name = EMBEDDED_MODEL if _TARGET.value is None else os.path.basename(target_path).removesuffix(".gguf")
    name = _MODEL_NAME.value or default_name
    context = _MAX_CONTEXT.value or min(target.config.context_length, 4096)
    print(f"compiling the engine: {_MAX_BATCH.value} rows of {context} positions, "
          f"{'speculative' if drafter else 'plain'} exact decoding", file=sys.stderr)
    engine = serving_engine(target, drafter, max_batch=_MAX_BATCH.value, max_context=context,
                            prefill_chunk=_PREFILL_CHUNK.value)
    scheduler = Scheduler(engine, Metrics(), max_queue=_MAX_QUEUE.value)
    api = build_app(scheduler, target.tokenizer, name, frozenset({target.config.eos_token_id}),
                    max_body_bytes=_MAX_BODY_BYTES.value)
    print(f"serving {name!r} on http://{_HOST.value}:{_PORT.value}/v1", file=sys.stderr)
    uvicorn.run(api, host=_HOST.value, port=_PORT.value, log_level="warning")


if __name__ == "__main__":
    run_main(main)
