"""Prompts inside the verify forwards (chunked prefill) against one prompt per forward between them, in one run: the
product's servicer and scheduler over a verifier paced to a GPU cost curve, under the same arrivals.

    python -m bench.prefill --curve h200-eager-qwen2.5-7b.json --sessions 32 --duration-s 60 --json out.json

``--sessions`` clients each run sessions back to back for ``--duration-s``: open with a prompt (its length drawn
from ``--prompt-tokens``, seeded), let the verifier decode an answer (its length drawn from ``--new-tokens``: answers
of different lengths keep the clients out of step, as real traffic is) alone (cloud-only streaming: the scheduler,
not a drafter, is what is measured), close, open the next. Both arms serve the same seeded sequence
of sessions: ``mixed`` (the default scheduler: prompts fill the room verify work leaves in each forward) and
``serial`` (``Scheduler(mixed_prefill=False)``: each prompt whole, as forwards of its own, between batches).
The target is the scripted rule (``cloud.engines.scripted_engine``) behind ``cloud.engines.pacing.PacedEngine``: every
forward (verify, prompt chunk, whole prompt) takes the curve's time for its tokens x ``--cost-scale`` (so this CPU keeps
up), labelled simulated. Reported per arm: time to first token (open to first token) and inter-token latency
p50/p99, decode tokens/s, forwards, prompt tokens computed inside forwards. Exit 1 if a session lost or repeated a
token (every token the rule's own) or an arm finished no session.
"""
from __future__ import annotations

import argparse
import queue
import random
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np

from .curves import curve_path
from .output import cpu_name, finish

ARMS = ("serial", "mixed")


def _progress(msg: str) -> None:
    print(f"[prefill] {msg}", file=sys.stderr, flush=True)


def session(stub, prompt: list[int], new: int) -> tuple[float, list[float], list[int]]:
    """One session through the servicer: (seconds to its first token, gaps between later tokens, its tokens)."""
    from tandem.protos import verifier_pb2 as pb
    requests: queue.SimpleQueue = queue.SimpleQueue()
    requests.put(pb.SessionRequest(open=pb.Open(prompt_tokens=prompt, decode_steps=new,
                                                limits=pb.Limits(max_new_tokens=new))))
    t0, times, tokens, sid = time.perf_counter(), [], [], ""
    responses = stub.Session(iter(requests.get, None), timeout=600)
    try:
        for r in responses:
            if r.HasField("opened"):
                sid = r.opened.session_id
            elif r.HasField("verdict"):
                times.append(time.perf_counter())
                tokens += [r.verdict.bonus_token] if r.verdict.bonus_token >= 0 else []
                if r.verdict.finish_reason:
                    requests.put(pb.SessionRequest(close=pb.Close(session_id=sid)))
            elif r.HasField("closed"):
                break
    finally:
        requests.put(None)
    return times[0] - t0, list(np.diff(times)), tokens


def run_arm(arm: str, args, plan: list[list[int]]) -> dict:
    from tandem.cloud.backend import LocalBackend
    from tandem.cloud.engines.pacing import CostCurve, PacedEngine
    from tandem.cloud.scheduler import Scheduler
    from tandem.cloud.engines.scripted_engine import ScriptedEngine
    from tandem.cloud.server import serve
    from tandem.protos import verifier_pb2_grpc as pb_grpc

    engine = PacedEngine(ScriptedEngine(n_ctx=8192, max_batch_tokens=args.max_batch_tokens),
                         CostCurve.load(curve_path(args.curve)), args.cost_scale)
    scheduler = Scheduler(engine, args.max_batch_tokens, args.window_ms, mixed_prefill=arm == "mixed")
    backend = LocalBackend(engine, max_sessions=args.sessions, scheduler=scheduler)
    server, port = serve(backend=backend, address="127.0.0.1:0", max_streams=4 * args.sessions)
    ttft, itl, bad, done = [], [], [], [0]
    lock, stop_at = threading.Lock(), time.perf_counter() + args.duration_s

    def client(i: int) -> None:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.VerifierStub(ch)
            for prompt, new in plan[i]:
                if time.perf_counter() >= stop_at:
                    return
                first, gaps, tokens = session(stub, prompt, new)
                want = [min(prompt[-1] + k, 255) for k in range(1, new + 1)]
                want = want[: want.index(255) + 1] if 255 in want else want
                with lock:
                    ttft.append(first)
                    itl.extend(gaps)
                    done[0] += 1
                    if tokens != want:
                        bad.append((i, len(tokens), len(want)))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(args.sessions)]
    for t in threads:
        t.start()
        time.sleep(args.stagger_s)
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    stats = scheduler.stats
    server.stop(None)
    scheduler.stop()

    def q(xs, p):
        return round(float(np.quantile(xs, p)) * 1000 * 1 / args.cost_scale, 2) if xs else None

    return {"sessions_done": done[0], "wrong": len(bad), "ttft_ms_p50": q(ttft, 0.5), "ttft_ms_p99": q(ttft, 0.99),
            "itl_ms_p50": q(itl, 0.5), "itl_ms_p99": q(itl, 0.99),
            "decode_tokens_per_s": round((len(itl) + len(ttft)) / wall * args.cost_scale, 1),
            "forwards": stats.forwards, "prefill_forwards": stats.prefill_forwards,
            "prefill_tokens_in_forwards": stats.prefill_tokens, "late_ms": round(engine.late_ms, 1)}


def report(result: dict, path: Path) -> None:
    lines = ["# Chunked prefill against one prompt per forward", "",
             f"Simulated (paced): the scripted target behind `PacedEngine` on `{result['curve']}` x "
             f"{result['cost_scale']} (times below divided back by it), the product's servicer and scheduler, "
             f"{result['sessions']} clients x {result['duration_s']} s, prompts {result['prompt_tokens']} tokens, "
             f"answers {result['new_tokens']} tokens, max_batch_tokens {result['max_batch_tokens']}. Run on "
             f"{result['cpu']}, {result['date']}.", "",
             "| arm | sessions | TTFT p50 / p99 ms | ITL p50 / p99 ms | decode tokens/s | forwards | prompt tokens "
             "in forwards |", "|---|---|---|---|---|---|---|"]
    for arm in ARMS:
        r = result["arms"][arm]
        lines.append(f"| {arm} | {r['sessions_done']} | {r['ttft_ms_p50']} / {r['ttft_ms_p99']} | {r['itl_ms_p50']} / "
                     f"{r['itl_ms_p99']} | {r['decode_tokens_per_s']} | {r['forwards']} | "
                     f"{r['prefill_tokens_in_forwards']} |")
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.prefill", description=__doc__.split("\n\n")[0])
    ap.add_argument("--curve", default="h200-eager-qwen2.5-7b.json")
    ap.add_argument("--cost-scale", type=float, default=4.0, help="multiply every forward's time (this CPU keeps up)")
    ap.add_argument("--sessions", type=int, default=32, help="concurrent clients")
    ap.add_argument("--limit", type=int, default=0, help="sessions per client (0: as many as the duration allows)")
    ap.add_argument("--duration-s", type=float, default=30.0)
    ap.add_argument("--stagger-s", type=float, default=0.05, help="between client starts")
    ap.add_argument("--prompt-tokens", default="100,1500", help="prompt lengths drawn uniformly from LO,HI")
    ap.add_argument("--new-tokens", default="16,128", help="answer lengths drawn uniformly from LO,HI")
    ap.add_argument("--max-batch-tokens", type=int, default=512)
    ap.add_argument("--window-ms", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--report", type=Path, default=Path("bench/out/prefill.md"))
    args = ap.parse_args(argv)
    lo, hi = (int(x) for x in args.prompt_tokens.split(","))
    new_lo, new_hi = (int(x) for x in args.new_tokens.split(","))
    rng = random.Random(args.seed)
    per_client = args.limit or 1000
    # token ids 1..200 (the rule counts up from the last to the end token, 255): every answer is known
    plan = [[([rng.randint(1, 200) for _ in range(rng.randint(lo, hi))], rng.randint(new_lo, new_hi))
             for _ in range(per_client)] for _ in range(args.sessions)]
    arms = {}
    for arm in ARMS:
        _progress(f"{arm}: {args.sessions} clients for {args.duration_s} s")
        arms[arm] = run_arm(arm, args, plan)
        _progress(f"{arm}: {arms[arm]}")
    s, m = arms["serial"], arms["mixed"]
    result = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu_name(), "label": "simulated (paced)",
              "curve": args.curve, "cost_scale": args.cost_scale, "sessions": args.sessions,
              "duration_s": args.duration_s, "prompt_tokens": args.prompt_tokens,
              "new_tokens": args.new_tokens, "max_batch_tokens": args.max_batch_tokens, "arms": arms,
              "ttft_p99_ratio": round(m["ttft_ms_p99"] / s["ttft_ms_p99"], 3) if s["ttft_ms_p99"] else None,
              "itl_p99_ratio": round(m["itl_ms_p99"] / s["itl_ms_p99"], 3) if s["itl_ms_p99"] else None,
              "tokens_per_s_ratio": round(m["decode_tokens_per_s"] / s["decode_tokens_per_s"], 3)
              if s["decode_tokens_per_s"] else None}
    ok = all(a["wrong"] == 0 and a["sessions_done"] > 0 for a in arms.values())
    return finish(result, args.json, report, args.report, ok, "a session's tokens were not the target's, or an arm "
                                                              "finished no session", "prefill")


if __name__ == "__main__":
    sys.exit(main())
