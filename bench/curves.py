"""Where the benches find verifier cost curves: a file path, or a name in ``deploy/cost-curves/``."""
from __future__ import annotations

from pathlib import Path

CURVE_DIR = Path(__file__).resolve().parent.parent / "deploy" / "cost-curves"


def curve_path(name: str | Path) -> Path:
    p = Path(name)
    return p if p.exists() else CURVE_DIR / p
