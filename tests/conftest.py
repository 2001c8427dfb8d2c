"""Test session setup: fast XLA compiles on CPU, opt-in markers, and shared tiny-pair fixtures."""

from __future__ import annotations

import functools
import gc
import os

# The tiny-model tests are bound by XLA compile time, not run time; LLVM -O0 compiles ~2.5x faster.
# Exactness tests compare programs compiled with the same flags, so this changes no assertion.
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")

import jax  # noqa: E402
import pytest  # noqa: E402

from dsparkjax.aot import AotFunction  # noqa: E402
from dsparkjax.tiny import tiny_pair, write_tiny_pair  # noqa: E402


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="also run tests marked slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow: opt in with --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


MAP_HEADROOM = 30000  # memory mappings a test may add before the next would risk vm.max_map_count


def _map_count() -> int:
    """The process's memory mappings (Linux), else 0."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:
        return 0


@pytest.fixture(autouse=True)
def _release_compiled_programs_near_the_map_limit():
    """Drop every compiled program after a test that left the process within `MAP_HEADROOM` mappings of the
    kernel's limit: exact mode compiles one program per width, and one module (test_spec.py) compiled enough
    of them to crash XLA's CPU compiler mid-module (SIGSEGV at 65530 mappings)."""
    yield
    try:
        with open("/proc/sys/vm/max_map_count") as limit:
            room = int(limit.read()) - _map_count()
    except OSError:
        return
    if room < MAP_HEADROOM:
        _clear_compiled_programs()


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop every compiled program when a test module ends.

    Each XLA CPU executable keeps its own memory mappings; the whole suite compiles thousands of programs, and
    holding them all ran the process towards the kernel's map limit (vm.max_map_count, 65530) until XLA's CPU
    compiler crashed (SIGSEGV/SIGABRT) late in the suite. Programs are cached by JAX and by lru_cache'd builders
    (the package's compiled steps, the tests' model helpers), so both are cleared.
    """
    yield
    _clear_compiled_programs()


def _clear_compiled_programs() -> None:
    jax.clear_caches()
    for obj in gc.get_objects():
        if type(obj) is functools._lru_cache_wrapper and getattr(obj, "__module__", "").startswith(
                ("dsparkjax", "test_", "model_helpers", "hf_reference")):
            obj.cache_clear()
        elif isinstance(obj, AotFunction):  # module-level ones outlive the caches: they would not compile again
            obj.clear()
    gc.collect()


@pytest.fixture(scope="session")
def tiny_params():
    """(target_cfg, target_params, drafter_cfg, drafter_params) of `tiny_pair(0)`."""
    return tiny_pair(0)


@pytest.fixture(scope="session")
def tiny_files(tmp_path_factory) -> tuple[str, str]:
    """(target.gguf, draft.gguf) written by `write_tiny_pair(seed=0)` (f32, default tokenizer)."""
    return write_tiny_pair(str(tmp_path_factory.mktemp("tiny_f32")), seed=0)
