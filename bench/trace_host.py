"""The verifier's host drafter replayed from acceptance traces, in the verifier's own process.

    python -m bench.trace_host --host-class laptop --cost-scale K --dataset humaneval -- serve <its flags>

Runs ``tandem serve`` (the product's composition, servicer and scheduler) with ``compose.build_host_drafting``
replaced by a ``TraceHost``: a ``cloud.host_drafting.HostDrafter`` that drafts the scripted target's tokens as often
as the traces say the drafter's first choices hold, on a device class's clock x K (catch-up per new committed token,
then a level per drafted token), as ``bench.scale.TraceDrafter`` does on a device. The host's drafter is the devices'
model, so each request draws a text of the same dataset, as each device draws its own. Used by ``bench.devices``.
"""
from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from pathlib import Path
from typing import Sequence

from tandem.core.tree import TreeShape

from .capacity import DEFAULT_TRACES
from .capsim import trees
from .capsim.physics import Device
from .capsim.regimes import DEVICES
from .capsim.traces import Traces


class TraceHost:
    name = "trace-host"

    def __init__(self, traces: Traces, dataset: str, device: Device, scale: float, slots: int, answer_tokens: int,
                 miss: int, seed: int = 0):
        self.traces, self.dataset, self.device, self.scale = traces, dataset, device, scale
        self.slots, self.answer_tokens, self.miss = slots, answer_tokens, miss
        self.agree = traces.acceptance(dataset)
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._state: dict[str, tuple[int, int, trees.Ranks]] = {}  # partition -> (prompt length, evaluated, ranks)

    def draft(self, partition: str, tokens: Sequence[int], depth: int) -> list[int]:
        # the scripted target's answer counts up from 1 after a prompt of zeros: output position p is token p + 1
        n_out = tokens[-1] if tokens and tokens[-1] > 0 else 0
        prompt_len = len(tokens) - n_out
        with self._lock:
            known, evaluated, ranks = self._state.get(partition, (-1, 0, None))
            if ranks is None or known != prompt_len or evaluated > len(tokens):  # another request
                text = self.traces.request(self.dataset, self.answer_tokens, self._rng)
                ranks, evaluated = trees.Ranks(text.runs, random.Random(self._rng.random())), 0
            self._state[partition] = (prompt_len, len(tokens), ranks)
        time.sleep((len(tokens) - evaluated) * self.device.catch_up_ms * self.scale / 1000)
        if depth < 1:  # a prompt caught up beside its prefill (HostDrafter: depth 0)
            return []
        built = trees.build(TreeShape(1, depth, depth), n_out, ranks, self.agree)
        chain = [t + 1 if t < trees.MISS else self.miss + i for i, t in enumerate(built.tree.tokens)]
        time.sleep(len(chain) * self.device.level_ms * self.scale / 1000)
        return chain


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host-class", default="laptop", choices=sorted(DEVICES))
    ap.add_argument("--cost-scale", type=float, default=1.0)
    ap.add_argument("--dataset", default="humaneval")
    ap.add_argument("--traces", type=Path, default=DEFAULT_TRACES)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--answer-tokens", type=int, default=96)
    ap.add_argument("--miss", type=int, default=190)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv[:split])

    from tandem.cloud.host_drafting import HostDrafting
    from tandem.orchestrator import cli, compose

    host = TraceHost(Traces.load(args.traces), args.dataset, DEVICES[args.host_class], args.cost_scale, args.slots,
                     args.answer_tokens, args.miss, args.seed)
    compose.build_host_drafting = lambda cfg, backend: HostDrafting(host)  # what --host-drafters would build
    return cli.main(argv[split + 1:])  # ("serve" and its flags)


if __name__ == "__main__":
    sys.exit(main())
