"""llama.cpp's own vocabulary-only GGUFs (``models/ggml-vocab-*.gguf`` in its source, with ``.inp``: the strings
llama.cpp's tokenizer tests read): the tokenizer families the tests hold conversions and translation to, with no
model hub. They come from the llama-cpp-python sdist the Makefile builds, fetched once with pip into the tandem
cache; only the files pinned below are kept, each checked against its sha256 before it is used."""
from __future__ import annotations

import fcntl
import hashlib
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from tandem.core.cache import cache_dir

SDIST = "llama-cpp-python==0.3.36"
MEMBERS = "llama_cpp_python-0.3.36/vendor/llama.cpp/models/"
PINS = {
    "ggml-vocab-qwen2.gguf": "44c2f46b715f585c6ab513970e8a006bfa5badd6108560054921cf598d154d8c",
    "ggml-vocab-llama-bpe.gguf": "97272e430d53bc7688f52d5e0ad8ea8f163ede9f1bbd1694feaa504797d5d96e",
    "ggml-vocab-llama-spm.gguf": "16c3724582d59aa8bf84711894e833f916ee46a31d80e21312759c48bf8d0e69",
    "ggml-vocab-phi-3.gguf": "967d7190d11c4842eab697079d98d56c2116e10eb617be355a2733bfc132e326",
    "ggml-vocab-gemma-4.gguf": "58b1ba0b57f3b4d7c468ba4ffd91ad85190346a3d7ad7e71d1cabaae8a14bb65",
    "ggml-vocab-deepseek-coder.gguf": "91cb1379f2e33af1c4866b194622b7a0e12e8f0c9dba7ba2f10d55978730bec1",
    "ggml-vocab-bert-bge.gguf": "fbcbe22278fb302694d5f4a41bfe48c5f90e8e3554eab1c0435387dff654a854",
    # llama.cpp's test strings of the families converted (most share one file)
    "ggml-vocab-qwen2.gguf.inp": (STRINGS := "be0a11f7071f0c67d3053a2d377d8f35f0dbcb77ff11a60300fb57d36b477cf0"),
    "ggml-vocab-llama-bpe.gguf.inp": STRINGS,
    "ggml-vocab-llama-spm.gguf.inp": STRINGS,
    "ggml-vocab-phi-3.gguf.inp": STRINGS,
    "ggml-vocab-gemma-4.gguf.inp": "0528aa007b06965f980181d252b5dff7bb170a77af6157bd48bba56885374448",
}


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def folder() -> Path:
    return cache_dir() / "test" / "llama-vocab"


def vocab(name: str) -> Path:
    """The path of ``ggml-vocab-<name>.gguf``, fetched on first use."""
    path = folder() / f"ggml-vocab-{name}.gguf"
    if not path.is_file():
        _fetch()
    return path


def llama_cpp_strings(name: str) -> list[str]:
    """llama.cpp's tokenizer test strings for ``ggml-vocab-<name>.gguf``."""
    path = folder() / f"ggml-vocab-{name}.gguf.inp"
    if not path.is_file():
        _fetch()
    return path.read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")


def _fetch() -> None:
    """Download the sdist, keep the pinned members (checked), drop the rest; once, under a lock."""
    out = folder()
    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if all((out / name).is_file() for name in PINS):
            return
        with tempfile.TemporaryDirectory(dir=out) as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--quiet",
                            "--progress-bar", "off", "-d", tmp, SDIST], check=True)
            (sdist,) = Path(tmp).glob("llama_cpp_python-*.tar.gz")
            with tarfile.open(sdist) as tar:
                for name in PINS:
                    member = tar.extractfile(MEMBERS + name)
                    if member is None:
                        raise FileNotFoundError(f"{SDIST} has no {MEMBERS + name}")
                    data = member.read()
                    if _sha256(data) != PINS[name]:
                        raise ValueError(f"{name} from {SDIST}: sha256 {_sha256(data)}, pinned {PINS[name]}")
                    part = Path(tmp) / name
                    part.write_bytes(data)
                    part.replace(out / name)  # (a file in the folder is whole)
