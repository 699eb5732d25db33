"""One simulated configuration: ``clients`` devices of one method, each a closed loop (think, ask, read the whole
answer, think again), sharing ``replicas`` verifiers through the orchestrator's own placement, measured over a
window after a warm-up.

A device thinks for an exponential time (mean ``think_s``; 0: it asks again at once, so clients = concurrent
sessions) and asks for an answer of ``answer_tokens`` (or a length drawn from the traces' recorded answers). The
pool admits a session where ``orchestrator.pool.placement`` puts it; when every replica holds its most sessions
(the KV memory's limit) the request waits for one to end, and its time to first token grows.

Measures: per request, the time to first token (from asking to the first token on the device) and the time per
output token after it (``(last - first) / (n - 1)``: the inter-token latency ``itl_*``, bursts averaged over the
answer, as serving benchmarks report it); the raw gaps between tokens arriving (``gap_*``: a speculative round's
burst shows as one long gap and zeros); per run, tokens the devices received in the window, GPU busy time,
forward tokens per committed token (what speculation spends), forwards past the cost curve.
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
from .physics import Device, Forward
from .replica import Replica
from .server_clients import ServerAR, ServerSD
from .traces import Traces

SERVER = ("server_ar", "server_sd")
TANDEM = ("tandem_streamed", "tandem_lockstep", "tandem_adaptive")
METHODS = SERVER + TANDEM


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
    batched_prefill: bool = False
    depth: int = 0  # the fixed chain of server_sd, tandem_streamed, tandem_lockstep
    seed: int = 0


@dataclass
class Request:
    start: float
    asked: int
    tokens: int = 0
    first: float = -1.0
    last: float = -1.0
    in_window: int = 0  # tokens received inside the measuring window


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
        return DraftPolicy(PolicyConfig(widths=(1,)))  # chains: the traces replay chains, not trees
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
        if cfg.method.startswith("tandem"):
            self.client = EdgeClient(w.sim, w.pool, self.planner, cfg.device, text, n, self.up, self.down, sid,
                                     partition=f"device-{self.i}", on_end=self._ended, on_emit=self._emit)
        else:
            kind = ServerSD if cfg.method == "server_sd" else ServerAR
            kw = {"depth": cfg.depth} if cfg.method == "server_sd" else {}
            self.client = kind(w.sim, w.pool, text, n, self.up, self.down, sid, on_end=self._ended,
                               on_emit=self._emit, **kw)

    def _emit(self, n: int) -> None:
        r, now, w = self.request, self.world.sim.now, self.world
        if w.t0 <= now < w.t1:
            r.in_window += n
            if r.first >= 0:  # the gaps a reader sees: the wait for the first token of a burst, none for the rest
                w.gaps.append(1000 * (now - r.last))
                w.gaps.extend([0.0] * (n - 1))
        if r.first < 0:
            r.first = now
        r.last, r.tokens = now, r.tokens + n

    def _ended(self, _client) -> None:
        self.world.done.append(self.request)
        self.request = self.client = None
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
        replicas = {f"r{i:02d}": Replica(self.sim, cfg.forward, cfg.drafter, cfg.window_ms, cfg.max_batch_tokens,
                                         cfg.budget_tokens, cfg.batched_prefill) for i in range(cfg.replicas)}
        prompt = statistics.fmean(t.prompt_tokens for t in self.traces.texts)
        longest = cfg.answer_tokens or max(self.traces.answer_tokens)
        self.pool = Pool(replicas, cfg.forward.max_sessions(int(prompt) + longest))
        self.devices = [User(self, i) for i in range(cfg.clients)]

    def run(self) -> dict:
        cfg, sim = self.cfg, self.sim
        busy: dict[str, float] = {}
        ramp = max(1.0, cfg.warmup_s / 2)  # first arrivals spread over half the warm-up: a ramp, not one burst
        for d in self.devices:
            sim.at(d.rng.random() * ramp, d.ask)
        sim.at(self.t0, lambda: busy.update(start=self._busy()))
        sim.at(self.t1, lambda: busy.update(end=self._busy()))
        sim.run(self.t1)
        window = [r for r in self.done if r.start >= self.t0 and r.last <= self.t1]
        open_ = [d.request for d in self.devices if d.request is not None]
        tokens = sum(r.in_window for r in self.done) + sum(r.in_window for r in open_)
        tpot = sorted(1000 * (r.last - r.first) / (r.tokens - 1) for r in window if r.tokens > 1)
        ttft = sorted(1000 * (r.first - r.start) for r in window if r.first >= 0)
        ttft += [1000 * (self.t1 - r.start) for r in open_ if r.first < 0 and r.start <= self.t1 - 1]
        ttft.sort()  # requests still waiting for a first token count with a lower bound of their wait
        gaps = sorted(self.gaps)
        reps = self.pool.replicas.values()
        gpu_s = (busy["end"] - busy["start"]) / 1000
        forwards, batches = sum(r.forwards for r in reps), sum(r.batches for r in reps)
        verifies = sum(r.verifies for r in reps)
        return {"requests": len(window), "tokens": tokens,
                "wrong_length": sum(r.tokens != r.asked for r in self.done),
                "itl_p50_ms": _pct(tpot, 50), "itl_p99_ms": _pct(tpot, 99),
                "ttft_p50_ms": _pct(ttft, 50), "ttft_p99_ms": _pct(ttft, 99),
                "gap_p50_ms": _pct(gaps, 50), "gap_p99_ms": _pct(gaps, 99),
                "client_tokens_per_s": round(statistics.fmean(1000 / x for x in tpot if x > 0), 2)
                if any(tpot) else 0.0,
                "server_tokens_per_s": round(tokens / cfg.duration_s, 1),
                "server_tokens_per_s_per_gpu": round(tokens / cfg.duration_s / cfg.replicas, 1),
                "gpu_s_per_1k_tokens": round(1000 * gpu_s / tokens, 4) if tokens else None,
                "gpu_busy": round(gpu_s / (cfg.duration_s * cfg.replicas), 3),
                "waiting": len(self.pool.waiting),
                "forward_ms_mean": round(sum(r.forward_ms for r in reps) / max(1, batches), 2),
                "forward_tokens_mean": round(sum(r.forward_tokens for r in reps) / max(1, batches), 1),
                "queue_ms_mean": round(sum(r.queue_ms for r in reps) / max(1, verifies), 2),
                "tokens_per_verify": round(sum(r.committed for r in reps) / max(1, verifies), 3),
                "forward_tokens_per_token": round(sum(r.forward_tokens for r in reps) /
                                                  max(1, sum(r.committed for r in reps)), 3),
                "beyond_curve_share": round(sum(r.beyond for r in reps) / forwards, 4) if forwards else 0.0}

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
