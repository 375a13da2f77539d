"""The SuperLink behind the reverse proxy of ``tools.deploy proxy`` (nginx), on loopback.

Both directions: the Control API answers the operator (127.0.0.1) and refuses anyone else
(127.0.0.2, another loopback address); the Runtime API is refused to all; the Fleet API serves
a SuperNode that authenticates and comes online through the proxy. Every process started here
is stopped by its process-group id.
"""

from __future__ import annotations

import http.client
import json
import shutil
import ssl
import subprocess
from pathlib import Path

import pytest

from tools.control import flwr_cli
from tools.deploy import (
    environment,
    node_config,
    proxy_command,
    proxy_config,
    register_nodes,
    superlink_command,
    supernode_command,
    write_certificates,
    write_connection,
    write_node_keys,
)
from tools.loopback import spawn
from tools.processes import free_port, stop, wait_for

pytestmark = pytest.mark.skipif(
    shutil.which("nginx") is None, reason="nginx is not installed (apt-get install nginx; .ci/run installs it)"
)


def status(port: int, path: str, source: str, ca: Path) -> int:
    """HTTP status of ``POST path`` through the proxy, sent from loopback address ``source``."""
    context = ssl.create_default_context(cafile=str(ca))
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=context, source_address=(source, 0), timeout=10)
    try:
        conn.request("POST", path, body=b"", headers={"Content-Type": "application/protobuf"})
        return conn.getresponse().status
    finally:
        conn.close()


def test_proxy_admits_nodes_everywhere_and_the_control_api_only_from_the_operator(tmp_path):
    env = {**environment(), "FLWR_HOME": str(tmp_path / "flwr-home")}
    certs = write_certificates(tmp_path / "certs", [], [])
    ((private, public),) = write_node_keys(tmp_path / "keys", 1)
    link_port, public_port = free_port(), free_port()
    write_connection(tmp_path / "flwr-home", "proxied", f"127.0.0.1:{public_port}", certs["ca"])
    procs: list[subprocess.Popen] = []
    try:
        procs.append(
            spawn(
                superlink_command(
                    tmp_path / "certs", auth=True, host="127.0.0.1", port=link_port, database=str(tmp_path / "state.db")
                ),
                env,
                tmp_path / "superlink.log",
            )
        )
        config = proxy_config(
            tmp_path / "proxy", tmp_path / "certs", f"127.0.0.1:{public_port}", f"127.0.0.1:{link_port}", ["127.0.0.1"]
        )
        procs.append(spawn(proxy_command(config), env, tmp_path / "proxy.log"))

        def healthy():
            for proc, log in zip(procs, ("superlink.log", "proxy.log")):
                if proc.poll() is not None:  # fail now, with its reason, not after the timeout
                    raise RuntimeError(f"{log} ended with {proc.returncode}: {(tmp_path / log).read_text()[-2000:]}")
            try:
                return status(public_port, "/health", "127.0.0.1", certs["ca"]) != 502 or None
            except OSError:
                return None

        wait_for(healthy, 60, "the SuperLink behind the proxy")

        control = "/v1/control/list-runs"
        assert status(public_port, control, "127.0.0.2", certs["ca"]) == 403  # not the operator
        assert status(public_port, control, "127.0.0.1", certs["ca"]) not in (403, 502)  # reaches Flower
        assert status(public_port, "/v1/runtime/pull-app-inputs", "127.0.0.1", certs["ca"]) == 403
        assert status(public_port, "/v1/fleet/create-node", "127.0.0.2", certs["ca"]) not in (403, 502)

        # the operator's CLI works through the proxy: registration (Control API) ...
        assert register_nodes([public], "proxied", timeout=30, env=env) == [f"{public}: registered"]
        # ... and an authenticated SuperNode comes online through it (Fleet API)
        procs.append(
            spawn(
                supernode_command(
                    f"127.0.0.1:{public_port}", certs["ca"], private, node_config(0, 1), port=free_port(), max_retries=3
                ),
                env,
                tmp_path / "supernode.log",
            )
        )

        def online():
            listed = flwr_cli("supernode", "list", "proxied", "--format", "json", env=env, timeout=120)
            nodes = json.loads(listed.stdout).get("nodes", []) if listed.returncode == 0 else []
            return any(n.get("status") == "online" for n in nodes)

        wait_for(online, 90, "the SuperNode to come online through the proxy")
    finally:
        for proc in procs:
            stop(proc)
    assert "403" in (tmp_path / "proxy" / "access.log").read_text()


def test_proxy_config_needs_an_operator(tmp_path):
    with pytest.raises(ValueError, match="--operator"):
        proxy_config(tmp_path, tmp_path, "127.0.0.1:1", "127.0.0.1:2", [])
