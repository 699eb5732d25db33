"""Where each partition's drafter adapter outlives a restart (opt-in: ``tandem serve --distill-dir``).

One directory per partition (its id: a digest, never a key or salt), readable by this user only, holding the
partition's current adapter (``adapter.gguf``, llama.cpp's LoRA GGUF), its record (``adapter.json``: what the
verifier advertises of it, when the training it continues began, and the tenant it counts against, a digest too)
and the training state the next round continues from (``state.pt``: the LoRA weights and their optimizer moments,
read back with ``torch.load(weights_only=True)``). Files are written to a temporary name and renamed, so a crash
leaves the previous version whole; an adapter whose bytes do not hash to what its record says is not served. An
expired or evicted adapter's directory is removed whole (``cloud.learning.online``).
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import NamedTuple

from tandem.core.messages import AdapterInfo

from .lora_gguf import sha256

log = logging.getLogger("tandem.cloud.adapter_dir")

_PARTITION = re.compile(r"[0-9a-f]{64}")
_SHARED_DIR = "shared"  # the partition of callers with neither key nor salt (core.tenancy.SHARED, "")


def partition_dir(root: Path, partition: str) -> Path:
    if partition and not _PARTITION.fullmatch(partition):
        raise ValueError(f"not a partition id: {partition[:80]!r}")
    return Path(root) / (partition or _SHARED_DIR)


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class Saved(NamedTuple):
    info: AdapterInfo
    data: bytes
    lineage_unix: float  # when the training it continues began
    tenant: str  # whom it counts against ("": a record from before tenants were kept)


def save_adapter(root: Path, partition: str, info: AdapterInfo, data: bytes, lineage_unix: float,
                 tenant: str = "") -> None:
    d = partition_dir(root, partition)
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    _write(d / "adapter.gguf", data)  # (the bytes first: an adapter.json never names bytes not yet there)
    _write(d / "adapter.json", json.dumps({"sha256": info.sha256, "version": info.version, "base": info.base,
                                           "size_bytes": info.size_bytes, "lineage_unix": lineage_unix,
                                           "tenant": tenant}).encode())


def remove(root: Path, partition: str) -> None:
    """The partition's directory (adapter, record, training state), gone."""
    shutil.rmtree(partition_dir(root, partition), ignore_errors=True)


def load_adapters(root: Path) -> dict[str, Saved]:
    """Every partition's saved adapter whose bytes are what its record says, with when its lineage began (a record
    without one: its file's time); others are skipped, logged."""
    out: dict[str, Saved] = {}
    if not Path(root).is_dir():
        return out
    for d in sorted(Path(root).iterdir()):
        partition = "" if d.name == _SHARED_DIR else d.name
        if not d.is_dir() or not (partition == "" or _PARTITION.fullmatch(partition)):
            continue
        try:
            meta = json.loads((d / "adapter.json").read_text())
            data = (d / "adapter.gguf").read_bytes()
            info = AdapterInfo(str(meta["sha256"]), int(meta["version"]), str(meta["base"]), len(data))
            lineage = float(meta.get("lineage_unix", (d / "adapter.gguf").stat().st_mtime))
            tenant = str(meta.get("tenant", ""))
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("saved adapter unreadable, skipped", extra={"partition": partition[:12], "error": str(e)})
            continue
        if sha256(data) != info.sha256:
            log.warning("saved adapter does not match its sha256, skipped", extra={"partition": partition[:12]})
            continue
        out[partition] = Saved(info, data, lineage, tenant)
    return out


def save_state(root: Path, partition: str, state: dict) -> None:
    import io

    import torch
    buf = io.BytesIO()
    torch.save(state, buf)
    d = partition_dir(root, partition)
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    _write(d / "state.pt", buf.getvalue())


def load_state(root: Path, partition: str) -> dict | None:
    """The partition's saved training state, or None (none saved, or unreadable: the round starts afresh)."""
    import torch
    path = partition_dir(root, partition) / "state.pt"
    if not path.is_file():
        return None
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # (a torn or foreign file: start over rather than fail the round)
        log.warning("saved training state unreadable, starting afresh",
                    extra={"partition": partition[:12], "error": str(e)})
        return None
