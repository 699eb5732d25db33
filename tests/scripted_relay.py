"""A scripted verifier behind a gateway that relays edge sessions over WebSocket, for clients in other languages
(clients/web's Node tests start it): prints one JSON line {"url", "key", "fingerprint"}, serves until stdin closes.
A line "restart" on stdin stops the verifier (its sessions end UNAVAILABLE) and starts a new one on the same port,
then prints "restarted". No model: the target counts up (cloud/engines/scripted_engine.py); the gateway's REST side is
the scripted FakeClient."""
import json
import sys

from scripted_gateway import KEY, FakeClient, app_server
from tandem.cloud.engines.scripted_engine import ScriptedEngine
from tandem.cloud.server import serve
from tandem.orchestrator.gateway.config import VerifierLink


def main() -> int:
    engine = ScriptedEngine()
    verifier, port = serve(engine, "127.0.0.1:0")
    start, servers = app_server()
    url = start(FakeClient(), verifier=VerifierLink(f"127.0.0.1:{port}"))
    print(json.dumps({"url": url, "key": KEY, "fingerprint": engine.vocab_fingerprint,
                      "vocab_size": engine.vocab_size}), flush=True)
    for line in sys.stdin:  # until the test closes it (or dies)
        if line.strip() == "restart":
            verifier.stop(grace=None)
            verifier, _ = serve(engine, f"127.0.0.1:{port}")
            print("restarted", flush=True)
    servers[0].should_exit = True
    verifier.stop(grace=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
