"""The exported-program cache (`dsparkjax.exported`): a warm start neither traces nor lowers a cached program,
computes the same bits as plain jit, keeps donation, and recovers from a bad entry."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.compilation_cache import compilation_cache

from dsparkjax import exported
from dsparkjax.aot import AotFunction
from dsparkjax.decoding import program, proposer
from dsparkjax.decoding.decoder import Decoder

from model_helpers import fresh_state, tiny_pair_model

REPO = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def compilation_cache_at(folder: Path | None) -> Iterator[Path | None]:
    """JAX's persistent compilation cache in `folder` (None: off) for the block; yields the exported directory."""
    previous = jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_compilation_cache_dir", None if folder is None else str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # every program, however fast to compile
    compilation_cache.reset_cache()
    try:
        yield None if folder is None else folder / exported.SUBDIR
    finally:
        jax.config.update("jax_compilation_cache_dir", previous[0])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", previous[1])
        compilation_cache.reset_cache()


def entries(folder: Path) -> list[Path]:
    return sorted(folder.glob("*" + exported.SUFFIX)) if folder.is_dir() else []


def compiled(folder: Path) -> set[Path]:
    """The compilation cache's entries in `folder`."""
    return {p for p in folder.iterdir() if p.is_file()}


class Counted:
    """`x * scale + offset` with static `scale` (by name) that counts its traces."""

    def __init__(self) -> None:
        self.traces = 0

    def __call__(self, x: jax.Array, offset: jax.Array, *, scale: int) -> dict[str, jax.Array]:
        self.traces += 1
        return {"y": x * scale + offset, "n": jnp.sum(x)}

    def program(self, name: str = "counted") -> AotFunction:
        """A fresh AotFunction of it (its own jit: nothing in memory from an earlier one)."""
        return AotFunction(self, static_argnames=("scale",), donate_argnums=(1,), cache_name=name)


def assert_same_bits(a: object, b: object) -> None:
    left, right = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(left) == len(right)
    for x, y in zip(left, right):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_the_cache_is_on_exactly_with_the_compilation_cache(tmp_path):
    """Without a persistent compilation cache every fresh program traces its function and nothing is written."""
    fn = Counted()
    with compilation_cache_at(None):
        assert exported.directory() is None
        for _ in range(2):
            out = fn.program()(jnp.arange(4.0), jnp.ones(4), scale=3)
    assert fn.traces == 2 and not any(tmp_path.iterdir())
    np.testing.assert_array_equal(np.asarray(out["y"]), np.arange(4.0) * 3 + 1)
    with compilation_cache_at(tmp_path) as folder:
        assert exported.directory() == str(folder)


def test_a_warm_program_loads_its_entry_without_tracing(tmp_path):
    fn = Counted()
    x = jnp.arange(4.0)
    with compilation_cache_at(tmp_path) as folder:
        cold = fn.program()(x, jnp.ones(4), scale=3)
        warm_program = fn.program()
        offset = jnp.ones(4)
        warm = warm_program(x, offset, scale=3)
        assert fn.traces == 1 and len(entries(folder)) == 1
        assert offset.is_deleted()  # still donated
        warm_program.compile(jax.ShapeDtypeStruct((4,), jnp.float32), jax.ShapeDtypeStruct((4,), jnp.float32),
                             scale=3)
    assert fn.traces == 1
    assert_same_bits(cold, warm)
    np.testing.assert_array_equal(np.asarray(warm["y"]), np.arange(4.0) * 3 + 1)


def test_the_key_changes_with_statics_types_and_name(tmp_path):
    fn = Counted()
    x = jnp.arange(4.0)
    with compilation_cache_at(tmp_path) as folder:
        calls = [(x, 3, "counted"), (x, 2, "counted"), (x[:3], 2, "counted"), (x.astype(jnp.bfloat16), 2, "counted"),
                 (x, 2, "other")]
        for i, (value, scale, name) in enumerate(calls):
            fn.program(name)(value, jnp.ones(value.shape[0]), scale=scale)
            assert fn.traces == i + 1 and len(entries(folder)) == i + 1
        for value, scale, name in calls:  # each one again, from its own entry
            out = fn.program(name)(value, jnp.ones(value.shape[0]), scale=scale)
            np.testing.assert_array_equal(np.asarray(out["y"]), np.asarray(value * scale + 1))
    assert fn.traces == len(calls)


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_a_damaged_entry_is_exported_again_with_a_warning(tmp_path, caplog, damage):
    fn = Counted()
    x = jnp.arange(4.0)
    with compilation_cache_at(tmp_path) as folder:
        fn.program()(x, jnp.ones(4), scale=3)
        (entry,) = entries(folder)
        data = entry.read_bytes()
        entry.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\0" * len(data))
        with caplog.at_level(logging.WARNING):
            out = fn.program()(x, jnp.ones(4), scale=3)
        assert str(entry) in caplog.text and fn.traces == 2
        fn.program()(x, jnp.ones(4), scale=3)  # the entry written again is whole
    assert fn.traces == 2 and entry.read_bytes() == data
    np.testing.assert_array_equal(np.asarray(out["y"]), np.arange(4.0) * 3 + 1)


@pytest.mark.parametrize("gone", ["entry", "directory"])
def test_an_entry_another_process_evicted_is_a_plain_miss(tmp_path, caplog, gone):
    """A cache sweep in another process (`dsparkjax.cache_bound`) may delete an entry, or the whole directory,
    under this one: the next program traces and writes it again, with nothing to warn about."""
    fn = Counted()
    x = jnp.arange(4.0)
    with compilation_cache_at(tmp_path) as folder:
        fn.program()(x, jnp.ones(4), scale=3)
        (entry,) = entries(folder)
        if gone == "entry":
            entry.unlink()
        else:
            shutil.rmtree(tmp_path)
        with caplog.at_level(logging.WARNING):
            out = fn.program()(x, jnp.ones(4), scale=3)
        assert not caplog.text and fn.traces == 2 and entries(folder) == [entry]
    np.testing.assert_array_equal(np.asarray(out["y"]), np.arange(4.0) * 3 + 1)


def test_a_program_export_refuses_runs_as_plain_jit(tmp_path, caplog):
    def doubled(x: jax.Array) -> jax.Array:  # a host callback: jax.export cannot serialize it
        return jax.pure_callback(lambda a: np.asarray(a) * 2, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

    with compilation_cache_at(tmp_path) as folder, caplog.at_level(logging.WARNING):
        out = AotFunction(doubled, cache_name="doubled")(jnp.arange(3.0))
    assert "cannot export" in caplog.text and not entries(folder)
    np.testing.assert_array_equal(np.asarray(out), [0.0, 2.0, 4.0])


def _fresh_programs() -> None:
    """Drop the cached program factories, so the next programs are traced (through the cache, if on) again."""
    for factory in (program.prefill_program, program.decode_program, program.step_program, proposer._compiled):
        factory.cache_clear()


def _speculative_run(target, drafter) -> tuple[object, ...]:
    """A prefill and two speculative steps of the tiny pair: what they return and whether each donated its
    loop state."""
    decoder = Decoder.for_prompts(target, drafter, speculative=True, lengths=[3, 1], max_new_tokens=8, verify="exact",
                                  width=3, prefill_chunk=3, sample=False)
    before = decoder.init()
    loop, first = decoder.prefill(before, {0: np.array([1, 2, 3]), 1: np.array([4])})
    donated = [all(leaf.is_deleted() for leaf in jax.tree.leaves(before.state))]
    outcomes = []
    for _ in range(2):
        stepped, outcome, widths = decoder.step(loop, np.array([True, True]), np.array([16, 16]))
        donated.append(all(leaf.is_deleted() for leaf in jax.tree.leaves(loop.state)))
        outcomes.append((outcome, widths))
        loop = stepped
    return loop, first, outcomes, donated


def test_decoding_programs_give_the_same_bits_through_the_cache(tmp_path):
    """Prefill, decode, absorb and propose: plain jit, a cold start (exporting) and a warm one (loading) give the
    same bits, and the loop state stays donated; the bare step likewise. The warm start compiles nothing: its
    modules are the cold start's, so the persistent compilation cache has them."""
    target, drafter = tiny_pair_model()
    tokens = jnp.asarray([[5, 7, 9], [11, 13, 17]], jnp.int32)
    runs, steps, written = [], [], []
    for folder in (None, tmp_path, tmp_path):
        _fresh_programs()
        before = compiled(tmp_path)
        with compilation_cache_at(folder):
            runs.append(_speculative_run(target, drafter))
            step = program.step_program(target.config, target.options())
            state = fresh_state(target, 2)
            steps.append(step(target.params, state, tokens))
            assert all(leaf.is_deleted() for leaf in jax.tree.leaves(state))
        written.append(len(compiled(tmp_path) - before))
    _fresh_programs()
    assert written[1] >= 5 and written[2] == 0  # the warm start compiled the cold start's modules
    # prefill, decode and absorb (at the chunk's width, the step's), propose, step
    assert len(entries(tmp_path / exported.SUBDIR)) == 5
    for run in runs:
        assert all(run[3])
    for other in runs[1:]:
        assert_same_bits(runs[0][:3], other[:3])
    for other in steps[1:]:
        assert_same_bits(steps[0], other)


def test_a_second_process_loads_the_exported_step_and_its_executable(tmp_path):
    """scripts/startup_compile.py twice on one cache: the second start loads the exported step and its executable
    (writes nothing); the first wrote both."""
    env = {**os.environ, "DSPARKJAX_CACHE": str(tmp_path / "cache"), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    runs = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, str(REPO / "scripts" / "startup_compile.py"), "--config=tiny",
                               "--layers=2"], capture_output=True, text=True, timeout=300, check=False, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    assert cold["exported_written"] == 1 and cold["compiled_written"] >= 1
    assert warm["exported_written"] == 0 and warm["compiled_written"] == 0


@pytest.mark.parametrize("cached", [False, True])
def test_a_program_takes_its_own_outputs_without_compiling_again(tmp_path, cached):
    """`AotFunction.compile`, then calls on fresh arrays and on the program's own outputs (what a decode loop
    feeds back): no call compiles, with the compilation cache off and on. Through the exported path (cache on)
    the outputs are committed to the device, which jit keyed as another signature: every program compiled again
    at its first call on its own outputs, so generate compiled after its clock started."""
    compiles = []

    def on_event(event: str, duration: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    with compilation_cache_at(tmp_path if cached else None):
        fn = Counted().program(f"own outputs {cached}")
        shape = jax.ShapeDtypeStruct((8,), jnp.float32)
        fn.compile(shape, shape, scale=3)
        x, offsets = jnp.ones(8), [jnp.full(8, i, jnp.float32) for i in range(2)]  # offsets are donated
        jax.monitoring.register_event_duration_secs_listener(on_event)
        try:
            out = fn(x, offsets[0], scale=3)
            fn(out["y"], offsets[1], scale=3)
        finally:
            jax.monitoring.unregister_event_duration_listener(on_event)
    assert compiles == []
