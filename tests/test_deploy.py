"""Deployment for real: a SuperLink and SuperNodes as separate processes on loopback, TLS and node auth.

One federation serves every check (starting Flower processes costs tens of seconds each):
an unregistered SuperNode is refused; FedGH runs 5 rounds on a CIFAR-10 slice; one SuperNode
is killed after round 1 (round 2 completes without it, after ``round-timeout`` at most, and
records it as dropped) and restarted after round 2 (it rejoins, in round 3 or 4 depending on
how fast it starts, with its model from its state dir).
Every process started here is stopped by its process-group id.
"""

from __future__ import annotations

import json
import ssl
import subprocess
import urllib.request
from pathlib import Path


from tools.deploy import (BIN, environment, node_config, register_nodes, superlink_command, supernode_command,
                          write_certificates, write_connection, write_node_keys)
from tools.run import free_port, run_status, stop, toml_value, wait_for

ROOT = Path(__file__).resolve().parents[1]
DATA_DIR = ROOT.parent / "shared" / "data"


def start(cmd, env, log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def flwr(*args, env) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "flwr"), *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)


def rows_of(out: Path) -> list[dict]:
    files = list(out.glob("*/metrics.jsonl"))
    return [json.loads(line) for line in files[0].read_text().splitlines()] if files else []


def test_tls_auth_deployment_survives_a_killed_and_restarted_supernode(tmp_path):
    env = {**environment(), "FLWR_HOME": str(tmp_path / "flwr-home")}
    certs = write_certificates(tmp_path / "certs", [], [])
    keys = write_node_keys(tmp_path / "keys", 4)
    port = free_port()
    address = f"127.0.0.1:{port}"
    write_connection(tmp_path / "flwr-home", "deploy", address, certs["ca"])
    procs: list[subprocess.Popen] = []
    logs = tmp_path / "logs"
    logs.mkdir()
    try:
        procs.append(start(superlink_command(tmp_path / "certs", auth=True, host="127.0.0.1", port=port,
                                             database=str(tmp_path / "state.db")), env, logs / "superlink.log"))
        context = ssl.create_default_context(cafile=str(certs["ca"]))

        def healthy():
            try:
                with urllib.request.urlopen(f"https://{address}/health", timeout=2, context=context):
                    return True
            except OSError:
                return False
        wait_for(healthy, 60, "the SuperLink (TLS) to become healthy")

        publics = [public for _, public in keys[:3]]
        assert register_nodes(publics, "deploy", env=env) == [f"{k}: registered" for k in publics]
        # registering again (a restarted stack) keeps the key: no error, no second node
        assert register_nodes(publics[:1], "deploy", env=env) == [f"{publics[0]}: registered before"]

        def supernode(i: int, key: Path) -> subprocess.Popen:
            config = node_config(i, 3, str(DATA_DIR), str(tmp_path / f"state-{i}"))
            return start(supernode_command(address, certs["ca"], key, config, port=free_port(), max_retries=3),
                         env, logs / f"supernode-{i}.log")

        nodes = {i: supernode(i, keys[i][0]) for i in range(3)}
        procs += nodes.values()
        intruder = supernode(3, keys[3][0])  # partition 3 with an unregistered key
        procs.append(intruder)

        out = tmp_path / "outputs"
        run_config = {"method": "fedgh", "num-clients": 3, "num-server-rounds": 5, "max-examples-per-client": 200,
                      "batch-size": 32, "data-dir": str(DATA_DIR), "output-dir": str(out), "round-timeout": 90.0}
        cmd = ["run", str(ROOT), "deploy", "--format", "json"]
        for k, v in run_config.items():
            cmd += ["--run-config", f"{k}={toml_value(v)}"]
        submitted = flwr(*cmd, env=env)
        run_id = json.loads(submitted.stdout)["run-id"]

        assert wait_for(lambda: intruder.poll() is not None, 90, "the unregistered SuperNode to be refused") != 0

        wait_for(lambda: len(rows_of(out)) >= 1, 400, "round 1")
        stop(nodes[2])  # killed mid-run: no more replies from partition 2
        wait_for(lambda: len(rows_of(out)) >= 2, 180, "round 2 without the killed node")
        nodes[2] = supernode(2, keys[2][0])  # the same key, so the same node id
        procs.append(nodes[2])

        def finished():
            status = run_status(env, run_id, "deploy")
            return status if status.startswith("finished") else None
        assert wait_for(finished, 600, "the run to finish") == "finished:completed"
    finally:
        for proc in procs:
            stop(proc)

    rows = rows_of(out)
    summary = json.loads(next(out.glob("*/summary.json")).read_text())
    assert summary["status"] == "completed" and [r["round"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[0]["num_clients"] == 3 and rows[0]["dropped_clients"] == []
    assert rows[0]["bytes_down"] == 3 * 4 * 10 * 501  # the FedGH header to each client
    assert 0 <= rows[0]["accuracy_mean"] <= 1
    assert rows[1]["dropped_clients"] == [2] and rows[1]["num_clients"] == 2
    # partition 2 is back by the last round, with the model it had saved before it was killed
    assert rows[-1]["num_clients"] == 3 and "2" in rows[-1]["accuracy_per_client"]
    assert sum(r["client_state_restores"] for r in rows[2:]) >= 1
    for i in range(3):
        assert list((tmp_path / f"state-{i}").glob("*/partition-*/model.pt"))
    print("deployment round seconds:", [round(r["round_seconds"], 1) for r in rows])
