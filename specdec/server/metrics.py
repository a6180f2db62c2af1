"""Prometheus metrics of one server (its own registry, so several apps in one process do not collide)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from specdec.runtime.engine import Generation

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 40, 80, 160)


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("specdec_requests", "HTTP requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("specdec_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generated_tokens = Counter("specdec_generated_tokens", "Tokens generated", registry=r)
        self.target_passes = Counter("specdec_target_passes", "Target verification passes (prefill not counted)",
                                     registry=r)
        self.drafted = Counter("specdec_drafted_tokens", "Draft tokens proposed", registry=r)
        self.accepted = Counter("specdec_accepted_tokens", "Draft tokens accepted by the target", registry=r)
        self.tau = Gauge("specdec_tokens_per_target_pass", "Generated tokens per verification pass, all requests "
                         "so far (speculation's gain; 1 without it)", registry=r)
        self.queue_depth = Gauge("specdec_queue_depth", "Requests waiting for a row", registry=r)
        self.active_rows = Gauge("specdec_batch_active_rows", "Rows generating in the last round", registry=r)
        self.batch_size = Gauge("specdec_batch_size", "Rows the batch holds", registry=r)
        self.ttft = Histogram("specdec_time_to_first_token_seconds", "From arrival to the first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("specdec_request_duration_seconds", "From arrival to the last token",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self._forwards = self._emitted = 0

    def finished(self, result: Generation, ttft_s: float | None, total_s: float) -> None:
        s = result.stats
        self.prompt_tokens.inc(s.prompt_tokens)
        self.generated_tokens.inc(s.new_tokens)
        self.target_passes.inc(s.target_forwards)
        self.drafted.inc(s.drafted)
        self.accepted.inc(s.accepted)
        self._forwards += s.target_forwards
        self._emitted += s.accepted + s.target_forwards
        if self._forwards:
            self.tau.set(self._emitted / self._forwards)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        self.latency.observe(total_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
