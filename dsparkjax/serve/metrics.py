"""The server's Prometheus metrics, in a registry of its own (several servers may share a process in tests).

The scheduler thread counts tokens, steps and draft acceptance; the app counts requests by outcome. Two
gauges are computed when scraped: tokens per second over a sliding window, and matched/offered since start.
"""

from __future__ import annotations

import collections
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder

OUTCOMES = ("finished", "cancelled", "rejected", "overloaded", "failed")


class Metrics:
    """Counters and gauges of one server; thread-safe (prometheus_client's metrics are)."""

    def __init__(self, window_s: float = 10.0):
        self.registry = registry = CollectorRegistry()
        self.window_s = window_s
        self.requests = Counter("dsparkjax_requests", "Generation requests answered, by endpoint and outcome "
                                f"({', '.join(OUTCOMES)})", ["endpoint", "outcome"], registry=registry)
        self.queue_depth = Gauge("dsparkjax_queue_depth", "Requests waiting for a free engine row", registry=registry)
        self.running = Gauge("dsparkjax_running_requests", "Requests holding an engine row", registry=registry)
        self.prompt_tokens = Counter("dsparkjax_prompt_tokens", "Prompt tokens admitted", registry=registry)
        self.generated_tokens = Counter("dsparkjax_generated_tokens", "Tokens generated", registry=registry)
        self.steps = Counter("dsparkjax_engine_steps", "Engine steps (prefill and decode of all rows)",
                             registry=registry)
        self.matched = Counter("dsparkjax_draft_matched", "Drafted candidates the target accepted", registry=registry)
        self.offered = Counter("dsparkjax_draft_offered", "Drafted candidates the target verified", registry=registry)
        self.ttft = Histogram("dsparkjax_time_to_first_token_seconds", "From admission to the queue to the first "
                              "token", buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10), registry=registry)
        Gauge("dsparkjax_tokens_per_second", f"Tokens generated per second over the last {window_s:g} s",
              registry=registry).set_function(self._rate)
        Gauge("dsparkjax_draft_acceptance", "Drafted candidates accepted / verified since start (matched/offered)",
              registry=registry).set_function(self._acceptance)
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        self._drafts = [0, 0]  # matched, offered: the acceptance gauge's totals
        self._lock = threading.Lock()

    def tokens(self, count: int, matched: int, offered: int) -> None:
        """Count `count` generated tokens and the drafts of the step that made them."""
        self.generated_tokens.inc(count)
        self.matched.inc(matched)
        self.offered.inc(offered)
        with self._lock:
            self._recent.append((time.monotonic(), count))
            self._drafts[0] += matched
            self._drafts[1] += offered

    def exposition(self, accept: str | None) -> tuple[bytes, str]:
        """The metrics in the text format the scraper's Accept header asks for: (body, content type)."""
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type

    def _rate(self) -> float:
        now = time.monotonic()
        with self._lock:
            while self._recent and self._recent[0][0] < now - self.window_s:
                self._recent.popleft()
            return sum(n for _, n in self._recent) / self.window_s

    def _acceptance(self) -> float:
        with self._lock:
            matched, offered = self._drafts
        return matched / offered if offered else 0.0
