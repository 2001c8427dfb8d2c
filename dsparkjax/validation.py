"""Up-front checks of the public API's arguments: a bad one is refused before anything compiles or runs,
with an ArgumentError naming the argument, what it must be and what it was."""

from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple, Sequence

import numpy as np

from dsparkjax.errors import ArgumentError


def token_ids(value: Any, what: str, ndim: int) -> np.ndarray:
    """`value` as an int64 array of `ndim` axes of token ids; strings, floats, ragged rows and ids beyond int64
    are refused (an id past int64 is named: it would wrap to a negative id, or read as a ragged or float row)."""
    if isinstance(value, (str, bytes)):
        raise ArgumentError(f"{what} must be token ids (integers), got a string: tokenize it first "
                            f"(target.tokenizer.encode)")
    try:
        array = np.asarray(value)
    except ValueError:
        raise ArgumentError(f"{what} must be a rectangular array of token ids, got rows of different lengths"
                            ) from None
    if array.dtype.kind in "uOf":  # numpy holds ints past int64 as uint64, objects, or floats (2**63 with -1)
        _check_int64(value, array, what)
    if array.dtype == object:
        raise ArgumentError(f"{what} must be a rectangular array of token ids, got ragged or mixed rows")
    if array.size and array.dtype.kind not in "iu":
        kind = "strings" if array.dtype.kind in "US" else f"dtype {array.dtype}"
        raise ArgumentError(f"{what} must hold integer token ids, got {kind}")
    if array.ndim != ndim:
        raise ArgumentError(f"{what} must have {ndim} axes of token ids, got shape {array.shape}")
    return array.astype(np.int64)


_INT64 = np.iinfo(np.int64)


def _check_int64(value: Any, array: np.ndarray, what: str) -> None:
    """Refuse, naming it, the first integer of `value` (converted to `array`) outside int64."""
    if array.dtype.kind == "u":
        ids = array.ravel()
        bad = ids[ids > _INT64.max]
        first = int(bad[0]) if bad.size else None
    else:  # Python ints: read them back as objects (a ragged value has none to name)
        try:
            flat = np.asarray(value, dtype=object).ravel()
        except ValueError:
            return
        first = next((int(v) for v in flat if isinstance(v, numbers.Integral) and not isinstance(v, bool)
                      and not _INT64.min <= v <= _INT64.max), None)
    if first is not None:
        raise ArgumentError(f"{what} holds token id {first}, outside the int64 range of token ids")


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


def boolean(value: Any, name: str) -> bool:
    """A bool (or numpy's): a string such as "no" would otherwise read as true."""
    if not isinstance(value, (bool, np.bool_)):
        raise ArgumentError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def choice(value: Any, name: str, choices: Sequence[Any]) -> Any:
    if value not in choices:
        raise ArgumentError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


def temperature(value: Any) -> float:
    """A finite real >= 0 (0 is greedy) that float32, the rows' dtype, holds as a normal number: one that
    overflows to inf would sample uniformly, and a positive one that rounds to 0, or to a subnormal (which XLA
    flushes to 0 on the CPU and the GPU), would decode greedily."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
        raise ArgumentError(f"temperature must be a finite number >= 0 (0: greedy), got {value!r}")
    with np.errstate(over="ignore"):
        held = np.float32(value)
    f32 = np.finfo(np.float32)
    if not np.isfinite(held) or (value > 0 and held < f32.smallest_normal):
        raise ArgumentError(f"temperature {value!r} does not survive float32 (it becomes {held}"
                            f"{', a subnormal XLA flushes to 0' if 0 < held < f32.smallest_normal else ''}): use 0 "
                            f"(greedy) or a value in [{f32.smallest_normal:.3g}, {f32.max:.3g}]")
    return float(value)


PROPOSER_MEMBERS = ("block_size", "capture_layers", "has_confidence", "width_thresholds", "init_state", "precompile",
                    "absorb", "propose", "propose_sampled")


def proposer(drafter: Any) -> None:
    """A drafter must implement the Proposer protocol (a target passed as the drafter does not)."""
    missing = [m for m in PROPOSER_MEMBERS if not hasattr(drafter, m)]
    if missing:
        raise ArgumentError(f"drafter must be a Proposer such as load_drafter(path, target), got "
                            f"{type(drafter).__name__} (it lacks {', '.join(missing)})")


def target(value: Any) -> None:
    """The model argument must be a loaded Target (a GGUF path is not one)."""
    from dsparkjax.target_api import Target  # imported here: target_api checks its own arguments with this module

    if not isinstance(value, Target):
        raise ArgumentError(f"target must be a Target such as load_target(path), got {type(value).__name__}")


class GenerateArguments(NamedTuple):
    """`generate`'s checked arguments, as the types the decoder uses."""

    prompts: list[np.ndarray]  # int64 token ids, one array per prompt
    mode: str  # "spec" or "ar"
    max_new_tokens: int
    prefill_chunk: int
    stop_tokens: frozenset[int]


def generate_arguments(target_: Any, prompts: Any, drafter: Any, max_new_tokens: Any, verify: Any, mode: Any,
                       temperature_: Any, prefill_chunk: Any, on_token: Any, stop_tokens: Any) -> GenerateArguments:
    """Check `generate`'s arguments (stop_tokens None: the target's EOS)."""
    target(target_)
    arrays = prompt_list(prompts)
    max_new_tokens = positive_int(max_new_tokens, "max_new_tokens")
    prefill_chunk = positive_int(prefill_chunk, "prefill_chunk")
    choice(verify, "verify", ("exact", "fast", "lossless"))
    choice(mode, "mode", ("spec", "ar", None))
    temperature(temperature_)
    if drafter is not None:
        proposer(drafter)
    if on_token is not None and not callable(on_token):
        raise ArgumentError(f"on_token must be a callable (sequence index, token id) or None, got "
                            f"{type(on_token).__name__}")
    mode = mode or ("spec" if drafter is not None else "ar")
    if mode == "spec" and drafter is None:
        raise ArgumentError("mode 'spec' needs a drafter")
    for i, array in enumerate(arrays):
        target_.check_tokens(array, f"prompt {i}")
    stops = token_ids([target_.config.eos_token_id] if stop_tokens is None else stop_tokens, "stop_tokens", 1)
    target_.check_tokens(stops, "stop_tokens")  # an id the model never emits would never stop a sequence
    context = target_.config.context_length
    longest = max(len(a) for a in arrays)
    if longest + max_new_tokens > context:
        raise ArgumentError(f"prompt of {longest} tokens + max_new_tokens {max_new_tokens} exceeds the context "
                            f"length {context} of {target_.path}")
    if prefill_chunk > context:  # a chunk no prompt can fill would only size the prefill program past memory
        raise ArgumentError(f"prefill_chunk {prefill_chunk} exceeds the context length {context} of {target_.path}")
    return GenerateArguments(arrays, mode, max_new_tokens, prefill_chunk, frozenset(stops.tolist()))
