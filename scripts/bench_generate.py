"""Measure generation: plain vs speculative, exact vs fast, on one device in one run.

    python scripts/bench_generate.py --config wide --dtype bfloat16 --prompts 64 --output bench.json

Builds a random model (`tiny`; `wide`: a DS4-shaped model with wider dims; `ds4`: DeepSeek-V4-Flash's own dims
and `--layers` of its 43 layers, with its full-size drafter, matrices written as random packed blocks), writes
it as GGUF (float32, or quantized with `--recipe`: `published` and `q4k_experts` are DS4's own types, run on the
packed kernels as a real file is) and loads it back (`--kernels dequantize` runs a quantized file on dense weights instead: the packed kernels'
A/B on the same numbers), then for the same random prompts measures:
- plain decoding through the exact (batch-invariant) width-1 program and through the fast one (XLA's own
  contractions: the program exact mode ran before issue 42 made steps batch invariant);
- speculative decoding with an oracle proposer at a chosen acceptance rate (the drafter's quality is not
  what is measured here: the verify economics are), exact and fast, and with the random DSpark drafter;
- the exact mode before issue 42 (`old_exact`): every step through the width-`--q` program with XLA's own
  contractions, plain decoding as that program with every candidate wrong (the padding rows) and speculative
  decoding with the oracle on that program's own tokens;
- exactness: exact-mode speculative tokens == plain exact tokens for every prompt; the fast mode's mismatch
  rate against plain decoding;
- tok/s of the best of `--reps` runs (each run's time is kept: single runs are noisy), the speculative/plain
  ratio, and the fraction of the weight-streaming roofline (bytes of weights a plain step reads, over the
  device copy bandwidth measured in the same run).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile

import jax
import numpy as np
from absl import app, flags, logging

from dsparkjax import footprint
from dsparkjax.config import DrafterConfig, TargetConfig, deepseek_v4_flash, dspark_flash, tiny_drafter, tiny_target
from dsparkjax.decoding.generate import Result, generate
from dsparkjax.decoding.proposer import Drafter, load_drafter
from dsparkjax.ggufio.writer import RECIPES
from dsparkjax.kernels.policy import KernelPolicy
from dsparkjax.target_api import KERNEL_CHOICES, Target, load_target
from dsparkjax.testing.oracle import oracle_for
from dsparkjax.testing.timing import copy_bandwidth
from dsparkjax.tiny import write_tiny_pair

_CONFIG = flags.DEFINE_enum("config", "wide", ["tiny", "wide", "ds4"], "Random model shape (ds4: DS4's own "
                            "dims, --layers layers, --recipe published or q4k_experts).")
_LAYERS = flags.DEFINE_integer("layers", 8, "--config ds4: how many of DS4's 43 layers (the first ones).")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["float32", "bfloat16"], "Compute dtype.")
_RECIPE = flags.DEFINE_enum("recipe", "f32", list(RECIPES), "Quant recipe of the written GGUFs (f32: dense "
                            "weights; others keep the quantized matrices packed on the FFI kernels).")
_KERNELS = flags.DEFINE_enum("kernels", "auto", list(KERNEL_CHOICES),
                             "How the target's matrices run (load_target's `kernels`): with --recipe published, "
                             "'dequantize' runs the same quantized model on dense weights, the A/B for the "
                             "packed kernels.")
_GEMM_MIN_ROWS = flags.DEFINE_integer("gemm_min_rows", KernelPolicy.gemm_min_rows,
                                      "KernelPolicy.gemm_min_rows: rows from which a packed non-expert matmul takes "
                                      "the dense copy (0: the kernels always).")
_GEMM_MIN_ROWS_LARGE = flags.DEFINE_integer("gemm_min_rows_large", KernelPolicy.gemm_min_rows_large,
                                            "KernelPolicy.gemm_min_rows_large: the same for weights of 16 MB or more.")
_MMA = flags.DEFINE_enum("mma", KernelPolicy.mma, ["off", "auto", "force"], "KernelPolicy.mma: the GPU's "
                         "tensor-core mode.")
_PROMPTS = flags.DEFINE_integer("prompts", 64, "Number of random prompts (one batch).")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 32, "Tokens per prompt.")
_ACCEPT = flags.DEFINE_float("acceptance", 0.7, "Oracle proposer: fraction of correct candidates.")
_WIDTH = flags.DEFINE_string("q", "4", "Verify width for the oracle runs ('adaptive' or 1..6).")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "> 0: every run samples (prompt i with seed i); the oracle "
                                  "proposes plain sampling's tokens, and a lossless run is added.")
_REPS = flags.DEFINE_integer("reps", 3, "Timed runs of each configuration (bench_step.py: of each width); the "
                             "best is reported, with the spread (single runs on one GPU vary by up to 1.6x).")
_OUTPUT = flags.DEFINE_string("output", None, "Write the results as JSON here.")
RUNS = ("plain_exact", "plain_fast", "spec_exact", "spec_fast", "dspark_exact", "old_exact")
_RUNS = flags.DEFINE_list("runs", ["plain_exact", "plain_fast", "spec_exact", "spec_fast", "dspark_exact"],
                          f"Which configurations to time, of {', '.join(RUNS)} (plain_exact always runs: the "
                          "oracle proposes its tokens).")


def wide_target() -> TargetConfig:
    """DS4's structure (SWA, CSA with indexer, HCA, hash + top-k MoE, 4 HC streams) at wider dims."""
    layers = 6
    return dataclasses.replace(
        tiny_target(vocab_size=16384, hidden_size=512, moe_intermediate_size=256),
        num_layers=layers, num_heads=8, q_lora_rank=256, o_groups=4, o_lora_rank=128, sliding_window=128,
        compress_ratios=(0, 0, 4, 16, 4, 16), index_topk=32, n_routed_experts=32, n_active_experts=4,
        swiglu_limit=(10.0,) * layers, swiglu_limit_shared=(10.0,) * layers, context_length=8192)


def step_weight_bytes(target: Target) -> int:
    """Weight bytes one plain decode step reads (`footprint.step_weight_bytes`)."""
    return footprint.step_weight_bytes(target.params, target.config)


def same_tokens(a: list[Result], b: list[Result]) -> bool:
    return all(x.token_ids == y.token_ids for x, y in zip(a, b))


@dataclasses.dataclass(frozen=True)
class Timing:
    """A configuration's results and its decode seconds over the timed runs (generate's own clock: from the
    start of decoding, after compiling and prefill, to the last sequence's end)."""

    results: list[Result]
    seconds: list[float]

    @property
    def best(self) -> float:
        return min(self.seconds)


def timed(label: str, fn) -> Timing:
    """Run `fn(max_new_tokens)` once briefly to warm up, then `--reps` times in full; every run must give the
    same tokens (generation is deterministic). Prints the best run's rate and the spread of ms per step."""
    fn(2)
    seconds, results = [], None
    for _ in range(_REPS.value):
        run = fn(_MAX_NEW.value)
        if results is not None and not same_tokens(run, results):
            raise RuntimeError(f"{label}: two runs of the same generation gave different tokens")
        results = run
        seconds.append(max(len(r.token_ids) / r.tok_per_s for r in run))
    tokens = sum(len(r.token_ids) for r in results)
    steps = max(max(r.steps for r in results), 1)
    spread = " ".join(f"{t / steps * 1e3:.2f}" for t in seconds)
    print(f"{label:<30} {tokens / min(seconds):9.1f} tok/s  {min(seconds) / steps * 1e3:7.2f} ms/step  "
          f"{steps} steps  (runs: {spread} ms/step)")
    return Timing(results, seconds)


def matched_per_offered(results: list[Result]) -> float:
    return sum(r.matched for r in results) / max(1, sum(r.offered for r in results))


def mismatch_rate(a: list[Result], b: list[Result]) -> float:
    return float(np.mean([x.token_ids != y.token_ids for x, y in zip(a, b)]))


def bench_configs() -> tuple[TargetConfig, DrafterConfig]:
    """The flags' target and drafter configs."""
    if _CONFIG.value == "ds4":
        if _RECIPE.value not in ("published", "q4k_experts"):
            raise app.UsageError("--config ds4 writes its matrices as random blocks of DS4's published types: "
                                 f"use --recipe published or q4k_experts, not {_RECIPE.value}")
        return deepseek_v4_flash(_LAYERS.value), dspark_flash(_LAYERS.value)
    cfg = wide_target() if _CONFIG.value == "wide" else tiny_target()
    return cfg, tiny_drafter(cfg)


def bench_model() -> tuple[Target, Drafter, list[list[int]]]:
    """The flags' random model written as GGUF and loaded back, its drafter, and the random prompts (8-64
    tokens each, seeded): what every generation measurement runs on. The files are deleted once loaded
    (DS4-sized ones are tens of GB)."""
    tcfg, dcfg = bench_configs()
    folder = tempfile.mkdtemp(prefix="dsparkjax-bench-")
    try:
        target_path, draft_path = write_tiny_pair(folder, recipe=_RECIPE.value, target_cfg=tcfg, drafter_cfg=dcfg,
                                                  tokenizer=None, random_blocks=_CONFIG.value == "ds4")
        policy = KernelPolicy(gemm_min_rows=_GEMM_MIN_ROWS.value, gemm_min_rows_large=_GEMM_MIN_ROWS_LARGE.value,
                              mma=_MMA.value)
        target = load_target(target_path, dtype=_DTYPE.value, kernels=_KERNELS.value, policy=policy)
        drafter = load_drafter(draft_path, target)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, tcfg.vocab_size, int(rng.integers(8, 65))).tolist() for _ in range(_PROMPTS.value)]
    return target, drafter, prompts


def main(argv: list[str]) -> None:
    del argv
    logging.set_verbosity(logging.WARNING)
    target, drafter, prompts = bench_model()
    cfg = target.config
    kw = dict(stop_tokens=(), temperature=_TEMPERATURE.value, seed=0)
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, {_CONFIG.value} model, {_DTYPE.value}, "
          f"recipe {_RECIPE.value} ({target.kernels} matrices), {len(prompts)} prompts x {_MAX_NEW.value} tokens")
    runs = set(_RUNS.value) | {"plain_exact"}
    if runs - set(RUNS):
        raise app.UsageError(f"--runs: unknown {sorted(runs - set(RUNS))}; choose from {', '.join(RUNS)}")
    width = int(_WIDTH.value) if _WIDTH.value.isdigit() else _WIDTH.value
    timings: dict[str, Timing] = {}
    timings["plain_exact"] = ar_exact = timed("plain, exact program", lambda n: generate(
        target, prompts, drafter=drafter, mode="ar", max_new_tokens=n, **kw))
    if "plain_fast" in runs:
        timings["plain_fast"] = timed("plain, width-1 program", lambda n: generate(
            target, prompts, drafter=drafter, mode="ar", verify="fast", max_new_tokens=n, **kw))
    oracle = oracle_for(prompts, ar_exact.results, cfg.vocab_size, wrong_rate=1 - _ACCEPT.value, seed=1,
                        capture_layers=drafter.capture_layers)
    if "spec_exact" in runs:
        timings["spec_exact"] = timed("spec oracle, exact", lambda n: generate(
            target, prompts, drafter=oracle, width=width, max_new_tokens=n, **kw))
    if "spec_fast" in runs:
        reference = timings.get("plain_fast", ar_exact).results
        oracle_fast = oracle_for(prompts, reference, cfg.vocab_size, wrong_rate=1 - _ACCEPT.value, seed=1,
                                 capture_layers=drafter.capture_layers)
        timings["spec_fast"] = timed("spec oracle, fast", lambda n: generate(
            target, prompts, drafter=oracle_fast, width=width, verify="fast", max_new_tokens=n, **kw))
    if "old_exact" in runs:  # every step through one width-q program of XLA's contractions (before issue 42)
        if not isinstance(width, int):
            raise app.UsageError("--runs old_exact needs a fixed --q: the old exact mode's one program width")
        padding = oracle_for(prompts, ar_exact.results, cfg.vocab_size, wrong_rate=1.0, seed=1,
                             capture_layers=drafter.capture_layers)
        timings["plain_old_exact"] = old_plain = timed(f"plain, old exact (width {width})", lambda n: generate(
            target, prompts, drafter=padding, width=width, verify="fast", max_new_tokens=n, **kw))
        oracle_old = oracle_for(prompts, old_plain.results, cfg.vocab_size, wrong_rate=1 - _ACCEPT.value, seed=1,
                                capture_layers=drafter.capture_layers)
        timings["spec_old_exact"] = timed("spec oracle, old exact", lambda n: generate(
            target, prompts, drafter=oracle_old, width=width, verify="fast", max_new_tokens=n, **kw))
    if "dspark_exact" in runs:
        timings["dspark_exact"] = timed("spec DSpark (random), exact", lambda n: generate(
            target, prompts, drafter=drafter, max_new_tokens=n, **kw))
    if _TEMPERATURE.value > 0:
        timings["spec_lossless"] = timed("spec oracle, lossless", lambda n: generate(
            target, prompts, drafter=oracle, width=width, verify="lossless", max_new_tokens=n, **kw))
    bw = copy_bandwidth(256, 10)
    tokens = sum(len(r.token_ids) for r in ar_exact.results)
    plain = timings.get("plain_fast", ar_exact)
    steps_ar = max(r.steps for r in plain.results)
    roofline_step = step_weight_bytes(target) / bw
    tok_s = {name: tokens / t.best for name, t in timings.items()}
    summary = dict(
        device=jax.devices()[0].device_kind, jax=jax.__version__, config=_CONFIG.value, dtype=_DTYPE.value,
        recipe=_RECIPE.value, kernels=target.kernels, reps=_REPS.value, temperature=_TEMPERATURE.value,
        prompts=len(prompts), max_new_tokens=_MAX_NEW.value, acceptance_target=_ACCEPT.value, q=_WIDTH.value,
        copy_bandwidth_gbs=bw / 1e9, step_weight_mb=step_weight_bytes(target) / 1e6,
        tok_s=tok_s, decode_seconds={name: t.seconds for name, t in timings.items()},
        ms_per_step={name: t.best / max(max(r.steps for r in t.results), 1) * 1e3 for name, t in timings.items()},
        roofline_step_ms=roofline_step * 1e3,
    )
    for name, key in (("spec_exact", "exact_spec_equals_plain"), ("dspark_exact", "dspark_exact_equals_plain")):
        if name in timings:
            summary[key] = same_tokens(timings[name].results, ar_exact.results)
    if "spec_exact" in timings:
        spec = timings["spec_exact"].results
        summary["oracle_matched_per_offered"] = matched_per_offered(spec)
        summary["mean_accepted_tokens_per_step"] = sum(r.matched + r.steps for r in spec) / sum(r.steps for r in spec)
    if "plain_fast" in timings:
        summary["fast_plain_vs_exact_plain_mismatch"] = mismatch_rate(timings["plain_fast"].results, ar_exact.results)
        summary["plain_fast_step_ms"] = plain.best / steps_ar * 1e3
        summary["plain_exact_over_plain_fast_step"] = (summary["ms_per_step"]["plain_exact"]
                                                       / summary["ms_per_step"]["plain_fast"])
        summary["plain_fast_roofline_fraction"] = summary["roofline_step_ms"] / summary["plain_fast_step_ms"]
        for name in ("spec_exact", "spec_fast"):
            if name in tok_s:
                summary[f"{name}_over_plain_fast"] = tok_s[name] / tok_s["plain_fast"]
    if "spec_fast" in timings and "plain_fast" in timings:
        summary["fast_spec_vs_fast_plain_mismatch"] = mismatch_rate(timings["spec_fast"].results,
                                                                    timings["plain_fast"].results)
    if "spec_lossless" in timings:
        # The oracle's candidates carry a point-mass q: lossless accepts each with the target's probability of it.
        summary["lossless_matched_per_offered"] = matched_per_offered(timings["spec_lossless"].results)
    if "spec_old_exact" in timings:
        summary["old_exact_spec_equals_old_plain"] = same_tokens(timings["spec_old_exact"].results,
                                                                 timings["plain_old_exact"].results)
        if "spec_exact" in tok_s:
            summary["spec_exact_over_spec_old_exact"] = tok_s["spec_exact"] / tok_s["spec_old_exact"]
    print(json.dumps(summary, indent=1))
    if _OUTPUT.value:
        with open(_OUTPUT.value, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    app.run(main)
