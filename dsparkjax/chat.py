"""The DeepSeek-V4 chat template, and prompts files.

The template follows DeepSeek's own V4 encoding: ``encoding/README.md`` and ``encoding/encoding_dsv4.py``
in the model repository (https://huggingface.co/deepseek-ai/DeepSeek-V4-Flash/tree/main/encoding), with
its defaults (``drop_thinking=True``, BOS added). Only plain conversations are covered: system, user and
assistant turns with optional ``reasoning_content``; tools, quick-instruction tasks, ``latest_reminder``
and the ``reasoning_effort="max"`` preamble are not.

A prompt can also skip the template entirely: its text is then tokenized as is (see ``Prompt.render``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"

#: Special tokens the template emits, in the order the tiny test vocabulary gives them ids.
#: The first four are control tokens; ``<think>``/``</think>`` are ordinary added tokens in DeepSeek's
#: vocabulary (llama.cpp's converter types them USER_DEFINED), so they survive ``skip_special`` decoding.
CONTROL_TOKENS = (BOS, EOS, USER, ASSISTANT)
USER_DEFINED_TOKENS = (THINK_START, THINK_END)

_ROLES = ("system", "user", "assistant")


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    *,
    thinking: bool = False,
    add_generation_prompt: bool = True,
    default_system: str | None = None,
) -> str:
    """Render a conversation as the DeepSeek-V4 prompt text, starting with the BOS token.

    Layout (encoding_dsv4.py): BOS, then the system text with no role marker, each user turn as
    ``<｜User｜>content``, each assistant turn as ``content<｜end▁of▁sentence｜>``. A user turn that is
    followed by an assistant turn (or ends the conversation, when ``add_generation_prompt``) is closed by
    ``<｜Assistant｜>`` plus ``</think>`` (chat mode, and every turn before the last user turn) or
    ``<think>`` (thinking mode, last user turn) so the model opens its reasoning block. In thinking mode
    the reasoning of earlier assistant turns is dropped; an assistant turn after the last user turn keeps
    its ``reasoning_content`` followed by ``</think>``.

    ``default_system`` is inserted as a leading system turn when the conversation has none. The default is
    None because DeepSeek's encoding adds no system prompt of its own (its README's example prompt is
    ``BOS + "You are a helpful assistant." + "<｜User｜>..."`` only because the caller passed that system
    message).
    """
    msgs = [_checked_message(m, i) for i, m in enumerate(messages)]
    if default_system is not None and not any(m["role"] == "system" for m in msgs):
        msgs.insert(0, {"role": "system", "content": default_system})
    last_user = max((i for i, m in enumerate(msgs) if m["role"] == "user"), default=-1)

    out = [BOS]
    for i, m in enumerate(msgs):
        if m["role"] == "system":
            out.append(m["content"])
        elif m["role"] == "user":
            out.append(USER + m["content"])
            is_last = i + 1 == len(msgs)
            if (is_last and add_generation_prompt) or (not is_last and msgs[i + 1]["role"] == "assistant"):
                out.append(ASSISTANT + (THINK_START if thinking and i == last_user else THINK_END))
        else:
            reasoning = m.get("reasoning_content") or ""
            out.append((reasoning + THINK_END if thinking and i > last_user else "") + m["content"] + EOS)
    return "".join(out)


def _checked_message(message: Mapping[str, Any], index: int) -> dict[str, Any]:
    """Return ``message`` as a dict after checking its role and content types."""
    if not isinstance(message, Mapping):
        raise ValueError(f"chat message {index}: expected an object, found {type(message).__name__}")
    role, content = message.get("role"), message.get("content")
    if role not in _ROLES:
        raise ValueError(f"chat message {index}: role must be one of {_ROLES}, found {role!r}")
    if not isinstance(content, str):
        raise ValueError(f"chat message {index}: content must be a string, found {type(content).__name__}")
    reasoning = message.get("reasoning_content")
    if reasoning is not None and not isinstance(reasoning, str):
        raise ValueError(f"chat message {index}: reasoning_content must be a string")
    return dict(message)


@dataclass(frozen=True)
class Prompt:
    """One prompt of a prompts file: either raw ``text`` or chat ``messages`` (exactly one is set)."""

    text: str | None = None
    messages: tuple[Mapping[str, Any], ...] | None = None

    def render(self, *, chat_template: bool = True, thinking: bool = False, default_system: str | None = None) -> str:
        """The text to tokenize.

        With ``chat_template`` a text prompt becomes one user turn of ``render_chat``; without it the text
        is returned unchanged (no BOS either: pass ``add_bos=True`` to ``Tokenizer.encode`` if wanted).
        Chat messages have no raw form, so they require the template.
        """
        if self.messages is not None:
            if not chat_template:
                raise ValueError("a prompt given as chat messages cannot bypass the chat template")
            return render_chat(self.messages, thinking=thinking, default_system=default_system)
        assert self.text is not None
        if not chat_template:
            return self.text
        return render_chat([{"role": "user", "content": self.text}], thinking=thinking, default_system=default_system)


def load_prompts(path: str | Path) -> list[Prompt]:
    """Read a prompts file: one prompt per non-blank line.

    The file is JSONL when its name ends in ``.jsonl`` or its first non-blank line starts with ``{``; each
    line is then ``{"prompt": "..."}`` or ``{"messages": [{"role": ..., "content": ...}, ...]}``. Otherwise
    every line is a plain-text prompt (use JSONL for prompts spanning lines). Blank lines are skipped.
    Malformed lines raise ValueError naming the file and line number.
    """
    path = Path(path)
    lines = path.read_text(encoding="utf-8").splitlines()
    numbered = [(n, line) for n, line in enumerate(lines, 1) if line.strip()]
    is_jsonl = path.suffix == ".jsonl" or (bool(numbered) and numbered[0][1].lstrip().startswith("{"))
    if not is_jsonl:
        return [Prompt(text=line) for _, line in numbered]
    return [_parse_jsonl_prompt(line, f"{path}:{n}") for n, line in numbered]


def _parse_jsonl_prompt(line: str, where: str) -> Prompt:
    """Parse one JSONL line of a prompts file; ``where`` is ``file:line`` for error messages."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: malformed JSON: {e.msg} (column {e.colno})") from None
    if not isinstance(obj, dict) or len(obj.keys() & {"prompt", "messages"}) != 1:
        raise ValueError(f'{where}: expected an object with exactly one of "prompt" or "messages"')
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str):
            raise ValueError(f'{where}: "prompt" must be a string')
        return Prompt(text=obj["prompt"])
    messages = obj["messages"]
    if not isinstance(messages, list) or not messages:
        raise ValueError(f'{where}: "messages" must be a non-empty list')
    try:
        checked = tuple(_checked_message(m, i) for i, m in enumerate(messages))
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return Prompt(messages=checked)
