"""``tandem health``: whether a verifier or a gateway can serve, as an exit status (for container healthchecks)."""
from __future__ import annotations

import sys


def check(args) -> int:
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

