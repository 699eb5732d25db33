"""Lossless sampling of the whole stack: thousands of generations through edge -> gRPC -> verifier on a tiny
random-weight model, and the joint distribution of their first two tokens against the target's own sampling
distribution, computed exactly from its logits. Scenarios: lock-step trees, trees + n-gram grafts from a cache
shared across sessions, speculative (proactive) trees, pipelined trees while the verifier streams, and a resume
after the first token. A chi-square test at p = 1e-4 must pass for each.

Power: the same test is run on a mutant verifier whose draws restart at every session open (the reuse bug Tandem
had: a pinned seed's stream replayed on resume); it must be rejected at p < 1e-9. Around the numbers here (600
generations, 144 cells), the test rejects deviations of about 0.1 in total variation."""
import numpy as np
import pytest
from scipy import stats

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tandem.cloud import session as session_module  # noqa: E402
from tandem.cloud.backend import LocalBackend, ReplicaLost  # noqa: E402
from tandem.cloud.server import serve  # noqa: E402
from tandem.cloud.engines.torch_engine import TorchVerifierEngine  # noqa: E402
from tandem.core.penalties import History  # noqa: E402
from tandem.core.sampling import Draws, Sampling, warp  # noqa: E402
from tandem.core.tree import TreeShape  # noqa: E402
from tandem.edge.client import EdgeClient  # noqa: E402
from tandem.edge.ngram import NgramDrafter  # noqa: E402
from tandem.edge.planner import FixedPlanner  # noqa: E402

from tinystack import V, TinyDrafter, tiny_model  # noqa: E402

PROMPT = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3]  # repeats: prompt lookup proposes continuations
SAMPLING = dict(temperature=1.0)
N = 600


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def joint(model, s: Sampling) -> dict:
    """Exact joint distribution of the first two tokens under ``s``: p(x1) p(x2 | x1), the logits shaped by each
    position's history (penalties) before warping."""
    def shaped(row, output=()):
        h = History(PROMPT)
        h.extend(output)
        return warp(h.shape(row, s), s)

    with torch.inference_mode():
        p1 = shaped(model(torch.tensor([PROMPT])).logits[0, -1].double().numpy())
        batch = torch.tensor([PROMPT + [x] for x in range(V)])
        rows = model(batch).logits[:, -1].double().numpy()
    return {(a, b): p1[a] * shaped(rows[a], (a,))[b] for a in range(V) for b in range(V)}


@pytest.fixture(scope="module")
def target(model):
    return joint(model, Sampling(**SAMPLING))


class Flaky(LocalBackend):
    """Loses the replica of every session opened on the prompt after it delivered one token (cloud-only decoding:
    one token per verdict): the client resumes after the first token, the second comes from a new session."""

    async def verify(self, session_id, req):
        s = self.session(session_id)
        if s.prompt_len == len(PROMPT) and s.committed_len == len(PROMPT) + 1:
            await self.close(session_id)
            raise ReplicaLost("replica lost (test)")
        return await super().verify(session_id, req)


@pytest.fixture
def stack(model):
    servers = []

    def start(flaky: bool = False):
        engine = TorchVerifierEngine(model=model, n_ctx=64, device="cpu", max_sessions=2)
        backend = (Flaky if flaky else LocalBackend)(engine, max_sessions=2)
        srv, port = serve(backend=backend, address="127.0.0.1:0")
        servers.append((srv, backend))
        return f"127.0.0.1:{port}"

    yield start
    for srv, backend in servers:
        srv.stop(None)
        backend.scheduler.stop()


def sample(address, model, n, planner, seeds=None, ngram=None, proactive=False, sampling=SAMPLING):
    """First two tokens of n generations."""
    client = EdgeClient(TinyDrafter(model), address, max_tree_nodes=8, max_tree_depth=4, ngram=ngram,
                        proactive=proactive, backoff_s=0.0, max_resumes=2)
    counts: dict = {}
    for i in range(n):
        seed = None if seeds is None else seeds + i
        gen = client.generate(PROMPT, max_new_tokens=2, sampling=Sampling(**sampling, seed=seed),
                              planner=planner).result()
        key = tuple(gen.tokens)
        counts[key] = counts.get(key, 0) + 1
    client.close()
    return counts, gen.stats


def chi2(counts, probs) -> float:
    """Chi-square p-value; cells expected below 5 counts are pooled into one."""
    n = sum(counts.values())
    assert all(len(k) == 2 for k in counts), "every generation yields two tokens here"
    big = [k for k, p in probs.items() if p * n >= 5]
    small = [k for k in probs if k not in big]
    obs = [counts.get(k, 0) for k in big] + [sum(counts.get(k, 0) for k in small)]
    exp = [probs[k] * n for k in big] + [sum(probs[k] for k in small) * n]
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return stats.chisquare(obs, np.array(exp) * sum(obs) / sum(exp)).pvalue


SCENARIOS = {
    # name: (planner, kwargs) -- pinned seeds (seeds=...) make the run reproducible, each generation its own seed
    "lock-step trees": (FixedPlanner(TreeShape(2, 6, 3), stream=False), dict(seeds=1000)),
    "speculative trees": (FixedPlanner(TreeShape(1, 3, 3), stream=False), dict(seeds=2000, proactive=True)),
    "pipelined trees": (FixedPlanner(TreeShape(2, 6, 3), stream=True), dict(seeds=3000)),
    "n-gram grafts from a shared cache (fresh entropy)": (FixedPlanner(TreeShape(1, 2, 2), stream=False),
                                                          dict(ngram="shared")),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_first_tokens_follow_the_target_distribution(name, stack, model, target):
    planner, kw = SCENARIOS[name]
    if kw.get("ngram") == "shared":
        kw = dict(kw, ngram=NgramDrafter(n_min=1, n_max=3))
    counts, stats_ = sample(stack(), model, N, planner, **kw)
    p = chi2(counts, target)
    assert p > 1e-4, (name, p, counts)
    if name.startswith("n-gram"):
        assert stats_.ngram_nodes > 0


def test_modified_distributions_top_k_and_min_p(stack, model):
    """The verifier samples the warped target (temperature, top-k, min-p), so speculative output follows the
    *modified* target's distribution, not the raw one's."""
    warped = dict(temperature=1.3, top_k=12, min_p=0.08)
    target = joint(model, Sampling(**warped))
    counts, _ = sample(stack(), model, N, FixedPlanner(TreeShape(2, 6, 3), stream=False), seeds=7000,
                       sampling=warped)
    assert chi2(counts, target) > 1e-4
    assert all(target[k] > 0 for k in counts)  # nothing min-p or top-k removed was ever emitted
    assert chi2(counts, joint(model, Sampling(1.3))) < 1e-4  # and the raw distribution is rejected


def test_after_a_resume_too(stack, model, target):
    counts, s = sample(stack(flaky=True), model, N, FixedPlanner(None), seeds=5000)
    assert s.resumes == 1
    assert chi2(counts, target) > 1e-4


PENALISED = dict(temperature=1.0, presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3,
                 logit_bias=((0, 2.0), (5, -1.0)))


@pytest.mark.parametrize("flaky", [False, True], ids=["trees", "resumed after the first token"])
def test_penalties_and_logit_bias_shape_the_distribution(stack, model, flaky):
    """Penalties depend on the output so far, so the second token's distribution depends on the first: through
    lock-step trees (each row shaped by its own path) and across a resume (the resumed session still counts the
    first token as output), the pair must follow the penalised target, and the unpenalised one is rejected."""
    target = joint(model, Sampling(**PENALISED))
    planner = FixedPlanner(None) if flaky else FixedPlanner(TreeShape(2, 6, 3), stream=False)
    counts, st = sample(stack(flaky=flaky), model, N, planner, seeds=9000, sampling=PENALISED)
    assert st.resumes == (1 if flaky else 0)
    assert chi2(counts, target) > 1e-4
    assert chi2(counts, joint(model, Sampling(1.0))) < 1e-4


def test_the_test_catches_draws_replayed_on_resume(stack, model, target, monkeypatch):
    """The mutant: draws keyed by the position within the session (restarting at every open), so after the
    resume the second token reuses the first token's draw -- what the old per-session seeded stream did."""
    class Replayed(Draws):
        def __init__(self, key, offset):
            super().__init__(key)
            self.offset = offset

        def uniform(self, position):
            return super().uniform(position - self.offset)

    real_start = session_module.start_session

    def replayed(s):
        s.draws = Replayed(Draws.for_sampling(s.sampling).key, s.prompt_len)
        return s

    def start_session(engine, prompt, sampling, *a, **kw):  # both ways a session opens: whole or chunked
        opening = real_start(engine, prompt, sampling, *a, **kw)
        if isinstance(opening, session_module.Opening):
            make = opening.session
            opening.session = lambda: replayed(make())
            return opening
        return replayed(opening)

    monkeypatch.setattr(session_module, "start_session", start_session)  # open_session's too
    from tandem.cloud import backend as backend_module
    monkeypatch.setattr(backend_module, "start_session", start_session)
    counts, s = sample(stack(flaky=True), model, N, FixedPlanner(None), seeds=5000)
    assert s.resumes == 1 and chi2(counts, target) < 1e-9


def test_a_pinned_seed_gives_the_same_tokens_whatever_the_drafting(stack, model):
    """Position-keyed draws: with a pinned seed the output depends on (seed, prompt, target) only."""
    address = stack()
    outs = []
    for planner in (FixedPlanner(None), FixedPlanner(TreeShape(2, 6, 3), stream=False),
                    FixedPlanner(TreeShape(1, 4, 4), stream=True)):
        client = EdgeClient(TinyDrafter(model), address, max_tree_nodes=8, max_tree_depth=4)
        outs.append([client.generate(PROMPT, max_new_tokens=12, sampling=Sampling(1.0, seed=s),
                                     planner=planner).result().tokens for s in range(20)])
        client.close()
    assert outs[0] == outs[1] == outs[2]
    assert len({tuple(o) for o in outs[0]}) > 10  # and different seeds differ
