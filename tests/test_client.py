"""The edge client on the real pair, where the issues were: a verifier granting smaller trees than the client
asks for (open and resume), a drafter whose context fills up, sampled output with a pinned seed equal to the
target's own sampled decoding, and pinned-seed sessions kept out of the shared n-gram cache."""
import pytest

from tandem.cloud import reference
from tandem.cloud.backend import LocalBackend, ReplicaLost
from tandem.cloud.server import serve
from tandem.core.messages import Limits
from tandem.core.sampling import Sampling
from tandem.core.tree import TreeShape
from tandem.edge.client import EdgeClient
from tandem.edge.ngram import NgramDrafter

pytestmark = pytest.mark.models


@pytest.fixture(scope="module")
def prompt(engine, humaneval_chats):
    return engine.model.tokenize(engine.model.chat_prompt(humaneval_chats[3]))


class LoseOnce(LocalBackend):
    """Loses its replica once, after the first session committed ``after`` tokens."""

    def __init__(self, *a, after: int, **kw):
        super().__init__(*a, **kw)
        self.after, self.lost = after, False

    async def verify(self, session_id, req):
        s = self.session(session_id)
        if not self.lost and s.generated >= self.after:
            self.lost = True
            await self.close(session_id)
            raise ReplicaLost("replica lost (test)")
        return await super().verify(session_id, req)


def test_a_verifier_granting_smaller_trees_serves_opens_and_resumes(engine, drafter, prompt, noise, target_greedy):
    """The client asks for trees of 64 nodes; this verifier grants 2. Every tree must fit the grant, also on the
    session re-opened after the replica is lost."""
    backend = LoseOnce(engine, Limits(0, 2, 2), max_sessions=2, after=6)
    srv, port = serve(backend=backend, address="127.0.0.1:0")
    try:
        client = EdgeClient(drafter, f"127.0.0.1:{port}", TreeShape(4, 16, 6), stream=False, backoff_s=0.0)
        gen = client.generate(prompt, max_new_tokens=24).result()
        client.close()
    finally:
        srv.stop(None)
        backend.scheduler.stop()
    assert backend.lost and gen.stats.resumes == 1 and gen.stats.trees > 0
    assert gen.stats.drafted_nodes <= 2 * gen.stats.trees
    verdict = reference.classify(gen.tokens, target_greedy(engine, prompt, 24), noise)
    assert verdict.ok, str(verdict)


def test_a_drafter_with_a_full_context_lets_the_verifier_finish(engine, server, drafter_path, prompt, noise,
                                                                 target_greedy):
    """The drafter's context (the prompt and 20 tokens) fills up mid-generation; trees stop, the verifier decodes
    the rest. (The whole prompt, not a cut one: on a 2-core Xeon the target answered the last 60 tokens of this
    chat with a code fence and its end, 2 tokens, through a near-tie.)"""
    from tandem.edge.llama_drafter import LlamaDrafter
    ref = target_greedy(engine, prompt, 40)
    assert len(ref.tokens) == 40  # the target's answer outlasts the drafter's context
    small = LlamaDrafter(drafter_path, n_ctx=len(prompt) + 20, n_threads=2)
    client = EdgeClient(small, server, TreeShape(2, 6, 4), stream=False)
    gen = client.generate(prompt, max_new_tokens=40).result()
    client.close()
    assert len(gen.tokens) == 40 and gen.stats.trees > 0
    assert gen.stats.streamed_tokens > 0  # lock-step trees, until the full drafter left the rest to the verifier
    verdict = reference.classify(gen.tokens, ref, noise)
    assert verdict.ok, str(verdict)


def test_pinned_seed_sampling_equals_target_only_sampling(engine, server, drafter, prompt):
    """Position-keyed draws: with the same seed, speculative decoding (trees, pipelined) commits what target-only
    sampled decoding commits, up to a draw that lands within batch-shape noise of a CDF boundary."""
    client = EdgeClient(drafter, server, TreeShape(2, 8, 4))
    for seed in (1, 2, 3):
        s = Sampling(0.8, top_p=0.95, seed=seed)
        gen = client.generate(prompt, max_new_tokens=32, sampling=s).result()
        ref = reference.decode(engine, prompt, 32, s)
        first = next((i for i, (a, b) in enumerate(zip(gen.tokens, ref.tokens)) if a != b), None)
        assert first is None or ref.cdf_margin[first] < 0.02, (seed, first, ref.cdf_margin[first])
        assert len(gen.tokens) == len(ref.tokens) or first is not None
    client.close()


def test_pinned_seed_sessions_stay_out_of_the_shared_ngram_cache(server, drafter, prompt):
    ngram = NgramDrafter()
    client = EdgeClient(drafter, server, TreeShape(1, 2, 2), ngram=ngram)
    client.generate(prompt, max_new_tokens=12, sampling=Sampling(0.8, seed=7)).result()
    assert len(ngram._cache) == 0
    client.generate(prompt, max_new_tokens=12, sampling=Sampling(0.8)).result()
    assert len(ngram._cache) > 0
    client.close()
