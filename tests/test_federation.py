"""The run's size follows the federation (``num-clients`` = 0), and TensorBoard logging."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch

from common.config import ConfigError, RunConfig
from common.errors import RunFailed
from common.files import read_rows
from common.protocol import HANDSHAKE
from common.run_folder import load_checkpoint, scalars
from conftest import federation
from server_app.app import run


def grid_of(rc: dict, num_nodes: int):
    """A FakeGrid of ``num_nodes`` nodes (node config ``num-partitions`` = ``num_nodes``) for ``rc``."""
    from client_app.app import app as client_app
    from fakegrid import FakeGrid

    return FakeGrid(client_app, rc, num_nodes)


class TricklingGrid:
    """Wraps a FakeGrid so that its nodes connect one at a time: each look at the node list
    reveals one more node (a simulation's virtual nodes connect over several seconds)."""

    def __init__(self, grid, connected: int = 1) -> None:
        self.grid, self.connected = grid, connected
        self.looks = 0

    def get_node_ids(self):
        self.looks += 1
        nodes = list(self.grid.get_node_ids())
        self.connected = min(self.connected + (self.looks > 1), len(nodes))
        return nodes[: self.connected]

    def __getattr__(self, name):
        return getattr(self.grid, name)


def test_num_clients_zero_takes_every_node_even_when_they_connect_one_by_one(run_config):
    rc = run_config(**{"num-clients": 0, "num-server-rounds": 2})
    grid = grid_of(rc, 5)
    trickling = TricklingGrid(grid)
    results = run(trickling, RunConfig.from_dict(rc), "t")
    queries = [m for m in grid.sent if m.metadata.message_type == "query"]
    # the handshake asked the nodes in several batches as they came, each node once
    assert len(queries) == 5 and len({m.metadata.dst_node_id for m in queries}) == 5 and trickling.looks >= 5
    rows = read_rows(results.path)
    assert [r["num_clients"] for r in rows] == [5, 5]
    assert all(sorted(r["accuracy_per_client"]) == ["0", "1", "2", "3", "4"] for r in rows)
    summary = json.loads((results.path / "summary.json").read_text())
    assert summary["num_clients"] == 5 and summary["config"]["num-clients"] == 0
    # the run's final global arrays (the strategy's Result) are kept: FedGH's header after the last round
    final = torch.load(results.path / "global_arrays.pt", weights_only=True)
    header = load_checkpoint(results.path)["server"]["header"]
    assert set(final) == {"head.weight", "head.bias"} and set(header) == {"weight", "bias"}
    assert all(np.array_equal(final[f"head.{k}"].numpy(), header[k]) for k in header)


def test_explicit_num_clients_that_disagrees_with_the_nodes_fails_fast_naming_both_keys(run_config):
    # 5 SuperNodes but num-clients=3: before, the handshake started with whichever 3 had connected
    rc = run_config(**{"num-clients": 3, "connect-timeout": 600.0})
    strategy, _ = federation(rc)
    with pytest.raises(ConfigError, match=r"'num-clients' = 3.*'num-partitions' = 5"):
        strategy.start(grid_of(rc, 5))


def handshake_fails(run_config, num_nodes: int, edit, error: type, match: str) -> None:
    """With ``num-clients=0``, nodes whose node configs ``edit(grid)`` changed make the run fail fast."""
    rc = run_config(**{"num-clients": 0, "connect-timeout": 600.0})
    strategy, _ = federation(rc)
    grid = grid_of(rc, num_nodes)
    edit(grid)
    with pytest.raises(error, match=match):
        strategy.start(grid)


def test_nodes_must_agree_on_num_partitions(run_config):
    def other_federation(grid):  # the last node belongs to another federation
        grid.contexts[1003].node_config["num-partitions"] = 5

    handshake_fails(run_config, 4, other_federation, ConfigError, r"'num-partitions' = 5, other nodes have 4")


def test_num_clients_zero_needs_num_partitions_in_the_node_config(run_config):
    def no_size(grid):
        for context in grid.contexts.values():
            del context.node_config["num-partitions"]

    handshake_fails(run_config, 2, no_size, ConfigError, r"node config lacks 'num-partitions'.*'num-clients' = 0")


def test_no_node_at_all_times_out_naming_the_key(run_config):
    rc = run_config(**{"num-clients": 0, "connect-timeout": 0.2})
    strategy, _ = federation(rc)
    grid = grid_of(rc, 2)
    grid.gone.update(grid.contexts)
    with pytest.raises(RuntimeError, match=r"only 0 of \? .*'connect-timeout'"):
        strategy.start(grid)


def test_scalars_of_a_row():
    row = {
        "round": 3,
        "evaluated": True,
        "accuracy_mean": 0.5,
        "accuracy_weighted": None,
        "bytes_up": 10,
        "dropped_clients": [2],
        "accuracy_per_client": {"0": 0.25, "1": 0.75},
    }
    assert scalars(row) == {
        "evaluated": 1.0,
        "accuracy_mean": 0.5,
        "bytes_up": 10.0,
        "accuracy_per_client/0": 0.25,
        "accuracy_per_client/1": 0.75,
    }


def test_tensorboard_scalars_equal_the_metrics_rows(run_config):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rc = run_config(**{"num-clients": 3, "num-server-rounds": 3, "logger": "tensorboard", "eval-every": 2})
    results = run(grid_of(rc, 3), RunConfig.from_dict(rc), "tb")
    rows = read_rows(results.path)
    events = EventAccumulator(str(results.path), size_guidance={"scalars": 0})
    events.Reload()
    logged = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
    expected: dict[str, dict[int, float]] = {}
    for row in rows:
        for tag, value in scalars(row).items():
            expected.setdefault(tag, {})[row["round"]] = float(np.float32(value))  # TensorBoard stores float32
    assert logged == expected
    # what a user looks for is there
    assert logged["bytes_up"] == {r["round"]: float(r["bytes_up"]) for r in rows}
    assert set(logged["accuracy_mean"]) == {2, 3}  # round 1 was not evaluated (eval-every 2)
    assert {"accuracy_per_client/0", "server_update_seconds", "round_seconds"} <= set(logged)


def test_tensorboard_logger_is_validated(run_config):
    with pytest.raises(ConfigError, match="'logger'"):
        RunConfig.from_dict(run_config(logger="wandb"))


def test_launcher_refuses_a_federation_size_that_disagrees_with_num_clients(capsys):
    from tools.run import main

    assert main(["-c", "num-clients=3", "--num-supernodes", "5"]) == 2
    assert "'num-clients' = 3" in capsys.readouterr().out


def _handshaken(run_config):
    from flwr.app import ConfigRecord

    strategy, grid = federation(run_config(**{"num-clients": 3}))
    strategy.federation.transport.open(grid, "in-memory")
    strategy.federation.handshake()
    grid.pulls = 0
    return (
        strategy,
        grid,
        [
            strategy.federation.transport.message("query", n, {}, ConfigRecord(), 0)
            for n in strategy.federation.roster.nodes
        ],
    )


def test_pull_loop_returns_as_soon_as_all_replies_are_in(run_config):
    strategy, grid, messages = _handshaken(run_config)
    grid.delay[1001] = 0.2
    start = time.monotonic()
    replies = strategy.federation.transport.exchange(messages, timeout=30.0)
    elapsed = time.monotonic() - start
    assert 0.2 <= elapsed < 1.0, elapsed  # waited for the late reply, not for the timeout
    assert [r.metadata.src_node_id for r in replies] == [1000, 1001, 1002]  # in the order sent
    assert strategy.counters.round_dropped == set() and grid.pulls >= 2

    grid.delay.clear()
    grid.pulls = 0
    start = time.monotonic()
    strategy.federation.transport.exchange(messages_again(strategy), timeout=30.0)
    assert grid.pulls == 1 and time.monotonic() - start < 0.5  # all in at the first look: no sleep at all


def messages_again(strategy):
    from flwr.app import ConfigRecord

    return [
        strategy.federation.transport.message("query", n, {}, ConfigRecord(), 0)
        for n in strategy.federation.roster.nodes
    ]


def test_pull_loop_honours_the_timeout_and_records_late_clients_as_dropped(run_config):
    strategy, grid, messages = _handshaken(run_config)
    grid.delay[1002] = 60.0  # answers far too late
    start = time.monotonic()
    replies = strategy.federation.transport.exchange(messages, timeout=0.3)
    assert 0.3 <= time.monotonic() - start < 1.0
    assert [r.metadata.src_node_id for r in replies] == [1000, 1001]
    assert strategy.counters.round_dropped == {2} and strategy.counters.dropped["query"] == 1


def test_largest_expected_work_is_pushed_first_and_replies_keep_the_sent_order(run_config):
    from flwr.app import ConfigRecord

    from models.groups import MODEL_GROUPS

    strategy, grid, _ = _handshaken(run_config)
    for i, n in enumerate(strategy.federation.roster.nodes):  # the later the partition, the more test examples
        strategy.federation.roster.clients[n]["num-test"] = 10 * (i + 1)
    messages = [
        strategy.federation.transport.message("evaluate", n, {}, ConfigRecord(), 1)
        for n in strategy.federation.roster.nodes
    ]
    grid.sent.clear()
    replies = strategy.federation.transport.exchange(messages, timeout=30.0)
    # evaluate work ~ test examples (no speed measured yet: every architecture counts alike)
    assert [m.metadata.dst_node_id for m in grid.sent] == strategy.federation.roster.nodes[::-1]
    assert [r.metadata.src_node_id for r in replies] == strategy.federation.roster.nodes  # in the order of ``messages``
    # a measured training speed weighs the examples: the client of a slow architecture goes first
    group = MODEL_GROUPS[strategy.cfg.model_group]
    slow = min(strategy.federation.roster.nodes, key=lambda n: strategy.federation.roster.clients[n]["num-train"])
    strategy.counters.seconds_per_image = {
        group.architecture_for(strategy.federation.roster.clients[slow]["partition-id"]): 1000.0
    }
    train = [
        strategy.federation.transport.message("train", n, strategy.method.configure_train(n, 1), ConfigRecord(), 1)
        for n in strategy.federation.roster.nodes
    ]
    assert max(train, key=strategy.federation.transport.expected_seconds).metadata.dst_node_id == slow
    assert (
        strategy.federation.transport.expected_seconds(
            strategy.federation.transport.message("query", slow, {}, ConfigRecord(), 0)
        )
        == 0.0
    )


def test_a_window_keeps_at_most_that_many_messages_waiting_and_changes_no_result(run_config):
    """A simulation's window (``Transport.window``): pushes in batches as replies arrive, at most
    ``window()`` waiting at once, largest work first across batches; same rows as without one."""
    # the fake grid trains a client when its reply is pulled, so the exchange's deadline covers every
    # client's training: generous, so that a loaded machine drops no reply
    rc = run_config(**{"num-clients": 5, "num-server-rounds": 2, "max-examples-per-client": 60, "round-timeout": 120.0})
    plain, grid = federation(rc)
    plain.start(grid)
    windowed, grid = federation(rc)
    waiting, push = [], grid.push_messages

    def counted(messages):
        messages = list(messages)
        waiting.append(len(grid.outbox) + len(messages))
        return push(messages)

    grid.push_messages = counted
    windowed.start(grid, window=lambda: 2)
    assert max(waiting) == 2 and len(waiting) > 6  # 5 queries, 5 trains... in batches of at most 2
    strip = ("seconds", "per_second", "replies_per_ray_node")
    assert [{k: v for k, v in r.items() if not any(s in k for s in strip)} for r in windowed.rows] == [
        {k: v for k, v in r.items() if not any(s in k for s in strip)} for r in plain.rows
    ]


def _sampled_run(run_config, handshake: str, method: str = "fedgh", **overrides):
    """A FedGH run of 10 clients, 3 per round, evaluated right after training, with ``handshake``;
    returns (rows, the query messages sent, the train messages sent)."""
    rc = run_config(
        **{
            "method": method,
            "handshake": handshake,
            "num-clients": 10,
            "fraction-train": 0.3,
            "eval-clients": "trained",
            "num-server-rounds": 3,
            "max-examples-per-client": 40,
            "model-group": "cnn1",
            **overrides,
        }
    )
    grid = grid_of(rc, 10)
    results = run(grid, RunConfig.from_dict(rc), handshake)  # one results folder per run
    sent = {kind: [m for m in grid.sent if m.metadata.message_type == kind] for kind in ("query", "train")}
    return read_rows(results.path), sent["query"], sent["train"]


def _asks_handshake(message) -> bool:
    return bool(message.content.config_records["config"].get(HANDSHAKE, False))


@pytest.mark.parametrize("method", ["fedgh", "fedre"])
def test_sampled_handshake_asks_only_the_sampled_nodes_and_trains_what_the_full_handshake_does(run_config, method):
    # FakeGrid's node ids follow the partition ids, so a draw in node-id order is a draw in partition order:
    # the same seed samples the same clients either way, and everything but the queries must agree
    full_rows, full_queries, full_train = _sampled_run(run_config, "all", method)
    rows, queries, train = _sampled_run(run_config, "sampled", method)
    assert len(full_queries) == 10
    trained = [sorted(r["accuracy_per_client"]) for r in rows]
    assert trained == [sorted(r["accuracy_per_client"]) for r in full_rows] and all(len(t) == 3 for t in trained)
    # each node asked once, the first time it was sampled, and no other node: FedGH in that train message
    # (no query at all), FedRE, which must know partition 0 before it trains, with a query first
    first_train = {}
    for m in train:
        first_train.setdefault(m.metadata.dst_node_id, m)
    if method == "fedre":
        asked = [m.metadata.dst_node_id for m in queries]
        assert not any(_asks_handshake(m) for m in train)
    else:
        assert not queries
        asked = [m.metadata.dst_node_id for m in train if _asks_handshake(m)]
        assert all(m in first_train.values() for m in train if _asks_handshake(m))
    assert len(asked) == len(set(asked)) == len(first_train) < 10
    # (the push order within a round follows measured work, so compare the nodes, not the order)
    assert sorted(m.metadata.dst_node_id for m in train) == sorted(m.metadata.dst_node_id for m in full_train)
    for key in ("accuracy_mean", "accuracy_weighted", "accuracy_per_client", "bytes_up", "bytes_down", "num_clients"):
        assert [r[key] for r in rows] == [r[key] for r in full_rows], key


def test_a_method_that_needs_its_clients_before_training_asks_them_first():
    # a method with a round of its own or state per client must know a node before its train message
    # (engine.contract.needs_query_first, derived from the protocols it implements); the others let a new
    # node answer in its train reply
    from engine.contract import MethodServer, PerClientServer, needs_query_first
    from methods.registry import METHODS

    assert {n for n, m in METHODS.items() if needs_query_first(m.server)} == {"fedre", "mh-pfedhn", "mh-pfedhngd"}
    assert {n for n, m in METHODS.items() if issubclass(m.server, PerClientServer)} == {"mh-pfedhn", "mh-pfedhngd"}

    class HasItsOwnRound(MethodServer):
        def train_round(self, server_round):
            return {}, []

    assert needs_query_first(HasItsOwnRound) and not needs_query_first(MethodServer)


def test_a_server_with_part_of_the_per_client_protocol_is_refused():
    # the runner calls PerClientServer's members only on a server that has all of them: half a set would be
    # silently skipped
    from engine.contract import ClientProcedure, Method, MethodServer

    class SizesRepliesOnly(MethodServer):
        def reply_dims(self, node_id):
            return {}

    with pytest.raises(TypeError, match=r"'half'.*\['reply_dims'\].*'admitted'"):
        Method("half", SizesRepliesOnly, ClientProcedure, {})


@pytest.mark.parametrize(
    "overrides, first",
    [({}, False), ({"dp.epsilon": 8.0}, True), ({"record-payloads": "1"}, True), ({"method": "fedre"}, True)],
)
def test_recording_and_differential_privacy_keep_the_query_first(run_config, overrides, first):
    # a recorded download needs its partition; a spent DP budget must be known before the node is drawn again
    rc = run_config(**{"handshake": "sampled", "eval-clients": "trained", **overrides})
    strategy, _ = federation(rc)
    assert strategy.federation.roster.query_in_train is not first


@pytest.mark.parametrize(
    "overrides, key",
    [
        ({"num-clients": 0}, "num-clients"),
        ({"eval-clients": "all"}, "eval-clients"),
        ({"min-clients": 2}, "min-clients"),
    ],
)
def test_sampled_handshake_refuses_settings_that_need_every_node(run_config, overrides, key):
    rc = run_config(**{"handshake": "sampled", "eval-clients": "trained", **overrides})
    with pytest.raises(ConfigError, match=f"'{key}'"):
        RunConfig.from_dict(rc)


def test_sampled_handshake_refuses_held_out_clients(run_config):
    rc = run_config(**{"handshake": "sampled", "eval-clients": "trained", "generalization.held-out-clients": 1})
    with pytest.raises(ConfigError, match="generalization.held-out-clients"):
        federation(rc)


def test_sampled_handshake_serves_each_partition_by_one_node_and_skips_silent_ones(run_config):
    # node 999 claims partition 0 as well (the first claim stands, the other node is refused for the run);
    # node 1003 is listed but never answers: it is dropped when drawn, and asked again only after a pause
    # (the first draw waits connect-timeout for its answers: short here, the fake nodes answer at once)
    rc = run_config(
        **{
            "handshake": "sampled",
            "connect-timeout": 4.0,
            "num-clients": 6,
            "fraction-train": 0.5,
            "eval-clients": "trained",
            "num-server-rounds": 6,
            "max-examples-per-client": 40,
            "model-group": "cnn1",
        }
    )
    grid = grid_of(rc, 6)
    grid.add_node(999, 0)
    grid.silent.add(1003)
    rows = read_rows(run(grid, RunConfig.from_dict(rc), "t").path)
    partition = {node: ctx.node_config["partition-id"] for node, ctx in grid.contexts.items()}
    train = [m for m in grid.sent if m.metadata.message_type == "train"]
    # FedGH's train message is the same for every client: a new node answers the handshake in its first one
    assert not [m for m in grid.sent if m.metadata.message_type == "query"]
    queries = [m.metadata.dst_node_id for m in train if _asks_handshake(m)]
    trained = [m.metadata.dst_node_id for m in train if not _asks_handshake(m)]
    servers = {}
    for node in trained:
        servers.setdefault(partition[node], set()).add(node)
    assert all(len(nodes) == 1 for nodes in servers.values()) and 1003 not in trained
    assert len(rows) == 6 and all(r["num_clients"] >= 1 for r in rows)
    assert all(len(r["accuracy_per_client"]) == r["num_clients"] for r in rows)
    # each node asked at most once, but the silent one, whose misses space its queries out
    assert all(queries.count(n) == 1 for n in set(queries) - {1003}) and queries.count(1003) <= 3


def _refusing_sampled_config(run_config) -> dict:
    """Handshake ``sampled`` with 1 example per client: too few to split into a train and a
    test set, so every client answers its query with a data error."""
    return run_config(
        **{
            "handshake": "sampled",
            "num-clients": 2,
            "fraction-train": 0.5,
            "eval-clients": "trained",
            "num-server-rounds": 2,
            "max-examples-per-client": 1,
            "model-group": "cnn1",
        }
    )


def test_a_sampled_round_whose_nodes_refuse_fails_the_run_with_their_error(run_config):
    # deployment: a node's data error is its own, the round goes on without it, and a run that trains
    # nothing names the error, not "no reply"
    rc = _refusing_sampled_config(run_config)
    with pytest.raises(RunFailed) as failed:
        run(grid_of(rc, 2), RunConfig.from_dict(rc), "t")
    assert any("'max-examples-per-client'" in e and "cannot serve the run" in e for e in failed.value.client_errors)


def test_a_sampled_simulation_stops_at_the_first_nodes_data_error(run_config):
    # a simulation's nodes share the run config and the data folder: one node's error is the run's
    strategy, grid = federation(_refusing_sampled_config(run_config))
    with pytest.raises(ConfigError, match="max-examples-per-client"):
        strategy.start(grid, window=lambda: 2)
    # the drawn node was asked in its train message, which it answered with the error instead of training
    assert [_asks_handshake(m) for m in grid.sent] == [True]


@pytest.mark.parametrize(
    "method, first",
    [
        # the drawn node answers the handshake in its train message: the wait of both
        ("fedgh", "no reply within 3 s (run config key 'connect-timeout' + 'round-timeout')"),
        ("fedre", "no reply within 2 s (run config key 'connect-timeout')"),  # a query first (query_first)
    ],
)
def test_a_sampled_run_whose_drawn_nodes_never_answer_fails_naming_the_timeout(run_config, method, first):
    # the first draw is the handshake (connect-timeout, the ClientApps may be starting), later ones are rounds
    rc = {**_refusing_sampled_config(run_config), "max-examples-per-client": 40, "round-timeout": 1.0}
    rc["connect-timeout"], rc["method"] = 2.0, method
    grid = grid_of(rc, 2)
    grid.silent.update(grid.get_node_ids())
    with pytest.raises(RunFailed) as failed:
        run(grid, RunConfig.from_dict(rc), "t")
    assert failed.value.client_errors == [first, "no reply within 1 s (run config key 'round-timeout')"]
