"""What scripts/bench.py reports: the settings of a run, the JSON's fields (each documented, with its unit), the
file a child process writes its part to as it goes, and the table printed at the end. No JAX here: the
parent process imports this without starting a backend.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import time
import traceback
from typing import Any, Callable

SCHEMA = "dsparkjax.bench/1"
STARTUP_PROMPT_TOKENS, STARTUP_NEW_TOKENS = 32, 8  # the start-up generate call (bench.py and bench_load.py)
MEASUREMENTS = ("startup", "copy_bandwidth", "plain_decode", "capacity_cost", "steps", "drafter", "speculative",
                "batched")

# Every field of the JSON, `*` standing for a key (a context, width, acceptance rate, batch or program name).
# A measurement that failed is {"error": "..."} instead of its fields, one not run {"skipped": "why"}.
FIELDS = {
    "schema": f'"{SCHEMA}"',
    "fields": "this table: field -> meaning and unit",
    "errors": "present only when a child process failed: role -> what happened",
    "meta.commit": "git commit of the checkout that ran (HEAD, '+dirty' with uncommitted changes)",
    "meta.date_utc": "when the run started, ISO 8601 UTC",
    "meta.command": "the command line",
    "meta.source": "present only in results transcribed from the run log (docs/perf_log/) rather than written by "
                   "bench.py: the log entry and run id the numbers come from",
    "meta.notes": "present only with meta.source: how the log's measurement maps onto these fields",
    "meta.device": "the JAX device kind (e.g. 'NVIDIA H200')",
    "meta.platform": "JAX's default backend: gpu or cpu",
    "meta.jax": "jax version",
    "meta.jaxlib": "jaxlib version",
    "meta.python": "Python version",
    "meta.config": "ds4, tiny, or gguf (--gguf)",
    "meta.layers": "target layers",
    "meta.scan_layers": "whether layers of one structure ran as one scanned body (load_target's scan_layers)",
    "meta.recipe": "quant recipe of the weights (random: 'published' for ds4, 'f32' for tiny; gguf: as written)",
    "meta.dtype": "compute dtype",
    "meta.kernels": "how matrices run: ffi, reference (packed) or dequantize (dense)",
    "meta.weights": "'random on the device' or the target GGUF's path",
    "meta.draft": "'random on the device', the drafter GGUF's path, or null",
    "meta.batch": "sequences of every measurement but `batched`: 1",
    "meta.state_capacity": "tokens the batch-1 state holds (plain_decode, steps, speculative), whatever the position",
    "meta.reps": "timed runs per measurement (after one warm-up); reported values are their median",
    "meta.steps": "decode steps per timed run",
    "meta.mem_fraction": "XLA_PYTHON_CLIENT_MEM_FRACTION in effect (null: JAX's 0.75)",
    "meta.compilation_cache": "the persistent compilation cache's directory (null: off)",
    "meta.compile_threads": "programs compiled at once after the first",
    "weights.load_s": "seconds to build (random: generate on the device) or load (gguf) target and drafter weights",
    "weights.target_bytes": "bytes of the target's weights on the device (packed bytes for packed matrices)",
    "weights.drafter_bytes": "bytes of the drafter's weights on the device (0 without a drafter)",
    "weights.read_per_token_bytes": "weight bytes one batch-1 width-1 step reads, as the weights are held on the "
                                    "device (weights.read_per_token_model)",
    "weights.read_per_token_stored_bytes": "the same count on the file's bytes as stored (the loader holds F16 HC, "
                                           "router and compressor weights as float32)",
    "weights.read_per_token_model": "how read_per_token_bytes is counted",
    "memory.device_limit_bytes": "bytes JAX may use on the device (null where not reported: CPU)",
    "memory.device_in_use_after_load_bytes": "device bytes in use once the weights are loaded (null on CPU)",
    "memory.device_peak_bytes": "peak device bytes in use over the measure process (null on CPU)",
    "memory.host_peak_rss_bytes": "peak resident host memory of the measure process, bytes",
    "copy_bandwidth_gbs": "device copy bandwidth, GB/s (read + write; timing.copy_bandwidth of meta.copy_mib MiB "
                          "buffers)",
    "meta.copy_mib": "MiB per buffer of the copy-bandwidth probe",
    "roofline.*.step_ms": "held: read_per_token_bytes, stored: read_per_token_stored_bytes, at the copy bandwidth: "
                          "the weight-streaming floor of a step, ms",
    "roofline.*.tok_s": "1000 / step_ms",
    "roofline.*.fraction_of_q1_step": "step_ms / steps.1.ms",
    "roofline.*.fraction_of_plain_decode": "step_ms / plain_decode.<first context>.ms_per_token",
    "compile.programs.*.seconds": "wall seconds to compile one program (name: what it runs)",
    "compile.first_program_s": "seconds to compile the batch-1 width-1 decode program alone",
    "compile.concurrent_wall_s": "wall seconds to compile the other programs, compile_threads at a time",
    "startup.*.process_to_first_token_s": "warm: a second process, its programs in the compilation cache; cold "
                                          "(with --cold_start): the measure process, compiling them: seconds from "
                                          "the process's start to the first generated token",
    "startup.*.imports_s": "seconds from the process's start to dsparkjax imported",
    "startup.*.weights_s": "seconds to build or load the weights",
    "startup.*.generate_to_first_token_s": "seconds from calling generate to its first token (compiling or "
                                           "loading its programs, prefill, the first step)",
    "startup.*.cache_entries_written": "entries written to the compilation cache meanwhile (misses)",
    "startup.*.prompt_tokens": "tokens of the prompt (random ids)",
    "startup.*.new_tokens": "max_new_tokens of the generate call (plain decoding, exact program)",
    "plain_decode.*.tok_s": "batch-1 plain decoding (width-1 program, generate's loop: each step's outcome read "
                            "back one step later), tokens per second, at position * (tokens in the state)",
    "plain_decode.*.ms_per_token": "1000 / tok_s",
    "plain_decode.*.runs_ms": "each timed run's ms per token",
    "plain_decode.*.position": "tokens the state holds when the run starts",
    "plain_decode.*.capacity": "tokens the state can hold",
    "steps.*.ms": "ms per decode step of width q = * (the decode program: target step, greedy acceptance, "
                  "commit), batch 1, steps queued back to back with no read-back",
    "steps.*.ratio_to_q1": "steps.*.ms / steps.1.ms",
    "steps.*.runs_ms": "each timed run's ms per step",
    "drafter.propose_ms": "ms per DSpark drafter proposal (5 candidates after a seed), batch 1, back to back, under "
                          "exact mode's policy (XLA's order)",
    "drafter.runs_ms": "each timed run's ms per proposal",
    "speculative.plain_exact.tok_s": "plain decoding through the exact program (width 6), tokens per second: the "
                                     "baseline exact speculative decoding must equal token for token",
    "speculative.plain_exact.runs_ms": "each timed run's ms per token",
    "speculative.*.tok_s": "exact speculative decoding with an oracle proposer whose candidates equal the "
                           "target's greedy token with probability * each (width 6, 5 candidates), tok/s",
    "speculative.*.over_plain_decode": "tok_s / plain_decode.<first context>.tok_s (the width-1 program)",
    "speculative.*.over_plain_exact": "tok_s / speculative.plain_exact.tok_s",
    "speculative.*.tokens_per_step": "tokens committed per step (accepted candidates + the bonus token)",
    "speculative.*.matched_per_offered": "accepted candidates / verified candidates",
    "speculative.*.equals_plain_exact": "whether the speculative tokens equal plain exact decoding's",
    "speculative.*.runs_ms": "each timed run's ms per token",
    "speculative.*.position": "tokens the state holds when a run starts",
    "capacity_cost.position": "tokens the state holds (the first context)",
    "capacity_cost.small_capacity": "tokens the small state can hold (what generate would allocate)",
    "capacity_cost.small_ms_per_token": "batch-1 plain decoding at the first context in the small state",
    "capacity_cost.runs_ms": "each timed run's ms per token in the small state",
    "capacity_cost.large_capacity": "tokens the plain_decode state can hold (--capacity)",
    "capacity_cost.large_ms_per_token": "plain_decode.<first context>.ms_per_token",
    "capacity_cost.large_over_small": "large_ms_per_token / small_ms_per_token (issue 38: within 1.05)",
    "batched.*.tok_s": "aggregate tokens per second of * sequences (width-1 program, generate's loop)",
    "batched.*.ms_per_step": "ms per step of all * sequences",
    "batched.*.runs_ms": "each timed run's ms per step",
    "batched.*.position": "tokens each sequence's state holds when the run starts",
    "batched.*.capacity": "tokens each sequence's state can hold",
}

# Fields a bench.py run writes only in some cases (a failed child) or never (results transcribed from the log).
OPTIONAL_FIELDS = ("errors", "meta.source", "meta.notes")

READ_MODEL = ("every weight of the target once per token, but the embedding table (one row) and the routed "
              "experts not selected: n_active_experts of n_routed_experts per layer (gate, up and down of each); "
              "packed bytes as stored; the decode state's reads not counted (footprint.step_weight_bytes)")


@dataclasses.dataclass(frozen=True)
class Settings:
    """The flags, with the config's defaults filled in."""

    config: str  # ds4, tiny or gguf
    layers: int | None
    gguf: str | None
    draft: str | None
    dtype: str
    kernels: str
    seed: int
    compile_threads: int
    startup_tokens: int
    cold_start: bool
    contexts: tuple[int, ...]
    capacity: int
    widths: tuple[int, ...]
    acceptance: tuple[float, ...]
    batches: tuple[int, ...]
    copy_mib: int
    reps: int
    steps: int
    spec_tokens: int
    measure: frozenset[str]
    scan_layers: bool = False  # the target's layers of one structure share a scanned body (load_target's)


class Part:
    """A process's results, written to `path` after every measurement (bench.py's children: --part_out)."""

    def __init__(self, path: str | None, schema: str = SCHEMA, fields: dict[str, str] = FIELDS):
        self.path, self.results = path, {"schema": schema, "fields": fields}

    def record(self, name: str, measure: Callable[[], Any]) -> Any:
        """results[name] = measure(), or {"error": ...} when it raises (the traceback goes to stderr)."""
        print(f"== {name}", flush=True)
        start = time.perf_counter()
        try:
            value = measure()
        except Exception as err:  # noqa: BLE001 - a failed measurement is recorded, and the run goes on
            traceback.print_exc()
            value = {"error": f"{type(err).__name__}: {err}"}
        self.results[name] = value
        self.write()
        print(f"   {name}: {time.perf_counter() - start:.1f} s", flush=True)
        return value

    def write(self) -> None:
        if self.path:
            with open(self.path + ".tmp", "w") as f:
                json.dump(self.results, f, indent=1)
            os.replace(self.path + ".tmp", self.path)


def _get(results: dict, path: str) -> Any:
    node: Any = results
    for key in path.split("."):
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def table(r: dict) -> str:
    """The run's numbers as one table: measurement, value, unit."""
    rows: list[tuple[str, Any, str]] = []
    meta = r.get("meta", {})
    rows.append(("device", f"{meta.get('device')} ({meta.get('platform')}), jax {meta.get('jax')}", ""))
    rows.append(("model", f"{meta.get('config')}, {meta.get('layers')} layers, {meta.get('recipe')}, "
                          f"{meta.get('dtype')}, {meta.get('kernels')}", ""))
    rows.append(("commit", f"{meta.get('commit')} {meta.get('date_utc')}", ""))
    for label, path, unit, scale in (
            ("weights: build/load", "weights.load_s", "s", 1), ("weights: target", "weights.target_bytes", "GB", 1e-9),
            ("weights: drafter", "weights.drafter_bytes", "GB", 1e-9),
            ("weights read per token, as held", "weights.read_per_token_bytes", "GB", 1e-9),
            ("weights read per token, as stored", "weights.read_per_token_stored_bytes", "GB", 1e-9),
            ("device memory after load", "memory.device_in_use_after_load_bytes", "GB", 1e-9),
            ("device memory peak", "memory.device_peak_bytes", "GB", 1e-9),
            ("host peak RSS", "memory.host_peak_rss_bytes", "GB", 1e-9),
            ("copy bandwidth", "copy_bandwidth_gbs", "GB/s", 1),
            ("compile: width-1 program alone", "compile.first_program_s", "s", 1),
            ("compile: the others, concurrently", "compile.concurrent_wall_s", "s", 1),
            ("cold start to first token", "startup.cold.process_to_first_token_s", "s", 1),
            ("warm start to first token", "startup.warm.process_to_first_token_s", "s", 1),
            ("drafter proposal", "drafter.propose_ms", "ms", 1),
            ("plain exact decoding", "speculative.plain_exact.tok_s", "tok/s", 1)):
        value = _get(r, path)
        rows.append((label, "-" if value is None else f"{value * scale:.4g}", unit))
    for kind, v in _sections(r, "roofline"):
        rows.append((f"roofline, weights as {kind}", f"{_fmt(v, 'step_ms')} ms, {_fmt(v, 'tok_s')} tok/s; "
                                                   f"{_fmt(v, 'fraction_of_q1_step')} of the q=1 step, "
                                                   f"{_fmt(v, 'fraction_of_plain_decode')} of plain decoding", ""))
    for name, v in _sections(r.get("compile") or {}, "programs"):
        rows.append((f"compile: {name}", _fmt(v, "seconds"), "s"))
    for ctx, v in _sections(r, "plain_decode"):
        rows.append((f"plain decode at {ctx} (capacity {v.get('capacity')})", _fmt(v, "tok_s"), "tok/s"))
    cost = r.get("capacity_cost") or {}
    if cost.get("large_over_small") is not None:
        rows.append((f"capacity {cost['large_capacity']} over {cost['small_capacity']} at {cost['position']}",
                     f"x{cost['large_over_small']:.3f}", ""))
    for q, v in _sections(r, "steps"):
        rows.append((f"step q={q}", f"{_fmt(v, 'ms')} (x{_fmt(v, 'ratio_to_q1')})", "ms"))
    for p, v in _sections(r, "speculative"):
        if p != "plain_exact":
            rows.append((f"exact speculative, p={p}", f"{_fmt(v, 'tok_s')} (x{_fmt(v, 'over_plain_decode')} plain, "
                                                     f"{_fmt(v, 'tokens_per_step')} tok/step)", "tok/s"))
    for b, v in _sections(r, "batched"):
        rows.append((f"batch {b} aggregate", _fmt(v, "tok_s"), "tok/s"))
    for name, err in errors(r).items():
        rows.append((f"ERROR {name}", err[:120], ""))
    width = max(len(label) for label, _, _ in rows)
    return "\n".join(f"{label:<{width}}  {value} {unit}".rstrip() for label, value, unit in rows)


def _sections(r: dict, name: str) -> list[tuple[str, dict]]:
    section = r.get(name) or {}
    if "error" in section:
        return []
    return [(k, v) for k, v in section.items() if isinstance(v, dict)]


def _fmt(section: dict, key: str) -> str:
    value = section.get(key)
    return "-" if value is None else f"{value:.4g}"


def errors(results: dict) -> dict[str, str]:
    """Every failure the results record: field path -> message (failed measurements, programs, processes)."""
    found: dict[str, str] = {}

    def walk(node: Any, path: str) -> None:
        if not isinstance(node, dict):
            return
        if "error" in node:
            found[path] = str(node["error"])
        for key, value in node.items():
            if key != "fields":
                walk(value, f"{path}.{key}" if path else key)

    walk({k: v for k, v in results.items() if k != "errors"}, "")
    found.update({f"process {role}": str(msg) for role, msg in results.get("errors", {}).items()})
    return found


def git_commit() -> str | None:
    """$DSPARKJAX_COMMIT when set (a copied working tree, whose .git may be another commit's), else HEAD of the
    checkout this script runs from ('+dirty' with changes)."""
    if os.environ.get("DSPARKJAX_COMMIT"):
        return os.environ["DSPARKJAX_COMMIT"]
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=repo,
                               capture_output=True, text=True, check=True).stdout.strip()
        return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def count_files(folder: str | None) -> int:
    if not folder or not os.path.isdir(folder):
        return 0
    return sum(len(files) for _, _, files in os.walk(folder))
