"""A scripted verifier behind a gateway that relays edge sessions over WebSocket, for clients in other languages
(clients/web's Node tests start it): prints one JSON line {"url", "key", "fingerprint"}, serves until stdin closes.
A line "restart" on stdin stops the verifier (its sessions end UNAVAILABLE) and starts a new one on the same port,
then prints "restarted". No model: the target counts up (cloud/engines/scripted_engine.py); the gateway's REST side is
the scripted FakeClient. ``--host``: the verifier's host drafts too (a drafter that counts up, like the target)."""
import json
import sys

from scripted_gateway import KEY, FakeClient, app_server
from tandem.cloud.engines.scripted_engine import ScriptedEngine
from tandem.cloud.host_drafting import HostDrafting
from tandem.cloud.server import serve
from tandem.orchestrator.gateway.config import VerifierLink


class CountingHost:
    """A host drafter that knows the scripted target: the next tokens after t are t + 1, t + 2, ..."""

    name, slots = "counting-host", 2

    def draft(self, partition, tokens, depth):
        return [tokens[-1] + 1 + i for i in range(depth)] if tokens else []


def main() -> int:
    engine = ScriptedEngine()
    host = HostDrafting(CountingHost()) if "--host" in sys.argv[1:] else None
    verifier, port = serve(engine, "127.0.0.1:0", host=host)
    start, servers = app_server()
    url = start(FakeClient(), verifier=VerifierLink(f"127.0.0.1:{port}"))
    print(json.dumps({"url": url, "key": KEY, "fingerprint": engine.vocab_fingerprint,
                      "vocab_size": engine.vocab_size}), flush=True)
    for line in sys.stdin:  # until the test closes it (or dies)
        if line.strip() == "restart":
            verifier.stop(grace=None)
            verifier, _ = serve(engine, f"127.0.0.1:{port}", host=host)
            print("restarted", flush=True)
    servers[0].should_exit = True
    verifier.stop(grace=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
