"""``tandem serve``'s configuration, typed and whole: what the verifier, the REST gateway, security and distillation
were given (flags, ``TANDEM_*`` variables, the ``--config`` file: ``settings``; addresses settled by
``cli_args._serve_addresses``), plus the key sets of the environment. ``ServeConfig.load`` builds it from the parsed
namespace and refuses, before anything listens or loads, what cannot be served: each cross-check is a validator
that raises the error naming the flag or variable to change. ``compose.serve`` then runs it."""
from __future__ import annotations

import argparse
import os
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from tandem.core.auth import ApiKeys, AuthConfigError, client_key, require_auth_off_loopback
from tandem.core.tenancy import salt_secret

from . import models
from .settings import ConfigError


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True, extra="forbid")

    @classmethod
    def of(cls, args: argparse.Namespace, **given: Any):
        """The section from the namespace's attributes of the same names (and ``given``)."""
        return cls(**{name: getattr(args, name) for name in cls.model_fields if name not in given}, **given)


class VerifierSettings(_Section):
    """The verifier in this process (none when the gateway fronts a remote one, ``GatewaySettings.verifier``)."""
    target: str
    engine: str
    grpc_host: str
    grpc_port: int
    grpc_port_flag: str  # the flag that named the port (for errors)
    threads: int
    n_ctx: int
    max_sessions: int
    prefix_cache_tokens: int
    deterministic: bool
    max_tree_nodes: int
    max_tree_depth: int
    chat_template: str
    max_batch_tokens: int
    batch_window_ms: float
    serial_prefill: bool
    verify_budget_tokens: int
    verify_budget_ms: float
    verifier_cost: str
    cost_scale: float
    replicas: int
    host_drafters: int  # drafters beside the verifier for sessions that ask it to draft (0: none)
    ray_address: Optional[str]
    cpus_per_replica: float
    replica_resource: str
    max_streams: int
    stream_inbox: int
    key_sessions: int
    key_prefill_tokens_per_minute: int
    session_lifetime_s: float
    metrics_port: int
    drain_s: float


class GatewaySettings(_Section):
    """The REST gateway (``http_port`` 0: none) and its co-located drafters."""
    verifier: str  # a remote verifier to front ("": the one in this process)
    http_host: str
    http_port: int
    http_port_flag: str
    served_model_name: str
    model_name: str
    gateway_drafters: int
    gateway_queue_depth: int
    gateway_queue_timeout_s: float
    gateway_tree: str
    gateway_shadow: bool
    drafter: str
    drafter_engine: str
    drafter_vocab: str
    drafter_learn_vocab: bool
    ngram: bool
    drafter_threads: int
    n_ctx: int  # (serve's --n-ctx: the drafters' context too)
    key_concurrency: int
    key_tokens_per_minute: int
    max_body_bytes: int
    public_metrics: bool
    docs: bool
    chat_page: bool
    browser_drafter: bool
    cors_origins: str

    @property
    def enabled(self) -> bool:
        return bool(self.http_port)

    def model_names(self) -> list[str]:
        """The REST API's model ids: the first is the one answers carry."""
        return [n.strip() for n in (self.served_model_name or self.model_name).split(",") if n.strip()]


class ServeKeys(_Section):
    """The key sets of the environment (each ``$NAME`` or ``$NAME_FILE``) and ``--api-key``."""
    rest: ApiKeys  # REST clients of the gateway: TANDEM_API_KEYS[_FILE] and --api-key
    gateway: ApiKeys  # gateways' verifier keys (TANDEM_GATEWAY_KEYS): open the verifier, outside its per-key limits
    verifier: ApiKeys  # TANDEM_VERIFIER_KEYS
    metrics: ApiKeys  # scrapers of the gateway's /metrics
    teach: ApiKeys  # verifier keys whose tenants opted in to keeping the target's top-k (cloud.learning.teacher)
    rest_teach: ApiKeys  # REST keys whose tenants opted in: the gateway withholds the rest's sessions
    salt_secret: bytes
    salted: bool  # the salt secret is configured (edge tokens outlive this process)
    client_key: str  # what this process's gateway presents to a verifier (TANDEM_VERIFIER_KEY), else ""

    @classmethod
    def from_env(cls, api_key_flags: list[str] | None) -> ServeKeys:
        keys = {name: ApiKeys.from_env(name=f"TANDEM_{name.upper()}_KEYS")
                for name in ("gateway", "verifier", "metrics", "teach", "rest_teach")}
        flags = ApiKeys.of(k for given in api_key_flags or () for k in given.split(","))
        return cls(rest=ApiKeys(ApiKeys.from_env().keys + flags.keys), **keys, salt_secret=salt_secret(),
                   salted=bool(os.environ.get("TANDEM_SALT_SECRET") or os.environ.get("TANDEM_SALT_SECRET_FILE")),
                   client_key=client_key())

    @property
    def accepted(self) -> ApiKeys:
        """What opens the verifier: its own keys and the gateways'."""
        return ApiKeys(self.verifier.keys + self.gateway.keys)

    @property
    def guarded(self) -> bool:
        """Any tenant configuration (REST keys, opt-ins, a salt secret): the verifier must check keys."""
        return self.rest.enabled or self.teach.enabled or self.rest_teach.enabled or self.salted


class SecuritySettings(_Section):
    tls_cert: str
    tls_key: str
    tls_ca: str
    tls_server_name: str
    allow_unauthenticated: bool
    otlp_endpoint: str
    keys: ServeKeys


class DistillationSettings(_Section):
    """Positions kept for opted-in tenants (``--teacher-*``) and the drafter adapters distilled from them."""
    teacher_mb: float
    teacher_tenant_mb: float
    teacher_total_mb: float
    teacher_age_h: float
    distill_drafter: str
    distill_min_positions: int
    distill_budget_s: float
    distill_tenant_adapters: int
    distill_max_adapters: int
    distill_dir: str


class ServeConfig(_Section):
    verifier: VerifierSettings
    gateway: GatewaySettings
    security: SecuritySettings
    distillation: DistillationSettings
    deprecated: str = ""  # the line to print for the old address spelling

    @classmethod
    def load(cls, args: argparse.Namespace) -> ServeConfig:
        """``tandem serve``'s parsed namespace as its configuration. Raises ``models.ModelError`` for a file that
        cannot be a model (checked first), ``AuthConfigError``, ``SaltError`` or ``ConfigError`` for the rest."""
        _check_model_files(args)
        try:
            return cls(verifier=VerifierSettings.of(args), gateway=GatewaySettings.of(args),
                       security=SecuritySettings.of(args, keys=ServeKeys.from_env(args.api_key)),
                       distillation=DistillationSettings.of(args), deprecated=args.deprecated)
        except ValidationError as e:  # a validator's own error, as it was raised (pydantic wraps a ValueError)
            error = (e.errors()[0].get("ctx") or {}).get("error")
            raise error if isinstance(error, Exception) else ConfigError(str(e)) from None

    @property
    def remote(self) -> bool:
        """The gateway alone, in front of a verifier elsewhere."""
        return bool(self.gateway.verifier)

    @model_validator(mode="after")
    def _refuse_what_cannot_be_served(self) -> ServeConfig:
        _check_teaching(self)
        _check_distillation(self)
        _check_shared_vocabulary(self)
        _check_auth(self)
        _check_verify_budget(self.verifier)
        return self


def _check_model_files(args: argparse.Namespace) -> None:
    """A file that cannot be a model is refused before ports or anything else."""
    from tandem.cloud.engines import MODEL_FREE
    if not args.verifier and args.engine not in MODEL_FREE:
        models.check(args.target, "target", args.engine)
    if args.http_port or args.host_drafters:
        models.check(args.drafter, "drafter")


def _check_teaching(c: ServeConfig) -> None:
    """Opt-ins (TANDEM_TEACH_KEYS, TANDEM_REST_TEACH_KEYS) need collection on, in this process's verifier, and
    tenants known by a key the verifier checks."""
    keys, teacher_mb = c.security.keys, c.distillation.teacher_mb
    if keys.teach.enabled and not teacher_mb:
        raise AuthConfigError("TANDEM_TEACH_KEYS names opted-in tenants but --teacher-mb is 0 (collection off)")
    if not c.remote and not all(keys.accepted.has(k.decode()) for k in keys.teach.keys):
        raise AuthConfigError("TANDEM_TEACH_KEYS names keys that are not verifier keys: a tenant opts in by a "
                              "key the verifier checks (add them to TANDEM_VERIFIER_KEYS), else anyone "
                              "presenting one would land in its partition")
    if teacher_mb and (c.remote or c.verifier.replicas):
        raise AuthConfigError("--teacher-mb keeps positions in this process's verifier: not with --verifier "
                              "or --replicas")
    if keys.rest_teach.enabled and not c.gateway.enabled:
        raise AuthConfigError("TANDEM_REST_TEACH_KEYS names REST tenants but this serves no gateway (--http-port)")
    if keys.rest_teach.enabled and not c.remote and not teacher_mb:
        raise AuthConfigError("TANDEM_REST_TEACH_KEYS names opted-in REST tenants but --teacher-mb is 0 "
                              "(collection off)")


def _check_distillation(c: ServeConfig) -> None:
    d = c.distillation
    if d.distill_dir and not d.distill_drafter:
        raise AuthConfigError("--distill-dir keeps the adapters --distill-drafter trains: set --distill-drafter")
    if d.distill_drafter and not d.teacher_mb:
        raise AuthConfigError("--distill-drafter trains on the positions --teacher-mb keeps: set --teacher-mb "
                              "(and TANDEM_TEACH_KEYS)")


def _check_shared_vocabulary(c: ServeConfig) -> None:
    g = c.gateway
    if g.enabled and g.drafter_learn_vocab and g.drafter_vocab and len(c.security.keys.rest.keys) > 1:
        raise AuthConfigError("--drafter-learn-vocab would learn one head from every API key's traffic (a "
                              "state shared across tenants); serve one key per gateway, or pass "
                              "--no-drafter-learn-vocab")


def _check_auth(c: ServeConfig) -> None:
    """Keys off loopback, on both planes. Any tenant configuration means the verifier must check keys: without
    verifier keys of its own it accepts only the internal key of this process's gateway, never a keyless caller."""
    keys, allow = c.security.keys, c.security.allow_unauthenticated
    if c.gateway.enabled:
        require_auth_off_loopback(c.gateway.http_host, keys.rest, allow)
    if c.remote:
        return
    if keys.guarded and not keys.accepted.enabled and not c.gateway.enabled:
        raise AuthConfigError("REST keys, opt-ins or a salt secret are set, so the verifier checks keys, but it "
                              "has none (TANDEM_VERIFIER_KEYS) and no gateway (--http-port) to use one: it "
                              "would accept nobody")
    require_auth_off_loopback(c.verifier.grpc_host, keys.accepted, allow or keys.guarded, "TANDEM_VERIFIER_KEYS")


def _check_verify_budget(v: VerifierSettings) -> None:
    if v.verify_budget_tokens < 0 or not v.verify_budget_ms >= 0:
        raise ConfigError("--verify-budget-tokens and --verify-budget-ms must be >= 0")
