"""Test session setup: fast XLA compiles on CPU, opt-in markers, and shared tiny-pair fixtures."""

from __future__ import annotations

import os

# The tiny-model tests are bound by XLA compile time, not run time; LLVM -O0 compiles ~2.5x faster.
# Exactness tests compare programs compiled with the same flags, so this changes no assertion.
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")

import pytest  # noqa: E402

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


@pytest.fixture(scope="session")
def tiny_params():
    """(target_cfg, target_params, drafter_cfg, drafter_params) of `tiny_pair(0)`."""
    return tiny_pair(0)


@pytest.fixture(scope="session")
def tiny_files(tmp_path_factory) -> tuple[str, str]:
    """(target.gguf, draft.gguf) written by `write_tiny_pair(seed=0)` (f32, default tokenizer)."""
    return write_tiny_pair(str(tmp_path_factory.mktemp("tiny_f32")), seed=0)
