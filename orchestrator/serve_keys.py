"""Which keys a ``tandem serve`` verifier accepts, exempts and lets teach, from what the deployment configured.

The rule: any tenant configuration (REST keys, opt-ins to distillation, a salt secret that makes edge tokens
outlive the process) means the verifier checks keys. Without verifier keys of its own it then accepts only the
internal key of this process's gateway, never a keyless caller; with them, that key besides. The gateway's key is
exempt from the per-key limits (it limits its own callers, each in its own partition), and, when REST tenants
opted in, it may teach (the gateway withholds every other caller's sessions).
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Callable

from tandem.core.auth import ApiKeys


@dataclass(frozen=True)
class LocalKeys:
    verifier: ApiKeys  # what the verifier in this process accepts (none: it accepts anyone, loopback only)
    exempt: ApiKeys  # keys outside the verifier's per-key limits: gateways'
    teach: ApiKeys  # keys whose sessions may keep the target's top-k (cloud.learning.teacher)
    gateway_key: str  # what this process's gateway presents to the verifier ("" when nothing is checked)


def local_keys(verifier: ApiKeys, gateways: ApiKeys, teach: ApiKeys, rest_teach: ApiKeys, guarded: bool,
               gateway_key: str, gateway: bool,
               new_key: Callable[[], str] = lambda: secrets.token_urlsafe(24)) -> LocalKeys:
    """The keys of a verifier that runs in this process. ``verifier``/``gateways``: TANDEM_VERIFIER_KEYS and
    TANDEM_GATEWAY_KEYS; ``teach``/``rest_teach``: TANDEM_TEACH_KEYS and TANDEM_REST_TEACH_KEYS; ``guarded``: any
    tenant configuration exists; ``gateway_key``: the key given to this process to present (TANDEM_VERIFIER_KEY),
    else ""; ``gateway``: this process also serves the REST gateway."""
    accepted = ApiKeys(verifier.keys + gateways.keys)
    if accepted.enabled or guarded:  # keys are checked: this process's gateway presents one
        gateway_key = gateway_key or new_key()
        if not accepted.has(gateway_key):
            accepted = accepted.with_key(gateway_key)
    if rest_teach.enabled:  # the gateway's sessions may teach (it withholds those of the keys not named)
        gateway_key = gateway_key or new_key()  # (auth off: a key only to tell its sessions apart)
        teach = teach.with_key(gateway_key)
    if gateway_key and gateway and not gateways.has(gateway_key):
        gateways = gateways.with_key(gateway_key)
    return LocalKeys(accepted, gateways, teach, gateway_key)
