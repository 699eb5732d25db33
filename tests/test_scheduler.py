"""The engine loop on a scripted engine: drafts that arrive together share one forward, within the token budget;
a bad draft fails alone; an engine failure fails its batch and the loop keeps serving."""
import threading

import pytest

from tandem.cloud.scheduler import Scheduler
from tandem.cloud.session import DraftRequest, InvalidRequest, Limits, UnknownSession, open_session
from tandem.core.sampling import Sampling
from tandem.core.tree import DraftTree

from scripted import RuleEngine, ScriptedEngine, succ


def sessions(engine, n):
    return [open_session(engine, [1 + 10 * i, 2 + 10 * i], Sampling(), Limits(20, 8, 4), Limits(0, 16, 8))
            for i in range(n)]


def submit_together(sched, jobs):
    """Hold the loop on a call, queue every draft, release: the drafts are all pending at once."""
    gate = threading.Event()
    sched.call(gate.wait)
    futures = [sched.verify(s, DraftRequest(c, t, 1)) for s, c, t in jobs]
    gate.set()
    return futures


@pytest.mark.parametrize("batching,budget,expected", [
    (True, 512, [3]),  # all three in one forward
    (False, 512, [1, 1, 1]),  # the unbatched baseline
    (True, 6, [2, 1]),  # 3 tokens each (root + 2 nodes): two fit a budget of 6
    (True, 5, [1, 1, 1]),
])
def test_batches_form_within_budget(batching, budget, expected):
    eng = ScriptedEngine(succ)
    sched = Scheduler(eng, max_batch_tokens=budget, window_ms=50, batching=batching)
    ss = sessions(eng, 3)
    futures = submit_together(sched, [(s, 2, DraftTree.chain([3 + 10 * i, 4 + 10 * i])) for i, s in enumerate(ss)])
    verdicts = [f.result(timeout=5) for f in futures]
    sched.stop()
    assert eng.batches == expected
    for i, v in enumerate(verdicts):  # each session got its own tokens, as alone
        assert v.accepted == (0, 1) and v.bonus == 5 + 10 * i and v.committed_len == 5


def test_bad_draft_fails_alone_and_others_share_the_forward():
    eng = ScriptedEngine(succ)
    sched = Scheduler(eng, window_ms=50)
    a, b, c = sessions(eng, 3)
    with pytest.raises(InvalidRequest, match="inside the prompt"):
        sched.verify(b, DraftRequest(1, DraftTree(), 1)).result(timeout=5)  # rejected at submit, never queued
    gate = threading.Event()
    sched.call(gate.wait)
    fa, fb, fc = (sched.verify(s, DraftRequest(2, DraftTree.chain([3 + 10 * i]), 1)) for i, s in enumerate((a, b, c)))
    b.close()  # b goes away while its draft is queued: it must fail alone at the batch's re-check
    gate.set()
    with pytest.raises(UnknownSession, match="closed"):
        fb.result(timeout=5)
    assert fa.result(timeout=5).committed_len == 4 and fc.result(timeout=5).committed_len == 4
    sched.stop()
    assert eng.batches == [2]


def test_engine_failure_fails_the_batch_and_the_loop_survives():
    eng = ScriptedEngine(succ)
    sched = Scheduler(eng, window_ms=1)
    (s,) = sessions(eng, 1)
    real = eng.forward_batch
    eng.forward_batch = lambda jobs: (_ for _ in ()).throw(RuntimeError("device lost"))
    with pytest.raises(RuntimeError, match="device lost"):
        sched.verify(s, DraftRequest(2)).result(timeout=5)
    eng.forward_batch = real
    assert sched.verify(s, DraftRequest(2)).result(timeout=5).committed_len == 3
    sched.stop()


@pytest.mark.parametrize("open_sessions,waits", [(None, True), (1, False), (2, True)])
def test_batch_of_every_open_session_skips_the_window(open_sessions, waits):
    """A lone session (or a batch holding a draft of every open session) cannot grow: it runs at once instead of
    waiting out the window for drafts that will not come."""
    import time
    eng = ScriptedEngine(succ)
    sched = Scheduler(eng, window_ms=300)
    if open_sessions is not None:
        sched.open_sessions = lambda: open_sessions
    (s,) = sessions(eng, 1)
    t0 = time.perf_counter()
    assert sched.verify(s, DraftRequest(2)).result(timeout=5).committed_len == 3
    elapsed = time.perf_counter() - t0
    sched.stop()
    assert (elapsed >= 0.3) == waits, elapsed


def test_budget_never_exceeds_what_the_engine_takes_in_one_forward():
    """--max-batch-tokens above the engine's batch size (llama.cpp n_batch) used to fail every large batch."""
    eng = ScriptedEngine(succ)
    eng.max_batch_tokens = 5
    sched = Scheduler(eng, max_batch_tokens=1024, window_ms=50)
    assert sched.max_batch_tokens == 5
    ss = sessions(eng, 3)
    futures = submit_together(sched, [(s, 2, DraftTree.chain([3 + 10 * i, 4 + 10 * i])) for i, s in enumerate(ss)])
    assert all(f.result(timeout=5).committed_len == 5 for f in futures)
    sched.stop()
    assert eng.batches == [1, 1, 1]


def test_one_thread_at_a_time_owns_an_engine():
    """cloud/engines/ownership.py: a thread that owns the engine keeps every other thread's calls out (they raise,
    naming both threads); ``owned`` waits its turn instead; the scheduler owns its engine for each step."""
    import time

    from tandem.cloud.engines.ownership import EngineBusy, Ownership
    own = Ownership("test engine")
    inside, release = threading.Event(), threading.Event()

    def hold():
        with own.owned(), own.owned():  # reentrant
            inside.set()
            release.wait()

    holder = threading.Thread(target=hold, name="holder")
    holder.start()
    inside.wait()
    with pytest.raises(EngineBusy, match="'MainThread' while thread 'holder' owns it"):
        own.check()
    waited = []
    threading.Timer(0.2, release.set).start()
    t0 = time.monotonic()
    with own.owned():
        waited.append(time.monotonic() - t0)
        own.check()  # the owner may call
    holder.join()
    assert waited[0] >= 0.15
    own.check()  # nobody owns it: any thread may make a single call

    class Owned(ScriptedEngine):
        def __init__(self, nxt):
            super().__init__(nxt)
            self.ownership = Ownership("scripted")
            self.owned = self.ownership.owned
            self.checked_by: list[str] = []

        def forward_batch(self, jobs):
            self.ownership.check()
            with self.ownership.owned():  # inside a step the loop thread owns it: this nests
                self.checked_by.append(threading.current_thread().name)
            return super().forward_batch(jobs)

    eng = Owned(succ)
    sched = Scheduler(eng)
    try:
        (s,) = sessions(eng, 1)
        sched.verify(s, DraftRequest(2, DraftTree.chain([3]), 1)).result(5)
        assert eng.checked_by == ["engine-loop"]
    finally:
        sched.stop()


# --- prompts inside the verify forwards (chunked prefill) -------------------------------------------------------------
class Mixed(ScriptedEngine):
    """Records each forward: (verify tokens, [(sequence, prompt tokens)...]) in order."""
    n_ctx = 4096

    def __init__(self, nxt):
        super().__init__(nxt)
        self.forwards: list[tuple[int, list[tuple[int, int]]]] = []

    def forward_batch(self, jobs):
        self.forwards.append((sum(j.n_tokens for j in jobs), []))
        return super().forward_batch(jobs)

    def forward_mixed(self, jobs, chunks):
        self.forwards.append((sum(j.n_tokens for j in jobs), [(id(c.seq), len(c.tokens)) for c in chunks]))
        return RuleEngine.forward_batch(self, jobs) if jobs else []


def start(engine, prompt):
    from tandem.cloud.session import start_session
    return lambda: start_session(engine, prompt, Sampling(), Limits(20, 8, 4), Limits(0, 16, 8))


def test_prompts_fill_the_room_verify_work_leaves_in_arrival_order():
    """Two decoding sessions draft while two long prompts arrive: every forward holds both drafts first, then the
    prompts' chunks in arrival order (the first whole before the second begins), split to the room left; a session
    opens after the forward of its last chunk, and nothing is computed twice or left out."""
    eng = Mixed(succ)
    sched = Scheduler(eng, max_batch_tokens=64, window_ms=50)
    decoding = sessions(eng, 2)
    gate = threading.Event()
    sched.call(gate.wait)
    first, second = [40] * 91, [41] * 51  # 90 and 50 tokens to compute (the last token is the first tree's root)
    opens = [sched.open(start(eng, first)), sched.open(start(eng, second))]
    drafts = [sched.verify(s, DraftRequest(2, DraftTree.chain([3 + 10 * i, 4 + 10 * i]), 1))
              for i, s in enumerate(decoding)]
    gate.set()
    assert all(f.result(timeout=5).committed_len == 5 for f in drafts)
    a, b = (f.result(timeout=5) for f in opens)
    sched.stop()
    assert (a.committed_len, b.committed_len) == (91, 51)
    verify, chunks = eng.forwards[0]
    assert verify == 6 and [n for _, n in chunks] == [58]  # both drafts, then the room left: 64 - 6
    rest = [n for _, cs in eng.forwards[1:] for _, n in cs]
    assert rest == [32, 32, 18]  # a's last 32, then b's first 32 in the same forward, then b's 18
    assert [len(cs) for _, cs in eng.forwards[1:]] == [2, 1]
    assert sched.stats.prefill_tokens == 140 and sched.stats.prefill_forwards == 3


def test_a_prompt_alone_takes_whole_forwards_and_waits_for_no_window():
    import time
    eng = Mixed(succ)
    sched = Scheduler(eng, max_batch_tokens=64, window_ms=500)
    t0 = time.perf_counter()
    session = sched.open(start(eng, [7] * 151)).result(timeout=5)
    took = time.perf_counter() - t0
    sched.stop()
    assert [n for _, cs in eng.forwards for _, n in cs] == [64, 64, 22] and session.committed_len == 151
    assert took < 0.5  # (a draft would have waited the 500 ms window for more drafts)


def test_a_failed_forward_fails_the_prompts_in_it_and_frees_their_sequences():
    class Failing(Mixed):
        def forward_mixed(self, jobs, chunks):
            raise RuntimeError("engine fault")

    eng = Failing(succ)
    sched = Scheduler(eng, max_batch_tokens=64, window_ms=1)
    with pytest.raises(RuntimeError, match="engine fault"):
        sched.open(start(eng, [7] * 20)).result(timeout=5)
    released = eng.released
    assert released == 1 and not sched.busy()
    eng.forward_mixed = Mixed.forward_mixed.__get__(eng)  # the engine recovers: the loop serves the next open
    assert sched.open(start(eng, [7] * 20)).result(timeout=5).committed_len == 20
    sched.stop()


def test_serial_prefill_still_computes_each_prompt_whole_between_batches():
    from tandem.cloud.session import start_session
    eng = Mixed(succ)
    sched = Scheduler(eng, max_batch_tokens=64, window_ms=1, mixed_prefill=False)
    assert not sched.mixed_prefill
    s = sched.open(lambda: start_session(eng, [7] * 100, Sampling(), Limits(20, 8, 4), Limits(0, 16, 8),
                                         chunked=False)).result(timeout=5)
    sched.stop()
    assert s.committed_len == 100 and eng.forwards == []  # (the scripted engine's prefill takes it at once)
