"""``tandem serve`` assembled from its configuration (``serve_config.ServeConfig``), top to bottom: the keys the
local verifier accepts, both ports reserved before any model loads, the verifier (a local engine or a Ray pool) on
gRPC, the REST gateway in front of it (or of a verifier elsewhere), and draining on the way out."""
from __future__ import annotations

import errno
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

from . import models
from .drafting import ngram, paired, threads
from .serve_config import ServeConfig
from .serve_keys import LocalKeys, local_keys
from .settings import ConfigError

log = logging.getLogger("tandem.cli")


def serve(cfg: ServeConfig) -> int:
    """Run what ``cfg`` configures until SIGTERM (or Ctrl-C): its exit status (2: a port or a template refused)."""
    from tandem.cloud.server import PortInUse

    keys = None if cfg.remote else _verifier_keys(cfg)
    try:
        http_socket = reserve_ports(cfg)
    except PortInUse as e:
        print(f"tandem serve: {e}", file=sys.stderr)
        return 2
    if cfg.deprecated:  # once nothing stands in the way of starting
        print(f"tandem serve: {cfg.deprecated}", file=sys.stderr, flush=True)
    tls = _tls(cfg)
    _tracing(cfg)
    server, address = None, cfg.gateway.verifier
    try:
        template = chat_template(cfg.verifier.chat_template)
        if keys is not None:
            server, address = start_verifier(cfg, keys, tls, template)
    except (ConfigError, PortInUse) as e:  # a template that does not compile; a port taken since the check above
        print(f"tandem serve: {e}", file=sys.stderr)
        return 2
    if cfg.verifier.metrics_port:
        from prometheus_client import start_http_server
        start_http_server(cfg.verifier.metrics_port, addr=cfg.verifier.grpc_host)
    try:
        if http_socket is not None:  # (reserve_ports binds it where the gateway is enabled)
            verifier_key = keys.gateway_key if keys is not None else cfg.security.keys.client_key
            return run_gateway(cfg, address, verifier_key, tls, http_socket)
        return _until_sigterm()
    finally:
        if server is not None:
            _drain(server, cfg.verifier.drain_s)


def _verifier_keys(cfg: ServeConfig) -> LocalKeys:
    """What the verifier in this process accepts, exempts and lets teach, and the key its gateway presents."""
    k = cfg.security.keys
    return local_keys(k.verifier, k.gateway, k.teach, k.rest_teach, k.guarded, k.client_key, cfg.gateway.enabled)


def _tls(cfg: ServeConfig):
    from tandem.core.auth import Tls
    s = cfg.security
    return Tls(Path(s.tls_cert), Path(s.tls_key)) if s.tls_cert else None


def _tracing(cfg: ServeConfig) -> None:
    if cfg.security.otlp_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        from tandem.core import tracing
        tracing.configure("tandem-serve", cfg.security.otlp_endpoint or None)


def chat_template(path: str) -> str:
    """The template file the verifier publishes instead of the target's (``--chat-template``), compiled now, before
    any model loads; "" when none is given."""
    if not path:
        return ""
    from tandem.core.chat_template import ChatTemplate, TemplateError
    try:
        template = Path(path).read_text()
        ChatTemplate(template)
    except (OSError, TemplateError) as e:
        raise ConfigError(f"--chat-template {path}: {e}") from None
    return template


def _until_sigterm() -> int:
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    try:
        while not stop:
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    return 0


def _drain(server, drain_s: float) -> None:
    """Health says draining, new sessions are refused (UNAVAILABLE: clients go elsewhere), open sessions get
    ``drain_s`` to finish; then the server and its backend stop."""
    left = server.drain(drain_s)
    if left:
        log.warning("stopping with %d sessions still open after %.0f s of draining", left, drain_s)
    server.stop(grace=1)
    getattr(server.backend, "shutdown", lambda: None)()


# -- ports ----------------------------------------------------------------------------------------------------------
def reserve_ports(cfg: ServeConfig) -> socket.socket | None:
    """Both ports checked before any model loads (a second serve on a port in use fails now, naming it): the
    gateway's socket, bound now, or None without a gateway. Raises ``PortInUse``."""
    v, g = cfg.verifier, cfg.gateway
    if not cfg.remote:
        check_port(v.grpc_host, v.grpc_port, f"the verifier (gRPC, {v.grpc_port_flag})")
    return listen(g.http_host, g.http_port, f"the REST gateway ({g.http_port_flag})") if g.enabled else None


def check_port(host: str, port: int, what: str) -> None:
    """Raise ``PortInUse`` naming ``port`` unless it can be listened on now (0: any port, nothing to check)."""
    if port:
        listen(host, port, what).close()


def listen(host: str, port: int, what: str) -> socket.socket:
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


# -- the verifier ---------------------------------------------------------------------------------------------------
def start_verifier(cfg: ServeConfig, keys: LocalKeys, tls, template: str):
    """The verifier of this process, serving on gRPC: ``(server, address)``. A model llama.cpp cannot load
    (``LlamaError``) is one line (``cli.main``); a port taken since ``reserve_ports`` raises ``PortInUse``."""
    from tandem.cloud.server import PortInUse, StreamLimits
    from tandem.cloud.server import serve as serve_grpc

    v = cfg.verifier
    backend = build_backend(cfg)
    limits = StreamLimits(v.key_sessions, v.key_prefill_tokens_per_minute, v.session_lifetime_s, v.stream_inbox)
    try:
        server, port = serve_grpc(backend=backend, address=f"{v.grpc_host}:{v.grpc_port}", keys=keys.verifier,
                                  tls=tls, max_streams=v.max_streams, chat_template=template, limits=limits,
                                  exempt=keys.exempt, teach=keys.teach, host=build_host_drafting(cfg, backend))
    except PortInUse:
        getattr(backend, "shutdown", lambda: None)()
        raise
    address = f"{v.grpc_host}:{port}"
    device = getattr(getattr(backend, "engine", None), "device", "ray pool" if v.replicas else "cpu")
    print(f"verifier ready on {address} ({backend.info.engine} on {device}, {backend.info.model_id}"
          f"{', TLS' if tls else ''}{', API keys' if keys.verifier.enabled else ''})", flush=True)
    return server, address


def build_backend(cfg: ServeConfig):
    """The verifier's backend: a Ray pool (``--replicas``), else a local engine (paced to ``--verifier-cost`` if
    given) with its scheduler, its teacher store and the distillation of drafter adapters, where configured."""
    from tandem.cloud.backend import LocalBackend
    from tandem.cloud.engines import load_engine
    from tandem.cloud.scheduler import Scheduler
    from tandem.cloud.session import Limits

    v = cfg.verifier
    server_max = Limits(0, v.max_tree_nodes, v.max_tree_depth)
    engine_kwargs = _engine_kwargs(cfg)
    if v.replicas:  # a Ray-managed pool: local Ray, or the cluster at --ray-address / $TANDEM_RAY_ADDRESS
        from tandem.orchestrator.pool.ray_pool import PoolBackend
        return PoolBackend(v.replicas, v.engine, engine_kwargs, v.max_sessions, server_max, address=v.ray_address,
                           cpus_per_replica=v.cpus_per_replica, replica_resource=v.replica_resource,
                           scheduler_kwargs=dict(max_batch_tokens=v.max_batch_tokens, window_ms=v.batch_window_ms,
                                                 verify_budget_tokens=v.verify_budget_tokens,
                                                 verify_budget_ms=v.verify_budget_ms,
                                                 mixed_prefill=not v.serial_prefill))
    engine = load_engine(v.engine, **engine_kwargs)
    if v.verifier_cost:  # the GPU regime, simulated: real logits, forwards paced to the curve
        from tandem.cloud.engines.pacing import CostCurve, PacedEngine
        engine = PacedEngine(engine, CostCurve.load(v.verifier_cost), v.cost_scale)
    teacher, adapters = _teacher(cfg), _adapters(cfg)
    backend = LocalBackend(engine, server_max, v.max_sessions,
                           Scheduler(engine, v.max_batch_tokens, v.batch_window_ms,
                                     verify_budget_tokens=v.verify_budget_tokens,
                                     verify_budget_ms=v.verify_budget_ms, mixed_prefill=not v.serial_prefill),
                           teacher=teacher, adapters=adapters)
    if cfg.distillation.distill_drafter:
        _distil(cfg, backend)
    return backend


def build_host_drafting(cfg: ServeConfig, backend):
    """The host's drafters for sessions that ask the verifier to draft (``--host-drafters``; the gateway's
    ``--drafter`` model and engine), or None. Their vocabulary must be the target's (no translation on the host)."""
    n = cfg.verifier.host_drafters
    if not n:
        return None
    from tandem.cloud.host_drafting import HostDrafting
    from tandem.cloud.session import Refused, check_vocabulary
    from tandem.edge.drafter import load_drafter

    from .host_drafters import HostDrafters

    g = cfg.gateway
    path = models.resolve(g.drafter, "drafter")
    drafters = [load_drafter(g.drafter_engine, model_path=path, n_ctx=g.n_ctx,
                             n_threads=g.drafter_threads or threads(0.5 / n)) for _ in range(n)]
    tok, engine = drafters[0].tokenizer, getattr(backend, "engine", None)
    try:
        if engine is not None:  # a local target: the drafter's ids may be a prefix of its padded vocabulary
            check_vocabulary(engine, tok.n_vocab, tok.vocab_fingerprint)
        elif (tok.n_vocab, tok.vocab_fingerprint) != (backend.info.vocab_size, backend.info.vocab_fingerprint):
            raise Refused("a Ray pool's target is checked by its whole vocabulary, which differs")
    except Refused as e:
        raise ConfigError(f"--host-drafters: the drafter {path} cannot draft the target's ids ({e}); a drafter of "
                          f"another family drafts on the device, through translation") from None
    log.info("host drafting: %d drafters of %s", n, path)
    return HostDrafting(HostDrafters(drafters, path))


def _engine_kwargs(cfg: ServeConfig) -> dict:
    from tandem.cloud.engines import MODEL_FREE

    v = cfg.verifier
    target = v.target if v.engine in MODEL_FREE else models.resolve(v.target, "target")
    kwargs = dict(model_path=str(target), n_ctx=v.n_ctx, max_tree_nodes=v.max_tree_nodes,
                  n_threads=v.threads or threads(), max_sessions=v.max_sessions)
    if v.deterministic:
        kwargs["deterministic"] = True  # and no prefix cache: reused KV was computed in other batch shapes
        if v.prefix_cache_tokens > 0:
            log.info("deterministic mode: the prefix cache is off")
    elif v.prefix_cache_tokens > 0:  # both engines: llama.cpp by seq id, torch in copied blocks
        kwargs["prefix_cache_tokens"] = v.prefix_cache_tokens
    return kwargs


def _teacher(cfg: ServeConfig):
    """The target's top-k kept at opted-in tenants' positions (``--teacher-mb``), or None."""
    d = cfg.distillation
    if not d.teacher_mb:
        return None
    from tandem.cloud.learning.teacher import TeacherStore
    mb = 1 << 20
    return TeacherStore(max_bytes=int(d.teacher_mb * mb), max_age_s=d.teacher_age_h * 3600,
                        max_tenant_bytes=int(d.teacher_tenant_mb * mb) or None,
                        max_total_bytes=int(d.teacher_total_mb * mb) or None)


def _adapters(cfg: ServeConfig):
    """Where distilled drafter adapters are kept (``--distill-drafter``), or None."""
    d = cfg.distillation
    if not d.distill_drafter:
        return None
    from tandem.cloud.learning.online import AdapterStore
    # an adapter lives no longer than the positions it learnt from (a lineage at most --teacher-age-h old)
    return AdapterStore(Path(d.distill_dir) if d.distill_dir else None, max_age_s=d.teacher_age_h * 3600)


def _distil(cfg: ServeConfig, backend) -> None:
    """The verifier's idle time distils each opted-in partition's drafter adapter."""
    from tandem.cloud.learning.online import OnlineConfig, OnlineDistillation

    d = cfg.distillation
    OnlineDistillation(backend.teacher, backend.adapters, models.resolve(d.distill_drafter, "drafter"),
                       idle=lambda: backend.active_sessions() == 0 and not backend.scheduler.busy(),
                       config=OnlineConfig(min_positions=d.distill_min_positions, round_budget_s=d.distill_budget_s,
                                           max_tenant_adapters=d.distill_tenant_adapters,
                                           max_adapters=d.distill_max_adapters)).start()


# -- the REST gateway -----------------------------------------------------------------------------------------------
def run_gateway(cfg: ServeConfig, address: str, verifier_key: str, tls, http_socket: socket.socket) -> int:
    """Serve the REST gateway (``build_gateway``) on ``http_socket`` until SIGTERM or Ctrl-C."""
    import uvicorn

    from .gateway.app import server_options

    app, pool, config = build_gateway(cfg, address, verifier_key, tls)
    g = cfg.gateway
    print(f"gateway ready on http{'s' if tls else ''}://{g.http_host}:{g.http_port} "
          f"({len(pool.clients)} drafters, verifier {address})", flush=True)
    # uvicorn shuts down gracefully on SIGTERM/SIGINT and then re-raises the signal to the previous handler: make
    # that a no-op so the verifier is stopped by serve's `finally` and the exit status stays 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    s = cfg.security
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", ssl_certfile=s.tls_cert if tls else None,
                                           ssl_keyfile=s.tls_key if tls else None, **server_options(config)))
    server.run(sockets=[http_socket])  # the socket bound before anything loaded
    pool.close()
    return 0


def build_gateway(cfg: ServeConfig, address: str, verifier_key: str, tls):
    """The REST gateway in front of the verifier at ``address``: ``(app, pool, config)``, its pool of co-located
    drafters each an EdgeClient of that verifier, presenting ``verifier_key``."""
    from tandem.core.quota import KeyLimits

    from .gateway.app import create_app
    from .gateway.config import GatewayConfig, VerifierLink
    from .gateway.drafter_pool import DrafterPool

    g, s = cfg.gateway, cfg.security
    drafter_path = models.resolve(g.drafter, "drafter")
    browser_drafter = None
    if g.browser_drafter:
        from tandem.edge.export.onnx_export import export
        browser_drafter = export(drafter_path, "dynamic-int8", self_contained=True)
    ca = s.tls_ca or (s.tls_cert if tls and not cfg.remote else None)
    pool = DrafterPool([_gateway_client(cfg, drafter_path, address, verifier_key, ca)
                        for _ in range(g.gateway_drafters)])
    names = g.model_names()
    config = GatewayConfig(keys=s.keys.rest, model_name=names[0] if names else "", aliases=tuple(names[1:]),
                           max_body_bytes=g.max_body_bytes,
                           limits=KeyLimits(g.key_concurrency, g.key_tokens_per_minute),
                           metrics_keys=s.keys.metrics, public_metrics=g.public_metrics, docs=g.docs,
                           chat_page=g.chat_page, salt_secret=s.keys.salt_secret, teach_keys=s.keys.rest_teach,
                           cors_origins=tuple(o.strip() for o in g.cors_origins.split(",") if o.strip()),
                           verifier=VerifierLink(address, ca, s.tls_server_name or None, verifier_key),
                           browser_drafter=browser_drafter, queue_depth=g.gateway_queue_depth,
                           queue_timeout_s=g.gateway_queue_timeout_s)
    return create_app(pool, config), pool, config


def _gateway_client(cfg: ServeConfig, drafter_path, address: str, verifier_key: str, ca):
    """One co-located drafter of the gateway, as an EdgeClient of the verifier, paired with its target."""
    from tandem.core.tree import TreeShape
    from tandem.edge.client import EdgeClient
    from tandem.edge.drafter import load_drafter
    from tandem.edge.policy import DraftPolicy, PolicyConfig

    g = cfg.gateway
    vocab: dict[str, Any] = {"vocab": g.drafter_vocab, "learn_vocab": g.drafter_learn_vocab} if g.drafter_vocab else {}
    drafter = load_drafter(g.drafter_engine, model_path=drafter_path, n_ctx=g.n_ctx,
                           n_threads=g.drafter_threads or threads(0.5 / g.gateway_drafters), **vocab)
    adaptive = g.gateway_tree == "adaptive"
    # co-located drafters share the server's cores: no shadow chains unless asked (their measurement is not free)
    policy = DraftPolicy(PolicyConfig() if g.gateway_shadow else PolicyConfig(shadow_depth=0)) if adaptive else None
    return paired(EdgeClient(drafter, address, None if adaptive else TreeShape.parse(g.gateway_tree), policy=policy,
                             api_key=verifier_key, tls_ca=ca, tls_server_name=cfg.security.tls_server_name or None,
                             ngram=ngram(g.ngram)))
