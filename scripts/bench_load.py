"""A user's first five minutes at full size: write the published 86.7 GB layout as a sparse all-zero file, load
it through the public API, and generate.

    python scripts/bench_load.py --json_out load.json                    # DS4, 43 layers, its drafter
    python scripts/bench_load.py --layers 30 --dir /big/disk --json_out load30.json
    python scripts/bench_load.py --gguf target.gguf --draft draft.gguf --json_out load_real.json
    python scripts/bench_load.py --config tiny --json_out tiny_load.json  # the CPU smoke test
    python scripts/bench_load.py --layers 32 --load_workers 1,4,1,4 --json_out F  # serial vs prefetching loads

Writes the target and drafter with `dsparkjax.tiny.write_sparse_pair` (seconds, no disk: all-zero data is
valid in every type), then times `load_target` and `load_drafter` (each streams its tensors from the file's
memory map to the device with a progress bar, after checking they fit), records the host's peak resident
memory (the loader keeps no host copy and gives each tensor's pages back, so it stays far below the file's
size) and the device memory in use, and runs `generate` on one prompt to its first token and on: the same
call, shapes and programs as scripts/bench.py's start-up measurement, so with that run's compilation cache
its programs load instead of compiling. docs/bench.md describes the JSON.
"""

from __future__ import annotations

import time

_T0 = time.time()

import os  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

from absl import app, flags, logging  # noqa: E402
from bench_results import (  # noqa: E402  (scripts/ is on sys.path)
    STARTUP_NEW_TOKENS, STARTUP_PROMPT_TOKENS, Part, count_files, errors, git_commit)

_CONFIG = flags.DEFINE_enum("config", "ds4", ["ds4", "tiny"], "The sparse files' model (ignored with --gguf).")
_LAYERS = flags.DEFINE_integer("layers", None, "Target layers, the first N (ds4: of 43, default 43; tiny: of 4).")
_DIR = flags.DEFINE_string("dir", None, "Where to write the sparse files (default: a temporary directory, deleted "
                           "after the run).")
_GGUF = flags.DEFINE_string("gguf", None, "Load this target GGUF instead of writing one.")
_DRAFT = flags.DEFINE_string("draft", None, "With --gguf: its drafter GGUF.")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["float32", "bfloat16"], "Compute dtype.")
_PROMPT_TOKENS = flags.DEFINE_integer("prompt_tokens", STARTUP_PROMPT_TOKENS, "Prompt length (random ids): by "
                                      "default bench.py's start-up call's, whose programs it then finds cached.")
_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", STARTUP_NEW_TOKENS, "Tokens to generate (default: as bench.py's "
                                   "start-up call).")
_LOAD_WORKERS = flags.DEFINE_list("load_workers", None, "Threads that check and copy tensors ahead of the loader "
                                   "(load_target's load_workers; 1: one tensor at a time; default the library's). "
                                   "A list loads the target once per entry, each load replacing the last (after the "
                                   "first, the file is in the page cache): e.g. 1,4,1,4 compares serial and "
                                   "prefetching loads in one run. The last is kept for the drafter and generate.")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Write the results here as JSON.")

SCHEMA = "dsparkjax.bench_load/1"
FIELDS = {
    "schema": f'"{SCHEMA}"',
    "fields": "this table: field -> meaning and unit",
    "meta.commit": "git commit of the checkout that ran ('+dirty' with uncommitted changes)",
    "meta.date_utc": "when the run started, ISO 8601 UTC",
    "meta.device": "the JAX device kind",
    "meta.jax": "jax version",
    "meta.config": "ds4, tiny or gguf",
    "meta.layers": "target layers",
    "meta.dtype": "compute dtype",
    "meta.mem_fraction": "XLA_PYTHON_CLIENT_MEM_FRACTION in effect (null: JAX's 0.75)",
    "meta.compilation_cache": "the persistent compilation cache's directory (null: off)",
    "files.target": "the target GGUF",
    "files.target_bytes": "its size, bytes",
    "files.target_disk_bytes": "its blocks on disk, bytes (a sparse file: a few KB)",
    "files.draft": "the drafter GGUF",
    "files.draft_bytes": "its size, bytes",
    "files.draft_disk_bytes": "its blocks on disk, bytes",
    "files.write_s": "seconds to write both sparse files (0 with --gguf)",
    "load.target_s": "seconds of load_target (contract checks, fit check, streaming every tensor to the device); "
                     "the first of load.workers",
    "load.workers": "load_workers of each target load, in order (--load_workers); the drafter's is the last",
    "load.target_runs_s": "seconds of each target load, in the order of load.workers",
    "load.target_runs_gb_s": "the file's tensor bytes over each load's seconds, GB/s (1e9 bytes)",
    "load.drafter_s": "seconds of load_drafter",
    "load.target_param_bytes": "bytes of the target's weights on the device",
    "load.drafter_param_bytes": "bytes of the drafter's weights on the device",
    "load.host_rss_before_bytes": "resident host memory before loading, bytes",
    "load.host_peak_rss_bytes": "peak resident host memory of the process up to the end of both loads, bytes",
    "load.device_in_use_bytes": "device bytes in use after both loads (null on CPU)",
    "load.device_limit_bytes": "bytes JAX may use on the device (null on CPU)",
    "generate.process_to_first_token_s": "seconds from the process's start to the first generated token",
    "generate.call_to_first_token_s": "seconds from calling generate to its first token (programs, prefill, step)",
    "generate.tok_s": "generate's own tok/s of the sequence (plain decoding, exact program)",
    "generate.token_ids": "the generated ids (all-zero weights: token 0 throughout)",
    "generate.cache_entries_written": "entries written to the compilation cache by generate (0: all loaded)",
    "generate.device_peak_bytes": "peak device bytes in use over the process (null on CPU)",
}


def _rss() -> int:
    """The process's resident memory now, bytes (VmRSS)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def main(argv: list[str]) -> None:
    del argv
    logging.set_verbosity(logging.WARNING)
    from dsparkjax import runtime

    configured = runtime.configure()
    import jax
    import numpy as np
    from bench_measure import configs

    from dsparkjax import footprint, generate, load_drafter, load_target
    from dsparkjax.ggufio import open_gguf
    from dsparkjax.model.sources import LOAD_WORKERS
    from dsparkjax.tiny import write_sparse_pair

    part = Part(_JSON_OUT.value, SCHEMA, FIELDS)
    folder = None if _GGUF.value else (_DIR.value or tempfile.mkdtemp(prefix="dsparkjax-sparse-"))
    state: dict = {}

    def files() -> dict:
        start = time.perf_counter()
        if _GGUF.value:
            target, draft = _GGUF.value, _DRAFT.value
        else:  # the layout of bench.py's random model (tiny's in float32)
            target, draft = write_sparse_pair(folder, *configs(_CONFIG.value, _LAYERS.value),
                                              recipe="published" if _CONFIG.value == "ds4" else "f32")
        state.update(target=target, draft=draft)
        out = dict(target=target, write_s=0.0 if _GGUF.value else time.perf_counter() - start)
        for key, path in (("target", target), ("draft", draft)):
            stat = os.stat(path) if path else None
            out.update({key: path, f"{key}_bytes": stat and stat.st_size,
                        f"{key}_disk_bytes": stat and stat.st_blocks * 512})
        return out

    def load() -> dict:
        rss_before = _rss()
        workers = [int(w) for w in _LOAD_WORKERS.value or [LOAD_WORKERS]]
        seconds = []
        target = None
        for count in workers:
            target = None  # the last load's weights are freed before the next
            start = time.perf_counter()
            target = load_target(state["target"], dtype=_DTYPE.value, progress=True, load_workers=count)
            jax.block_until_ready(target.params)
            seconds.append(time.perf_counter() - start)
        tensor_bytes = sum(info.nbytes for info in open_gguf(state["target"]).tensors.values())
        start = time.perf_counter()
        drafter = (load_drafter(state["draft"], target, progress=True, load_workers=workers[-1])
                   if state["draft"] else None)
        jax.block_until_ready(drafter.params if drafter else None)
        state.update(model=target)
        mem = footprint.device_memory()
        part.results["meta"] = dict(
            commit=git_commit(), date_utc=time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime(_T0)),
            device=jax.devices()[0].device_kind, jax=jax.__version__,
            config="gguf" if _GGUF.value else _CONFIG.value, layers=target.config.num_layers, dtype=_DTYPE.value,
            mem_fraction=configured.mem_fraction, compilation_cache=configured.cache_dir)
        return dict(target_s=seconds[0], workers=workers, target_runs_s=seconds,
                    target_runs_gb_s=[tensor_bytes / 1e9 / s for s in seconds],
                    drafter_s=time.perf_counter() - start,
                    target_param_bytes=footprint.tree_bytes(target.params),
                    drafter_param_bytes=footprint.tree_bytes(drafter.params) if drafter else 0,
                    host_rss_before_bytes=rss_before,
                    host_peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                    device_in_use_bytes=mem and mem.in_use, device_limit_bytes=mem and mem.limit)

    def run_generate() -> dict:
        target = state["model"]
        prompt = np.random.default_rng(0).integers(0, target.config.vocab_size, _PROMPT_TOKENS.value).tolist()
        first: list[float] = []
        before = count_files(configured.cache_dir)
        called = time.time()
        (result,) = generate(target, [prompt], max_new_tokens=_NEW_TOKENS.value, stop_tokens=(),
                             on_token=lambda i, t: first.append(time.time()) if not first else None)
        mem = footprint.device_memory()
        return dict(process_to_first_token_s=first[0] - _T0, call_to_first_token_s=first[0] - called,
                    tok_s=result.tok_per_s, token_ids=result.token_ids,
                    cache_entries_written=count_files(configured.cache_dir) - before,
                    device_peak_bytes=mem and mem.peak)

    try:
        for name, measure in (("files", files), ("load", load), ("generate", run_generate)):
            if "error" in part.record(name, measure):
                break
    finally:
        if folder and not _DIR.value:
            shutil.rmtree(folder, ignore_errors=True)
    for name, section in part.results.items():
        if name not in ("fields", "schema"):
            print(f"{name}: {section}")
    if errors(part.results):
        sys.exit(1)


if __name__ == "__main__":
    app.run(main)
