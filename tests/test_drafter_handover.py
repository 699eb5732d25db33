"""A generation ends when its last verdict arrives, not when its drafter's last job does: the job finishes on its
own, the next generation's worker waits for it before touching the drafter, and ``wait_idle`` waits for it too.
Tiny random-weight stack, real gRPC."""
import threading
import time

import pytest

torch = pytest.importorskip("torch")

from tandem.cloud.backend import LocalBackend  # noqa: E402
from tandem.cloud.server import serve  # noqa: E402
from tandem.cloud.engines.torch_engine import TorchVerifierEngine  # noqa: E402
from tandem.core.sampling import Sampling  # noqa: E402
from tandem.core.tree import TreeShape  # noqa: E402
from tandem.edge.client import EdgeClient, wait_idle  # noqa: E402

from tinystack import TinyDrafter, tiny_model  # noqa: E402

PROMPT = [1, 2, 3, 4, 1, 2, 3]
SLOW_S = 1.5


class SlowDrafter(TinyDrafter):
    """Every draft takes SLOW_S; records overlapping calls (there must never be any)."""

    def __init__(self, model):
        super().__init__(model)
        self.active, self.overlaps, self.drafts_done = 0, 0, 0
        self._lock = threading.Lock()

    def _enter(self):
        with self._lock:
            self.active += 1
            self.overlaps += self.active > 1

    def _exit(self):
        with self._lock:
            self.active -= 1

    def draft(self, shape):
        self._enter()
        try:
            time.sleep(SLOW_S)
            return super().draft(shape)
        finally:
            self.drafts_done += 1
            self._exit()

    def start(self, prompt):
        self._enter()
        try:
            super().start(prompt)
        finally:
            self._exit()


@pytest.fixture(scope="module")
def address():
    model = tiny_model()
    backend = LocalBackend(TorchVerifierEngine(model=model, n_ctx=64, device="cpu", max_sessions=2), max_sessions=2)
    srv, port = serve(backend=backend, address="127.0.0.1:0")
    yield f"127.0.0.1:{port}", model
    srv.stop(None)
    backend.scheduler.stop()


def test_the_answer_does_not_wait_for_the_drafters_last_job(address):
    addr, model = address
    drafter = SlowDrafter(model)
    client = EdgeClient(drafter, addr, TreeShape(1, 3, 3))  # pipelined: the verifier streams while drafting
    reference = EdgeClient(TinyDrafter(model), addr, None)  # cloud-only: the same tokens, no drafter involved
    want = reference.generate(PROMPT, max_new_tokens=6, sampling=Sampling()).result().tokens
    t0 = time.perf_counter()
    gen = client.generate(PROMPT, max_new_tokens=6).result()
    took = time.perf_counter() - t0
    assert gen.tokens == want
    assert took < SLOW_S  # six tokens decoded by the verifier alone, long before the slow draft ends
    assert drafter.active == 1  # ... which is still running
    again = client.generate(PROMPT, max_new_tokens=6).result()  # its worker waits for the old job first
    assert again.tokens == want and drafter.overlaps == 0
    wait_idle(drafter)
    assert drafter.active == 0 and drafter.overlaps == 0
    client.close()
    reference.close()
