"""``tandem`` command line: fetch models, run a verifier, chat through the edge, or all of it at once (``demo``).

This module parses (``cli_args``: the parsers; ``settings``: where each option's value comes from) and dispatches to
the command's home: ``model_commands`` (models, drafter), ``compose`` (serve), ``terminal_chat`` (chat), ``health``,
``demo``."""
from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path

from tandem.core import lifetime, logs
from tandem.core.llama_cpu import LlamaError

from . import demo, health, model_commands, models, terminal_chat
from .cli_args import ENV_KEYS, OTHER_ENV_KEYS, auto_gateway_drafters, env_keys, parser
from .drafting import ngram as _ngram, paired as _paired, threads as _threads
from .serve_keys import local_keys
from .settings import CommandParser, ConfigError, check_keys, load_config
from .terminal_chat import unescape

__all__ = ["ENV_KEYS", "OTHER_ENV_KEYS", "auto_gateway_drafters", "env_keys", "main", "parser", "unescape"]

log = logging.getLogger("tandem.cli")


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



def cmd_chat(args) -> int:
    return terminal_chat.chat(args, args.verifier)


# each command (with its subcommand) -> what runs it
HANDLERS = {
    "models fetch": model_commands.models_fetch,
    "models list": model_commands.models_list,
    "models check": model_commands.models_check,
    "serve": cmd_serve,
    "chat": cmd_chat,
    "drafter export": model_commands.drafter_export,
    "drafter vocabtrim": model_commands.drafter_vocabtrim,
    "health": health.check,
    "demo": demo.run,
}


def _handler(args: argparse.Namespace):
    sub = getattr(args, f"{args.command}_command", None)
    return HANDLERS[f"{args.command} {sub}" if sub else args.command]


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
        return _handler(args)(args)
    except (models.ModelError, LlamaError) as e:  # a model that is missing or will not load: one line, no traceback
        print(f"tandem {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
