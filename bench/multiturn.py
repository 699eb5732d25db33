"""Multi-turn chats: time to first token per turn with and without the verifier's prefix cache, and the edge
drafter's catch-up per turn with and without keeping the last turn's cells.

    python -m bench.multiturn --limit 2 --turns 10 --json bench/out/multiturn.json

ShareGPT conversations with at least ``--turns`` user turns (each cut to 400 characters) are replayed turn by turn
through the real path (EdgeClient -> gRPC -> verifier), with cloud-only decoding so that the first token's wait is
the verifier's prefill alone: turn n's prompt is the whole conversation so far, rendered by the target's chat
template, with the answers the target gave. Two verifiers on the same model, one with the prefix cache
(``prefix_cache_tokens``) and one without, answer every turn in turn (drift of the host hits both alike); their
answers must agree token by token (up to measured near-ties), else the run exits 1. The drafter's catch-up on each
turn's prompt is timed twice: after the previous turn (cells of the shared prefix kept by ``start``) and from empty.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

from .output import finish
from bench.output import pyplot


def _progress(msg: str) -> None:
    print(f"[multiturn] {msg}", file=sys.stderr, flush=True)


def drafter_catch_up_ms(drafter, previous: list[int], prompt: list[int]) -> tuple[float, float]:
    """(ms to catch up on ``prompt`` right after a session on ``previous``, ms from an empty drafter)."""
    from tandem.edge.client import wait_idle
    wait_idle(drafter)
    times = []
    for before in (previous, []):
        drafter.start(before)
        drafter.catch_up()  # the state the last turn left (its history evaluated), or nothing
        drafter.start(prompt)
        t0 = time.perf_counter()
        drafter.catch_up()
        times.append((time.perf_counter() - t0) * 1000)
    return times[0], times[1]


def plot(result: dict, path: Path) -> str | None:
    plt = pyplot()
    if plt is None:
        return None
    turns = result["per_turn"]
    x = [t["turn"] for t in turns]
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    ax.plot(x, [t["ttft_ms_plain"] for t in turns], "o-", label="verifier without prefix cache")
    ax.plot(x, [t["ttft_ms_cached"] for t in turns], "s-", label="verifier with prefix cache")
    ax.plot(x, [t["drafter_catch_up_ms_reuse"] for t in turns], "^--", label="drafter catch-up, cells kept")
    ax.set_xlabel("turn")
    ax.set_ylabel("ms (mean over conversations)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    name = "multiturn_ttft.png"
    fig.savefig(path.parent / name, dpi=110)
    plt.close(fig)
    return name


def report(result: dict, path: Path) -> None:
    lines = ["# Multi-turn chats: the prefix cache", "",
             f"{result['conversations']} ShareGPT conversations x {result['turns']} turns, "
             f"{result['max_new_tokens']} new tokens per answer, greedy, cloud-only decoding through gRPC (the first "
             f"token waits for the verifier's prefill alone), {result.get('engine', 'llama.cpp')} verifiers on "
             f"{result['target']}, {result['threads']} threads. Means over conversations. "
             f"lossless_ok = {result['lossless_ok']} (cached against uncached answers, token by token).", "",
             "| turn | prompt tokens | cached tokens | TTFT ms, no cache | TTFT ms, cache | vs turn 1 (no cache / "
             "cache) | drafter catch-up ms, from empty | kept cells |",
             "|---|---|---|---|---|---|---|---|"]
    for t in result["per_turn"]:
        lines.append(f"| {t['turn']} | {t['prompt_tokens']} | {t['cached_tokens']} | {t['ttft_ms_plain']} | "
                     f"{t['ttft_ms_cached']} | {t['ttft_vs_turn1_plain']}x / {t['ttft_vs_turn1_cached']}x | "
                     f"{t['drafter_catch_up_ms_full']} | {t['drafter_catch_up_ms_reuse']} |")
    g = result["goal"]
    lines += ["", f"Turn-{result['turns']} TTFT against turn 1: {g['last_vs_first_cached']}x with the cache "
                  f"(goal <= 1.2x), {g['last_vs_first_plain']}x without. Total prefill time over all turns: "
                  f"{g['total_ttft_s_cached']} s with, {g['total_ttft_s_plain']} s without.", ""]
    if result.get("plot"):
        lines += [f"![{result['plot']}]({result['plot']})", ""]
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.multiturn", description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=2, help="conversations")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--prefix-cache-tokens", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--target", default="default")
    ap.add_argument("--drafter", default="default")
    ap.add_argument("--engine", choices=("llama.cpp", "torch"), default="llama.cpp", help="the verifiers' engine")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--report", type=Path, default=Path("bench/out/multiturn.md"))
    args = ap.parse_args(argv)

    from tandem.cloud import reference
    from tandem.cloud.engines import load_engine
    from tandem.cloud.server import serve
    from tandem.core import logs
    from tandem.core.chat_template import ChatTemplate
    from tandem.edge.client import EdgeClient
    from tandem.edge.llama_drafter import LlamaDrafter
    from tandem.edge.planner import FixedPlanner
    from tandem.orchestrator import models
    from tandem.orchestrator.datasets import sharegpt_dialogues
    logs.configure()

    target = models.resolve(args.target, "target")
    common = dict(model_path=str(target), n_ctx=4096, n_threads=args.threads, max_sessions=2)
    engines = {"cached": load_engine(args.engine, **common, prefix_cache_tokens=args.prefix_cache_tokens),
               "plain": load_engine(args.engine, **common)}
    drafter = LlamaDrafter(models.resolve(args.drafter, "drafter"), n_ctx=4096, n_threads=args.threads)
    tok = drafter.model  # the pair shares its vocabulary (each verifier checks the fingerprint at Open)
    template = ChatTemplate(engines["plain"].chat_template, engines["plain"].bos_token, engines["plain"].eos_token)
    servers, clients = [], {}
    for name, engine in engines.items():
        server, port = serve(engine, "127.0.0.1:0", max_sessions=2)
        servers.append(server)
        clients[name] = EdgeClient(drafter, f"127.0.0.1:{port}", None)
    cloud_only = FixedPlanner(None)  # no drafting: the first token waits for the verifier's prefill only
    dialogues = sharegpt_dialogues(args.turns, args.limit)
    if len(dialogues) < args.limit:
        _progress(f"only {len(dialogues)} conversations have {args.turns} user turns")
    noise = None
    rows: list[list[dict]] = []
    verdicts = []
    for c, user_turns in enumerate(dialogues):
        messages: list[dict] = []
        previous: list[int] = []
        conv_rows = []
        for i, text in enumerate(user_turns):
            messages.append({"role": "user", "content": text})
            prompt = tok.tokenize(template.render(messages))
            if noise is None:
                first = reference.greedy(engines["plain"], prompt, 8)
                noise = reference.batch_shape_noise(engines["plain"], prompt, first.tokens[:8])
            out = {}
            for name, client in clients.items():
                gen = client.generate(prompt, max_new_tokens=args.max_new_tokens, planner=cloud_only).result()
                out[name] = gen
            kind, at = "exact", None
            if out["cached"].tokens != out["plain"].tokens:  # which one moved: against target-only decoding
                ref = reference.greedy(engines["plain"], prompt, args.max_new_tokens)
                kind, at = max((reference.classify(out[n].tokens, ref, noise) for n in out),
                               key=lambda v: ("exact", "near_tie", "other").index(v[0]))
            verdicts.append({"conversation": c, "turn": i + 1, "kind": kind, "at": at})
            reuse_ms, full_ms = drafter_catch_up_ms(drafter, previous, prompt)
            row = {"turn": i + 1, "prompt_tokens": len(prompt), "cached_tokens": out["cached"].stats.cached_tokens,
                   "ttft_ms_plain": 1000 * out["plain"].stats.ttft_s,
                   "ttft_ms_cached": 1000 * out["cached"].stats.ttft_s,
                   "drafter_catch_up_ms_full": full_ms, "drafter_catch_up_ms_reuse": reuse_ms}
            conv_rows.append(row)
            _progress(f"conversation {c + 1} turn {i + 1}: {len(prompt)} tokens, cached "
                      f"{row['cached_tokens']}, TTFT {row['ttft_ms_plain']:.0f} -> {row['ttft_ms_cached']:.0f} ms, "
                      f"drafter {full_ms:.0f} -> {reuse_ms:.0f} ms ({kind})")
            answer = out["plain"].text
            messages.append({"role": "assistant", "content": answer})
            previous = prompt + out["plain"].tokens
        rows.append(conv_rows)
    for s in servers:
        s.stop(grace=None)
    for client in clients.values():
        client.close()

    per_turn = []
    for i in range(args.turns):
        at_turn = [conv[i] for conv in rows if len(conv) > i]
        mean = {k: float(np.mean([r[k] for r in at_turn])) for k in at_turn[0] if k != "turn"}
        per_turn.append({"turn": i + 1, **{k: round(v, 1) for k, v in mean.items()}})
    for t in per_turn:
        t["ttft_vs_turn1_plain"] = round(t["ttft_ms_plain"] / per_turn[0]["ttft_ms_plain"], 2)
        t["ttft_vs_turn1_cached"] = round(t["ttft_ms_cached"] / per_turn[0]["ttft_ms_cached"], 2)
    last = per_turn[-1]
    goal = {"last_vs_first_cached": last["ttft_vs_turn1_cached"], "last_vs_first_plain": last["ttft_vs_turn1_plain"],
            "total_ttft_s_cached": round(sum(t["ttft_ms_cached"] for t in per_turn) * len(rows) / 1000, 1),
            "total_ttft_s_plain": round(sum(t["ttft_ms_plain"] for t in per_turn) * len(rows) / 1000, 1),
            "met": last["ttft_vs_turn1_cached"] <= 1.2}
    lossless_ok = all(v["kind"] in ("exact", "near_tie") for v in verdicts)
    result = {"lossless_ok": lossless_ok, "per_turn": per_turn, "goal": goal, "verdicts": verdicts,
              "conversations": len(rows), "turns": args.turns, "max_new_tokens": args.max_new_tokens,
              "prefix_cache_tokens": args.prefix_cache_tokens, "threads": args.threads, "engine": args.engine,
              "batch_shape_noise": round(noise or 0.0, 4), "target": Path(target).name,
              "prefix_cache": vars(engines["cached"].prefix_cache.stats)}
    args.report.parent.mkdir(parents=True, exist_ok=True)
    result["plot"] = plot(result, args.report)
    return finish(result, args.json, report, args.report, lossless_ok,
                  "answers with the prefix cache diverge from answers without it other than at near-ties",
                  "multiturn")


if __name__ == "__main__":
    sys.exit(main())
