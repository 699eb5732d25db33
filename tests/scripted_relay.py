"""A scripted verifier behind a gateway that relays edge sessions over WebSocket, for clients in other languages
(clients/web's Node tests start it): prints one JSON line {"url", "key", "fingerprint"}, serves until stdin closes.
A line "restart" on stdin stops the verifier (its sessions end UNAVAILABLE) and starts a new one on the same port,
then prints "restarted". No model: the target counts up (cloud/scripted_engine.py); the gateway's REST side is the
scripted FakeClient."""
import json
import sys
import threading
import time

import uvicorn

from scripted_gateway import KEY, FakeClient
from tandem.cloud.scripted_engine import ScriptedEngine
from tandem.cloud.server import serve
from tandem.core.auth import ApiKeys
from tandem.orchestrator.gateway.app import create_app
from tandem.orchestrator.gateway.serving import DrafterPool, GatewayConfig, VerifierLink


def main() -> int:
    engine = ScriptedEngine()
    verifier, port = serve(engine, "127.0.0.1:0")
    app = create_app(DrafterPool([FakeClient()]), GatewayConfig(keys=ApiKeys.of([KEY]),
                                                                verifier=VerifierLink(f"127.0.0.1:{port}")))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.02)
    http_port = server.servers[0].sockets[0].getsockname()[1]
    print(json.dumps({"url": f"http://127.0.0.1:{http_port}", "key": KEY, "fingerprint": engine.vocab_fingerprint,
                      "vocab_size": engine.vocab_size}), flush=True)
    for line in sys.stdin:  # until the test closes it (or dies)
        if line.strip() == "restart":
            verifier.stop(grace=None)
            verifier, _ = serve(engine, f"127.0.0.1:{port}")
            print("restarted", flush=True)
    server.should_exit = True
    verifier.stop(grace=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
