"""The deploy files, validated offline (no Docker engine, cluster or cloud here) with each tool's own
checker where one is installed, and checked against the CLI: every command a container, unit or job
runs must exist with the flags it passes. Each mistake the deploy files once had has a check here:
unpinned images, a compose `ctl` that ran a missing command, no HF_HOME in the cache volumes, images
that run as root or reinstall dependencies on every code change, torch installed over vLLM's,
rollout units sharing GPU 0, SkyPilot's `-n 4` and plain-env secrets, a k8s base without an images
mapping, a model cache or a headless Service, and an HF Jobs command fed to `vllm serve`."""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from brigade.rpc import open_channel

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
K8S = ROOT / "deploy/k8s/base"
DOCKER = ROOT / "deploy/docker"
SKYPILOT = ROOT / "deploy/skypilot/rollout-spot.yaml"
SYSTEMD = ROOT / "deploy/systemd"
CONSTRAINTS = ROOT / "constraints.txt"
PINNED_TAG = re.compile(r":v?\d+(\.\d+)+[\w.-]*$")  # a full version, never latest or a bare major


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned_names() -> dict[str, str]:
    lines = [line for line in CONSTRAINTS.read_text().splitlines() if line and not line.startswith("#")]
    return {canonical(line.split("==")[0]): line.split("==")[1] for line in lines}


@cache
def cli_help(command: str) -> str:
    out = subprocess.run([sys.executable, "-m", "brigade_cli.main", *command.split(), "--help"],
                         capture_output=True, text=True, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, f"`brigade {command}` does not exist: {out.stderr[-500:]}"
    return out.stdout


def assert_cli_accepts(args: list[str]) -> None:
    command = args[0] if args[0] != "ctl" else f"ctl {args[1]}"
    text = cli_help(command)
    for flag in (a for a in args if a.startswith("--")):
        assert flag in text, f"`brigade {command}` has no flag {flag}"


def compose_args(service: dict) -> list[str]:
    """What `brigade` gets in a service's container: its entrypoint after `brigade`, then its command."""
    entrypoint = service.get("entrypoint", ["brigade"])
    assert entrypoint[0] == "brigade", entrypoint
    return [*entrypoint[1:], *service["command"]]


def test_compose_file_is_valid():
    if shutil.which("docker-compose"):
        out = subprocess.run(["docker-compose", "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True,
                             cwd=ROOT)
        assert out.returncode == 0, out.stderr
    config = yaml.safe_load(COMPOSE.read_text())
    services = config["services"]
    for name in ("redis", "s3", "proxy", "janitor", "learner", "rollout", "evaluator"):
        assert name in services, f"compose has no {name} service"
    assert "--appendonly" in services["redis"]["command"] and "yes" in services["redis"]["command"]
    assert "gpu" in services["rollout-vllm"]["profiles"]
    assert "vllm" in services["rollout-vllm"]["command"]
    for name in ("proxy", "redis", "s3"):
        assert "healthcheck" in services[name], f"{name} has no health check"
    # the proxy, janitor and ctl run the image without torch
    for name in ("proxy", "janitor", "ctl"):
        assert services[name]["build"]["dockerfile"].endswith("Dockerfile.core")
    installs = [line for line in (ROOT / "deploy/docker/Dockerfile.core").read_text().splitlines() if "pip install" in line]
    assert installs and not any("torch" in line or "[ml" in line for line in installs)


def test_compose_images_are_pinned_and_the_store_honours_create_only():
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    for name, service in services.items():
        assert PINNED_TAG.search(service["image"]), f"{name}: image {service['image']} is not pinned to a version"
    # MinIO's community image is frozen (October 2025); the S3 server must be a maintained one that
    # refuses a second If-None-Match: * put (the services probe it at start, see brigade.bucket.probe)
    assert not any("minio" in service["image"] for service in services.values())
    assert services["s3"]["image"].startswith("versity/versitygw:")


def test_compose_commands_exist_in_the_cli():
    config = yaml.safe_load(COMPOSE.read_text())
    for service in config["services"].values():
        image = service.get("image", "")
        if image.startswith("brigade"):
            assert_cli_accepts(compose_args(service))
    # `docker compose run --rm ctl X` replaces the command: the entrypoint must make it `brigade ctl X`
    ctl = config["services"]["ctl"]
    assert ctl["entrypoint"] == ["brigade", "ctl"]
    documented = re.findall(r"docker compose run --rm ctl ([a-z]+)", COMPOSE.read_text())
    assert documented
    for subcommand in documented:
        assert_cli_accepts(["ctl", subcommand])


def test_compose_models_land_in_the_cache_volume_and_spot_workers_exit_when_finished():
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    for name, service in services.items():
        mounts = [v.split(":")[1] for v in service.get("volumes", []) if v.startswith("model-cache:")]
        if mounts:
            env = service["environment"]
            assert env["HF_HOME"].startswith(mounts[0] + "/"), f"{name}: HF_HOME is outside the model cache"
            assert env["BRIGADE_CACHE"] == mounts[0], name
    for name in ("rollout", "rollout-vllm"):
        assert "--exit-when-finished" in services[name]["command"]
        assert services[name]["restart"] == "on-failure", f"{name}: exit 0 at the end of the run must stay down"


# ---------------------------------------------------------------- images and the constraints file


def dockerfile_steps(path: Path) -> list[str]:
    """The instructions, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n\s*", " ", path.read_text())
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


@pytest.mark.parametrize("dockerfile", sorted(p.name for p in DOCKER.glob("Dockerfile.*")))
def test_images_install_pinned_dependencies_before_the_code_and_run_as_a_user(dockerfile):
    steps = dockerfile_steps(DOCKER / dockerfile)
    assert PINNED_TAG.search(steps[0].split()[1]), f"{dockerfile}: base image not pinned: {steps[0]}"
    installs = [i for i, step in enumerate(steps) if "pip install" in step]
    assert installs
    for i in installs:
        assert " -c " in steps[i], f"{dockerfile}: an install without constraints: {steps[i]}"
    # dependencies from the pyproject files alone, then the code: a code change reuses the dependency layer
    code = next(i for i, step in enumerate(steps) if step == "COPY libs/brigade libs/brigade")
    deps = next(i for i in installs if "requirements.py" in steps[i])
    assert deps < code
    folders = re.findall(r'"?([\w/]+)(?:\[[\w,]+\])?"?', steps[deps].split("requirements.py", 1)[1].split(">")[0])
    copied = {step.split()[-1].rstrip("/") for step in steps[:deps] if step.startswith("COPY") and "pyproject" in step}
    assert set(folders) <= copied, f"{dockerfile}: requirements.py reads pyprojects it was not given"
    assert all("--no-deps" in steps[i] for i in installs if i > code), "code installs must resolve nothing"
    users = [step for step in steps if step.startswith("USER ")]
    assert users and users[-1] != "USER root", f"{dockerfile} runs as root"
    assert steps[-1] == 'ENTRYPOINT ["brigade"]'
    if dockerfile != "Dockerfile.core":
        env = " ".join(step for step in steps if step.startswith("ENV "))
        assert "HF_HOME=/cache/" in env and "BRIGADE_CACHE=/cache" in env


def test_the_vllm_image_keeps_vllms_torch():
    steps = dockerfile_steps(DOCKER / "Dockerfile.vllm")
    assert steps[0].startswith("FROM vllm/vllm-openai:v")
    for step in steps:
        if "pip install" in step:
            assert "torch" not in step.split("pip install", 1)[1], step
            assert "-c vllm-pins.txt" in step, f"what vLLM's image holds must constrain every install: {step}"


def test_constraints_pin_every_dependency_and_every_install_uses_them():
    pins = pinned_names()
    assert pins["torch"] == "2.13.0"
    requirements = subprocess.run(
        [sys.executable, str(DOCKER / "requirements.py"), "libs/brigade[ml]", "libs/brigade_cli[plots]",
         "libs/brigade_harness", "libs/brigade_testing",
         *(str(p.parent.relative_to(ROOT)) for p in ROOT.glob("services/*/pyproject.toml")),
         "bench"], capture_output=True, text=True, cwd=ROOT, check=True).stdout.split()
    dev = [line for line in (ROOT / "requirements-dev.txt").read_text().splitlines()
           if line and not line.startswith(("#", "-e"))]
    for req in requirements + dev:
        name = canonical(re.match(r"[\w.-]+", req).group(0))
        assert name in pins, f"{req} is not pinned in constraints.txt (run make lock)"
    makefile = (ROOT / "Makefile").read_text()
    rule = makefile.split("$(VENV_OK):", 1)[1].split("\n\n", 1)[0]
    assert "$(CONSTRAINTS)" in rule.splitlines()[0], "the venv must be rebuilt when constraints.txt changes"
    assert all("-c $(CONSTRAINTS)" in line for line in rule.splitlines() if "pip install" in line)
    assert "\nlock:" in makefile and "pytest" in makefile.split("\nlock:", 1)[1].split("\n\n", 1)[0]


def render_kustomization() -> list[dict]:
    """The base as `kubectl apply -k` sends it: kubectl's kustomize where installed, else the three
    transformations the base uses (namespace, labels, images), applied here."""
    if shutil.which("kubectl"):
        out = subprocess.run(["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return [doc for doc in yaml.safe_load_all(out.stdout) if doc]
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    images = {i["name"]: i for i in kustomization["images"]}
    labels = {k: v for entry in kustomization.get("labels", []) for k, v in entry["pairs"].items()}
    docs = []
    for resource in kustomization["resources"]:
        path = K8S / resource
        assert path.exists(), f"kustomization lists {resource}, which does not exist"
        for doc in (d for d in yaml.safe_load_all(path.read_text()) if d):
            if doc["kind"] != "Namespace":
                doc["metadata"]["namespace"] = kustomization["namespace"]
            doc["metadata"].setdefault("labels", {}).update(labels)
            for container in pod_spec(doc).get("containers", []):
                name = container["image"].split(":")[0]
                if name in images:
                    container["image"] = f"{images[name]['newName']}:{images[name]['newTag']}"
            docs.append(doc)
    return docs


def pod_spec(doc: dict) -> dict:
    return doc.get("spec", {}).get("template", {}).get("spec", {})


def test_kubernetes_base_validates():
    kv = pytest.importorskip("kubernetes_validate")
    docs = render_kustomization()
    assert {d["kind"] for d in docs} >= {"Namespace", "ConfigMap", "Secret", "Deployment", "Job", "Service"}
    for doc in docs:
        kv.validate(doc, "1.30.0", strict=True)
        for container in pod_spec(doc).get("containers", []):
            assert_cli_accepts(container["args"])
            # every image goes through the kustomization's images mapping, to a pinned tag
            assert container["image"].startswith("ghcr.io/your-org/brigade-"), container["image"]
            assert PINNED_TAG.search(container["image"]), container["image"]


def test_kubernetes_pods_cache_models_run_as_a_user_and_reach_every_proxy():
    docs = {(d["kind"], d["metadata"]["name"]): d for d in render_kustomization()}
    config = docs[("ConfigMap", "brigade-config")]["data"]
    assert config["HF_HOME"].startswith(config["BRIGADE_CACHE"] + "/")
    for (_, name), doc in docs.items():
        pod = pod_spec(doc)
        if not pod:
            continue
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        if "brigade-ml" in str(pod) or "brigade-vllm" in str(pod):
            mounts = {m["mountPath"]: m["name"] for c in pod["containers"] for m in c.get("volumeMounts", [])}
            assert mounts.get(config["BRIGADE_CACHE"]) == "model-cache", f"{name} has no model cache at /cache"
    # a ClusterIP would pin each client's HTTP/2 connection to one replica
    assert docs[("Service", "brigade-proxy")]["spec"]["clusterIP"] == "None"


class CountingHealth(health.aio.HealthServicer):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    async def Check(self, request, context):
        self.calls += 1
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


def test_clients_spread_calls_over_every_address_a_name_resolves_to():
    """What the headless Service relies on: a proxy name with two addresses gets calls on both."""
    async def main() -> list[int]:
        servers, servicers, ports = [], [], []
        for _ in range(2):
            server, servicer = grpc.aio.server(), CountingHealth()
            health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
            ports.append(server.add_insecure_port("127.0.0.1:0"))
            await server.start()
            servers.append(server)
            servicers.append(servicer)
        channel = open_channel("ipv4:" + ",".join(f"127.0.0.1:{p}" for p in ports))
        try:
            stub = health_pb2_grpc.HealthStub(channel)
            for _ in range(20):
                await stub.Check(health_pb2.HealthCheckRequest(), timeout=5, wait_for_ready=True)
        finally:
            await channel.close()
            for server in servers:
                await server.stop(0)
        return [s.calls for s in servicers]

    calls = asyncio.run(main())
    assert sum(calls) == 20 and min(calls) >= 5, calls


def test_rollout_workers_drain_on_sigterm_and_tolerate_spot():
    doc = yaml.safe_load((K8S / "rollout.yaml").read_text())
    pod = doc["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] >= 20
    assert any("spot" in t["key"].lower() or "spot" in str(t.get("value", "")).lower() for t in pod["tolerations"])


def test_systemd_units_run_existing_commands():
    for unit in SYSTEMD.glob("*.service"):
        exec_line = next(line for line in unit.read_text().splitlines() if line.startswith("ExecStart="))
        args = exec_line.split("brigade ", 1)[1].split()
        assert_cli_accepts(args)


def test_systemd_units_verify(tmp_path):
    """`systemd-analyze verify` on each unit (the template as instance @0), with ExecStart pointed at
    this checkout's `brigade` (verify insists the binary exists); any complaint fails."""
    if not shutil.which("systemd-analyze"):
        pytest.skip("systemd-analyze is not installed")
    brigade = Path(sys.executable).parent / "brigade"
    assert brigade.exists()
    units = []
    for unit in SYSTEMD.glob("*.service"):
        copy = tmp_path / unit.name.replace("@.", "@0.")
        copy.write_text(unit.read_text().replace("/opt/brigade/.venv/bin/brigade", str(brigade)))
        units.append(str(copy))
    out = subprocess.run(["systemd-analyze", "verify", *units], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and not (out.stdout + out.stderr).strip(), out.stdout + out.stderr


def test_systemd_rollout_units_take_one_gpu_each_and_models_have_a_home():
    unit = (SYSTEMD / "brigade-rollout@.service").read_text()
    assert "Environment=CUDA_VISIBLE_DEVICES=%i" in unit
    assert "--exit-when-finished" in unit and "Restart=on-failure" in unit
    for name in ("brigade-rollout@.service", "brigade-learner.service", "brigade-evaluator.service"):
        text = (SYSTEMD / name).read_text()
        assert "CacheDirectory=brigade" in text and "HF_HOME=/var/cache/brigade/" in text, name
    readme = (ROOT / "deploy/README.md").read_text()
    assert "brigade-rollout@0" in readme and "--create-home" in readme  # GPUs count from 0


# ---------------------------------------------------------------- SkyPilot and Hugging Face Jobs


SKYPILOT_PYTHON = ROOT / ".venv-skypilot/bin/python"  # `make install`: SkyPilot pins click below typer's
VALIDATE_TASK = """
import sys, yaml
from sky.utils import common_utils, schemas
common_utils.validate_schema(yaml.safe_load(sys.stdin), schemas.get_task_schema(), "Invalid task YAML: ")
"""


def skypilot_validates(text: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(SKYPILOT_PYTHON), "-c", VALIDATE_TASK], input=text, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.skipif(not SKYPILOT_PYTHON.exists(), reason="no .venv-skypilot (`make install` creates it)")
def test_skypilot_task_matches_skypilots_schema():
    """Validated by SkyPilot's own schema (sky.utils.schemas), in the venv `make install` gives SkyPilot."""
    text = SKYPILOT.read_text()
    out = skypilot_validates(text)
    assert out.returncode == 0, out.stderr[-2000:]
    broken = skypilot_validates(text + "\nsecret_envs: {A: b}\n")  # a field SkyPilot does not have
    assert broken.returncode != 0 and "secret_envs" in broken.stderr, broken.stderr[-2000:]


def test_skypilot_task_keeps_secrets_secret_and_ends_with_the_run():
    text = SKYPILOT.read_text()
    task = yaml.safe_load(text)
    secret = {"BRIGADE_TOKEN", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
    assert secret <= set(task["secrets"]) and not secret & set(task["envs"])
    assert all(value is None for value in task["secrets"].values()), "secret values never live in the task"
    assert task["envs"]["BRIGADE_EXIT_WHEN_FINISHED"] == "1"
    assert "HF_HOME" in task["envs"]
    # `-n` is --name; a fleet is --num-jobs
    assert not re.search(r"\s-n\s+\d", text) and "sky jobs launch" in text and "--num-jobs" in text
    command = task["run"].replace("\\\n", " ").split("brigade ", 1)[1].split()
    assert_cli_accepts(command)
    assert "--exit-when-finished" in command


def test_hf_jobs_example_runs_brigade_not_vllm_serve():
    text = (ROOT / "deploy/hf-jobs/README.md").read_text()
    job = text[text.index("hf jobs run"):].split("\n\n", 1)[0]
    assert "vllm/vllm-openai" not in job and "bash -c" not in job
    image_line = next(line for line in job.splitlines() if "brigade-vllm:" in line)
    assert PINNED_TAG.search(image_line.strip().rstrip("\\").strip())
    args = next(line for line in job.splitlines() if line.strip().startswith("rollout ")).split()
    assert_cli_accepts(args)
    assert "--exit-when-finished" in args
