"""``tandem`` command line: fetch models, run a verifier, chat through the edge, or all of it at once (``demo``)."""
from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tandem.core import lifetime

from tandem.core import logs

from tandem.core.llama_cpu import LlamaError

from . import models
from .serve_keys import local_keys
from .settings import CommandParser, ConfigError, check_keys, load_config

log = logging.getLogger("tandem.cli")

DEFAULT_PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a short docstring."
FIXED_TREE = "4,16,6"  # the fixed tree of --no-adaptive without --tree


def _threads(share: float = 1.0) -> int:
    return max(1, int((os.cpu_count() or 1) * share))


def cmd_models_list(args) -> int:
    for m in models.status():
        print(f"{m['role']:8} {m['name']:40} {m['bytes'] / 2**30:5.2f} GiB  {m['state']:12} {m['file']}")
    return 0


def cmd_models(args) -> int:
    roles = models.ROLES if args.role == "all" else (args.role,)
    for role in roles:
        path = models.fetch(role)
        print(f"{role}: {path}")
    return 0


def cmd_models_check(args) -> int:
    """Whether --drafter can draft for --target (the verifier's own rule), and its acceptance on a few prompts."""
    import json

    from tandem.cloud.engines import load_engine
    from tandem.core.llama_runtime import LlamaModel

    from . import datasets, pairing
    target_path = models.resolve(args.target, "target")
    drafter_path = models.resolve(args.drafter, "drafter")
    drafter = LlamaModel(drafter_path)
    engine = load_engine("torch" if target_path.is_dir() else "llama.cpp", model_path=target_path, n_ctx=4096,
                         **({} if target_path.is_dir() else {"n_threads": args.threads or _threads(),
                                                              "max_sessions": 1}))
    pair = pairing.pairing(engine, drafter)
    acceptance = None
    if pair.kind != pairing.REFUSED and args.prompts > 0:
        chats = [datasets.humaneval_messages(p) for p in datasets.humaneval(args.prompts)]
        chats += datasets.sharegpt(args.prompts)
        acceptance = pairing.measure_translated(engine, drafter_path, chats, args.tokens) \
            if pair.kind == pairing.TRANSLATED else pairing.measure(engine, drafter, chats, args.tokens)
    print(pairing.report(pair, acceptance))
    if args.json:
        Path(args.json).write_text(json.dumps(pairing.as_json(pair, acceptance), indent=1))
    return 1 if pair.kind == pairing.REFUSED else 0


def cmd_serve(args) -> int:
    """A verifier (local engine or Ray pool) on gRPC (--grpc-host/--grpc-port), plus the REST gateway (--host/--port);
    or, with --verifier, the gateway alone in front of a verifier elsewhere. Addresses: ``_serve_addresses``."""
    from tandem.cloud.server import PortInUse, StreamLimits, serve
    from tandem.core.auth import ApiKeys, AuthConfigError, Tls, client_key, require_auth_off_loopback
    from tandem.cloud.engines import MODEL_FREE
    from tandem.core.tenancy import SaltError, salt_secret

    try:  # a file that cannot be a model is refused now, before ports or anything else
        if not args.verifier and args.engine not in MODEL_FREE:
            models.check(args.target, "target", args.engine)
        if args.http_port:
            models.check(args.drafter, "drafter")
    except models.ModelError as e:
        print(f"tandem serve: {e}", file=sys.stderr)
        return 2
    try:
        # REST clients of the gateway: TANDEM_API_KEYS[_FILE] and --api-key
        rest_keys = ApiKeys(ApiKeys.from_env().keys + ApiKeys.of(
            k for given in args.api_key or () for k in given.split(",")).keys)
        # gateways' verifier keys open the verifier too, outside its per-key limits (a gateway limits its own REST
        # callers, each in its own cache partition)
        gateway_keys = ApiKeys.from_env(name="TANDEM_GATEWAY_KEYS")
        verifier_keys = ApiKeys(ApiKeys.from_env(name="TANDEM_VERIFIER_KEYS").keys + gateway_keys.keys)
        metrics_keys = ApiKeys.from_env(name="TANDEM_METRICS_KEYS")  # scrapers of the gateway's /metrics
        # verifier keys whose tenants opted in to keeping the target's top-k at their positions (cloud.teacher)
        teach_keys = ApiKeys.from_env(name="TANDEM_TEACH_KEYS")
        if teach_keys.enabled and not args.teacher_mb:
            raise AuthConfigError("TANDEM_TEACH_KEYS names opted-in tenants but --teacher-mb is 0 (collection off)")
        if not args.verifier and not all(verifier_keys.has(k.decode()) for k in teach_keys.keys):
            raise AuthConfigError("TANDEM_TEACH_KEYS names keys that are not verifier keys: a tenant opts in by a "
                                  "key the verifier checks (add them to TANDEM_VERIFIER_KEYS), else anyone "
                                  "presenting one would land in its partition")
        if args.teacher_mb and (args.verifier or args.replicas):
            raise AuthConfigError("--teacher-mb keeps positions in this process's verifier: not with --verifier "
                                  "or --replicas")
        # REST keys (of this gateway) whose tenants opted in: the gateway asks the verifier to keep nothing of the rest
        rest_teach_keys = ApiKeys.from_env(name="TANDEM_REST_TEACH_KEYS")
        if rest_teach_keys.enabled and not args.http_port:
            raise AuthConfigError("TANDEM_REST_TEACH_KEYS names REST tenants but this serves no gateway (--http-port)")
        if rest_teach_keys.enabled and not args.verifier and not args.teacher_mb:
            raise AuthConfigError("TANDEM_REST_TEACH_KEYS names opted-in REST tenants but --teacher-mb is 0 "
                                  "(collection off)")
        if args.distill_dir and not args.distill_drafter:
            raise AuthConfigError("--distill-dir keeps the adapters --distill-drafter trains: set --distill-drafter")
        if args.distill_drafter and not args.teacher_mb:
            raise AuthConfigError("--distill-drafter trains on the positions --teacher-mb keeps: set --teacher-mb "
                                  "(and TANDEM_TEACH_KEYS)")
        secret = salt_secret()
        if args.http_port and args.drafter_learn_vocab and args.drafter_vocab and len(rest_keys.keys) > 1:
            raise AuthConfigError("--drafter-learn-vocab would learn one head from every API key's traffic (a "
                                  "state shared across tenants); serve one key per gateway, or pass "
                                  "--no-drafter-learn-vocab")
        if args.http_port:
            require_auth_off_loopback(args.http_host, rest_keys, args.allow_unauthenticated)
        # Any tenant configuration (REST keys, opt-ins, a salt secret that makes edge tokens outlive this process)
        # means the verifier must check keys: without verifier keys of its own it accepts only the internal key
        # of this process's gateway, never a keyless caller.
        guarded = rest_keys.enabled or teach_keys.enabled or rest_teach_keys.enabled or bool(
            os.environ.get("TANDEM_SALT_SECRET") or os.environ.get("TANDEM_SALT_SECRET_FILE"))
        if not args.verifier and guarded and not verifier_keys.enabled and not args.http_port:
            raise AuthConfigError("REST keys, opt-ins or a salt secret are set, so the verifier checks keys, but it "
                                  "has none (TANDEM_VERIFIER_KEYS) and no gateway (--http-port) to use one: it "
                                  "would accept nobody")
        if not args.verifier:
            require_auth_off_loopback(args.grpc_host, verifier_keys, args.allow_unauthenticated or guarded,
                                      "TANDEM_VERIFIER_KEYS")
        gateway_key = client_key()  # the gateway's credential for the verifier, when one is given
    except (AuthConfigError, SaltError) as e:
        print(f"tandem serve: {e}", file=sys.stderr)
        return 2
    if not args.verifier:
        local = local_keys(ApiKeys.from_env(name="TANDEM_VERIFIER_KEYS"), gateway_keys, teach_keys, rest_teach_keys,
                           guarded, gateway_key, bool(args.http_port))
        verifier_keys, gateway_keys, teach_keys, gateway_key = local.verifier, local.exempt, local.teach, \
            local.gateway_key
    # both ports are checked before any model loads: a second serve on a port in use fails now, naming it
    http_socket = None
    try:
        if not args.verifier:
            _check_port(args.grpc_host, args.grpc_port, f"the verifier (gRPC, {args.grpc_port_flag})")
        if args.http_port:
            http_socket = _listen(args.http_host, args.http_port, f"the REST gateway ({args.http_port_flag})")
    except PortInUse as e:
        print(f"tandem serve: {e}", file=sys.stderr)
        return 2
    if args.deprecated:  # once nothing stands in the way of starting
        print(f"tandem serve: {args.deprecated}", file=sys.stderr, flush=True)
    limits = StreamLimits(args.key_sessions, args.key_prefill_tokens_per_minute, args.session_lifetime_s,
                          args.stream_inbox)
    tls = Tls(Path(args.tls_cert), Path(args.tls_key)) if args.tls_cert else None
    if args.otlp_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        from tandem.core import tracing
        tracing.configure("tandem-serve", args.otlp_endpoint or None)
    if args.verify_budget_tokens < 0 or not args.verify_budget_ms >= 0:  # before any model loads
        print("tandem serve: --verify-budget-tokens and --verify-budget-ms must be >= 0", file=sys.stderr)
        return 2
    template = ""
    if args.chat_template:  # checked before any model loads: a template that does not compile is an error now
        from tandem.core.chat_template import ChatTemplate, TemplateError
        try:
            template = Path(args.chat_template).read_text()
            ChatTemplate(template)
        except (OSError, TemplateError) as e:
            print(f"tandem serve: --chat-template {args.chat_template}: {e}", file=sys.stderr)
            return 2
    server, address = None, args.verifier
    if not args.verifier:
        backend = _backend(args)  # a model llama.cpp cannot load (LlamaError) is one line: main
        try:
            server, port = serve(backend=backend, address=f"{args.grpc_host}:{args.grpc_port}", keys=verifier_keys,
                                 tls=tls, max_streams=args.max_streams, chat_template=template, limits=limits,
                                 exempt=gateway_keys, teach=teach_keys)
        except PortInUse as e:  # taken since the check above
            print(f"tandem serve: {e}", file=sys.stderr)
            getattr(backend, "shutdown", lambda: None)()
            return 2
        address = f"{args.grpc_host}:{port}"
        device = getattr(getattr(backend, "engine", None), "device", "ray pool" if args.replicas else "cpu")
        print(f"verifier ready on {address} ({backend.info.engine} on {device}, {backend.info.model_id}"
              f"{', TLS' if tls else ''}{', API keys' if verifier_keys.enabled else ''})", flush=True)
    if args.metrics_port:
        from prometheus_client import start_http_server
        start_http_server(args.metrics_port, addr=args.grpc_host)
    try:
        if args.http_port:
            return _gateway(args, address, rest_keys, gateway_key, tls, metrics_keys, secret, rest_teach_keys,
                            http_socket)
        stop = []
        signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
        try:
            while not stop:
                time.sleep(0.2)
        except KeyboardInterrupt:
            pass
        return 0
    finally:
        if server is not None:
            # drain: Health says draining, new sessions are refused (UNAVAILABLE: clients go elsewhere), open
            # sessions get --drain-s to finish
            left = server.drain(args.drain_s)
            if left:
                log.warning("stopping with %d sessions still open after %.0f s of draining", left, args.drain_s)
            server.stop(grace=1)
            getattr(server.backend, "shutdown", lambda: None)()


def _backend(args):
    from tandem.cloud.backend import LocalBackend
    from tandem.cloud.engines import MODEL_FREE, load_engine
    from tandem.cloud.scheduler import Scheduler
    from tandem.cloud.session import Limits

    target = args.target if args.engine in MODEL_FREE else models.resolve(args.target, "target")
    server_max = Limits(0, args.max_tree_nodes, args.max_tree_depth)
    engine_kwargs = dict(model_path=str(target), n_ctx=args.n_ctx, max_tree_nodes=args.max_tree_nodes,
                         n_threads=args.threads or _threads(), max_sessions=args.max_sessions)
    if args.deterministic:
        engine_kwargs["deterministic"] = True  # and no prefix cache: reused KV was computed in other batch shapes
        if args.prefix_cache_tokens > 0:
            log.info("deterministic mode: the prefix cache is off")
    elif args.prefix_cache_tokens > 0:  # both engines: llama.cpp by seq id, torch in copied blocks
        engine_kwargs["prefix_cache_tokens"] = args.prefix_cache_tokens
    if args.replicas:  # a Ray-managed pool: local Ray, or the cluster at --ray-address / $TANDEM_RAY_ADDRESS
        from tandem.orchestrator.pool.ray_pool import PoolBackend
        return PoolBackend(args.replicas, args.engine, engine_kwargs, args.max_sessions, server_max,
                           address=args.ray_address, cpus_per_replica=args.cpus_per_replica,
                           replica_resource=args.replica_resource,
                           scheduler_kwargs=dict(max_batch_tokens=args.max_batch_tokens,
                                                 window_ms=args.batch_window_ms,
                                                 verify_budget_tokens=args.verify_budget_tokens,
                                                 verify_budget_ms=args.verify_budget_ms,
                                                 mixed_prefill=not args.serial_prefill))
    engine = load_engine(args.engine, **engine_kwargs)
    if args.verifier_cost:  # the GPU regime, simulated: real logits, forwards paced to the curve
        from tandem.cloud.pacing import CostCurve, PacedEngine
        engine = PacedEngine(engine, CostCurve.load(args.verifier_cost), args.cost_scale)
    teacher = None
    if args.teacher_mb:
        from tandem.cloud.teacher import TeacherStore
        mb = 1 << 20
        teacher = TeacherStore(max_bytes=int(args.teacher_mb * mb), max_age_s=args.teacher_age_h * 3600,
                               max_tenant_bytes=int(args.teacher_tenant_mb * mb) or None,
                               max_total_bytes=int(args.teacher_total_mb * mb) or None)
    adapters = None
    if args.distill_drafter:
        from tandem.cloud.online import AdapterStore
        # an adapter lives no longer than the positions it learnt from (a lineage at most --teacher-age-h old)
        adapters = AdapterStore(Path(args.distill_dir) if args.distill_dir else None,
                                max_age_s=args.teacher_age_h * 3600)
    backend = LocalBackend(engine, server_max, args.max_sessions,
                           Scheduler(engine, args.max_batch_tokens, args.batch_window_ms,
                                     verify_budget_tokens=args.verify_budget_tokens,
                                     verify_budget_ms=args.verify_budget_ms, mixed_prefill=not args.serial_prefill),
                           teacher=teacher, adapters=adapters)
    if args.distill_drafter:  # the verifier's idle time distils each opted-in partition's drafter adapter
        from tandem.cloud.online import OnlineConfig, OnlineDistillation
        OnlineDistillation(teacher, adapters, models.resolve(args.distill_drafter, "drafter"),
                           idle=lambda: backend.active_sessions() == 0 and not backend.scheduler.busy(),
                           config=OnlineConfig(min_positions=args.distill_min_positions,
                                               round_budget_s=args.distill_budget_s,
                                               max_tenant_adapters=args.distill_tenant_adapters,
                                               max_adapters=args.distill_max_adapters)).start()
    return backend


def _check_port(host: str, port: int, what: str) -> None:
    """Raise ``PortInUse`` naming ``port`` unless it can be listened on now (0: any port, nothing to check)."""
    if port:
        _listen(host, port, what).close()


def _listen(host: str, port: int, what: str) -> socket.socket:
    """A socket listening on ``host:port`` (no SO_REUSEPORT: a port another server holds is an error), or
    ``PortInUse`` naming the port and what it was for."""
    from tandem.cloud.server import PortInUse
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(info[0], socket.SOCK_STREAM)
    except OSError as e:
        raise PortInUse(f"cannot listen on {host}:{port} for {what}: {e.strerror or e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (only lets a closed server's port be reused)
        sock.bind(info[4])
        sock.listen(2048)
    except OSError as e:
        sock.close()
        why = "the port is in use" if e.errno == errno.EADDRINUSE else e.strerror or str(e)
        raise PortInUse(f"cannot listen on {host}:{port} for {what}: {why}") from None
    return sock


def _gateway(args, address: str, keys, verifier_key: str, tls, metrics_keys, salt_secret: bytes,
             teach_keys, http_socket: socket.socket) -> int:
    """The REST gateway: a pool of co-located drafters, each an EdgeClient of the verifier at ``address``."""
    import uvicorn

    from tandem.edge.client import EdgeClient
    from tandem.edge.drafter import load_drafter
    from tandem.core.tree import TreeShape

    from .gateway.app import create_app, server_options
    from .gateway.serving import DrafterPool, GatewayConfig, VerifierLink
    from tandem.edge.policy import DraftPolicy, PolicyConfig
    from tandem.core.quota import KeyLimits

    drafter_path = models.resolve(args.drafter, "drafter")
    browser_drafter = None
    if args.browser_drafter:
        from tandem.edge.onnx_export import export
        browser_drafter = export(drafter_path, "dynamic-int8", self_contained=True)
    ca = args.tls_ca or (args.tls_cert if tls and not args.verifier else None)
    # co-located drafters share the server's cores: no shadow chains unless asked (their measurement is not free)
    policy_config = PolicyConfig() if args.gateway_shadow else PolicyConfig(shadow_depth=0)
    clients = []
    for _ in range(args.gateway_drafters):
        drafter = load_drafter(args.drafter_engine, model_path=drafter_path, n_ctx=args.n_ctx,
                               n_threads=args.drafter_threads or _threads(0.5 / args.gateway_drafters),
                               **({"vocab": args.drafter_vocab, "learn_vocab": args.drafter_learn_vocab}
                                  if args.drafter_vocab else {}))
        adaptive = args.gateway_tree == "adaptive"
        clients.append(_paired(EdgeClient(drafter, address, None if adaptive else TreeShape.parse(args.gateway_tree),
                                          policy=DraftPolicy(policy_config) if adaptive else None,
                                          api_key=verifier_key, tls_ca=ca,
                                          tls_server_name=args.tls_server_name or None, ngram=_ngram(args.ngram))))
    pool = DrafterPool(clients)
    names = [n.strip() for n in (args.served_model_name or args.model_name).split(",") if n.strip()]
    config = GatewayConfig(keys=keys, model_name=names[0] if names else "", aliases=tuple(names[1:]),
                                         max_body_bytes=args.max_body_bytes,
                                         limits=KeyLimits(args.key_concurrency, args.key_tokens_per_minute),
                                         metrics_keys=metrics_keys, public_metrics=args.public_metrics,
                                         docs=args.docs, chat_page=args.chat_page, salt_secret=salt_secret,
                                         teach_keys=teach_keys,
                                         cors_origins=tuple(o.strip() for o in args.cors_origins.split(",")
                                                            if o.strip()),
                                         verifier=VerifierLink(address, ca, args.tls_server_name or None,
                                                               verifier_key), browser_drafter=browser_drafter,
                                         queue_depth=args.gateway_queue_depth,
                                         queue_timeout_s=args.gateway_queue_timeout_s)
    app = create_app(pool, config)
    print(f"gateway ready on http{'s' if tls else ''}://{args.http_host}:{args.http_port} "
          f"({len(clients)} drafters, verifier {address})", flush=True)
    # uvicorn shuts down gracefully on SIGTERM/SIGINT and then re-raises the signal to the previous handler: make
    # that a no-op so the verifier below is stopped by our `finally` and the exit status stays 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", ssl_certfile=args.tls_cert if tls else None,
                                           ssl_keyfile=args.tls_key if tls else None, **server_options(config)))
    server.run(sockets=[http_socket])  # the socket bound before anything loaded
    pool.close()
    return 0


def _paired(client):
    """``client`` with its drafter matched to the verifier's target (``EdgeClient.pair_with_target``: a drafter
    with another tokenizer drafts through translation); an unreachable verifier leaves it as it is."""
    from tandem.edge.client import RemoteError
    try:
        kind = client.pair_with_target()
    except RemoteError as e:
        log.warning("could not match the drafter to the verifier's target: %s", e)
        return client
    if kind != "native":
        log.info("drafter and target: %s", kind)
    return client


def _adaptive(args) -> bool:
    """Whether a chat drafts under the draft policy: as asked (``--adaptive`` / ``--no-adaptive``), else unless a
    fixed ``--tree`` was given. The policy is the default because where drafting loses it stays near cloud-only
    decoding (``tandem demo`` on 2 cores: 0.96x of the fixed tree, whose trees all went stale there, 2026-12-04),
    while a fixed streamed tree whose trees land and lose ran at 0.58-0.64x of it (bench.network on shared cores
    and over 10 and 40 ms links, in issue 15's first measurement)."""
    return args.adaptive if args.adaptive is not None else args.tree is None


def _load_drafter(args):
    from tandem.edge.drafter import load_drafter
    return load_drafter(args.drafter_engine, model_path=models.resolve(args.drafter, "drafter"),
                        n_ctx=args.n_ctx, n_threads=args.drafter_threads or _threads(),
                        **({"vocab": args.vocab, "learn_vocab": args.learn_vocab} if args.vocab else {}))


def _chat(args, address: str) -> int:
    """One answer (``prompt`` given), or an interactive multi-turn chat on the terminal. The verifier is asked first
    (Health), before the drafter loads. Ctrl-C during an answer stops it, and the part shown stays in the
    conversation; Ctrl-C on a line being typed drops the line; Ctrl-C at an empty prompt, Ctrl-D or /quit ends the
    chat."""
    from tandem.core.sampling import Sampling
    from tandem.edge.client import EdgeClient, RemoteError, health
    from tandem.core.tree import TreeShape

    try:
        health(address, timeout_s=10, tls_ca=args.tls_ca or None)
    except RemoteError as e:
        print(f"tandem chat: {_unreachable(address, e)}", file=sys.stderr)
        return 1
    drafter = _load_drafter(args)
    policy, adaptive = None, _adaptive(args)
    if adaptive:
        from tandem.edge.policy import DraftPolicy, PolicyConfig
        policy = DraftPolicy(PolicyConfig() if args.shadow else PolicyConfig(shadow_depth=0), objective=args.objective)
    tree = args.tree or FIXED_TREE
    client = _paired(EdgeClient(drafter, address, TreeShape.parse(tree), policy=policy, proactive=args.proactive,
                                tls_ca=args.tls_ca or None, ngram=_ngram(args.ngram)))
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict] = []
    show_stats = args.stats or bool(args.prompt)

    def answer(prompt: str) -> bool:
        """Stream one answer; False when Ctrl-C stopped it (what was shown stays in the conversation)."""
        history.append({"role": "user", "content": prompt})
        gen = client.generate(client.prompt_tokens(system + history), max_new_tokens=args.max_tokens,
                              stop=args.stop or (), sampling=Sampling(args.temperature, args.top_k, args.top_p,
                                                                      args.seed, args.min_p))
        with _interruptible() as interrupted:
            for text in gen:
                print(text, end="", flush=True)
                if interrupted:  # at the next token: the generator is ours to close between tokens
                    gen.cancel()
                    break
        history.append({"role": "assistant", "content": gen.text})
        print(flush=True)
        stopped = bool(interrupted) and gen.finish_reason is None
        if stopped:
            print("[stopped: Ctrl-C; the answer so far stays in the conversation, /reset forgets it]", flush=True)
        elif gen.finish_reason == "length":
            print(f"[cut at --max-tokens {args.max_tokens}]", flush=True)
        if show_stats:
            s = gen.stats
            print(f"-- {s.generated_tokens} tokens (prompt {s.prompt_tokens}), tau {s.tau:.2f}, "
                  f"{s.tokens_per_s:.1f} tokens/s (finish: {gen.finish_reason or 'stopped'}, {s.rounds} verify "
                  f"forwards, {'adaptive' if adaptive else 'tree ' + tree})", flush=True)
        answered_at[0] = time.monotonic()
        return not stopped

    answered_at = [0.0]
    try:
        if args.prompt:
            return 0 if answer(args.prompt) else 130
        _line_editing()
        print("tandem chat: type a message; /stats toggles statistics, /reset starts over, /quit (or Ctrl-D) ends; "
              "Ctrl-C stops an answer.", flush=True)
        while True:
            try:
                line = _read_line("> ").strip()
            except EOFError:
                print(flush=True)
                return 0
            except _LineDropped:  # Ctrl-C on a line with text: the text goes, as in a shell
                print(flush=True)
                continue
            except KeyboardInterrupt:  # Ctrl-C at an empty prompt ends the chat, as Ctrl-D does, unless it came just
                print(flush=True)     # as an answer ended: then it was meant for the answer
                if time.monotonic() - answered_at[0] < LATE_CTRL_C_S:
                    continue
                return 0
            if line in ("/quit", "/exit", "/bye"):
                return 0
            if line == "/reset":
                history.clear()
                print("conversation cleared", flush=True)
            elif line == "/stats":
                show_stats = not show_stats
                print(f"statistics {'on' if show_stats else 'off'}", flush=True)
            elif line:
                answer(line)
    except RemoteError as e:
        print(f"tandem chat: {_unreachable(address, e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # a second Ctrl-C during an answer: out at once
        print(flush=True)
        return 130
    finally:
        client.close()


LATE_CTRL_C_S = 1.0  # a Ctrl-C at the prompt this soon after an answer ended was meant to stop that answer


class _Flag:
    """Truthy once set (Ctrl-C pressed)."""

    def __init__(self):
        self.set = False

    def __bool__(self) -> bool:
        return self.set


class _interruptible:
    """Within it, the first Ctrl-C (SIGINT) only raises the flag it yields: the answer stops at its next token. A
    second one interrupts as usual (KeyboardInterrupt), for a verifier that has stopped sending tokens."""

    def __enter__(self) -> _Flag:
        self.flag = _Flag()

        def on_sigint(signum, frame):
            if self.flag:
                raise KeyboardInterrupt
            self.flag.set = True

        self.previous = signal.signal(signal.SIGINT, on_sigint) if _main_thread() else None
        return self.flag

    def __exit__(self, *exc) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)


def _main_thread() -> bool:
    import threading
    return threading.current_thread() is threading.main_thread()


class _LineDropped(Exception):
    """Ctrl-C was pressed on a line with text typed."""


def _read_line(prompt: str) -> str:
    """``input(prompt)``; Ctrl-C raises ``_LineDropped`` when text was typed on the line (the terminal's line editor
    knows it), else KeyboardInterrupt."""
    typed = [""]

    def on_sigint(signum, frame):
        typed[0] = _line_buffer()  # read while the line editor still holds the line
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint) if _main_thread() else None
    try:
        return input(prompt)
    except KeyboardInterrupt:
        if typed[0].strip():
            raise _LineDropped from None
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def _line_buffer() -> str:
    """The text typed so far on the terminal's current line (line editing on), else empty."""
    readline = sys.modules.get("readline")
    return readline.get_line_buffer() if readline is not None else ""


def _line_editing() -> None:
    """Arrow keys and history at the prompt, where the terminal has them."""
    if sys.stdin.isatty():
        try:
            import readline  # noqa: F401  (input() uses it once imported)
        except ImportError:
            pass


def _unreachable(address: str, e) -> str:
    """What a failed gRPC call to ``address`` means for a user: an HTTP/1 server there (the REST gateway's port,
    most often) is named as such instead of gRPC's parsing error."""
    if "HTTP/2" in e.details or "http1" in e.details.lower():
        return (f"{address} is an HTTP server (the REST gateway?), not the verifier: tandem chat speaks gRPC to the "
                f"verifier; give its address with --verifier HOST:PORT (tandem serve's --grpc-port, 50051 by default)")
    return f"cannot reach the verifier at {address} ({e.code.name}: {e.details})"


def unescape(text: str) -> str:
    """A stop string as typed on a command line: backslash escapes as in Python strings (\\n, \\t, \\r, \\\\,
    \\xHH, \\uXXXX), so ``--stop "\\n\\n"`` stops at a blank line; any other backslash stays as it is."""
    import re
    simple = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "'": "'"}

    def one(m: re.Match) -> str:
        e = m.group(1)
        if e[0] in "xu":
            return chr(int(e[1:], 16))
        return simple.get(e, m.group(0))

    return re.sub(r"\\(x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|.)", one, text, flags=re.S)


def _ngram(enabled: bool):
    if not enabled:
        return None
    from tandem.edge.ngram import NgramDrafter
    return NgramDrafter()


def cmd_chat(args) -> int:
    return _chat(args, args.verifier)


def cmd_health(args) -> int:
    """Exit 0 when the verifier (gRPC Health) can take sessions, or the gateway (HTTP, e.g. /readyz) answers; for
    healthchecks. A verifier with no live capacity (every replica of its pool lost) or draining is unhealthy."""
    if args.grpc:
        from tandem.edge.client import RemoteError, health
        try:
            h = health(args.grpc, timeout_s=args.timeout, tls_ca=args.tls_ca or None)
        except RemoteError as e:
            print(f"unhealthy: {e}", file=sys.stderr)
            return 1
        if h.draining or h.max_sessions == 0:
            print(f"unhealthy: {h.target_model} ({h.engine}) "
                  f"{'is draining' if h.draining else 'has no live replica'}", file=sys.stderr)
            return 1
        print(f"ok: {h.target_model} ({h.engine}), {h.active_sessions}/{h.max_sessions} sessions")
        return 0
    import ssl
    import urllib.error
    import urllib.request

    from tandem.core.auth import SYSTEM_ROOTS
    # https with a private CA; the default context (system roots) for "system" or plain https
    context = ssl.create_default_context(cafile=args.tls_ca) if args.tls_ca and args.tls_ca != SYSTEM_ROOTS else None
    try:
        with urllib.request.urlopen(args.http, timeout=args.timeout, context=context) as r:
            print(f"ok: {r.status}")
            return 0
    except (urllib.error.URLError, OSError) as e:
        print(f"unhealthy: {e}", file=sys.stderr)
        return 1


def cmd_drafter_export(args) -> int:
    from tandem.edge.onnx_export import ExportError, export
    try:
        print(export(models.resolve(args.drafter, "drafter"), args.quant, force=args.force,
                     self_contained=args.self_contained))
    except ExportError as e:
        print(f"tandem drafter export: {e}", file=sys.stderr)
        return 2
    return 0


def cmd_drafter_vocabtrim(args) -> int:
    """Choose a VocabTrim head vocabulary: ranked by the declared corpus (orchestrator.calibration) plus the target's
    own outputs on calibration prompts; sized by ``--k``, by calibration ``--coverage``, or (default) as the smallest
    K covering ``--heldout-coverage`` of the target's tokens on prompts the ranking did not see (two folds)."""
    from collections import Counter

    from .calibration import corpus_counts, k_by_coverage, merge
    from .datasets import calibration_chats
    from tandem.cloud import reference
    from tandem.cloud.llama_engine import LlamaVerifierEngine
    from tandem.edge import vocabtrim

    engine = LlamaVerifierEngine(models.resolve(args.target, "target"), n_ctx=4096, n_threads=args.threads or
                                 _threads(), max_sessions=1)
    tok = engine.model
    corpus, meta = corpus_counts(tok, progress=lambda m: print(f"\r[vocabtrim] corpus {m}  ", end="",
                                                                file=sys.stderr, flush=True))
    print(f"\n[vocabtrim] corpus: {meta['tokens']} tokens, {meta['distinct']} distinct ids", file=sys.stderr)
    prompts = [tok.tokenize(tok.chat_prompt(c)) for c in calibration_chats(args.code_prompts, args.chat_prompts)]
    per_prompt: list[list[int]] = []
    for i, p in enumerate(prompts):
        per_prompt.append(reference.greedy(engine, p, args.max_new_tokens).tokens)
        print(f"\r[vocabtrim] target outputs {i + 1}/{len(prompts)}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    outputs = [t for o in per_prompt for t in o]
    counts = merge(corpus, Counter(outputs))
    eog = [t for t in range(tok.n_vocab) if tok.is_eog(t)]
    k = args.k
    if k is None and args.coverage is None:
        k = k_by_coverage(corpus, per_prompt, args.heldout_coverage)
        if k is None:
            print(f"tandem drafter vocabtrim: no K reaches {args.heldout_coverage} of the target's outputs",
                  file=sys.stderr)
            return 1
        print(f"[vocabtrim] K = {k}: the smallest head holding {args.heldout_coverage} of the target's tokens on "
              "prompts its ranking did not see (two folds)", file=sys.stderr)
    ids = vocabtrim.choose(counts, k=k, coverage=None if k else args.coverage, always=eog, fill_below=tok.n_vocab)
    vocabtrim.save(ids, args.out, counts=counts)
    print(f"{len(ids)} ids; target outputs covered {vocabtrim.coverage(ids, outputs):.4f}: {args.out}")
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cmd_demo(args) -> int:
    """Fetch the pair, start a local verifier process, answer one prompt through edge -> gRPC -> cloud three ways
    (cloud-only, and Tandem under each objective: ``orchestrator.demo``)."""
    from tandem.edge.client import RemoteError, health

    for role in models.ROLES:
        models.fetch(role)
    port = _free_port()
    address = f"127.0.0.1:{port}"
    # split the cores between the verifier process and the drafter in this process
    server_threads, args.drafter_threads = _threads(0.5), _threads(0.5)
    cmd = [sys.executable, "-m", "tandem.orchestrator.cli", "serve", "--grpc-port", str(port), "--threads",
           str(server_threads), "--target", args.target or "default", "--n-ctx", str(args.n_ctx),
           "--no-gateway", "--prefix-cache-tokens", "0"]  # each run prefills its prompt: like for like
    print(f"starting the verifier on {address} ...", file=sys.stderr, flush=True)
    server = lifetime.spawn(cmd, stdout=subprocess.DEVNULL)  # dies with this process, even by SIGKILL
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
        from . import demo
        return demo.compare(args, address, _load_drafter, _paired)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()


def _add_chat_args(p: CommandParser) -> None:
    p.option("--drafter", "default", help="'default' (pinned Qwen2.5-Coder-0.5B) or a GGUF path")
    p.option("--drafter-engine", "auto", help="auto | llama.cpp | onnx (exported once, cached); auto: onnx where it "
                                              "exports without torch (the default drafter), else llama.cpp")
    p.option("--vocab", "", help="VocabTrim head vocabulary (.npy from `tandem drafter vocabtrim`; onnx engine)")
    p.option("--learn-vocab", True, bool, help="re-rank the --vocab head from the tokens the verifier commits")
    p.option("--ngram", False, bool, help="graft prompt-lookup (n-gram) drafts onto every tree")
    p.option("--drafter-threads", 0, int, help="0 = all cores")
    p.option("--tree", None, help=f"draft this fixed tree shape k,N,D every round (k=1 is a chain) instead of the "
                                  f"adaptive policy; with --no-adaptive and no shape: {FIXED_TREE}")
    p.option("--adaptive", None, bool,
             help="the draft policy chooses, from measured link, costs and acceptance, between cloud-only decoding and "
                  "drafting, and the tree (the default unless --tree is given)")
    p.option("--objective", "latency", choices=("latency", "cloud_cost"),
             help="with --adaptive: fastest answers, or fewest verifier forwards without being slower than cloud-only "
                  "decoding")
    p.option("--proactive", False, bool,
             help="draft the next tree while the verdict is in flight (hides the round trip when it holds)")
    p.option("--shadow", True, bool,
             help="with --adaptive: while cloud-only decoding runs, the idle drafter drafts chains on the streamed "
                  "text (never sent) to measure this request's acceptance; --no-shadow keeps it idle (battery)")
    p.option("--max-tokens", 256, int, help="the longest answer, in tokens (a longer one is cut, and says so)")
    p.option("--temperature", 0.0, float)
    p.option("--top-k", 0, int)
    p.option("--top-p", 1.0, float)
    p.option("--min-p", 0.0, float)
    p.option("--seed", None, int, help="pin the random draws: the same seed and prompt give the same answer "
                                       "(default: fresh)")
    p.add_argument("--stop", action="append", type=unescape,
                   help="stop string (repeatable); backslash escapes as in Python: --stop '\\n\\n' stops at a blank "
                        "line")
    p.option("--system", "", help="system message")
    p.option("--n-ctx", 4096, int)


# Every setting a deployment can pass through the environment (docker-compose, k8s): TANDEM_<FLAG> -> --flag
# (``settings``). Besides these: TANDEM_API_KEYS / TANDEM_API_KEYS_FILE (REST), TANDEM_VERIFIER_KEYS /
# TANDEM_VERIFIER_KEYS_FILE (gRPC), TANDEM_GATEWAY_KEYS[_FILE] (gateways' verifier keys), TANDEM_METRICS_KEYS[_FILE]
# (/metrics scrapers), TANDEM_TEACH_KEYS[_FILE] / TANDEM_REST_TEACH_KEYS[_FILE] (verifier / REST keys whose tenants
# opted in to distillation) and TANDEM_VERIFIER_KEY / TANDEM_API_KEY (a client's key for the verifier) (core.auth),
# TANDEM_SALT_SECRET[_FILE] (core.tenancy), TANDEM_CACHE (core.cache), TANDEM_LOG (core.logs).
ENV_KEYS = CommandParser.variables
OTHER_ENV_KEYS = ("TANDEM_API_KEYS", "TANDEM_API_KEYS_FILE", "TANDEM_API_KEY", "TANDEM_VERIFIER_KEYS",
                  "TANDEM_VERIFIER_KEYS_FILE", "TANDEM_VERIFIER_KEY", "TANDEM_VERIFIER_KEY_FILE", "TANDEM_CACHE",
                  "TANDEM_GATEWAY_KEYS", "TANDEM_GATEWAY_KEYS_FILE", "TANDEM_METRICS_KEYS",
                  "TANDEM_METRICS_KEYS_FILE", "TANDEM_SALT_SECRET", "TANDEM_SALT_SECRET_FILE",
                  "TANDEM_TEACH_KEYS", "TANDEM_TEACH_KEYS_FILE", "TANDEM_REST_TEACH_KEYS",
                  "TANDEM_REST_TEACH_KEYS_FILE",
                  "TANDEM_LOG", "TANDEM_CONFIG",
                  "TANDEM_LLAMA_EXTRA_BUFTS", "TANDEM_LLAMA_CPU_VARIANT")  # the last two: core.llama_probe


def env_keys() -> set[str]:
    """Every TANDEM_* variable Tandem reads."""
    parser()  # registers the flag-backed keys
    return set(ENV_KEYS) | set(OTHER_ENV_KEYS)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("tandem")
    except PackageNotFoundError:
        return "unknown (not installed)"


def parser() -> CommandParser:
    ap = CommandParser(prog="tandem", description="Lossless edge-cloud speculative decoding.")
    ap.add_argument("--version", action="version", version=f"tandem {_version()}")
    ap.add_argument("--config", default=os.environ.get("TANDEM_CONFIG"),
                    help="TOML file of option values (top level or per subcommand table) [$TANDEM_CONFIG]")
    ap.add_argument("--log-level", default=None, help="debug|info|warning (default: warning, or $TANDEM_LOG)")
    sub = ap.add_subparsers(dest="command", required=True)
    for add in (_models_parser, _serve_parser, _chat_parser, _drafter_parser, _health_parser, _demo_parser):
        add(sub)
    return ap


def _models_parser(sub) -> None:
    m = sub.add_parser("models", help="model provisioning")
    msub = m.add_subparsers(dest="models_command", required=True)
    f = msub.add_parser("fetch", help="download, assemble and verify the default model pair")
    f.add_argument("--role", choices=("all", *models.ROLES), default="all")
    f.set_defaults(func=cmd_models)
    ls = msub.add_parser("list", help="the pinned models and their state in the cache")
    ls.set_defaults(func=cmd_models_list)
    c = msub.add_parser("check", help="whether a drafter can draft for a target (native, padded, translated or "
                                      "refused) and its acceptance on a few prompts; exits 1 for a refused pair")
    c.add_argument("--target", default="default", help="target GGUF file or Hugging Face model directory")
    c.add_argument("--drafter", default="default", help="drafter GGUF file")
    c.add_argument("--prompts", type=int, default=2, metavar="N",
                   help="HumanEval and ShareGPT prompts each to measure acceptance on (0: the pairing only)")
    c.add_argument("--tokens", type=int, default=64, help="greedy answer tokens per prompt")
    c.add_argument("--threads", type=int, default=0)
    c.add_argument("--json", metavar="PATH", help="also write the result as JSON")
    c.set_defaults(func=cmd_models_check)


SERVE_EPILOG = """\
keys (environment only, comma-separated; each also as a file, one key a line: $NAME_FILE):
  TANDEM_API_KEYS         REST API keys clients send as 'Authorization: Bearer KEY' (with --api-key); without
                          any, serve listens on loopback only (unless --allow-unauthenticated)
  TANDEM_VERIFIER_KEYS    keys that open the gRPC verifier (edge devices, remote gateways)
  TANDEM_GATEWAY_KEYS     verifier keys of gateways, exempt from the per-key limits
  TANDEM_METRICS_KEYS     keys of /metrics scrapers
  TANDEM_TEACH_KEYS, TANDEM_REST_TEACH_KEYS   verifier / REST keys whose tenants opted in to distillation
  TANDEM_VERIFIER_KEY     the key this gateway presents to a remote --verifier
  TANDEM_SALT_SECRET      the cache-partition secret (edge tokens outlive a restart with it)
addresses: --host/--port are the REST gateway's (as in vLLM), --grpc-host/--grpc-port the verifier's. Given
--http-host or --http-port (deprecated, or $TANDEM_HTTP_HOST/$TANDEM_HTTP_PORT), --host/--port keep their old
meaning, the verifier's, for this release."""

GRPC_PORT, HTTP_PORT, LOOPBACK = 50051, 8000, "127.0.0.1"
MAX_AUTO_DRAFTERS = 8


def auto_gateway_drafters(cores: int | None = None) -> int:
    """The gateway's drafters when not given: one per 4 cores (each drafts on a share of them), 1 to 8."""
    return max(1, min(MAX_AUTO_DRAFTERS, (cores or os.cpu_count() or 1) // 4))


def _serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="run a verifier (gRPC) and the OpenAI-compatible REST gateway",
                       epilog=SERVE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    _serve_verifier_options(s)
    _serve_gateway_options(s)
    _serve_security_options(s)
    s.finish = _serve_addresses
    s.set_defaults(func=cmd_serve)


def _serve_addresses(a: argparse.Namespace) -> list[str]:
    """Settle where serve listens (``grpc_host``/``grpc_port``, ``http_host``/``http_port``, 0: no gateway) and the
    gateway's drafters; ``deprecated`` is the line to print for the old spelling, else empty. The errors, if any."""
    old = [f for f in ("http_host", "http_port") if getattr(a, f) is not None]
    a.deprecated, errors = "", []
    if old:  # the old spelling: --host/--port are the verifier's, --http-host/--http-port the gateway's
        for new, was in (("grpc_host", "host"), ("grpc_port", "port")):
            if getattr(a, new) is not None and getattr(a, was) is not None:
                errors.append(f"--{was} and --{new.replace('_', '-')} both name the verifier's address here (with "
                              f"the deprecated --{old[0].replace('_', '-')}, --{was} is the verifier's): give "
                              f"--host/--port (REST) and --grpc-host/--grpc-port (gRPC)")
        grpc_host, grpc_port = _first(a.grpc_host, a.host, LOOPBACK), _first(a.grpc_port, a.port, GRPC_PORT)
        http_host, http_port = _first(a.http_host, LOOPBACK), _first(a.http_port, HTTP_PORT)
        a.grpc_port_flag, a.http_port_flag = "--port" if a.grpc_port is None else "--grpc-port", "--http-port"
        spelled = ", ".join(a.sources.get(f, "--" + f.replace("_", "-")) for f in old)
        a.deprecated = (f"{spelled}: deprecated spelling, and with it --host/--port still name the verifier (gRPC). "
                        f"Use --host/--port for the REST gateway and --grpc-host/--grpc-port for the verifier, as "
                        f"in vLLM (the old spelling goes in the next release).")
    else:
        grpc_host, grpc_port = _first(a.grpc_host, LOOPBACK), _first(a.grpc_port, GRPC_PORT)
        http_host, http_port = _first(a.host, LOOPBACK), _first(a.port, HTTP_PORT)
        a.grpc_port_flag, a.http_port_flag = "--grpc-port", "--port"
    if not a.gateway:
        http_port = 0
    for name, port in (("grpc", grpc_port), ("http", http_port)):
        if not 0 <= port <= 65535:
            errors.append(f"the {'verifier' if name == 'grpc' else 'REST'} port {port} is not in 0..65535")
    a.grpc_host, a.grpc_port, a.http_host, a.http_port = grpc_host, grpc_port, http_host, http_port
    if a.verifier and not http_port:
        errors.append("--verifier serves the REST gateway alone, in front of that verifier: not with --no-gateway "
                      f"or {a.http_port_flag} 0 (nothing would be served)")
    if a.gateway_drafters < 0:
        errors.append(f"--gateway-drafters {a.gateway_drafters}: give 1 or more (0: {auto_gateway_drafters()} "
                      f"on this machine)")
    a.gateway_drafters = a.gateway_drafters or auto_gateway_drafters()
    if a.gateway_queue_depth < 0 or not a.gateway_queue_timeout_s > 0:
        errors.append("--gateway-queue-depth must be >= 0 and --gateway-queue-timeout-s > 0")
    return errors


def _first(*values):
    return next(v for v in values if v is not None)


def _serve_verifier_options(s) -> None:
    s.option("--target", "default", aliases=("--model",),
             help="the target model (--model, as in vLLM): 'default' (pinned Qwen2.5-Coder-1.5B), a GGUF file or a "
                  "Hugging Face directory (--engine torch)")
    s.option("--engine", "llama.cpp", choices=("llama.cpp", "torch", "scripted"),
             help="llama.cpp; torch (HF directory or GGUF, CUDA if present); scripted (a rule for a target, no "
                  "model: for client implementers, docs/protocol.md)")
    s.option("--grpc-host", None, help="the verifier's (gRPC) bind address (default: 127.0.0.1; keys are required "
                                       "off loopback)")
    s.option("--grpc-port", None, int, help=f"the verifier's (gRPC) port (default: {GRPC_PORT}; 0: any free port)")
    s.option("--threads", 0, int, help="verifier threads, 0 = all cores")
    s.option("--n-ctx", 4096, int)
    s.option("--max-sessions", 4, int, help="sessions per replica (KV is reserved for each)")
    s.option("--prefix-cache-tokens", 4096, int,
             help="KV kept for finished sessions' histories, reused by the next turn of a chat (0: off)")
    s.option("--deterministic", False, bool,
             help="bit-identical output whatever drafting, trees or batching do: logits independent of batch shape "
                  "(both engines; fixed-size forwards, one session each, no prefix cache)")
    s.option("--max-tree-nodes", 64, int)
    s.option("--max-tree-depth", 16, int)
    s.option("--chat-template", "", help="Jinja chat template file the verifier publishes to clients instead of the "
                                         "target's own (GGUF metadata / tokenizer_config.json)")
    s.option("--max-batch-tokens", 512, int, help="token budget of one verify forward")
    s.option("--batch-window-ms", 2.0, float, help="longest wait for more drafts to batch")
    s.option("--serial-prefill", False, bool, help="compute each prompt whole, in forwards of its own between "
                                                   "batches, instead of in chunks inside the verify forwards "
                                                   "(chunked prefill, the default on llama.cpp)")
    s.option("--verify-budget-tokens", 0, int,
             help="most tokens in one verify forward under load, reached by pruning the least probable draft nodes of "
                  "all sessions instead of holding drafts back (holds verify latency; 0: off)")
    s.option("--verify-budget-ms", 0.0, float,
             help="the same budget as a latency target: each verify forward holds the tokens the replica's measured "
                  "forward cost fits in this many ms (0: off; with --verify-budget-tokens, the smaller)")
    s.option("--verifier-cost", "", help="simulate a verifier: pace each forward to this cost curve (JSON, "
                                         "deploy/cost-curves/); real logits, labelled simulated")
    s.option("--cost-scale", 1.0, float, help="multiply the cost curve's times (to slow a whole run down evenly)")
    s.option("--replicas", 0, int, help="run a Ray pool of this many replicas (0 = in process)")
    s.option("--ray-address", None, help="existing Ray cluster, e.g. ray-head:6379 (default: a local Ray)")
    s.option("--cpus-per-replica", 1.0, float, help="CPU slice per replica when there is no GPU")
    s.option("--replica-resource", "", help="place replicas only on Ray nodes that advertise this custom resource, "
                                            "one replica per unit (ray start --resources '{\"NAME\": 1}')")


def _serve_gateway_options(s) -> None:
    s.option("--verifier", "", help="gateway only: the verifier at this address instead of a local one",
             env="TANDEM_GATEWAY_VERIFIER")  # not TANDEM_VERIFIER: chat's, which must not turn serve into a gateway
    s.option("--host", None, help=f"the REST gateway's bind address (default: {LOOPBACK}; keys are required off "
                                  f"loopback)")
    s.option("--port", None, int, help=f"the REST gateway's port (default: {HTTP_PORT}; 0: no gateway)")
    s.option("--gateway", True, bool, help="serve the REST gateway (--no-gateway: the verifier alone)")
    s.add_argument("--api-key", action="append", metavar="KEY",
                   help="a REST API key clients must send (repeatable, or comma-separated; adds to "
                        "$TANDEM_API_KEYS, which keeps keys out of the process list)")
    s.option("--http-host", None, help="deprecated: --host (with it, --host is the verifier's address)")
    s.option("--http-port", None, int, help="deprecated: --port (with it, --port is the verifier's port)")
    s.option("--served-model-name", "", help="model ids of the REST API, comma-separated: the first is the id "
                                             "answers carry, the others aliases (default: a slug of the target's "
                                             "file name)")
    s.option("--model-name", "", help="the served model id (older name of --served-model-name with one id)")
    s.option("--gateway-drafters", 0, int,
             help=f"co-located drafters = REST generations at once (0: one per 4 cores, 1 to {MAX_AUTO_DRAFTERS}: "
                  f"{auto_gateway_drafters()} on this machine)")
    s.option("--gateway-queue-depth", 64, int,
             help="requests that wait for a drafter when all are busy, first come first served (beyond: 429; 0: "
                  "no queue)")
    s.option("--gateway-queue-timeout-s", 300.0, float, help="the longest a request waits for a drafter (then 503)")
    s.option("--gateway-tree", "adaptive", help="'adaptive' (draft policy) or a fixed tree k,N,D (alias: --tree, "
                                                "as in `tandem chat`)", aliases=("--tree",))
    s.option("--gateway-shadow", False, bool,
             help="with the adaptive gateway tree: shadow chains while decoding cloud-only (off: co-located drafters "
                  "would spend the server's cores on them)")
    s.option("--drafter", "default", help="'default' (pinned Qwen2.5-Coder-0.5B) or a GGUF path")
    s.option("--drafter-engine", "auto", help="auto | llama.cpp | onnx (as chat's)")
    s.option("--drafter-vocab", "", help="VocabTrim head vocabulary (.npy) for an onnx drafter")
    s.option("--drafter-learn-vocab", True, bool, help="re-rank the --drafter-vocab head from served traffic")
    s.option("--ngram", False, bool, help="graft prompt-lookup (n-gram) drafts onto the gateway's trees")
    s.option("--drafter-threads", 0, int, help="threads of each gateway drafter (0: half the cores, shared among "
                                               "the drafters)")


def _serve_security_options(s) -> None:
    """Metrics, TLS, keys, limits and shutdown."""
    s.option("--metrics-port", 0, int, help="Prometheus /metrics of the verifier on this port (0: off; the "
                                            "gateway serves /metrics on its own port)")
    s.option("--tls-cert", "", help="PEM certificate: TLS on gRPC and REST")
    s.option("--tls-key", "", help="PEM private key of --tls-cert")
    s.option("--tls-ca", "", help="PEM the remote --verifier's certificate chains to, or 'system' for the "
                                  "publicly trusted roots")
    s.option("--tls-server-name", "", help="name the verifier's certificate carries, if not its address")
    s.option("--allow-unauthenticated", False, bool, help="serve off loopback without API keys (trusted networks)")
    s.option("--key-concurrency", 0, int, help="REST generations at once per API key (0: unlimited)")
    s.option("--key-tokens-per-minute", 0, int,
             help="REST prompt + completion tokens per API key and minute, /tokenize and /detokenize included "
                  "(0: unlimited)")
    s.option("--key-sessions", 0, int, help="gRPC sessions at once per verifier key (0: unlimited; gateway keys, "
                                            "TANDEM_GATEWAY_KEYS, are exempt)")
    s.option("--key-prefill-tokens-per-minute", 0, int,
             help="prompt tokens one verifier key's sessions may prefill per minute (0: unlimited)")
    s.option("--session-lifetime-s", 0.0, float, help="longest a gRPC session may live (0: unlimited)")
    s.option("--teacher-mb", 0.0, float,
             help="keep the target's top-16 at each committed position of the tenants whose verifier keys are in "
                  "TANDEM_TEACH_KEYS (for distilling the drafter), up to this many MB per tenant (0: off)")
    s.option("--teacher-tenant-mb", 0.0, float, help="kept positions of one verifier key's partitions together "
                                                      "(0: 4 x --teacher-mb); least recently written first out")
    s.option("--teacher-total-mb", 0.0, float, help="kept positions of every tenant together (0: 16 x --teacher-mb)")
    s.option("--teacher-age-h", 24.0, float, help="how long kept positions live (--teacher-mb), and adapters "
                                                  "trained on them (--distill-drafter); swept every minute")
    s.option("--distill-drafter", "", help="distil a LoRA adapter for this drafter (GGUF, Hugging Face directory or "
                                           "'default') from each opted-in tenant's kept positions while the "
                                           "verifier is idle, and offer it to that tenant's edges (torch extra)")
    s.option("--distill-min-positions", 512, int, help="new positions a tenant keeps before its next adapter")
    s.option("--distill-budget-s", 300.0, float, help="compute seconds one adapter's training may take")
    s.option("--distill-tenant-adapters", 4, int, help="partitions of one verifier key that may hold an adapter and "
                                                       "its training state (least recently used out first)")
    s.option("--distill-max-adapters", 16, int, help="partitions of every tenant together that may hold one")
    s.option("--distill-dir", "", help="keep each tenant's adapter and its training state in this directory, so "
                                       "they outlive a restart (default: in memory only)")
    s.option("--stream-inbox", 8, int, help="requests one gRPC stream buffers before flow control pushes back")
    s.option("--max-body-bytes", 1 << 20, int, help="largest REST request body (413 above)")
    s.option("--public-metrics", False, bool,
             help="serve the gateway's /metrics without a key (else it needs one of TANDEM_METRICS_KEYS)")
    s.option("--docs", False, bool, help="serve the gateway's /docs and /openapi.json")
    s.option("--chat-page", True, bool, help="serve the web chat page at /chat (it shows speculation live)")
    s.option("--browser-drafter", False, bool,
             help="serve the drafter's self-contained ONNX export to browsers (exported once, cached): the chat "
                  "page's 'draft in this browser'")
    s.option("--cors-origins", "", help="browser origins allowed to call the REST API, comma-separated "
                                        "(e.g. https://app.example); none by default")
    s.option("--max-streams", 256, int, help="gRPC session streams at once (RESOURCE_EXHAUSTED beyond)")
    s.option("--drain-s", 30.0, float, help="on SIGTERM, how long open sessions get to finish")
    s.option("--otlp-endpoint", "", help="export OpenTelemetry traces over OTLP/gRPC to this endpoint (otel extra; "
                                         "OTEL_EXPORTER_OTLP_ENDPOINT works too)")


def _chat_parser(sub) -> None:
    c = sub.add_parser("chat", help="chat through a running verifier (interactive without a prompt)")
    c.add_argument("prompt", nargs="?", default="", help="answer this one prompt and exit")
    c.option("--verifier", "127.0.0.1:50051", help="verifier address (gRPC; alias: --server)", aliases=("--server",))
    c.option("--tls-ca", "", help="PEM the verifier's certificate chains to (TLS), or 'system' for the "
                                  "publicly trusted roots")
    c.add_argument("--stats", action="store_true", help="print statistics after every answer")
    _add_chat_args(c)
    c.set_defaults(func=cmd_chat)


def _drafter_parser(sub) -> None:
    dr = sub.add_parser("drafter", help="drafter engines: ONNX export, VocabTrim heads")
    dsub = dr.add_subparsers(dest="drafter_command", required=True)
    ex = dsub.add_parser("export", help="export the drafter to ONNX (cached by source hash)")
    ex.add_argument("--drafter", default="default", help="'default', a GGUF path or an HF directory")
    ex.add_argument("--quant", default="int4", choices=("int4", "int8", "dynamic-int8", "fp32"),
                    help="dynamic-int8: the browser's (onnxruntime-web runs it fast; with --self-contained)")
    ex.add_argument("--force", action="store_true", help="re-export even if cached")
    ex.add_argument("--self-contained", action="store_true",
                    help="one model.onnx, token ids in and logits out, with tokenizer.json beside it (browsers, "
                         "apps; a Qwen2 GGUF)")
    ex.set_defaults(func=cmd_drafter_export)
    vt = dsub.add_parser("vocabtrim", help="choose a drafter head vocabulary (declared corpus + the target's own "
                                                 "outputs)")
    size = vt.add_mutually_exclusive_group()
    size.add_argument("--k", type=int, help="keep the K highest-ranked ids")
    size.add_argument("--coverage", type=float, help="keep the fewest ids covering this fraction of the counts")
    size.add_argument("--heldout-coverage", type=float, default=0.98,
                      help="(default) the smallest K covering this fraction of the target's own outputs")
    vt.add_argument("--target", default="default")
    vt.add_argument("--code-prompts", type=int, default=40, help="HumanEval calibration prompts (first half)")
    vt.add_argument("--chat-prompts", type=int, default=40, help="ShareGPT calibration prompts (first 100)")
    vt.add_argument("--max-new-tokens", type=int, default=128)
    vt.add_argument("--threads", type=int, default=0)
    vt.add_argument("--out", type=Path, required=True, help=".npy file of sorted ids (for --vocab)")
    vt.set_defaults(func=cmd_drafter_vocabtrim)


def _health_parser(sub) -> None:
    h = sub.add_parser("health", help="exit 0 if a verifier or gateway answers (container healthchecks)")
    target = h.add_mutually_exclusive_group(required=True)
    target.add_argument("--grpc", help="verifier address host:port (gRPC Health)")
    target.add_argument("--http", help="URL, e.g. http://127.0.0.1:8000/readyz")
    h.add_argument("--tls-ca", default="", help="PEM the server's certificate chains to (gRPC TLS, or https), "
                                                "or 'system' for the publicly trusted roots")
    h.add_argument("--timeout", type=float, default=3.0)
    h.set_defaults(func=cmd_health)


def _demo_parser(sub) -> None:
    d = sub.add_parser("demo", help="fetch models, start a local verifier, answer one prompt through it cloud-only "
                                     "and with Tandem, side by side")
    d.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT)
    d.add_argument("--target", default="default")
    d.add_argument("--stats", action="store_true", default=True, help=argparse.SUPPRESS)
    d.add_argument("--tls-ca", default="", help=argparse.SUPPRESS)
    _add_chat_args(d)
    d.set_defaults(func=cmd_demo)


def _config_path(argv: list[str]) -> str | None:
    """``--config`` is read before the parser is built: its values become the options' defaults."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config", default=os.environ.get("TANDEM_CONFIG"))
    return pre.parse_known_args(argv)[0].config


def main(argv: list[str] | None = None) -> int:
    lifetime.bind_to_parent()
    argv = sys.argv[1:] if argv is None else argv
    try:
        CommandParser.config = load_config(_config_path(argv))
        ap = parser()
        check_keys(CommandParser.config, ap.known_options())
    except ConfigError as e:
        print(f"tandem: {e}", file=sys.stderr)
        return 2
    args = ap.parse_args(argv)
    if errors := getattr(args, "config_errors", None):  # this command's own options were set badly
        for e in errors:
            print(f"tandem: {e}", file=sys.stderr)
        return 2
    logs.configure(args.log_level)
    try:
        return args.func(args)
    except (models.ModelError, LlamaError) as e:  # a model that is missing or will not load: one line, no traceback
        print(f"tandem {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
