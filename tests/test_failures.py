"""What deployment does to a run, in-process: nodes vanish, restart empty, come back under new ids."""

import torch

from common.config import RunConfig
from common.runtime import MODEL_STATE, ClientRuntime
from common.state_store import STAMPS
from fakegrid import FakeGrid
from methods.registry import build_run


def deployed(rc, state_dir):
    from client_app.app import app as client_app

    cfg = RunConfig.from_dict(rc)
    return build_run(cfg), FakeGrid(client_app, rc, cfg.num_clients, node_config={"state-dir": str(state_dir)})


def saved_model(state_dir, key, partition):
    saved = torch.load(state_dir / key / f"partition-{partition}" / f"{MODEL_STATE}.pt", weights_only=True)
    return saved["state"]  # stamped with its round: {"round": r, "state": state dict}


def test_state_is_written_to_the_node_dir_and_restored_after_a_restart(run_config, tmp_path):
    rc = run_config(**{"num-clients": 3, "num-server-rounds": 1})
    strategy, grid = deployed(rc, tmp_path / "state")
    strategy.start(grid)
    key = strategy.federation.transport.state_key
    for ctx in grid.contexts.values():
        on_disk = saved_model(tmp_path / "state", key, ctx.node_config["partition-id"])
        # the state lives on disk only: the context keeps the round of the file, no model
        assert not ctx.state.array_records and dict(ctx.state.config_records[STAMPS]) == {MODEL_STATE: 1}
        runtime = ClientRuntime(ctx, key)
        loaded = runtime.model.state_dict()  # what the node's next message starts from
        assert on_disk.keys() == loaded.keys() and all(torch.equal(on_disk[k], loaded[k]) for k in on_disk)
        assert runtime.state_restores == 0  # the context knew it: not a restore
    assert not list((tmp_path / "state").rglob("*.tmp"))  # written atomically: no partial files left
    assert strategy.rows[0]["client_state_restores"] == 0

    # node 1001 restarts: same node id (an authenticated SuperNode keeps its id), empty context
    before = saved_model(tmp_path / "state", key, 1)
    grid.add_node(1001, 1)
    runtime = ClientRuntime(grid.contexts[1001], key)
    restored = runtime.model.state_dict()
    assert runtime.state_restores == 1 and all(torch.equal(restored[k], before[k]) for k in before)


def test_a_killed_node_is_dropped_and_rejoins_with_its_state(run_config, tmp_path):
    rc = run_config(**{"num-clients": 3, "num-server-rounds": 4})
    strategy, grid = deployed(rc, tmp_path / "state")
    original_round = strategy.train_round
    events = []

    def train_round(server_round):
        if server_round == 2:  # killed after round 1: still listed, never answers
            grid.silent.add(1002)
        if server_round == 3:  # its heartbeat expired: no longer listed
            grid.gone.add(1002)
        if server_round == 4:  # restarted under a new node id with an empty context
            grid.add_node(2002, 2)
            events.append(saved_model(tmp_path / "state", strategy.federation.transport.state_key, 2))
        strategy.federation.refresh()
        return original_round(server_round)

    strategy.train_round = train_round
    strategy.start(grid)
    rows = strategy.rows
    assert [r["dropped_clients"] for r in rows] == [[], [2], [2], []]
    assert [r["num_clients"] for r in rows] == [3, 2, 2, 3]
    # asked in round 2 and silent; no longer listed in round 3, so not asked
    assert [r["eval_missing"] for r in rows] == [[], [2], [], []]
    assert strategy.results is None or strategy.results.summary()["incomplete_evaluations"] == [2]
    assert rows[-1]["client_state_restores"] == 1  # the restarted node found its model on disk
    assert set(rows[1]["accuracy_per_client"]) == {"0", "1"} and set(rows[3]["accuracy_per_client"]) == {"0", "1", "2"}
    assert strategy.federation.roster.nodes[2] == 2002
    # what it restored is what it had saved at the end of round 1 (it missed rounds 2 and 3)
    first = events[0]
    now = saved_model(tmp_path / "state", strategy.federation.transport.state_key, 2)
    assert any(not torch.equal(first[k], now[k]) for k in first)  # and it trained on from there in round 4
    assert strategy.counters.dropped["train"] >= 1


def test_a_state_file_gone_under_a_running_node_is_logged_and_the_client_starts_afresh(run_config, tmp_path, caplog):
    rc = run_config(**{"num-clients": 2, "num-server-rounds": 1})
    strategy, grid = deployed(rc, tmp_path / "state")
    strategy.start(grid)
    ctx = next(iter(grid.contexts.values()))
    partition = ctx.node_config["partition-id"]
    (
        tmp_path / "state" / strategy.federation.transport.state_key / f"partition-{partition}" / f"{MODEL_STATE}.pt"
    ).unlink()
    runtime = ClientRuntime(ctx, strategy.federation.transport.state_key)
    assert not runtime.restore(MODEL_STATE, torch.nn.Linear(1, 1))
    assert f"'{MODEL_STATE}' of round 1 is gone" in caplog.text and runtime.state_restores == 0
