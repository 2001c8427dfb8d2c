"""Checks of the command-line inputs of scripts/generate.py, done before any model loads or runs, and
`run_main`, which turns the DsparkError of any command (`generate.py`, `python -m dsparkjax.serve`) into one line.

Each check raises CliInputError, whose message names the flag and the file or value, so the script can
print it and exit non-zero without a traceback. A prompts file that is missing, not UTF-8, malformed or
empty is refused: it never falls back to the demo prompts. `--prompt_ids` must be comma-separated
non-negative integers. The directory of `--output` must exist and be writable before generation starts,
so a long run is not lost at the end. The sampling flags must make a valid `SamplingParams` and seed.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

from absl import app

from dsparkjax import chat
from dsparkjax.decoding.sampling import SamplingParams, check_seed
from dsparkjax.errors import ArgumentError, DsparkError


class CliInputError(DsparkError):
    """A command-line flag's value (or the file it names) cannot be used."""


def read_prompts_file(path: str, flag: str = "--prompts_file") -> list[chat.Prompt]:
    """The prompts of `path` (`chat.load_prompts` format); CliInputError if unreadable, malformed or empty."""
    if not path:
        raise CliInputError(f"{flag} is empty; give the path of a prompts file")
    file = Path(path)
    if not file.exists():
        raise CliInputError(f"{flag} {path}: no such file")
    if not file.is_file():
        raise CliInputError(f"{flag} {path}: not a regular file")
    try:
        prompts = chat.load_prompts(file)
    except UnicodeDecodeError as e:
        line = e.object[: e.start].count(b"\n") + 1
        raise CliInputError(f"{flag} {path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}, "
                            f"line {line})") from None
    except OSError as e:
        raise CliInputError(f"{flag} {path}: cannot read: {e.strerror or e}") from None
    except ValueError as e:  # malformed JSONL line; the message already names file:line
        raise CliInputError(f"{flag}: {e}") from None
    if not prompts:
        raise CliInputError(f"{flag} {path}: holds no prompts (the file is empty or blank)")
    return prompts


def parse_prompt_ids(value: str, flag: str = "--prompt_ids") -> list[int]:
    """Token ids of one `--prompt_ids` value such as "1, 2,3"; CliInputError unless every item is an id >= 0."""
    items = value.split(",")
    if not value.strip():
        raise CliInputError(f"{flag} {value!r}: no token ids; expected comma-separated integers such as 1,2,3")
    ids = []
    for n, item in enumerate(items, 1):
        text = item.strip()
        if not text.isascii() or not text.isdigit():  # rejects '', '1.5', '-1', 'a', '1e3', '٣'
            raise CliInputError(f"{flag} {value!r}: item {n} ({text!r}) is not a non-negative integer token id")
        ids.append(int(text))
    return ids


def check_output_path(path: str, flag: str = "--output") -> None:
    """CliInputError unless `path` can be written: its directory exists and is writable, and it is no directory."""
    if not path:
        raise CliInputError(f"{flag} is empty; give the path of the file to write")
    file = Path(path)
    directory = file.parent
    if not directory.is_dir():
        raise CliInputError(f"{flag} {path}: directory {directory} does not exist")
    if file.is_dir():
        raise CliInputError(f"{flag} {path}: is a directory, not a file")
    if not os.access(directory, os.W_OK | os.X_OK) or (file.exists() and not os.access(file, os.W_OK)):
        raise CliInputError(f"{flag} {path}: not writable")


def sampling_flags(temperature: float, top_k: int, top_p: float, min_p: float, seed: int
                   ) -> tuple[SamplingParams, int]:
    """`--temperature --top_k --top_p --min_p --seed` as (SamplingParams, seed); CliInputError naming the flag."""
    try:
        return SamplingParams(temperature, top_k, top_p, min_p), check_seed(seed)
    except ArgumentError as err:  # its message starts with the parameter's name, which is the flag's
        raise CliInputError(f"--{err}") from None


def run_main(main: Callable[[list[str]], None]) -> None:
    """`absl.app.run(main)`, where a DsparkError (bad input: a flag, a file) prints `error: <message>` on stderr
    and exits with status 1, instead of a traceback."""
    try:
        app.run(main)
    except DsparkError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
