"""The training loop's schedule and wall-clock budget, and the f16 recipe the trained target may be written in."""

from __future__ import annotations

import time

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dsparkjax.config import tiny_target
from dsparkjax.errors import ArgumentError
from dsparkjax.decoding.forward import forward
from dsparkjax.formats import GGMLType
from dsparkjax.ggufio.contract import target_tensor_specs
from dsparkjax.ggufio.reader import GGUFFile
from dsparkjax.target_api import load_target
from dsparkjax.tiny import write_tiny_pair
from dsparkjax.tokenizer import build_tiny_tokenizer
from dsparkjax.training import loop
from dsparkjax.training.corpus import held_out_prompts, token_stream


def test_learning_rate_is_optax_warmup_cosine():
    s = loop.Schedule(steps=300, learning_rate=3e-3, warmup=50)
    reference = optax.warmup_cosine_decay_schedule(0.0, 3e-3, 50, 300, 3e-3 * 0.05)
    for step in (0, 1, 25, 49, 50, 51, 120, 299, 300):
        assert loop.learning_rate(s, step, 300) == pytest.approx(float(reference(step)), rel=1e-5, abs=1e-9)


def test_fitted_steps_fill_the_budget_and_respect_the_cap():
    s = loop.Schedule(steps=1000, learning_rate=1e-3, seconds=100.0)
    assert loop.fitted_steps(s, 10, 10.0, 0.5) == 10 + int(0.9 * 90 / 0.5)
    assert loop.fitted_steps(s, 10, 10.0, 0.001) == 1000
    assert loop.fitted_steps(s, 10, 200.0, 0.5) == 11  # over budget already: stop after this step


def _quadratic(params, batch):
    value = jnp.sum((params["w"] - batch) ** 2)
    return value, {"sq": value}


def test_train_minimises_and_stops_at_its_budget():
    params = {"w": jnp.zeros(4)}
    target = jnp.arange(4.0)
    trained, history = loop.train(params, _quadratic, lambda step: target, target,
                                  loop.Schedule(steps=200, learning_rate=0.1, warmup=10), "quadratic")
    assert history.steps == 200 and history.held_out[-1][1] < 0.05 * history.held_out[0][1]

    def slow(step):
        time.sleep(0.02)
        return target

    _, budgeted = loop.train(params, _quadratic, slow, target,
                             loop.Schedule(steps=100_000, learning_rate=0.1, warmup=10, seconds=3.0), "budget")
    # At >= 20 ms a step, 1000 steps would take 20 s: the loop stopped near its budget (compiling included).
    assert 6 <= budgeted.steps < 1000 and budgeted.seconds < 10.0
    assert budgeted.train[-1][0] == budgeted.steps - 1


def test_f16_recipe_halves_the_target_and_keeps_its_logits(tmp_path):
    cfg = tiny_target()
    f32_path, _ = write_tiny_pair(str(tmp_path / "f32"), recipe="f32", target_cfg=cfg)
    f16_path, _ = write_tiny_pair(str(tmp_path / "f16"), recipe="f16", target_cfg=cfg)
    stored = {name: info.ggml_type for name, info in GGUFFile(f16_path).tensors.items()}
    wanted = {"vector": GGMLType.F32, "hash_table": GGMLType.I32}
    for spec in target_tensor_specs(cfg):
        if spec.name in stored:
            assert stored[spec.name] == wanted.get(spec.family, GGMLType.F16), spec.name
    assert GGUFFile(f16_path).bytes_by_type()["F16"] > 0.4 * sum(GGUFFile(f32_path).bytes_by_type().values())
    tokens = [[1, 5, 9, 13, 2, 7]]
    want = np.asarray(forward(load_target(f32_path), tokens))
    got = np.asarray(forward(load_target(f16_path), tokens))
    np.testing.assert_allclose(got, want, atol=0.05 * np.abs(want).max())


def test_held_out_prompts_from_a_directory_come_from_its_files(tmp_path):
    """`root` draws every window from the .py files under it (text unseen by a pair trained on another Python);
    anything but a directory is an ArgumentError naming it."""
    tokenizer = build_tiny_tokenizer(300)
    (tmp_path / "a.py").write_text("def spam(eggs):\n    return eggs * 2\n" * 20)
    (tmp_path / "notes.txt").write_text("never read\n" * 50)
    stream = token_stream(tokenizer, [str(tmp_path / "a.py")]).tolist()
    prompts = held_out_prompts(tokenizer, 4, 8, seed=0, root=str(tmp_path))
    assert len(prompts) == 4 and all(len(p) == 8 for p in prompts)
    assert all(any(stream[s : s + 8] == p for s in range(len(stream) - 7)) for p in prompts)
    with pytest.raises(ArgumentError, match="root"):
        held_out_prompts(tokenizer, 4, 8, seed=0, root=str(tmp_path / "a.py"))
