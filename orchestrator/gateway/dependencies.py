"""The FastAPI dependencies every router of the gateway shares: the application's ``Gateway`` and the caller's API
key (``serving``'s REST routes, ``edge_sessions``' token minting)."""
from __future__ import annotations

from fastapi import Request

from tandem.core.auth import ApiKeys

from .errors import unauthorized
from .gateway import Gateway


def gateway(request: Request) -> Gateway:
    """The application's serving class (``app.create_app`` puts it in ``app.state``)."""
    return request.app.state.gateway


def api_key(request: Request) -> str:
    """The caller's key (the guard has checked it already; with auth off, everyone is "anonymous")."""
    keys: ApiKeys = request.app.state.gateway.config.keys
    presented = request.headers.get("authorization") or ""
    if not keys.check(presented):
        raise unauthorized()
    return presented[7:].strip() if presented[:7].lower() == "bearer " else (presented or "anonymous")
