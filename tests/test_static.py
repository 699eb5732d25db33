"""Static checks, run with the suite: ruff lint over the whole checkout; mypy over every layer of the product (core,
edge, cloud, orchestrator; the modules written since, strict: pyproject.toml); ruff format on the shared core, the
maths (acceptance, tree building, draft policy) and those newer modules."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("protos", "core", "edge", "cloud", "orchestrator")
TYPED = ("core", "cloud/acceptance.py", "cloud/budget.py", "cloud/caches/block_cache.py",
         "cloud/engines/deterministic.py", "edge/planner.py", "edge/policy", "orchestrator/settings.py",
         "edge/actions.py", "edge/generation_stats.py", "edge/drafter_worker.py", "edge/transport.py",
         "edge/export/torch_step.py", "cloud/host_drafting.py", "orchestrator/host_drafters.py", "edge/thin.py")
CHECKED = ("core", "edge", "cloud", "orchestrator")  # mypy's


def run(*argv, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", *argv], cwd=cwd, capture_output=True, text=True, timeout=600)


def test_ruff_lint():
    r = run("ruff", "check", "--no-cache", "--output-format", "concise", ".")
    assert r.returncode == 0, r.stdout + r.stderr


def test_ruff_format_of_core_and_maths():
    r = run("ruff", "format", "--no-cache", "--check", "--diff", *TYPED)
    assert r.returncode == 0, "run `ruff format " + " ".join(TYPED) + "`:\n" + r.stdout + r.stderr


def test_mypy_on_every_layer(tmp_path):
    """Through a tandem/ tree of links to the layers: mypy finds modules by their folders, and no setting of it maps
    ``tandem.core`` to ``core/`` as the package's package-dir does (pyproject.toml)."""
    from tandem.core.cache import cache_dir
    tree = tmp_path / "tandem"
    tree.mkdir()
    for layer in LAYERS:
        (tree / layer).symlink_to(ROOT / layer, target_is_directory=True)
    r = run("mypy", "--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", str(cache_dir() / "mypy"),
            *(f"tandem/{t}" for t in CHECKED), cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
