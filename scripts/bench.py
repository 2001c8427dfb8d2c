"""The headline benchmark: DeepSeek-V4-Flash at full size on one GPU, every number of issue 38 in one run.

    python scripts/bench.py --json_out docs/bench/ds4_full_h200.json      # 43 layers, random weights made on the GPU
    python scripts/bench.py --layers 32 --json_out ds4_32.json            # a slice (fits an 80 GB H100)
    python scripts/bench.py --gguf target.gguf --draft draft.gguf --json_out real.json
    python scripts/bench.py --config tiny --layers 2 --json_out tiny.json # the CPU smoke test

By default the target is DeepSeek-V4-Flash with the published recipe (`config.deepseek_v4_flash`,
`writer.RECIPES`) and the full-size DSpark drafter (`config.dspark_flash`), their weights random valid packed
blocks generated on the device (`tiny.DeviceRandomSource`: no file, no host copy). It measures, each a
median over `--reps` timed runs after a warm-up, in one process: the weights' build (or load) time and bytes,
the first-token latency of a second process's warm start (compiled programs from the persistent cache; and
of this run's cold start with --cold_start), every program's compile time, plain decoding's tok/s at several
contexts, the decode step at widths 1-6, the drafter's proposal, exact speculative decoding at controlled
acceptance, batched decoding's aggregate tok/s, the copy bandwidth, the weight bytes a token reads and the
roofline fraction, and device and host memory. It prints one table and writes the JSON documented in
docs/bench.md (and in the JSON itself, under "fields"). A measurement that fails records its error and the run
goes on.

Process layout: this process runs two children, `--role measure` (everything above but the warm start) and
then `--role startup` (a fresh process: weights, then `generate` to its first token), and merges their
JSON; a child writes its part after every measurement, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import time

_T0 = time.time()  # the process's start, before JAX is imported: what first-token latencies count from

import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from typing import Any  # noqa: E402

from absl import app, flags, logging  # noqa: E402
from bench_results import (  # noqa: E402  (scripts/ is on sys.path)
    MEASUREMENTS, STARTUP_NEW_TOKENS, Part, Settings, errors, table)

_CONFIG = flags.DEFINE_enum("config", "ds4", ["ds4", "tiny"], "ds4: DeepSeek-V4-Flash and its DSpark drafter with "
                            "the published recipe; tiny: the CPU test model (float32 tensors). Ignored with --gguf.")
_LAYERS = flags.DEFINE_integer("layers", None, "Target layers, the first N (ds4: of 43, default 43; tiny: of 4).")
_GGUF = flags.DEFINE_string("gguf", None, "Run this target GGUF instead of random weights.")
_DRAFT = flags.DEFINE_string("draft", None, "With --gguf: its DSpark drafter GGUF (without one, the drafter's "
                             "proposal is not measured).")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["float32", "bfloat16"], "Compute dtype.")
_KERNELS = flags.DEFINE_enum("kernels", "auto", ["auto", "dequantize", "ffi", "reference"],
                             "How matrices run (load_target's `kernels`).")
_CONTEXTS = flags.DEFINE_list("contexts", None, "Positions of the plain-decode steps, in tokens (default ds4: "
                              "1024,8192,65536; tiny: 128,256,512).")
_CAPACITY = flags.DEFINE_integer("capacity", None, "Tokens the batch-1 state holds (default: the largest "
                                 "context + 1024), shared by the plain-decode, width and speculative measurements.")
_WIDTHS = flags.DEFINE_list("widths", ["1", "2", "3", "4", "5", "6"], "Step widths q to time (1 = plain decoding).")
_ACCEPTANCE = flags.DEFINE_list("acceptance", ["0.6", "0.8", "0.9"], "Per-candidate acceptance rates of the "
                                "oracle proposer for exact speculative decoding.")
_BATCHES = flags.DEFINE_list("batches", None, "Batch sizes for aggregate tok/s (default ds4: 8,32; tiny: 2,4).")
_REPS = flags.DEFINE_integer("reps", None, "Timed runs per measurement, after one warm-up (default ds4: 5, tiny: 2).")
_STEPS = flags.DEFINE_integer("steps", None, "Decode steps per timed run (default ds4: 32, tiny: 4).")
_SPEC_TOKENS = flags.DEFINE_integer("spec_tokens", None, "Tokens per speculative run (default ds4: 64, tiny: 12).")
_COPY_MIB = flags.DEFINE_integer("copy_mib", None, "MiB per buffer of the copy-bandwidth probe (16 buffers in all; "
                                 "default ds4: 256, tiny: 16).")
_STARTUP_TOKENS = flags.DEFINE_integer("startup_tokens", STARTUP_NEW_TOKENS, "New tokens of the start-up "
                                       "`generate` call.")
_COLD_START = flags.DEFINE_bool("cold_start", False, "Also time the measure process's own start to its first token, "
                                "compiling generate's programs alone before the others (a minute or two at full "
                                "size); without it they compile with the others, for the warm start.")
_COMPILE_THREADS = flags.DEFINE_integer("compile_threads", 6, "Programs compiled at once (after the width-1 "
                                        "program, compiled alone for its own compile time).")
_WARM_START = flags.DEFINE_bool("warm_start", True, "Also time a second process's start to its first token.")
_MEASURE = flags.DEFINE_list("measure", ["all"], "Measurements to run (all, or some of: "
                             "startup, copy_bandwidth, plain_decode, steps, drafter, speculative, batched).")
_SCAN_LAYERS = flags.DEFINE_bool("scan_layers", False, "Layers of one structure share one scanned body "
                                  "(load_target's scan_layers): compiles in a fraction of the time.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the random weights, prompts and oracle.")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Write the results here as JSON.")
_ROLE = flags.DEFINE_enum("role", "run", ["run", "measure", "startup"], "Internal: which part this process runs.")
_PART_OUT = flags.DEFINE_string("part_out", None, "Internal: where a child process writes its part.")

def settings() -> Settings:
    tiny = _CONFIG.value == "tiny" and _GGUF.value is None
    contexts = tuple(int(c) for c in (_CONTEXTS.value or (["128", "256", "512"] if tiny else
                                                          ["1024", "8192", "65536"])))
    measure = frozenset(MEASUREMENTS if "all" in _MEASURE.value else _MEASURE.value)
    unknown = measure - set(MEASUREMENTS)
    if unknown:
        raise app.UsageError(f"--measure: unknown {sorted(unknown)}; choose from {', '.join(MEASUREMENTS)}")
    return Settings(
        config="gguf" if _GGUF.value else _CONFIG.value, layers=_LAYERS.value, gguf=_GGUF.value, draft=_DRAFT.value,
        dtype=_DTYPE.value, kernels=_KERNELS.value, seed=_SEED.value, compile_threads=_COMPILE_THREADS.value,
        startup_tokens=_STARTUP_TOKENS.value, cold_start=_COLD_START.value, contexts=contexts,
        capacity=_CAPACITY.value or max(contexts) + 1024, widths=tuple(int(w) for w in _WIDTHS.value),
        acceptance=tuple(float(p) for p in _ACCEPTANCE.value),
        batches=tuple(int(b) for b in (_BATCHES.value or (["2", "4"] if tiny else ["8", "32"]))),
        copy_mib=_COPY_MIB.value or (16 if tiny else 256), reps=_REPS.value or (2 if tiny else 5),
        steps=_STEPS.value or (4 if tiny else 32), spec_tokens=_SPEC_TOKENS.value or (12 if tiny else 64),
        measure=measure, scan_layers=_SCAN_LAYERS.value)


# ---------------------------------------------------------------------------------------------------------
# The parent: run the two children, merge, print.


def _child(role: str, part: str) -> dict[str, Any]:
    """Run this script again as `role`, its output passed through; returns the part it wrote (or {})."""
    argv = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], f"--role={role}", f"--part_out={part}"]
    proc = subprocess.run(argv, check=False)
    result: dict[str, Any] = {}
    if os.path.exists(part):
        with open(part) as f:
            result = json.load(f)
    if proc.returncode != 0:
        result.setdefault("errors", {})[role] = f"the {role} process exited with status {proc.returncode}"
    return result


def run_parent() -> None:
    with tempfile.TemporaryDirectory(prefix="dsparkjax-bench-") as tmp:
        results = _child("measure", os.path.join(tmp, "measure.json"))
        if _WARM_START.value and "startup" in settings().measure:
            warm = _child("startup", os.path.join(tmp, "startup.json"))
            startup = results.setdefault("startup", {})
            if "error" not in startup:
                startup["warm"] = warm.get("startup", {}).get("warm", {"error": "the startup process wrote nothing"})
            results.setdefault("errors", {}).update(warm.get("errors", {}))
    if not results.get("errors"):
        results.pop("errors", None)
    print(table(results))
    if _JSON_OUT.value:
        os.makedirs(os.path.dirname(os.path.abspath(_JSON_OUT.value)), exist_ok=True)
        with open(_JSON_OUT.value, "w") as f:
            json.dump(results, f, indent=1)
        print(f"wrote {_JSON_OUT.value}")
    if errors(results):
        sys.exit(1)


def main(argv: list[str]) -> None:
    del argv
    logging.set_verbosity(logging.WARNING)
    if _ROLE.value == "run":
        run_parent()
        return
    from dsparkjax import runtime

    configured = runtime.configure()  # before JAX touches the device
    import bench_measure  # JAX and the model: only in the children

    bench_measure.run(_ROLE.value, settings(), configured, Part(_PART_OUT.value), _T0)


if __name__ == "__main__":
    app.run(main)
