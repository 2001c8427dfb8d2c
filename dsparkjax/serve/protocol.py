"""OpenAI request bodies in, OpenAI response bodies out.

`parse_request` turns the raw body of `POST /v1/chat/completions` or `POST /v1/completions` into a
`GenerationRequest` (prompt token ids, limits, stop strings, sampling fields) or raises `RequestError`, whose
`body()` is OpenAI's error object. Fields this server does not implement are refused when set to anything but
their neutral value, so a client never gets output it did not ask for; fields it does not know are ignored,
as OpenAI's own API does. The `*_chunk` and `*_response` functions build the JSON bodies.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import numbers
import time
import uuid
from typing import Any, Literal, Sequence

from dsparkjax import chat, validation
from dsparkjax.decoding.sampling import MAX_SEED, MAX_TOP_K
from dsparkjax.errors import ArgumentError
from dsparkjax.tokenizer import Tokenizer

Kind = Literal["chat", "completion"]
MAX_STOP_STRINGS = 4  # OpenAI's limit
# The default request body limit (`--max_body_bytes`): a 4096-position prompt is at most ~30 KB of JSON token
# ids, and a million-token one about 8 MB; the body is read whole before it is parsed.
MAX_BODY_BYTES = 8 * 2**20

# Fields accepted only at the neutral value given (what they would change is not implemented).
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (None, 1), "best_of": (None, 1), "echo": (None, False), "suffix": (None, ""),
    "tools": (None, []), "functions": (None, []),
    "logit_bias": (None, {}), "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
    "response_format": (None, {"type": "text"}), "tool_choice": (None, "none", "auto"),
}


class RequestError(ArgumentError):
    """A request the server refuses; `body()` is OpenAI's error object, sent with HTTP `status`."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400,
                 err_type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.err_type, self.code = message, param, status, err_type, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param, "code": self.code}}


@dataclasses.dataclass(frozen=True)
class SamplingFields:
    """A request's sampling fields, range-checked: temperature 0 is greedy, top_k 0, top_p 1 and min_p 0 keep
    every token (`sampling` maps them on the engine)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """One validated request: what to generate and how to answer."""

    kind: Kind
    prompt_ids: tuple[int, ...]
    max_tokens: int | None  # None: as many as the context leaves
    stop: tuple[str, ...]  # strings that end the text (never part of it)
    sampling: SamplingFields
    stream: bool
    include_usage: bool  # streamed: a last chunk with the usage
    logprobs: int | None = None  # report each token's logprob with this many alternatives (only 0 so far), or not


def parse_request(kind: Kind, raw: bytes, tokenizer: Tokenizer, model: str) -> GenerationRequest:
    """Validate the raw JSON body of a `kind` request for the served `model` and tokenize its prompt."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"the request body is not valid JSON: {e}") from None
    except RecursionError:  # arrays or objects nested thousands deep
        raise RequestError("the request body nests arrays or objects too deeply") from None
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    name = body.get("model")
    if not isinstance(name, str):
        raise RequestError(f"model must be a string, got {_type(name)}", param="model")
    if name != model:
        raise RequestError(f"the model {name!r} does not exist; this server serves {model!r}", param="model",
                           status=404, code="model_not_found")
    for field, neutral in _NEUTRAL.items():
        if field in body and body[field] not in neutral:
            raise RequestError(f"{field} is not supported by this server (got {body[field]!r})", param=field)
    stream = _optional(body, "stream", bool, False)
    options = _optional(body, "stream_options", dict, {})
    include_usage = _optional(options, "include_usage", bool, False, "stream_options.include_usage")
    newer = kind == "chat" and body.get("max_tokens") is None  # chat's newer name of the same field
    param = "max_completion_tokens" if newer and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _optional(body, param, int, None)
    if max_tokens is not None and max_tokens < 1:
        raise RequestError(f"{param} must be at least 1, got {max_tokens}", param=param)
    ids = _chat_prompt(body, tokenizer) if kind == "chat" else _completion_prompt(body, tokenizer)
    return GenerationRequest(kind, tuple(ids), max_tokens, _stop(body.get("stop")), _sampling(body), stream,
                             include_usage, _logprobs(kind, body))


def completion_budget(request: GenerationRequest, room: int, context: int) -> int:
    """The tokens `request` may generate when the context leaves `room` after its prompt (of `context`
    positions in all): its max_tokens, or all the room; RequestError when the prompt or max_tokens does not fit."""
    prompt = len(request.prompt_ids)
    if room < 1:
        raise RequestError(f"the prompt has {prompt} tokens, beyond this server's context of {context} tokens "
                           "(after the room a decode step needs)", param="messages" if request.kind == "chat"
                           else "prompt", code="context_length_exceeded")
    if request.max_tokens is not None and request.max_tokens > room:
        raise RequestError(f"max_tokens {request.max_tokens} does not fit: the prompt's {prompt} tokens leave room "
                           f"for {room} in this server's context of {context}", param="max_tokens",
                           code="context_length_exceeded")
    return request.max_tokens if request.max_tokens is not None else room


def _chat_prompt(body: dict[str, Any], tokenizer: Tokenizer) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(f"messages must be a non-empty array, got {_type(messages)}", param="messages")
    flat = []
    for i, message in enumerate(messages):
        if isinstance(message, dict) and isinstance(message.get("content"), list):  # content parts: text only
            message = {**message, "content": _text_parts(message["content"], i)}
        flat.append(message)
    try:
        text = chat.render_chat(flat)
    except ValueError as e:
        raise RequestError(str(e), param="messages") from None
    return _encode(tokenizer, text, "messages")  # the template starts with BOS


def _text_parts(parts: list[Any], index: int) -> str:
    if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in parts):
        raise RequestError(f"chat message {index}: content parts must be text parts "
                           '({"type": "text", "text": "..."})', param="messages")
    return "".join(p["text"] for p in parts)


def _completion_prompt(body: dict[str, Any], tokenizer: Tokenizer) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("prompt must not be empty", param="prompt")
        return _encode(tokenizer, prompt, "prompt", add_bos=True)
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {tokenizer.vocab_size})",
                               param="prompt")
        return list(prompt)
    raise RequestError("prompt must be a non-empty string or a non-empty array of token ids (one prompt per "
                       f"request), got {_type(prompt)}", param="prompt")


def _encode(tokenizer: Tokenizer, text: str, param: str, add_bos: bool = False) -> list[int]:
    """`tokenizer.encode`, its refusal of a string that is no text (a lone surrogate) a 400 naming `param`."""
    try:
        return tokenizer.encode(text, add_bos=add_bos)
    except ArgumentError as e:
        raise RequestError(f"{param}: {e}", param=param) from None


def _stop(value: Any) -> tuple[str, ...]:
    stops = [value] if isinstance(value, str) else value if value is not None else []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(f"stop must be a non-empty string or an array of them, got {value!r}", param="stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise RequestError(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}", param="stop")
    return tuple(stops)


def _sampling(body: dict[str, Any]) -> SamplingFields:
    temperature = _optional(body, "temperature", float, 0.0)
    if not 0 <= temperature <= 2:
        raise RequestError(f"temperature must be in [0, 2], got {temperature}", param="temperature")
    try:
        validation.temperature(temperature)  # one float32 rounds to 0 would decode greedily
    except ArgumentError as e:
        raise RequestError(str(e), param="temperature") from None
    top_k = _optional(body, "top_k", int, 0)  # vLLM's extension field, as are min_p and its -1
    if not -1 <= top_k <= MAX_TOP_K:
        raise RequestError(f"top_k must be an integer in [-1, 2**31) (-1 or 0: off), got {top_k}", param="top_k")
    top_p = _optional(body, "top_p", float, 1.0)
    if not 0 < top_p <= 1:
        raise RequestError(f"top_p must be in (0, 1], got {top_p}", param="top_p")
    min_p = _optional(body, "min_p", float, 0.0)
    if not 0 <= min_p <= 1:
        raise RequestError(f"min_p must be in [0, 1] (0: off), got {min_p}", param="min_p")
    seed = _optional(body, "seed", int, None)
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise RequestError(f"seed must be an integer in [0, 2**32), got {seed}", param="seed")
    return SamplingFields(temperature=temperature, top_k=max(top_k, 0), top_p=top_p, min_p=min_p, seed=seed)


def _logprobs(kind: Kind, body: dict[str, Any]) -> int | None:
    """How many alternatives each token's logprob comes with (chat: `logprobs` true and `top_logprobs` in
    [0, 20]; completions: `logprobs` in [0, 5]), or None for no logprobs. The alternatives are not implemented:
    a count above 0 is refused."""
    if kind == "chat":
        top = _optional(body, "top_logprobs", int, 0)
        if not 0 <= top <= 20:
            raise RequestError(f"top_logprobs must be an integer in [0, 20], got {top}", param="top_logprobs")
        if not _optional(body, "logprobs", bool, False):
            if top:
                raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")
            return None
        param, count = "top_logprobs", top
    else:
        param, count = "logprobs", _optional(body, "logprobs", int, None)
        if count is not None and not 0 <= count <= 5:
            raise RequestError(f"logprobs must be an integer in [0, 5], got {count}", param="logprobs")
    if count:
        raise RequestError(f"{param} {count} is not supported by this server: it reports each generated token's "
                           f"own logprob ({param} 0), not the most likely alternatives", param=param)
    return count


def _optional(body: dict[str, Any], field: str, kind: type, default: Any, param: str | None = None) -> Any:
    """`body[field]` checked to be of `kind` (JSON null or absent: `default`)."""
    value = body.get(field)
    if value is None:
        return default
    ok = {bool: lambda v: isinstance(v, bool), int: _is_int, dict: lambda v: isinstance(v, dict),
          float: lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)}[kind](value)
    if not ok:
        expected = {bool: "a boolean", int: "an integer", float: "a finite number", dict: "an object"}[kind]
        raise RequestError(f"{param or field} must be {expected}, got {value!r}", param=param or field)
    return float(value) if kind is float else value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _type(value: Any) -> str:
    return "null" if value is None else type(value).__name__


# -- responses ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int

    def body(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """One generated token's logprob entry: its text, its bytes and its logprob (the target's distribution,
    before temperature and filters)."""

    token: str
    bytes: bytes
    logprob: float


def logprobs_body(kind: Kind, entries: Sequence[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """A choice's `logprobs` object for `entries` (completions: their text offsets count from `offset`)."""
    if kind == "chat":
        return {"content": [{"token": e.token, "logprob": e.logprob, "bytes": list(e.bytes), "top_logprobs": []}
                            for e in entries]}
    starts = itertools.accumulate((len(e.token) for e in entries[:-1]), initial=offset)
    return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{} for _ in entries], "text_offset": list(starts) if entries else []}


@dataclasses.dataclass(frozen=True)
class Envelope:
    """The fields every response and chunk of one request share."""

    kind: Kind
    model: str
    id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    def _head(self, streamed: bool) -> dict[str, Any]:
        if self.kind == "chat":
            obj = "chat.completion.chunk" if streamed else "chat.completion"
            return {"id": f"chatcmpl-{self.id}", "object": obj, "created": self.created, "model": self.model}
        return {"id": f"cmpl-{self.id}", "object": "text_completion", "created": self.created, "model": self.model}

    def chunk(self, text: str | None, finish_reason: str | None = None, logprobs: dict[str, Any] | None = None
              ) -> dict[str, Any]:
        """A streamed chunk: `text` (chat: None opens the assistant's message) and/or the finish reason, with
        the `logprobs` object of its tokens (`logprobs_body`) when the request asked for them."""
        if self.kind == "chat":
            delta = {"role": "assistant", "content": ""} if text is None else {"content": text} if text else {}
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        return {**self._head(True), "choices": [choice]}

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        """The last chunk of a stream with `stream_options.include_usage`: no choices, the usage."""
        return {**self._head(True), "choices": [], "usage": usage.body()}

    def response(self, text: str, finish_reason: str, usage: Usage, logprobs: dict[str, Any] | None = None
                 ) -> dict[str, Any]:
        """A whole (non-streamed) response (`logprobs`: as in `chunk`)."""
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        return {**self._head(False), "choices": [choice], "usage": usage.body()}
