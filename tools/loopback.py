"""A real deployment on this host's loopback: a SuperLink and SuperNodes as separate processes,
with TLS and SuperNode authentication, for the deployment test and ``bench.deployment``.

Each process runs in its own session and is stopped by its process-group id (so the
SuperExec and ClientApp processes a SuperNode starts go with it). Logs go to ``<folder>/logs``.
"""

from __future__ import annotations

import json
import ssl
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

from common.files import ROWS_FILE, read_rows
from tools.control import CliControl, flwr_cli, wait_finished
from tools.deploy import (
    environment,
    register_nodes,
    superlink_command,
    write_certificates,
    write_connection,
    write_node_keys,
)
from tools.processes import free_port, stop, wait_for
from tools.runconfig import run_config_file

ROOT = Path(__file__).resolve().parents[1]
CONNECTION = "deploy"


def spawn(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """Start ``cmd`` in its own session (stop it with ``tools.processes.stop``), output appended to ``log``."""
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


class LoopbackDeployment:
    """SuperLink + SuperNodes on 127.0.0.1, TLS and node authentication; a context manager.

    Args:
        folder: working folder (certificates, keys, CLI home, SuperLink database, logs, node state).
        num_nodes: SuperNodes started by :meth:`start`, partitions ``0..num_nodes-1``.
        data_dir: the nodes' ``data-dir``.
        spare_keys: extra key pairs made but not registered (e.g. for an intruder).
    """

    def __init__(self, folder: Path, num_nodes: int, data_dir: Path, spare_keys: int = 0) -> None:
        self.folder, self.num_nodes, self.data_dir = folder, num_nodes, data_dir
        self.env = {**environment(), "FLWR_HOME": str(folder / "flwr-home")}
        self.certs = write_certificates(folder / "certs", [], [])
        self.keys = write_node_keys(folder / "keys", num_nodes + spare_keys)
        self.address = f"127.0.0.1:{free_port()}"
        write_connection(folder / "flwr-home", CONNECTION, self.address, self.certs["ca"])
        self.logs = folder / "logs"
        self.logs.mkdir(exist_ok=True)
        self.procs: list[subprocess.Popen] = []
        self.registered: list[str] = []  # register_nodes' lines, one per key

    def _spawn(self, cmd: list[str], log: str) -> subprocess.Popen:
        proc = spawn(cmd, self.env, self.logs / log)
        self.procs.append(proc)
        return proc

    def healthy(self) -> bool:
        """Whether the SuperLink answers ``/health`` over TLS."""
        context = ssl.create_default_context(cafile=str(self.certs["ca"]))
        try:
            with urllib.request.urlopen(f"https://{self.address}/health", timeout=2, context=context):
                return True
        except OSError:
            return False

    def start(self, started: int | None = None) -> LoopbackDeployment:
        """Start the SuperLink, register the nodes' keys, start the SuperNodes (only the first ``started``
        of them when given: the others can join later with :meth:`supernode`).

        Raises:
            TimeoutError: the SuperLink did not become healthy within 60 s.
            RuntimeError: a key was refused.
        """
        host, port = self.address.split(":")
        self._spawn(
            superlink_command(
                self.folder / "certs", auth=True, host=host, port=int(port), database=str(self.folder / "state.db")
            ),
            "superlink.log",
        )
        wait_for(self.healthy, 60, "the SuperLink (TLS) to become healthy")
        self.registered = register_nodes(
            [public for _, public in self.keys[: self.num_nodes]], CONNECTION, env=self.env
        )
        for i in range(self.num_nodes if started is None else started):
            self.supernode(i)
        return self

    def supernode(self, partition_id: int, key_index: int | None = None) -> subprocess.Popen:
        """Start the SuperNode of ``partition_id`` with key pair ``key_index`` (default: the
        partition's own), state under ``<folder>/state-<partition_id>``, as a user does:
        ``python -m tools.deploy supernode`` (with its SuperExec, in the node's process group)."""
        key = self.keys[partition_id if key_index is None else key_index][0]
        cmd = [sys.executable, "-m", "tools.deploy", "supernode", "--superlink", self.address]
        cmd += ["--root-cert", str(self.certs["ca"]), "--key", str(key), "--port", str(free_port())]
        cmd += ["--partition-id", str(partition_id), "--num-partitions", str(self.num_nodes)]
        cmd += ["--data-dir", str(self.data_dir), "--state-dir", str(self.folder / f"state-{partition_id}")]
        cmd += ["--max-retries", "3"]
        return self._spawn(cmd, f"supernode-{partition_id}.log")

    def submit(self, run_config: dict[str, Any]) -> int:
        """``flwr run`` of this app with ``run_config``; returns the run id.

        Raises:
            RuntimeError: the CLI refused the run (its output is in the message).
        """
        with run_config_file(run_config) as path:
            cmd = ["run", str(ROOT), CONNECTION, "--format", "json", "--run-config", str(path)]
            done = flwr_cli(*cmd, env=self.env, timeout=300)
        try:
            return int(json.loads(done.stdout)["run-id"])
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise RuntimeError(f"flwr run failed: {done.stdout}{done.stderr}") from exc

    def finished(self, run_id: int, timeout: float) -> str:
        """Wait up to ``timeout`` seconds for run ``run_id`` to finish; returns its status
        (:func:`tools.control.wait_finished`)."""
        return wait_finished(CliControl(self.env, CONNECTION), run_id, timeout)

    def stop(self) -> None:
        """Stop every process started here, by process group."""
        for proc in self.procs:
            stop(proc)

    def __enter__(self) -> LoopbackDeployment:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def rows_of(out: Path) -> list[dict]:
    """The per-round rows written so far under output folder ``out`` (one run)."""
    runs = [f.parent for f in out.glob(f"*/{ROWS_FILE}")]
    return read_rows(runs[0]) if runs else []
