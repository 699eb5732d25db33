"""llama.cpp kernel probe (core/llama_probe.py): the fallback on a crashing child, the cached verdict, overrides,
clear errors for files that cannot run; and on the real drafter, that the chosen settings load and decode.

No AMX CPU is needed: the crash is a real child killed by SIGILL, chosen by the test's runner."""
import json
import logging
import os
import signal
import subprocess
import sys

import pytest

from tandem.core import llama_probe as probe
from tandem.core.llama_probe import Outcome, ProbeError, Settings


def sigill_child() -> Outcome:
    """A real process dying of an illegal instruction, classified by the same code as the real probe."""
    r = subprocess.run([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGILL)"],
                       capture_output=True, text=True)
    return probe.outcome(r.returncode, r.stdout, r.stderr)


class Runner:
    """Scripted probe children: ``crash(settings) -> bool`` decides which settings die of SIGILL."""

    def __init__(self, crash=lambda s: False, load_error: str | None = None):
        self.crash, self.load_error, self.calls = crash, load_error, []

    def __call__(self, model, s: Settings) -> Outcome:
        self.calls.append(s)
        if self.load_error:
            return probe.outcome(probe.LOAD_FAILED, json.dumps({"error": self.load_error}) + "\n", "")
        return sigill_child() if self.crash(s) else Outcome(True)


@pytest.fixture
def model(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF-not-really")
    return f


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    monkeypatch.delenv(probe.EXTRA_BUFTS_ENV, raising=False)
    monkeypatch.delenv(probe.VARIANT_ENV, raising=False)
    probe._plans.clear()
    yield
    probe._plans.clear()


@pytest.mark.parametrize("variants, mode, expected", [
    ([None], "auto", [Settings(None, True), Settings(None, False)]),
    ([None], "on", [Settings(None, True)]),
    ([None], "off", [Settings(None, False)]),
    (["icelake", "haswell"], "auto", [Settings("icelake", True), Settings("icelake", False),
                                      Settings("haswell", True), Settings("haswell", False)]),
])
def test_candidates_in_order_of_preference(variants, mode, expected):
    assert probe.candidates(variants, mode) == expected


@pytest.mark.parametrize("rc, stdout, stderr, expected", [
    (0, "", "", Outcome(True)),
    (-signal.SIGILL, "", "", Outcome(False, "SIGILL")),
    (-signal.SIGSEGV, "", "", Outcome(False, "SIGSEGV")),
    (probe.LOAD_FAILED, 'noise\n{"error": "bad magic"}\n', "", Outcome(False, "bad magic", load_failed=True)),
    (1, "", "Traceback\nImportError: no llama_cpp\n", Outcome(False, "ImportError: no llama_cpp")),
])
def test_child_outcomes(rc, stdout, stderr, expected):
    assert probe.outcome(rc, stdout, stderr) == expected


def test_sigill_with_extra_buffers_falls_back_and_is_cached(model, tmp_path, caplog):
    logger = logging.getLogger("tandem.llama")  # tandem's loggers may not propagate (core.logs): listen here
    logger.addHandler(caplog.handler)
    runner = Runner(crash=lambda s: s.extra_bufts)
    p = probe.plan(model, runner=runner, cache=tmp_path / "c", variants=[])
    assert p == probe.Plan(Settings(None, False), "probed")
    assert runner.calls == [Settings(None, True), Settings(None, False)]
    logger.removeHandler(caplog.handler)
    assert "SIGILL" in caplog.text and "extra buffer types off" in caplog.text
    record = json.loads(next((tmp_path / "c").glob("*.json")).read_text())
    assert record["settings"] == {"variant": None, "extra_bufts": False}
    assert [a["detail"] for a in record["attempts"]] == ["SIGILL", ""]

    probe._plans.clear()  # a new process: the verdict comes from the file, no child runs
    again = Runner(crash=lambda s: pytest.fail("the cached verdict must not be probed again"))
    assert probe.plan(model, runner=again, cache=tmp_path / "c", variants=[]).source == "cached"
    assert again.calls == []


def test_a_new_model_is_checked_once_with_the_machine_verdict(model, tmp_path):
    probe.plan(model, runner=Runner(crash=lambda s: s.extra_bufts), cache=tmp_path, variants=[])
    other = tmp_path / "other.gguf"
    other.write_bytes(b"x")
    runner = Runner()
    assert probe.plan(other, runner=runner, cache=tmp_path, variants=[]).settings == Settings(None, False)
    assert runner.calls == [Settings(None, False)]  # settings that crashed before are not tried again


def test_a_crashing_cpu_variant_falls_back_to_the_next(model, tmp_path):
    runner = Runner(crash=lambda s: s.variant == "sapphirerapids")
    p = probe.plan(model, runner=runner, cache=tmp_path, variants=["sapphirerapids", "icelake", "haswell"])
    assert p.settings == Settings("icelake", True)
    assert runner.calls == [Settings("sapphirerapids", True), Settings("sapphirerapids", False),
                            Settings("icelake", True)]


@pytest.mark.parametrize("value, tried", [("off", [Settings(None, False)]), ("on", [Settings(None, True)])])
def test_environment_forces_extra_buffers(model, tmp_path, monkeypatch, value, tried):
    monkeypatch.setenv(probe.EXTRA_BUFTS_ENV, value)
    runner = Runner()
    p = probe.plan(model, runner=runner, cache=tmp_path, variants=[])
    assert runner.calls == tried and p.source == "forced"
    assert "settings" not in json.loads(next(tmp_path.glob("*.json")).read_text())  # no verdict for the machine


def test_bad_override_is_a_clear_error(model, tmp_path, monkeypatch):
    monkeypatch.setenv(probe.EXTRA_BUFTS_ENV, "maybe")
    with pytest.raises(ProbeError, match="TANDEM_LLAMA_EXTRA_BUFTS='maybe': use on, off or auto"):
        probe.plan(model, runner=Runner(), cache=tmp_path, variants=[])
    monkeypatch.setenv(probe.EXTRA_BUFTS_ENV, "auto")
    monkeypatch.setenv(probe.VARIANT_ENV, "pentium4")
    with pytest.raises(ProbeError, match="TANDEM_LLAMA_CPU_VARIANT='pentium4'"):
        probe.plan(model, runner=Runner(), cache=tmp_path)


def test_a_file_that_crashes_everywhere_names_itself_and_the_signals(model, tmp_path):
    with pytest.raises(ProbeError) as e:
        probe.plan(model, runner=Runner(crash=lambda s: True), cache=tmp_path, variants=["icelake"])
    msg = str(e.value)
    assert str(model) in msg and msg.count("SIGILL") == 2 and "cannot run on this CPU" in msg


def test_a_file_llama_cpp_refuses_is_not_retried(model, tmp_path):
    runner = Runner(load_error="failed to read magic")
    with pytest.raises(ProbeError, match=r"cannot load .*m\.gguf: failed to read magic"):
        probe.plan(model, runner=runner, cache=tmp_path, variants=["icelake", "haswell"])
    assert len(runner.calls) == 1


# -- the real thing, in child processes (backend settings are per process) -------------------------------------
def _python(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)


@pytest.mark.models
@pytest.mark.parametrize("force", ["", "off"])
def test_real_model_loads_and_decodes_with_the_chosen_settings(drafter_path, tmp_path, force):
    env = dict(os.environ, TANDEM_CACHE=str(tmp_path), **({probe.EXTRA_BUFTS_ENV: force} if force else {}))
    code = f"""
import json
from tandem.core.llama_runtime import LlamaContext, LlamaModel, _variant
m = LlamaModel({str(drafter_path)!r})
ctx = LlamaContext(m, n_ctx=64, n_seq_max=1, n_batch=16, n_threads=2)
row = ctx.prefill(m.tokenize("def add(a, b):"), 0, logits_last=True)[0]
print(json.dumps({{"extra_bufts": m.extra_bufts, "variant": _variant[0], "top": int(row.argmax())}}))
"""
    r = _python(code, env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    if force == "off":
        assert out["extra_bufts"] is False
    record = json.loads(next((tmp_path / "llama-probe").glob("*.json")).read_text())
    assert record["attempts"] and record["attempts"][-1]["ok"]
    assert out["variant"] == record["attempts"][-1]["variant"]
    assert 0 <= out["top"] < 151936


@pytest.mark.models
def test_a_truncated_gguf_is_a_clear_error_not_a_signal(drafter_path, tmp_path):
    bad = tmp_path / "truncated.gguf"
    with open(drafter_path, "rb") as f:
        bad.write_bytes(f.read(4 << 20))
    env = dict(os.environ, TANDEM_CACHE=str(tmp_path))
    r = _python(f"from core.llama_runtime import LlamaModel\nLlamaModel({str(bad)!r})", env)
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])  # an exception, not a signal
    assert "truncated.gguf" in r.stderr.strip().splitlines()[-1]
    assert "ProbeError" in r.stderr


def test_a_read_only_cache_keeps_verdicts_in_temporary_space(tmp_path, monkeypatch):
    """Deployments mount the model cache read-only: the probe then keeps its verdicts in the system's temporary
    space instead of failing to start."""
    from tandem.core import llama_probe
    cache = tmp_path / "models" / "llama-probe"
    assert llama_probe._writable(cache) == cache and cache.is_dir()

    def read_only(*a, **k):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(llama_probe.tempfile, "NamedTemporaryFile", read_only)
    monkeypatch.setattr(llama_probe.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    assert llama_probe._writable(cache) == tmp_path / "tmp" / f"tandem-llama-probe-{__import__('os').getuid()}"
