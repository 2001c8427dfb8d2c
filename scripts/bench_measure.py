"""The measurements of scripts/bench.py, run in its child processes (bench.py holds the flags, the JSON's
fields and the table; docs/bench.md describes what each measurement does and why).

Decoding is driven here as `generate` drives it (the decode program of decoding/program.py, each step's outcome
read back one step later), on states set up directly: a state "at position P" is a fresh state whose
committed length is set to P (`commit`), so a 64k-token context costs no 64k-token prefill. What a step
reads from the cache does not depend on the cached values, only on the length and the capacity.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import platform
import resource
import statistics
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from bench_results import (  # scripts/ is on sys.path
    READ_MODEL, STARTUP_PROMPT_TOKENS, Part, Settings, count_files, git_commit)
from dsparkjax import footprint, kernels, runtime
from dsparkjax.config import DrafterConfig, TargetConfig, deepseek_v4_flash, dspark_flash, tiny_drafter, tiny_target
from dsparkjax.decoding.decoder import DEFAULT_BLOCK, plain_proposal
from dsparkjax.decoding.generate import generate
from dsparkjax.decoding.program import LoopState, StepOutcome, decode_program
from dsparkjax.decoding.proposer import Drafter, load_drafter
from dsparkjax.decoding.sampling import RowSampling
from dsparkjax.decoding.width import WidthPolicy
from dsparkjax.ggufio.reader import open_gguf
from dsparkjax.ggufio.writer import QUANT_RECIPE_KEY
from dsparkjax.model.params import load_drafter_params, load_target_params
from dsparkjax.model.sources import ShapeSource
from dsparkjax.model.state import DecodeState, commit, init_state
from dsparkjax.target_api import DTYPES, Target, load_target
from dsparkjax.testing.oracle import OracleProposer
from dsparkjax.testing.timing import copy_bandwidth
from dsparkjax.tiny import random_sources

RANDOM = "random on the device"
EXACT_WIDTH = DEFAULT_BLOCK + 1  # the exact program's width: a seed and DSpark's 5 candidates


@dataclasses.dataclass(frozen=True)
class Model:
    target: Target
    drafter: Drafter | None
    recipe: str
    load_s: float
    stored: dict  # the target's tensors as stored: name -> TensorInfo


def configs(config: str, layers: int | None) -> tuple[TargetConfig, DrafterConfig]:
    """The target and drafter of --config ds4 (its first `layers` of 43) or tiny (its first of 4)."""
    if config == "ds4":
        layers = layers or 43
        return deepseek_v4_flash(layers), dspark_flash(layers)
    cfg = tiny_target(layers=layers or 4)
    return cfg, tiny_drafter(cfg)


def build_model(s: Settings) -> Model:
    """The flags' target and drafter on the device: loaded from --gguf/--draft, or random (DeviceRandomSource),
    checked to fit the device first either way."""
    start = time.perf_counter()
    if s.gguf:
        target = load_target(s.gguf, dtype=s.dtype, kernels=s.kernels, progress=True, scan_layers=s.scan_layers)
        drafter = load_drafter(s.draft, target, progress=True) if s.draft else None
        file = open_gguf(s.gguf)
        recipe, stored = str(file.metadata.get(QUANT_RECIPE_KEY, "as written")), file.tensors
    else:
        tcfg, dcfg = configs(s.config, s.layers)
        recipe = "published" if s.config == "ds4" else "f32"
        backend = "dequantize" if recipe == "f32" else (kernels.default_backend() if s.kernels == "auto" else s.kernels)
        pack, dtype = (None if backend == "dequantize" else backend), DTYPES[s.dtype]
        tsrc, dsrc = random_sources(tcfg, dcfg, seed=s.seed, recipe=recipe)
        stored = tsrc.tensors
        shapes = (load_target_params(ShapeSource(tsrc.path, tsrc.tensors), tcfg, dtype, pack,
                                     scan_layers=s.scan_layers),
                  load_drafter_params(ShapeSource(dsrc.path, dsrc.tensors), dcfg, dtype, pack))
        footprint.check_fits(footprint.tree_bytes(shapes), "the random target and drafter")
        target = Target(RANDOM, tcfg, load_target_params(tsrc, tcfg, dtype, pack, scan_layers=s.scan_layers), dtype,
                        True, None, backend)
        drafter = Drafter(RANDOM, dcfg, load_drafter_params(dsrc, dcfg, dtype, pack), target)
    jax.block_until_ready((target.params, drafter.params if drafter else None))
    return Model(target, drafter, recipe, time.perf_counter() - start, stored)


def meta(s: Settings, model: Model, configured: runtime.Settings) -> dict[str, Any]:
    import jaxlib

    return dict(
        commit=git_commit(), date_utc=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command=" ".join(a for a in sys.argv if not a.startswith(("--role=", "--part_out="))),
        device=jax.devices()[0].device_kind, platform=jax.default_backend(), jax=jax.__version__,
        jaxlib=jaxlib.__version__, python=platform.python_version(), config=s.config,
        layers=model.target.config.num_layers, scan_layers=s.scan_layers, recipe=model.recipe, dtype=s.dtype, kernels=model.target.kernels,
        weights=s.gguf or RANDOM, draft=(s.draft if s.gguf else RANDOM), batch=1, state_capacity=s.capacity,
        reps=s.reps, steps=s.steps, copy_mib=s.copy_mib, mem_fraction=configured.mem_fraction,
        compilation_cache=configured.cache_dir, compile_threads=s.compile_threads)


# ---------------------------------------------------------------------------------------------------------
# Decoding as generate does it, on states set up here.


class Runner:
    """The target's decode program (decoding/program.py) and the arguments generate passes it, for one model."""

    def __init__(self, target: Target):
        self.target = target
        self.program = decode_program(target.config, target.options())
        self.decay = WidthPolicy().ewma_decay  # generate's default policy: the programs it compiles
        self._loops: dict[int, LoopState] = {}  # batch -> the last step's loop: its buffers are reused

    @staticmethod
    def loop(state: DecodeState, seeds: Any, active: Any, ewma: Any) -> LoopState:
        return LoopState(state=state, proposer=None, seeds=seeds, ewma=ewma,
                         sampling=RowSampling.greedy(active.shape[0]), active=active)

    def state(self, batch: int, capacity: int) -> DecodeState:
        return init_state(self.target.config, batch, capacity, EXACT_WIDTH, self.target.dtype, self.target.plan)

    def compile(self, batch: int, capacity: int, width: int) -> None:
        ints = jax.ShapeDtypeStruct((batch,), jnp.int32)
        state = jax.eval_shape(lambda: self.state(batch, capacity))
        loop = self.loop(state, ints, jax.ShapeDtypeStruct((batch,), jnp.bool_),
                         jax.ShapeDtypeStruct((batch,), jnp.float32))
        self.program.compile(self.target.params, loop, drafts=jax.ShapeDtypeStruct((batch, DEFAULT_BLOCK), jnp.int32),
                             widths=ints, width=width, ewma_decay=self.decay, sample=False)

    def step(self, state: DecodeState, seeds: jax.Array, drafts: jax.Array, widths: jax.Array, width: int
             ) -> tuple[DecodeState, jax.Array, StepOutcome]:
        """One decode step; returns (the committed state, the next seeds, the outcome). The next seeds are the
        loop's, not the outcome's bonus buffer: the next step donates them, and the outcome is read later. The loop's other values (active mask,
        EWMA, sampling rows) come from this batch's last step (as generate threads them), so no step builds new buffers."""
        batch = seeds.shape[0]
        if batch not in self._loops:
            self._loops[batch] = self.loop(state, seeds, jnp.ones((batch,), bool), jnp.zeros((batch,), jnp.float32))
        loop, _, outcome = self.program(self.target.params, self._loops[batch].replace(state=state, seeds=seeds),
                                        drafts=drafts, widths=widths, width=width, ewma_decay=self.decay,
                                        sample=False)
        self._loops[batch] = loop
        return loop.state, loop.seeds, outcome


def fresh(runner: Runner, batch: int, capacity: int, position: int) -> DecodeState:
    """A new state holding `position` tokens per sequence (zeros: what a step reads costs the same whatever
    the values). Every run starts from one, so runs from the same position compute the same tokens (setting
    an old state's length back would not: its window ring holds the later positions written since)."""
    state = runner.state(batch, capacity)
    return commit(state, jnp.full((batch,), position, jnp.int32))


@dataclasses.dataclass
class Run:
    """One decoding run's outcome."""

    seconds: float
    tokens: list[list[int]]  # emitted per sequence
    steps: int  # steps read back
    matched: int  # candidates accepted, over all sequences


def decode_run(runner: Runner, state: DecodeState, seeds: jax.Array, width: int, *, steps: int | None = None,
               tokens: int | None = None, propose: Callable | None = None) -> Run:
    """Decode from `state` as generate does: plain (`propose` None: the seeds repeated as padding drafts,
    width 1 counted) or speculative with `propose(seeds, positions) -> (drafts, confidences)` and q = `width`;
    step k+1 is queued before step k's outcome is read. Stops after `steps` steps, or once every sequence
    has `tokens` tokens (the time taken when the last of those is read)."""
    batch = seeds.shape[0]
    seeds = jnp.array(seeds, copy=True)  # the steps donate their seeds; the caller reuses its array across runs
    widths = jnp.full((batch,), width if propose else 1, jnp.int32)
    run = Run(0.0, [[] for _ in range(batch)], 0, 0)

    def read(outcome: tuple) -> None:
        matched, bonus, candidates = jax.device_get(outcome)
        for b in range(batch):
            run.tokens[b] += [*candidates[b, : matched[b]].tolist(), int(bonus[b])]
        run.steps += 1
        run.matched += int(matched.sum())

    pending, dispatched = None, 0
    start = time.perf_counter()
    while (steps is None or dispatched < steps) and (tokens is None or min(map(len, run.tokens)) < tokens):
        if propose is not None:
            drafts, _ = propose(seeds, state.length)
        else:
            drafts, _ = plain_proposal(seeds, DEFAULT_BLOCK)  # generate's padding drafts
        state, seeds, outcome = runner.step(state, seeds, drafts, widths, width)
        dispatched += 1
        if pending is not None:
            read(pending)
        pending = (outcome.matched, outcome.bonus, outcome.candidates)
    if steps is not None and pending is not None:
        read(pending)
    run.seconds = time.perf_counter() - start
    jax.block_until_ready(state)  # a step queued past the stop ends before the next run
    return run


def queued_seconds(runner: Runner, state: DecodeState, seeds: jax.Array, drafts: jax.Array, width: int,
                   steps: int) -> float:
    """Seconds of `steps` steps of `width` from `state` (donated) queued back to back, nothing read back: the
    device's cost plus dispatch."""
    widths = jnp.full(seeds.shape, width, jnp.int32)
    seeds = jnp.array(seeds, copy=True)  # the steps donate their seeds; the caller reuses its array across runs
    start = time.perf_counter()
    for _ in range(steps):
        state, seeds, _ = runner.step(state, seeds, drafts, widths, width)
    jax.block_until_ready(state)
    return time.perf_counter() - start


def median_runs(reps: int, once: Callable[[], float]) -> tuple[float, list[float]]:
    """One warm-up call of `once`, then the median and the values of `reps` calls."""
    once()
    runs = [once() for _ in range(reps)]
    return statistics.median(runs), runs


# ---------------------------------------------------------------------------------------------------------
# The measurements.


class Bench:
    """The measure and startup processes' work: one model, its runner, and the measurements."""

    def __init__(self, s: Settings, configured: runtime.Settings, part: Part, t0: float):
        self.s, self.configured, self.part, self.t0 = s, configured, part, t0
        self.t_imported = time.time()
        self.rng = np.random.default_rng(s.seed)
        self.model: Model | None = None
        self.runner: Runner | None = None
        self.after_load: footprint.DeviceMemory | None = None

    # -- setup -------------------------------------------------------------------------------------------

    def load(self) -> dict[str, Any]:
        self.model = build_model(self.s)
        self.runner = Runner(self.model.target)
        target, drafter = self.model.target, self.model.drafter
        self.after_load = footprint.device_memory()
        self.part.results["meta"] = meta(self.s, self.model, self.configured)
        return dict(load_s=self.model.load_s, target_bytes=footprint.tree_bytes(target.params),
                    drafter_bytes=footprint.tree_bytes(drafter.params) if drafter else 0,
                    read_per_token_bytes=footprint.step_weight_bytes(target.params, target.config),
                    read_per_token_stored_bytes=footprint.stored_step_weight_bytes(self.model.stored, target.config),
                    read_per_token_model=READ_MODEL)

    def batch_capacity(self) -> int:
        """Capacity of the batched states: what generate would allocate for the first context and a run."""
        return 1 << (self.s.contexts[0] + self.s.steps + 16).bit_length()

    def seeds(self, batch: int) -> jax.Array:
        return jnp.asarray(self.rng.integers(0, self.model.target.config.vocab_size, batch), jnp.int32)

    # -- start-up ----------------------------------------------------------------------------------------

    def start_generate(self, on_token: Callable[[int, int], None] | None = None) -> None:
        """The start-up call: `generate` on one random prompt of STARTUP_PROMPT_TOKENS tokens (plain decoding,
        the exact program: what a user's first call runs)."""
        prompt = np.random.default_rng(self.s.seed).integers(0, self.model.target.config.vocab_size,
                                                             STARTUP_PROMPT_TOKENS).tolist()
        generate(self.model.target, [prompt], max_new_tokens=self.s.startup_tokens, on_token=on_token, stop_tokens=())

    def startup(self, weights_s: float) -> dict[str, Any]:
        """The start-up call timed to its first token, right after the weights."""
        cache = self.configured.cache_dir
        before = count_files(cache)
        first: list[float] = []

        def on_token(index: int, token: int) -> None:
            del index, token
            if not first:
                first.append(time.time())

        called = time.time()
        self.start_generate(on_token)
        return dict(process_to_first_token_s=first[0] - self.t0, imports_s=self.t_imported - self.t0,
                    weights_s=weights_s, generate_to_first_token_s=first[0] - called,
                    cache_entries_written=count_files(cache) - before, prompt_tokens=STARTUP_PROMPT_TOKENS,
                    new_tokens=self.s.startup_tokens)

    # -- compiling ---------------------------------------------------------------------------------------

    def programs(self) -> list[tuple[str, Callable[[], None]]]:
        """(name, compile) of every program the chosen measurements run, the batch-1 width-1 one first; without
        a cold start, `generate`'s start-up call too, so its programs reach the persistent cache."""
        s, m, c = self.s, self.s.measure, self.s.capacity
        widths = sorted(({1} if m & {"plain_decode", "steps"} else set()) | (set(s.widths) if "steps" in m else set())
                        | ({EXACT_WIDTH} if "speculative" in m else set()))
        jobs: list[tuple[str, Callable[[], None]]] = [
            (f"decode b1 q{w} capacity {c}", lambda w=w: self.runner.compile(1, c, w)) for w in widths]
        batches = (set(s.batches) if "batched" in m else set()) | ({1} if "capacity_cost" in m else set())
        jobs += [(f"decode b{b} q1 capacity {self.batch_capacity()}",
                  lambda b=b: self.runner.compile(b, self.batch_capacity(), 1)) for b in sorted(batches)]
        drafter = self.model.drafter
        if "drafter" in m and drafter is not None:
            jobs.append(("drafter propose b1",
                         lambda: drafter.precompile(drafter.init_state(1, EXACT_WIDTH), (), invariant=False)))
        if "startup" in m and not s.cold_start:  # generate compiles its own, for the warm start's cache
            jobs.append(("the start-up generate call (its programs, and one run)", self.start_generate))
        return jobs

    def compile_all(self) -> dict[str, Any]:
        jobs = self.programs()
        programs: dict[str, Any] = {}

        def timed(name: str, fn: Callable[[], None]) -> None:
            start = time.perf_counter()
            try:
                fn()
                programs[name] = dict(seconds=time.perf_counter() - start)
            except Exception as err:  # noqa: BLE001 - recorded; the measurement that needs it fails on its own
                programs[name] = dict(error=f"{type(err).__name__}: {err}")
            print(f"   compiled {name}: {programs[name]}", flush=True)

        first = 0.0
        if jobs:
            timed(*jobs[0])
            first = programs[jobs[0][0]].get("seconds", 0.0)
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(max(1, self.s.compile_threads)) as pool:
            list(pool.map(lambda job: timed(*job), jobs[1:]))
        return dict(programs=programs, first_program_s=first, concurrent_wall_s=time.perf_counter() - start)

    # -- decoding ----------------------------------------------------------------------------------------

    def plain_decode(self) -> dict[str, Any]:
        s, c = self.s, self.s.capacity
        out = {}
        for ctx in s.contexts:
            if ctx + s.steps + EXACT_WIDTH > c:
                raise ValueError(f"context {ctx} + {s.steps} steps does not fit the capacity {c} (--capacity)")
            seeds = self.seeds(1)

            def once() -> float:
                return decode_run(self.runner, fresh(self.runner, 1, c, ctx), seeds, 1, steps=s.steps).seconds \
                    / s.steps * 1e3

            ms, runs = median_runs(s.reps, once)
            out[str(ctx)] = dict(tok_s=1e3 / ms, ms_per_token=ms, runs_ms=runs, position=ctx, capacity=c)
        return out

    def steps(self) -> dict[str, Any]:
        s, c, ctx = self.s, self.s.capacity, self.s.contexts[0]
        out: dict[str, Any] = {}
        for q in s.widths:
            seeds = self.seeds(1)
            drafts = jnp.asarray(self.rng.integers(0, self.model.target.config.vocab_size, (1, DEFAULT_BLOCK)),
                                 jnp.int32)

            def once() -> float:
                return queued_seconds(self.runner, fresh(self.runner, 1, c, ctx), seeds, drafts, q, s.steps) \
                    / s.steps * 1e3

            ms, runs = median_runs(s.reps, once)
            out[str(q)] = dict(ms=ms, runs_ms=runs)
        base = out.get("1", {}).get("ms")
        for v in out.values():
            v["ratio_to_q1"] = v["ms"] / base if base else None
        return out

    def drafter(self) -> dict[str, Any]:
        drafter = self.model.drafter
        state = drafter.init_state(1, EXACT_WIDTH)
        seeds, position = self.seeds(1), jnp.full((1,), self.s.contexts[0], jnp.int32)

        def once() -> float:
            start = time.perf_counter()
            for _ in range(self.s.steps):
                out = drafter.propose(state, seeds, position, invariant=False)  # exact mode's drafter
            jax.block_until_ready(out)
            return (time.perf_counter() - start) / self.s.steps * 1e3

        ms, runs = median_runs(self.s.reps, once)
        return dict(propose_ms=ms, runs_ms=runs)

    def speculative(self, plain_tok_s: float | None) -> dict[str, Any]:
        s, c, ctx, vocab = self.s, self.s.capacity, self.s.contexts[0], self.model.target.config.vocab_size
        seed = self.seeds(1)
        # Plain decoding through the exact program: the tokens speculative decoding must reproduce (the
        # oracle's truth), then its own speed.
        reference = decode_run(self.runner, fresh(self.runner, 1, c, ctx), seed, EXACT_WIDTH, steps=s.spec_tokens + 1)
        expected = reference.tokens[0][: s.spec_tokens]

        def plain_once() -> float:
            return decode_run(self.runner, fresh(self.runner, 1, c, ctx), seed, EXACT_WIDTH, steps=s.steps).seconds \
                / s.steps * 1e3

        plain_ms, plain_runs = median_runs(s.reps, plain_once)
        out: dict[str, Any] = dict(plain_exact=dict(tok_s=1e3 / plain_ms, runs_ms=plain_runs))
        truth = np.zeros((1, ctx + s.spec_tokens + 4 * EXACT_WIDTH), np.int32)
        truth[0, ctx] = int(seed[0])
        truth[0, ctx + 1 : ctx + 1 + len(reference.tokens[0])] = reference.tokens[0]
        for i, p in enumerate(s.acceptance):
            wrong = np.random.default_rng(s.seed + 1 + i).random(truth.shape) >= p
            oracle = OracleProposer(truth, wrong, vocab, block_size=DEFAULT_BLOCK)
            ostate = oracle.init_state(1, EXACT_WIDTH)
            runs: list[Run] = []

            def once() -> float:
                run = decode_run(self.runner, fresh(self.runner, 1, c, ctx), seed, EXACT_WIDTH, tokens=s.spec_tokens,
                                 propose=lambda seeds, pos: oracle.propose(ostate, seeds, pos, invariant=False))
                runs.append(run)
                return run.seconds / len(run.tokens[0]) * 1e3

            ms, runs_ms = median_runs(s.reps, once)
            last = runs[-1]
            tok_s = 1e3 / ms
            out[str(p)] = dict(
                tok_s=tok_s, over_plain_decode=tok_s / plain_tok_s if plain_tok_s else None,
                over_plain_exact=tok_s * plain_ms / 1e3, tokens_per_step=len(last.tokens[0]) / last.steps,
                matched_per_offered=last.matched / (last.steps * DEFAULT_BLOCK),
                equals_plain_exact=all(r.tokens[0][: s.spec_tokens] == expected for r in runs), runs_ms=runs_ms,
                position=ctx)
        return out

    def batched(self) -> dict[str, Any]:
        s, ctx, cap = self.s, self.s.contexts[0], self.batch_capacity()
        out = {}
        for b in s.batches:
            seeds = self.seeds(b)

            def once() -> float:
                return decode_run(self.runner, fresh(self.runner, b, cap, ctx), seeds, 1, steps=s.steps).seconds \
                    / s.steps * 1e3

            ms, runs = median_runs(s.reps, once)
            out[str(b)] = dict(tok_s=b * 1e3 / ms, ms_per_step=ms, runs_ms=runs, position=ctx, capacity=cap)
        return out

    def capacity_cost(self, plain: dict[str, Any] | None) -> dict[str, Any]:
        """Issue 38 part 3: a width-1 step at the first context in a state just big enough for it (the capacity
        `generate` would allocate) against the same step in the `--capacity` state of plain_decode. Cost should
        follow the length, not the capacity."""
        s, ctx, small = self.s, self.s.contexts[0], self.batch_capacity()
        seeds = self.seeds(1)

        def once() -> float:
            return decode_run(self.runner, fresh(self.runner, 1, small, ctx), seeds, 1, steps=s.steps).seconds \
                / s.steps * 1e3

        ms, runs = median_runs(s.reps, once)
        large = (plain or {}).get(str(ctx), {}).get("ms_per_token")
        return dict(position=ctx, small_capacity=small, small_ms_per_token=ms, runs_ms=runs,
                    large_capacity=s.capacity, large_ms_per_token=large,
                    large_over_small=large / ms if large else None)

    def memory(self) -> dict[str, Any]:
        mem, loaded = footprint.device_memory(), self.after_load
        return dict(device_limit_bytes=loaded and loaded.limit, device_in_use_after_load_bytes=loaded and loaded.in_use,
                    device_peak_bytes=mem and mem.peak,
                    host_peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # KiB on Linux

    def roofline(self) -> dict[str, Any]:
        """The weight-streaming floor of a step: the bytes a token reads (as held, and as stored in the file) at
        the copy bandwidth, and its fraction of the measured step and of plain decoding's time per token."""
        r = self.part.results
        q1 = (r.get("steps") or {}).get("1", {}).get("ms")
        plain = (r.get("plain_decode") or {}).get(str(self.s.contexts[0]), {}).get("ms_per_token")
        out = {}
        for name, key in (("held", "read_per_token_bytes"), ("stored", "read_per_token_stored_bytes")):
            step_ms = r["weights"][key] / (r["copy_bandwidth_gbs"] * 1e9) * 1e3
            out[name] = dict(step_ms=step_ms, tok_s=1e3 / step_ms, fraction_of_q1_step=step_ms / q1 if q1 else None,
                             fraction_of_plain_decode=step_ms / plain if plain else None)
        return out


def run(role: str, s: Settings, configured: runtime.Settings, part: Part, t0: float) -> None:
    """The measure process (role "measure") or the warm-start process ("startup")."""
    bench = Bench(s, configured, part, t0)
    weights = part.record("weights", bench.load)
    if "error" in weights:
        return
    if "startup" in s.measure and (role == "startup" or s.cold_start):
        key = "warm" if role == "startup" else "cold"
        part.record("startup", lambda: {key: bench.startup(weights["load_s"])})
    if role == "startup":
        return
    m = s.measure
    if "copy_bandwidth" in m:
        part.record("copy_bandwidth_gbs", lambda: copy_bandwidth(s.copy_mib, 10) / 1e9)
    part.record("compile", bench.compile_all)
    if "plain_decode" in m:
        part.record("plain_decode", bench.plain_decode)
    if "steps" in m:
        part.record("steps", bench.steps)
    if "drafter" in m:
        part.record("drafter", bench.drafter if bench.model.drafter else lambda: {"skipped": "no drafter (--draft)"})
    if "speculative" in m:
        plain = (part.results.get("plain_decode") or {}).get(str(s.contexts[0]), {}).get("tok_s")
        part.record("speculative", lambda: bench.speculative(plain))
    if "capacity_cost" in m:
        part.record("capacity_cost", lambda: bench.capacity_cost(part.results.get("plain_decode")))
    if "batched" in m:
        part.record("batched", bench.batched)
    part.record("memory", bench.memory)
    if "copy_bandwidth" in m:
        part.record("roofline", bench.roofline)
