"""The gateway's drafter pool: multi-turn chats on a few drafters, lent first-free against by partition and
shared prefix (``orchestrator.gateway.drafter_pool``), in one run.

    python -m bench.drafter_pool --limit 2 --turns 6 --drafters 3 --json bench/out/drafter_pool.json

``--limit`` ShareGPT conversations of ``--turns`` user turns are answered first by the target alone (greedy,
``--max-new-tokens``), which fixes every turn's prompt. The turns are then replayed round-robin across the
conversations (every conversation's first turn, then every second turn, ...), each request speculatively decoded
through an EdgeClient lent by a pool, against one local verifier with the prefix cache. Two pools of ``--drafters``
llama.cpp drafters, one lending the drafter free the longest (the gateway before) and one by partition and shared
prefix, take every request in turn (which goes first alternates); each conversation is its own cache partition in
each pool. Fewer conversations in flight than drafters is the case the lending decides: a first-free pool then
rotates a conversation's turns over drafters that hold other conversations.

Reported per pool: the tokens a drafter evaluated before drafting (the prompt less the prefix it kept from its last
generation, which it keeps only for the same partition), wall time and tokens/s per request, and acceptance.
Every answer is checked against the target's own (exit 1 on a divergence that is not a near-tie).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

from .output import cpu_name, finish

ARMS = ("first_free", "affinity")


def _progress(msg: str) -> None:
    print(f"[drafter_pool] {msg}", file=sys.stderr, flush=True)


def report(result: dict, path: Path) -> None:
    a, f = result["arms"]["affinity"], result["arms"]["first_free"]
    lines = ["# Drafter pool: lending by partition and shared prefix against first-free", "",
             f"Measured on {result['cpu']}, {result['date']}, {result['threads']} threads. {result['conversations']} "
             f"ShareGPT conversations x {result['turns']} turns, replayed round-robin, on {result['drafters']} "
             f"llama.cpp drafters per pool ({result['target']} verifier with the prefix cache, in-process over "
             f"gRPC, tree {result['shape']}, {result['max_new_tokens']} new tokens per answer). "
             f"lossless_ok = {result['lossless_ok']}.", "",
             "| pool | drafter tokens evaluated before drafting | kept from the last turn | wall s / request | "
             "tokens/s | tau |", "|---|---|---|---|---|---|"]
    for name in ARMS:
        r = result["arms"][name]
        lines.append(f"| {name} | {r['catch_up_tokens']} | {r['kept_tokens']} | {r['wall_s_mean']} | "
                     f"{r['tokens_per_s_mean']} | {r['tau_mean']} |")
    lines += ["", f"Affinity against first-free: {a['catch_up_tokens']} against {f['catch_up_tokens']} tokens "
                  f"evaluated by the drafters; wall per request {result['wall_ratio']}x (median of the per-request "
                  f"ratios {result['wall_ratio_median']}x); tokens/s {result['tokens_per_s_ratio']}x.", "",
              "| turn | prompt tokens | first_free: evaluated / wall s | affinity: evaluated / wall s |",
              "|---|---|---|---|"]
    for t in result["per_turn"]:
        lines.append(f"| {t['turn']} | {t['prompt_tokens']} | {t['first_free_catch_up']} / {t['first_free_wall_s']} "
                     f"| {t['affinity_catch_up']} / {t['affinity_wall_s']} |")
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.drafter_pool", description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=2, help="conversations")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--drafters", type=int, default=3, help="drafters in each pool")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--shape", default="1,4,4", help="the drafters' tree shape (k,n,d)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--target", default="default")
    ap.add_argument("--drafter", default="default")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--report", type=Path, default=Path("bench/out/drafter_pool.md"))
    args = ap.parse_args(argv)

    from tandem.cloud import reference
    from tandem.cloud.engines import load_engine
    from tandem.cloud.server import serve
    from tandem.core import logs
    from tandem.core.chat_template import ChatTemplate
    from tandem.core.tree import TreeShape, common_prefix
    from tandem.edge.client import EdgeClient
    from tandem.edge.llama_drafter import LlamaDrafter
    from tandem.orchestrator import models
    from tandem.orchestrator.datasets import sharegpt_dialogues
    from tandem.orchestrator.gateway.drafter_pool import DrafterPool
    logs.configure()

    target, drafter_path = models.resolve(args.target, "target"), models.resolve(args.drafter, "drafter")
    engine = load_engine("llama.cpp", model_path=str(target), n_ctx=4096, n_threads=args.threads, max_sessions=4,
                         prefix_cache_tokens=16384)
    tok = engine.model
    template = ChatTemplate(engine.chat_template, engine.bos_token, engine.eos_token)
    dialogues = sharegpt_dialogues(args.turns, args.limit)

    # every turn's prompt, fixed by the target's own answers
    prompts: list[list[list[int]]] = []
    refs: list[list] = []
    for c, user_turns in enumerate(dialogues):
        messages: list[dict] = []
        prompts.append([])
        refs.append([])
        for text in user_turns:
            messages.append({"role": "user", "content": text})
            prompt = tok.tokenize(template.render(messages))
            ref = reference.greedy(engine, prompt, args.max_new_tokens)
            prompts[c].append(prompt)
            refs[c].append(ref)
            answer = b"".join(tok.piece(t) for t in ref.tokens if not tok.is_eog(t)).decode("utf-8", "replace")
            messages.append({"role": "assistant", "content": answer})
        _progress(f"conversation {c + 1}: {len(user_turns)} turns answered by the target, "
                  f"{len(prompts[c][-1])} prompt tokens at the last")
    noise = reference.batch_shape_noise(engine, prompts[0][0], refs[0][0].tokens[:8])
    engine.reset_prefix_cache()  # (both pools start from the same empty verifier cache)

    server, port = serve(engine, "127.0.0.1:0", max_sessions=4)
    shape = TreeShape.parse(args.shape)
    pools = {arm: DrafterPool([EdgeClient(LlamaDrafter(drafter_path, n_ctx=4096, n_threads=args.threads),
                                          f"127.0.0.1:{port}", shape, stream=False) for _ in range(args.drafters)])
             for arm in ARMS}
    history: dict[int, tuple[str, list[int]]] = {}  # id(client) -> (partition, the history its cells hold)
    rows = {arm: [] for arm in ARMS}
    verdicts = []
    i = 0
    for turn in range(args.turns):
        for c in range(len(dialogues)):
            if turn >= len(prompts[c]):
                continue
            prompt, ref = prompts[c][turn], refs[c][turn]
            for arm in (ARMS if i % 2 == 0 else ARMS[::-1]):
                i += 1
                salt = f"{arm}/{c}"
                pool = pools[arm]
                client = pool.acquire(salt, prompt) if arm == "affinity" else pool.acquire()
                last = history.get(id(client))
                kept = common_prefix(last[1], prompt) if last is not None and last[0] == salt else 0
                t0 = time.perf_counter()
                gen = client.generate(prompt, max_new_tokens=args.max_new_tokens, cache_salt=salt).result()
                wall = time.perf_counter() - t0
                pool.release(client)
                history[id(client)] = (salt, prompt + gen.tokens)
                v = reference.classify(gen.tokens, ref, noise)
                verdicts.append({"arm": arm, "conversation": c, "turn": turn + 1, "kind": v.kind, "at": v.at})
                rows[arm].append({"conversation": c, "turn": turn + 1, "prompt_tokens": len(prompt), "kept": kept,
                                  "catch_up": len(prompt) - kept, "wall_s": wall,
                                  "tokens_per_s": gen.stats.tokens_per_s, "tau": gen.stats.tau})
                _progress(f"{arm}: conversation {c + 1} turn {turn + 1}, {len(prompt)} tokens, kept {kept}, "
                          f"{wall:.2f} s ({v.kind})")
    server.stop(grace=None)
    for pool in pools.values():
        pool.close()

    arms = {}
    for arm in ARMS:
        r = rows[arm]
        arms[arm] = {"catch_up_tokens": int(sum(x["catch_up"] for x in r)),
                     "kept_tokens": int(sum(x["kept"] for x in r)),
                     "wall_s_mean": round(float(np.mean([x["wall_s"] for x in r])), 3),
                     "tokens_per_s_mean": round(float(np.mean([x["tokens_per_s"] for x in r])), 2),
                     "tau_mean": round(float(np.mean([x["tau"] for x in r])), 2), "requests": r}
    per_turn = []
    for turn in range(args.turns):
        at = {arm: [x for x in rows[arm] if x["turn"] == turn + 1] for arm in ARMS}
        if not at["affinity"]:
            continue
        row = {"turn": turn + 1, "prompt_tokens": round(float(np.mean([x["prompt_tokens"] for x in at["affinity"]])))}
        for arm in ARMS:
            row[f"{arm}_catch_up"] = round(float(np.mean([x["catch_up"] for x in at[arm]])))
            row[f"{arm}_wall_s"] = round(float(np.mean([x["wall_s"] for x in at[arm]])), 2)
        per_turn.append(row)
    pairs = [(a["wall_s"], f["wall_s"]) for a, f in zip(rows["affinity"], rows["first_free"])]
    lossless_ok = all(v["kind"] in ("exact", "near_tie") for v in verdicts)
    result = {"lossless_ok": lossless_ok, "arms": arms, "per_turn": per_turn, "verdicts": verdicts,
              "wall_ratio": round(arms["affinity"]["wall_s_mean"] / arms["first_free"]["wall_s_mean"], 3),
              "wall_ratio_median": round(float(np.median([a / f for a, f in pairs])), 3),
              "tokens_per_s_ratio": round(arms["affinity"]["tokens_per_s_mean"] /
                                          arms["first_free"]["tokens_per_s_mean"], 3),
              "conversations": len(dialogues), "turns": args.turns, "drafters": args.drafters,
              "max_new_tokens": args.max_new_tokens, "shape": args.shape, "threads": args.threads,
              "batch_shape_noise": round(noise, 4), "target": Path(target).name, "cpu": cpu_name(),
              "date": time.strftime("%Y-%m-%d")}
    return finish(result, args.json, report, args.report, lossless_ok,
                  "an answer diverges from the target's own other than at a near-tie", "drafter_pool")


if __name__ == "__main__":
    sys.exit(main())
