"""Deployment for real: a SuperLink and SuperNodes as separate processes on loopback, TLS and node auth.

One federation serves every check (starting Flower processes costs tens of seconds each):
an unregistered SuperNode is refused; FedGH runs 8 rounds on a CIFAR-10 slice; one SuperNode
is killed after round 1 (round 2 completes without it, after ``round-timeout`` at most, and
records it as dropped) and restarted after round 2 (it rejoins a few rounds later, depending on
how fast it starts, with its model from its state dir: rounds take ~5 s and a SuperNode ~12 s
to start, so 8 rounds leave it twice the time it needs).
Every process started here is stopped by its process-group id.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools.deploy import register_nodes
from tools.loopback import CONNECTION, LoopbackDeployment, rows_of
from tools.processes import stop, wait_for

ROOT = Path(__file__).resolve().parents[1]
DATA_DIR = ROOT.parent / "shared" / "data"


@pytest.mark.slow
def test_tls_auth_deployment_survives_a_killed_and_restarted_supernode(tmp_path):
    out = tmp_path / "outputs"
    with LoopbackDeployment(tmp_path, 3, DATA_DIR, spare_keys=1) as deployment:
        deployment.start()
        publics = [public for _, public in deployment.keys[:3]]
        assert deployment.registered == [f"{k}: registered" for k in publics]
        # registering again (a restarted stack) keeps the key: no error, no second node
        assert register_nodes(publics[:1], CONNECTION, env=deployment.env) == [f"{publics[0]}: registered before"]
        intruder = deployment.supernode(3, key_index=3)  # partition 3 with an unregistered key

        run_config = {
            "method": "fedgh",
            "num-clients": 3,
            "num-server-rounds": 8,
            "max-examples-per-client": 200,
            "batch-size": 32,
            "data-dir": str(DATA_DIR),
            "output-dir": str(out),
            "round-timeout": 90.0,
        }
        run_id = deployment.submit(run_config)

        assert wait_for(lambda: intruder.poll() is not None, 90, "the unregistered SuperNode to be refused") != 0

        wait_for(lambda: len(rows_of(out)) >= 1, 400, "round 1")
        stop(deployment.procs[3])  # partition 2's SuperNode, killed mid-run: no more replies from it
        wait_for(lambda: len(rows_of(out)) >= 2, 180, "round 2 without the killed node")
        deployment.supernode(2)  # the same key, so the same node id
        assert deployment.finished(run_id, 600) == "finished:completed"

    rows = rows_of(out)
    summary = json.loads(next(out.glob("*/summary.json")).read_text())
    assert summary["status"] == "completed" and [r["round"] for r in rows] == list(range(1, 9))
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


@pytest.mark.slow
def test_a_supernode_started_after_round_1_joins_the_running_federation(tmp_path):
    """Run config ``min-clients`` = 2 of ``num-clients`` = 3: the run starts with two SuperNodes; the
    third, started once round 1 is written, is registered at a later round boundary and trains from then on."""
    out = tmp_path / "outputs"
    with LoopbackDeployment(tmp_path, 3, DATA_DIR) as deployment:
        deployment.start(started=2)
        run_config = {
            "method": "fedproto",
            "num-clients": 3,
            "min-clients": 2,
            "num-server-rounds": 6,
            "max-examples-per-client": 200,
            "batch-size": 32,
            "data-dir": str(DATA_DIR),
            "output-dir": str(out),
            "round-timeout": 90.0,
        }
        run_id = deployment.submit(run_config)
        wait_for(lambda: len(rows_of(out)) >= 1, 400, "round 1")
        deployment.supernode(2)
        assert deployment.finished(run_id, 600) == "finished:completed"

    rows = rows_of(out)
    assert rows[0]["num_clients"] == 2 and set(rows[0]["accuracy_per_client"]) == {"0", "1"}
    joined = [r["round"] for r in rows if "2" in r["accuracy_per_client"]]
    assert joined and joined == list(range(joined[0], 7)), joined  # from the round it joined to the last
    assert all(r["num_clients"] == 3 for r in rows if r["round"] >= joined[0])
    print("partition 2 joined in round", joined[0])
