"""The committed gRPC stubs must be exactly what grpc_tools generates from protos/verifier.proto."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_stubs_match_proto(tmp_path):
    from tandem.protos.generate import STUBS, generate
    generate(tmp_path)
    for name in STUBS:
        fresh = (tmp_path / name).read_text()
        committed = (ROOT / "protos" / name).read_text()
        assert fresh == committed, f"protos/{name} drifted from verifier.proto: run `make protos` and commit"


def test_package_is_versioned():
    from tandem.protos import verifier_pb2 as pb
    assert pb.DESCRIPTOR.package == "tandem.v1"
    assert set(pb.DESCRIPTOR.services_by_name) == {"Verifier"}
    methods = {m.name for m in pb.DESCRIPTOR.services_by_name["Verifier"].methods}
    assert methods == {"Session", "Health", "Tokenizer", "DrafterAdapter"}
