"""Held-out clients (run config [generalization]): they never train, the generalisation phase serves them
what a new client of their method gets, MH-pFedHN's phase moves only their embeddings, and partitions
that connect after the handshake join the run at a round boundary."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.config import ConfigError, RunConfig
from common.heldout import architecture_for
from conftest import client_runtime, federation
from engine.heldout_phase import run_phase

HELD_OUT = {"generalization.held-out-clients": 1.0, "generalization.rounds": 2}


def captured(rc, results=False):
    """(strategy, grid) after a whole run of ``rc`` on the fake grid; ``results``: with a results writer."""
    from client_app.app import app as client_app
    from common.run_folder import ResultsWriter
    from fakegrid import FakeGrid
    from methods.registry import build_run

    cfg = RunConfig.from_dict(rc)
    writer = ResultsWriter(cfg.output_dir, "run", cfg.as_dict()) if results else None
    strategy, grid = build_run(cfg, writer), FakeGrid(client_app, rc, cfg.num_clients)
    strategy.start(grid)
    return strategy, grid


def test_held_out_clients_never_train_and_the_others_keep_their_partitions(run_config):
    rc = run_config(method="fedgh", dataset="mnist", **HELD_OUT, **{"generalization.every": 1})
    strategy, grid = captured(rc, results=True)
    trains = [m for m in grid.sent if m.metadata.message_type.startswith("train")]
    held_out = [m for m in trains if m.metadata.dst_node_id == 1003]
    # partition 3 gets train messages only inside a phase: each scoped to that phase's own state
    assert held_out and all(m.content.config_records["config"].get("state-scope") for m in held_out)
    assert all("state-scope" not in m.content.config_records["config"] for m in trains if m not in held_out)
    assert {m.content.config_records["config"]["state-scope"] for m in held_out} == {
        "heldout-1-round-1",
        "heldout-2-round-2",
    }
    for row in strategy.rows:  # the training clients' rows never include the held-out client
        assert row["num_clients"] == 3 and set(row["accuracy_per_client"]) == {"0", "1", "2"}
        assert row["heldout_partitions"] == [3] and row["heldout_clients"] == 1
        assert len(row["heldout_curve_mean"]) == 3 and set(row["heldout_accuracy_per_client"]) == {"3"}
        assert row["heldout_accuracy_mean"] == row["heldout_curve_mean"][-1]
        assert row["heldout_bytes_down"] > 0 and row["heldout_bytes_up"] > 0
    summary = strategy.results.summary()
    assert summary["held_out_partitions"] == [3]
    assert summary["final_heldout_accuracy_mean"] == strategy.rows[-1]["heldout_accuracy_mean"]
    plain = run_config(method="fedgh", dataset="mnist")
    for p in range(3):  # the same partition draw with and without held-out clients
        a, b = client_runtime(rc, p).data, client_runtime(plain, p).data
        assert torch.equal(a.train_y, b.train_y) and torch.equal(a.test_x, b.test_x)


def test_a_phase_only_after_the_last_round_by_default_and_a_phase_starts_afresh(run_config):
    rc = run_config(method="local", dataset="mnist", **HELD_OUT, **{"num-server-rounds": 3})
    strategy, grid = captured(rc)
    assert ["heldout_accuracy_mean" in r for r in strategy.rows] == [False, False, True]
    again = run_phase(strategy, 3)  # Local's held-out client trains from scratch: the same phase again
    assert again["heldout_curve_mean"] == strategy.rows[-1]["heldout_curve_mean"]


def test_mh_pfedhn_generalisation_moves_only_new_embeddings_and_learns(run_config):
    """§4.4 on a toy: the trained hypernetwork stays bytes-equal, the held-out client's embedding moves and
    its generated model ends above where it started (a 3-round hypernetwork; its embeddings given room
    to matter by a larger init and server step than the paper's)."""
    rc = run_config(
        method="mh-pfedhn",
        dataset="mnist",
        partitioner="iid",
        **{"model-group": "mh-lenet", "num-clients": 3, "num-server-rounds": 3, "max-examples-per-client": 300},
        **{"mh-pfedhn.server-lr": 0.01, "mh-pfedhn.embedding-std": 1.0},
        **{"generalization.held-out-clients": 1.0, "generalization.rounds": 6},
    )
    strategy, grid = captured(rc)
    before = {k: v.clone() for k, v in strategy.method.hn.state_dict().items()}
    assert "p2" not in strategy.method.hn.embeddings  # the held-out client is no part of the trained hypernetwork
    seen = {}
    end = strategy.method.end_generalization

    def keep_phase():
        seen["phase"] = strategy.method.phase[0]
        end()

    strategy.method.end_generalization = keep_phase
    phase = run_phase(strategy, 3)
    after = strategy.method.hn.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    moved = {k for k, v in seen["phase"].state_dict().items() if k not in before or not torch.equal(v, before[k])}
    assert moved == {"embeddings.p2"}
    curve = phase["heldout_curve_mean"]
    assert len(curve) == 7 and curve[-1] > curve[0], curve


@pytest.mark.slow
def test_a_new_architecture_is_held_out_and_gets_a_new_head(run_config):
    rc = run_config(
        method="mh-pfedhn",
        dataset="mnist",
        **{"num-clients": 5, "num-server-rounds": 1, "max-examples-per-client": 60},
        **{"generalization.held-out-clients": 2.0, "generalization.new-architectures": 1, "generalization.rounds": 1},
    )
    cfg = RunConfig.from_dict(rc)
    assert [architecture_for(cfg, p, 5) for p in range(5)] == ["cnn1", "cnn2", "cnn3", "cnn5", "cnn5"]
    strategy, grid = captured(rc)
    assert strategy.rows[-1]["heldout_clients"] == 2
    nodes = strategy.federation.roster.nodes[3:]
    strategy.method.begin_generalization(nodes, 1)
    hn = strategy.method.phase[0]
    assert hn.head_names["p3"] == "new-p3" and hn.head_names["p0"] == str(hn.tau(hn.sizes["p0"]))
    trainable = {n for n, p in hn.named_parameters() if p.requires_grad}
    assert trainable == {"embeddings.p3", "embeddings.p4"} | {n for n in trainable if n.startswith("heads.new-")}
    strategy.method.end_generalization()


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"generalization.new-architectures": 1}, "generalization.new-architectures"),
        ({"generalization.held-out-clients": 1.5}, "generalization.held-out-clients"),
        ({"generalization.held-out-clients": 4.0}, "generalization.held-out-clients"),
        ({"generalization.held-out-clients": 1.0, "dp.epsilon": 8.0}, "generalization.held-out-clients"),
        ({"generalization.held-out-clients": 1.0, "generalization.new-architectures": 5}, "new-architectures"),
    ],
)
def test_an_impossible_held_out_setting_fails_before_the_run_starts(run_config, overrides, key):
    from methods.registry import build_run

    with pytest.raises(ConfigError, match=key):
        build_run(RunConfig.from_dict(run_config(**overrides)))


def test_a_held_out_share_rounds_and_keeps_a_trainer(run_config):
    from common.heldout import generalization_options

    opts = generalization_options(RunConfig.from_dict(run_config(**{"generalization.held-out-clients": 0.2})))
    assert [opts.count(n) for n in (2, 5, 10, 50)] == [1, 1, 2, 10]
    assert [p for p in range(10) if opts.is_held_out(p, 10)] == [8, 9]


def test_a_scoped_state_leaves_the_run_state_alone(run_config):
    rc = run_config()
    client = client_runtime(rc, 1)
    scoped = client_runtime(rc, 1)
    scoped.context = client.context
    scoped.scope = "heldout-round-1"
    model = torch.nn.Linear(2, 2)
    scoped.store("model", model)
    assert not client.restore("model", torch.nn.Linear(2, 2))
    assert scoped.restore("model", torch.nn.Linear(2, 2))


@pytest.mark.parametrize(("method", "group"), [("fedproto", "hetero-cnn5"), ("mh-pfedhn", "mh-lenet")])
def test_a_partition_that_connects_after_the_handshake_joins_at_a_round_boundary(run_config, method, group):
    """MH-pFedHN also registers the late client's embedding before it is served."""
    rc = run_config(
        method=method,
        dataset="mnist",
        **{"model-group": group, "num-clients": 3, "min-clients": 2, "num-server-rounds": 3},
    )
    strategy, grid = federation(rc)
    grid.gone.add(1002)
    play = strategy.run_round

    def play_and_connect(server_round, run_start):
        out = play(server_round, run_start)
        grid.gone.discard(1002)  # the third SuperNode starts after round 1
        return out

    strategy.run_round = play_and_connect
    strategy.start(grid)
    rows = strategy.rows
    assert rows[0]["num_clients"] == 2 and set(rows[0]["accuracy_per_client"]) == {"0", "1"}
    assert rows[1]["num_clients"] == 3 and set(rows[-1]["accuracy_per_client"]) == {"0", "1", "2"}
    assert np.isfinite(rows[-1]["accuracy_mean"])
    if method == "mh-pfedhn":
        assert set(strategy.method.hn.embeddings) == {"p0", "p1", "p2"}
