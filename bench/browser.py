"""Drafting in a browser tab against drafting on the gateway (a thin client), on the real pair.

    python -m bench.browser --limit 2 --json bench/out/browser.json

One stack in this process: the target behind a gRPC verifier, the gateway (REST, the chat page, WebSocket sessions)
with its own drafter (the CLI's default engine), and the drafter's self-contained export for browsers
(``dynamic-int8``, run by onnxruntime-web's WASM build with as many threads as the page gets, up to 4: the
gateway serves the page cross-origin isolated). Per prompt (``--limit`` from HumanEval and
from ShareGPT), temperature 0, lock-step rounds:

- browser: headless Chromium opens /chat, ticks "draft in this browser" and asks; the page drafts, the verifier
  checks each chain over the WebSocket session. Twice: chains as the page's policy chooses (``browser``:
  clients/web/src/policy.ts, the closed form on the tab's own rounds) and chains of 4 (``browser_depth4``), and
  once more with trees (``browser_tree``, of ``--tree``'s shape; ``--tree ""``: not run).
  Figures from the page: ms per drafted token in the tab once the prompt is in (the prompt's own prefill in the
  tab apart, ``prompt_ms``), tau, tokens/s from the session's start to its last verdict;
- gateway: a thin client's REST request (``/v1/chat/completions``); the gateway drafts chains of 4 beside the
  verifier. tau and its draft ms per drafted token from the response's statistics, tokens/s over the request's
  wall time.

Every browser answer is checked token by token against target-only decoding with the same engine (exact, or a
measured batch-shape near-tie), every gateway answer by its text (``gateway_check``); exits 1 on any other
divergence. All processes share this machine's cores: the figures compare the two placements of the drafter on
one CPU, not a phone or a GPU.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from .output import cpu_name, finish

WEB = Path(__file__).resolve().parent.parent / "clients" / "web"
KEY = "bench-browser-key"
TREE_SIDE = "browser_tree"  # trees of --tree's shape (beside "browser", its policy, and "browser_depth4")


def _progress(msg: str) -> None:
    print(f"[browser] {msg}", file=sys.stderr, flush=True)


def browser_answer(browser, url: str, text: str, max_new: int, query: str = "") -> dict:
    """One answer drafted in a fresh page (its drafter loaded anew: one conversation per prompt); chains as the
    page's policy chooses, or as ``query`` says (``depth=4``, ``tree=2,6,4``)."""
    from playwright.sync_api import expect
    page = browser.new_page()
    try:
        page.goto(f"{url}/chat" + (f"?{query}" if query else ""))
        page.fill("#key", KEY)
        page.fill("#max", str(max_new))
        page.check("#local")
        page.fill("#prompt", text)
        page.click("#send")
        expect(page.locator("#stats:has-text('tokens/s'), .answer:has-text('error')")).to_have_count(1,
                                                                                                  timeout=900_000)
        log = page.locator("#log").text_content() or ""
        if "error" in log:
            raise RuntimeError(f"the page failed: {log[-500:]}")
        figures = page.eval_on_selector("#stats", "e => ({...e.dataset})")
        tokens = json.loads(page.locator(".answer").last.get_attribute("data-tokens") or "[]")
    finally:
        page.close()
    return {"tokens": tokens, "tau": float(figures["tau"]), "tokens_per_s": float(figures["tokensPerS"]),
            "draft_ms_per_token": float(figures["draftMsPerToken"]), "drafted": int(figures["drafted"]),
            "accepted": int(figures["accepted"]), "forwards": int(figures["forwards"]),
            "chain_length": float(figures["chainLength"]), "prompt_ms": float(figures["promptMs"])}


def gateway_answer(url: str, model: str, messages: list[dict], max_new: int) -> dict:
    import httpx
    t0 = time.perf_counter()
    r = httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=900, json={
        "model": model, "messages": messages, "temperature": 0, "max_tokens": max_new})
    seconds = time.perf_counter() - t0
    r.raise_for_status()
    body = r.json()
    t, n = body["tandem"], body["usage"]["completion_tokens"]
    return {"text": body["choices"][0]["message"]["content"], "tokens": n, "tau": t["tau"],
            "tokens_per_s": round(n / seconds, 2),
            "draft_ms_per_token": round(t["draft_ms"] / max(1, t["drafted_tokens"]), 1),
            "drafted": t["drafted_tokens"], "accepted": t["accepted_tokens"], "forwards": t["verify_forwards"]}


def gateway_check(engine, text: str, page_tokens: list[int], page_kind: str, ref, noise: float) -> str:
    """A REST answer carries text, not ids: the reference's text is exact; the browser's answer's text (when that
    was a near-tie) is its kind; anything else is re-tokenized and compared as the browser's was."""
    from tandem.cloud import reference

    def spelled(tokens):
        return b"".join(engine.model.piece(t) for t in tokens).decode("utf-8", errors="replace")
    if text == spelled(ref.tokens):
        return "exact"
    if text == spelled(page_tokens) and page_kind in ("exact", "near_tie"):
        return page_kind
    return reference.classify(engine.model.tokenize(text, special=False), ref, noise)[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.browser", description=__doc__.split("\n")[0])
    ap.add_argument("--limit", type=int, default=2, help="prompts from each dataset")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2, help="the verifier's threads")
    ap.add_argument("--tree", default="2,6,4", help="k,N,D of the trees the page drafts once more (\"\": none)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--report", type=Path, default=Path("bench/out/browser.md"))
    args = ap.parse_args(argv)
    browser_sides = [("browser", ""), ("browser_depth4", "depth=4")] + ([(TREE_SIDE, f"tree={args.tree}")]
                                                                       if args.tree else [])
    sides = [side for side, _ in browser_sides] + ["gateway"]

    import threading

    import httpx
    import uvicorn
    from playwright.sync_api import sync_playwright

    from tandem.cloud import reference
    from tandem.cloud.engines.llama_engine import LlamaVerifierEngine
    from tandem.cloud.server import serve
    from tandem.core.auth import ApiKeys
    from tandem.core.tree import TreeShape
    from tandem.edge.client import EdgeClient
    from tandem.edge.drafter import load_drafter
    from tandem.edge.export.onnx_export import WEB_QUANT, export
    from tandem.orchestrator import models
    from tandem.orchestrator.datasets import humaneval, humaneval_messages, sharegpt
    from tandem.orchestrator.gateway.app import create_app
    from tandem.orchestrator.gateway.config import GatewayConfig, VerifierLink
    from tandem.orchestrator.gateway.drafter_pool import DrafterPool
    logging.getLogger("tandem.gateway.access").setLevel(logging.WARNING)  # a line per request: not this bench's

    chromium = shutil.which("chromium")
    if chromium is None:
        raise SystemExit("bench.browser needs Debian's chromium (apt-get install chromium)")
    _progress("building clients/web (npm run build) ...")
    subprocess.run(["npm", "run", "build"], cwd=WEB, check=True, capture_output=True, timeout=600)
    target_path, drafter_path = models.fetch("target"), models.fetch("drafter")
    _progress("the drafter's browser export (cached after the first run) ...")
    exported = export(drafter_path, WEB_QUANT, self_contained=True)
    engine = LlamaVerifierEngine(target_path, n_ctx=4096, n_threads=args.threads, max_sessions=2)
    server, port = serve(engine, "127.0.0.1:0", max_sessions=2)
    address = f"127.0.0.1:{port}"
    drafter = load_drafter("auto", model_path=drafter_path, n_ctx=4096, n_threads=1)
    client = EdgeClient(drafter, address, TreeShape(1, 4, 4), stream=False)  # chains of 4, lock-step: as the page
    app = create_app(DrafterPool([client]), GatewayConfig(keys=ApiKeys.of([KEY]), verifier=VerifierLink(address),
                                                          browser_drafter=exported, web_client=WEB))
    gateway = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    threading.Thread(target=gateway.run, daemon=True).start()
    while not gateway.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{gateway.servers[0].sockets[0].getsockname()[1]}"
    model = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()["data"][0]["id"]

    chats = [("humaneval", humaneval_messages(p)) for p in humaneval(args.limit)]
    chats += [("sharegpt", c) for c in sharegpt(args.limit)]
    rows, noise = [], None
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            for i, (dataset, messages) in enumerate(chats):
                prompt = engine.model.tokenize(engine.model.chat_prompt(messages))
                ref = reference.greedy(engine, prompt, args.max_new_tokens)
                if noise is None:
                    noise = reference.batch_shape_noise(engine, prompt, ref.tokens)
                row = {"dataset": dataset, "prompt_tokens": len(prompt)}
                for side, query in browser_sides:
                    page = browser_answer(browser, url, messages[-1]["content"], args.max_new_tokens, query)
                    tokens = page.pop("tokens")
                    kind, _ = reference.classify(tokens, ref, noise)
                    row[side] = {**page, "check": kind}
                thin = gateway_answer(url, model, messages, args.max_new_tokens)  # (its text kept in the row)
                row["gateway"] = {**thin, "check": gateway_check(engine, thin["text"], tokens, kind, ref, noise)}
                rows.append(row)
                _progress(f"{i + 1}/{len(chats)} {dataset}: " + "; ".join(
                    f"{side} {row[side]['tokens_per_s']} tokens/s, tau {row[side]['tau']}" for side in sides))
        finally:
            browser.close()
    gateway.should_exit = True
    client.close()
    server.stop(grace=None)

    def median(side: str, key: str, dataset: str | None = None) -> float:
        return round(statistics.median(r[side][key] for r in rows if dataset in (None, r["dataset"])), 2)

    summary = {ds: {side: {k: median(side, k, ds) for k in ("tau", "draft_ms_per_token", "tokens_per_s")}
                    | ({"chain_length": median(side, "chain_length", ds)} if side in ("browser", TREE_SIDE) else {})
                    for side in sides} for ds in ("humaneval", "sharegpt")}
    browser_ok = all(r[side]["check"] in ("exact", "near_tie") for r in rows for side, _ in browser_sides)
    gateway_ok = all(r["gateway"]["check"] in ("exact", "near_tie") for r in rows)
    result = {"lossless_ok": browser_ok and gateway_ok, "rows": rows, "summary": summary,
              "browser_vs_gateway_tokens_per_s": round(median("browser", "tokens_per_s") /
                                                       median("gateway", "tokens_per_s"), 3),
              "policy_vs_depth4_tokens_per_s": round(median("browser", "tokens_per_s") /
                                                     median("browser_depth4", "tokens_per_s"), 3),
              **({"tree": args.tree, "tree_vs_depth4_tokens_per_s": round(
                  median(TREE_SIDE, "tokens_per_s") / median("browser_depth4", "tokens_per_s"), 3)}
                 if args.tree else {}),
              "max_new_tokens": args.max_new_tokens, "batch_shape_noise": round(noise or 0.0, 4),
              "quant": WEB_QUANT, "model_mb": round((exported / "model.onnx").stat().st_size / 1e6),
              "gateway_drafter": f"{type(drafter).__name__} (int4)", "browser_threads": min(4, os.cpu_count() or 1),
              "cpu": cpu_name(platform.machine()),
              "measured": time.strftime("%Y-%m-%d")}
    return finish(result, args.json, report, args.report, result["lossless_ok"],
                  "an answer diverged from target-only decoding other than at a near-tie", "browser")


def report(result: dict, path: Path) -> None:
    lines = [f"# Drafting in the browser against drafting on the gateway ({result['measured']}, measured)", "",
             f"{result['cpu']}, every process on its cores; the browser's drafter: {result['quant']} "
             f"({result['model_mb']} MB), onnxruntime-web WASM in headless Chromium, "
             f"{result['browser_threads']} threads; the gateway's: {result['gateway_drafter']}, one thread. Chains of "
             f"4 in lock-step rounds, temperature 0, {result['max_new_tokens']} new tokens at most; medians per "
             "dataset.", "",
             "| dataset | drafter | chain | tau | draft ms / drafted token | tokens/s |", "|---|---|---|---|---|---|"]
    names = {"browser": "browser, the policy", "browser_depth4": "browser", TREE_SIDE: "browser, trees",
             "gateway": "gateway"}
    for ds, sides in result["summary"].items():
        for side, f in sides.items():
            chain = {"browser": f"{f.get('chain_length')} (policy)",
                     TREE_SIDE: f"{f.get('chain_length')} nodes ({result.get('tree')})"}.get(side, "4")
            lines.append(f"| {ds} | {names[side]} | {chain} | {f['tau']} | {f['draft_ms_per_token']} | "
                         f"{f['tokens_per_s']} |")
    lines += ["", f"Browser (the policy) / gateway tokens/s (median over every prompt): "
              f"{result['browser_vs_gateway_tokens_per_s']}x; the policy / chains of 4 in the browser: "
              f"{result['policy_vs_depth4_tokens_per_s']}x"
              + (f"; trees of {result['tree']} / chains of 4: {result['tree_vs_depth4_tokens_per_s']}x"
                 if "tree" in result else "") + f". Lossless: {result['lossless_ok']} "
              "(browser answers token by token against target-only decoding, gateway answers by their text).", ""]
    path.write_text("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
