"""Drafting on the verifier's host (cloud.host_drafting, orchestrator.host_drafters): the depth rule, the wire fields,
the host's drafters kept apart by cache partition, and whole generations over real gRPC on a tiny random-weight
stack whose tokens are the target's own, greedy and sampled; a verdict that misreports the host's tokens is caught by
the edge."""
from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")

from tandem.cloud.backend import LocalBackend  # noqa: E402
from tandem.cloud.host_drafting import HostDrafting, HostSeats, HostSession, next_depth  # noqa: E402
from tandem.cloud.server import serve  # noqa: E402
from tandem.cloud.engines.torch_engine import TorchVerifierEngine  # noqa: E402
from tandem.core import wire  # noqa: E402
from tandem.core.messages import DraftRequest, Limits, OpenRequest, Opened, Verdict  # noqa: E402
from tandem.core.sampling import Sampling  # noqa: E402
from tandem.core.tree import DraftTree, TreeShape  # noqa: E402
from tandem.edge.client import EdgeClient  # noqa: E402
from tandem.edge.planner import FixedPlanner  # noqa: E402
from tandem.edge.rounds import ProtocolError  # noqa: E402
from tandem.orchestrator.host_drafters import HostDrafters  # noqa: E402

from tinystack import TinyDrafter, tiny_model  # noqa: E402

PROMPT = [1, 2, 3, 4, 1, 2, 3]


@pytest.mark.parametrize("depth, drafted, accepted, cap, expected", [
    (4, 4, 4, 8, 5),  # all taken: one deeper
    (8, 8, 8, 8, 8),  # ... not past the cap
    (4, 4, 2, 8, 4),  # half: the same
    (4, 4, 1, 8, 3),  # under half: one shallower
    (1, 1, 0, 8, 1),  # ... not under 1
    (4, 2, 0, 8, 4),  # a chain cut short (the drafter's context) says nothing of depth
    (6, 6, 6, 4, 4),  # a cap lowered under the depth holds
])
def test_next_depth(depth, drafted, accepted, cap, expected):
    assert next_depth(depth, drafted, accepted, cap) == expected


def test_host_fields_cross_the_wire():
    o = OpenRequest((1, 2), host_draft=True)
    assert wire.open_from_wire(wire.open_to_wire(o).open).host_draft
    d = DraftRequest(5, host_draft=True)
    assert wire.draft_from_wire(wire.draft_to_wire("s", d).draft).host_draft
    v = Verdict((), 9, 12, host_tokens=(7, 8), host_drafted=4, host_level_us=1500)
    back = wire.verdict_from_wire(wire.verdict_to_wire(v).verdict)
    assert (back.host_tokens, back.host_drafted, back.host_level_us) == ((7, 8), 4, 1500)
    assert back.tokens(DraftTree()) == [7, 8, 9]
    opened = wire.opened_from_wire(wire.opened_to_wire(Opened("s", Limits(), 0, host_drafter="d@1",
                                                              host_level_us=900)).opened)
    assert (opened.host_drafter, opened.host_level_us) == ("d@1", 900)


class RecordingDrafter(TinyDrafter):
    def __init__(self, model):
        super().__init__(model)
        self.starts: list[tuple[int, ...]] = []

    def start(self, prompt):
        self.starts.append(tuple(prompt))
        super().start(prompt)


def test_a_drafter_forgets_another_partitions_cells_before_drafting():
    d = RecordingDrafter(tiny_model())
    host = HostDrafters([d], "tiny")
    host.draft("A", PROMPT, 2)  # a drafter fresh from its warm-up forgets that too
    assert d.starts == [(), tuple(PROMPT)]
    host.draft("A", PROMPT + [5], 2)  # the same partition: its cells stay
    assert d.starts[2:] == [tuple(PROMPT + [5])]
    host.draft("B", PROMPT, 2)  # another: everything forgotten first
    assert d.starts[-2:] == [(), tuple(PROMPT)]
    host.draft("A", PROMPT, 2)
    assert d.starts[-2:] == [(), tuple(PROMPT)]


def test_a_chain_goes_to_the_drafter_holding_most_of_its_partitions_history():
    a, b = RecordingDrafter(tiny_model()), RecordingDrafter(tiny_model())
    host = HostDrafters([a, b], "tiny")
    host.draft("A", PROMPT, 2)  # a (free the longest)
    host.draft("B", [9, 9, 9], 2)  # b
    host.draft("A", PROMPT + [4], 2)
    assert len(a.starts) == 3 and a.starts[-1] == tuple(PROMPT + [4])  # back to a, no forgetting
    host.draft("C", [5], 2)  # neither holds C: the one free the longest (b), which forgets B's cells
    assert b.starts[-2:] == [(), (5,)]


def test_a_session_that_loses_track_of_its_tokens_decodes_alone():
    s = HostSession(HostDrafting(HostDrafters([TinyDrafter(tiny_model())], "tiny")), "", [1, 2], 8)
    s.follow(DraftTree.chain([3, 4]), Verdict((0,), 5, 4))  # 3 accepted, bonus 5: [1, 2, 3, 5]
    assert s.ok and s.tokens == [1, 2, 3, 5]
    s.follow(DraftTree(), Verdict((), 6, 6))  # says 6 committed where 5 are known
    assert not s.ok


@pytest.fixture(scope="module")
def stack():
    model = tiny_model()
    backend = LocalBackend(TorchVerifierEngine(model=model, n_ctx=96, device="cpu", max_sessions=4), max_sessions=4)
    host = HostDrafting(HostDrafters([TinyDrafter(model), TinyDrafter(model)], "tiny"))
    srv, port = serve(backend=backend, address="127.0.0.1:0", host=host)
    yield f"127.0.0.1:{port}", model
    srv.stop(None)
    backend.scheduler.stop()
    host.close()


def _generate(address, model, host: bool, sampling=Sampling(), n=40, prompt=PROMPT):
    client = EdgeClient(TinyDrafter(model), address, None, tls_ca="none")
    g = client.generate(prompt, n, sampling, planner=FixedPlanner(None, host=host))
    list(g)
    return g


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=0.8, seed=7)], ids=["greedy", "sampled"])
def test_host_drafted_generations_are_the_targets_own(stack, sampling):
    address, model = stack
    for prompt in (PROMPT, [5, 6, 7, 8, 9], [2, 2, 2]):
        plain = _generate(address, model, host=False, sampling=sampling, prompt=prompt)
        hosted = _generate(address, model, host=True, sampling=sampling, prompt=prompt)
        assert hosted.tokens == plain.tokens
        assert plain.stats.host_tokens == 0
    assert hosted.stats.host_tokens > 0  # the host drafted, and the target took some of it
    assert hosted.stats.rounds < plain.stats.rounds  # in fewer forwards


def test_a_verdict_misreporting_the_hosts_tokens_is_caught(stack, monkeypatch):
    address, model = stack
    real = HostSession.settle

    def wrong(self, chain, v):  # the accepted tokens reported one off
        out = real(self, chain, v)
        return replace(out, host_tokens=tuple((t + 1) % 12 for t in out.host_tokens))

    monkeypatch.setattr(HostSession, "settle", wrong)
    with pytest.raises(ProtocolError):
        _generate(address, model, host=True)


def test_a_host_drafter_that_cannot_draft_the_targets_ids_is_refused_at_start(drafter_path):
    from tandem.orchestrator import cli
    from tandem.orchestrator.compose import build_backend, build_host_drafting
    from tandem.orchestrator.serve_config import ServeConfig
    from tandem.orchestrator.settings import ConfigError
    cfg = ServeConfig.load(cli.parser().parse_args(["serve", "--engine", "scripted", "--host-drafters", "1",
                                                    "--drafter", str(drafter_path), "--drafter-engine", "llama.cpp",
                                                    "--no-gateway"]))
    backend = build_backend(cfg)  # the scripted target: 256 ids of its own
    try:
        with pytest.raises(ConfigError, match="--host-drafters: .* cannot draft the target's ids"):
            build_host_drafting(cfg, backend)
    finally:
        backend.scheduler.stop()


class Flip(FixedPlanner):
    """Hands the run to the host for ``every`` verdicts, then drafts chains of 3 on the device for as many, and so
    on: a policy switching modes within a session, as often as it can."""

    def __init__(self, every: int):
        super().__init__(None)
        self.n, self.every, self.drafts = 0, every, True

    @property
    def host(self):
        return (self.n // self.every) % 2 == 0

    @host.setter
    def host(self, value):  # (FixedPlanner's own, ignored)
        pass

    def shape(self, pending):
        return None if self.host else TreeShape(1, 3, 3)

    peek = shape

    def observe(self, r):
        self.n += 1


@pytest.mark.parametrize("every", [1, 2, 3])
def test_switching_between_host_and_device_drafting_within_a_session_keeps_the_targets_tokens(stack, every):
    """Device trees and host runs interleaved: each switch is a draft sent while the verifier decodes (an empty one
    hands the run to the host, late by the tokens decoded meanwhile); the output is cloud-only decoding's."""
    address, model = stack
    for prompt in (PROMPT, [5, 6, 7, 8], [2, 2, 2, 2]):
        plain = _generate(address, model, host=False, prompt=prompt, n=60)
        client = EdgeClient(TinyDrafter(model), address, None, tls_ca="none")
        mixed = client.generate(prompt, 60, planner=Flip(every)).result()
        assert mixed.tokens == plain.tokens
        assert mixed.stats.host_tokens > 0 and mixed.stats.trees > 0


def test_a_session_starts_at_the_depth_its_partitions_last_one_reached():
    host = HostDrafting(HostDrafters([TinyDrafter(tiny_model())], "tiny"))
    first = HostSession(host, "A", [1, 2], 16)
    assert first.depth == 4
    for _ in range(3):  # the target took every chain whole: 5, 6, 7
        first.settle(DraftTree.chain([1, 2, 3, 4, 5, 6, 7][: first.depth]), Verdict(tuple(range(first.depth)), 9, 0))
    assert first.depth == 7
    assert HostSession(host, "A", [1, 2], 16).depth == 7  # the partition's next session goes on from there
    assert HostSession(host, "B", [1, 2], 16).depth == 4  # another partition's does not
    assert HostSession(host, "A", [1, 2], 5).depth == 5  # within the session's own granted depth


def test_a_step_that_finds_every_host_drafter_busy_is_decoded_alone_and_the_pace_says_so():
    """The verifier never waits for its host: with one drafter drafting, a second session's step gets no chain at
    once (its step is a token decoded alone), and the published pace is the level's time over the share served."""
    import asyncio
    import time as clock

    class Slow:
        name, slots = "slow", 1

        def draft(self, partition, tokens, depth):
            clock.sleep(0.2)
            return [1] * depth

    async def two_at_once():
        host = HostDrafting(Slow())
        t0 = clock.perf_counter()
        first, second = await asyncio.gather(host.chain("A", [1], 4), host.chain("B", [1], 4))
        paced = host.level_us
        host.close()
        return first, second, paced, clock.perf_counter() - t0

    first, second, paced, took = asyncio.run(two_at_once())
    assert len(first) == 4 and len(second) == 0 and took < 0.35  # the second did not wait for the first
    assert paced > 0.2e6 / 4 / 0.85  # 50 ms a level, over the 80 % of steps served (EWMA 0.2): > 59 ms


def test_seats_one_a_drafter_held_until_given_up():
    seats = HostSeats(2)
    assert seats.take("a") and seats.take("a") and seats.take("b")  # (taking one's own seat again holds it)
    assert not seats.free and not seats.take("c")
    seats.release("a")
    assert seats.take("c") and not seats.take("a")
    seats.release("nobody")  # (a session without a seat gives nothing up)
    assert seats.held == {"b", "c"}


def test_a_session_without_a_seat_is_decoded_alone_and_told_the_host_serves_it_nothing():
    """One drafter, one seat: the session holding it (it asked at its open: the host caught up on its prompt
    meanwhile) gets chains at the drafter's pace; another asking meanwhile gets no chain and a pace of none of its
    steps served (its policy leaves the host), and is not even offered the host when it opens while the seat is
    taken; once the first stands up, the second sits."""
    import asyncio

    host = HostDrafting(HostDrafters([TinyDrafter(tiny_model())], "tiny"))
    opened = Opened("a", Limits(64, 8, 8), 0)

    async def steps():
        a = HostSession.before_open(host, "A", [1, 2, 3], wants=True)
        b = HostSession.before_open(host, "B", [1, 2, 3])
        offered_a, offered_b = a.opened(opened), b.opened(replace(opened, session_id="b"))
        assert a.seated and offered_a.host_drafter == "tiny" and not b.seated and offered_b.host_drafter == ""
        await a._warm  # (the prompt's catch-up)
        return a, b, await a.chain(), await b.chain()

    a, b, chain_a, chain_b = asyncio.run(steps())
    assert len(chain_a) > 0 and len(chain_b) == 0 and not b.seated
    v = Verdict((), 7, 4)
    seated, unseated = a.settle(chain_a, v).host_level_us, b.settle(chain_b, v).host_level_us
    assert seated == host.level_us < host.pace.unseated_us == unseated
    a.stand()
    assert len(asyncio.run(b.chain())) > 0 and b.seated
    host.close()


def test_over_grpc_one_seat_serves_one_session_at_a_time_and_frees_when_it_ends():
    """A host of one drafter (slowed so that two generations overlap): of two sessions asking at once, one is
    drafted by the host (which caught up on its prompt while the target prefilled it) and the other decoded alone,
    both the target's own tokens; a session after them gets the seat the first gave up when it ended."""
    import time as clock
    from concurrent.futures import ThreadPoolExecutor

    calls = []

    class Slowed(HostDrafters):
        def draft(self, partition, tokens, depth):
            calls.append((tuple(tokens), depth))
            clock.sleep(0.05)
            return super().draft(partition, tokens, depth)

    model = tiny_model()
    backend = LocalBackend(TorchVerifierEngine(model=model, n_ctx=96, device="cpu", max_sessions=4), max_sessions=4)
    host = HostDrafting(Slowed([TinyDrafter(model)], "tiny"))
    srv, port = serve(backend=backend, address="127.0.0.1:0", host=host)
    address = f"127.0.0.1:{port}"
    try:
        plain = [_generate(address, model, host=False, prompt=p).tokens for p in (PROMPT, [5, 6, 7, 8, 9])]
        with ThreadPoolExecutor(2) as pool:
            both = list(pool.map(lambda p: _generate(address, model, host=True, prompt=p), (PROMPT, [5, 6, 7, 8, 9])))
        assert [g.tokens for g in both] == plain
        assert sorted(g.stats.host_tokens > 0 for g in both) == [False, True]
        assert calls[0][0] in (tuple(PROMPT), (5, 6, 7, 8, 9)) and calls[0][1] == 0  # the prompt caught up at open
        assert all(depth > 0 for _, depth in calls[1:])
        deadline = clock.monotonic() + 5  # (the servicer ends a stream after its client has seen the last verdict)
        while host.seats.held and clock.monotonic() < deadline:
            clock.sleep(0.01)
        assert not host.seats.held  # both ended: the seat is free again ...
        assert _generate(address, model, host=True, prompt=[2, 2, 2]).stats.host_tokens > 0  # ... and taken
    finally:
        srv.stop(None)
        backend.scheduler.stop()
        host.close()
