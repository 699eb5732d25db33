"""The probe's child process: load a model with given kernel settings and decode, so that a crash costs only this
process. Run by core/llama_probe.py as
``python -m tandem.core.llama_probe_child MODEL --variant V --extra-bufts on|off``; exit 0 when the decode ran,
``LOAD_FAILED`` with llama.cpp's message when it refused the file, or a signal."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from . import lifetime
from . import llama_runtime as rt
from .llama_probe import LOAD_FAILED


def child(model: Path, variant: str | None, extra_bufts: bool) -> int:
    """Load, decode a 16-token batch (the batched kernels) and one token (the vector kernels) on every core."""
    try:
        rt.init_backend(variant)
        m = rt.LlamaModel(model, extra_bufts=extra_bufts)
        ctx = rt.LlamaContext(m, n_ctx=64, n_seq_max=1, n_batch=32, n_threads=os.cpu_count() or 1)
    except rt.LlamaError as e:
        print(json.dumps({"error": str(e)}))
        return LOAD_FAILED
    tokens = (m.tokenize('def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n') * 16)[:16]
    logits = ctx.prefill(tokens, 0, logits_last=True)
    ctx.decode([int(logits[0].argmax())], [len(tokens)], [(0,)], [True])
    print(json.dumps({"ok": True}))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tandem.core.llama_probe_child")
    ap.add_argument("model", type=Path)
    ap.add_argument("--variant", default="")
    ap.add_argument("--extra-bufts", choices=("on", "off"), required=True)
    args = ap.parse_args(argv)
    lifetime.bind_to_parent()
    return child(args.model, args.variant or None, args.extra_bufts == "on")


if __name__ == "__main__":
    sys.exit(main())
