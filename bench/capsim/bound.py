"""The analytic bound: the most sessions a GPU could hold at a per-token SLO with Tandem's acceptance, in closed form.

A verify forward of B sessions drafting chains of d tokens costs t(B (d + 1) + prefill, KV of B contexts) and
commits tau(d) tokens per session, tau(d) = 1 + E[min(L, d)] over the traces' positions (the drafter's recorded
greedy chains: what Tandem's acceptance allows). Every session in every forward, drafting free to the GPU, no
queueing, no round trip: B sessions meet a per-token SLO S while t <= tau(d) x S. Prompts are GPU work no method
avoids: a round of tau S commits B tau tokens, so B tau / A answers end and as many prompts of P new tokens join it
(A: the mean answer, P: the mean prompt computed). The KV memory caps B too (the same cap the simulation applies).
The bound is the best d's B, per GPU. d = 0 is server-only decoding under the same idealisation (``ar``): their
ratio is docs/design.md's (S - F / tau) / (S - F) ("Where speculation pays") with the curve's own F, c and KV terms.
"""
from __future__ import annotations

from .physics import Forward
from .traces import Traces


def tau_chain(traces: Traces, dataset: str, depth: int) -> float:
    runs = [r for t in traces.texts if t.dataset == dataset for r in t.runs]
    return 1.0 + sum(min(r, depth) for r in runs) / len(runs) if runs else 1.0


def sessions_within(forward: Forward, slo_ms: float, depth: int, tau: float, context: float, prompt_new: float,
                    prompt_ctx: float, answer: float, cap: int) -> int:
    """The largest B <= cap whose forward fits ``tau x slo_ms``."""
    def fits(b: int) -> bool:
        prefill = b * tau * prompt_new / answer
        tokens = b * (depth + 1) + prefill
        ctx = b * context + b * tau / answer * prompt_ctx  # each joining prompt reads its cached part once
        pairs = b * (depth + 1) * context + prefill * (prompt_ctx + prompt_new / 2)
        if not forward.allows(int(tokens) + 1):
            return False
        return forward.ms(int(round(tokens)), int(ctx), int(pairs)) <= tau * slo_ms

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= cap and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, cap + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def bound(forward: Forward, traces: Traces, dataset: str, slo_ms: float, context_tokens: int = 0,
          fresh_context: bool = False, answer_tokens: float = 0.0, max_depth: int = 16) -> dict:
    """Tandem's bound and server-only decoding's under the same idealisation, per GPU; the best depth and its
    tau."""
    texts = [t for t in traces.texts if t.dataset == dataset] or traces.texts
    traced = sum(t.prompt_tokens for t in texts) / len(texts)
    answer = answer_tokens or (sum(traces.answer_tokens) / len(traces.answer_tokens) if traces.answer_tokens
                               else 256.0)
    if not context_tokens:
        prompt, new = traced, traced
    elif fresh_context:
        prompt = new = max(context_tokens, traced)
    else:
        prompt, new = max(context_tokens, traced), traced
    cap = forward.max_sessions(int(prompt + answer))
    context = prompt + answer / 2  # a session's KV, on average over its answer
    cached = prompt - new
    out = {"ar": 0, "bound": 0, "depth": 0, "tau": 1.0}
    for d in range(max_depth + 1):
        tau = tau_chain(traces, dataset, d)
        b = sessions_within(forward, slo_ms, d, tau, context, new, cached, answer, cap)
        if d == 0:
            out["ar"] = b / forward.tp
        if b / forward.tp > out["bound"]:
            out.update(bound=b / forward.tp, depth=d, tau=round(tau, 3))
    out["kv_cap"] = cap / forward.tp
    return {k: (round(v, 1) if isinstance(v, float) else v) for k, v in out.items()}
