"""What the service reports: Prometheus metrics (``GET /metrics``) and a progress line in the log.

In: the HTTP handlers' and the lockstep loop's events (a request answered, a forward's rows, tokens and seconds,
the time a request waited). Out: a :class:`prometheus_client.CollectorRegistry` of the service's own (no process
globals), rendered in the Prometheus text format, and every ``interval_s`` one log line per listener::

    serve: 12 requests (+4), 2,310 tokens/s, queue 1, forward 0.41 s / waiting 0.93 s of the last 5 s
"""

from __future__ import annotations

import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST
SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ROWS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
REFUSAL_REASONS = ("stopping", "queue_full", "bad_request", "too_large", "no_vocab_mapping",
                   "vocab_mapping_ambiguous", "client_gone", "failed")
"""``ds_capture_serve_refusals_total{reason}``: every refused or unanswered request counts under one of these."""


class ServeMetrics:
    """Counters of one service (thread-safe: prometheus_client's metrics are)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("ds_capture_serve_requests", "HTTP requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=self.registry)
        self.rows = Counter("ds_capture_serve_rows", "Rows forwarded for generate requests", registry=self.registry)
        self.tokens = Counter("ds_capture_serve_tokens", "Content tokens (attention_mask) forwarded",
                              registry=self.registry)
        self.forwards = Counter("ds_capture_serve_forwards", "Forwards run (one may answer several requests)",
                                registry=self.registry)
        self.forward_seconds = Counter("ds_capture_serve_forward_seconds",
                                       "Seconds in forward + supervision on this listener", registry=self.registry)
        self.wait_seconds = Counter("ds_capture_serve_wait_seconds",
                                    "Seconds requests waited in the queue before their forward (summed)",
                                    registry=self.registry)
        self.latency = Histogram("ds_capture_serve_request_seconds",
                                 "generate: seconds from the request's headers to its answer (body, queue, forward)",
                                 buckets=SECONDS_BUCKETS, registry=self.registry)
        self.queue_wait = Histogram("ds_capture_serve_queue_wait_seconds",
                                    "generate: seconds a request waited in the queue before its forward",
                                    buckets=SECONDS_BUCKETS, registry=self.registry)
        self.forward_time = Histogram("ds_capture_serve_forward_time_seconds",
                                      "Seconds of one forward + supervision", buckets=SECONDS_BUCKETS,
                                      registry=self.registry)
        self.batch_rows = Histogram("ds_capture_serve_batch_rows", "Rows of one forward", buckets=ROWS_BUCKETS,
                                    registry=self.registry)
        self.refusals = Counter("ds_capture_serve_refusals", "Requests refused or left unanswered, by reason",
                                ["reason"], registry=self.registry)
        for reason in REFUSAL_REASONS:
            self.refusals.labels(reason=reason)  # every reason present from the start (0)
        self.in_flight = Gauge("ds_capture_serve_in_flight",
                               "generate requests admitted and not yet answered (0 once the service is quiet)",
                               registry=self.registry)
        self.held = Gauge("ds_capture_serve_held", "generate requests held for room in the queue (back-pressure)",
                          registry=self.registry)
        self.queue_depth = Gauge("ds_capture_serve_queue_depth", "generate requests waiting", registry=self.registry)
        self.ready = Gauge("ds_capture_serve_ready", "1 once every rank loaded the target, 0 when stopping",
                           registry=self.registry)
        self._lock = threading.Lock()
        self._totals = [0.0, 0.0, 0.0, 0.0]  # generate answered, tokens, forward s, waiting s (for the log line)
        self._last = (time.monotonic(), 0.0, 0.0, 0.0, 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def count_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()
        if endpoint == "generate" and status == 200:
            with self._lock:
                self._totals[0] += 1

    def refuse(self, reason: str) -> None:
        self.refusals.labels(reason=reason).inc()

    def count_forward(self, *, rows: int, tokens: int, seconds: float, waits: list[float]) -> None:
        waited = sum(waits)
        for wait in waits:
            self.queue_wait.observe(wait)
        self.forward_time.observe(seconds)
        self.batch_rows.observe(rows)
        self.forwards.inc()
        self.rows.inc(rows)
        self.tokens.inc(tokens)
        self.forward_seconds.inc(seconds)
        self.wait_seconds.inc(waited)
        with self._lock:
            self._totals[1] += tokens
            self._totals[2] += seconds
            self._totals[3] += waited

    def line(self) -> str:
        """The progress line since the previous call."""
        now = time.monotonic()
        with self._lock:
            answered, tokens, forward, waited = self._totals
            then, answered0, tokens0, forward0, waited0 = self._last
            self._last = (now, answered, tokens, forward, waited)
        depth = self.queue_depth.collect()[0].samples[0].value
        span = max(now - then, 1e-9)
        return (f"serve: {answered:,.0f} generate requests (+{answered - answered0:,.0f}), "
                f"{(tokens - tokens0) / span:,.0f} tokens/s, queue {depth:.0f}, "
                f"forward {forward - forward0:.2f} s / waiting {waited - waited0:.2f} s of the last {span:.0f} s")
