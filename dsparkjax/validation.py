"""Up-front checks of the public API's arguments: a bad one is refused before anything compiles or runs,
with an ArgumentError naming the argument, what it must be and what it was."""

from __future__ import annotations

import math
import numbers
from typing import Any, Sequence

import numpy as np

from dsparkjax.errors import ArgumentError


def token_ids(value: Any, what: str, ndim: int) -> np.ndarray:
    """`value` as an int64 array of `ndim` axes of token ids; strings, floats, ragged rows are refused."""
    if isinstance(value, (str, bytes)):
        raise ArgumentError(f"{what} must be token ids (integers), got a string: tokenize it first "
                            f"(target.tokenizer.encode)")
    try:
        array = np.asarray(value)
    except ValueError:
        raise ArgumentError(f"{what} must be a rectangular array of token ids, got rows of different lengths"
                            ) from None
    if array.dtype == object:
        raise ArgumentError(f"{what} must be a rectangular array of token ids, got ragged or mixed rows")
    if array.size and array.dtype.kind not in "iu":
        kind = "strings" if array.dtype.kind in "US" else f"dtype {array.dtype}"
        raise ArgumentError(f"{what} must hold integer token ids, got {kind}")
    if array.ndim != ndim:
        raise ArgumentError(f"{what} must have {ndim} axes of token ids, got shape {array.shape}")
    return array.astype(np.int64)


def prompt_list(prompts: Any) -> list[np.ndarray]:
    """`generate`'s prompts: a non-empty sequence of non-empty token-id sequences (lengths may differ)."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (Sequence, np.ndarray)):
        raise ArgumentError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
    arrays = [token_ids(p, f"prompt {i}", 1) for i, p in enumerate(prompts)]
    if not arrays or any(a.size == 0 for a in arrays):
        raise ArgumentError("every prompt needs at least one token")
    return arrays


def positive_int(value: Any, name: str) -> int:
    """An integer >= 1 (bools and floats such as 2.5 or 2.0 are refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ArgumentError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def choice(value: Any, name: str, choices: Sequence[Any]) -> Any:
    if value not in choices:
        raise ArgumentError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


def temperature(value: Any) -> float:
    """A finite real >= 0 (0 is greedy)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
        raise ArgumentError(f"temperature must be a finite number >= 0 (0: greedy), got {value!r}")
    return float(value)


PROPOSER_MEMBERS = ("block_size", "capture_layers", "has_confidence", "width_thresholds", "init_state", "precompile",
                    "absorb", "propose", "propose_sampled")


def proposer(drafter: Any) -> None:
    """A drafter must implement the Proposer protocol (a target passed as the drafter does not)."""
    missing = [m for m in PROPOSER_MEMBERS if not hasattr(drafter, m)]
    if missing:
        raise ArgumentError(f"drafter must be a Proposer such as load_drafter(path, target), got "
                            f"{type(drafter).__name__} (it lacks {', '.join(missing)})")


def generate_arguments(target: Any, prompts: Any, drafter: Any, max_new_tokens: Any, verify: Any, mode: Any,
                       temperature_: Any, prefill_chunk: Any) -> tuple[list[np.ndarray], str]:
    """Check `generate`'s arguments; returns (the prompts as int64 arrays, the mode: "spec" or "ar")."""
    arrays = prompt_list(prompts)
    positive_int(max_new_tokens, "max_new_tokens")
    positive_int(prefill_chunk, "prefill_chunk")
    choice(verify, "verify", ("exact", "fast", "lossless"))
    choice(mode, "mode", ("spec", "ar", None))
    temperature(temperature_)
    if drafter is not None:
        proposer(drafter)
    mode = mode or ("spec" if drafter is not None else "ar")
    if mode == "spec" and drafter is None:
        raise ArgumentError("mode 'spec' needs a drafter")
    for i, array in enumerate(arrays):
        target.check_tokens(array, f"prompt {i}")
    longest = max(len(a) for a in arrays)
    if longest + max_new_tokens > target.config.context_length:
        raise ArgumentError(f"prompt of {longest} tokens + max_new_tokens {max_new_tokens} exceeds the context "
                            f"length {target.config.context_length} of {target.path}")
    return arrays, mode
