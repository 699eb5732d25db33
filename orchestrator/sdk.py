"""``connect``: one call from a verifier's address to a ready client, with the defaults a device wants.

    from tandem.orchestrator.sdk import connect

    with connect("verifier.example:50051", api_key=KEY) as client:   # TLS with the system's trusted roots
        print(client.chat([{"role": "user", "content": "hello"}]).text)

It fetches the pinned drafter once (or loads the GGUF or drafter given), drafts under the draft policy with the
objective asked for, and matches the drafter to the verifier's target (native, padded or translated: see
``EdgeClient.pair_with_target``) before returning.
"""
from __future__ import annotations

from pathlib import Path

from tandem.edge.client import EdgeClient
from tandem.edge.drafter import Drafter, load_drafter
from tandem.edge.policy import DraftPolicy

from . import models


def connect(address: str, drafter: str | Path | Drafter = "default", *, api_key: str | None = None,
            tls_ca: str | None = None, objective: str = "latency", engine: str = "auto",
            n_threads: int | None = None, n_ctx: int = 4096, **client_kwargs) -> EdgeClient:
    """A client of the verifier at ``address``. ``drafter``: "default" (the pinned Qwen2.5-Coder-0.5B, fetched
    into the cache once), a GGUF path, or a drafter already loaded; ``engine``: the drafter engine for a path
    ("auto": ONNX Runtime where it exports without torch, else llama.cpp; "llama.cpp"; "onnx"); ``objective``:
    the draft policy's ("latency" or "cloud_cost"); ``tls_ca``: a CA file,
    "system" for the public roots, "none" for plaintext, or None: TLS with the
    system roots off this machine, plaintext on loopback. Other keyword arguments go to ``EdgeClient``."""
    if isinstance(drafter, (str, Path)):
        drafter = load_drafter(engine, model_path=models.resolve(str(drafter), "drafter"), n_ctx=n_ctx,
                               n_threads=n_threads)
    client = EdgeClient(drafter, address, policy=DraftPolicy(objective=objective), api_key=api_key, tls_ca=tls_ca,
                        **client_kwargs)
    try:
        client.pair_with_target()
    except BaseException:
        client.close()
        raise
    return client
