"""docs/deploy.md's steps for users, held to the files they name and, where this machine can, run: the openai SDK
with the stack's private CA against a gateway over TLS with deploy/secrets.sh's certificate; the Kubernetes Secrets
the manifests read, each created by the documented kubectl command from files secrets.sh makes; bringing your own
model into compose and Kubernetes (the services, claim, images, variables and commands named exist and parse).
(clients/web/README.md's example is run by tests/test_dist.py, from the packed client.)"""
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from tandem.orchestrator import cli

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "deploy.md").read_text()
STEPS = DOC[DOC.index("### Calling the stack"):DOC.index("## A pool of verifiers")]  # the sections for users


def section(title: str) -> str:
    start = STEPS.index(title)
    end = STEPS.find("\n### ", start + 1)
    return STEPS[start:end if end > 0 else len(STEPS)]


def blocks(text: str, lang: str) -> list[str]:
    """The ```lang blocks of ``text``, dedented (a block inside a list item is indented)."""
    out = []
    for indent, body in re.findall(rf"^( *)```{lang}\n(.*?)^\1```", text, re.M | re.S):
        out.append("\n".join(line[len(indent):] for line in body.splitlines()) + "\n")
    return out


def commands(text: str) -> list[list[str]]:
    """Every shell command in ``text``'s sh blocks, continuation lines joined, heredoc bodies left out."""
    out = []
    for block in blocks(text, "sh"):
        block = re.sub(r"<<'EOF'\n.*?\nEOF\n", "\n", block, flags=re.S).replace("\\\n", " ")
        out += [argv for line in block.splitlines() if (argv := shlex.split(line, comments=True))]
    return out


def tandem_argv(argv: list[str]) -> list[str] | None:
    """The `tandem ...` part of a command (after VAR=value prefixes, or inside `docker compose run ... SERVICE`)."""
    return argv[argv.index("tandem"):] if "tandem" in argv else None


def test_the_openai_sdk_with_the_stacks_ca_reaches_the_gateway_over_tls(tmp_path):
    """The documented Python, as written, against a gateway serving secrets.sh's certificate: the private CA is what
    makes it connect (the same call with the system's roots is refused), and the documented curl works too."""
    import uvicorn

    from scripted_gateway import FakeClient
    from tandem.core.auth import ApiKeys
    from tandem.orchestrator.gateway.app import create_app, server_options
    from tandem.orchestrator.gateway.config import GatewayConfig
    from tandem.orchestrator.gateway.drafter_pool import DrafterPool

    if not shutil.which("openssl"):
        pytest.fail("openssl is not installed (deploy/secrets.sh needs it)")
    subprocess.run(["bash", str(ROOT / "deploy" / "secrets.sh"), "secrets"], cwd=tmp_path, check=True,
                   capture_output=True)
    key = (tmp_path / "secrets" / "api_keys").read_text().split()[0]
    config = GatewayConfig(keys=ApiKeys.of([key]), model_name="tandem")
    app = create_app(DrafterPool([FakeClient(script=["Hello", " from", " the stack"])]), config)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                           ssl_certfile=str(tmp_path / "secrets" / "tls.crt"),
                                           ssl_keyfile=str(tmp_path / "secrets" / "tls.key"), **server_options(config)))
    threading.Thread(target=server.run, daemon=True).start()
    try:
        while not server.started:
            time.sleep(0.02)
        port = server.servers[0].sockets[0].getsockname()[1]
        (python,) = blocks(section("### Calling the stack"), "python")
        assert "localhost:8000" in python and "secrets/ca.crt" in python
        script = python.replace("localhost:8000", f"localhost:{port}")
        r = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr[-3000:]
        assert r.stdout.startswith("Hello from the stack {") and "'verify_forwards'" in r.stdout, r.stdout
        # without the CA: the system's roots do not know it
        plain = script.replace('ssl.create_default_context(cafile="secrets/ca.crt")', "ssl.create_default_context()")
        r = subprocess.run([sys.executable, "-c", plain], cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and "CERTIFICATE_VERIFY_FAILED" in r.stderr, r.stderr[-2000:]
        (curl,) = blocks(section("### Calling the stack"), "sh")
        if shutil.which("curl"):
            r = subprocess.run(["bash", "-c", curl.replace("localhost:8000", f"localhost:{port}")], cwd=tmp_path,
                               capture_output=True, text=True, timeout=60)
            assert r.returncode == 0 and '"id": "tandem"' in r.stdout.replace('":"', '": "'), r.stdout + r.stderr
    finally:
        server.should_exit = True


def manifests() -> list[dict]:
    return [d for f in sorted((ROOT / "deploy" / "k8s").glob("*.yaml")) for d in yaml.safe_load_all(f.read_text())
            if d]


def pod_specs() -> list[dict]:
    specs = []
    for d in manifests():
        if d["kind"] in ("Deployment", "Job"):
            specs.append(d["spec"]["template"]["spec"])
        elif d["kind"] == "RayCluster":
            specs += [g["template"]["spec"] for g in [d["spec"]["headGroupSpec"], *d["spec"]["workerGroupSpecs"]]]
    return specs


def secrets_read() -> dict[str, set[str]]:
    """Each Secret the manifests mount, and the keys their containers read (a path under its mount, named in an
    environment value or a probe's command)."""
    read: dict[str, set[str]] = {}
    for spec in pod_specs():
        volumes = {v["name"]: v["secret"]["secretName"] for v in spec.get("volumes", []) if "secret" in v}
        for c in spec["containers"]:
            probes = [c.get(p) for p in ("startupProbe", "readinessProbe", "livenessProbe")]
            text = yaml.safe_dump({"env": c.get("env"), "probes": probes})
            for m in c.get("volumeMounts", []):
                if m["name"] in volumes:
                    keys = set(re.findall(re.escape(m["mountPath"].rstrip("/")) + r"/([\w.-]+)", text))
                    assert keys, (m, "a mounted Secret nothing reads")
                    read.setdefault(volumes[m["name"]], set()).update(keys)
    return read


def test_the_documented_kubectl_steps_create_every_secret_the_manifests_read(tmp_path):
    steps = section("### Kubernetes, step by step")
    created: dict[str, dict[str, str]] = {}
    for argv in commands(steps):
        if argv[:4] == ["kubectl", "create", "secret", "generic"]:
            files = dict(a.split("=", 2)[1:] for a in argv if a.startswith("--from-file="))
            created[argv[4]] = files
            if argv[4] == "tandem-tls":
                assert "--type=kubernetes.io/tls" in argv
    read = secrets_read()
    assert set(created) == set(read), (sorted(created), sorted(read))
    for name, keys in read.items():
        assert keys <= set(created[name]), (name, keys, created[name])
    # the table names the same Secrets and keys
    table = dict(re.findall(r"^ *\| `(tandem-[\w-]+)` \| (.+?) \|", steps, re.M))
    assert set(table) == set(read) and all(set(re.findall(r"`([\w.]+)`", table[n])) == read[n] for n in read)
    # the files come from secrets.sh run as documented; the certificate names the Service the gateway dials
    (make,) = [a for a in commands(steps) if "deploy/secrets.sh" in a]
    env = dict(a.split("=", 1) for a in make[:make.index("deploy/secrets.sh")])
    subprocess.run(["bash", str(ROOT / "deploy" / "secrets.sh"), *make[make.index("deploy/secrets.sh") + 1:]],
                   cwd=tmp_path, env={"PATH": "/usr/bin:/bin", **env}, check=True, capture_output=True)
    for files in created.values():
        assert all((tmp_path / path).is_file() for path in files.values()), files
    sans = subprocess.run(["openssl", "x509", "-in", str(tmp_path / created["tandem-tls"]["tls.crt"]), "-noout",
                           "-ext", "subjectAltName"], capture_output=True, text=True).stdout
    gateway_dials = next(e["value"] for spec in pod_specs() for c in spec["containers"] for e in c.get("env", [])
                         if e["name"] == "TANDEM_GATEWAY_VERIFIER").split(":")[0]
    assert f"DNS:{gateway_dials}," in sans + ",", sans


def test_the_documented_kubernetes_steps_name_what_the_manifests_define():
    steps = section("### Kubernetes, step by step")
    docs = manifests()
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    images = {c["image"] for spec in pod_specs() for c in spec["containers"]}
    claim = next(d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim")
    for argv in commands(steps):
        for a in argv:
            if a.startswith("deploy/k8s/"):
                assert (ROOT / a).is_file(), a
        if argv[:2] == ["kubectl", "wait"] and argv[-1].startswith("job/"):
            assert ("Job", argv[-1].split("/")[1]) in names, argv
        if argv[:2] == ["kubectl", "rollout"] or argv[:3] == ["kubectl", "set", "env"]:
            target = next(a for a in argv if a.startswith("deployment/"))
            assert ("Deployment", target.split("/")[1]) in names, argv
        if argv[:3] == ["kubectl", "set", "env"]:
            assert all(a.split("=")[0] in cli.env_keys() for a in argv[4:]), argv
        if argv[:2] == ["kubectl", "port-forward"]:
            service = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == argv[2].split("/")[1])
            assert int(argv[3].split(":")[1]) in {p["port"] for p in service["spec"]["ports"]}, argv
    (pod,) = [yaml.safe_load(b.split("<<'EOF'\n", 1)[1].split("\nEOF\n")[0]) for b in blocks(steps, "sh")
              if "<<'EOF'" in b]
    assert pod["kind"] == "Pod" and pod["spec"]["containers"][0]["image"] in images
    assert pod["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] == claim
    assert not pod["spec"]["volumes"][0]["persistentVolumeClaim"].get("readOnly")  # it writes
    mount = pod["spec"]["containers"][0]["volumeMounts"][0]["mountPath"]
    assert "kubectl cp" in steps and f"tandem-models-copy:{mount}/" in steps
    # what the pods read the models from is where it was copied
    assert all(any(m["mountPath"] == mount for m in c.get("volumeMounts", []) if m["name"] == "models")
               for spec in pod_specs() for c in spec["containers"] if any(v["name"] == "models" for v in
                                                                         spec.get("volumes", [])))


def test_your_own_model_in_compose_uses_its_services_and_real_settings():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    steps = section("### Your own model in the compose stack")
    for argv in commands(steps):
        assert argv[:2] == ["docker", "compose"] or "docker" in argv, argv
        if "run" in argv:
            service = "models-init"
            assert service in argv and argv[argv.index("--profile") + 1] in services[service]["profiles"]
            assert not any(v.endswith(":ro") for v in services[service]["volumes"])  # it writes the volume
        if "up" in argv:
            assert argv[argv.index("--profile") + 1] in {p for s in services.values() for p in s.get("profiles", [])}
        for assignment in (a for a in argv if re.fullmatch(r"TANDEM_\w+=.*", a)):
            name = assignment.split("=")[0]
            used = [s for s, svc in services.items()
                    if re.search(r"\$\{" + name + r"(:-|\})", str(svc.get("environment")))]
            assert used, f"{name} reaches no service of the compose file"
        if argv_t := tandem_argv(argv):
            cli.parser().parse_args(argv_t[1:])  # (exits on a flag it does not know)
    # the volume the copy writes is the one the services read
    assert any(v.startswith("models:/models") for v in services["models-init"]["volumes"])
    (override,) = blocks(steps, "yaml")
    for name, svc in yaml.safe_load(override)["services"].items():
        assert name in services, name
        assert set(svc["environment"]) <= cli.env_keys()
        assert all(v.startswith("/models/") for v in svc["environment"].values())
