"""The starlette application: OpenAI's completion endpoints, models, health and metrics.

A generation request's body is read only when its Content-Length is within the server's limit; it is then
validated and tokenized on the event loop (`protocol`), its sampling fields mapped by the one adapter
(`sampling.admission_options`), then queued on the scheduler; the handler waits on the request's asyncio queue. Streamed answers are server-sent events in OpenAI's chunk format ending with
`data: [DONE]`; when the client goes away, starlette cancels the stream and its row is released. A whole
answer races the request's queue against the client's disconnect the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from dsparkjax.serve.protocol import MAX_BODY_BYTES, Envelope, GenerationRequest, Kind, RequestError, \
    TokenLogprob, Usage, completion_budget, logprobs_body, parse_request
from dsparkjax.serve.sampling import admission_options
from dsparkjax.serve.scheduler import Delta, Job, QueueFull, Scheduler
from dsparkjax.tokenizer import Tokenizer

_ENDPOINTS: dict[Kind, str] = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


def build_app(scheduler: Scheduler, tokenizer: Tokenizer, model: str, stop_tokens: frozenset[int],
              max_body_bytes: int = MAX_BODY_BYTES) -> Starlette:
    """The ASGI app serving `model` from `scheduler`; its lifespan starts and closes the scheduler's thread.

    stop_tokens: token ids that end a generation (the target's EOS). max_body_bytes: the largest request body
    read (a larger Content-Length gets 413 before any of it is read).
    """
    api = _Api(scheduler, tokenizer, model, stop_tokens, max_body_bytes)

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        scheduler.start()
        try:
            yield
        finally:
            await asyncio.to_thread(scheduler.close)

    routes = [Route(path, api.endpoint(kind), methods=["POST"]) for kind, path in _ENDPOINTS.items()]
    routes += [Route("/v1/models", api.models), Route("/health", api.health), Route("/metrics", api.metrics_page)]
    return Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: _http_error})


class _Api:
    def __init__(self, scheduler: Scheduler, tokenizer: Tokenizer, model: str, stop_tokens: frozenset[int],
                 max_body_bytes: int):
        self.scheduler, self.tokenizer, self.model, self.stop_tokens = scheduler, tokenizer, model, stop_tokens
        self.max_body_bytes = max_body_bytes
        self.metrics = scheduler.metrics

    def endpoint(self, kind: Kind):
        async def handle(request: Request) -> Response:
            return await self.generate(kind, request)
        return handle

    async def generate(self, kind: Kind, http: Request) -> Response:
        try:
            request = parse_request(kind, await read_body(http, self.max_body_bytes), self.tokenizer, self.model)
            options = admission_options(request.sampling)
            budget = completion_budget(request, self.scheduler.room(len(request.prompt_ids)), self.scheduler.context)
            job = Job(request, budget, options, self.tokenizer, self.stop_tokens)
            self.scheduler.submit(job)
        except RequestError as e:
            self._count(kind, "rejected")
            return _error(e)
        except QueueFull as e:
            self._count(kind, "overloaded")
            return _error(RequestError(str(e), status=429, err_type="rate_limit_error", code="queue_full"))
        envelope = Envelope(kind, self.model)
        if request.stream:
            return StreamingResponse(self._events(job, request, envelope), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await self._whole(http, job, request, envelope)

    async def _events(self, job: Job, request: GenerationRequest, envelope: Envelope) -> AsyncIterator[str]:
        """The SSE stream of one request; cancels its row if the stream ends early (the client went away)."""
        outcome, offset = "cancelled", 0  # offset: the completion's text offset of the next token
        try:
            if request.kind == "chat":
                yield _sse(envelope.chunk(None))
            while True:
                delta = await job.queue.get()
                if delta.error is not None:
                    outcome = "failed"
                    yield _sse(RequestError(delta.error, status=500, err_type="server_error").body())
                    break
                logprobs = None
                if request.logprobs is not None and delta.logprobs:
                    logprobs = logprobs_body(request.kind, delta.logprobs, offset)
                    offset += sum(len(e.token) for e in delta.logprobs)
                if delta.text or delta.finish_reason or logprobs:
                    yield _sse(envelope.chunk(delta.text, delta.finish_reason, logprobs))
                if delta.finish_reason:
                    outcome = "finished"
                    if request.include_usage:
                        yield _sse(envelope.usage_chunk(Usage(len(request.prompt_ids), delta.completion_tokens)))
                    break
            yield "data: [DONE]\n\n"
        finally:
            if outcome == "cancelled":
                self.scheduler.cancel(job)
            self._count(request.kind, outcome)

    async def _whole(self, http: Request, job: Job, request: GenerationRequest, envelope: Envelope) -> Response:
        """The whole answer, or nothing if the client disconnects first (its row is then released)."""
        collect = asyncio.ensure_future(_collect(job))
        gone = asyncio.ensure_future(_disconnected(http))
        await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if not collect.done():
            collect.cancel()
            self.scheduler.cancel(job)
            self._count(request.kind, "cancelled")
            return Response(status_code=499)  # nobody reads it
        text, last, entries = collect.result()
        if last.error is not None:
            self._count(request.kind, "failed")
            return _error(RequestError(last.error, status=500, err_type="server_error"))
        self._count(request.kind, "finished")
        usage = Usage(len(request.prompt_ids), last.completion_tokens)
        logprobs = logprobs_body(request.kind, entries) if request.logprobs is not None else None
        return JSONResponse(envelope.response(text, last.finish_reason or "stop", usage, logprobs))

    def _count(self, kind: Kind, outcome: str) -> None:
        self.metrics.requests.labels(_ENDPOINTS[kind], outcome).inc()

    async def models(self, _: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": self.model, "object": "model", "created": 0,
                                                          "owned_by": "dsparkjax"}]})

    async def health(self, _: Request) -> Response:
        return JSONResponse({"status": "ok", **self.scheduler.status()})

    async def metrics_page(self, http: Request) -> Response:
        body, content_type = self.metrics.exposition(http.headers.get("accept"))
        return Response(body, headers={"Content-Type": content_type})


async def read_body(http: Request, limit: int) -> bytes:
    """The request's body, read only when its Content-Length is a decimal count of at most `limit` bytes;
    RequestError otherwise: 411 without one (a chunked body has none), 400 when it is no count, 413 past `limit`."""
    length = http.headers.get("content-length")
    if length is None:
        raise RequestError("the request needs a Content-Length header (chunked bodies are not accepted)",
                           status=411, code="length_required")
    if not (length.isascii() and length.isdigit()):
        raise RequestError(f"Content-Length must be a decimal count of bytes, got {length!r}")
    if int(length) > limit:
        raise RequestError(f"the request body of {int(length)} bytes exceeds this server's limit of {limit} bytes "
                           "(--max_body_bytes)", status=413, code="request_too_large")
    return await http.body()


async def _collect(job: Job) -> tuple[str, Delta, list[TokenLogprob]]:
    """All of a job's text, its last delta (finished or failed) and its tokens' logprobs."""
    parts, entries = [], []
    while True:
        delta = await job.queue.get()
        parts.append(delta.text)
        entries += delta.logprobs
        if delta.finish_reason is not None or delta.error is not None:
            return "".join(parts), delta, entries


async def _disconnected(http: Request) -> None:
    """Returns when the client disconnects (the request body has been read already)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


def _sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def _error(error: RequestError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


async def _http_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return _error(RequestError(exc.detail, status=exc.status_code))
