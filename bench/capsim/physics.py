"""What the simulated world is made of, each from a file or a cited figure: the verifier's forward cost, the
devices' drafters, the links.

A forward's time is the cost curve's at its tokens (``cloud.pacing.CostCurve``) plus, where the curve file gives
the model's KV size, the time to read every batched session's context once: ``kv_bytes_per_token`` x context /
``hbm_gb_s``. That term is what a speculative round saves (one read of the context for several tokens) and what
makes a big batch of long conversations slower than its token count says. A file with ``floor_ms`` holds the
GPU's own time in its points and a host-side floor (kernel launches) under which GPU work hides: the forward
takes max(floor, points + KV). A curve file may also give the memory left for KV (``kv_gb``): a replica then
holds at most ``kv_gb / (kv_bytes_per_token x tokens per session)`` sessions and the others wait for one to end.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from tandem.cloud.pacing import CostCurve

from ..curves import curve_path
from ..linkproxy import LinkProfile
from ..network import PROFILES


@dataclass(frozen=True)
class Forward:
    """A replica's forward time: ``ms(tokens, context_tokens)``."""
    curve: CostCurve
    kv_ms_per_token: float = 0.0  # ms to read one context token's KV once
    kv_tokens: int = 0  # KV tokens a replica holds (0: unbounded)
    floor_ms: float = 0.0  # no forward is faster (host-bound launches)

    @classmethod
    def load(cls, path: str | Path, scale: float = 1.0) -> "Forward":
        """``scale`` multiplies every time, as ``cloud.pacing.PacedEngine``'s ``--cost-scale`` does."""
        p = curve_path(str(path))
        d = json.loads(p.read_text())
        kv = float(d.get("kv_bytes_per_token", 0))
        kv_ms = kv / (float(d["hbm_gb_s"]) * 1e9) * 1000 if kv and d.get("hbm_gb_s") else 0.0
        kv_tokens = int(float(d["kv_gb"]) * 1e9 / kv) if kv and d.get("kv_gb") else 0
        c = CostCurve.load(p)
        curve = c if scale == 1.0 else replace(c, ms=tuple(scale * m for m in c.ms))
        return cls(curve, scale * kv_ms, kv_tokens, scale * float(d.get("floor_ms", 0.0)))

    def ms(self, tokens: int, context_tokens: int = 0) -> float:
        return max(self.floor_ms, self.curve(tokens) + self.kv_ms_per_token * context_tokens)

    def beyond(self, tokens: int) -> bool:
        """Whether a forward of ``tokens`` lies past the curve's last point (an extrapolation)."""
        return tokens > self.curve.tokens[-1]

    def max_sessions(self, tokens_per_session: int) -> int:
        return max(1, self.kv_tokens // tokens_per_session) if self.kv_tokens else 1 << 30


@dataclass(frozen=True)
class Device:
    """A device class's drafter: ms per drafted level (one node of a chain), and per committed token it catches
    up on (a prefill-speed token)."""
    name: str
    level_ms: float
    catch_up_ms: float
    label: str  # "measured" (this machine) or "derived" (from the cited figures)
    source: str = ""


# Published llama.cpp figures, scaled to the 0.5B drafter by parameter count (decode is memory-bound, prefill
# compute-bound: both scale about with the weights). Derived, not measured.
LAPTOP = Device("laptop", 6.0, 0.3, "derived",
                "Apple Mac mini M4, llama.cpp, Qwen3.5-0.8B Q4_K_M: 103 tokens/s generation, 2085 tokens/s prompt "
                "processing (jitesh.dev, 2026), scaled 0.8B -> 0.5B: ~6 ms a level, ~0.3 ms a caught-up token")
PHONE = Device("phone", 15.0, 2.7, "derived",
               "MediaTek Dimensity 9000+ CPU, llama.cpp, Gemma-4-E2B Q4: 15-18 tokens/s generation, 81-104 tokens/s "
               "prompt processing (pt13762104.github.io, 2026), scaled by parameters (x4) to the 0.5B drafter: "
               "~15 ms a level, ~2.7 ms a caught-up token")


def device_from_ceiling(path: str | Path, name: str = "this-cpu") -> Device:
    """This machine's drafter, measured by ``bench.ceiling`` (``draft_ms[k]``: a k-level chain after one caught-up
    token): the per-level slope, and the rest as the catch-up."""
    d = json.loads(Path(path).read_text())
    ms = d["draft_ms"]
    k = len(ms) - 1
    level = (ms[k] - ms[1]) / (k - 1)
    return Device(name, round(level, 2), round(max(0.0, ms[1] - level), 2), "measured",
                  f"bench.ceiling on {d.get('cpu', 'this machine')}, llama.cpp drafter, 1 thread")


# bench.network's profiles (the ones a paced real run has), and cellular ones from published median round trips
# (4G ~70 ms with a wide spread, 5G non-standalone ~30 ms): derived.
LINKS: dict[str, LinkProfile] = {
    **{k: v for k, v in PROFILES.items() if k != "local"},
    "4g": LinkProfile(one_way_ms=35.0, jitter_ms=15.0, loss=0.005, rate_mbit=20),
    "5g": LinkProfile(one_way_ms=15.0, jitter_ms=5.0, loss=0.002, rate_mbit=100),
}
