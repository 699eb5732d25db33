"""Ceilings: the fastest, and the cheapest, that edge chain drafting can be for this model pair on a link and a
verifier cost curve, by an oracle that knows the drafter's acceptance at every position.

    python -m bench.ceiling --limit 4 --drafter-vocab head.npy --json bench/out/ceiling.json \\
        --compare bench/results/2026-12-02/epyc/cpupaced/network.json

Why: issue goals such as "1.4x cloud-only at metro on code" or "a third of cloud-only's verifier time at the same
speed" are only worth chasing if some policy could reach them. This bench measures what bounds the policies:

1. the target's greedy output on HumanEval and ShareGPT prompts (``cloud.reference``, the lossless reference);
2. the drafter's real greedy chain (its engine's incremental cache, as a round drafts it) after every prefix of
   it: ``L[i]``, how many of its tokens from ``i`` on agree with the target, is exactly how many tokens of a
   greedy chain drafted at ``i`` the verifier accepts (temperature 0); chains are one deeper than the deepest
   round, so that a round's "everything and the next token accepted" is known;
3. the drafter's real time for a chain of ``k`` (``draft_ms[k]``) on one thread, in the state a round leaves it
   (the bonus token pending), at real positions of those outputs;
4. for every cost curve x link: a dynamic programme over positions that picks, at each one, cloud-only decoding of
   one token (``v(1)``) or a chain of depth ``k`` (commits ``min(L[i], k) + 1``, verifies ``k + 1`` tokens), with
   mode switches free. Three families of chain round:
   - ``lockstep``: the edge drafts, sends, waits: ``draft_ms[k] + rtt + v(k + 1)``;
   - ``proactive``: lock-step, and while a verdict is in flight the next chain is drafted on the guess that this
     one and the drafter's next token are accepted; where they are (``L[i] > k``) the next round takes
     ``max(draft_ms[k], rtt + v(k + 1))``;
   - ``overlapped``: drafting and the round trip hidden perfectly behind the verifier's forwards (DuoDecoding,
     streamed drafts): ``max(draft_ms[k], v(k + 1))``. No real pipeline does better: each committed draft token
     is drafted once and verified once. It ignores that a streamed draft is drafted from a prefix a round trip
     old (the tokens in between are guesses): with a drafter slower per token than the verifier's forward (the GPU
     curves) it is far from reachable.
   The oracle's speed (cloud-only decode time over its time, TTFT excluded: it is the same prefill for all) is a
   ceiling for policies of that family: ``lockstep`` and ``proactive`` bound lock-step policies (the verifier
   idle while the edge drafts), ``overlapped`` also streamed ones (the product's ``draft`` mode, where the
   verifier decodes alone meanwhile). ``proactive`` charges a ready round against its own flight, exact for a
   fixed depth and approximate where depths change. Its cost floor (least verifier time per token at a speed >=
   1.0x) is the Lagrangian dual bound of the same programme: for every price lambda of verifier time, any schedule
   with time <= T has verifier time >= V_lambda + (T_lambda - T) / lambda; the floor is the best over the sweep.

5. a confidence cut, realisable: fixed lock-step chains that end at the first node whose path probability under
   the drafter is below ``min_p`` (Pacer, SpecDec++ and DLoop stop drafting on the drafter's confidence), priced
   over a sweep of ``min_p`` from the same chains and their path log-probabilities, with the drafter's calibration
   (path probability against the share of nodes accepted) beside it.

Draft times are medians, not minima: the bounds hold for this drafter's typical speed. Not modelled: draft trees
(on a CPU curve a wider tree costs more to verify than the chain; on a flat GPU curve it can beat the chain
ceiling), link jitter and loss. Sampling: with ``--temperature`` the target's answers are sampled with the
verifier's keyed draws (``--seed``), and a greedy chain holds as far as it agrees with them, exactly as a session
with that seed accepts it. Correctness check: a lock-step chain of
``--check-depth`` through gRPC on localhost must accept as many drafts per tree as the chains replay (within
``--max-check-error``), and its outputs must equal target-only decoding up to measured near-ties; else exit 1.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from .curves import curve_path
from .output import cpu_name
from .output import finish
from bench.output import pyplot

CURVES = ("cpu-1core-qwen2.5-coder-1.5b-q4km.json", "h200-torch-qwen2.5-7b.json", "a100-roofline-qwen2.5-7b.json")
LINKS_RTT_MS = {"local": 0.0, "lan": 2.0, "metro": 20.0, "wan": 80.0}  # bench.network's profiles, both directions
MAX_DEPTH = 8
FAMILIES = ("lockstep", "proactive", "overlapped")
CUT_FAMILIES = ("lockstep", "proactive")  # the lock-step rounds a confidence cut is priced in (``cut_ceilings``)
# the cuts priced: a chain ends at its first node whose path probability is below this
MIN_PS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
CALIBRATION_BINS = (0.0, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 1.0)
# Lagrange multipliers of verifier time against wall time: 0 (fastest) up to 1e3 (cheapest), geometric
LAMBDAS = (0.0, *(10 ** (e / 8) for e in range(-24, 25)))


def _progress(msg: str) -> None:
    print(f"[ceiling] {msg}", file=sys.stderr, flush=True)


# -- the maths ----------------------------------------------------------------------------------------------------
def accept_runs(agree: Sequence[bool]) -> list[int]:
    """``L[i]``: consecutive agreements starting at position ``i`` (how much of a greedy chain drafted at ``i``, of
    any depth, the target accepts)."""
    out = [0] * (len(agree) + 1)
    for i in range(len(agree) - 1, -1, -1):
        out[i] = out[i + 1] + 1 if agree[i] else 0
    return out[:-1]


@dataclass(frozen=True)
class Costs:
    verify_ms: Callable[[int], float]  # tokens in one forward -> ms
    draft_ms: Sequence[float]  # draft_ms[k]: a chain of k drafted tokens (draft_ms[0] unused)
    rtt_ms: float

    def round_ms(self, family: str, k: int) -> float:
        if family == "lockstep":
            return self.draft_ms[k] + self.rtt_ms + self.verify_ms(k + 1)
        if family == "overlapped":
            return max(self.draft_ms[k], self.verify_ms(k + 1))
        raise ValueError(f"unknown family {family!r}")

    def ready_ms(self, k: int) -> float:
        """A lock-step round of a chain of ``k`` drafted during the last verdict's flight (``proactive``, the guess
        held): its drafting overlaps the round trip and forward of the round before."""
        return max(self.draft_ms[k], self.rtt_ms + self.verify_ms(k + 1))


@dataclass(frozen=True)
class Plan:
    time_ms: float
    verifier_ms: float
    tokens: int
    plain_tokens: int  # committed by cloud-only decoding steps
    rounds: dict[int, int]  # chain depth -> rounds


def oracle(runs: Sequence[int], costs: Costs, family: str, lam: float = 0.0, max_depth: int = MAX_DEPTH,
           depths: Sequence[int] | None = None, plain: bool = True) -> Plan:
    """The schedule minimising time + ``lam`` * verifier time over the positions of one output (``runs`` from
    ``accept_runs``). ``depths`` restricts the chain depths (one: a fixed chain); ``plain`` allows cloud-only steps.
    Advances are clipped at the end of the output: the last round cannot commit past it.

    ``proactive`` is lock-step with the next chain drafted while a verdict is in flight, on the guess that the
    whole chain and the drafter's own next token (the bonus) are accepted: after a round where ``runs[i] > k`` the
    next round's drafting overlaps the flight (``max(draft, rtt + verify)``, the steady state of a fixed chain);
    otherwise it is drafted after the verdict. The state is (position, next chain drafted)."""
    n = len(runs)
    ks = list(depths) if depths is not None else list(range(1, max_depth + 1))
    if not ks and not plain:
        raise ValueError("no step allowed: give a depth or allow plain")
    v1 = costs.verify_ms(1)
    proactive = family == "proactive"
    base = "lockstep" if proactive else family
    opts = [(k, costs.round_ms(base, k), costs.verify_ms(k + 1)) for k in ks]
    # best[r][i]: least cost from position i on, with the chain at i ready (r = 1) or not (r = 0)
    best = [[0.0] * (n + 1), [0.0] * (n + 1)]
    # (k or 0 for plain, advance, time, verifier, next state)
    choice: list[list[tuple[int, int, float, float, int]]] = [[(0, 0, 0.0, 0.0, 0)] * n, [(0, 0, 0.0, 0.0, 0)] * n]
    for i in range(n - 1, -1, -1):
        for r in (0, 1):
            cands = [(v1 + lam * v1 + best[0][i + 1], (0, 1, v1, v1, 0))] if plain else []
            for k, t, v in opts:
                adv = min(min(runs[i], k) + 1, n - i)
                nxt = int(proactive and runs[i] > k)
                t_k = costs.ready_ms(k) if proactive and r else t
                cands.append((t_k + lam * v + best[nxt][i + adv], (k, adv, t_k, v, nxt)))
            best[r][i], choice[r][i] = min(cands, key=lambda c: c[0])
    time_ms = verif = 0.0
    plain_tokens, rounds, i, r = 0, {}, 0, 0
    while i < n:
        k, adv, t, v, r = choice[r][i]
        time_ms, verif = time_ms + t, verif + v
        if k == 0:
            plain_tokens += 1
        else:
            rounds[k] = rounds.get(k, 0) + 1
        i += adv
    return Plan(time_ms, verif, n, plain_tokens, rounds)


def dual_floor(sweep: Sequence[tuple[float, float, float]], time_limit: float) -> float | None:
    """A lower bound on the verifier time of any schedule at most ``time_limit`` long, from ``(lambda, T, V)``
    triples where (T, V) minimises T + lambda * V: weak duality, T_s + lambda V_s >= T + lambda V for every schedule
    s, so T_s <= limit gives V_s >= V + (T - limit) / lambda. None when even the fastest schedule (lambda 0) is
    slower than the limit."""
    fastest = min((t for lam, t, _ in sweep if lam == 0), default=None)
    if fastest is None or fastest > time_limit:
        return None
    bounds = [v + (t - time_limit) / lam for lam, t, v in sweep if lam > 0]
    return max([0.0, *bounds])


def ceilings(outputs: Sequence[Sequence[int]], costs: Costs, max_depth: int = MAX_DEPTH) -> dict:
    """Speed ceilings and cost floors of the families over several outputs (summed: every output's cloud-only
    time is ``len * v(1)``), against cloud-only decoding."""
    v1 = costs.verify_ms(1)
    base = sum(len(r) for r in outputs) * v1
    out: dict = {"cloud_ar_ms": round(base, 1)}
    for family in FAMILIES:
        plans = {lam: [oracle(r, costs, family, lam, max_depth) for r in outputs] for lam in LAMBDAS}
        fast = plans[0.0]  # the fastest schedules: the sweep's first price
        t = sum(p.time_ms for p in fast)
        fixed = {k: sum(oracle(r, costs, family, 0.0, max_depth, depths=[k], plain=False).time_ms for r in outputs)
                 for k in range(1, max_depth + 1)}
        best_k = min(fixed, key=fixed.get)
        sweep = [(lam, sum(p.time_ms for p in ps), sum(p.verifier_ms for p in ps)) for lam, ps in plans.items()]
        floor = dual_floor(sweep, base * (1 + 1e-9))  # cloud-only's own schedule sums to base, up to rounding
        rounds: dict[int, int] = {}
        for p in fast:
            for k, c in p.rounds.items():
                rounds[k] = rounds.get(k, 0) + c
        out[family] = {"speed": round(base / t, 3), "verifier_cost": round(sum(p.verifier_ms for p in fast) / base, 3),
                       "plain_share": round(sum(p.plain_tokens for p in fast) / max(1, sum(p.tokens for p in fast)), 3),
                       "rounds_by_depth": dict(sorted(rounds.items())),
                       "fixed_best_k": best_k, "fixed_speed": round(base / fixed[best_k], 3),
                       "cost_floor_at_1x": None if floor is None else round(floor / base, 3),
                       "pareto": [{"speed": round(base / pt, 3), "cost": round(pv / base, 3)}
                                  for pt, pv in sorted({(t, v) for _, t, v in sweep})]}
    return out



def cut_lengths(logps: Sequence[Sequence[float]], min_p: float, depth: int) -> list[int]:
    """Per position, the length of a chain of at most ``depth`` cut by the drafter's confidence: it ends at the
    first node whose path log-probability (``logps[i]``, the chain drafted there, node by node) is below log
    ``min_p``, that node kept (its children could be no likelier than it). The first node always goes."""
    floor = math.log(min_p) if min_p > 0 else -math.inf
    out = []
    for lp in logps:
        n = min(depth, len(lp))
        out.append(max(1, next((j + 1 for j in range(n) if lp[j] < floor), n)))
    return out


def cut_schedule(runs: Sequence[int], lengths: Sequence[int], costs: Costs, family: str) -> tuple[float, float]:
    """(time ms, verifier ms) of lock-step rounds over one output whose chain at position ``i`` is
    ``lengths[i]`` long (``cut_lengths``): a realisable policy, not an oracle. ``proactive`` as in ``oracle``: a
    round whose chain and the drafter's next token held had its successor drafted during the flight."""
    if family not in CUT_FAMILIES:
        raise ValueError(f"unknown family {family!r}")
    n, i, t, v, ready = len(runs), 0, 0.0, 0.0, False
    while i < n:
        c = lengths[i]
        round_ms = costs.ready_ms(c) if ready else costs.round_ms("lockstep", c)
        ready = family == "proactive" and runs[i] > c
        t, v = t + round_ms, v + costs.verify_ms(c + 1)
        i += min(min(runs[i], c) + 1, n - i)
    return t, v


def cut_ceilings(outputs: Sequence[Sequence[int]], logps: Sequence[Sequence[Sequence[float]]], costs: Costs,
                 max_depth: int = MAX_DEPTH) -> dict:
    """What a confidence cut (``cut_lengths``) makes of fixed lock-step chains, against cloud-only decoding:
    per ``min_p``, the fastest depth's speed and verifier cost; and the cheapest (depth, ``min_p``) at least as
    fast as cloud-only decoding, with the cheapest without a cut (``min_p`` 0) beside it."""
    base = sum(len(r) for r in outputs) * costs.verify_ms(1)
    lengths = {(p, k): [cut_lengths(lp, p, k) for lp in logps] for p in MIN_PS for k in range(1, max_depth + 1)}
    out: dict = {}
    for family in CUT_FAMILIES:
        table = {}
        for (p, k), per_output in lengths.items():
            t = v = 0.0
            for runs, cut in zip(outputs, per_output):
                dt, dv = cut_schedule(runs, cut, costs, family)
                t, v = t + dt, v + dv
            table[p, k] = (base / t, v / base)

        def row(p: float, k: int, table: dict = table) -> dict:
            return {"min_p": p, "k": k, "speed": round(table[p, k][0], 3), "cost": round(table[p, k][1], 3)}

        fastest = {p: max(range(1, max_depth + 1), key=lambda k: table[p, k][0]) for p in MIN_PS}
        at_1x = [(p, k) for (p, k), (sp, _) in table.items() if sp >= 1.0]
        cheapest = min(at_1x, key=lambda pk: table[pk][1], default=None)
        plain_cut = [(p, k) for p, k in at_1x if p == 0.0]
        cheapest_uncut = min(plain_cut, key=lambda pk: table[pk][1], default=None)
        out[family] = {"fastest_by_min_p": [row(p, fastest[p]) for p in MIN_PS],
                       "cheapest_at_1x": row(*cheapest) if cheapest else None,
                       "cheapest_at_1x_no_cut": row(*cheapest_uncut) if cheapest_uncut else None}
    return out


def calibration(runs: Sequence[Sequence[int]], logps: Sequence[Sequence[Sequence[float]]]) -> list[dict]:
    """How well the drafter's path probability predicts acceptance: chain node ``j`` drafted at position ``i`` is
    accepted iff the target agrees up to it (``runs[i] > j``), and the drafter's path probability there is its
    estimate of exactly that. Per bin of path probability: nodes, mean path probability, share accepted."""
    bins: list[list[float]] = [[0, 0.0, 0] for _ in CALIBRATION_BINS[1:]]
    for out_runs, out_lp in zip(runs, logps):
        for run, lp in zip(out_runs, out_lp):
            for j, x in enumerate(lp):
                p = math.exp(x)
                b = next((i for i, hi in enumerate(CALIBRATION_BINS[1:]) if p <= hi), len(bins) - 1)
                bins[b][0] += 1
                bins[b][1] += p
                bins[b][2] += run > j
    return [{"p_from": lo, "p_to": hi, "nodes": int(n), "mean_p": round(sp / n, 3) if n else None,
             "accepted": round(a / n, 3) if n else None}
            for (lo, hi), (n, sp, a) in zip(zip(CALIBRATION_BINS, CALIBRATION_BINS[1:]), bins)]


# -- measurement --------------------------------------------------------------------------------------------------
def chain_runs(drafter, prompt: Sequence[int], out: Sequence[int], depth: int = MAX_DEPTH,
               logps: list[list[float]] | None = None) -> list[int]:
    """``L[i]`` (capped at ``depth``) by drafting a real greedy chain after every prefix of ``out``: what the engine's
    incremental cache gives, the very chains a round would send. Consecutive prefixes share the cache, so each
    costs one catch-up token and ``depth`` levels. ``logps``: where given, each chain's path log-probabilities
    under the drafter are appended to it (what a confidence cut ends the chain by)."""
    from tandem.core.tree import TreeShape
    shape = TreeShape(1, depth, depth)
    runs = []
    for i in range(len(out)):
        drafter.start(list(prompt) + list(out[:i]))
        built = drafter.draft(shape)
        chain = built.tree.tokens
        n = 0
        while n < len(chain) and i + n < len(out) and chain[n] == out[i + n]:
            n += 1
        runs.append(n)
        if logps is not None:
            logps.append([round(x, 4) for x in built.logp])
        drafter.commit(built, [], [])
    return runs


def draft_times(drafter, prompt: Sequence[int], out: Sequence[int], positions: Sequence[int],
                depth: int = MAX_DEPTH) -> list[list[float]]:
    """ms to draft a chain of k = 1..depth at each position, from the state a round leaves (its bonus token
    pending): ``times[k]`` is the list over positions."""
    from tandem.core.tree import TreeShape
    times: list[list[float]] = [[] for _ in range(depth + 1)]
    for i in positions:
        for k in range(1, depth + 1):
            drafter.start(list(prompt) + list(out[:i - 1]))
            drafter.catch_up()
            drafter.start(list(prompt) + list(out[:i]))  # the bonus token pending, as after a verdict
            t0 = time.perf_counter()
            built = drafter.draft(TreeShape(1, k, k))
            times[k].append((time.perf_counter() - t0) * 1000)
            drafter.commit(built, [], [])
    return times


def paced_on(curve: Callable[[int], float], host: Callable[[int], float]) -> Callable[[int], float]:
    """A curve as pacing reproduces it on a host whose own forwards take ``host(n)``: never faster than either."""
    return lambda n: max(curve(n), host(n))


def replay_chain(runs: Sequence[int], depth: int, start: int) -> tuple[int, int]:
    """(trees, accepted drafts) of a fixed chain of ``depth`` in lock-step rounds from position ``start`` on."""
    trees = accepted = 0
    i = start
    while i < len(runs):
        a = min(runs[i], depth)
        trees, accepted, i = trees + 1, accepted + a, i + a + 1
    return trees, accepted


def measured_ratios(path: Path) -> dict:
    """bench.network's tokens/s and verifier ms/token per profile, method and dataset, against cloud_ar's (the
    measured side of the comparison)."""
    d = json.loads(path.read_text())
    rows = d["results"]
    base = {(r["profile"], ds): v for r in rows if r["method"] == "cloud_ar" for ds, v in r["by_dataset"].items()}
    out: dict = {}
    for r in rows:
        if r["method"] == "cloud_ar":
            continue
        for ds, v in r["by_dataset"].items():
            b = base.get((r["profile"], ds))
            if b and b["edge_tokens_per_s"] and b["verifier_ms_per_token"]:
                # the steady state after the first token where the run recorded it (the oracle's ratio excludes
                # the prefill too), else whole requests
                key = "decode_tokens_per_s" if v.get("decode_tokens_per_s") and b.get("decode_tokens_per_s") \
                    else "edge_tokens_per_s"
                out.setdefault(r["profile"], {}).setdefault(r["method"], {})[ds] = {
                    "speed": round(v[key] / b[key], 3), "speed_of": key,
                    "cost": round(v["verifier_ms_per_token"] / b["verifier_ms_per_token"], 3)}
    return {"file": str(path), "simulation": d.get("simulation"), "max_new_tokens": d.get("max_new_tokens"),
            "ratios": out}


def report(result: dict, path: Path) -> None:
    lines = ["# Ceilings of chain drafting (oracle)", "",
             f"{result['prompts']} prompts ({', '.join(f'{n} {d}' for d, n in result['by_dataset_prompts'].items())}), "
             f"{result['max_new_tokens']} new tokens, temperature {result.get('temperature', 0.0):g}"
             + (f" (seed {result['seed']})" if result.get("seed") is not None else "")
             + f"; target {result['target']}, drafter "
             f"{result['drafter']}, drafting on {result['drafter_threads']} thread(s) of {result['cpu']}. "
             "Times are the cost curve's (verifier) and this CPU's (drafter); the link is its round trip only.", "",
             "An oracle that knows how much of each greedy chain the target accepts picks, per position, cloud-only "
             "decoding or a chain of depth 1..8 (switches free). `lockstep`: draft + round trip + verify; "
             "`proactive`: the same, with the next chain drafted during the flight where the guess that this one and "
             "the drafter's next token are accepted holds; `overlapped`: drafting and the round trip hidden behind "
             "the verifier (max of the two; a loose bound: streamed drafts are a round trip stale). Speed: "
             "cloud-only decode time over the oracle's, TTFT excluded: ceilings for policies of each family (lock-step "
             "ones for the first two, streamed ones too for the third). Cost floor: least verifier time per token at "
             ">= 1.0x speed, against cloud-only (a dual lower bound). `fixed k`: the best "
             "single chain depth, every round, no cloud-only steps.", "",
             "Drafter acceptance: "
             + ", ".join(f"{ds} {v['agree']:.2f} of positions, mean run {v['mean_run']:.2f}"
                         for ds, v in result["acceptance"].items()) + ". Chain draft ms by depth: "
             + ", ".join(f"{k}: {ms:.0f}" for k, ms in enumerate(result["draft_ms"]) if k) + ".", "",
             "| curve | link | dataset | speed: lockstep / proactive / overlapped "
             "| fixed k (lockstep / proactive / overlapped) | cost floor at 1.0x (lockstep / proactive / overlapped) "
             "| measured (bench.network: speed / cost) |",
             "|---|---|---|---|---|---|---|"]
    measured = (result.get("measured") or {}).get("ratios", {})
    for c in result["ceilings"]:
        for ds, v in c["by_dataset"].items():
            fam = [v[f] for f in FAMILIES]

            def floor(x):
                return "-" if x is None else f"{x:.2f}x"
            meas = ""
            if c["measured_here"]:
                meas = "; ".join(f"{m} {r[ds]['speed']:.2f}x / {r[ds]['cost']:.2f}x"
                                 for m, r in measured.get(c["link"], {}).items() if ds in r)
            lines.append(f"| {c['curve']} | {c['link']} | {ds} | "
                         + " / ".join(f"{x['speed']:.2f}x" for x in fam) + " | "
                         + " / ".join(f"{x['fixed_speed']:.2f}x (k={x['fixed_best_k']})" for x in fam) + " | "
                         + " / ".join(floor(x["cost_floor_at_1x"]) for x in fam) + f" | {meas or '-'} |")
    if result.get("measured"):
        kinds = {x.get("speed_of", "edge_tokens_per_s") for m in measured.values() for r in m.values()
                 for x in r.values()}
        what = ("tokens/s after the first token, as the oracle's" if kinds == {"decode_tokens_per_s"} else
                "tokens/s of whole requests, TTFT included, so diluted towards 1.0 against these")
        lines += ["", f"Measured column: `{result['measured']['file']}` ({result['measured']['max_new_tokens']} new "
                      f"tokens; speed is {what}; cost is verifier time per token)."]
    lines += ["", "Confidence cut (a chain ends at its first node whose path probability under the drafter is "
              "below min_p, that node kept): fixed lock-step chains of depth k, realisable (no oracle), every round "
              "a chain. Fastest: the best (k, min_p) by speed, beside the best k uncut; cheapest: least verifier time "
              "per token at >= 1.0x speed, uncut / cut.", "",
              "| curve | link | dataset | family | fastest uncut | fastest cut | cheapest at 1.0x uncut "
              "| cheapest at 1.0x cut |", "|---|---|---|---|---|---|---|---|"]

    def cell(x: dict | None) -> str:
        return "-" if x is None else f"{x['speed']:.2f}x / {x['cost']:.2f}x (k={x['k']}, min_p {x['min_p']:g})"
    for c in result["ceilings"]:
        for ds, v in c["by_dataset"].items():
            for family, x in v.get("cut", {}).items():
                rows = x["fastest_by_min_p"]
                best = max(rows, key=lambda r: r["speed"])
                lines.append(f"| {c['curve']} | {c['link']} | {ds} | {family} | {cell(rows[0])} | {cell(best)} | "
                             f"{cell(x['cheapest_at_1x_no_cut'])} | {cell(x['cheapest_at_1x'])} |")
    if result.get("calibration"):
        lines += ["", "Drafter calibration (chain nodes by path probability: mean probability -> share accepted): "
                  + "; ".join(ds + ": " + ", ".join(f"{b['mean_p']:.2f}->{b['accepted']:.2f} ({b['nodes']})"
                                                    for b in bins if b["nodes"])
                              for ds, bins in result["calibration"].items()) + "."]
    c = result["check"]
    lines += ["", f"Model check: a lock-step chain of {c['depth']} through gRPC on localhost accepted "
                  f"{c['accepted_per_tree_measured']:.3f} drafts per tree ({c['trees_measured']} trees) against "
                  f"{c['accepted_per_tree_oracle']:.3f} ({c['trees_oracle']}) replayed from the chains; outputs "
                  f"against target-only decoding: {c['verdicts']}."]
    if result.get("plots"):
        lines += ["", *(f"![{Path(p).name}]({Path(p).name})" for p in result["plots"])]
    path.write_text("\n".join(lines) + "\n")


def plot(result: dict, path: Path) -> list[str]:
    plt = pyplot()
    if plt is None:
        return []
    sel = [c for c in result["ceilings"] if c["link"] == "metro"]
    if not sel:
        return []
    fig, axes = plt.subplots(1, len(sel), figsize=(5 * len(sel), 4), squeeze=False)
    for ax, c in zip(axes[0], sel):
        for ds, v in c["by_dataset"].items():
            for family, style in zip(FAMILIES, ("-", "-.", "--")):
                pts = v[family]["pareto"]
                ax.plot([p["speed"] for p in pts], [p["cost"] for p in pts], style, marker=".",
                        label=f"{ds} {family}")
        ax.axvline(1.0, color="grey", lw=0.8)
        ax.set_title(f"{c['curve']}, metro", fontsize=8)
        ax.set_xlabel("speed vs cloud-only (oracle)")
        ax.set_ylabel("verifier time per token vs cloud-only")
        ax.legend(fontsize=7)
    fig.tight_layout()
    out = path.with_name("ceiling_pareto.png")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return [str(out)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.ceiling", description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=4, help="prompts per dataset (HumanEval and ShareGPT)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--drafter-engine", default="onnx", choices=("llama.cpp", "onnx"))
    ap.add_argument("--drafter-vocab", default="", help="VocabTrim head (.npy) for the onnx drafter")
    ap.add_argument("--drafter-threads", type=int, default=1, help="the edge drafter's threads (bench.network: 1)")
    ap.add_argument("--curves", default=",".join(CURVES), help="cost curves: files, or names in deploy/cost-curves")
    ap.add_argument("--links", default="metro,wan", help=f"round trips of {list(LINKS_RTT_MS)}")
    ap.add_argument("--compare", type=Path, help="a bench.network JSON to set the measured ratios beside")
    ap.add_argument("--host-curve", default="",
                    help="this host's own verifier curve: adds the compared run's curve as pacing gave it here, "
                         "max(curve, host) per token count (pacing cannot make a forward faster than it is)")
    ap.add_argument("--check-depth", type=int, default=4, help="the lock-step chain of the model check")
    ap.add_argument("--chain-depth", type=int, default=MAX_DEPTH + 1,
                    help="the recorded chains' depth (runs are capped there; bench.capacity replays up to it)")
    ap.add_argument("--answer-lengths", type=int, default=0,
                    help="also record the lengths (target tokens) of this many ShareGPT answers (bench.capacity's "
                         "request lengths)")
    ap.add_argument("--max-check-error", type=float, default=0.1,
                    help="fail when the check's accepted drafts per tree are off the chains' by more than this")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sample the target's answers (with --seed): acceptance traces at this temperature (a drafted "
                         "token is accepted when it is the token the verifier's keyed draw picks)")
    ap.add_argument("--seed", type=int, default=1, help="the draws' seed when --temperature > 0")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--report", type=Path, default=Path("bench/out/ceiling.md"))
    args = ap.parse_args(argv)
    if not 1 <= args.check_depth <= MAX_DEPTH:
        ap.error(f"--check-depth must be 1..{MAX_DEPTH}")
    if args.chain_depth < MAX_DEPTH + 1:
        ap.error(f"--chain-depth must be at least {MAX_DEPTH + 1} (the ceilings' deepest chain and one more)")
    links = [x.strip() for x in args.links.split(",") if x.strip()]
    if bad := [x for x in links if x not in LINKS_RTT_MS]:
        ap.error(f"unknown link {bad}; known: {list(LINKS_RTT_MS)}")
    curve_paths = [curve_path(c) for c in args.curves.split(",") if c]
    if missing := [str(c) for c in curve_paths if not c.exists()]:
        ap.error(f"no such cost curve {missing}")

    from tandem.cloud import reference
    from tandem.cloud.engines.llama_engine import LlamaVerifierEngine
    from tandem.cloud.engines.pacing import CostCurve
    from tandem.cloud.server import serve
    from tandem.core import logs
    from tandem.core.sampling import Sampling
    from tandem.core.tree import TreeShape
    from tandem.edge.client import EdgeClient
    from tandem.edge.drafter import load_drafter
    from tandem.orchestrator import models
    from tandem.orchestrator.datasets import humaneval, humaneval_messages, sharegpt, sharegpt_replies
    logs.configure()
    curves = [CostCurve.load(c) for c in curve_paths]
    t_start = time.perf_counter()
    target, drafter_path = models.fetch("target"), models.fetch("drafter")
    engine = LlamaVerifierEngine(target, n_ctx=4096, n_threads=os.cpu_count() or 1, max_sessions=2)
    tok = engine.model
    chats = [("humaneval", humaneval_messages(p)) for p in humaneval(args.limit)] + \
        [("sharegpt", c) for c in sharegpt(args.limit)]
    prompts = [tok.tokenize(tok.chat_prompt(m)) for _, m in chats]
    datasets = [d for d, _ in chats]
    refs = []
    # at temperature > 0 the verifier's draw at a position is keyed by the seed and the position, whatever was
    # drafted: a drafter's greedy chain holds as far as it agrees with the target's sampled answer, as at T = 0
    sampling = Sampling(temperature=args.temperature, seed=args.seed if args.temperature > 0 else None)
    for i, p in enumerate(prompts):
        refs.append(reference.decode(engine, p, args.max_new_tokens, sampling))
        _progress(f"reference {i + 1}/{len(prompts)}: {len(refs[-1].tokens)} tokens")
    noise = max(reference.batch_shape_noise(engine, p, r.tokens[:8]) for p, r in zip(prompts[:2], refs[:2]))
    if args.drafter_engine == "onnx":
        from tandem.edge.export.onnx_export import export
        export(drafter_path)
        kw = {"vocab": str(Path(args.drafter_vocab).resolve()), "learn_vocab": False} if args.drafter_vocab else {}
    else:
        kw = {}
    drafter = load_drafter(args.drafter_engine, model_path=str(drafter_path), n_ctx=4096,
                           n_threads=args.drafter_threads, **kw)

    # the model check first, while the verifier may use every core: lock-step chain rounds as the product runs them
    server, port = serve(engine, "127.0.0.1:0", max_sessions=2)
    client = EdgeClient(drafter, f"127.0.0.1:{port}", TreeShape(1, args.check_depth, args.check_depth), stream=False)
    check_stats, verdicts = [], []
    for i, (p, ref) in enumerate(zip(prompts, refs)):
        gen = client.generate(p, max_new_tokens=args.max_new_tokens, sampling=sampling).result()
        s = gen.stats
        check_stats.append((s.streamed_tokens, s.trees, s.accepted_tokens))
        verdicts.append((reference.classify_sampled(gen.tokens, ref) if args.temperature > 0 else
                         reference.classify(gen.tokens, ref, noise))[0])
        _progress(f"check {i + 1}/{len(prompts)}: {verdicts[-1]}, {s.trees} trees, {s.accepted_tokens} accepted, "
                  f"{s.streamed_tokens} streamed")
    client.close()
    server.stop(grace=None)

    if hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) > args.drafter_threads:
        os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:args.drafter_threads]))  # the edge's core(s)
    runs, logps, times = [], [], [[] for _ in range(MAX_DEPTH + 1)]
    for i, (p, ref) in enumerate(zip(prompts, refs)):
        t0 = time.perf_counter()
        logps.append([])
        runs.append(chain_runs(drafter, p, ref.tokens, args.chain_depth, logps[-1]))
        n = len(ref.tokens)
        for k, ts in enumerate(draft_times(drafter, p, ref.tokens, range(1, n, max(1, n // 4)))):
            times[k] += ts
        _progress(f"chains {i + 1}/{len(prompts)} ({datasets[i]}): agree {sum(r > 0 for r in runs[-1]) / n:.2f}, "
                  f"{time.perf_counter() - t0:.0f} s")
    draft_ms = [0.0] + [statistics.median(t) for t in times[1:]]

    # the model check: the trees a fixed chain makes, and what they accept, from the chains, against what the
    # product measured. Lock-step clients stream from the verifier until the drafter is ready (the prefill's token
    # first), then every round is a tree: trees start at the streamed count.
    model = [replay_chain(r, args.check_depth, streamed) for r, (streamed, _, _) in zip(runs, check_stats)]
    per_tree_model = sum(a for _, a in model) / max(1, sum(t for t, _ in model))
    per_tree_measured = sum(a for _, _, a in check_stats) / max(1, sum(t for _, t, _ in check_stats))
    check_error = abs(per_tree_measured - per_tree_model) / max(per_tree_model, 1e-9)
    check = {"depth": args.check_depth, "accepted_per_tree_oracle": round(per_tree_model, 3),
             "accepted_per_tree_measured": round(per_tree_measured, 3), "error": round(check_error, 3),
             "trees_oracle": sum(t for t, _ in model), "trees_measured": sum(t for _, t, _ in check_stats),
             "verdicts": {v: verdicts.count(v) for v in sorted(set(verdicts))}}

    measured = measured_ratios(args.compare) if args.compare else None
    sim_curve = ((measured or {}).get("simulation") or {}).get("curve")
    host = None
    if args.host_curve:
        hp = curve_path(args.host_curve)
        host = CostCurve.load(hp)
    regimes = [(c, p.name, c.label, sim_curve == p.name) for c, p in zip(curves, curve_paths)]
    if host is not None:
        for c, p in zip(curves, curve_paths):
            if sim_curve == p.name:  # the regime the compared bench.network run really had on this host
                regimes.append((paced_on(c, host), f"{p.name} paced on {Path(args.host_curve).name}",
                                "simulated on this host", True))
    out_ceilings = []
    for curve, name, label, here in regimes:
        for link in links:
            costs = Costs(curve, draft_ms, LINKS_RTT_MS[link])
            by_ds = {ds: ceilings([r for r, d in zip(runs, datasets) if d == ds], costs)
                     for ds in dict.fromkeys(datasets)}
            for ds, v in by_ds.items():
                v["cut"] = cut_ceilings([r for r, d in zip(runs, datasets) if d == ds],
                                        [lp for lp, d in zip(logps, datasets) if d == ds], costs)
            out_ceilings.append({"curve": name, "label": label, "link": link,
                                 "rtt_ms": LINKS_RTT_MS[link], "verify_1_ms": round(curve(1), 2),
                                 "by_dataset": by_ds, "measured_here": here})
    acceptance = {ds: {"agree": round(statistics.fmean(x > 0 for r, d in zip(runs, datasets) if d == ds for x in r), 3),
                       "mean_run": round(statistics.fmean(x for r, d in zip(runs, datasets) if d == ds for x in r), 3)}
                  for ds in dict.fromkeys(datasets)}
    cpu = cpu_name()
    ok = verdicts.count("other") == 0 and check_error <= args.max_check_error
    result = {"ok": ok, "prompts": len(prompts),
              "by_dataset_prompts": {d: datasets.count(d) for d in dict.fromkeys(datasets)},
              "max_new_tokens": args.max_new_tokens, "limit": args.limit, "target": Path(target).name,
              "drafter": Path(drafter_path).name + (f" ({args.drafter_engine}"
                                                   + (f", head {Path(args.drafter_vocab).name})" if args.drafter_vocab
                                                      else ")")),
              "drafter_threads": args.drafter_threads, "cpu": cpu, "draft_ms": [round(x, 2) for x in draft_ms],
              "acceptance": acceptance, "runs": runs, "datasets": datasets, "check": check, "chain_logps": logps,
              "calibration": {ds: calibration([r for r, d in zip(runs, datasets) if d == ds],
                                              [lp for lp, d in zip(logps, datasets) if d == ds])
                              for ds in dict.fromkeys(datasets)},
              "ceilings": out_ceilings, "measured": measured, "bench_s": round(time.perf_counter() - t_start, 1),
              "prompt_tokens": [len(p) for p in prompts], "chain_depth": args.chain_depth,
              "temperature": args.temperature, "seed": args.seed if args.temperature > 0 else None}
    if args.answer_lengths:
        replies = sharegpt_replies(max_bytes=4_000_000)[:args.answer_lengths]
        result["answer_tokens"] = [len(tok.tokenize(r, special=False)) for r in replies]
    args.report.parent.mkdir(parents=True, exist_ok=True)
    result["plots"] = plot(result, args.report)
    return finish(result, args.json, report, args.report, ok,
                  "a lock-step output diverged from target-only decoding, or the chains mispredict its rounds",
                  "ceiling")


if __name__ == "__main__":
    sys.exit(main())
