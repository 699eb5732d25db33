"""What every bench module does with its result: JSON on stdout (and at ``--json``), the Markdown report, and the
exit status that says whether its correctness check held."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable


def finish(result: dict, json_path: Path | None, report: Callable[[dict, Path], None], report_path: Path,
           ok: bool, failure: str, tag: str) -> int:
    text = json.dumps(result, indent=2)
    print(text)
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(text + "\n")
    report_path.parent.mkdir(parents=True, exist_ok=True)
    report(result, report_path)
    print(f"[{tag}] report: {report_path}", file=sys.stderr, flush=True)
    if not ok:
        print(f"[{tag}] FAIL: {failure}", file=sys.stderr, flush=True)
        return 1
    return 0
