"""Train the small shipped pair: a DS4 target on the standard library's Python, then its DSpark drafter.

    python scripts/train_tiny.py                      # writes dsparkjax/data/{target,draft}.gguf, docs/training_*
    python scripts/train_tiny.py --target_steps 50 --drafter_steps 20 --out /tmp/pair   # a quick smoke run

Steps: a 512-token byte-level BPE trained on the corpus's training files; the target (every layer kind, hash
and top-k MoE, hc_mult 4) trained on random windows of them; greedy continuations of training prompts by the
frozen target, with its logits and captured features; the drafter trained on those with DeepSpec's objective
(`dsparkjax/training/drafter.py`); both written through the GGUF writer (target in `--target_recipe` with the
tokenizer, drafter with lucebox's ROCmFP4 experts and F16 dense tensors); the width policy's thresholds
fitted on the written pair (`dsparkjax/training/calibration.py`) and stored in the drafter GGUF; the loss
curves as a PNG and a JSON summary of the run (flags, device, corpus, losses, thresholds, times). Needs the
`train` extra (optax, matplotlib).

The same command runs on a GPU (JAX picks the device; nothing here is CPU-only). `--target_seconds` and
`--drafter_seconds` bound each model's training loop by wall-clock time: the warm-up steps are timed and the
step count is cut to fit (`dsparkjax/training/loop.py`), so a run fits a device budget whatever the speed.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging

from dsparkjax import runtime
from dsparkjax.decoding.proposer import load_drafter
from dsparkjax.ggufio.contract import drafter_tensor_specs, target_tensor_specs
from dsparkjax.ggufio.writer import write_model_gguf
from dsparkjax.model.drafter import DrafterModel
from dsparkjax.model.target import StepOptions
from dsparkjax.target_api import load_target
from dsparkjax.tokenizer import build_tiny_tokenizer
from dsparkjax.training import calibration, configs, corpus, drafter, loop, target
from dsparkjax.training.params import initial_params, to_numpy

_OUT = flags.DEFINE_string("out", "dsparkjax/data", "Directory for target.gguf and draft.gguf.")
_DOCS = flags.DEFINE_string("docs", "docs", "Directory for training_loss.png and training_run.json.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the initial weights and of every sampled batch.")
_TARGET_STEPS = flags.DEFINE_integer("target_steps", 400, "Target optimizer steps.")
_BATCH = flags.DEFINE_integer("batch", 16, "Target windows per step.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 128, "Target window length (tokens).")
_LR = flags.DEFINE_float("lr", 3e-3, "Peak learning rate of the target.")
_DRAFT_SEQS = flags.DEFINE_integer("draft_sequences", 384, "Greedy continuations made for the drafter.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 32, "Prompt tokens of each continuation.")
_GEN = flags.DEFINE_integer("gen_tokens", 96, "Greedy tokens per continuation.")
_DRAFT_STEPS = flags.DEFINE_integer("drafter_steps", 300, "Drafter optimizer steps.")
_DRAFT_BATCH = flags.DEFINE_integer("drafter_batch", 8, "Sequences per drafter step.")
_ANCHORS = flags.DEFINE_integer("anchors", 16, "Anchor positions per sequence per drafter step.")
_DRAFT_LR = flags.DEFINE_float("drafter_lr", 3e-3, "Peak learning rate of the drafter.")
_GAMMA = flags.DEFINE_float("gamma", 2.0, "Decay of the drafter's per-slot loss weights exp(-i/gamma).")
_HIDDEN = flags.DEFINE_integer("hidden", 64, "Target (and drafter) hidden size.")
_EXPERT_FFN = flags.DEFINE_integer("expert_ffn", 64, "Routed and shared experts' intermediate size.")
_WINDOW = flags.DEFINE_integer("window", 32, "Sliding window of the target and the drafter.")
_TARGET_SECONDS = flags.DEFINE_float("target_seconds", None, "Wall-clock budget of the target's training loop "
                                     "(--target_steps is then the most).")
_DRAFT_SECONDS = flags.DEFINE_float("drafter_seconds", None, "Wall-clock budget of the drafter's training loop "
                                    "(--drafter_steps is then the most).")
_TARGET_RECIPE = flags.DEFINE_enum("target_recipe", "f32", ["f32", "f16"], "How the target GGUF stores its weights.")


def plot(histories: dict[str, loop.History], path: str) -> None:
    """Train and held-out loss curves of each model, one panel each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(histories), figsize=(6 * len(histories), 4))
    for ax, (name, h) in zip(np.atleast_1d(axes), histories.items()):
        ax.plot(*zip(*h.train), label="train")
        ax.plot(*zip(*h.held_out), "o-", label="held out")
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats/token)" if name == "target" else "DSpark loss")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def fit_width_thresholds(target_path: str, draft_path: str) -> dict:
    """Fit the width policy's thresholds on the written pair as `scripts/calibrate.py` does with its defaults,
    and store them in the drafter GGUF; returns them with the head's per-slot AUC of prefix survival."""
    target = load_target(target_path)
    drafter = load_drafter(draft_path, target)
    prompts = corpus.held_out_prompts(target.tokenizer, calibration.PROMPTS, calibration.PROMPT_LEN,
                                      calibration.PROMPT_SEED)
    proposals = calibration.proposals_on(target, drafter, prompts, calibration.NEW_TOKENS)
    thresholds = calibration.fit_thresholds(proposals, calibration.BREAK_EVEN)
    calibration.write_thresholds(draft_path, thresholds)
    aucs = [calibration.auc(proposals.predicted[:, k], proposals.survived[:, k]) for k in range(drafter.block_size)]
    return dict(thresholds=list(thresholds), break_even=calibration.BREAK_EVEN, positions=int(len(proposals.matches)),
                prefix_auc=aucs)


def main(argv: list[str]) -> None:
    del argv
    logging.set_verbosity(logging.WARNING)
    runtime.configure()  # before JAX starts: the GPU memory share, the compilation cache
    started = time.perf_counter()
    rng = np.random.default_rng(_SEED.value)
    split = corpus.split_files(corpus.stdlib_files())
    tokenizer = build_tiny_tokenizer(configs.VOCAB, (corpus.read_text(f) for f in split.train), reserved=1)
    train_stream = corpus.token_stream(tokenizer, split.train)
    held_stream = corpus.token_stream(tokenizer, split.held_out)
    print(f"corpus: {len(split.train)} training files ({len(train_stream)} tokens), {len(split.held_out)} held out "
          f"({len(held_stream)} tokens)")

    t_cfg = configs.trained_target(_HIDDEN.value, _EXPERT_FFN.value, _WINDOW.value)
    d_cfg = configs.trained_drafter(t_cfg, _WINDOW.value)
    options = StepOptions(simulate_qat=True, capture_layers=d_cfg.capture_layer_ids)
    t_params, hash_tables = initial_params(target_tensor_specs(t_cfg), _SEED.value, t_cfg.hc_mult,
                                           t_cfg.n_routed_experts)
    length = _SEQ_LEN.value + 1
    t_loss = functools.partial(target.next_token_loss, frozen=hash_tables, cfg=t_cfg, options=options)
    t_params, t_hist = loop.train(
        t_params, t_loss, lambda _: jnp.asarray(corpus.sample_windows(train_stream, rng, _BATCH.value, length)),
        jnp.asarray(corpus.sample_windows(held_stream, np.random.default_rng(1), _BATCH.value, length)),
        loop.Schedule(_TARGET_STEPS.value, _LR.value, _TARGET_SECONDS.value), "target")

    frozen = target.target_params(t_params, hash_tables, t_cfg)

    def feature_set(stream: np.ndarray, count: int, seed: int) -> drafter.FeatureSet:
        prompts = corpus.sample_windows(stream, np.random.default_rng(seed), count, _PROMPT_LEN.value)
        sequences = drafter.greedy_continuations(frozen, t_cfg, options, prompts, _GEN.value)
        return drafter.capture(frozen, t_cfg, options, sequences)

    train_set = feature_set(train_stream, _DRAFT_SEQS.value, _SEED.value + 2)
    held_set = feature_set(held_stream, _DRAFT_BATCH.value, 3)
    sample = functools.partial(drafter.sample_batch, anchors=_ANCHORS.value, block=d_cfg.block_size,
                               first_anchor=_PROMPT_LEN.value // 2)
    held_batch = jax.tree.map(jnp.asarray, sample(held_set, np.random.default_rng(4), _DRAFT_BATCH.value))
    d_params, _ = initial_params(drafter_tensor_specs(d_cfg), _SEED.value + 1, d_cfg.hc_mult, d_cfg.n_routed_experts)
    d_loss = functools.partial(drafter.dspark_loss, model=DrafterModel(d_cfg, options.simulate_qat),
                               embed=frozen.embed, head=frozen.head, gamma=_GAMMA.value)
    d_params, d_hist = loop.train(
        d_params, d_loss, lambda _: jax.tree.map(jnp.asarray, sample(train_set, rng, _DRAFT_BATCH.value)),
        held_batch, loop.Schedule(_DRAFT_STEPS.value, _DRAFT_LR.value, _DRAFT_SECONDS.value), "drafter")

    os.makedirs(_OUT.value, exist_ok=True)
    os.makedirs(_DOCS.value, exist_ok=True)
    target_path, draft_path = os.path.join(_OUT.value, "target.gguf"), os.path.join(_OUT.value, "draft.gguf")
    write_model_gguf(target_path, t_cfg, {**to_numpy(t_params), **hash_tables}, recipe=_TARGET_RECIPE.value,
                     tokenizer=tokenizer,
                     name="dsparkjax trained tiny target (scripts/train_tiny.py)")
    write_model_gguf(draft_path, d_cfg, to_numpy(d_params), recipe="rocmfpx",
                     name="dsparkjax trained tiny DSpark drafter (scripts/train_tiny.py)")
    fit = fit_width_thresholds(target_path, draft_path)
    plot({"target": t_hist, "drafter": d_hist}, os.path.join(_DOCS.value, "training_loss.png"))
    summary = dict(
        command=" ".join(["python", "scripts/train_tiny.py", *sys.argv[1:]]),
        flags={f.name: f.value for f in flags.FLAGS.get_key_flags_for_module(sys.argv[0])},
        python=platform.python_version(), jax=jax.__version__, device=jax.devices()[0].device_kind, corpus=dict(
            root=os.path.dirname(split.train[0]) if split.train else "", train_files=len(split.train),
            held_out_files=len(split.held_out), train_tokens=int(len(train_stream)),
            held_out_tokens=int(len(held_stream)), held_out_every=corpus.HELD_OUT_EVERY),
        target=dict(steps=t_hist.steps, seconds=round(t_hist.seconds, 1), final_train=t_hist.train[-1][1],
                    final_held_out=t_hist.held_out[-1][1], bytes=os.path.getsize(target_path)),
        drafter=dict(steps=d_hist.steps, seconds=round(d_hist.seconds, 1), final_train=d_hist.train[-1][1],
                     final_held_out=d_hist.held_out[-1][1], last_batch_terms=d_hist.last_terms,
                     bytes=os.path.getsize(draft_path)),
        width=fit,
        total_seconds=round(time.perf_counter() - started, 1))
    with open(os.path.join(_DOCS.value, "training_run.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    app.run(main)
