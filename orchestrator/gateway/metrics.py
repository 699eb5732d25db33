"""Prometheus metrics of the REST gateway (one set per process). Latencies in seconds, Prometheus' base unit."""
from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from tandem.edge.client import GenerationStats

REQUESTS = Counter("tandem_gateway_requests", "Chat completion requests by HTTP status", ["status"])
SESSIONS = Gauge("tandem_gateway_sessions", "Generations in progress on the gateway's drafters")
QUEUED = Gauge("tandem_gateway_queued", "Requests waiting for a drafter (every drafter lent)")
QUEUE_WAIT_SECONDS = Histogram("tandem_gateway_queue_wait_seconds", "Time a request waited for a drafter",
                               buckets=(0.001, 0.01, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))
TOKENS = Counter("tandem_gateway_committed_tokens", "Completion tokens committed")
TAU = Histogram("tandem_gateway_tau", "Committed tokens per verify forward, per request",
                buckets=(1, 1.5, 2, 3, 4, 5, 6, 8, 10, 16))
RTT_SECONDS = Histogram("tandem_gateway_rtt_seconds", "Round time minus verifier time seen by the gateway's "
                        "drafters, mean per request", buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                                           0.1, 0.25))
TTFT_SECONDS = Histogram("tandem_gateway_ttft_seconds", "Time to first token",
                         buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
REACHED = Counter("tandem_gateway_depth_reached", "Rounds whose tree reached depth d with d-1 tokens accepted",
                  ["depth"])
ACCEPTED = Counter("tandem_gateway_depth_accepted", "Rounds whose token at depth d was accepted", ["depth"])
ERRORS = Counter("tandem_gateway_errors", "Failed requests by error code", ["code"])


def record_generation(s: GenerationStats, ttft_s: float | None) -> None:
    TOKENS.inc(s.generated_tokens)
    if s.rounds:
        TAU.observe(s.tau)
        RTT_SECONDS.observe(s.network_us / 1e6 / s.rounds)
    if ttft_s is not None:
        TTFT_SECONDS.observe(ttft_s)
    for d, (a, r) in enumerate(zip(s.accepted_by_depth, s.reached_by_depth), start=1):
        REACHED.labels(str(d)).inc(r)
        ACCEPTED.labels(str(d)).inc(a)
