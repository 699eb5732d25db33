"""What the simulated world is made of, each from a file or a cited figure: the verifier's forward cost, the
devices' drafters, the links.

A forward's time is the cost curve's at its tokens (``cloud.engines.pacing.CostCurve``) plus the time to read every
batched session's context once (``kv_bytes_per_token`` x context / ``hbm_gb_s``) plus, where the file gives it, the
attention's compute (``attn_ms_per_token_ctx`` x query tokens x the context each attends over). The KV term is what
a speculative round saves (one read of the context for several tokens) and what makes a big batch of long
conversations slower than its token count says. A file with ``floor_ms`` holds the GPU's own time in its points and
a host-side floor (kernel launches) under which GPU work hides: the forward takes max(floor, points + KV +
attention). ``kv_gb`` is the memory left for KV: a replica holds at most ``kv_gb / (kv_bytes_per_token x tokens per
session)`` sessions and the others wait for one to end. ``tp``: GPUs one replica spans (tensor parallelism; the
points then include its all-reduces), so clients per GPU are clients per replica / tp.

Every curve must carry ``kv_bytes_per_token``, ``hbm_gb_s`` and ``kv_gb``: without them a simulator silently drops
the KV reads and the memory cap, and every figure past the memory's limit is physically impossible.
``Forward.load`` refuses such a file and says what to add.

Past a curve's last point: a measured curve's points are all it knows, so a forward past them is refused
(``BeyondCurve``; the run says so) unless the caller asks to extrapolate; a derived curve's points are samples of
its formula, whose last slope is the formula's own, so it is extrapolated by that slope (and counted).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from tandem.cloud.engines.pacing import CostCurve

from ..curves import curve_path
from ..linkproxy import LinkProfile
from ..network import PROFILES

KV_FIELDS = ("kv_bytes_per_token", "hbm_gb_s", "kv_gb")


class CurveError(ValueError):
    """A cost curve file the simulator cannot use; the message says what it lacks."""


class BeyondCurve(RuntimeError):
    """A forward past the last point of a curve that refuses to extrapolate."""


@dataclass(frozen=True)
class Forward:
    """A replica's forward time: ``ms(tokens, context_tokens, attn_pairs)``."""
    curve: CostCurve
    kv_ms_per_token: float = 0.0  # ms to read one context token's KV once
    kv_tokens: int = 0  # KV tokens a replica holds (0: unbounded)
    floor_ms: float = 0.0  # no forward is faster (host-bound launches)
    attn_ms_per_token_ctx: float = 0.0  # attention compute per (query token x context token it attends over)
    tp: int = 1  # GPUs per replica
    past_end: str = "extrapolate"  # past the last point: "extrapolate" (the last slope) or "refuse"
    context_in_points: int = 0  # context tokens whose KV read the points already hold (measured curves)
    label: str = "measured"

    @classmethod
    def load(cls, path: str | Path, scale: float = 1.0, past_end: str | None = None) -> "Forward":
        """``scale`` multiplies every time, as ``cloud.engines.pacing.PacedEngine``'s ``--cost-scale`` does;
        ``past_end`` overrides the file's rule for forwards past its last point (default: refuse on a measured
        curve)."""
        p = curve_path(str(path))
        try:
            d = json.loads(p.read_text())
        except (OSError, ValueError) as e:
            raise CurveError(f"{p}: not a readable cost curve ({e})") from None
        missing = [k for k in KV_FIELDS if not _positive(d.get(k))]
        if missing:
            raise CurveError(
                f"{p.name}: the cost curve lacks {', '.join(missing)}; bench.capacity refuses it, since without them "
                "it would drop every KV read and the KV memory cap. Add, from the model's published architecture "
                "and the GPU's datasheet: kv_bytes_per_token = 2 x layers x kv_heads x head_dim x bytes per element, "
                "hbm_gb_s = the memory bandwidth (GB/s), kv_gb = the memory left for KV (GB), and say 'derived' in "
                "the file (deploy/cost-curves/derive.py writes such curves)")
        kv = float(d["kv_bytes_per_token"])
        kv_ms = kv / (float(d["hbm_gb_s"]) * 1e9) * 1000
        kv_tokens = int(float(d["kv_gb"]) * 1e9 / kv)
        c = CostCurve.load(p)
        curve = c if scale == 1.0 else replace(c, ms=tuple(scale * m for m in c.ms))
        label = d.get("label", "measured")
        rule = past_end or d.get("past_end") or ("refuse" if label == "measured" else "extrapolate")
        if rule not in ("extrapolate", "refuse"):
            raise CurveError(f"{p.name}: past_end must be 'extrapolate' or 'refuse', got {rule!r}")
        return cls(curve, scale * kv_ms, kv_tokens, scale * float(d.get("floor_ms", 0.0)),
                   scale * float(d.get("attn_ms_per_token_ctx", 0.0)), int(d.get("tp", 1)), rule,
                   int(d.get("context_tokens", 0)) if label == "measured" else 0, label)

    def ms(self, tokens: int, context_tokens: int = 0, attn_pairs: int = 0) -> float:
        """A forward of ``tokens`` whose sessions hold ``context_tokens`` of KV between them, its queries attending
        over ``attn_pairs`` (query, key) pairs in all."""
        if self.past_end == "refuse" and tokens > self.curve.tokens[-1]:
            raise BeyondCurve(f"a forward of {tokens} tokens on {self.curve.name}, whose measured points end at "
                              f"{self.curve.tokens[-1]}: refused, not extrapolated")
        kv = self.kv_ms_per_token * max(0, context_tokens - self.context_in_points)
        return max(self.floor_ms, self.curve(tokens) + kv + self.attn_ms_per_token_ctx * attn_pairs)

    def allows(self, tokens: int) -> bool:
        return self.past_end != "refuse" or tokens <= self.curve.tokens[-1]

    def beyond(self, tokens: int) -> bool:
        """Whether a forward of ``tokens`` lies past the curve's last point (an extrapolation)."""
        return tokens > self.curve.tokens[-1]

    def max_sessions(self, tokens_per_session: int) -> int:
        return max(1, self.kv_tokens // max(1, tokens_per_session)) if self.kv_tokens else 1 << 30


def _positive(x) -> bool:
    try:
        return float(x) > 0
    except (TypeError, ValueError):
        return False


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
BROWSER = Device("browser-tab", 44.0, 13.0, "measured",
                 "the 0.5B drafter's dynamic-int8 ONNX export on onnxruntime-web's WASM build, two threads, on this "
                 "project's 2-core AMD EPYC VM: 44 ms a token in Node alone, its prompt 0.8-2.1 s for 46-162 tokens "
                 "in headless Chromium (~13 ms a token; bench/results/2026-12-06/browser/NOTES.md)")


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
