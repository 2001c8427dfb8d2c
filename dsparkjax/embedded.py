"""The embedded default pair: a small trained DS4 target and its DSpark drafter, shipped in `dsparkjax/data/`.

Both were produced by `scripts/train_tiny.py` (provenance, losses and acceptance in `docs/training.md`): the
target reads and writes Python (trained on the standard library's `.py` files, a 512-token byte-level BPE in
its metadata), the drafter proposes 5 tokens per step with the Markov and confidence heads.

This module only names the files, so importing it loads nothing heavy; `dsparkjax.pair.load_pair` loads "the
given pair, or the embedded one".
"""

from __future__ import annotations

import os

from dsparkjax.errors import DsparkError

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


def embedded_pair() -> tuple[str, str]:
    """Paths of the shipped `target.gguf` and `draft.gguf`."""
    paths = os.path.join(DATA_DIR, "target.gguf"), os.path.join(DATA_DIR, "draft.gguf")
    missing = [p for p in paths if not os.path.exists(p)]
    if missing:
        raise DsparkError(f"the embedded pair is missing ({', '.join(missing)}); reinstall dsparkjax or rebuild it "
                          "with `python scripts/train_tiny.py`")
    return paths
