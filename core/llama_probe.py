"""Which llama.cpp CPU kernels this machine can run, decided once per machine and llama.cpp build.

Two optional kernel paths can kill a process with a signal where they should fail cleanly:

- extra buffer types (``llama_model_params.use_extra_bufts``): weights repacked for AMX tiles (Intel Sapphire Rapids
  and later) or into interleaved layouts. On some AMX hosts the tile kernels fault (SIGILL at ``tilezero`` on an
  OpenMP worker thread: the tile-data permission is requested on one thread only, an upstream llama.cpp bug);
- the CPU variant of a portable build (``GGML_BACKEND_DL`` + ``GGML_CPU_ALL_VARIANTS``): ggml picks the variant
  whose instruction sets cpuid reports, and a hypervisor can report sets it does not enable.

So before a process loads its first model, a child process loads that model and decodes a batch and a single token
with the preferred settings. A child killed by a signal costs nothing but a fallback to the next settings: extra
buffer types off, then lower CPU variants. The verdict is cached under the cache dir, keyed by the CPU's flags and
a hash of the llama.cpp libraries, so a machine pays the probe once per build; after that each new model file is
checked once with the chosen settings, and a GGUF that cannot run here gets an error that names it, not a signal.

Overrides: ``TANDEM_LLAMA_EXTRA_BUFTS=on|off|auto`` (default ``auto``: probe) and, for portable builds,
``TANDEM_LLAMA_CPU_VARIANT=NAME`` (e.g. ``haswell``; the library ``libggml-cpu-NAME.so``).

``python -m tandem.core.llama_probe MODEL`` prints the plan for MODEL (probing if needed): what this machine chose. The
child is ``core/llama_probe_child.py``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

from . import lifetime
from .llama_cpu import (
    EXTRA_BUFTS_ENV,
    VARIANT_ENV,
    LlamaError,
    best_variants,
    cpu_flags,
    machine_key,
    model_key,
    variant_libraries,
)

log = logging.getLogger("tandem.llama")
CHILD_TIMEOUT_S = 900.0  # a large model on a slow disk takes minutes to page in
LOAD_FAILED = 3  # the child's exit status when llama.cpp refused the file cleanly (no signal)


class ProbeError(LlamaError):
    """The model cannot run on this CPU with any kernel settings, or the settings asked for are invalid."""


@dataclass(frozen=True)
class Settings:
    variant: str | None  # CPU variant library of a portable build; None: the build has a single CPU backend
    extra_bufts: bool


@dataclass(frozen=True)
class Outcome:
    ok: bool
    detail: str = ""  # "SIGILL", "exit 1", "timed out after 900 s", or llama.cpp's error
    load_failed: bool = False  # llama.cpp refused the file cleanly: no other settings will help


@dataclass(frozen=True)
class Plan:
    settings: Settings
    source: str  # "probed", "cached" or "forced"


Runner = Callable[[Path, Settings], Outcome]


# -- the verdict ----------------------------------------------------------------------------------------------------
def extra_bufts_mode() -> str:
    mode = os.environ.get(EXTRA_BUFTS_ENV, "auto").strip().lower() or "auto"
    if mode not in ("on", "off", "auto"):
        raise ProbeError(f"{EXTRA_BUFTS_ENV}={mode!r}: use on, off or auto")
    return mode


def candidates(variants: Sequence[str | None], mode: str) -> list[Settings]:
    """Settings to try, best first: each variant with extra buffer types, then without (``mode`` auto)."""
    extra = {"on": (True,), "off": (False,), "auto": (True, False)}[mode]
    return [Settings(v, e) for v in variants for e in extra]


_lock = threading.Lock()
_plans: dict[tuple, Plan] = {}


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Two processes starting together (a verifier and its drafter) probe once, not twice."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        try:
            import fcntl

            fcntl.flock(f, fcntl.LOCK_EX)
        except ImportError:  # no fcntl (Windows): at worst both probe
            pass
        yield


def plan(
    model: Path, runner: Runner | None = None, cache: Path | None = None, variants: Sequence[str] | None = None
) -> Plan:
    """Kernel settings for loading ``model`` in this process: the machine's cached verdict when this model was
    checked with it, else a probe (children, in order of preference). Raises ``ProbeError`` naming the file when
    no settings run it. ``runner`` and ``variants`` replace the real child and the build's variants (tests)."""
    model = Path(model)
    mode = extra_bufts_mode()
    forced_variant = os.environ.get(VARIANT_ENV, "").strip() or None
    if variants is None:
        libs = variant_libraries()
        if forced_variant and forced_variant not in libs:
            have = f"the CPU variants {', '.join(libs)}" if libs else "no CPU variants (not a portable build)"
            raise ProbeError(f"{VARIANT_ENV}={forced_variant!r}, but this llama.cpp build has {have}")
        variants = best_variants()
    order: list[str | None] = list(variants) or [None]
    runner = runner or run_child
    if cache is None:
        from .cache import cache_dir

        cache = _writable(cache_dir() / "llama-probe")
    file = cache / f"{machine_key()}.json"
    mkey, memo_key = model_key(model), (str(cache), model_key(model), mode, forced_variant)
    with _lock, _file_lock(file.with_suffix(".lock")):
        if memo_key in _plans:
            return _plans[memo_key]
        record = _read(file)
        tries = candidates(order, mode)
        saved = record.get("settings")
        chosen = Settings(saved["variant"], saved["extra_bufts"]) if saved else None
        if chosen in tries:  # settings ranked above the machine's verdict crashed here before: start from it
            tries = tries[tries.index(chosen) :]
        if _check_key(mkey, tries[0]) in record.get("checked", []):
            result = Plan(tries[0], "cached" if mode == "auto" else "forced")
        else:
            result = _probe(model, tries, runner, record, mkey, mode)
            _write(file, record)
        _plans[memo_key] = result
    return result


def _probe(model: Path, tries: list[Settings], runner: Runner, record: dict, mkey: str, mode: str) -> Plan:
    failures: list[tuple[str, str]] = []
    for s in tries:
        outcome = runner(model, s)
        record.setdefault("attempts", []).append(
            {**asdict(s), "model": model.name, "ok": outcome.ok, "detail": outcome.detail}
        )
        if outcome.ok:
            if failures:
                log.warning(
                    "llama.cpp settings %s crashed on this CPU (%s); using %s",
                    failures[0][0],
                    failures[0][1],
                    _describe(s),
                )
            else:
                log.info("llama.cpp on this CPU: %s (probed)", _describe(s))
            if mode == "auto" and not os.environ.get(VARIANT_ENV):  # a forced run is no verdict for the machine
                record["settings"] = asdict(s)
            record["checked"] = [*record.get("checked", [])[-50:], _check_key(mkey, s)]
            return Plan(s, "probed" if mode == "auto" else "forced")
        if outcome.load_failed:
            raise ProbeError(f"llama.cpp cannot load {model}: {outcome.detail}")
        failures.append((_describe(s), outcome.detail))
    tried = "; ".join(f"{d}: {why}" for d, why in failures)
    raise ProbeError(
        f"{model} cannot run on this CPU: a test decode crashed with every kernel setting tried "
        f"({tried}). The file may be corrupt or use a type this llama.cpp build cannot run here."
    )


def _writable(cache: Path) -> Path:
    """``cache``, or a directory in the system's temporary space when it cannot be written (a model cache mounted
    read-only, as deployments mount it): the verdict is then kept for this machine's uptime only."""
    try:
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=cache):
            pass
        return cache
    except OSError:
        fallback = Path(tempfile.gettempdir()) / f"tandem-llama-probe-{os.getuid()}"
        log.info("%s is not writable; keeping llama.cpp probe verdicts in %s", cache, fallback)
        return fallback


def _check_key(mkey: str, s: Settings) -> str:
    return f"{mkey}|{s.variant}|{s.extra_bufts}"


def _describe(s: Settings) -> str:
    return f"CPU variant {s.variant or 'built-in'}, extra buffer types {'on' if s.extra_bufts else 'off'}"


def _read(file: Path) -> dict:
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError):
        return {}


def _write(file: Path, record: dict) -> None:
    record["cpu_flags"] = cpu_flags()
    record["attempts"] = record.get("attempts", [])[-20:]
    tmp = file.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, file)


# -- the child ------------------------------------------------------------------------------------------------------
def run_child(model: Path, s: Settings) -> Outcome:
    """Load ``model`` and decode in a fresh process with settings ``s``; a signal there is only an outcome here."""
    argv = [
        sys.executable,
        "-m",
        "tandem.core.llama_probe_child",
        str(model),
        "--variant",
        s.variant or "",
        "--extra-bufts",
        "on" if s.extra_bufts else "off",
    ]
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, env=lifetime.child_env())
    except subprocess.TimeoutExpired:
        return Outcome(False, f"timed out after {CHILD_TIMEOUT_S:.0f} s")
    return outcome(r.returncode, r.stdout, r.stderr)


def outcome(returncode: int, stdout: str, stderr: str) -> Outcome:
    """What a finished child says: ok, killed by a signal (a kernel path this CPU cannot run), or a clean
    refusal from llama.cpp (``LOAD_FAILED``, its message on the last stdout line)."""
    if returncode == 0:
        return Outcome(True)
    if returncode < 0:
        try:
            return Outcome(False, signal.Signals(-returncode).name)
        except ValueError:
            return Outcome(False, f"signal {-returncode}")
    try:
        error = json.loads((stdout.strip().splitlines() or [""])[-1])["error"]
    except (ValueError, KeyError, TypeError):
        error = (stderr.strip().splitlines() or [f"exit {returncode}"])[-1]
    return Outcome(False, error, load_failed=returncode == LOAD_FAILED)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tandem.core.llama_probe", description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        p = plan(args.model)
    except ProbeError as e:
        print(f"probe: {e}", file=sys.stderr)
        return 1
    print(json.dumps({**asdict(p.settings), "source": p.source, "machine": machine_key()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
