"""The fuzzer's worker process: load each GGUF path read from stdin and run a forward; answer one JSON line.

It runs under a memory limit (RLIMIT_AS, argv[1] GiB) in its own process, so that a mutation that makes the
loader hang, allocate without bound or crash the interpreter is seen by the test (`test_gguf_fuzz.py`) as a
timeout or a dead worker rather than taking the test run down. Answers:
  {"status": "ran", "finite": bool, "shape": [...]}       the file loaded and the forward ran
  {"status": "refused", "error": class, "message": str}   a dsparkjax error (DsparkError)
  {"status": "crashed", "error": class, "message": str}   any other exception, with its traceback
"""

from __future__ import annotations

import json
import resource
import sys
import traceback

import numpy as np

TOKENS = np.array([[1, 7, 42, 300, 5, 9, 11, 260, 3, 4]])  # ids below the fuzzed model's vocabulary


def run_one(path: str) -> dict:
    from dsparkjax.errors import DsparkError
    from dsparkjax.decoding.forward import forward
    from dsparkjax.target_api import load_target

    try:
        target = load_target(path)
        logits = forward(target, TOKENS, chunk=5)
        return {"status": "ran", "finite": bool(np.isfinite(logits).all()), "shape": list(logits.shape)}
    except DsparkError as err:
        return {"status": "refused", "error": type(err).__name__, "message": str(err)}
    except Exception as err:  # noqa: BLE001 - what the fuzzer is looking for
        return {"status": "crashed", "error": type(err).__name__,
                "message": "".join(traceback.format_exception(err))[-3000:]}


def main() -> None:
    limit = int(float(sys.argv[1]) * (1 << 30))
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    for line in sys.stdin:
        print(json.dumps(run_one(line.strip())), flush=True)


if __name__ == "__main__":
    main()
