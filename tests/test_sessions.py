"""Several sessions on one verifier, sampling end to end, and the command line, on the real pair."""
import re
import subprocess
import sys
import threading

import pytest

from tandem.cloud import reference
from tandem.core.sampling import Sampling
from tandem.edge.client import EdgeClient, health
from tandem.core.tree import TreeShape

pytestmark = pytest.mark.models

NEW = 32


@pytest.fixture(scope="module")
def prompts(engine, humaneval_chats):
    return [engine.model.tokenize(engine.model.chat_prompt(c)) for c in humaneval_chats[5:8]]


def test_concurrent_sessions_are_batched_and_isolated(verifier, make_drafter, prompts, engine, noise,
                                                        target_greedy):
    server, backend = verifier
    clients = [EdgeClient(make_drafter(), server, TreeShape(3, 8, 4)) for _ in prompts]
    alone = [c.generate(p, max_new_tokens=NEW).result().tokens for c, p in zip(clients, prompts)]
    together, errors = [None] * len(prompts), []

    def run(i):
        try:
            together[i] = clients[i].generate(prompts[i], max_new_tokens=NEW).result().tokens
        except Exception as e:  # surfaced below
            errors.append(e)

    before = (backend.scheduler.stats.forwards, backend.scheduler.stats.trees)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    forwards = backend.scheduler.stats.forwards - before[0]
    trees = backend.scheduler.stats.trees - before[1]
    assert trees > forwards, f"no forward verified more than one session ({trees} trees in {forwards} forwards)"
    # batching changes only batch shapes: outputs equal those alone, up to a measured near-tie flip
    for t, a, p in zip(together, alone, prompts):
        if t != a:
            ref = target_greedy(engine, p, NEW)
            kinds = {reference.classify(t, ref, noise)[0], reference.classify(a, ref, noise)[0]}
            assert kinds <= {"exact", "near_tie"}, kinds
    assert len(set(map(tuple, alone))) == len(prompts)
    assert health(server).active_sessions == 0
    for c in clients:
        c.close()


def test_sampling_top_k_1_equals_greedy(server, drafter, engine, prompts, noise, target_greedy):
    """top_k = 1 makes p a point mass on the argmax: the sampling path must reproduce greedy decoding."""
    client = EdgeClient(drafter, server, TreeShape(4, 16, 6))
    gen = client.generate(prompts[0], max_new_tokens=NEW, sampling=Sampling(1.0, top_k=1, seed=3)).result()
    ref = target_greedy(engine, prompts[0], NEW)
    verdict = reference.classify(gen.tokens, ref, noise)
    assert verdict.ok, str(verdict)


def test_sampling_is_seeded_and_stops_on_length(server, drafter, prompts):
    client = EdgeClient(drafter, server, TreeShape(4, 16, 6))
    # hot enough that a few seeds surely differ somewhere (code prompts make a confident model)
    runs = [client.generate(prompts[1], max_new_tokens=NEW, sampling=Sampling(1.5, top_p=0.99, seed=s)).result()
            for s in (11, 11, 12, 13)]
    assert runs[0].tokens == runs[1].tokens  # same seed, same drafts: the same session
    assert len({tuple(r.tokens) for r in runs[1:]}) > 1  # other seeds draw other tokens
    for r in runs:
        assert r.finish_reason in ("stop", "length") and 0 < len(r.tokens) <= NEW
        assert r.stats.tau >= 1.0


def test_stop_string_ends_generation(server, drafter, engine):
    client = EdgeClient(drafter, server, TreeShape(1, 4, 4))
    gen = client.chat([{"role": "user", "content": "Write a Python function that adds two numbers."}],
                      max_new_tokens=64, stop=["def "]).result()
    assert gen.finish_reason == "stop" and "def " not in gen.text
    assert len(gen.tokens) < 64


def test_cli_chat_against_running_verifier(server):
    """One answer: cut by --max-tokens it says so; a stop string typed with escapes (`--stop '\\n'`) ends it at the
    first line break."""
    out = subprocess.run([sys.executable, "-m", "tandem.orchestrator.cli", "chat", "Say hello.", "--server", server,
                          "--max-tokens", "12", "--tree", "2,6,3"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    *_, marker, last = out.stdout.strip().splitlines()
    assert re.fullmatch(r"-- \d+ tokens \(prompt \d+\), tau [\d.]+, [\d.]+ tokens/s \(finish: (stop|length), "
                        r"\d+ verify forwards, tree 2,6,3\)", last), last
    assert (marker == "[cut at --max-tokens 12]") == ("finish: length" in last), out.stdout
    out = subprocess.run([sys.executable, "-m", "tandem.orchestrator.cli", "chat", "Write a Python function that adds "
                          "two numbers.", "--server", server, "--max-tokens", "64", "--tree", "2,6,3", "--stop",
                          "\\n"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    answer, last = out.stdout.strip().splitlines()[-2:]
    assert "finish: stop" in last and "[cut" not in out.stdout and answer.strip(), out.stdout


def test_cli_demo_runs_the_whole_stack():
    """What `make run` runs: models from the cache, a verifier subprocess, a chat through it."""
    out = subprocess.run([sys.executable, "-m", "tandem.orchestrator.cli", "demo", "Print hello in Python.",
                          "--max-tokens", "16"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines()
            if line.startswith(("cloud-only", "tandem (", "lock-step chains"))]
    assert [r[0] for r in rows] == ["cloud-only", "tandem", "tandem", "lock-step"], out.stdout
    assert "the answers are identical" in out.stdout or "near-tie" in out.stdout, out.stdout
    assert "on a GPU, simulated (closed form" in out.stdout and "server-only" in out.stdout, out.stdout
