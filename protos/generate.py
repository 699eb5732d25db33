"""Regenerate the committed stubs from ``verifier.proto`` (``make protos``; tests/test_protos.py checks drift).

protoc names a stub's imports after the proto's path under the include root, so the proto is staged as
``tandem/protos/verifier.proto``: the generated ``verifier_pb2_grpc`` then imports ``tandem.protos.verifier_pb2``,
the installed name. Needs ``grpcio-tools`` (the test extra)."""
from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
STUBS = ("verifier_pb2.py", "verifier_pb2.pyi", "verifier_pb2_grpc.py")  # .pyi: the messages' types, for mypy


def generate(out: Path = HERE) -> list[Path]:
    with tempfile.TemporaryDirectory() as tmp:
        staged = Path(tmp) / "tandem" / "protos"
        staged.mkdir(parents=True)
        shutil.copy(HERE / "verifier.proto", staged)
        subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{tmp}", f"--python_out={tmp}",
                        f"--pyi_out={tmp}", f"--grpc_python_out={tmp}", "tandem/protos/verifier.proto"], check=True)
        out.mkdir(parents=True, exist_ok=True)
        return [Path(shutil.copy(staged / name, out / name)) for name in STUBS]


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE):
        print(path)
