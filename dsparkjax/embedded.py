"""The embedded default pair: a small trained DS4 target and its DSpark drafter, shipped in `dsparkjax/data/`.

Both were produced by `scripts/train_tiny.py` (provenance, losses and acceptance in `docs/training.md`): the
target reads and writes Python (trained on the standard library's `.py` files, a 512-token byte-level BPE in
its metadata), the drafter proposes 5 tokens per step with the Markov and confidence heads.

`load_pair` is how the scripts and the server load "the given pair, or the embedded one".
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

from dsparkjax.decoding.proposer import Drafter, load_drafter
from dsparkjax.errors import ArgumentError, DsparkError
from dsparkjax.target_api import Target, load_target

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


def embedded_pair() -> tuple[str, str]:
    """Paths of the shipped `target.gguf` and `draft.gguf`."""
    paths = os.path.join(DATA_DIR, "target.gguf"), os.path.join(DATA_DIR, "draft.gguf")
    missing = [p for p in paths if not os.path.exists(p)]
    if missing:
        raise DsparkError(f"the embedded pair is missing ({', '.join(missing)}); reinstall dsparkjax or rebuild it "
                          "with `python scripts/train_tiny.py`")
    return paths


class Pair(NamedTuple):
    """A loaded target and drafter (None: plain decoding only) with the paths they came from, for reports."""

    target: Target
    drafter: Drafter | None
    target_path: str
    draft_path: str | None


def load_pair(target_path: str | None, draft_path: str | None, *, need_drafter: bool = False,
              progress: bool = False, **target_options: Any) -> Pair:
    """Load the target at `target_path` and the drafter at `draft_path`.

    Without `target_path` the embedded pair loads (a given `draft_path` replaces its drafter). A given target
    without `draft_path` has no drafter: ArgumentError if `need_drafter`, else the Pair's drafter is None.
    `target_options` go to `load_target` (dtype, simulate_qat, kernels, policy); `progress` to both loaders.
    """
    if target_path is None:
        target_path, embedded_draft = embedded_pair()
        draft_path = draft_path or embedded_draft
    elif not draft_path and need_drafter:
        raise ArgumentError(f"draft_path: a drafter GGUF is needed with the target {target_path} (only the "
                            "embedded target comes with one)")
    target = load_target(target_path, progress=progress, **target_options)
    drafter = load_drafter(draft_path, target, progress=progress) if draft_path else None
    return Pair(target, drafter, target_path, draft_path)
