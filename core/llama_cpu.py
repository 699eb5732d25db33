"""What llama.cpp build and CPU this process runs on: the build's CPU variants (a portable build ships one library
per x86-64 instruction-set level) and the identities its kernel verdicts are cached under (core/llama_probe.py).
Loads no model and runs no kernel."""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
from pathlib import Path

from .errors import TandemError

EXTRA_BUFTS_ENV = "TANDEM_LLAMA_EXTRA_BUFTS"
VARIANT_ENV = "TANDEM_LLAMA_CPU_VARIANT"


class LlamaError(TandemError, RuntimeError):
    """llama.cpp could not load or run something; the message names what and why."""


def lib_dir() -> Path:
    """The directory llama-cpp-python loads its libraries from."""
    import llama_cpp

    return Path(llama_cpp.__file__).parent / "lib"


def variant_libraries(directory: Path | None = None) -> dict[str, Path]:
    """CPU variants of a portable build (``libggml-cpu-NAME.so``); empty for a build with one CPU backend."""
    directory = directory or lib_dir()
    prefix = "libggml-cpu-"
    return {
        p.name[len(prefix) :].split(".")[0]: p for p in sorted(directory.glob(f"{prefix}*.so*")) if not p.is_symlink()
    }


def variant_scores(libraries: dict[str, Path]) -> list[tuple[str, int]]:
    """Variants this CPU supports, best first, as ggml itself ranks them (each library's ``ggml_backend_score``:
    0 when cpuid lacks one of its instruction sets). Loading a library runs no kernel, which is how ggml does it."""
    scored = []
    for name, path in libraries.items():
        try:
            score = ctypes.CDLL(str(path)).ggml_backend_score
        except (OSError, AttributeError):
            continue
        score.restype = ctypes.c_int
        if (s := score()) > 0:
            scored.append((name, s))
    return sorted(scored, key=lambda x: -x[1])


def best_variants() -> list[str]:
    """This build's CPU variants that cpuid allows, best first (empty for a build with one CPU backend)."""
    forced = os.environ.get(VARIANT_ENV, "").strip()
    return [forced] if forced else [name for name, _ in variant_scores(variant_libraries())]


def cpu_flags() -> str:
    """The CPU's instruction-set flags as the OS reports them (what decides which kernels can run)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


_build_hash: dict[Path, str] = {}


def build_id(directory: Path | None = None) -> str:
    """Hash of the llama.cpp libraries' contents: a rebuilt or upgraded llama.cpp is probed again."""
    directory = directory or lib_dir()
    if directory not in _build_hash:
        h = hashlib.sha256()
        for p in sorted(directory.glob("*.so*")) + sorted(directory.glob("*.dylib")) + sorted(directory.glob("*.dll")):
            if p.is_file() and not p.is_symlink():
                h.update(p.name.encode() + b"\0")
                with open(p, "rb") as f:
                    while chunk := f.read(1 << 20):
                        h.update(chunk)
        _build_hash[directory] = h.hexdigest()[:16]
    return _build_hash[directory]


def machine_key(directory: Path | None = None) -> str:
    cpu = hashlib.sha256(f"{platform.machine()}\0{cpu_flags()}".encode()).hexdigest()[:16]
    return f"{cpu}-{build_id(directory)}"


def model_key(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
