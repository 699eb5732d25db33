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
# vLLM's speculative-decoding counters, under the same names (tandem_ prefix) and a model_name label, so existing
# dashboards carry over; acceptance rate = accepted_tokens / draft_tokens, mean accepted length = 1 + accepted /
# drafts. Per-round histograms show the spread that per-request means hide.
SPEC_DRAFTS = Counter("tandem_spec_decode_num_drafts", "Draft trees verified", ["model_name"])
SPEC_DRAFT_TOKENS = Counter("tandem_spec_decode_num_draft_tokens", "Draft tokens (tree nodes) verified",
                            ["model_name"])
SPEC_ACCEPTED = Counter("tandem_spec_decode_num_accepted_tokens", "Draft tokens accepted", ["model_name"])
SPEC_ACCEPTED_POS = Counter("tandem_spec_decode_num_accepted_tokens_per_pos",
                            "Draft tokens accepted at each position of the accepted path (0: the root's child)",
                            ["model_name", "position"])
ROUND_COMMITTED = Histogram("tandem_verifier_round_committed_tokens", "Tokens one verdict commits (per-round tau)",
                            ["model_name"], buckets=(1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32))
ROUND_TREE_TOKENS = Histogram("tandem_verifier_round_tree_tokens", "Draft tree nodes verified in one round",
                              ["model_name"], buckets=(0, 1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64))
KV_SEQUENCES = Gauge("tandem_verifier_kv_sequences", "KV cache blocks the engine holds for sequences (engines "
                     "that count them)")


def watch_engine(engine) -> None:
    """Export the engine's KV blocks in use, for engines that count them (``sequences_in_use``)."""
    if hasattr(engine, "sequences_in_use"):
        KV_SEQUENCES.set_function(engine.sequences_in_use)


def record_verdict(tree_depth: int, tree_nodes: int, accepted: int, committed: int, queue_us: int,
                   verify_us: int, model: str = "") -> None:
    if tree_nodes:
        SPEC_DRAFTS.labels(model).inc()
        SPEC_DRAFT_TOKENS.labels(model).inc(tree_nodes)
        SPEC_ACCEPTED.labels(model).inc(accepted)
        for pos in range(accepted):
            SPEC_ACCEPTED_POS.labels(model, str(pos)).inc()
    ROUND_COMMITTED.labels(model).observe(committed)
    ROUND_TREE_TOKENS.labels(model).observe(tree_nodes)
    VERIFY_SECONDS.observe(verify_us / 1e6)
    QUEUE_SECONDS.observe(queue_us / 1e6)
    TOKENS.inc(committed)
    DRAFTED.inc(tree_nodes)
    reached, accepted_depths = depths_reached_and_accepted(tree_depth, accepted)
    for d in reached:
        REACHED.labels(str(d)).inc()
    for d in accepted_depths:
        ACCEPTED.labels(str(d)).inc()
