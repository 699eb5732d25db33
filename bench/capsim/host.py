"""The verifier host's drafters on the virtual clock, mirrored from ``cloud/host_drafting.py`` and
``orchestrator/host_drafters.py``: ``slots`` drafters at a device class's pace beside a replica. A chain costs its
session's tokens committed since the host last drafted for it (caught up at the class's prefill pace) and a level per
drafted token; a step that finds every slot busy is decoded alone, and the pace the host publishes is a level's
time over the share of steps it served (as ``HostDrafting.level_us``). Its tokens come from the session's text's
trace, as the device's own drafter's would (the host runs the devices' model). Seats: ``HostSeats``; a session
asking at its open takes one then, and the host catches up on its prompt beside the prefill. Depth:
``cloud.host_drafting.next_depth``, a session starting where its partition's last one ended."""
from __future__ import annotations

from typing import Callable

from tandem.cloud.host_drafting import START_DEPTH, HostPace, HostSeats
from tandem.core.messages import EMPTY
from tandem.core.tree import DraftTree, TreeShape

from . import trees
from .events import Sim
from .physics import Device


class SimHost:
    def __init__(self, sim: Sim, device: Device, slots: int, agree: float, ewma: float = 0.2):
        self.sim, self.device, self.slots, self.agree = sim, device, slots, agree
        self.idle = list(range(slots))  # free drafters, the one free the longest first ...
        self.last: list[str | None] = [None] * slots  # ... and the partition each last drafted for
        self.pace = HostPace(ewma)
        self.seats = HostSeats(slots)
        self.chains = self.skipped = 0
        self.busy_ms = 0.0  # drafter time spent (all slots)
        self.depths: dict[str, int] = {}  # partition -> the depth its last chain left

    @property
    def free(self) -> int:
        return len(self.idle)

    @property
    def level_us(self) -> int:
        return self.pace.level_us

    def offered(self, sid: str) -> bool:
        """Whether a just-opened session is told of the host: it holds a seat or one is free."""
        return sid in self.seats.held or self.seats.free

    def depth_of(self, partition: str) -> int:
        return self.depths.get(partition, START_DEPTH)

    def chain(self, ranks: trees.Ranks, start: int, history: int, known: int, depth: int,
              done: Callable[[DraftTree], None], partition: str = "") -> None:
        """A chain of ``depth`` drafted at output position ``start`` below a session's ``history`` tokens, of which
        a drafter that last drafted for its partition holds the first ``known`` (one last used by another
        partition forgets its cells first: it evaluates them all); ``done`` gets it when drafted, or an empty one
        at once when every slot is busy."""
        self.pace.asked(bool(self.free))
        if not self.free:
            self.skipped += 1
            done(EMPTY)
            return
        slot, same = self._take(partition)
        asked = self.sim.now
        built = trees.build(TreeShape(1, depth, depth), start, ranks, self.agree)
        ms = (history - known if same else history) * self.device.catch_up_ms + len(built.tree) * self.device.level_ms
        self.busy_ms += ms
        self.sim.after(ms / 1000, lambda: self._finish(slot, partition, asked, built.tree, done))

    def warm(self, prompt_tokens: int, cached: int, partition: str, done: Callable[[], None]) -> None:
        """A seated session's prompt caught up beside the target's prefill (``HostSession.before_open``): its
        conversation's ``cached`` first tokens are still on a drafter that last drafted for its partition."""
        self.pace.asked(bool(self.free))
        if not self.free:
            done()  # (a seat is a drafter: one is free; kept for the mirror's sake)
            return
        slot, same = self._take(partition)
        ms = (prompt_tokens - (cached if same else 0)) * self.device.catch_up_ms
        self.busy_ms += ms

        def finish() -> None:
            self._give(slot, partition)
            done()

        self.sim.after(ms / 1000, finish)

    def _take(self, partition: str) -> tuple[int, bool]:
        """The free drafter that last drafted for ``partition``, else the one free the longest; and whether its
        cells are the partition's (``orchestrator/host_drafters.py``)."""
        i = next((i for i, slot in enumerate(self.idle) if self.last[slot] == partition), 0)
        slot = self.idle.pop(i)
        return slot, self.last[slot] == partition

    def _give(self, slot: int, partition: str) -> None:
        self.last[slot] = partition
        self.idle.append(slot)

    def _finish(self, slot: int, partition: str, asked: float, chain: DraftTree,
                done: Callable[[DraftTree], None]) -> None:
        self._give(slot, partition)
        self.chains += 1
        self.pace.drafted((self.sim.now - asked) * 1e6, len(chain))
        done(chain)
