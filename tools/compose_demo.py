"""The docker compose demo end to end: build, start, run FedGH through the SuperLink, check, tear down.

    uv run --frozen python -m tools.compose_demo [--rounds 3] [--data-dir ../shared/data]

1. A Docker engine: the one that answers, else ``docker/dockerd.sh start`` (no bridge, no
   iptables; stopped again at the end).
2. Flower's base images at the ``uv.lock`` version: used when present, else pulled, else built
   locally by ``docker/local-images.sh`` (for machines with no container registry).
3. ``docker compose build``, then ``up``: certificates and node keys, the SuperLink (TLS,
   SuperNode authentication), the registration of the 3 node keys, 3 SuperNodes and the
   SuperExecs. With no bridge network the stack runs with ``docker/compose.loopback.yml``.
4. ``flwr run`` of this app through the SuperLink (a CLI connection in a temporary FLWR_HOME,
   trusting the stack's CA), FedGH for ``--rounds`` rounds on 3 clients.
5. Checks: the run finished completed, every round has the 3 clients, and every round's
   ``bytes_down``/``bytes_up`` equal the FedGH payload sizes computed here from the partitions
   (4*C*(d+1) per client down, 4*C_k*(d+1) up, C_k the classes of client k's training split).
6. ``docker compose down -v`` (containers, network, volumes) and the engine stopped if this
   started it, also on failure or Ctrl-C. Images are kept, so a second demo builds from cache.
   It refuses to start beside an existing ``mheterofl`` stack (not its to remove) or when
   something else listens on the stack's 127.0.0.1 ports.

Prints build seconds, start-up seconds (``up`` until the 3 SuperNodes are online), seconds per
round, the checks and the tail of the stack's log; exits 0 only if every check passed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

from common.errors import ConfigError
from common.files import read_rows, read_summary
from tools.control import CliControl, flwr_cli, wait_finished
from tools.deploy import environment, write_connection
from tools.processes import STOP_SIGNALS, stop_on_signals, wait_for
from tools.runconfig import add_config_arguments, app_defaults, read_config, run_config_file, validate_configs

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
COMPONENTS = ("superlink", "supernode", "superexec")
NUM_NODES = 3  # docker/compose.yml's SuperNodes


def demo_run_config(rounds: int) -> dict:
    """The run config of the demo's FedGH job, as paths inside the containers."""
    return {
        "method": "fedgh",
        "num-clients": NUM_NODES,
        "num-server-rounds": rounds,
        "max-examples-per-client": 200,
        "batch-size": 32,
        "data-dir": "/data",
        "output-dir": "/app/outputs",
        "round-timeout": 300.0,
    }


def fedgh_payload_bytes(run_config: dict, data_dir: str) -> tuple[int, int]:
    """``(bytes_down, bytes_up)`` of one FedGH training round over all clients of ``run_config``
    (pyproject defaults filled in), computed from the partitions in ``data_dir``: the header is
    4*C*(d+1) bytes to each client, client k sends 4*C_k*(d+1) bytes (FedGH payload, see
    methods/fedgh.py). Reads labels only (no image decoding).

    Raises:
        ConfigError: the run config is invalid (key named).
    """
    from common.config import RunConfig
    from common.data import DataSpec, partition_split
    from common.datasets import DATASETS

    cfg = RunConfig.from_dict({**app_defaults(), **run_config, "data-dir": data_dir})
    spec = DataSpec.from_config(cfg, cfg.num_clients)
    d, c = cfg.representation_dim, DATASETS[cfg.dataset].num_classes
    down = cfg.num_clients * 4 * c * (d + 1)
    up = 0
    for partition in range(cfg.num_clients):
        _, labels, train_idx, _ = partition_split(spec, partition, labels_only=True)
        up += 4 * len(labels[train_idx].unique()) * (d + 1)
    return down, up


def check_rows(rows: list[dict], summary: dict, rounds: int, down: int, up: int) -> list[str]:
    """What is wrong with a finished demo run's rows and summary (empty: every check passed)."""
    problems = []
    if summary.get("status") != "completed":
        problems.append(f"summary status {summary.get('status')!r}, expected 'completed'")
    if [r["round"] for r in rows] != list(range(1, rounds + 1)):
        problems.append(f"rounds {[r['round'] for r in rows]}, expected 1..{rounds}")
    for r in rows:
        if r["num_clients"] != NUM_NODES or r["dropped_clients"]:
            problems.append(f"round {r['round']}: {r['num_clients']} clients, dropped {r['dropped_clients']}")
        if (r["bytes_down"], r["bytes_up"]) != (down, up):
            problems.append(
                f"round {r['round']}: bytes down/up {r['bytes_down']}/{r['bytes_up']}, expected {down}/{up}"
            )
    return problems


class Stack:
    """``docker compose`` on docker/compose.yml (+ the loopback override when ``loopback``)."""

    def __init__(self, loopback: bool, data_dir: Path):
        files = ["compose.yml"] + (["compose.loopback.yml"] if loopback else [])
        self.base = ["docker", "compose", *(a for f in files for a in ("-f", str(DOCKER / f)))]
        self.env = {**os.environ, "DATA_DIR": str(data_dir.resolve())}

    def __call__(self, *args: str, check: bool = True, capture: bool = False) -> subprocess.CompletedProcess:
        done = subprocess.run([*self.base, *args], env=self.env, text=True, capture_output=capture)
        if check and done.returncode != 0:
            raise RuntimeError(
                f"docker compose {' '.join(args)} exited {done.returncode}: {(done.stderr or '')[-2000:]}"
            )
        return done


def log_tail(stack: Stack, lines: int = 15) -> str:
    """The last ``lines`` log lines of every service, without terminal colour codes."""
    logs = stack("logs", "--no-color", "--tail", str(lines), capture=True, check=False).stdout
    return "--- log tail ---\n" + re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", logs)


def locked_flwr() -> str:
    """The flwr version of uv.lock (the tag of the flwr/* images)."""
    return next(p["version"] for p in tomllib.loads((ROOT / "uv.lock").read_text())["package"] if p["name"] == "flwr")


def engine_up() -> bool:
    return subprocess.run(["docker", "info"], capture_output=True).returncode == 0


def flower_images(version: str) -> str:
    """Make ``flwr/<component>:<version>`` available: present, pulled, or built locally.
    Returns which of the three it was."""
    images = [f"flwr/{c}:{version}" for c in COMPONENTS]
    if all(subprocess.run(["docker", "image", "inspect", i], capture_output=True).returncode == 0 for i in images):
        return "present"
    if all(subprocess.run(["docker", "pull", "-q", i], capture_output=True).returncode == 0 for i in images):
        return "pulled"
    subprocess.run([str(DOCKER / "local-images.sh")], check=True)
    return "built locally (docker/local-images.sh)"


def flwr_json(*args: str, env: dict) -> dict:
    done = flwr_cli(*args, "--format", "json", env=env)
    try:
        return json.loads(done.stdout)
    except json.JSONDecodeError:
        return {}


def ports_in_use(ports: list[int]) -> list[int]:
    """Which of ``ports`` something on 127.0.0.1 already listens on."""
    busy = []
    for port in ports:
        with socket.socket() as s:
            s.settimeout(1.0)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                busy.append(port)
    return busy


def has_bridge() -> bool:
    """Whether the engine has its default bridge network (not with docker/dockerd.sh)."""
    names = subprocess.run(["docker", "network", "ls", "--format", "{{.Name}}"], capture_output=True, text=True)
    return "bridge" in names.stdout.split()


def demo(stack: Stack, rounds: int, data_dir: Path, work: Path, run_config: dict) -> int:
    """Steps 2-5 of the module docstring on a running engine; returns the exit status."""
    print(f"flwr {locked_flwr()} images: {flower_images(locked_flwr())}", flush=True)
    down, up = fedgh_payload_bytes(run_config, str(data_dir))

    t0 = time.monotonic()
    stack("build", capture=True)
    build_s = time.monotonic() - t0
    print(f"build: {build_s:.1f} s", flush=True)

    try:
        return run_on_stack(stack, rounds, work, run_config, (down, up), build_s)
    except BaseException:
        print(log_tail(stack))
        raise


def run_on_stack(
    stack: Stack, rounds: int, work: Path, run_config: dict, payload: tuple[int, int], build_s: float
) -> int:
    """Steps 3-5 after the build: up, run, check; returns the exit status."""
    down, up = payload
    # the CLI talks to 127.0.0.1:8000 in both network modes: it must be this stack's SuperLink
    busy = ports_in_use([8000] + ([9094, 9095, 9096] if "compose.loopback.yml" in " ".join(stack.base) else []))
    if busy:
        raise RuntimeError(f"127.0.0.1 port(s) {busy} already in use: stop what listens there first")
    t0 = time.monotonic()
    stack("up", "-d", capture=True)
    stack("cp", "certs:/certs/ca.crt", str(work / "ca.crt"), capture=True)
    env = {**environment(), "FLWR_HOME": str(work / "flwr-home")}
    write_connection(work / "flwr-home", "docker", "127.0.0.1:8000", work / "ca.crt")

    def online():
        nodes = flwr_json("supernode", "list", "docker", env=env).get("nodes", [])
        return sum(n.get("status") == "online" for n in nodes) >= NUM_NODES

    wait_for(online, 300, f"{NUM_NODES} SuperNodes to be online")
    startup_s = time.monotonic() - t0
    print(f"start-up (up until {NUM_NODES} SuperNodes online): {startup_s:.1f} s", flush=True)

    t0 = time.monotonic()
    with run_config_file(run_config) as path:
        submitted = flwr_json("run", str(ROOT), "docker", "--run-config", str(path), env=env)
    if "run-id" not in submitted:
        raise RuntimeError(f"flwr run was refused: {submitted}")
    run_id = int(submitted["run-id"])

    status = wait_finished(CliControl(env, "docker"), run_id, 300 + 300 * rounds)
    run_s = time.monotonic() - t0
    print(f"run {run_id}: {status} in {run_s:.1f} s", flush=True)

    stack("cp", "superexec-serverapp:/app/outputs", str(work / "outputs"), capture=True)
    run_dirs = [p.parent for p in (work / "outputs").glob("*/summary.json")]
    if len(run_dirs) != 1:
        raise RuntimeError(f"expected one run folder in the outputs volume, found {run_dirs}")
    rows = read_rows(run_dirs[0])
    summary = read_summary(run_dirs[0])
    if status != "finished:completed":
        print(f"run {status}: {summary.get('error') or 'no reason recorded'}", flush=True)
    seconds = [r["round_seconds"] for r in rows]
    print(
        "seconds per round:",
        " ".join(f"{s:.1f}" for s in seconds),
        f"(median {statistics.median(seconds):.1f})" if seconds else "",
        flush=True,
    )
    print(f"final accuracy (mean over clients): {summary.get('final_accuracy_mean')}", flush=True)
    problems = check_rows(rows, summary, rounds, down, up)
    print(log_tail(stack))
    for problem in problems:
        print("CHECK FAILED:", problem, flush=True)
    if problems:
        return 1
    print(
        f"checks passed: {rounds} rounds completed, {NUM_NODES} clients each, payload bytes exact "
        f"(down {down} B, up {up} B per round)",
        flush=True,
    )
    print(f"build_s={build_s:.1f} startup_s={startup_s:.1f} round_s={statistics.median(seconds):.1f}", flush=True)
    return 0


def shielded(cmd: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a clean-up command shielded from a second Ctrl-C or SIGTERM (a half-done
    ``compose down`` leaves containers and volumes behind): the signals are ignored meanwhile
    and the command runs in its own session, out of reach of the terminal's Ctrl-C."""
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in STOP_SIGNALS}
    try:
        return subprocess.run(cmd, env=env, capture_output=True, text=True, start_new_session=True)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    add_config_arguments(parser, preset=False)
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=ROOT.parent / "shared" / "data",
        help="host folder with <dataset>/train.parquet, mounted read-only at /data",
    )
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    # `docker compose down` must run on SIGTERM and SIGHUP too, not only on Ctrl-C
    with stop_on_signals():
        try:  # the whole config, before the engine or any container starts
            config, run_config = read_config(None, args.run_config, demo_run_config(args.rounds))
            if config["method"] != "fedgh":
                raise ConfigError(
                    f"run config key 'method' = {config['method']!r}: the demo checks FedGH's payload bytes; "
                    "run other methods on the stack with flwr run (see docs/compose.md)"
                )
            validate_configs([config])
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr, flush=True)
            return 2
        except KeyboardInterrupt:
            print("demo interrupted before it started anything", file=sys.stderr, flush=True)
            return 130
        return run_demo(args, run_config)


def run_demo(args: argparse.Namespace, run_config: dict) -> int:
    """Start the engine if needed, build, run and check the demo, and remove what it created."""
    started_engine = False
    try:
        if (
            shutil.which("docker") is None
            or subprocess.run(["docker", "compose", "version"], capture_output=True).returncode != 0
        ):
            raise RuntimeError("needs the docker CLI with the compose plugin: run docker/setup-host.sh (as root)")
        if not engine_up():
            out = subprocess.run(
                [str(DOCKER / "dockerd.sh"), "start"], check=True, capture_output=True, text=True
            ).stdout
            started_engine = out.startswith("started")
            print("docker engine:", out.strip(), flush=True)
        loopback = not has_bridge()
        print(
            "network:",
            "host (docker/compose.loopback.yml: the engine has no bridge)" if loopback else "bridge",
            flush=True,
        )
        stack = Stack(loopback, args.data_dir)
        if stack("ps", "-a", "-q", capture=True).stdout.split():
            # not ours to remove: the demo tears down only what it created
            raise RuntimeError(
                "a 'mheterofl' compose stack already exists: "
                "docker compose -f docker/compose.yml down -v, then run the demo again"
            )
        with tempfile.TemporaryDirectory(prefix="mheterofl-compose-") as work:
            try:
                return demo(stack, args.rounds, args.data_dir, Path(work), run_config)
            finally:
                done = shielded([*stack.base, "down", "-v", "--remove-orphans", "--timeout", "10"], stack.env)
                print(
                    "stack removed (docker compose down -v)"
                    if done.returncode == 0
                    else f"docker compose down failed: {done.stderr[-1000:]}",
                    flush=True,
                )
    except (RuntimeError, TimeoutError, subprocess.CalledProcessError) as error:
        print(f"demo failed: {error}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("demo interrupted", file=sys.stderr, flush=True)
        return 130
    finally:
        if started_engine:
            print("docker engine:", shielded([str(DOCKER / "dockerd.sh"), "stop"]).stdout.strip(), flush=True)


if __name__ == "__main__":
    sys.exit(main())
