"""`load_pair`: "the given target and drafter, or the embedded pair", as the scripts and the server load them.

Kept apart from `dsparkjax.embedded` (which only names the shipped files) because loading imports the target
and drafter loaders, and with them JAX and the model.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from dsparkjax.decoding.proposer import Drafter, load_drafter
from dsparkjax.embedded import embedded_pair
from dsparkjax.errors import ArgumentError
from dsparkjax.target_api import Target, load_target


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
