"""One simulated configuration: ``clients`` devices of one method, each a closed loop (think, ask, read the whole
answer, think again), sharing ``replicas`` verifiers through the orchestrator's own placement, measured over a
window after a warm-up.

A device thinks for an exponential time (mean ``think_s``; 0: it asks again at once, so clients = concurrent
sessions) and asks for an answer of ``answer_tokens`` (or a length drawn from the traces' recorded answers). The
pool admits a session where ``orchestrator.pool.placement`` puts it; when every replica holds its most sessions
(the KV memory's limit, paged: the context plus a mean prompt and answer per session) the request waits for one to
end, and its time to first token grows.

Context (``context_tokens`` C): a conversation of about C tokens. Code and chat traffic carry it from earlier turns:
the verifier's prefix cache and the device's kept drafter cells hold all but the new turn (the traced prompt), which
alone is computed. Long-context traffic (``fresh_context``) brings a new document of C tokens with every request:
all of it is prefilled on the GPU, and a drafting device catches up on all of it first.

Measures: per request, the time to first token (from asking to the first token on the device; requests asked in the
window) and the time per output token (``(last - first) / (n - 1)`` over the n >= ``MIN_ITL_TOKENS`` tokens it
received inside the window: the inter-token latency ``itl_*``, bursts averaged, as serving benchmarks report it; an
answer longer than the window counts by its part inside it, so long answers are never left out); whole answers of 2-3
tokens are reported apart (``itl_short_*``: one speculative burst a round after the first token sets their figure);
the raw gaps between tokens arriving (``gap_*``); per run, tokens the devices received in the window, GPU busy time,
forward tokens per committed token (what speculation spends), forwards past the cost curve, the GPU's share spent on
prompts and on server-side drafting. ``samples`` keeps the raw lists so that runs of several seeds pool into one
percentile (``summarize``).
"""
from __future__ import annotations

import math
import random
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from tandem.core.tree import TreeShape
from tandem.edge.planner import FixedPlanner
from tandem.edge.policy import DraftPolicy, PolicyConfig
from tandem.orchestrator.pool.placement import NoCapacity, Placement

from ..linkproxy import LinkProfile
from .edge_client import EdgeClient
from .events import Link, Sim
from .host import SimHost
from .lockstep import DepthPolicy, LockstepReplica
from .physics import LAPTOP, BeyondCurve, Device, Forward
from .replica import Replica
from .server_clients import ServerAR, ServerSD, eagle_text
from .traces import Traces

SERVER = ("server_ar", "server_sd", "server_eagle")
TANDEM = ("tandem_streamed", "tandem_lockstep", "tandem_adaptive")
METHODS = SERVER + TANDEM
LOCKSTEP = ("server_sd", "server_eagle")
MIN_ITL_TOKENS = 4  # answers shorter than this are reported apart
RAMP_S = 5.0  # the first arrivals spread over half the warm-up, at most this
# EAGLE-class acceptance, from published acceptance lengths: the public EAGLE-3 checkpoint for Llama-3.1-8B
# (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B) commits 2.77 tokens per verify on MT-bench and 3.49 on HumanEval with chains
# of 7 (temperature 1; the nebius/EAGLE3-Llama-3.3-70B-Instruct model card's comparison table). A flat acceptance by
# depth a gives 1 + a + ... + a^7 = those: a = 0.65 (chat), 0.74 (code). Published, not ours: labelled.
EAGLE_ALPHA = {"humaneval": 0.74, "sharegpt": 0.65}


@dataclass(frozen=True)
class Config:
    method: str
    dataset: str
    clients: int
    replicas: int
    forward: Forward
    device: Device
    link: LinkProfile
    drafter: Forward | None = None  # server_sd's drafter on the GPU
    answer_tokens: int = 256  # 0: drawn from the traces' recorded answer lengths
    think_s: float = 0.0
    warmup_s: float = 20.0
    duration_s: float = 60.0
    window_ms: float = 2.0
    max_batch_tokens: int = 4096
    budget_tokens: int = 0
    batched_prefill: bool = True  # prompts in the verify forwards, in chunks (the product's scheduler)
    depth: int = 0  # the fixed chain of tandem_streamed, tandem_lockstep
    seed: int = 0
    context_tokens: int = 0  # a conversation of about this many tokens (0: the traced prompt alone)
    fresh_context: bool = False  # the context is a new document every request (long-context traffic)
    widths: tuple[int, ...] = (1, 2)  # tree widths the draft policy prices (1: chains)
    eagle_drafter: Forward | None = None  # server_eagle's draft head on the GPU
    max_depth: int = 8  # server-side speculation's deepest chain
    host_ms_per_verdict: float = 0.0  # the verifier host's serial time per verdict (replica.Replica; 0: none)
    host_slots: int = 0  # drafters on each replica's host for the sessions that ask (capsim.host; 0: none) ...
    host_device: Device | None = None  # ... at this device class's pace (None: a laptop's)


@dataclass
class Request:
    start: float
    asked: int
    tokens: int = 0
    first: float = -1.0
    last: float = -1.0
    in_window: int = 0  # tokens received inside the measuring window
    win_first: float = -1.0  # when the first of them arrived ...
    win_last: float = -1.0  # ... and the last


def received(r: Request, n: int, now: float, t0: float, t1: float, gaps: list[float]) -> None:
    """``n`` tokens of request ``r`` reached the user at ``now``; a measuring window [t0, t1) (one definition for
    the simulated devices and the real ones of ``bench.scale``)."""
    if t0 <= now < t1:
        r.in_window += n
        if r.win_first < 0:
            r.win_first = now
        r.win_last = now
        if r.first >= 0:  # the gaps a reader sees: the wait for the first token of a burst, none for the rest
            gaps.append(1000 * (now - r.last))
            gaps.extend([0.0] * (n - 1))
    if r.first < 0:
        r.first = now
    r.last, r.tokens = now, r.tokens + n


def request_measures(done: list[Request], open_: list[Request], t0: float, t1: float) -> dict:
    """Per-request measures of a window [t0, t1): ``done`` ended inside the run, ``open_`` had not by t1."""
    tokens = sum(r.in_window for r in done) + sum(r.in_window for r in open_)
    # every answer's time per output token over the tokens it received in the window (at least 4): long answers
    # count as surely as short ones, whatever the window's length; whole answers of 2-3 tokens apart
    tpot = [1000 * (r.win_last - r.win_first) / (r.in_window - 1) for r in done + open_
            if r.in_window >= MIN_ITL_TOKENS]
    window = [r for r in done if t0 <= r.first and r.last <= t1]
    short = [1000 * (r.last - r.first) / (r.tokens - 1) for r in window if 1 < r.tokens < MIN_ITL_TOKENS]
    # first tokens of the requests asked in the window; one still waiting counts with a lower bound of its wait
    asked = [r for r in done + open_ if t0 <= r.start <= t1 - 1]
    ttft = [1000 * ((r.first if r.first >= 0 else t1) - r.start) for r in asked]
    return {"requests": len(tpot), "tokens": tokens, "wrong_length": sum(r.tokens != r.asked for r in done),
            "tpot": tpot, "tpot_short": short, "ttft": ttft}


class Pool:
    """The replicas behind the orchestrator's placement; a request that finds them all full waits its turn."""

    def __init__(self, replicas: dict[str, Replica], max_sessions: int):
        self.replicas = replicas
        self.placement = Placement({r: max_sessions for r in replicas}, remember=0)
        self.waiting: deque[tuple[str, Callable[[Replica], None]]] = deque()

    def admit(self, sid: str, opened: Callable[[Replica], None]) -> None:
        if self.waiting:
            self.waiting.append((sid, opened))
            return
        try:
            opened(self.replicas[self.placement.place(sid)])
        except NoCapacity:
            self.waiting.append((sid, opened))

    def release(self, sid: str) -> None:
        self.placement.release(sid)
        while self.waiting:
            sid, opened = self.waiting[0]
            try:
                replica = self.replicas[self.placement.place(sid)]
            except NoCapacity:
                return
            self.waiting.popleft()
            opened(replica)


def planner_for(cfg: Config):
    if cfg.method == "tandem_adaptive":
        return DraftPolicy(PolicyConfig(widths=cfg.widths))
    if cfg.method in ("tandem_streamed", "tandem_lockstep"):
        return FixedPlanner(TreeShape(1, cfg.depth, cfg.depth), stream=cfg.method == "tandem_streamed")
    return None  # set by the caller (a replay)


class User:
    """One device's closed loop of requests."""

    def __init__(self, world: "World", i: int):
        self.world, self.i = world, i
        self.rng = random.Random(world.cfg.seed * 1_000_003 + i)
        cfg = world.cfg
        self.up, self.down = Link(world.sim, cfg.link, self.rng), Link(world.sim, cfg.link, self.rng)
        self.planner = planner_for(cfg)
        self.n = 0
        self.request: Request | None = None
        self.client = None
        self.script: list | None = None  # texts to ask once each, in order (a replay of a real run)

    def think(self) -> None:
        s = self.world.cfg.think_s
        self.world.sim.after(self.rng.expovariate(1 / s) if s > 0 else 0.0, self.ask)

    def ask(self) -> None:
        w, cfg = self.world, self.world.cfg
        if self.script is not None:
            if not self.script:
                return
            text = self.script.pop(0)
            n = min(cfg.answer_tokens, len(text.runs))
        else:
            n = cfg.answer_tokens or self.rng.choice(w.traces.answer_tokens)
            text = w.traces.request(cfg.dataset, n, self.rng)
        sid = f"d{self.i}-{self.n}"
        self.n += 1
        self.request = Request(w.sim.now, n)
        prompt, cached = w.prompt_of(text.prompt_tokens)
        if cfg.method.startswith("tandem"):
            self.client = EdgeClient(w.sim, w.pool, self.planner, cfg.device, text, n, self.up, self.down, sid,
                                     partition=f"device-{self.i}", on_end=self._ended, on_emit=self._emit,
                                     prompt_len=prompt, cached=cached, device_cached=cached,
                                     rng=random.Random(self.rng.random()), agree=w.agree,
                                     drafter_before=self.client.drafter if self.client is not None else None)
        else:
            kind = ServerSD if cfg.method in LOCKSTEP else ServerAR
            if cfg.method == "server_eagle":
                text = eagle_text(text, EAGLE_ALPHA.get(cfg.dataset, min(EAGLE_ALPHA.values())), self.rng)
            self.client = kind(w.sim, w.pool, text, n, self.up, self.down, sid, on_end=self._ended,
                               on_emit=self._emit, prompt_len=prompt, cached=cached)

    def _emit(self, n: int) -> None:
        w = self.world
        received(self.request, n, w.sim.now, w.t0, w.t1, w.gaps)

    def _ended(self, _client) -> None:
        self.world.done.append(self.request)
        self.request = None  # (the client stays: its drafter may still run its last job, which the next one awaits)
        self.think()


@dataclass
class World:
    cfg: Config
    traces: Traces
    sim: Sim = field(default_factory=Sim)
    done: list[Request] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)  # ms between tokens arriving, in the window

    def __post_init__(self):
        cfg = self.cfg
        self.t0, self.t1 = cfg.warmup_s, cfg.warmup_s + cfg.duration_s
        self.ramp_s = max(1.0, min(cfg.warmup_s / 2, RAMP_S))
        self.refused = ""
        # a measured curve prices no forward past its last point: forwards are capped there (prompts in pieces)
        self.max_batch_tokens = cfg.max_batch_tokens if cfg.forward.allows(cfg.max_batch_tokens) else \
            cfg.forward.curve.tokens[-1]
        if cfg.method in LOCKSTEP:
            drafter = cfg.eagle_drafter if cfg.method == "server_eagle" else cfg.drafter
            replicas = {f"r{i:02d}": LockstepReplica(self.sim, cfg.forward, drafter, cfg.window_ms,
                                                     self.max_batch_tokens, 0, cfg.batched_prefill,
                                                     DepthPolicy(cfg.max_depth)) for i in range(cfg.replicas)}
        else:
            drafter = None
            replicas = {f"r{i:02d}": Replica(self.sim, cfg.forward, None, cfg.window_ms, self.max_batch_tokens,
                                             cfg.budget_tokens, cfg.batched_prefill, cfg.host_ms_per_verdict)
                        for i in range(cfg.replicas)}
        texts = [t for t in self.traces.texts if t.dataset == cfg.dataset] or self.traces.texts
        prompt = statistics.fmean(self.prompt_of(t.prompt_tokens)[0] for t in texts)
        answer = cfg.answer_tokens or statistics.fmean(self.traces.answer_tokens)
        kv_share = 1.0  # a drafter on the GPU keeps its own KV beside the target's
        if drafter is not None and drafter.kv_tokens and cfg.forward.kv_tokens:
            kv_share = 1 / (1 + cfg.forward.kv_tokens / drafter.kv_tokens)
        self.pool = Pool(replicas, max(1, int(kv_share * cfg.forward.max_sessions(int(prompt + answer)))))
        self.agree = self.traces.acceptance(cfg.dataset) if cfg.dataset in self.traces.datasets() else 0.8
        if cfg.host_slots and cfg.method not in LOCKSTEP:
            for r in replicas.values():
                r.host = SimHost(self.sim, cfg.host_device or LAPTOP, cfg.host_slots, self.agree)
        self.devices = [User(self, i) for i in range(cfg.clients)]

    def prompt_of(self, traced: int) -> tuple[int, int]:
        """(the whole prompt, the part of it already cached) for a request whose new turn is ``traced`` tokens."""
        c = self.cfg.context_tokens
        if not c:
            return traced, 0
        if self.cfg.fresh_context:
            return max(c, traced), 0
        return max(c, traced), max(0, c - traced)

    def run(self) -> dict:
        return summarize([self.samples()], self.cfg)

    def samples(self) -> dict:
        """The run's raw measures (to pool with other seeds' in ``summarize``)."""
        cfg, sim = self.cfg, self.sim
        busy: dict[str, float] = {}
        for d in self.devices:  # first arrivals spread over half the warm-up: a ramp, not one burst
            sim.at(d.rng.random() * self.ramp_s, d.ask)
        sim.at(self.t0, lambda: busy.update(start=self._busy()))
        sim.at(self.t1, lambda: busy.update(end=self._busy()))
        try:
            sim.run(self.t1)
        except BeyondCurve as e:
            self.refused = str(e)
            busy.setdefault("start", 0.0)
            busy["end"] = self._busy()
        open_ = [d.request for d in self.devices if d.request is not None]
        reps = list(self.pool.replicas.values())
        keys = ("forwards", "batches", "verifies", "committed", "forward_ms", "forward_tokens", "queue_ms", "beyond",
                "prefill_ms", "busy_ms")
        sums = {k: sum(getattr(r, k) for r in reps) for k in keys}
        sums["drafter_ms"] = sum(getattr(r, "drafter_ms", 0.0) for r in reps)
        sums["drafter_refused"] = sum(getattr(r, "drafter_refused", 0) for r in reps)
        depth = [sum(x) for x in zip(*(r.depth_sessions for r in reps))] if cfg.method in LOCKSTEP else []
        return {**request_measures(self.done, open_, self.t0, self.t1), "gaps": list(self.gaps),
                "gpu_ms": busy["end"] - busy["start"], "waiting": len(self.pool.waiting), "sums": sums,
                "depth_sessions": depth, "refused": self.refused}

    def replay(self, texts: list) -> list[dict]:
        """One device asks each of ``texts`` once, in order, as a real bench run does; per request: tokens, time
        to first token, time per output token after it."""
        user = self.devices[0]
        user.script = list(texts)
        self.sim.at(0.0, user.ask)
        self.sim.run()
        return [{"dataset": t.dataset, "tokens": r.tokens, "ttft_ms": round(1000 * (r.first - r.start), 1),
                 "tpot_ms": round(1000 * (r.last - r.first) / max(1, r.tokens - 1), 2)}
                for t, r in zip(texts, self.done)]

    def replay_together(self, texts: list) -> list[dict]:
        """Device i asks ``texts[i]`` once, all at time 0; per request: tokens, first and last token (seconds).
        The replica runs the queued prompts first, one forward each, and every session's first draft finds the
        others' there: decoding starts together, as ``bench.pool --decode-together``'s barrier makes it start in
        the real run (whose engine would otherwise interleave its unpaced prefills with the first verifies)."""
        for user, text in zip(self.devices, texts):
            user.script = [text]
            self.sim.at(0.0, user.ask)
        self.sim.run()
        return [{"tokens": r.tokens, "first_s": r.first, "last_s": r.last} for r in self.done]

    def _busy(self) -> float:
        return sum(r.busy_ms for r in self.pool.replicas.values())


def _pct(xs: list[float], q: float) -> float | None:
    """Nearest-rank percentile of sorted ``xs``."""
    if not xs:
        return None
    return round(xs[max(0, math.ceil(q / 100 * len(xs)) - 1)], 2)


def summarize(runs: list[dict], cfg: Config) -> dict:
    """One row from the raw measures of runs of the same configuration (seeds): percentiles over the pooled
    requests, rates and shares over the pooled windows."""
    tpot = sorted(x for r in runs for x in r["tpot"])
    short = sorted(x for r in runs for x in r["tpot_short"])
    ttft = sorted(x for r in runs for x in r["ttft"])
    gaps = sorted(x for r in runs for x in r["gaps"])
    s = {k: sum(r["sums"][k] for r in runs) for k in runs[0]["sums"]}
    tokens, window_s = sum(r["tokens"] for r in runs), cfg.duration_s * len(runs)
    gpu_s = sum(r["gpu_ms"] for r in runs) / 1000
    depth = [sum(x) for x in zip(*(r["depth_sessions"] for r in runs))] if runs[0]["depth_sessions"] else []
    answers = len(tpot) + len(short)
    row = {"requests": sum(r["requests"] for r in runs), "tokens": tokens, "seeds": len(runs),
           "wrong_length": sum(r["wrong_length"] for r in runs),
           "itl_p50_ms": _pct(tpot, 50), "itl_p99_ms": _pct(tpot, 99),
           "itl_short_p99_ms": _pct(short, 99), "short_answers": len(short),
           "short_share": round(len(short) / answers, 4) if answers else 0.0,
           "ttft_p50_ms": _pct(ttft, 50), "ttft_p99_ms": _pct(ttft, 99),
           "gap_p50_ms": _pct(gaps, 50), "gap_p99_ms": _pct(gaps, 99),
           "client_tokens_per_s": round(statistics.fmean(1000 / x for x in tpot if x > 0), 2)
           if any(tpot) else 0.0,
           "server_tokens_per_s": round(tokens / window_s, 1),
           "server_tokens_per_s_per_gpu": round(tokens / window_s / (cfg.replicas * cfg.forward.tp), 1),
           "gpu_s_per_1k_tokens": round(1000 * gpu_s * cfg.forward.tp / tokens, 4) if tokens else None,
           "gpu_busy": round(gpu_s / (window_s * cfg.replicas), 3),
           "prefill_gpu_share": round(s["prefill_ms"] / s["busy_ms"], 3) if s["busy_ms"] else 0.0,
           "drafter_gpu_share": round(s["drafter_ms"] / s["busy_ms"], 3) if s["busy_ms"] else 0.0,
           "waiting": max(r["waiting"] for r in runs),
           "forward_ms_mean": round(s["forward_ms"] / max(1, s["batches"]), 2),
           "forward_tokens_mean": round(s["forward_tokens"] / max(1, s["batches"]), 1),
           "queue_ms_mean": round(s["queue_ms"] / max(1, s["verifies"]), 2),
           "tokens_per_verify": round(s["committed"] / max(1, s["verifies"]), 3),
           "forward_tokens_per_token": round(s["forward_tokens"] / max(1, s["committed"]), 3),
           "beyond_curve_share": round(s["beyond"] / s["forwards"], 4) if s["forwards"] else 0.0}
    if depth:
        row["depth_mean"] = round(sum(d * n for d, n in enumerate(depth)) / max(1, sum(depth)), 2)
        row["drafter_refused_steps"] = s["drafter_refused"]
    refused = next((r["refused"] for r in runs if r["refused"]), "")
    if refused:
        row["refused"] = refused
    return row

