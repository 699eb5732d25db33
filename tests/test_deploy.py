"""docker-compose.yml and deploy/k8s/ checked without a Docker engine or a cluster: they parse, the required
services and resources exist, ports / healthchecks / GPU reservations are wired, every TANDEM_* variable is a real
configuration key, and every `tandem ...` command line parses with the real CLI."""
from pathlib import Path

import pytest
import yaml

from tandem.orchestrator import cli

ROOT = Path(__file__).resolve().parent.parent
KNOWN_ENV = cli.env_keys()


@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def k8s_docs():
    return [d for f in sorted((ROOT / "deploy" / "k8s").glob("*.yaml")) for d in yaml.safe_load_all(f.read_text())
            if d]


def check_command(argv):
    """A `tandem ...` command parses with the real parser (flags exist, values have the right types)."""
    if argv and argv[0] == "tandem":
        cli.parser().parse_args(argv[1:])


def env_names(env) -> set[str]:
    if isinstance(env, dict):
        return set(env)
    return {e["name"] for e in env or ()}


def test_compose_services_and_profiles(compose):
    s = compose["services"]
    assert {"models-init", "ray-head", "verifier-worker", "verifier", "gateway", "cpu", "edge-demo"} <= set(s)
    assert "gpu" in s["verifier-worker"]["profiles"] and "cpu" in s["cpu"]["profiles"]
    assert all(s[name].get("profiles") for name in s), "every service belongs to a profile"
    gpu = s["verifier-worker"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia" and gpu["capabilities"] == ["gpu"]
    assert "models" in compose["volumes"]
    for name in ("verifier-worker", "verifier", "gateway", "cpu", "models-init"):
        assert any(v.startswith("models:/models") for v in s[name]["volumes"]), name


def test_compose_ports_healthchecks_and_dependencies(compose):
    s = compose["services"]
    assert "8000:8000" in s["gateway"]["ports"] and "50051:50051" in s["verifier"]["ports"]
    assert "8000:8000" in s["cpu"]["ports"]
    for name in ("ray-head", "verifier", "gateway", "cpu"):
        test = s[name]["healthcheck"]["test"]
        assert test[0] == "CMD", name
        check_command(test[1:])
    assert s["gateway"]["depends_on"]["verifier"]["condition"] == "service_healthy"
    assert s["verifier"]["depends_on"]["verifier-worker"]["condition"] == "service_healthy"
    assert s["cpu"]["depends_on"]["models-init"]["condition"] == "service_completed_successfully"
    # the gateway reaches the verifier by its service name and port
    assert s["gateway"]["environment"]["TANDEM_GATEWAY_VERIFIER"] == "verifier:50051"
    assert s["verifier"]["environment"]["TANDEM_GRPC_PORT"] == "50051"
    for name in ("verifier", "gateway", "cpu"):  # the current spelling: no deprecation line at every start
        assert not {"TANDEM_HTTP_HOST", "TANDEM_HTTP_PORT"} & set(s[name]["environment"])
    assert s["verifier"]["environment"]["TANDEM_RAY_ADDRESS"].startswith("ray-head:")


def test_compose_env_and_commands_are_real_config(compose):
    for name, svc in compose["services"].items():
        unknown = {k for k in env_names(svc.get("environment")) if k.startswith("TANDEM_")} - KNOWN_ENV
        assert not unknown, f"{name}: {unknown} are not configuration keys"
        check_command(svc.get("command"))
        if "build" in svc:
            assert (ROOT / svc["build"]["dockerfile"]).is_file()
    # services listening off loopback get keys (the CLI refuses to start without them), as files, never values;
    # REST keys and verifier keys are separate sets
    s = compose["services"]
    assert "TANDEM_VERIFIER_KEYS_FILE" in s["verifier"]["environment"] and "verifier_keys" in s["verifier"]["secrets"]
    assert "TANDEM_API_KEYS_FILE" in s["gateway"]["environment"] and "TANDEM_VERIFIER_KEY_FILE" in \
        s["gateway"]["environment"]
    assert {"TANDEM_API_KEYS_FILE", "TANDEM_VERIFIER_KEYS_FILE"} <= set(s["cpu"]["environment"])
    for name, svc in s.items():
        env = svc.get("environment") or {}
        assert not {k for k, v in env.items() if k.endswith(("_KEYS", "_KEY")) and not str(v).startswith("/")}, \
            f"{name}: a key as an environment value (a file path is fine: TANDEM_TLS_KEY)"
        for secret in svc.get("secrets", ()):
            assert secret in compose["secrets"], (name, secret)


def test_nothing_publishes_ray_or_runs_as_root(compose):
    """Ray's dashboard and client ports accept job submission without any key: never published. Images drop root."""
    for name, svc in compose["services"].items():
        assert not any(p.split(":")[0] in ("8265", "10001") for p in svc.get("ports", ())), name
        assert "--dashboard-host=0.0.0.0" not in (svc.get("command") or []), name
    (rc,) = [d for d in k8s_docs() if d["kind"] == "RayCluster"]
    assert rc["spec"]["headGroupSpec"]["rayStartParams"].get("include-dashboard") == "false"
    head = rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert {p["containerPort"] for p in head["ports"]} == {6379}
    for name in ("gateway.Dockerfile", "verifier.Dockerfile"):
        runtime = (ROOT / "deploy" / name).read_text().rsplit("\nFROM ", 1)[1]
        assert "USER 10001" in runtime and "useradd --uid 10001" in runtime, name


def test_k8s_containers_are_confined_sized_and_probed():
    for d in k8s_docs():
        if d["kind"] not in ("Deployment", "RayCluster"):
            continue
        specs = ([d["spec"]["template"]["spec"]] if d["kind"] == "Deployment" else
                 [d["spec"]["headGroupSpec"]["template"]["spec"]] +
                 [g["template"]["spec"] for g in d["spec"]["workerGroupSpecs"]])
        for spec in specs:
            for c in spec["containers"]:
                sc = c.get("securityContext", {})
                assert sc.get("runAsNonRoot") and sc.get("allowPrivilegeEscalation") is False, c["name"]
                assert sc.get("capabilities", {}).get("drop") == ["ALL"], c["name"]
                assert c["resources"]["requests"] and c["resources"]["limits"], c["name"]
                if d["kind"] == "Deployment":
                    assert "startupProbe" in c, c["name"]
                    assert not {k for k, v in _env(c).items()
                                if k.endswith(("_KEYS", "_KEY")) and not str(v).startswith("/")}, c["name"]


def test_env_keys_reach_the_flags(monkeypatch, compose):
    """The compose environment of the gateway, applied, gives the CLI the intended configuration."""
    import re
    env = compose["services"]["gateway"]["environment"]
    for k, v in env.items():
        if k in cli.ENV_KEYS:  # compose's ${VAR:-default} at its default
            monkeypatch.setenv(k, re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", str(v)))
    args = cli.parser().parse_args(["serve"])
    assert (args.verifier, args.http_host, args.http_port, args.gateway_drafters) == ("verifier:50051", "0.0.0.0",
                                                                                     8000, 2)
    assert args.key_concurrency > 0 and args.key_tokens_per_minute > 0  # per-key limits on by default


def test_k8s_raycluster_has_gpu_workers():
    (rc,) = [d for d in k8s_docs() if d["kind"] == "RayCluster"]
    assert rc["apiVersion"] == "ray.io/v1"
    head = rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert any(p["containerPort"] == 6379 for p in head["ports"])
    (workers,) = rc["spec"]["workerGroupSpecs"]
    c = workers["template"]["spec"]["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1 and workers["rayStartParams"]["num-gpus"] == "1"


def test_k8s_deployments_are_wired():
    docs = k8s_docs()
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    assert {"tandem-verifier", "tandem-gateway"} <= set(deployments) <= set(services)
    for d in list(deployments.values()) + [x for x in docs if x["kind"] == "Job"]:
        for c in d["spec"]["template"]["spec"]["containers"]:
            unknown = {k for k in env_names(c.get("env")) if k.startswith("TANDEM_")} - KNOWN_ENV
            assert not unknown, (d["metadata"]["name"], unknown)
            check_command(c.get("command"))
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                if "exec" in c.get(probe, {}):
                    check_command(c[probe]["exec"]["command"])
    gw = deployments["tandem-gateway"]["spec"]["template"]["spec"]["containers"][0]
    assert gw["readinessProbe"]["httpGet"]["path"] == "/readyz" and gw["livenessProbe"]["httpGet"]["path"] == "/healthz"
    env = {e["name"]: e["value"] for e in gw["env"]}
    verifier_port = services["tandem-verifier"]["spec"]["ports"][0]["port"]
    assert env["TANDEM_GATEWAY_VERIFIER"] == f"tandem-verifier:{verifier_port}"
    venv = {e["name"]: e["value"] for e in deployments["tandem-verifier"]["spec"]["template"]["spec"]
            ["containers"][0]["env"]}
    (rc,) = [d for d in docs if d["kind"] == "RayCluster"]
    assert venv["TANDEM_RAY_ADDRESS"] == f"{rc['metadata']['name']}-head-svc:6379"  # KubeRay's head service name


def test_llama_cpp_is_built_portable_everywhere():
    """The cached wheel and both images build llama.cpp from deploy/llama-cpp.cmake-args (runtime CPU-variant
    dispatch), never for the build machine's CPU, and every package directory the install maps into tandem.* is
    in the images."""
    flags = [w for line in (ROOT / "deploy" / "llama-cpp.cmake-args").read_text().splitlines()
             if not line.startswith("#") for w in line.split()]
    assert {"-DGGML_NATIVE=OFF", "-DGGML_BACKEND_DL=ON", "-DGGML_CPU_ALL_VARIANTS=ON"} <= set(flags)
    assert "llama-cpp.cmake-args" in (ROOT / "Makefile").read_text()
    import tomllib
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    packages = set(package_dir.values())  # what pip installs as tandem.*
    for name in ("gateway.Dockerfile", "verifier.Dockerfile"):
        text = (ROOT / "deploy" / name).read_text()
        assert "COPY deploy/llama-cpp.cmake-args" in text and "CMAKE_ARGS=\"$(grep -v '^#'" in text, name
        assert "GGML_NATIVE=ON" not in text and "march=native" not in text, name
        runtime = text.rsplit("\nFROM ", 1)[1]  # the final stage: no compilers in the runtime image
        assert "build-essential" not in runtime and "cmake" not in runtime, name
        assert {f"COPY {p} {p}" for p in packages} <= set(runtime.splitlines()), name
        assert "python3.11" not in text or "python:3.11" in text, name  # Ubuntu 24.04 has no python3.11 package
        # the versions the suite ran with (uv.lock), and traces exportable from every image
        assert "uv export --frozen" in text and "-c /wheels/constraints.txt" in runtime, name
        assert "--extra otel" in text and "otel]'" in runtime, name


def _pod_specs(d):
    if d["kind"] in ("Deployment", "Job"):
        return [d["spec"]["template"]["spec"]]
    if d["kind"] == "RayCluster":
        return [d["spec"]["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"]
                                                                    for g in d["spec"]["workerGroupSpecs"]]
    return []


def _env(container) -> dict:
    return {e["name"]: e.get("value") for e in container.get("env") or ()}


def test_compose_keys_cross_networks_only_over_tls_and_tenants_are_limited(compose):
    s = compose["services"]
    v, g, cpu = (s[n]["environment"] for n in ("verifier", "gateway", "cpu"))
    for env in (v, cpu):  # gRPC (and the cpu profile's REST) speak TLS
        assert env["TANDEM_TLS_CERT"].startswith("/run/secrets/") and env["TANDEM_TLS_KEY"].startswith("/run/secrets/")
    assert g["TANDEM_TLS_CA"].startswith("/run/secrets/") and g["TANDEM_TLS_CERT"]  # verifies the verifier; https
    assert s["edge-demo"]["environment"]["TANDEM_TLS_CA"]
    for name in ("verifier", "gateway", "cpu"):
        test = s[name]["healthcheck"]["test"]
        assert "--tls-ca" in test and not any(t.startswith("http://") for t in test), name
    for env in (v, cpu):  # per-key limits by default on both planes
        assert {"TANDEM_KEY_SESSIONS", "TANDEM_KEY_PREFILL_TOKENS_PER_MINUTE", "TANDEM_SESSION_LIFETIME_S"} <= set(env)
    for env in (g, cpu):
        assert {"TANDEM_KEY_CONCURRENCY", "TANDEM_KEY_TOKENS_PER_MINUTE", "TANDEM_SALT_SECRET_FILE",
                "TANDEM_METRICS_KEYS_FILE"} <= set(env)
    assert v["TANDEM_GATEWAY_KEYS_FILE"] == "/run/secrets/verifier_key" == g["TANDEM_VERIFIER_KEY_FILE"]


def test_compose_isolates_ray_the_metrics_port_and_the_model_volume(compose):
    s = compose["services"]
    assert compose["networks"]["pool"].get("internal") is True
    for name in ("ray-head", "verifier-worker"):
        assert s[name]["networks"] == ["pool"], name
        assert s[name]["environment"]["RAY_AUTH_MODE"] == "token" and "ray_token" in s[name]["secrets"], name
    assert "pool" in s["verifier"]["networks"] and s["verifier"]["environment"]["RAY_AUTH_MODE"] == "token"
    for name in ("gateway", "cpu", "edge-demo"):  # nothing that faces users can reach Ray's ports
        assert "pool" not in s[name].get("networks", []), name
    assert not any(p.split(":")[0] == "9090" for svc in s.values() for p in svc.get("ports", ()))
    for name, svc in s.items():
        for vol in svc.get("volumes", ()):
            if vol.startswith("models:"):
                assert vol.endswith(":ro") == (name != "models-init"), name
    drain = int(s["verifier"]["environment"]["TANDEM_DRAIN_S"])
    for name in ("verifier", "gateway", "cpu"):
        assert int(s[name]["stop_grace_period"].rstrip("s")) > drain, name


def test_k8s_tls_ray_auth_read_only_models_and_grace(compose):
    docs = k8s_docs()
    for d in docs:
        for spec in _pod_specs(d):
            for c in spec["containers"]:
                writes = d["kind"] == "Job"
                for m in c.get("volumeMounts", ()):
                    if m["name"] == "models":
                        assert bool(m.get("readOnly")) != writes, (d["metadata"]["name"], c["name"])
                sc = c.get("securityContext", {})  # Jobs too
                assert sc.get("runAsNonRoot") and sc.get("allowPrivilegeEscalation") is False, c["name"]
                assert sc.get("capabilities", {}).get("drop") == ["ALL"], c["name"]
                if d["kind"] == "RayCluster":
                    assert _env(c)["RAY_AUTH_MODE"] == "token", c["name"]
            if d["kind"] == "Deployment":
                env = _env(spec["containers"][0])
                assert spec["terminationGracePeriodSeconds"] > int(env["TANDEM_DRAIN_S"]), d["metadata"]["name"]
    deployments = {d["metadata"]["name"]: d["spec"]["template"]["spec"]["containers"][0] for d in docs
                   if d["kind"] == "Deployment"}
    v, g = _env(deployments["tandem-verifier"]), _env(deployments["tandem-gateway"])
    assert v["TANDEM_TLS_CERT"] and v["TANDEM_TLS_KEY"] and v["RAY_AUTH_MODE"] == "token"
    assert g["TANDEM_TLS_CA"] and g["TANDEM_SALT_SECRET_FILE"] and g["TANDEM_METRICS_KEYS_FILE"]
    assert int(v["TANDEM_KEY_SESSIONS"]) > 0 and int(g["TANDEM_KEY_CONCURRENCY"]) > 0
    assert "--tls-ca" in deployments["tandem-verifier"]["readinessProbe"]["exec"]["command"]
    assert deployments["tandem-gateway"]["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"


def test_k8s_network_policies_keep_everyone_but_the_front_off_ray_and_metrics():
    policies = {d["metadata"]["name"]: d["spec"] for d in k8s_docs() if d["kind"] == "NetworkPolicy"}
    deny = policies["tandem-default-deny"]
    assert deny["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "tandem"} and "ingress" not in deny
    pool = policies["tandem-verifier-pool"]
    allowed = [p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in pool["ingress"][0]["from"]]
    assert sorted(allowed) == ["verifier", "verifier-pool"]  # not the gateway, not the internet
    verifier = policies["tandem-verifier"]["ingress"]
    metrics = [r for r in verifier if any(p["port"] == 9090 for p in r["ports"])]
    assert metrics and all(r.get("from") for r in metrics)  # the metrics port only from labelled scrapers
    (rc,) = [d for d in k8s_docs() if d["kind"] == "RayCluster"]
    for spec in [rc["spec"]["headGroupSpec"]] + rc["spec"]["workerGroupSpecs"]:
        assert spec["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == "verifier-pool"


def test_the_secrets_script_makes_every_secret_compose_needs(compose, tmp_path):
    import shutil
    import subprocess
    if not shutil.which("openssl"):
        pytest.skip("no openssl")
    subprocess.run(["bash", str(ROOT / "deploy" / "secrets.sh"), str(tmp_path / "secrets")], check=True,
                   capture_output=True)
    for name, secret in compose["secrets"].items():
        path = tmp_path / secret["file"]
        assert path.is_file() and path.stat().st_size > 0, name
    check = subprocess.run(["openssl", "verify", "-CAfile", str(tmp_path / "secrets" / "ca.crt"),
                            str(tmp_path / "secrets" / "tls.crt")], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    sans = subprocess.run(["openssl", "x509", "-in", str(tmp_path / "secrets" / "tls.crt"), "-noout", "-ext",
                           "subjectAltName"], capture_output=True, text=True).stdout
    assert all(n in sans for n in ("DNS:verifier", "DNS:gateway", "DNS:cpu", "IP Address:127.0.0.1"))


def test_compose_scales_workers_and_front_together_and_the_demo_reaches_either_profile(compose):
    s = compose["services"]
    assert s["verifier-worker"]["deploy"]["replicas"] == s["verifier"]["environment"]["TANDEM_REPLICAS"] \
        == "${TANDEM_REPLICAS:-1}"
    demo = s["edge-demo"]["environment"]["TANDEM_VERIFIER"].split(":-")[1].split(":")[0]  # the default host
    gpu_names = {"verifier"}
    cpu_names = {"cpu", *s["cpu"]["networks"]["front"]["aliases"]}
    assert demo in gpu_names and demo in cpu_names
