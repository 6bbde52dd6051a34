"""docker-compose.yml and the Kubernetes base, validated offline (no Docker engine or cluster here),
and checked against the CLI: every command a container runs must exist with the flags it passes."""

from __future__ import annotations

import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
K8S = ROOT / "deploy/k8s/base"


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


def test_compose_file_is_valid():
    if shutil.which("docker-compose"):
        out = subprocess.run(["docker-compose", "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True,
                             cwd=ROOT)
        assert out.returncode == 0, out.stderr
    config = yaml.safe_load(COMPOSE.read_text())
    services = config["services"]
    for name in ("redis", "minio", "proxy", "janitor", "learner", "rollout", "evaluator"):
        assert name in services, f"compose has no {name} service"
    assert "--appendonly" in services["redis"]["command"] and "yes" in services["redis"]["command"]
    assert "gpu" in services["rollout-vllm"]["profiles"]
    assert "vllm" in services["rollout-vllm"]["command"]
    for name in ("proxy", "redis", "minio"):
        assert "healthcheck" in services[name], f"{name} has no health check"
    # the proxy, janitor and ctl run the image without torch
    for name in ("proxy", "janitor", "ctl"):
        assert services[name]["build"]["dockerfile"].endswith("Dockerfile.core")
    installs = [line for line in (ROOT / "deploy/docker/Dockerfile.core").read_text().splitlines() if "pip install" in line]
    assert installs and not any("torch" in line or "[ml" in line for line in installs)


def test_compose_commands_exist_in_the_cli():
    config = yaml.safe_load(COMPOSE.read_text())
    for service in config["services"].values():
        image = service.get("image", "")
        if image.startswith("brigade"):
            assert_cli_accepts(service["command"])


def test_kubernetes_base_validates():
    kv = pytest.importorskip("kubernetes_validate")
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    for resource in kustomization["resources"]:
        path = K8S / resource
        assert path.exists(), f"kustomization lists {resource}, which does not exist"
        for doc in yaml.safe_load_all(path.read_text()):
            kv.validate(doc, "1.30.0", strict=True)
            for container in doc.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
                assert_cli_accepts(container["args"])


def test_rollout_workers_drain_on_sigterm_and_tolerate_spot():
    doc = yaml.safe_load((K8S / "rollout.yaml").read_text())
    pod = doc["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] >= 20
    assert any("spot" in t["key"].lower() or "spot" in str(t.get("value", "")).lower() for t in pod["tolerations"])


def test_systemd_units_run_existing_commands():
    for unit in (ROOT / "deploy/systemd").glob("*.service"):
        exec_line = next(line for line in unit.read_text().splitlines() if line.startswith("ExecStart="))
        args = exec_line.split("brigade ", 1)[1].split()
        assert_cli_accepts(args)
