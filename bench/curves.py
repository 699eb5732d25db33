"""Where the benches find verifier cost curves: a file path, or a name in ``deploy/cost-curves/``; and which drafter
curves go with a target's (server-side speculation prices its drafter on the same GPU)."""
from __future__ import annotations

import json
from pathlib import Path

CURVE_DIR = Path(__file__).resolve().parent.parent / "deploy" / "cost-curves"
DEFAULT_DRAFTER = "h200-roofline-qwen2.5-0.5b.json"  # the 0.5B drafter on an H200, tuned engine (derived)
DEFAULT_EAGLE = "derived-h200-eagle3-qwen2.5-7b.json"


def curve_path(name: str | Path) -> Path:
    p = Path(name)
    return p if p.exists() else CURVE_DIR / p


def drafters_for(target: str | Path, drafter: str = "auto", eagle: str = "auto") -> tuple[str, str, str]:
    """(server_sd's drafter curve, server_eagle's head curve, a note saying where each came from): the ones named
    on the command line, else the ones the target's curve file names (``drafter_curve``, ``eagle_curve``), else the
    H200 defaults (said so)."""
    try:
        d = json.loads(curve_path(target).read_text())
    except (OSError, ValueError):
        d = {}
    notes, out = [], []
    for arg, key, default in ((drafter, "drafter_curve", DEFAULT_DRAFTER), (eagle, "eagle_curve", DEFAULT_EAGLE)):
        if arg and arg != "auto":
            out.append(arg)
            notes.append(f"{key}: {Path(arg).name}, as asked")
        elif d.get(key):
            out.append(str(d[key]))
            notes.append(f"{key}: {d[key]}, named by the target's curve")
        else:
            out.append(default)
            notes.append(f"{key}: {default} (the target's curve names none: an H200 default)")
    return out[0], out[1], "; ".join(notes)
