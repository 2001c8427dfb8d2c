"""The flags and JSON report shared by the scripts that measure a pair on held-out prompts (acceptance.py,
acceptance_sampling.py, calibrate.py): `HeldOutFlags` and `print_json`."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from absl import flags

from dsparkjax.pair import Pair, load_pair
from dsparkjax.training.corpus import held_out_prompts


@dataclasses.dataclass(frozen=True)
class HeldOutFlags:
    """The flags of a script that measures a pair on held-out prompts: the pair's files (default: the embedded
    pair) and the prompts' count, length, seed and source (`training.corpus.held_out_prompts`)."""

    target: flags.FlagHolder[str | None]
    draft: flags.FlagHolder[str | None]
    prompts: flags.FlagHolder[int]
    prompt_len: flags.FlagHolder[int]
    seed: flags.FlagHolder[int]
    prompt_dir: flags.FlagHolder[str | None]

    @classmethod
    def define(cls, prompts: int = 16, prompt_len: int = 32, seed: int = 7,
               seed_help: str = "Seed of the prompt positions.") -> HeldOutFlags:
        """Define the flags `--target --draft --prompts --prompt_len --seed --prompt_dir` with these defaults."""
        return cls(
            flags.DEFINE_string("target", None, "Target GGUF (default: the embedded target)."),
            flags.DEFINE_string("draft", None, "Drafter GGUF (default: the embedded drafter)."),
            flags.DEFINE_integer("prompts", prompts, "Held-out prompts."),
            flags.DEFINE_integer("prompt_len", prompt_len, "Tokens per prompt."),
            flags.DEFINE_integer("seed", seed, seed_help),
            flags.DEFINE_string("prompt_dir", None, "Draw the prompts from every .py file under this directory "
                                "instead of this Python's held-out split (which is held out only for a pair trained "
                                "on this Python)."))

    def load(self) -> tuple[Pair, list[list[int]]]:
        """The pair the flags name (ArgumentError for a target given without its drafter) and its prompts."""
        pair = load_pair(self.target.value, self.draft.value, need_drafter=True)
        return pair, held_out_prompts(pair.target.tokenizer, self.prompts.value, self.prompt_len.value,
                                      self.seed.value, self.prompt_dir.value)

    def header(self, pair: Pair, prompts: list[list[int]]) -> dict[str, Any]:
        """The report's first fields: the pair's files and what the prompts were drawn with."""
        return dict(target=pair.target_path, draft=pair.draft_path, prompts=len(prompts),
                    prompt_dir=self.prompt_dir.value, prompt_len=self.prompt_len.value, seed=self.seed.value)


def print_json(report: dict[str, Any], path: str | None) -> None:
    """Print `report` as indented JSON and, when `path` is given, write the same text there."""
    text = json.dumps(report, indent=2)
    print(text)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")
