"""The committed gRPC stubs must be exactly what grpc_tools generates from protos/verifier.proto."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_stubs_match_proto(tmp_path):
    (tmp_path / "protos").mkdir()
    (tmp_path / "protos" / "verifier.proto").write_bytes((ROOT / "protos" / "verifier.proto").read_bytes())
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I.", "--python_out=.", "--grpc_python_out=.",
                    "protos/verifier.proto"], cwd=tmp_path, check=True)
    for name in ("verifier_pb2.py", "verifier_pb2_grpc.py"):
        fresh = (tmp_path / "protos" / name).read_text()
        committed = (ROOT / "protos" / name).read_text()
        assert fresh == committed, f"protos/{name} drifted from verifier.proto: run `make protos` and commit"


def test_package_is_versioned():
    from protos import verifier_pb2 as pb
    assert pb.DESCRIPTOR.package == "tandem.v1"
    assert set(pb.DESCRIPTOR.services_by_name) == {"Verifier"}
    methods = {m.name for m in pb.DESCRIPTOR.services_by_name["Verifier"].methods}
    assert methods == {"Session", "Health"}
