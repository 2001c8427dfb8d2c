"""The training corpus: the `.py` files of the running Python's standard library, tokenized.

Files come from `sysconfig.get_paths()["stdlib"]` in sorted order, without `site-packages`, the test suites,
IDLE and lib2to3 (which vendor large data-like files). Every `HELD_OUT_EVERY`-th file is held out for the
evaluation loss and the acceptance prompts, so the split is deterministic for a given Python.
"""

from __future__ import annotations

import dataclasses
import os
import sysconfig

import numpy as np

from dsparkjax.errors import ArgumentError
from dsparkjax.tokenizer import Tokenizer

HELD_OUT_EVERY = 20
_SKIPPED_DIRS = frozenset({"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"})


def stdlib_files(root: str | None = None) -> list[str]:
    """The standard library's `.py` files (paths), in a deterministic order."""
    root = root or sysconfig.get_paths()["stdlib"]
    files: list[str] = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in _SKIPPED_DIRS)
        files += [os.path.join(directory, n) for n in sorted(names) if n.endswith(".py")]
    if not files:
        raise FileNotFoundError(f"no .py files under the standard library directory {root}")
    return files


def read_text(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


@dataclasses.dataclass(frozen=True)
class Split:
    """The files of the training and held-out parts (paths)."""

    train: list[str]
    held_out: list[str]


def split_files(files: list[str]) -> Split:
    return Split([f for i, f in enumerate(files) if i % HELD_OUT_EVERY],
                 [f for i, f in enumerate(files) if i % HELD_OUT_EVERY == 0])


def token_stream(tokenizer: Tokenizer, files: list[str]) -> np.ndarray:
    """All files tokenized and concatenated, each starting with BOS: int32 `[N]`."""
    parts = [np.asarray(tokenizer.encode(read_text(f), add_bos=True), np.int32) for f in files]
    return np.concatenate(parts)


def sample_windows(stream: np.ndarray, rng: np.random.Generator, batch: int, length: int) -> np.ndarray:
    """`batch` random windows of `length` tokens of the stream: int32 `[batch, length]`."""
    starts = rng.integers(0, len(stream) - length, size=batch)
    return np.stack([stream[s : s + length] for s in starts])


def held_out_prompts(tokenizer: Tokenizer, count: int, length: int, seed: int,
                     root: str | None = None) -> list[list[int]]:
    """`count` prompts of `length` tokens from random places of the held-out files (acceptance, calibration).

    `root`: every `.py` file under that directory instead. The split is per Python, so on another Python than
    the pair's training one most "held-out" files were training files; `root` names text known to be unseen
    (e.g. a module the training Python no longer has).
    """
    if root is not None and not os.path.isdir(root):
        raise ArgumentError(f"root must be a directory of .py files, got {root!r}")
    files = stdlib_files(root) if root is not None else split_files(stdlib_files()).held_out
    stream = token_stream(tokenizer, files)
    return sample_windows(stream, np.random.default_rng(seed), count, length).tolist()
