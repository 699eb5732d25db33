"""Edge drafting across emulated links: profiles x methods on HumanEval and ShareGPT prompts, in one run.

    python -m bench.network --limit 2 --profiles local,lan,metro,wan,lossy --json bench/out/network.json

Profiles (bench/netbed.py; the link proxy is bench/linkproxy.py):

- ``local``: edge and verifier on the same cores of this host (the gateway's co-located mode), loopback only;
- ``lan`` / ``metro`` / ``wan`` / ``lossy``: the edge in one network namespace pinned to core 0, the verifier in
  another pinned to core 1, joined only through the delay proxy; bandwidth by tbf. Needs root; the bench refuses
  with a clear message where namespaces are not permitted (``--profiles local`` still runs).

Methods: ``cloud_ar`` (no drafting: the verifier decodes and streams every token), ``chain4`` (fixed chain of 4)
and ``tree`` (fixed tree 2,10,5), both drafted while the verifier streams and rebased onto its tokens,
``adaptive`` (edge.policy, latency objective), ``adaptive_proactive`` (+ drafting while a verdict is in
flight), ``adaptive_cost`` (cloud-cost objective: fewest verifier forwards without being slower than cloud_ar). By name
only: ``adaptive_noshadow``, ``adaptive_proactive_noshadow``, the policy without shadow chains and without the
interference gate on working alongside the verifier (the same run's A/B of that change); ``lockstep3``, a fixed
lock-step chain of 3 (a policy-free baseline); ``adaptive_proactive_cost``, the cloud-cost objective drafting
proactively (``tandem chat --objective cloud_cost --proactive``); ``cloud_ar_control``, cloud-only streaming run a
second time: the same work as ``cloud_ar``, so its ratios are the run's noise floor (``request_ratios``: whole run,
per dataset and request by request). Methods keep their order, rotated (``--rotate``), so an arm's distance from
``cloud_ar`` in ``--methods`` is its distance in time: host speed drifts over minutes, so the control placed beside
cloud_ar reads less noise than an arm placed further away (on a shared 2-core VM, 2026-12-04: 0.96-1.04x request
by request beside it, while adaptive arms that decoded every timed token cloud-only, the same work, read
0.87-1.28x).
Every method runs behind the same proxy, which counts the bytes on the wire. Reported per method and dataset:
tokens/s at the edge, TTFT and verifier busy time per token, each against cloud_ar's. For the adaptive methods
the JSON also keeps every request's policy decisions (``requests``: each phase's end and re-check, with what ran,
what it measured, the rates the choice compared and the calibration), to show why a mode ran where it lost.

The GPU regime, simulated (``--verifier-cost FILE``): the verifier computes real logits but paces every forward to
the cost curve (cloud/engines/pacing.py). Pacing only slows forwards down, so everything is slowed by one factor
``--time-scale`` (default: the smallest that keeps this CPU's measured curve under the given one): the curve, the
link delays, and the drafter's time. Ratios are those of the simulated regime; absolute rates are scaled.

Methods run prompt by prompt (drift of the host hits all alike), in the order given or, with ``--rotate``, each
prompt's order rotated by one place: on shared cores a method's place after or before ``cloud_ar`` moves its ratio
by a few per cent.

Lossless check (temperature 0): within a profile, every method's tokens must equal ``cloud_ar``'s (target-only
decoding on the same verifier) except at a measured near-tie (top-2 logit gap within the batch-shape noise);
otherwise the bench exits 1.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from tandem.core import lifetime

from .curves import CURVE_DIR
from .linkproxy import LinkProfile
from .output import finish, policy_log_since, policy_mark, policy_summary, ProbedPolicy
from bench.output import pyplot

PROFILES: dict[str, LinkProfile] = {
    "local": LinkProfile(),
    "lan": LinkProfile(one_way_ms=1.0, jitter_ms=0.2, rate_mbit=1000),
    "metro": LinkProfile(one_way_ms=10.0, jitter_ms=1.0, rate_mbit=100),
    "wan": LinkProfile(one_way_ms=40.0, jitter_ms=5.0, rate_mbit=20),
    "lossy": LinkProfile(one_way_ms=40.0, jitter_ms=5.0, loss=0.01, rate_mbit=20),
}
METHODS = ("cloud_ar", "chain4", "tree", "adaptive", "adaptive_proactive", "adaptive_cost")
# the adaptive methods as they were before shadow chains and the interference gate (an A/B in one run; not default)
ABLATIONS = ("adaptive_noshadow", "adaptive_proactive_noshadow")
# fixed baselines, by name: a lock-step chain of 3 (no policy: what a fixed choice gets, e.g. beside bench.ceiling)
BASELINES = ("lockstep3", "cloud_ar_control")
# by name: the cloud-cost objective with proactive drafting (held guesses hide a lock-step chain's drafting)
COMBOS = ("adaptive_proactive_cost",)
CPU_CURVE = CURVE_DIR / "cpu-1core-qwen2.5-coder-1.5b-q4km.json"
TREE = "2,10,5"
# enough for the policy's first phase (32 tokens) and a probe of each other mode: the streamed mode's runs up to a
# phase, and one of lock-step rounds is its entry (the drafter catching up, 10-20 tokens) and at least two trees
WARMUP_TOKENS = 128


def _progress(msg: str) -> None:
    print(f"[network] {msg}", file=sys.stderr, flush=True)


# -- edge worker (runs inside the edge namespace) -------------------------------------------------------------------
def _client(method: str, drafter, address: str):
    from tandem.core.auth import PLAINTEXT  # the namespaces' addresses are not loopback; the bed has no TLS
    from tandem.core.tree import TreeShape
    from tandem.edge.client import EdgeClient
    if method in ("cloud_ar", "cloud_ar_control"):
        return EdgeClient(drafter, address, shape=None, tls_ca=PLAINTEXT)
    if method == "chain4":
        return EdgeClient(drafter, address, TreeShape(1, 4, 4), tls_ca=PLAINTEXT)
    if method == "tree":
        return EdgeClient(drafter, address, TreeShape.parse(TREE), tls_ca=PLAINTEXT)
    if method == "lockstep3":
        return EdgeClient(drafter, address, TreeShape(1, 3, 3), stream=False, tls_ca=PLAINTEXT)
    objective = "cloud_cost" if method.startswith(("adaptive_cost", "adaptive_proactive_cost")) else "latency"
    from tandem.edge.policy import PolicyConfig
    config = PolicyConfig(shadow_depth=0, overlap_tolerance=float("inf")) if method in ABLATIONS else PolicyConfig()
    policy = ProbedPolicy(config, objective=objective)
    return EdgeClient(drafter, address, policy=policy, proactive=method.startswith("adaptive_proactive"),
                      tls_ca=PLAINTEXT)


class PacedDrafter:
    """The drafter slowed by the run's time scale (the GPU simulation): each operation takes ``scale`` times its
    real time."""

    def __init__(self, inner, scale: float):
        self.inner, self.scale = inner, scale

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if name not in ("catch_up", "draft", "speculate", "commit", "adopt") or self.scale <= 1:
            return attr

        def paced(*a, **kw):
            t0 = time.perf_counter()
            out = attr(*a, **kw)
            time.sleep((self.scale - 1) * (time.perf_counter() - t0))
            return out
        return paced


def worker(spec_path: Path) -> int:
    """Run every method over the prompts through the proxy; write per-generation records."""
    from tandem.edge.client import wait_idle
    from tandem.edge.drafter import load_drafter
    from .linkproxy import read_counters
    spec = json.loads(spec_path.read_text())
    engine = spec.get("drafter_engine", "llama.cpp")
    drafter = load_drafter(engine, model_path=spec["drafter"], n_ctx=4096, n_threads=spec["threads"],
                           **({"vocab": spec["drafter_vocab"], "learn_vocab": False}
                              if spec.get("drafter_vocab") else {}))
    if spec.get("time_scale", 1.0) > 1:
        drafter = PacedDrafter(drafter, spec["time_scale"])
    tok = drafter.tokenizer
    prompts = [(p["dataset"], tok.tokenize(tok.chat_prompt(p["messages"]))) for p in spec["prompts"]]
    control = (spec["control"][0], spec["control"][1])
    clients = {method: _client(method, drafter, spec["address"]) for method in spec["methods"]}
    warmups: dict = {}
    for method, client in clients.items():
        # warm-up, not measured: pages the models in, and lets the adaptive policy learn this link first (a real
        # client keeps its estimates across requests); what the policy decided there is kept (``policy.warmup``)
        mark = policy_mark(client.policy) if client.policy is not None else None
        client.generate(prompts[0][1], max_new_tokens=spec.get("warmup_tokens", WARMUP_TOKENS)).result()
        if client.policy is not None and mark is not None:
            warmups[method] = policy_log_since(client.policy, mark)
    out: dict = {method: [] for method in clients}
    for i, (dataset, prompt) in enumerate(prompts):  # prompt by prompt, every method: drift hits all alike
        order = list(clients.items())
        if spec.get("rotate"):  # each method takes each place in the order in turn (see --rotate)
            order = order[i % len(order):] + order[:i % len(order)]
        for method, client in order:
            wait_idle(drafter)
            drafter.start([])  # a cold drafter for every run: the same prompt's cells from the last method would help
            before = read_counters(control)
            mark = policy_mark(client.policy) if client.policy is not None else None
            gen = client.generate(prompt, max_new_tokens=spec["max_new_tokens"])
            t0 = time.perf_counter()
            ttft = None
            for _ in gen:
                if ttft is None:
                    ttft = time.perf_counter() - t0
            wall = time.perf_counter() - t0
            after = read_counters(control)
            s = gen.stats
            out[method].append({"dataset": dataset, "tokens": gen.tokens, "ttft_ms": 1000 * s.ttft_s,
                                "first_text_ms": 1000 * (ttft or wall),
                                "wall_s": wall, "rounds": s.rounds, "drafted": s.drafted_nodes,
                                "accepted": s.accepted_tokens, "proactive_hits": s.proactive_hits,
                                "shadow_chains": s.shadow_chains, "shadow_accepted": s.shadow_accepted,
                                "verifier_ms": s.verify_us / 1000, "trees": s.trees, "rebased": s.rebased_tokens,
                                "wire_bytes": (after["up_bytes"] - before["up_bytes"])
                                + (after["down_bytes"] - before["down_bytes"]),
                                "stalls": after["stalls"] - before["stalls"],
                                **(policy_log_since(client.policy, mark)
                                   if client.policy is not None and mark is not None else {})})
            print(f"[edge] {method} {dataset}: {len(gen.tokens)} tokens, tau {s.tau:.2f}, "
                  f"{len(gen.tokens) / wall:.1f} tok/s"
                  + (f", modes {out[method][-1]['tokens_by_mode']}" if client.policy is not None else ""),
                  file=sys.stderr, flush=True)
    for method, client in clients.items():
        if client.policy is not None:
            out[method][-1]["policy"] = {**policy_summary(client.policy), "warmup": warmups.get(method)}
        client.close()
    Path(spec["out"]).write_text(json.dumps(out))
    return 0


# -- orchestration ------------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_cmd(target: str, host: str, port: int, threads: int, cost: str = "", scale: float = 1.0) -> list[str]:
    return [sys.executable, "-m", "tandem.orchestrator.cli", "serve", "--target", target, "--grpc-host", host,
            "--grpc-port", str(port), "--threads", str(threads), "--n-ctx", "4096", "--max-sessions", "2",
            "--no-gateway",
            # no prefix cache: every method runs the same prompts one after the other, and each must pay the same
            # prefill (bench.multiturn measures the cache)
            "--prefix-cache-tokens", "0",
            "--allow-unauthenticated"] + (  # the bed's private addresses only
        ["--verifier-cost", cost, "--cost-scale", str(scale)] if cost else [])


def _wait_verifier(proc: subprocess.Popen, what: str) -> None:
    line = proc.stdout.readline()
    if "verifier ready" not in line:
        raise RuntimeError(f"{what} verifier did not start (exit {proc.poll()}): {line.strip()}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()


def run_local(spec: dict, target: str, tmp: Path) -> dict:
    """Drafter and verifier share this host's cores; loopback through a zero-delay proxy (for byte counts)."""
    cores = os.cpu_count() or 1
    port, proxy_port, control_port = _free_port(), _free_port(), _free_port()
    server = lifetime.spawn(_serve_cmd(target, "127.0.0.1", port, cores, spec.get("verifier_cost", ""),
                                       spec.get("time_scale", 1.0)), stdout=subprocess.PIPE, text=True)
    proxy = None
    try:
        _wait_verifier(server, "local")
        proxy = lifetime.spawn([sys.executable, "-m", "bench.linkproxy", "--listen", f"127.0.0.1:{proxy_port}",
                                  "--upstream", f"127.0.0.1:{port}", "--control", f"127.0.0.1:{control_port}"],
                                 stdout=subprocess.DEVNULL)
        from .netbed import wait_port
        wait_port(("127.0.0.1", control_port))
        return _run_worker([], {**spec, "address": f"127.0.0.1:{proxy_port}",
                                "control": ["127.0.0.1", control_port], "threads": cores}, tmp, "local")
    finally:
        for p in (proxy, server):
            if p is not None:
                _stop(p)


def _run_worker(prefix: list[str], spec: dict, tmp: Path, profile: str) -> dict:
    spec_path, out = tmp / f"spec-{profile}.json", tmp / f"out-{profile}.json"
    spec_path.write_text(json.dumps({**spec, "out": str(out)}))
    r = subprocess.run(prefix + [sys.executable, "-m", "bench.network", "--worker", str(spec_path)],
                       env=lifetime.child_env())
    if r.returncode != 0:
        raise RuntimeError(f"edge worker for profile {profile} failed ({r.returncode})")
    return json.loads(out.read_text())


def run_namespaced(profiles: list[str], spec: dict, target: str, tmp: Path) -> dict:
    from .netbed import CLOUD_ADDR, NetBed
    results = {}
    with NetBed() as bed:
        server = bed.spawn("cloud", _serve_cmd(target, CLOUD_ADDR, 50051, 1, spec.get("verifier_cost", ""),
                                               spec.get("time_scale", 1.0)), cpus="1", stdout=subprocess.PIPE,
                           text=True)
        _wait_verifier(server, "cloud")
        for name in profiles:
            profile = scaled(PROFILES[name], spec.get("time_scale", 1.0))
            bed.rate(profile.rate_mbit)
            proxy = bed.start_proxy(profile, 50051)
            try:
                _progress(f"profile {name}: {profile}")
                results[name] = _run_worker(bed.command("edge", [], cpus="0"),
                                            {**spec, "address": proxy.address, "control": list(proxy.control),
                                             "threads": 1}, tmp, name)
            finally:
                proxy.stop()
    return results


def scaled(p: LinkProfile, s: float) -> LinkProfile:
    """A link ``s`` times slower in every delay (bandwidth divided by s): the GPU simulation's time scale."""
    return LinkProfile(p.one_way_ms * s, p.jitter_ms * s, p.loss, p.rto_ms * s,
                       p.rate_mbit / s if p.rate_mbit else p.rate_mbit)


def auto_time_scale(curve_path: str) -> float:
    """The smallest whole factor that keeps this CPU's verify forwards (its measured curve) under the simulated
    curve at every token count a tree here can have (1..64)."""

    from tandem.cloud.engines.pacing import CostCurve
    cpu, sim = CostCurve.load(CPU_CURVE), CostCurve.load(curve_path)
    need = max(cpu(n) / sim(n) for n in range(1, 65))
    return float(max(1, -(-need // 1)))


def summarise(records: list[dict]) -> dict:
    tokens = sum(len(r["tokens"]) for r in records)
    rounds = sum(r["rounds"] for r in records)
    wall = sum(r["wall_s"] for r in records)
    # after the first token: the steady state, without the prefill every method shares (bench.ceiling's ratios)
    decode_s = sum(r["wall_s"] - r["ttft_ms"] / 1000 for r in records)
    return {"edge_tokens_per_s": round(tokens / wall, 2) if wall else 0.0,
            "decode_tokens_per_s": round((tokens - len(records)) / decode_s, 2) if decode_s > 0 else 0.0,
            "ttft_ms": round(sum(r["ttft_ms"] for r in records) / len(records), 1),
            "tau": round(tokens / rounds, 3) if rounds else 0.0,
            "verify_forwards_per_token": round(rounds / tokens, 4) if tokens else 0.0,
            "wire_bytes_per_token": round(sum(r["wire_bytes"] for r in records) / tokens, 1) if tokens else 0.0,
            "verifier_ms_per_token": round(sum(r.get("verifier_ms", 0.0) for r in records) / tokens, 2) if tokens
            else 0.0,
            "tokens": tokens, "stalls": sum(r["stalls"] for r in records),
            "proactive_hits": sum(r["proactive_hits"] for r in records),
            **({"tokens_by_mode": {m: sum(r["tokens_by_mode"][m] for r in records) for m in
                                   records[0]["tokens_by_mode"]}} if records and "tokens_by_mode" in records[0]
               else {})}


def check_lossless(raw: dict, prompts_tokens: dict, target: str, max_new_tokens: int) -> tuple[bool, list[dict]]:
    """Compare each method with cloud_ar in the same profile; classify any divergence against the target's own
    logits (near-tie or not), loading the target here only when something diverged."""
    diverged = []
    for profile, methods in raw.items():
        ref = methods.get("cloud_ar")
        if ref is None:
            continue
        for method, records in methods.items():
            for i, (r, base) in enumerate(zip(records, ref)):
                if r["tokens"] != base["tokens"]:
                    diverged.append({"profile": profile, "method": method, "prompt": i})
    if not diverged:
        return True, []
    from tandem.cloud import reference
    from tandem.cloud.engines.llama_engine import LlamaVerifierEngine
    from tandem.orchestrator import models
    engine = LlamaVerifierEngine(models.resolve(target, "target"), n_ctx=4096, n_threads=os.cpu_count() or 1)
    tok = engine.model
    prompts = [tok.tokenize(tok.chat_prompt(m)) for m in prompts_tokens]
    refs = {i: reference.greedy(engine, prompts[i], max_new_tokens) for i in {d["prompt"] for d in diverged}}
    noise = max(reference.batch_shape_noise(engine, prompts[i], refs[i].tokens[:8]) for i in list(refs)[:2])
    ok = True
    for d in diverged:
        tokens = raw[d["profile"]][d["method"]][d["prompt"]]["tokens"]
        base = raw[d["profile"]]["cloud_ar"][d["prompt"]]["tokens"]
        kind, at = reference.classify(tokens, refs[d["prompt"]], noise)
        base_kind, _ = reference.classify(base, refs[d["prompt"]], noise)
        d.update(kind=kind, at=at, cloud_ar_vs_reference=base_kind, noise=round(noise, 4))
        ok &= kind in ("exact", "near_tie") and base_kind in ("exact", "near_tie")
    return ok, diverged


def plot(result: dict, path: Path) -> list[str]:
    plt = pyplot()
    if plt is None:
        return []
    rows = result["results"]
    profiles = [p for p in PROFILES if any(r["profile"] == p for r in rows)]
    methods = [m for m in METHODS + ABLATIONS + COMBOS + BASELINES if any(r["method"] == m for r in rows)]
    files = []
    for key, label, name in (("edge_tokens_per_s", "tokens/s at the edge", "network_tps.png"),
                             ("verify_forwards_per_token", "verify forwards per token", "network_fwd.png")):
        fig, ax = plt.subplots(figsize=(8, 3.6))
        width = 0.8 / len(methods)
        for j, m in enumerate(methods):
            vals = [next((r[key] for r in rows if r["profile"] == p and r["method"] == m), 0) for p in profiles]
            ax.bar([i + j * width for i in range(len(profiles))], vals, width, label=m)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(profiles))], profiles)
        ax.set_ylabel(label)
        ax.legend(fontsize=7, ncol=3)
        fig.tight_layout()
        fig.savefig(path.parent / name, dpi=110)
        plt.close(fig)
        files.append(name)
    return files


def request_ratios(rows: list[dict]) -> dict:
    """Per profile and method, each request's tokens/s against cloud_ar's on the same prompt (requests are kept in
    prompt order), and with a ``cloud_ar_control`` arm the run's noise floor: what the same work read against
    cloud_ar, whole run and per dataset."""
    out: dict = {}
    for r in rows:
        base = next((b for b in rows if b["profile"] == r["profile"] and b["method"] == "cloud_ar"), None)
        if base is None or r["method"] == "cloud_ar" or "requests" not in r:
            continue
        ratios = [round((q["tokens"] / q["wall_s"]) / (b["tokens"] / b["wall_s"]), 3)
                  for q, b in zip(r["requests"], base["requests"]) if q["wall_s"] > 0 and b["wall_s"] > 0]
        entry = out.setdefault(r["profile"], {})[r["method"]] = {"requests": ratios}
        if r["method"] == "cloud_ar_control":
            entry["run"] = round(r["edge_tokens_per_s"] / base["edge_tokens_per_s"], 3)
            entry["by_dataset"] = {d: round(v["edge_tokens_per_s"] / base["by_dataset"][d]["edge_tokens_per_s"], 3)
                                   for d, v in r.get("by_dataset", {}).items() if d in base.get("by_dataset", {})}
    return out


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


def report(result: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    sim = result.get("simulation")
    lines = ["# Edge drafting across emulated links", ""]
    if sim:
        lines += [f"**Simulated verifier regime**: every verify forward paced to `{sim['curve']}` "
                  f"({sim['label']}), all times (curve, link, drafter) x{sim['time_scale']}; ratios are the "
                  "simulated regime's, absolute rates are slowed by the time scale.", ""]
    lines += [f"{result['prompts']} prompts ({result['limit']} HumanEval + {result['limit']} ShareGPT), "
              f"{result['max_new_tokens']} new tokens, temperature 0, target {result['target']}, drafter "
              f"{result['drafter']}. lossless_ok = {result['lossless_ok']}.", "",
              "Links: delay and jitter from a userspace proxy (per direction, order kept), bandwidth from tbf, 1 % "
              "loss approximated as 200 ms retransmission stalls (head-of-line) on the chunks it would hit. "
              "Namespaced profiles pin the edge to core 0 and the verifier (1 thread) to core 1; `local` shares both "
              "cores (2 threads each). Every method runs one unmeasured warm-up generation of "
              f"{result.get('warmup_tokens', WARMUP_TOKENS)} tokens first: it pages the models in, and an adaptive "
              "client, which keeps its policy across requests, measures the link there (what its probes cost is "
              "in the policy table below). Methods run prompt by prompt, "
              + ("each prompt's order rotated by one place (`--rotate`). " if result.get("rotate") else
                 "in the order given. ")
              + "Ratios are against cloud_ar in the same profile: tokens/s (higher is "
              "better), TTFT and verifier busy ms per token (lower is better).", "",
              "| profile | method | tokens/s | vs cloud_ar | HumanEval | ShareGPT | TTFT ms | TTFT vs cloud_ar | "
              "verifier ms/token | cost vs cloud_ar (code / chat) | tau | wire B/token |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = result["results"]
    for r in rows:
        base = next((b for b in rows if b["profile"] == r["profile"] and b["method"] == "cloud_ar"), None)
        by, bb = r.get("by_dataset", {}), (base or {}).get("by_dataset", {})
        ds = {d: _ratio(by[d]["edge_tokens_per_s"], bb[d]["edge_tokens_per_s"]) if d in by and d in bb else "-"
              for d in ("humaneval", "sharegpt")}
        cost = " / ".join(_ratio(by[d]["verifier_ms_per_token"], bb[d]["verifier_ms_per_token"])
                          if d in by and d in bb else "-" for d in ("humaneval", "sharegpt"))
        lines.append(f"| {r['profile']} | {r['method']} | {r['edge_tokens_per_s']} | "
                     f"{_ratio(r['edge_tokens_per_s'], base['edge_tokens_per_s']) if base else '-'} | "
                     f"{ds['humaneval']} | {ds['sharegpt']} | {r['ttft_ms']} | "
                     f"{_ratio(r['ttft_ms'], base['ttft_ms']) if base else '-'} | {r['verifier_ms_per_token']} | "
                     f"{cost} | {r['tau']} | {r['wire_bytes_per_token']} |")
    preds = [(r["profile"], r["method"], r["policy"], r["by_dataset"]) for r in rows if r.get("policy")]
    if preds:
        lines += ["", "Adaptive policy: the mode it settled on, its measured rates (tokens/s), and its cost model "
                  "against the clock (mean tree round and verify times, predicted / measured), and the time its "
                  "probes of the other modes lost against the favourite over the client's life (warm-up included); "
                  "the verifier's slowdown while the drafter worked (interference, median against median: above "
                  "1.1 the drafter stops working alongside it), the shadow chains it scored on streamed text, and "
                  "the probes their predictions skipped or called:",
                  "", "| profile | method | chose | rates | round ms | verify ms | probes lost ms | "
                  "tokens by mode, code / chat | interference | shadow chains | probes skipped / called |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for profile, method, p, by_ds in preds:
            split = " / ".join(str(by_ds[ds].get("tokens_by_mode", "-")) for ds in ("humaneval", "sharegpt")
                               if ds in by_ds)
            pr = p.get("prediction") or {}
            lines.append(f"| {profile} | {method} | {p['favourite']} | {p['rates']} | "
                         f"{pr.get('round_ms_predicted', '-')} / {pr.get('round_ms_measured', '-')} | "
                         f"{pr.get('verify_ms_predicted', '-')} / {pr.get('verify_ms_measured', '-')} | "
                         f"{p.get('explore_loss_ms', '-')} | {split} | {p.get('interference', '-')} | "
                         f"{p.get('shadows', '-')} | {p.get('skipped_probes', '-')} / {p.get('called_probes', '-')} |")
        by_mode = [(profile, method, mode, m) for profile, method, p, _ in preds
                   for mode, m in ((p.get("prediction") or {}).get("by_mode") or {}).items()]
        if by_mode:
            lines += ["", "The cost model per mode priced: mean tree round, verify and verified nodes, predicted / "
                      "measured:", "", "| profile | method | mode | trees | round ms | verify ms | nodes |",
                      "|---|---|---|---|---|---|---|"]
            lines += [f"| {profile} | {method} | {mode} | {m['trees']} | {m['round_ms_predicted']} / "
                      f"{m['round_ms_measured']} | {m['verify_ms_predicted']} / {m['verify_ms_measured']} | "
                      f"{m['nodes_predicted']} / {m['nodes_measured']} |" for profile, method, mode, m in by_mode]
    spread = result.get("request_ratios") or {}
    if spread:
        lines += ["", "Request by request, tokens/s against cloud_ar on the same prompt (lowest - highest), and "
                  "where the run has a `cloud_ar_control` arm (cloud-only streaming again: the same work), what "
                  "this host's noise alone reads:", ""]
        for profile, methods in spread.items():
            parts = [f"{m} {min(v['requests']):.2f}-{max(v['requests']):.2f}x" for m, v in methods.items()
                     if v["requests"]]
            control = methods.get("cloud_ar_control")
            floor = (f"; noise floor (`cloud_ar_control`): {control['run']:.2f}x over the run ("
                     + ", ".join(f"{d} {x:.2f}x" for d, x in control["by_dataset"].items()) + ")") if control else ""
            lines.append(f"- {profile}: " + ", ".join(parts) + floor)
    for f in result.get("plots", []):
        lines += ["", f"![{f}]({f})"]
    if result["divergences"]:
        lines += ["", "Divergences from cloud_ar: " + json.dumps(result["divergences"])]
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.network", description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=2, help="prompts per dataset (HumanEval and ShareGPT)")
    ap.add_argument("--profiles", default=",".join(PROFILES))
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--warmup-tokens", type=int, default=WARMUP_TOKENS,
                    help="tokens of each client's unmeasured first generation (the policy learns the link there)")
    ap.add_argument("--target", default="default")
    ap.add_argument("--drafter", default="default")
    ap.add_argument("--drafter-engine", default="llama.cpp", choices=("llama.cpp", "onnx"))
    ap.add_argument("--drafter-vocab", default="", help="VocabTrim head (.npy) for the onnx drafter")
    ap.add_argument("--interleave", action="store_true",
                    help="alternate HumanEval and ShareGPT prompts (code after chat, chat after code)")
    ap.add_argument("--rotate", action="store_true",
                    help="rotate the order of the methods prompt by prompt (on shared cores the place in the order "
                         "moves a method's rate by a few per cent)")
    ap.add_argument("--verifier-cost", default="", help="simulate this verifier cost curve (JSON)")
    ap.add_argument("--time-scale", type=float, default=0.0, help="slow-down of the simulation (0: automatic)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--report", type=Path, default=Path("bench/out/network.md"))
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    from tandem.core import logs
    from tandem.orchestrator import models
    logs.configure()
    if args.worker:
        lifetime.bind_to_parent()
        return worker(args.worker)
    profiles = [p.strip() for p in args.profiles.split(",") if p.strip()]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    known = METHODS + ABLATIONS + COMBOS + BASELINES
    unknown = [p for p in profiles if p not in PROFILES] + [m for m in methods if m not in known]
    if unknown:
        ap.error(f"unknown profile/method {unknown}; profiles: {list(PROFILES)}, "
                 f"methods: {list(known)}")
    namespaced = [p for p in profiles if p != "local"]
    if namespaced:
        from .netbed import NetBedUnavailable, check
        try:
            check()
        except NetBedUnavailable as e:
            print(f"bench.network: profiles {namespaced} need network namespaces: {e}. "
                  f"Run as root, or use --profiles local.", file=sys.stderr)
            return 2
    from tandem.orchestrator.datasets import humaneval, humaneval_messages, sharegpt
    code = [("humaneval", humaneval_messages(p)) for p in humaneval(args.limit)]
    chat = [("sharegpt", c) for c in sharegpt(args.limit)]
    chats = [x for pair in zip(code, chat) for x in pair] if args.interleave else code + chat
    target = str(models.fetch("target")) if args.target == "default" else args.target
    drafter = str(models.resolve(args.drafter, "drafter"))
    spec = {"drafter": drafter, "methods": methods, "max_new_tokens": args.max_new_tokens,
            "warmup_tokens": args.warmup_tokens, "rotate": args.rotate,
            "prompts": [{"dataset": d, "messages": m} for d, m in chats], "drafter_engine": args.drafter_engine,
            "drafter_vocab": str(Path(args.drafter_vocab).resolve()) if args.drafter_vocab else ""}
    if args.drafter_engine == "onnx":  # exported (or found in the cache) once, before the workers start
        from tandem.edge.export.onnx_export import export
        export(drafter)
    simulation = None
    if args.verifier_cost:
        from tandem.cloud.engines.pacing import CostCurve
        curve = CostCurve.load(args.verifier_cost)
        scale = args.time_scale or auto_time_scale(args.verifier_cost)
        spec.update(verifier_cost=str(Path(args.verifier_cost).resolve()), time_scale=scale)
        simulation = {"curve": Path(args.verifier_cost).name, "label": curve.label, "time_scale": scale}
        _progress(f"simulated verifier {curve.name} ({curve.label}), everything x{scale}")
    t0 = time.perf_counter()
    raw: dict = {}
    with tempfile.TemporaryDirectory(prefix="tandem-net-") as tmp:
        os.chmod(tmp, 0o755)
        if "local" in profiles:
            _progress("profile local: drafter and verifier on the same cores")
            raw["local"] = run_local(spec, target, Path(tmp))
        if namespaced:
            raw.update(run_namespaced(namespaced, spec, target, Path(tmp)))
    ok, divergences = check_lossless(raw, [m for _, m in chats], target, args.max_new_tokens)
    rows = []
    for profile in profiles:
        for method in methods:
            recs = raw[profile][method]
            by_ds = {ds: summarise([r for r in recs if r["dataset"] == ds]) for ds in ("humaneval", "sharegpt")
                     if any(r["dataset"] == ds for r in recs)}
            rows.append({"profile": profile, "method": method, **summarise(recs), "by_dataset": by_ds,
                         **({"policy": recs[-1]["policy"]} if recs and "policy" in recs[-1] else {}),
                         "requests": [{"dataset": r["dataset"], "tokens": len(r["tokens"]), "wall_s": r["wall_s"],
                                       "ttft_ms": round(r["ttft_ms"], 1),
                                       **({"tokens_by_mode": r["tokens_by_mode"], "decisions": r["decisions"]}
                                          if "decisions" in r else {})} for r in recs]})
    result = {"lossless_ok": ok, "results": rows, "divergences": divergences, "limit": args.limit,
              "simulation": simulation,
              "prompts": len(chats), "max_new_tokens": args.max_new_tokens, "warmup_tokens": args.warmup_tokens,
              "tree": TREE, "interleave": args.interleave, "rotate": args.rotate,
              "links": {p: asdict(PROFILES[p]) for p in profiles}, "target": Path(target).name,
              "drafter": Path(drafter).name + (f" (onnx, head {Path(args.drafter_vocab).name or 'full'})"
                                               if args.drafter_engine == "onnx" else ""),
              "drafter_engine": args.drafter_engine, "bench_s": round(time.perf_counter() - t0, 1)}
    result["request_ratios"] = request_ratios(rows)
    args.report.parent.mkdir(parents=True, exist_ok=True)
    result["plots"] = plot(result, args.report)
    return finish(result, args.json, report, args.report, ok,
                  "outputs diverge from cloud-only decoding other than at near-ties", "network")


if __name__ == "__main__":
    sys.exit(main())
