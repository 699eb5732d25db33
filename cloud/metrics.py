"""Prometheus metrics of a verifier process (one set per process, the Prometheus convention).

Served by ``tandem serve --metrics-port`` (and on the gateway's ``/metrics`` when both run in one process).
Latencies are in seconds, Prometheus' base unit.
"""
from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from tandem.core.tree import depths_reached_and_accepted

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

SESSIONS = Gauge("tandem_verifier_sessions", "Open verifier sessions in this process")
VERIFY_SECONDS = Histogram("tandem_verifier_verify_seconds", "Verify forward + acceptance time per draft",
                           buckets=_LATENCY)
QUEUE_SECONDS = Histogram("tandem_verifier_queue_seconds", "Time a draft waited before its forward",
                          buckets=_LATENCY)
TOKENS = Counter("tandem_verifier_committed_tokens", "Tokens committed by verdicts (accepted + bonus)")
DRAFTED = Counter("tandem_verifier_drafted_nodes", "Draft tree nodes received")
REACHED = Counter("tandem_verifier_depth_reached", "Drafts whose tree reached depth d with d-1 tokens accepted",
                  ["depth"])
ACCEPTED = Counter("tandem_verifier_depth_accepted", "Drafts whose token at depth d was accepted", ["depth"])
ERRORS = Counter("tandem_verifier_errors", "Requests ended with a gRPC error", ["code"])
KV_SEQUENCES = Gauge("tandem_verifier_kv_sequences", "KV cache blocks the engine holds for sequences (engines "
                     "that count them)")


def watch_engine(engine) -> None:
    """Export the engine's KV blocks in use, for engines that count them (``sequences_in_use``)."""
    if hasattr(engine, "sequences_in_use"):
        KV_SEQUENCES.set_function(engine.sequences_in_use)


def record_verdict(tree_depth: int, tree_nodes: int, accepted: int, committed: int, queue_us: int,
                   verify_us: int) -> None:
    VERIFY_SECONDS.observe(verify_us / 1e6)
    QUEUE_SECONDS.observe(queue_us / 1e6)
    TOKENS.inc(committed)
    DRAFTED.inc(tree_nodes)
    reached, accepted_depths = depths_reached_and_accepted(tree_depth, accepted)
    for d in reached:
        REACHED.labels(str(d)).inc()
    for d in accepted_depths:
        ACCEPTED.labels(str(d)).inc()
