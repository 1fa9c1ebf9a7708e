"""What GET /metrics shows, in Prometheus' text format: requests, the queue, the running batch,
tokens per second, step times and the bytes the steps read.

The registry is the server's own, not prometheus_client's global one, so that two servers in one
process (the tests') count apart.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

RATE_WINDOW_S = 10.0   # tokens/s is over the steps of the last this many seconds
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ServeMetrics:
    def __init__(self, bytes_read=lambda: 0):
        """bytes_read: reads the bytes streamed from disk so far (the loaded model's counter)."""
        disable_created_metrics()  # the *_created timestamps per series say nothing a server's user needs
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("zerolite_requests", "HTTP requests answered, by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.sequences = Counter("zerolite_sequences_finished", "Sequences ended, by finish reason "
                                 "(stop, length, cancelled, error)", ["reason"], registry=r)
        self.queue_depth = Gauge("zerolite_queue_depth", "Sequences waiting to join the batch", registry=r)
        self.active = Gauge("zerolite_active_sequences", "Sequences in the running batch", registry=r)
        self.prompt_tokens = Counter("zerolite_prompt_tokens", "Prompt tokens fed", registry=r)
        self.generated_tokens = Counter("zerolite_generated_tokens", "Tokens generated", registry=r)
        self.tokens_per_s = Gauge("zerolite_tokens_per_second", f"Tokens generated per second over the last "
                                  f"{RATE_WINDOW_S:.0f} s", registry=r)
        self.steps = Histogram("zerolite_step_seconds",
                               "Time of one step: one pass over the weights for the whole batch",
                               buckets=STEP_BUCKETS, registry=r)
        self.ttft = Histogram("zerolite_time_to_first_token_seconds", "From a request's arrival to its first token",
                              buckets=TTFT_BUCKETS, registry=r)
        Gauge("zerolite_bytes_read", "Bytes the steps have streamed from disk", registry=r).set_function(bytes_read)
        self._recent: deque[tuple[float, int]] = deque()   # (end of step, tokens it generated)
        self._lock = threading.Lock()  # the decode loop appends while a scrape reads
        self.tokens_per_s.set_function(self._rate)

    def step(self, seconds: float, generated: int) -> None:
        self.steps.observe(seconds)
        self.generated_tokens.inc(generated)
        with self._lock:
            self._recent.append((time.monotonic(), generated))

    def _rate(self) -> float:
        now = time.monotonic()
        with self._lock:
            while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
                self._recent.popleft()
            return sum(tokens for _, tokens in self._recent) / RATE_WINDOW_S

    def render(self) -> bytes:
        return generate_latest(self.registry)
