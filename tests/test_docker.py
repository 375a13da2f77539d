"""docker/: checked statically (no Docker engine runs here): services, commands, ports, volumes,
versions, and that every Flower flag used exists in the flwr CLIs of the locked version."""

import re
import subprocess
import sys
import tomllib
from functools import cache
from pathlib import Path

import yaml
from flwr.common.config import parse_config_args

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
BIN = Path(sys.executable).parent
CLI = {"superlink": "flower-superlink", "supernode": "flower-supernode", "superexec": "flower-superexec"}


def locked_flwr() -> str:
    lock = tomllib.loads((ROOT / "uv.lock").read_text())
    return next(p["version"] for p in lock["package"] if p["name"] == "flwr")


@cache
def cli_flags(tool: str) -> set[str]:
    out = subprocess.run([str(BIN / CLI[tool]), "--help"], capture_output=True, text=True, check=True).stdout
    return set(re.findall(r"(--[a-z][a-z0-9-]+)", out))


def compose(name="compose.yml"):
    return yaml.safe_load((DOCKER / name).read_text())


def role(service: dict) -> str:
    dockerfile = service.get("build", {}).get("dockerfile", "")
    return re.search(r"Dockerfile\.(\w+)", dockerfile).group(1)


def test_dockerfiles_use_the_official_images_at_the_locked_version():
    version = locked_flwr()
    for tool in CLI:
        text = (DOCKER / f"Dockerfile.{tool}").read_text()
        assert f"ARG FLWR_VERSION={version}" in text and f"FROM flwr/{tool}:${{FLWR_VERSION}}" in text
        assert "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1" in text
    superexec = (DOCKER / "Dockerfile.superexec").read_text()
    assert "uv export --frozen --no-dev" in superexec and "COPY pyproject.toml uv.lock" in superexec
    assert f"FLWR_VERSION:-{version}" in (DOCKER / "compose.yml").read_text()


def test_every_flag_exists_in_the_flwr_clis():
    for name, service in compose()["services"].items():
        if name == "certs":
            continue
        flags = {a for a in service["command"] if isinstance(a, str) and a.startswith("--")}
        unknown = flags - cli_flags(role(service))
        assert not unknown, f"{name}: {sorted(unknown)} not in {CLI[role(service)]} {locked_flwr()}"


def test_topology_tls_data_and_state():
    services = compose()["services"]
    link = services["superlink"]
    assert link["ports"] == ["8000:8000"] and "--insecure" not in link["command"]
    for flag in ("--ssl-ca-certfile", "--ssl-certfile", "--ssl-keyfile", "--disable-runtime-dependency-installation"):
        assert flag in link["command"]
    assert link["command"][link["command"].index("--isolation") + 1] == "process"
    assert link["depends_on"]["certs"]["condition"] == "service_completed_successfully"
    assert "/app/deploy.py certs" in services["certs"]["command"][0] and "--name superlink" in services["certs"]["command"][0]
    serverapp = services["superexec-serverapp"]["command"]
    assert serverapp[serverapp.index("--runtime-api-address") + 1] == "superlink:8000" and "--root-certificates" in serverapp

    nodes = {n: s for n, s in services.items() if n.startswith("supernode-")}
    assert len(nodes) >= 3
    partitions = []
    for name, node in nodes.items():
        cmd = node["command"]
        assert "--root-certificates" in cmd and "--insecure" not in cmd
        assert cmd[cmd.index("--superlink") + 1] == "superlink:8000"
        config = parse_config_args([cmd[cmd.index("--node-config") + 1]])
        assert config["num-partitions"] == len(nodes) and config["data-dir"] == "/data"
        partitions.append(config["partition-id"])
        executor = services["superexec-clientapp-" + name.split("-")[1]]
        assert executor["command"][executor["command"].index("--runtime-api-address") + 1] == f"{name}:9094"
        volumes = executor["volumes"]
        assert any(v.endswith(":/data:ro") for v in volumes)  # data read-only where ClientApps run
        assert any(v.endswith(":" + config["state-dir"]) for v in volumes)  # client state on a volume
    assert sorted(partitions) == list(range(len(nodes)))


def test_gpu_override_reserves_a_gpu_for_every_clientapp_service():
    base, gpu = compose()["services"], compose("compose.gpu.yml")["services"]
    clientapps = {n for n in base if n.startswith("superexec-clientapp-")}
    assert set(gpu) == clientapps
    for service in gpu.values():
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"] and device["count"] == 1
