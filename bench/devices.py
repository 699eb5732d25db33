"""Three devices share one verifier: a thin client (no drafter), a slow device and a fast one, each with the
product's draft policy; does each get the mode that serves it best, and none less than plain decoding?

    python -m bench.devices --json out.json

``tandem serve --engine scripted`` paced to a GPU cost curve slowed ``--cost-scale`` K times (as ``bench.scale``
runs it: the product's servicer and scheduler in their own process); each device is the product's ``EdgeClient``
whose drafter replays the acceptance traces on its device class's clock x K (``bench.scale.TraceDrafter``). The
devices ask for answers one after another, all three at once, in four arms on the same verifier:

- ``adaptive``: the draft policy chooses (plain decoding, lock-step rounds, or drafting while the verifier decodes
  alone) from what it measures;
- ``plain``, ``rounds``, ``draft``: every device held to that mode, the drafting ones at the deepest chain the
  policy chose for that device in the adaptive arm (its choice of depth, its mode overridden);
- ``host``: every device hands its runs to the verifier's host drafter (``cloud.host_drafting``; here
  ``bench.trace_host``, replaying the same traces on the ``--host-class`` clock x K), which picks its own depth.

Per device and arm: tokens/s as the user sees them (answer tokens / the answer's wall time, first token included,
in simulated time) after ``--warmup-requests`` answers (a policy's first answer is spent learning the device, the
link and the verifier: its rate is reported apart), the policy's modes. Checks: under the policy every device gets
at least ``--min-vs-plain`` x plain decoding's tokens/s, and at least ``--min-vs-best`` x the best held mode's. A
thin client has no drafter: its policy chooses between plain decoding and the host's drafts. ``--no-host``: a
verifier without a host drafter (the thin client then decodes plainly; no host arm). Simulated regime (paced),
labelled so.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from tandem.core.tree import TreeShape
from tandem.edge.client import EdgeClient
from tandem.edge.planner import FixedPlanner
from tandem.edge.policy import PolicyConfig

from .capacity import DEFAULT_TRACES
from .capsim.physics import LAPTOP, Device
from .capsim.regimes import DEVICES
from .capsim.traces import Traces
from .scale import MISS, Record, RecordingPolicy, TraceDrafter, device_keys, serve

ARMS = ("adaptive", "plain", "rounds", "draft", "host")
HELD = {True: ("plain", "rounds", "draft", "host"), False: ("plain", "rounds", "draft")}  # by whether a host drafts
THIN = "thin-client"


def _progress(msg: str) -> None:
    print(f"[bench.devices] {msg}", file=sys.stderr, flush=True)


def planner_for(arm: str, device: Device | None, shape: TreeShape | None, record: Record, widths):
    if arm == "host":
        return FixedPlanner(None, host=True)
    if arm == "adaptive":  # (a thin client: the host's drafts or none; no shadow chains, it has no drafter)
        config = PolicyConfig(widths=widths, **({} if device else {"shadow_depth": 0}))
        return RecordingPolicy(config, record, modes=("draft", "rounds", "host") if device else ("host",))
    if device is None or arm == "plain":  # (a thin client decodes plainly in the device-drafting arms)
        return FixedPlanner(None)
    return FixedPlanner(shape, stream=arm == "draft")


def run_arm(args, traces: Traces, address: str, devices: dict[str, Device | None], arm: str,
            shapes: dict[str, TreeShape | None], keys: dict[str, str]) -> dict:
    """All devices at once, ``--requests`` answers each; per device: tokens/s per answer and what it drafted."""
    k, out, errors = args.cost_scale, {}, []
    agree = traces.acceptance(args.dataset)

    def one(name: str, i: int) -> None:
        device = devices[name]
        rng = random.Random(args.seed * 1_000_003 + i)
        record = Record()
        drafter = TraceDrafter(device or LAPTOP, k, agree)  # (a thin client's is never asked to draft)
        planner = planner_for(arm, device, shapes.get(name), record, args.widths)
        rates, wrong, shapes_used = [], 0, Counter()
        with EdgeClient(drafter, address, policy=planner, adapters=False, api_key=keys[name]) as client:
            for r in range(args.warmup_requests + args.requests):
                text = traces.request(args.dataset, args.answer_tokens, rng)
                drafter.replay(text, random.Random(rng.random()))
                t0 = time.perf_counter()
                gen = client.generate([0] * text.prompt_tokens, max_new_tokens=args.answer_tokens).result()
                rates.append(len(gen.tokens) / ((time.perf_counter() - t0) / k))
                wrong += gen.tokens != list(range(1, args.answer_tokens + 1))
                if isinstance(planner, RecordingPolicy) and r >= args.warmup_requests:
                    shapes_used.update(str(d["shape"]) for d in planner.decisions  # (the device's own trees)
                                       if d["shape"] and d["chose"] in ("draft", "rounds"))
        warm, measured = rates[:args.warmup_requests], rates[args.warmup_requests:]
        out[name] = {"tokens_per_s": round(statistics.fmean(measured), 2), "answers": len(measured),
                     "first_answers_tokens_per_s": [round(x, 2) for x in warm], "wrong": wrong,
                     **({"policy": record.summary(k), "shapes": dict(shapes_used)} if record.modes else {})}

    def guarded(name: str, i: int) -> None:
        try:
            one(name, i)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(n, i)) for i, n in enumerate(devices)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"a device failed in arm {arm}: {errors[0]!r}") from errors[0]
    return out


def deepest(shapes: dict) -> TreeShape | None:
    """The deepest chain among the policy's choices (``"k,n,d"`` strings), or None when it drafted none."""
    chains = [TreeShape.parse(s) for s in shapes]
    return max(chains, key=lambda s: s.d, default=None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--curve", default="derived-l40s-qwen2.5-14b.json")
    ap.add_argument("--cost-scale", type=float, default=4.0)
    ap.add_argument("--slow", default="browser-tab", choices=sorted(DEVICES), help="the slow device's class")
    ap.add_argument("--fast", default="laptop", choices=sorted(DEVICES), help="the fast device's class")
    ap.add_argument("--dataset", default="humaneval")
    ap.add_argument("--traces", type=Path, default=DEFAULT_TRACES)
    ap.add_argument("--answer-tokens", type=int, default=96)
    ap.add_argument("--requests", type=int, default=4, help="answers per device and arm, measured")
    ap.add_argument("--warmup-requests", type=int, default=1,
                    help="answers per device and arm before those (the policy learns the device, the link and the "
                         "verifier on them: reported apart as first_answers_tokens_per_s)")
    ap.add_argument("--limit", type=int, default=0, help="answers per device and arm (alias of --requests)")
    ap.add_argument("--widths", default="1", help="tree widths the policy prices (the held arms draft chains)")
    ap.add_argument("--window-ms", type=float, default=2.0)
    ap.add_argument("--max-batch-tokens", type=int, default=512)
    ap.add_argument("--min-vs-plain", type=float, default=0.98)
    ap.add_argument("--min-vs-best", type=float, default=0.9)
    ap.add_argument("--host-class", default="laptop", choices=sorted(DEVICES),
                    help="the verifier host's drafter speed, as a device class (its CPU drafts the same model)")
    ap.add_argument("--no-host", action="store_true", help="a verifier without a host drafter")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    args.requests = args.limit or args.requests
    args.widths = tuple(int(w) for w in args.widths.split(","))
    if not 4 <= args.answer_tokens <= MISS - 2:
        ap.error(f"--answer-tokens must be 4..{MISS - 2}")
    traces = Traces.load(args.traces)
    devices: dict[str, Device | None] = {THIN: None, args.slow: DEVICES[args.slow], args.fast: DEVICES[args.fast]}
    # a key per device and arm: each arm starts from nothing the verifier learnt of its devices in the arms before
    # (the host's chain depth, the prefix cache: both are kept per partition, i.e. per key)
    pool = iter(device_keys(len(devices) * len(ARMS)))
    keys = {arm: {name: next(pool) for name in devices} for arm in ARMS}
    hosted = not args.no_host
    host = None if args.no_host else [
        "--host-class", args.host_class, "--cost-scale", str(args.cost_scale), "--dataset", args.dataset,
        "--traces", str(args.traces), "--slots", str(len(devices)), "--answer-tokens", str(args.answer_tokens),
        "--miss", str(MISS), "--seed", str(args.seed)]
    proc, address = serve(args, len(devices), [k for ks in keys.values() for k in ks.values()], host=host)
    arms: dict[str, dict] = {}
    try:
        shapes: dict[str, TreeShape | None] = {}
        for arm in ARMS if hosted else ARMS[:-1]:
            _progress(f"arm {arm} ...")
            arms[arm] = run_arm(args, traces, address, devices, arm, shapes, keys[arm])
            if arm == "adaptive":
                shapes = {n: deepest(r.get("shapes", {})) or TreeShape(1, 4, 4) for n, r in arms[arm].items()}
            _progress(f"arm {arm}: " + ", ".join(f"{n} {r['tokens_per_s']} tok/s" for n, r in arms[arm].items()))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    verdicts, ok = {}, True
    for name, device in devices.items():
        rate = {arm: arms[arm][name]["tokens_per_s"] for arm in arms}
        held = HELD[hosted] if device is not None else ("plain", "host")[:1 + hosted]
        best = max(held, key=lambda a: rate[a])
        v = {"tokens_per_s": rate, "best_held_mode": best,
             "vs_plain": round(rate["adaptive"] / rate["plain"], 3),
             "vs_best": round(rate["adaptive"] / rate[best], 3),
             "modes": arms["adaptive"][name].get("policy", {}).get("policy_modes", {"plain": 1.0}),
             "held_shape": str(shapes.get(name)) if device is not None else None}
        v["ok"] = v["vs_plain"] >= args.min_vs_plain and v["vs_best"] >= args.min_vs_best
        ok &= v["ok"]
        verdicts[name] = v
        _progress(f"{name}: adaptive {v['vs_plain']}x plain, {v['vs_best']}x the best held mode ({best}); modes "
                  f"{v['modes']}")
    lossless = all(r["wrong"] == 0 for a in arms.values() for r in a.values())
    out = {"ok": ok and lossless, "lossless_ok": lossless, "label": "simulated (a paced scripted verifier)",
           "host": None if args.no_host else DEVICES[args.host_class].__dict__,
           "curve": args.curve, "cost_scale": args.cost_scale, "dataset": args.dataset,
           "answer_tokens": args.answer_tokens, "requests": args.requests,
           "devices": {n: (d.__dict__ if d is not None else None) for n, d in devices.items()},
           "arms": arms, "devices_verdicts": verdicts}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1, default=str))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
