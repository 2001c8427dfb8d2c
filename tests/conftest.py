"""Test session setup: fast XLA compiles on CPU, opt-in markers, freeing compiled programs (per module and near
the kernel's map limit), shared tiny-pair fixtures and the kernel tests' device fixtures."""

from __future__ import annotations

import functools
import gc
import os

# The tiny-model tests are bound by XLA compile time, not run time; LLVM -O0 compiles ~2.5x faster.
# Exactness tests compare programs compiled with the same flags, so this changes no assertion.
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")
# pytest-xdist workers (pyproject's addopts) share one GPU where there is one: each takes memory as it needs it,
# not JAX's default 75 % up front, which would leave the second worker none.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import pytest  # noqa: E402

from dsparkjax import kernels  # noqa: E402
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


def _map_room() -> int | None:
    """How many more memory mappings the kernel allows this process (Linux: vm.max_map_count minus the
    mappings now in /proc/self/maps); None where that cannot be read."""
    try:
        with open("/proc/sys/vm/max_map_count") as limit, open("/proc/self/maps", "rb") as maps:
            return int(limit.read()) - sum(1 for _ in maps)
    except OSError:
        return None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    """Drop every compiled program after the last test of a module, and after any test that left the process
    within `MAP_HEADROOM` mappings of the kernel's limit.

    Each XLA CPU executable keeps its own memory mappings. Holding every program the suite compiles ran the
    process towards vm.max_map_count (65530) until XLA's CPU compiler crashed (SIGSEGV/SIGABRT) late in the
    suite, so each module's programs are freed when it ends (this also bounds memory); and exact mode compiles
    one program per width, enough within one module (test_spec.py) to crash it mid-module, hence the check
    after every test. It runs after the test's own teardown, so module-scoped fixtures have already let go of
    the programs they held. Under pytest-xdist each worker runs whole modules (`--dist loadfile`) and frees its own.
    """
    try:
        return (yield)
    finally:
        module_ends = nextitem is None or nextitem.getparent(pytest.Module) is not item.getparent(pytest.Module)
        room = _map_room()
        if module_ends or (room is not None and room < MAP_HEADROOM):
            _clear_compiled_programs()


def is_program_cache(obj: object) -> bool:
    """An lru_cache'd builder that may hold compiled programs or models: the package's compiled steps and the
    tests' model helpers (`model_helpers`, `hf_reference`, and those defined in test modules)."""
    return type(obj) is functools._lru_cache_wrapper and getattr(obj, "__module__", "").startswith(
        ("dsparkjax", "test_", "model_helpers", "hf_reference"))


def _clear_compiled_programs() -> None:
    """Clear JAX's caches, every `is_program_cache` and the module-level AotFunctions (which outlive the caches:
    they would not compile again), then collect what they held."""
    jax.clear_caches()
    for obj in gc.get_objects():
        if is_program_cache(obj):
            obj.cache_clear()
        elif isinstance(obj, AotFunction):
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


@pytest.fixture
def cpu_device() -> jax.Device:
    """The CPU, whose plugin must be loaded (it also serves GPU tests' CPU-side oracles)."""
    if not kernels.ffi.available("cpu"):
        pytest.fail(f"CPU plugin not loaded: {kernels.ffi._STATUS['cpu']}")
    return jax.devices("cpu")[0]


@pytest.fixture
def gpu_device() -> jax.Device:
    """The GPU, whose plugin must be loaded; the test is skipped where either is missing."""
    try:
        dev = jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("no GPU visible to JAX")
    if not kernels.ffi.available("gpu"):
        pytest.skip(f"CUDA plugin not loaded: {kernels.ffi._STATUS['gpu']}")
    return dev


@pytest.fixture(params=["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def device(request) -> jax.Device:
    """Each device in turn: the CPU, and the GPU under the `gpu` marker."""
    return request.getfixturevalue(f"{request.param}_device")
