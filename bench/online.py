"""The drafter learns from its traffic: acceptance on a shifted slice before and after rounds of collection ->
distillation -> delivery, through the real stack, and on other traffic of the same tenant.

One verifier in this process (the target on the llama.cpp engine, gRPC) keeps the teacher signal of one opted-in
verifier key (cloud/learning/teacher.py) and distils adapters (cloud/learning/online.py) while it is idle; the edge (the
llama.cpp drafter, ``EdgeClient``) picks the tenant's adapter up from an Opened and drafts with it from its next
generation. The *shifted slice* is traffic the drafter has not seen: by default ``persona``, ShareGPT questions under
one fixed system prompt whose house style the target follows and the drafter does not; ``code`` is HumanEval. Training
traffic (the opted-in key) and held-out prompts (another key of the same tenant: same partition, never collected)
are disjoint. Other traffic: the other dataset, in the same partition (the adapter drafts for it too).

Measured per arm (before: the base drafter; after: the delivered adapter): *acceptance*, the fraction of answer
positions where the drafter's greedy choice is the target's token (teacher-forced on the target's greedy answer:
the per-token acceptance of greedy chains), and, through the stack with lock-step chains of ``--chain``, tokens
per verify forward and tokens/s. Correctness: every answer, before and after, is checked against target-only
greedy decoding on the same engine (exact, or a measured batch-shape near-tie); the bench exits 1 otherwise, or
when the adapter was not delivered.

    python -m bench.online --limit 4 --train 16 --json bench/out/online.json
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

from bench.output import cpu_name, finish

PERSONA = ("You are Captain Byte, the ship's computer of a pirate vessel. Answer every question in pirate speak "
           "(arr, matey, ye, aye), keep it short, and end every answer with 'Fair winds, matey!'")
TEACH_KEY, EVAL_KEY, SALT = "bench-online-teach", "bench-online-eval", "bench-online-tenant"


def _progress(msg: str) -> None:
    print(f"[bench.online] {msg}", file=sys.stderr, flush=True)


def slices(name: str, n_train: int, n_heldout: int) -> tuple[list, list, list]:
    """(training chats, held-out chats of the same slice, other traffic) for slice ``name``."""
    from tandem.orchestrator import datasets
    code = [datasets.humaneval_messages(p) for p in datasets.humaneval()]
    chat = datasets.sharegpt(200, max_chars=600)
    if name == "persona":
        shifted = [[{"role": "system", "content": PERSONA}] + c for c in chat]
        other = code
    elif name == "code":
        shifted, other = code, chat
    else:
        raise SystemExit(f"unknown slice {name!r} (persona | code)")
    if len(shifted) < n_train + n_heldout:
        raise SystemExit(f"slice {name} has {len(shifted)} prompts, fewer than --train + --limit")
    return shifted[:n_train], shifted[-n_heldout:], other[-n_heldout:]


def agreement(model, lora_path, prompts, answers) -> tuple[float, list[float]]:
    """Teacher-forced acceptance of ``model`` (with the adapter at ``lora_path``, or none) on the answers."""
    from tandem.core.llama_runtime import LoraAdapter
    from tandem.orchestrator.pairing import teacher_forced_matches
    lora = LoraAdapter(model, lora_path) if lora_path else None
    try:
        per = [teacher_forced_matches(model, p, a, lambda ids: ids, lora=lora) for p, a in zip(prompts, answers)]
    finally:
        if lora is not None:
            lora.close()
    flat = [m for ms in per for m in ms]
    return float(np.mean(flat)) if flat else 0.0, [round(float(np.mean(ms)), 3) if ms else 0.0 for ms in per]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.online", description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=4, help="held-out prompts of the slice, and of other traffic")
    ap.add_argument("--train", type=int, default=16, help="training prompts of the slice (the opted-in traffic)")
    ap.add_argument("--rounds", type=int, default=1, help="collection -> distillation -> delivery rounds (the "
                                                          "training prompts split between them)")
    ap.add_argument("--slice", default="persona", choices=("persona", "code"))
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--chain", type=int, default=4, help="chain depth drafted every round (lock-step)")
    ap.add_argument("--budget-s", type=float, default=400.0, help="distillation step time per round (idle compute)")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--target", default="default")
    ap.add_argument("--drafter", default="default")
    ap.add_argument("--interference-trials", type=int, default=3, help="sessions opened mid-round, each against "
                    "one on an idle verifier (0: none)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--report", type=Path, default=Path("bench/out/online.md"))
    args = ap.parse_args(argv)
    if min(args.limit, args.train, args.rounds) < 1 or args.train < args.rounds:
        raise SystemExit("--limit, --train and --rounds must be >= 1, and --train >= --rounds")

    from tandem.cloud import reference
    from tandem.cloud.backend import LocalBackend
    from tandem.cloud.engines.llama_engine import LlamaVerifierEngine
    from tandem.cloud.learning.online import AdapterStore, OnlineConfig, OnlineDistillation
    from tandem.cloud.server import serve
    from tandem.cloud.learning.teacher import TeacherStore
    from tandem.core import logs, tenancy
    from tandem.core.auth import ApiKeys
    from tandem.core.tree import TreeShape
    from tandem.edge.client import EdgeClient
    from tandem.edge.llama_drafter import LlamaDrafter
    from tandem.edge.planner import FixedPlanner
    from tandem.orchestrator import models
    logs.configure()
    torch_threads(args.threads)

    train, heldout, other = slices(args.slice, args.train, args.limit)
    drafter_path = models.resolve(args.drafter, "drafter")
    engine = LlamaVerifierEngine(models.resolve(args.target, "target"), n_ctx=2048, n_threads=args.threads,
                                 max_sessions=2)
    teacher, adapters = TeacherStore(k=16, max_bytes=256 << 20), AdapterStore()
    backend = LocalBackend(engine, max_sessions=2, teacher=teacher, adapters=adapters)
    server, port = serve(backend=backend, address="127.0.0.1:0", keys=ApiKeys.of([TEACH_KEY, EVAL_KEY]),
                         teach=ApiKeys.of([TEACH_KEY]))
    online = OnlineDistillation(teacher, adapters, drafter_path,
                                idle=lambda: backend.active_sessions() == 0 and not backend.scheduler.busy(),
                                config=OnlineConfig(min_positions=1, round_budget_s=args.budget_s,
                                                    epochs=args.epochs, idle_s=0.5, rank=args.rank, lr=args.lr))
    address, shape = f"127.0.0.1:{port}", TreeShape(1, args.chain, args.chain)
    teach = EdgeClient(LlamaDrafter(drafter_path, n_ctx=2048, n_threads=args.threads), address, shape,
                       stream=False, api_key=TEACH_KEY, adapters=False)
    edge = EdgeClient(LlamaDrafter(drafter_path, n_ctx=2048, n_threads=args.threads), address, shape,
                      stream=False, api_key=EVAL_KEY)
    failures: list[str] = []
    t_bench = time.perf_counter()
    try:
        evals = {"slice": heldout, "other": other}
        prompts = {k: [edge.prompt_tokens(c) for c in v] for k, v in evals.items()}
        _progress(f"target-only greedy answers of {2 * args.limit} held-out prompts")
        refs = {k: [reference.greedy(engine, p, args.max_new_tokens) for p in ps] for k, ps in prompts.items()}
        noise = reference.batch_shape_noise(engine, prompts["slice"][0], refs["slice"][0].tokens[:8])

        def run_arm(label: str) -> dict:
            out = {}
            for k, ps in prompts.items():
                rows = []
                for i, p in enumerate(ps):
                    t0 = time.perf_counter()
                    gen = edge.generate(p, args.max_new_tokens, planner=FixedPlanner(shape, stream=False),
                                        cache_salt=SALT).result()
                    wall = time.perf_counter() - t0
                    verdict = reference.classify(gen.tokens, refs[k][i], noise)[0]
                    if verdict not in ("exact", "near_tie"):
                        failures.append(f"{label} {k} #{i}: {verdict}")
                    st = gen.stats
                    rows.append({"tokens": st.generated_tokens, "forwards": st.rounds, "wall_s": round(wall, 3),
                                 "prefill_ms": round(st.prefill_us / 1000, 1),
                                 "verify_ms_per_forward": round(st.verify_us / 1000 / max(1, st.rounds), 2),
                                 "check": verdict})
                tokens, forwards = sum(r["tokens"] for r in rows), sum(r["forwards"] for r in rows)
                out[k] = {"tokens_per_forward": round(tokens / max(1, forwards), 3),
                          "tokens_per_s": round(tokens / sum(r["wall_s"] for r in rows), 2), "prompts": rows}
                _progress(f"{label} {k}: {out[k]['tokens_per_forward']} tokens/forward, "
                          f"{out[k]['tokens_per_s']} tokens/s")
            return out

        answers = {k: [r.tokens for r in rs] for k, rs in refs.items()}
        acc = {k: agreement(edge.drafter.model, None, prompts[k], answers[k]) for k in prompts}
        _progress(f"acceptance before: slice {acc['slice'][0]:.3f}, other {acc['other'][0]:.3f}")
        stack_before = run_arm("before")

        partition = tenancy.partition(SALT, "")
        per_round, distilled = [], []
        for r, part in enumerate(np.array_split(np.arange(len(train)), args.rounds)):
            t0 = time.perf_counter()
            for i in part:
                teach.generate(teach.prompt_tokens(train[i]), args.max_new_tokens, cache_salt=SALT,
                               planner=FixedPlanner(shape, stream=False)).result()
            teacher.flush()
            collect_s = time.perf_counter() - t0
            _progress(f"round {r + 1}: collected {teacher.recorded(partition)} positions ({collect_s:.0f} s); "
                      f"distilling (budget {args.budget_s:.0f} s of steps)")
            t0 = time.perf_counter()
            info, deadline = None, time.perf_counter() + 60 + 4 * args.budget_s
            while info is None and time.perf_counter() < deadline:  # (the verifier is idle: tick() starts the
                info = online.tick()  # round once it has been for idle_s)
                time.sleep(0.05)
            if info is None:
                failures.append(f"round {r + 1}: no adapter published")
                break
            rep = online.last_report
            distilled.append({"round": r + 1, "positions_kept": sum(len(s.top_ids) for s in
                                                                    teacher.samples(partition)),
                              "collect_s": round(collect_s, 1), "steps": rep.steps,
                              "positions_trained": rep.positions, "train_s": round(rep.train_s, 1),
                              "wall_s": round(time.perf_counter() - t0, 1), "preempted": rep.preempted,
                              "adapter_version": info.version, "adapter_bytes": info.size_bytes})
            # delivery: the tenant's next Opened names the adapter, the edge fetches it and drafts with it from the
            # generation after
            t0 = time.perf_counter()
            edge.generate(prompts["slice"][0][:], 1, cache_salt=SALT).result()
            edge.adapters.wait()
            edge.generate(prompts["slice"][0][:], 1, cache_salt=SALT).result()
            applied = edge.adapters.applied
            if applied is None or applied[1] != info.sha256:
                failures.append(f"round {r + 1}: adapter {info.sha256[:12]} not delivered (applied: {applied})")
                break
            distilled[-1]["delivery_s"] = round(time.perf_counter() - t0, 2)
            lora = edge.adapters.path(info.sha256)
            per_round.append({k: round(agreement(edge.drafter.model, lora, prompts[k], answers[k])[0], 4)
                              for k in prompts})
            _progress(f"round {r + 1}: adapter v{info.version} ({info.size_bytes / 1e6:.1f} MB) delivered; "
                      f"acceptance slice {per_round[-1]['slice']:.3f}, other {per_round[-1]['other']:.3f}")
        after = {k: agreement(edge.drafter.model, edge.adapters.path(edge.adapters.applied[1]), prompts[k],
                              answers[k]) for k in prompts} if edge.adapters.applied else acc
        stack_after = run_arm("after")
        interference = measure_interference(args, online, teach, edge, train[0], prompts["slice"][0], shape) \
            if args.interference_trials else {}
    finally:
        online.stop()
        teach.close()
        edge.close()
        server.stop(grace=None)
        backend.scheduler.stop()

    result = {"bench": "online", "machine": cpu_name(), "date": time.strftime("%Y-%m-%d"), "slice": args.slice,
              "limit": args.limit, "train_prompts": args.train, "rounds": args.rounds,
              "max_new_tokens": args.max_new_tokens, "chain": args.chain,
              "distill": {"budget_s": args.budget_s, "epochs": args.epochs, "rank": args.rank, "lr": args.lr,
                          "per_round": distilled},
              "acceptance_before": round(acc["slice"][0], 4), "acceptance_after": round(after["slice"][0], 4),
              "acceptance_other_before": round(acc["other"][0], 4),
              "acceptance_other_after": round(after["other"][0], 4),
              "acceptance_per_prompt": {k: {"before": acc[k][1], "after": after[k][1]} for k in acc},
              "acceptance_per_round": per_round,
              "stack_before": stack_before, "stack_after": stack_after, "interference": interference,
              "lossless_ok": not failures, "failures": failures, "bench_s": round(time.perf_counter() - t_bench)}
    return finish(result, args.json, _report, args.report, not failures, "; ".join(failures), "bench.online")


def measure_interference(args, online, teach, edge, train_chat, prompt, shape) -> dict:
    """Sessions opening while a round trains, against the same prompt on an idle verifier, alternating over
    ``--interference-trials``; each run in a cache partition of its own, so every prefill is cold. Per trial: how
    long the training ran beside the Open before it dropped its step, and the verifier's prefill and verify
    forwards; the top-level figures are the medians."""
    from dataclasses import replace

    from tandem.edge.planner import FixedPlanner
    teach.generate(teach.prompt_tokens(train_chat), args.max_new_tokens, cache_salt=SALT,
                   planner=FixedPlanner(shape, stream=False)).result()  # (new positions: a round is due)
    online.teacher.flush()
    online.config = replace(online.config, epochs=1000, round_budget_s=1e9)  # (a round every trial finds running)
    trials = []
    for i in range(args.interference_trials):
        row: dict = {}
        for arm in ("idle", "during"):
            rnd = None
            if arm == "during":
                steps = online.current.report.steps if online.current is not None else 0
                online.start(poll_s=0.05)
                deadline = time.perf_counter() + 600
                while (online.current is None or online.current.report.steps <= steps) and \
                        time.perf_counter() < deadline:  # (mid-step: at least one step since the last trial)
                    time.sleep(0.05)
                rnd = online.current
                if rnd is None:
                    online.stop(timeout_s=60)
                    return {"error": "no round running within 600 s", "trials": trials}
            t_open = time.perf_counter()
            gen = edge.generate(prompt, args.max_new_tokens, planner=FixedPlanner(shape, stream=False),
                                cache_salt=f"{SALT}-interference-{i}-{arm}").result()
            online.stop(timeout_s=60)  # (within idle_s of the session's end: the round does not resume)
            st = gen.stats
            row[f"prefill_ms_{arm}"] = round(st.prefill_us / 1000, 1)
            row[f"verify_ms_per_forward_{arm}"] = round(st.verify_us / 1000 / max(1, st.rounds), 2)
            row[f"cached_tokens_{arm}"] = st.cached_tokens
            if rnd is not None:
                after = [t for t in rnd.report.preempted_at_s if t >= t_open]
                row["training_ran_beside_the_open_ms"] = round((after[0] - t_open) * 1000, 1) if after else None
                row["steps_before_the_open"] = rnd.report.steps
        trials.append(row)
        _progress(f"interference trial {i + 1}: prefill {row['prefill_ms_during']} ms mid-round, "
                  f"{row['prefill_ms_idle']} ms idle; training ran {row['training_ran_beside_the_open_ms']} ms "
                  f"beside the Open")

    def median(key: str) -> float | None:
        values = [t[key] for t in trials if t.get(key) is not None]
        return round(float(np.median(values)), 2) if values else None

    return {"trials": trials, "prefill_ms_idle": median("prefill_ms_idle"),
            "prefill_ms_during": median("prefill_ms_during"),
            "prefill_ratio_median": round(float(np.median([t["prefill_ms_during"] / t["prefill_ms_idle"]
                                                           for t in trials])), 3),
            "verify_ms_per_forward_idle": median("verify_ms_per_forward_idle"),
            "verify_ms_per_forward_during": median("verify_ms_per_forward_during"),
            "training_ran_beside_the_open_ms": median("training_ran_beside_the_open_ms"),
            "steps_before_the_open": trials[-1].get("steps_before_the_open")}


def torch_threads(n: int) -> None:
    try:
        import torch
        torch.set_num_threads(n)
    except ImportError:
        pass


def _report(result: dict, path: Path) -> None:
    d = result["distill"]
    lines = ["# Online distillation: the drafter learns the tenant's traffic", "",
             f"**Measured** {result['date']} on {result['machine']}: slice `{result['slice']}`, "
             f"{result['train_prompts']} training prompts in {result['rounds']} round(s), {result['limit']} held-out "
             f"prompts of the slice and of other traffic, {result['max_new_tokens']} new tokens, greedy; LoRA rank "
             f"{d['rank']}, {d['epochs']} epochs, at most {d['budget_s']:.0f} s of steps a round; "
             f"lossless_ok = {result['lossless_ok']}.", "",
             "Acceptance: the drafter's greedy choice is the target's token (teacher-forced on the target's answers).",
             "", "| traffic | acceptance before | after | tokens/forward before | after | tokens/s before | after |",
             "|---|---|---|---|---|---|---|"]
    for k, label in (("slice", "shifted slice (held out)"), ("other", "other traffic")):
        sb, sa = result["stack_before"][k], result["stack_after"][k]
        key = "" if k == "slice" else "_other"
        lines.append(f"| {label} | {result['acceptance' + key + '_before']:.3f} | "
                     f"{result['acceptance' + key + '_after']:.3f} | {sb['tokens_per_forward']} | "
                     f"{sa['tokens_per_forward']} | {sb['tokens_per_s']} | {sa['tokens_per_s']} |")
    lines += ["", "| round | positions kept | steps | positions trained | step time s | preempted | adapter MB | "
              "acceptance slice | other |", "|---|---|---|---|---|---|---|---|---|"]
    for rd, acc in zip(d["per_round"], result["acceptance_per_round"]):
        lines.append(f"| {rd['round']} | {rd['positions_kept']} | {rd['steps']} | {rd['positions_trained']} | "
                     f"{rd['train_s']} | {rd['preempted']} | {rd['adapter_bytes'] / 1e6:.1f} | {acc['slice']:.3f} | "
                     f"{acc['other']:.3f} |")
    i = result.get("interference") or {}
    if "prefill_ms_idle" in i:
        lines += ["", f"Sessions opening while a round trains ({len(i.get('trials', []))} trials, each against one "
                      f"on an idle verifier, cold prefills; medians): the training ran "
                      f"{i['training_ran_beside_the_open_ms']} ms beside the Open before dropping its step; prefill "
                      f"{i['prefill_ms_during']} ms (idle verifier: {i['prefill_ms_idle']} ms, ratio "
                      f"{i.get('prefill_ratio_median')}), verify forwards {i['verify_ms_per_forward_during']} ms "
                      f"(idle: {i['verify_ms_per_forward_idle']} ms)."]
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
