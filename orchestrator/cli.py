"""``tandem`` command line: fetch models, run a verifier, chat through the edge, or all of it at once (``demo``)."""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time

from . import logs, models

DEFAULT_PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a short docstring."


def _threads(share: float = 1.0) -> int:
    return max(1, int((os.cpu_count() or 1) * share))


def cmd_models(args) -> int:
    roles = models.ROLES if args.role == "all" else (args.role,)
    for role in roles:
        path = models.fetch(role)
        print(f"{role}: {path}")
    return 0


def cmd_serve(args) -> int:
    from cloud.backend import LocalBackend
    from cloud.engine import load_engine
    from cloud.scheduler import Scheduler
    from cloud.server import serve
    from cloud.session import Limits

    target = models.resolve(args.target, "target")
    server_max = Limits(0, args.max_tree_nodes, args.max_tree_depth)
    engine_kwargs = dict(model_path=str(target), n_ctx=args.n_ctx, max_tree_nodes=args.max_tree_nodes,
                         n_threads=args.threads or _threads(), max_sessions=args.max_sessions)
    if args.replicas:  # a Ray-managed pool: local Ray, or the cluster at --ray-address / $TANDEM_RAY_ADDRESS
        from orchestrator.pool import PoolBackend
        backend = PoolBackend(args.replicas, args.engine, engine_kwargs, args.max_sessions, server_max,
                              address=args.ray_address, cpus_per_replica=args.cpus_per_replica)
    else:
        engine = load_engine(args.engine, **engine_kwargs)
        backend = LocalBackend(engine, server_max, args.max_sessions,
                               Scheduler(engine, args.max_batch_tokens, args.batch_window_ms))
    server, port = serve(backend=backend, address=f"{args.host}:{args.port}")
    device = getattr(getattr(backend, "engine", None), "device", "ray pool" if args.replicas else "cpu")
    print(f"verifier ready on {args.host}:{port} ({backend.info.engine} on {device}, {backend.info.model_id})",
          flush=True)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    try:
        while not stop:
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    server.stop(grace=2).wait()
    return 0


def _chat(args, address: str) -> int:
    from cloud.acceptance import Sampling
    from edge.client import EdgeClient
    from edge.drafter import load_drafter
    from edge.drafting import TreeShape

    drafter = load_drafter(args.drafter_engine, model_path=models.resolve(args.drafter, "drafter"),
                           n_ctx=args.n_ctx, n_threads=args.drafter_threads or _threads())
    policy = None
    if args.adaptive:
        from orchestrator.policy import DraftPolicy
        policy = DraftPolicy()
    client = EdgeClient(drafter, address, TreeShape.parse(args.tree), policy=policy, proactive=args.proactive)
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
               [{"role": "user", "content": args.prompt}]
    gen = client.chat(messages, max_new_tokens=args.max_tokens, stop=args.stop or (),
                      sampling=Sampling(args.temperature, args.top_k, args.top_p, args.seed))
    for text in gen:
        print(text, end="", flush=True)
    s = gen.stats
    print(f"\n-- {s.generated_tokens} tokens, tau {s.tau:.2f}, {s.tokens_per_s:.1f} tokens/s "
          f"(finish: {gen.finish_reason}, {s.rounds} verify forwards, "
          f"{'adaptive tree' if args.adaptive else 'tree ' + args.tree})", flush=True)
    client.close()
    return 0


def cmd_chat(args) -> int:
    return _chat(args, args.server)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cmd_demo(args) -> int:
    """Fetch the pair, start a local verifier process, answer one prompt through edge -> gRPC -> cloud."""
    from edge.client import RemoteError, health

    for role in models.ROLES:
        models.fetch(role)
    port = _free_port()
    address = f"127.0.0.1:{port}"
    # split the cores between the verifier process and the drafter in this process
    server_threads, args.drafter_threads = _threads(0.5), _threads(0.5)
    cmd = [sys.executable, "-m", "orchestrator.cli", "serve", "--port", str(port), "--threads",
           str(server_threads), "--target", args.target or "default", "--n-ctx", str(args.n_ctx)]
    print(f"starting the verifier on {address} ...", file=sys.stderr, flush=True)
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                health(address, timeout_s=2)
                break
            except RemoteError:
                if server.poll() is not None or time.monotonic() > deadline:
                    print("the verifier did not start; run `tandem serve` to see why", file=sys.stderr)
                    return 1
                time.sleep(0.5)
        return _chat(args, address)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()


def _add_chat_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drafter", default="default", help="'default' (pinned Qwen2.5-Coder-0.5B) or a GGUF path")
    p.add_argument("--drafter-engine", default="llama.cpp")
    p.add_argument("--drafter-threads", type=int, default=0, help="0 = all cores")
    p.add_argument("--tree", default="4,16,6", help="draft tree shape k,N,D (k=1 is a chain)")
    p.add_argument("--adaptive", action="store_true",
                   help="choose each round's tree from measured RTT, costs and acceptance instead of --tree")
    p.add_argument("--proactive", action="store_true",
                   help="draft the next tree while the verdict is in flight (hides the round trip when it holds)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--system", default="", help="system message")
    p.add_argument("--n-ctx", type=int, default=4096)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tandem", description="Lossless edge-cloud speculative decoding.")
    ap.add_argument("--log-level", default=None, help="debug|info|warning (default: warning, or $TANDEM_LOG)")
    sub = ap.add_subparsers(dest="command", required=True)

    m = sub.add_parser("models", help="model provisioning")
    msub = m.add_subparsers(dest="models_command", required=True)
    f = msub.add_parser("fetch", help="download, assemble and verify the default model pair")
    f.add_argument("--role", choices=("all", *models.ROLES), default="all")
    f.set_defaults(func=cmd_models)

    s = sub.add_parser("serve", help="run a verifier replica (gRPC)")
    s.add_argument("--target", default="default", help="'default' (pinned Qwen2.5-Coder-1.5B) or a GGUF path")
    s.add_argument("--engine", default="llama.cpp", help="llama.cpp | torch (HF directory or GGUF, CUDA if present)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=50051)
    s.add_argument("--threads", type=int, default=0, help="0 = all cores")
    s.add_argument("--n-ctx", type=int, default=4096)
    s.add_argument("--max-sessions", type=int, default=4, help="sessions per replica (KV is reserved for each)")
    s.add_argument("--max-tree-nodes", type=int, default=64)
    s.add_argument("--max-tree-depth", type=int, default=16)
    s.add_argument("--max-batch-tokens", type=int, default=512, help="token budget of one verify forward")
    s.add_argument("--batch-window-ms", type=float, default=2.0, help="longest wait for more drafts to batch")
    s.add_argument("--replicas", type=int, default=0, help="run a Ray pool of this many replicas (0 = in process)")
    s.add_argument("--ray-address", default=None, help="existing Ray cluster (default $TANDEM_RAY_ADDRESS, else local)")
    s.add_argument("--cpus-per-replica", type=float, default=1, help="CPU slice per replica when there is no GPU")
    s.set_defaults(func=cmd_serve)

    c = sub.add_parser("chat", help="answer one prompt through a running verifier")
    c.add_argument("prompt")
    c.add_argument("--server", default="127.0.0.1:50051")
    _add_chat_args(c)
    c.set_defaults(func=cmd_chat)

    d = sub.add_parser("demo", help="fetch models, start a local verifier, answer one prompt through it")
    d.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT)
    d.add_argument("--target", default="default")
    _add_chat_args(d)
    d.set_defaults(func=cmd_demo)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logs.configure(args.log_level)
    try:
        return args.func(args)
    except models.ModelError as e:
        print(f"tandem: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
