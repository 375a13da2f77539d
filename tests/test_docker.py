"""docker/ checked statically (the compose demo itself runs in tests/test_compose.py when an engine is
there): services, commands, ports, volumes, node authentication, the loopback override, the local
stand-in images, versions, and that every Flower flag used exists in the flwr CLIs of the locked
version."""

import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import yaml
from flwr.common.config import parse_config_args

from tools.compose_demo import locked_flwr

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
BIN = Path(sys.executable).parent
CLI = {"superlink": "flower-superlink", "supernode": "flower-supernode", "superexec": "flower-superexec"}


#: the entrypoint of the ClientApp services: tools/superexec.py as the Dockerfile copies it
WARM_SUPEREXEC = ["python", "/app/superexec.py"]


@cache
def cli_flags(tool: str, warm: bool = False) -> set[str]:
    """The flags of Flower's CLI ``tool``, or of tools/superexec.py (``warm``)."""
    cmd = [sys.executable, str(ROOT / "tools" / "superexec.py")] if warm else [str(BIN / CLI[tool])]
    out = subprocess.run([*cmd, "--help"], capture_output=True, text=True, check=True).stdout
    return set(re.findall(r"(--[a-z][a-z0-9-]+)", out))


class ComposeLoader(yaml.SafeLoader):
    """YAML with compose's ``!reset`` tag, read as ``{"!reset": value}``."""


ComposeLoader.add_constructor("!reset", lambda loader, node: {"!reset": loader.construct_sequence(node)})


def compose(name="compose.yml"):
    return yaml.load((DOCKER / name).read_text(), Loader=ComposeLoader)


def role(service: dict) -> str:
    """superlink | supernode | superexec, from the service's image name."""
    return re.fullmatch(r"mheterofl-(\w+):\$\{FLWR_VERSION:-[\d.]+\}", service["image"]).group(1)


def flower_services(services: dict) -> dict:
    """The services that run a Flower CLI or tools/superexec.py (not the one-shot shell services)."""
    return {n: s for n, s in services.items() if s.get("entrypoint", WARM_SUPEREXEC) == WARM_SUPEREXEC}


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
    base, loopback = compose()["services"], compose("compose.loopback.yml")["services"]
    for name, service in flower_services(base).items():
        for command in (service["command"], loopback.get(name, {}).get("command", [])):
            flags = {a for a in command if isinstance(a, str) and a.startswith("--")}
            unknown = flags - cli_flags(role(service), "entrypoint" in service)
            assert not unknown, f"{name}: {sorted(unknown)} not in {CLI[role(service)]} {locked_flwr()}"


def test_topology_tls_data_and_state():
    services = compose()["services"]
    link = services["superlink"]
    assert link["ports"] == ["127.0.0.1:8000:8000"] and "--insecure" not in link["command"]
    # the Control API shares the port: nothing but the SuperLink publishes, and only on loopback
    assert [name for name, service in services.items() if service.get("ports")] == ["superlink"]
    from tools.deploy import TASK_POLL_SECONDS

    for name, service in services.items():  # SuperExecs look for tasks as often as tools.deploy's do
        if name.startswith("superexec"):
            assert float(service["environment"]["FLWR_SUPEREXEC_TASK_POLL_INTERVAL"]) == TASK_POLL_SECONDS, name
    for flag in (
        "--ssl-ca-certfile",
        "--ssl-certfile",
        "--ssl-keyfile",
        "--disable-runtime-dependency-installation",
        "--enable-supernode-auth",
    ):
        assert flag in link["command"]
    assert link["command"][link["command"].index("--isolation") + 1] == "process"
    assert link["depends_on"]["certs"]["condition"] == "service_completed_successfully"
    assert (
        "/app/deploy.py certs" in services["certs"]["command"][0]
        and "--name superlink" in services["certs"]["command"][0]
    )
    serverapp = services["superexec-serverapp"]["command"]
    assert (
        serverapp[serverapp.index("--runtime-api-address") + 1] == "superlink:8000"
        and "--root-certificates" in serverapp
    )

    nodes = {n: s for n, s in services.items() if n.startswith("supernode-")}
    assert len(nodes) >= 3
    partitions, registered = [], []
    for name, node in nodes.items():
        cmd = node["command"]
        assert "--root-certificates" in cmd and "--insecure" not in cmd
        assert cmd[cmd.index("--superlink") + 1] == "superlink:8000"
        # node authentication: its own key, registered before any SuperNode starts
        key = cmd[cmd.index("--auth-supernode-private-key") + 1]
        assert key == f"/keys/node-{name.split('-')[1]}" and "node-keys:/keys:ro" in node["volumes"]
        assert node["depends_on"]["register"]["condition"] == "service_completed_successfully"
        registered.append(key + ".pub")
        config = parse_config_args([cmd[cmd.index("--node-config") + 1]])
        assert config["num-partitions"] == len(nodes) and config["data-dir"] == "/data"
        partitions.append(config["partition-id"])
        executor = services["superexec-clientapp-" + name.split("-")[1]]
        assert executor["entrypoint"] == WARM_SUPEREXEC  # warm ClientApp processes, as tools.deploy's
        assert "/app/superexec.py" in (DOCKER / "Dockerfile.superexec").read_text()
        assert executor["command"][executor["command"].index("--runtime-api-address") + 1] == f"{name}:9094"
        volumes = executor["volumes"]
        assert any(v.endswith(":/data:ro") for v in volumes)  # data read-only where ClientApps run
        assert any(v.endswith(":" + config["state-dir"]) for v in volumes)  # client state on a volume
    assert sorted(partitions) == list(range(len(nodes)))
    # the certs service makes one key pair per node; register registers exactly those keys
    assert f"keys --out /keys --nodes {len(nodes)}" in services["certs"]["command"][0]
    register = services["register"]
    assert register["command"][0].split("deploy.py register")[1].split()[-len(nodes) :] == registered
    assert "node-keys:/keys:ro" in register["volumes"] and register["depends_on"] == ["superlink"]
    assert register["environment"]["SUPERLINK"] == "superlink:8000"


def test_each_image_is_built_once():
    services = compose()["services"]
    built = {}
    for name, service in services.items():
        if "build" in service:
            assert service["image"] not in built, f"{name} builds {service['image']} again ({built[service['image']]})"
            built[service["image"]] = name
        else:
            assert service["pull_policy"] == "never" and service["image"] in {
                s["image"] for s in services.values() if "build" in s
            }, name
    # the build context is the repository root: .dockerignore lets through exactly what is copied
    copied = set()
    for dockerfile in DOCKER.glob("Dockerfile.*"):
        for line in dockerfile.read_text().splitlines():
            if line.startswith("COPY "):
                copied.update(line.split()[1:-1])
    ignore = (ROOT / ".dockerignore").read_text().split()
    assert "*" in ignore and {p[1:] for p in ignore if p.startswith("!")} == copied


def test_loopback_override_changes_only_addresses():
    """Every service on the host network, listening on 127.0.0.1 with distinct ports, and each
    command equal to compose.yml's but for the addresses."""
    base, override = compose()["services"], compose("compose.loopback.yml")["services"]
    assert set(override) == set(base)
    assert all(s["network_mode"] == "host" for s in override.values())
    for name, service in base.items():
        if "build" in service:
            assert override[name]["build"] == {"network": "host"}, name
        else:
            assert "build" not in override[name], name
    runtime_port = {f"supernode-{i}:9094": f"127.0.0.1:{9094 + i}" for i in range(3)}
    listening = []
    for name, service in flower_services(base).items():
        expected = []
        for arg in service["command"]:
            arg = {"superlink:8000": "127.0.0.1:8000", "0.0.0.0": "127.0.0.1"}.get(arg, runtime_port.get(arg, arg))
            expected.append(arg)
        if name.startswith("supernode-"):
            expected[expected.index("--port") + 1] = str(9094 + int(name.split("-")[1]))
        assert override[name]["command"] == expected, name
        if "--port" in expected:
            listening.append(expected[expected.index("--port") + 1])
    assert len(listening) == len(set(listening))  # distinct ports on the one host network
    assert override["superlink"]["ports"] == {"!reset": []}  # nothing published: there is no bridge
    assert override["register"]["environment"]["SUPERLINK"] == "127.0.0.1:8000"


def test_local_images_mirror_the_official_layout():
    """docker/local/Dockerfile: the official images' venv, user, working directory and entrypoints."""
    text = (DOCKER / "local" / "Dockerfile").read_text()
    for tool, cli in CLI.items():
        assert re.search(rf"FROM base AS {tool}\nENTRYPOINT \[\"{cli}\"\]", text), tool
    assert "--uid 49999 app" in text and "WORKDIR /app\nUSER app\nENV HOME=/app" in text
    assert '/python/venv/bin/pip install --no-cache-dir "flwr==${FLWR_VERSION}"' in text
    assert "PATH=/python/venv/bin:$PATH" in text
    script = (DOCKER / "local-images.sh").read_text()
    assert 'p["name"] == "flwr"' in script and '-t "flwr/$component:$VERSION"' in script


def test_gpu_override_reserves_a_gpu_for_every_clientapp_service():
    base, gpu = compose()["services"], compose("compose.gpu.yml")["services"]
    clientapps = {n for n in base if n.startswith("superexec-clientapp-")}
    assert set(gpu) == clientapps
    for service in gpu.values():
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"] and device["count"] == 1


def test_secrets_are_mounted_only_where_needed():
    """The CA key is in no running container; the SuperLink's TLS key only in the SuperLink;
    node keys read-only in the SuperNodes (and the one-shot services that make or register them)."""
    services = compose()["services"]

    def mounting(volume):
        return {n for n, s in services.items() for v in s.get("volumes", []) if v.split(":")[0] == volume}

    assert mounting("ca-key") == {"certs"}
    assert mounting("superlink-tls") == {"certs", "superlink"}
    assert mounting("node-keys") == {"certs", "register"} | {n for n in services if n.startswith("supernode-")}
    for name, service in services.items():
        if name != "certs":
            assert all(
                v.endswith(":ro")
                for v in service.get("volumes", [])
                if v.split(":")[0] in ("certs", "superlink-tls", "node-keys")
            ), name
    link = services["superlink"]["command"]
    assert (
        link[link.index("--ssl-keyfile") + 1].startswith("/tls/")
        and "superlink-tls:/tls:ro" in services["superlink"]["volumes"]
    )
    assert "--ca-key-dir /ca" in services["certs"]["command"][0]
