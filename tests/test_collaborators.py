"""The run's collaborators alone, each built from its explicit inputs without a method or a runner:
the federation (roster and transport) on the fake grid, the round counters, the checkpoint store."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ConfigRecord

from common.config import ConfigError, RunConfig
from common.payload import NO_PAYLOAD_SCHEMAS
from common.run_folder import ResultsWriter
from engine.checkpoint import Checkpoints
from engine.federation import Federation
from engine.roster import Roster
from engine.round_rows import RoundCounters
from engine.transport import ReplyRules

#: the least a transport needs of a method: schemas without payload, no metrics or checks of its own
RULES = ReplyRules(
    NO_PAYLOAD_SCHEMAS, {}, False, check_reply=lambda message_type, metrics: None, reply_dims=lambda node: {}
)


def collaborators(rc: dict):
    from client_app.app import app as client_app
    from fakegrid import FakeGrid

    cfg = RunConfig.from_dict(rc)
    counters = RoundCounters()
    federation = Federation(cfg, counters, np.random.default_rng(cfg.seed), None, query_in_train=False)
    federation.bind(RULES)
    grid = FakeGrid(client_app, rc, cfg.num_clients)
    federation.open(grid, "alone")
    return federation, counters, grid


def test_registry_and_transport_alone_handshake_sample_and_count(run_config):
    federation, counters, grid = collaborators(run_config(method="local", **{"fraction-train": 0.5}))
    roster, transport = federation.roster, federation.transport
    federation.handshake()
    assert roster.nodes == [1000, 1001, 1002, 1003]  # ordered by partition id
    assert [roster.clients[n]["partition-id"] for n in roster.nodes] == [0, 1, 2, 3]
    assert counters.traffic == {"query_bytes_down": 0, "query_bytes_up": 0}  # queries carry no arrays
    sampled = roster.sample()
    again = Roster(roster.cfg, RoundCounters(), np.random.default_rng(roster.cfg.seed), federation)
    again.nodes, again.connected = list(roster.nodes), set(roster.connected)
    again.clients.update(roster.clients)
    again.num_partitions = roster.num_partitions
    assert len(sampled) == 2 and again.sample() == sampled  # seeded: the same draw from the same seed
    grid.silent.add(sampled[0])
    transport.timeout = 0.3
    replies = transport.exchange([transport.message("query", n, {}, ConfigRecord(), 1) for n in sampled])
    assert [r.metadata.src_node_id for r in replies] == sampled[1:]
    assert counters.dropped["query"] == 1 and counters.round_dropped == {sampled[0] - 1000}
    counters.begin_round()
    assert counters.round_dropped == set() and counters.dropped["query"] == 1  # the run's count stays


def test_checkpoint_store_alone_builds_and_loads_what_a_resume_needs(run_config, tmp_path):
    rc = run_config(method="fedgh")
    cfg = RunConfig.from_dict(rc)
    writer = ResultsWriter(cfg.output_dir, "first", cfg.as_dict())
    store = Checkpoints(cfg, writer)
    assert store.state_key() == "first"
    counters, rng = RoundCounters(), np.random.default_rng(5)
    counters.traffic["train_bytes_up"] = 123
    rng.random()
    writer.write_checkpoint(store.build(3, "first", rng, counters, [{"round": 3}], {"header": {}}))
    resumed = Checkpoints(RunConfig.from_dict({**rc, "resume-from": str(writer.path)}), None)
    assert resumed.state_key() == "first"  # a resumed run keeps its clients' state key
    state = resumed.load()
    assert state["round"] == 3 and state["traffic"] == {"train_bytes_up": 123} and state["rows"] == [{"round": 3}]
    assert state["rng"] == rng.bit_generator.state
    other = Checkpoints(RunConfig.from_dict({**rc, "resume-from": str(writer.path), "lr": 0.5}), None)
    with pytest.raises(ConfigError, match=r"'lr' \(0\.01, now 0\.5\)"):
        other.load()


def test_a_long_client_error_is_quoted_with_its_cause():
    """A Ray actor's traceback (2,391 characters on the GPU machine) names its cause last: the log line
    keeps the start and the end, within REASON_CHARS plus the marker."""
    from engine.transport import REASON_CHARS, quoted_reason

    header = "<class 'ray.exceptions.RayTaskError(ClientAppException)'>: ray::ClientAppActor.run() "
    traceback = header + "  File x.py, line 1\n" * 120 + "ValueError: Expected a torch.device with a specified index"
    quoted = quoted_reason(traceback)
    assert quoted.startswith(header[:60]) and "ValueError: Expected a torch.device" in quoted
    assert f"({len(traceback)} characters)" in quoted and len(quoted) <= REASON_CHARS + 30
    assert quoted_reason("short") == "short"
