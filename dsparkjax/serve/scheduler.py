"""The batching scheduler: one thread owns the `Engine` and feeds each request's asyncio queue.

Requests wait in a bounded queue (`submit` raises `QueueFull` when it is full: the app answers 429). Between
engine steps the thread releases the rows of cancelled requests, admits waiting requests into free rows, runs
one `Engine.step()` and turns each row's emitted tokens into a `Delta` (text with stop strings applied, the
finish reason) on that request's queue; a finished request's row is released at once. Only this thread calls
the engine, so JAX never sees two threads stepping one state. The engine's programs are compiled before the
thread starts (`serving_engine`), and a request only fills rows of them: nothing compiles per request.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
import time
from typing import Any

import numpy as np

from dsparkjax import validation
from dsparkjax.decoding.decoder import Decoder
from dsparkjax.decoding.engine import Emitted, Engine
from dsparkjax.decoding.proposer import Proposer
from dsparkjax.errors import ArgumentError, DsparkError
from dsparkjax.serve.metrics import Metrics
from dsparkjax.serve.protocol import GenerationRequest, TokenLogprob
from dsparkjax.serve.text import TextStream
from dsparkjax.target_api import Target
from dsparkjax.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class QueueFull(DsparkError):
    """The queue of requests waiting for a row is full."""


def serving_engine(target: Target, drafter: Proposer | None, *, max_batch: int, max_context: int,
                   prefill_chunk: int = 16) -> Engine:
    """An exact-mode engine of `max_batch` rows of `max_context` positions (speculative with `drafter`, plain
    without) whose rows may sample (each with its own parameters and seed, greedy ones alike), compiled, and
    warmed up by one throwaway sequence so that serving compiles nothing more. `max_context` is at most the
    target's context length."""
    context = target.config.context_length
    if validation.positive_int(max_context, "max_context") > context:
        raise ArgumentError(f"max_context {max_context} exceeds the context length {context} of {target.path}")
    decoder = Decoder.for_prompts(target, drafter, speculative=drafter is not None, lengths=[1] * max_batch,
                                  max_new_tokens=1, verify="exact", width="adaptive", prefill_chunk=prefill_chunk,
                                  sample=True)
    engine = Engine(dataclasses.replace(decoder, max_len=max_context))
    row = engine.admit([target.config.bos_token_id])
    engine.step()  # prefills the row and queues a decode step
    engine.step()  # reads that step back
    engine.release(row)
    return engine


@dataclasses.dataclass(frozen=True)
class Delta:
    """What one engine step gave one request."""

    text: str  # new text to send (may be empty)
    completion_tokens: int  # tokens generated so far
    finish_reason: str | None = None  # "stop" (EOS or a stop string) or "length" when the request is done
    error: str | None = None  # the request failed (the engine failed, or the server is shutting down)
    logprobs: tuple[TokenLogprob, ...] = ()  # the tokens taken in this delta (not EOS, which gives no text)


class Job:
    """One request in the scheduler: its prompt and limits, its text stream, and its queue of `Delta`s.

    Made on the event loop's thread; after `submit` only the scheduler thread touches it, except `cancelled`
    (set by `Scheduler.cancel`) and the queue (read on the event loop).
    """

    def __init__(self, request: GenerationRequest, max_tokens: int, options: dict[str, Any], tokenizer: Tokenizer,
                 stop_tokens: frozenset[int]):
        self.prompt = np.asarray(request.prompt_ids, np.int64)
        self.max_tokens, self.options, self.stop_tokens = max_tokens, options, stop_tokens
        self.text = TextStream(tokenizer, request.stop)
        self._tokenizer = tokenizer
        self.queue: asyncio.Queue[Delta] = asyncio.Queue()
        self.cancelled = False
        self.completion_tokens = 0
        self.submitted = time.monotonic()
        self._loop = asyncio.get_running_loop()

    def take(self, out: Emitted) -> Delta:
        """The delta of one row's emitted tokens: stops at EOS, a stop string or max_tokens."""
        pieces, finish, logprobs = [], None, []
        for token, logprob in zip(out.tokens, out.logprobs):
            self.completion_tokens += 1
            if token in self.stop_tokens:
                pieces.append(self.text.flush())
                finish = "stop"
            else:
                raw = self._tokenizer.token_bytes(token)
                logprobs.append(TokenLogprob(raw.decode("utf-8", errors="replace"), raw, logprob))
                pieces.append(self.text.push(token))
                if self.text.stopped:
                    finish = "stop"
                elif self.completion_tokens >= self.max_tokens:
                    pieces.append(self.text.flush())
                    finish = "length"
            if finish:
                break
        return Delta("".join(pieces), self.completion_tokens, finish, logprobs=tuple(logprobs))

    def publish(self, delta: Delta) -> None:
        """Hand `delta` to the event loop (from the scheduler thread)."""
        try:
            self._loop.call_soon_threadsafe(self.queue.put_nowait, delta)
        except RuntimeError:  # the event loop has closed: nobody is listening any more
            pass

    def fail(self, message: str) -> None:
        self.publish(Delta("", self.completion_tokens, error=message))


class Scheduler:
    """Owns `engine` on its own thread (`start` / `close`); requests come in by `submit` and `cancel`."""

    def __init__(self, engine: Engine, metrics: Metrics, *, max_queue: int):
        self.metrics, self.max_queue = metrics, max_queue
        self._engine = engine
        decoder = engine.decoder
        self.context = decoder.max_len
        self._reserve = 2 * decoder.max_step  # a row's decode steps run up to two widths past what the host read
        self._waiting: collections.deque[Job] = collections.deque()
        self._rows: dict[int, Job] = {}  # scheduler thread only
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="dsparkjax-engine", daemon=True)

    def room(self, prompt_tokens: int) -> int:
        """The most tokens a prompt of `prompt_tokens` may generate in a row (< 1: the prompt does not fit)."""
        return self.context - prompt_tokens - self._reserve

    def status(self) -> dict[str, int]:
        with self._cond:
            return {"running": len(self._rows), "waiting": len(self._waiting), "rows": self._engine.decoder.batch}

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop the thread after its current step; requests still waiting or running fail."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join()
        for job in [*self._waiting, *self._rows.values()]:
            job.fail("the server is shutting down")

    def submit(self, job: Job) -> None:
        """Queue `job` for a row; QueueFull when `max_queue` requests already wait."""
        with self._cond:
            if self._closed:
                raise QueueFull("the server is shutting down")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are already waiting for a row "
                                f"(--max_queue {self.max_queue}); retry later")
            self._waiting.append(job)
            self.metrics.queue_depth.set(len(self._waiting))
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """Drop `job`: out of the queue now, or its row released before the next step."""
        with self._cond:
            job.cancelled = True
            if job in self._waiting:
                self._waiting.remove(job)
                self.metrics.queue_depth.set(len(self._waiting))
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or self._waiting or self._rows)
                if self._closed:
                    return
                arrivals = [self._waiting.popleft() for _ in range(min(len(self._waiting),
                                                                           len(self._engine.free_rows)))]
                self.metrics.queue_depth.set(len(self._waiting))
            try:
                self._tick(arrivals)
            except Exception:  # noqa: BLE001 -- whatever broke, the rows fail and the server goes on
                log.exception("engine step failed; failing its %d requests and starting a fresh engine",
                              len(self._rows))
                self._engine = Engine(self._engine.decoder)  # the compiled programs are reused
                for job in self._rows.values():
                    job.fail("the engine failed while generating this request; see the server log")
                self._rows.clear()
                self.metrics.running.set(0)

    def _tick(self, arrivals: list[Job]) -> None:
        """Release cancelled rows, admit `arrivals`, step the engine and hand out what it emitted."""
        for row, job in list(self._rows.items()):
            if job.cancelled:
                self._engine.release(row)
                del self._rows[row]
        for job in arrivals:
            try:
                self._rows[self._engine.admit(job.prompt, **job.options)] = job
            except DsparkError as e:  # the request checks make this unreachable; fail the one request if not
                job.fail(str(e))
                continue
            self.metrics.prompt_tokens.inc(job.prompt.size)
        self.metrics.running.set(len(self._rows))
        if not self._rows:
            return
        emitted = self._engine.step()
        self.metrics.steps.inc()
        for row, out in emitted.items():
            job = self._rows[row]
            before = job.completion_tokens
            delta = job.take(out)
            if before == 0:
                self.metrics.ttft.observe(time.monotonic() - job.submitted)
            self.metrics.tokens(delta.completion_tokens - before, out.matched, out.offered)
            job.publish(delta)
            if delta.finish_reason is not None:
                self._engine.release(row)
                del self._rows[row]
        self.metrics.running.set(len(self._rows))
