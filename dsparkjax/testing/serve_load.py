"""Concurrent streaming clients of an OpenAI-compatible server, for the server's load test and its benchmark.

`run_load` starts every client at once with the real `openai` client (the test extra), each streaming one
chat or text completion, optionally closing its stream after the first text (a client that leaves midway),
and returns what each received, its time to first token, and the wall time of the whole load.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import statistics
import time


PROMPTS = (  # the embedded pair writes Python
    "import os\nimport sys\n\n\ndef main(",
    "class Parser:\n    def __init__(self, text):\n",
    "    for i in range(len(items)):\n",
    "def f(x):\n    return",
    "# Copyright\n\"\"\"Utilities for reading files.\"\"\"\n\nimport re\n",
    "        if not",
    "    def __repr__(self):\n        return",
    "try:\n    import json\nexcept ImportError:\n",
)


@dataclasses.dataclass(frozen=True)
class ClientSpec:
    """One client: a chat (one user message) or text completion of `prompt`, up to `max_tokens`."""

    prompt: str
    max_tokens: int
    chat: bool = False
    leave_early: bool = False  # close the stream after the first text


@dataclasses.dataclass
class ClientResult:
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int | None = None  # the usage chunk's count (None when the client left early)
    ttft_s: float = float("nan")  # from sending the request to the first text or finish reason


@dataclasses.dataclass(frozen=True)
class LoadReport:
    results: list[ClientResult]
    elapsed_s: float

    @property
    def completion_tokens(self) -> int:
        """Tokens of the streams that ran to their end (their usage chunks)."""
        return sum(r.completion_tokens or 0 for r in self.results)

    def summary(self) -> dict[str, float]:
        """Aggregate tok/s of the finished streams over the load's wall time, and TTFT p50/p99 in ms."""
        ttft = sorted(r.ttft_s for r in self.results)
        return {"clients": len(self.results), "completion_tokens": self.completion_tokens,
                "elapsed_s": self.elapsed_s, "tok_per_s": self.completion_tokens / self.elapsed_s,
                "ttft_p50_ms": statistics.median(ttft) * 1e3,
                "ttft_p99_ms": ttft[round(0.99 * (len(ttft) - 1))] * 1e3}


def mixed_clients(count: int, longest: int, leave_every: int = 4, prompts: tuple[str, ...] = PROMPTS
                  ) -> list[ClientSpec]:
    """`count` clients cycling through `prompts`, chat and text completions alternating, max_tokens spread over
    longest/8 .. longest; every `leave_every`-th client (0: none) asks for `longest` and leaves after its first
    text."""
    lengths = [longest * k // 8 for k in range(1, 9)]
    specs = []
    for i in range(count):
        leave = leave_every > 0 and i % leave_every == leave_every - 1
        specs.append(ClientSpec(prompts[i % len(prompts)], longest if leave else lengths[(i * 3) % 8],
                                chat=i % 2 == 0, leave_early=leave))
    return specs


async def _stream(client, model: str, spec: ClientSpec) -> ClientResult:
    start = time.perf_counter()
    kwargs = dict(model=model, max_tokens=spec.max_tokens, stream=True, stream_options={"include_usage": True})
    if spec.chat:
        stream = await client.chat.completions.create(messages=[{"role": "user", "content": spec.prompt}], **kwargs)
    else:
        stream = await client.completions.create(prompt=spec.prompt, **kwargs)
    result = ClientResult()
    async for chunk in stream:
        if chunk.usage is not None:
            result.completion_tokens = chunk.usage.completion_tokens
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        piece = (choice.delta.content or "") if spec.chat else choice.text
        if (piece or choice.finish_reason) and math.isnan(result.ttft_s):
            result.ttft_s = time.perf_counter() - start
        result.text += piece
        result.finish_reason = choice.finish_reason or result.finish_reason
        if spec.leave_early and result.text:
            await stream.close()
            break
    return result


def run_load(base_url: str, model: str, specs: list[ClientSpec], timeout_s: float = 300) -> LoadReport:
    """Run every client of `specs` at once against the server at `base_url` (…/v1)."""
    import openai

    async def run_all() -> LoadReport:
        client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=timeout_s)
        start = time.perf_counter()
        results = await asyncio.gather(*(_stream(client, model, spec) for spec in specs))
        elapsed = time.perf_counter() - start
        await client.close()
        return LoadReport(list(results), elapsed)

    return asyncio.run(run_all())
