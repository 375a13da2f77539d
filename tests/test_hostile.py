"""Hostile and faulty clients, through the fake grid: no reply may crash or poison a run.

Each attack tampers with the train replies of one node (partition 1). The run must go on, the
reply must be dropped and counted (the partition is in the round's ``dropped_clients``), and the
server's global state must equal that of a run in which the same reply was simply lost.
"""

from __future__ import annotations

import io
import math
import tracemalloc

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict

from common.protocol import PAYLOAD
from conftest import federation

ATTACKER = 1001  # node of partition 1 in the fake grid


def npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def with_payload(reply: Message, arrays: dict[str, Array]) -> Message:
    reply.content = RecordDict({PAYLOAD: ArrayRecord(arrays), "metrics": reply.content.metric_records["metrics"]})
    return reply


def with_metrics(reply: Message, **changes) -> Message:
    metrics = MetricRecord({**dict(reply.content.metric_records["metrics"]), **changes})
    reply.content = RecordDict({**dict(reply.content.array_records), "metrics": metrics})
    return reply


def lost(reply: Message) -> Message:
    """A reply the server cannot use at all (no records): dropped without a word about its payload."""
    reply.content = RecordDict()
    return reply


def attacker(message_type: str, attack):
    """A fake-grid ``tamper`` passing partition 1's replies of ``message_type`` through ``attack``."""

    def tamper(node, reply):
        if node == ATTACKER and reply.metadata.message_type == message_type and not reply.has_error():
            return attack(reply)
        return reply

    return tamper


def state_arrays(state, prefix: str = "") -> dict[str, np.ndarray]:
    """A strategy's ``server_state()`` flattened to name -> ndarray (modules, optimisers, RNGs)."""
    if isinstance(state, dict):
        return {k: v for key, value in state.items() for k, v in state_arrays(value, f"{prefix}{key}.").items()}
    if isinstance(state, (list, tuple)):
        return {k: v for i, value in enumerate(state) for k, v in state_arrays(value, f"{prefix}{i}.").items()}
    if isinstance(state, torch.Tensor):
        return {prefix: state.detach().cpu().numpy().copy()}
    return {prefix: np.asarray(state).copy()} if isinstance(state, (np.ndarray, int, float)) else {}


def run(run_config, attack, rounds: int = 2, **options):
    """(rows, server state) of a run (FedGH unless ``options`` say otherwise) whose partition-1
    train replies go through ``attack``."""
    rc = run_config(**{"num-clients": 3, "num-server-rounds": rounds, **options})
    strategy, grid = federation(rc, attacker("train", attack))
    strategy.start(grid)
    return strategy.rows, state_arrays(strategy.method.server_state())


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """The same run with partition 1's train replies lost."""
    from conftest import make_run_config

    out = tmp_path_factory.mktemp("baseline")
    return run(lambda **o: make_run_config(**{"output-dir": str(out), **o}), lost)


def assert_dropped_like_lost(rows, arrays, baseline):
    base_rows, base_arrays = baseline
    assert [r["round"] for r in rows] == [r["round"] for r in base_rows]
    for row in rows:
        assert 1 in row["dropped_clients"] and row["num_clients"] == 2
    assert arrays and arrays.keys() == base_arrays.keys()
    for k in arrays:
        assert (arrays[k].dtype.kind != "f" or np.isfinite(arrays[k]).all()) and np.array_equal(
            arrays[k], base_arrays[k]
        ), k


def test_hostile_npz_blob_is_dropped(run_config, baseline):
    def attack(reply):
        buffer = io.BytesIO()
        np.savez(buffer, lar=np.zeros((2, 500), np.float32))
        return with_payload(
            reply,
            {
                "lar": Array("float32", (2, 500), "numpy.ndarray", buffer.getvalue()),
                "lar_labels": Array(np.array([0, 1], np.int32)),
            },
        )

    assert_dropped_like_lost(*run(run_config, attack), baseline)


def test_hostile_torch_typed_and_truncated_arrays_are_dropped(run_config, baseline):
    def torch_typed(reply):
        arrays = dict(reply.content.array_records[PAYLOAD])
        a = arrays["lar"]
        arrays["lar"] = Array(a.dtype, a.shape, "torch.Tensor", a.data)
        return with_payload(reply, arrays)

    def truncated(reply):
        arrays = dict(reply.content.array_records[PAYLOAD])
        a = arrays["lar"]
        arrays["lar"] = Array(a.dtype, a.shape, a.stype, a.data[: len(a.data) // 2])
        return with_payload(reply, arrays)

    assert_dropped_like_lost(*run(run_config, torch_typed), baseline)
    assert_dropped_like_lost(*run(run_config, truncated), baseline)


def test_hostile_huge_declared_shape_allocates_nothing(run_config, baseline):
    """An npy header claiming (1, 2e9) float32 (7.45 GiB) with a few bytes behind it."""
    header = npy_bytes(np.zeros((1, 2), np.float32)).replace(b"(1, 2)", b"(1, 2000000000)")
    header = header[:-8]  # drop the 2 values: the data is what the header says minus everything

    def attack(reply):
        arrays = dict(reply.content.array_records[PAYLOAD])
        arrays["lar"] = Array("float32", (1, 2_000_000_000), "numpy.ndarray", header + b"\0" * 64)
        return with_payload(reply, arrays)

    tracemalloc.start()
    try:
        rows, arrays = run(run_config, attack, rounds=1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 30, f"peak {peak / 2**30:.2f} GiB"
    assert 1 in rows[0]["dropped_clients"] and rows[0]["num_clients"] == 2


def test_hostile_mislabelled_array_is_dropped(run_config, baseline):
    """Array fields that disagree with the bytes (byte counts read them) are refused."""

    def attack(reply):
        arrays = dict(reply.content.array_records[PAYLOAD])
        a = arrays["lar"]
        arrays["lar"] = Array(a.dtype, (1, 500), a.stype, a.data)
        return with_payload(reply, arrays)

    assert_dropped_like_lost(*run(run_config, attack), baseline)


@pytest.mark.parametrize(
    "metrics",
    [
        {"train-loss": [1.0, 2.0]},
        {"train-loss": math.inf},
        {"num-examples": 10**15},
        {"num-examples": -1},
        {"eval-test-correct": 10**6},
        {"train-seconds": math.nan},
        {"train-loss": 1e308},  # summed into the row's weighted mean it was inf
        {"eval-test-acc-global-head": 1e300},  # became the row's global-head accuracy
        {"train-acc": 1.5},
        {"train-seconds": -1.0},
        {"state-restores": 10**12},
        {"test-acc": 0.5},  # an evaluate key in a train reply
        {"eval-test-acc-invented": 0.5},  # a key no method declares
    ],
)
def test_hostile_metrics_are_dropped(run_config, baseline, metrics):
    """List-valued, non-finite, out-of-range and undeclared metrics (a num-examples claim above the
    client's handshake size would outweigh the others in any sample-weighted mean; an accuracy
    above 1 or a loss of 1e308 would poison the row)."""
    assert_dropped_like_lost(*run(run_config, lambda reply: with_metrics(reply, **metrics)), baseline)


def zero_classes(reply: Message) -> Message:
    """The reply's per-class upload with every row removed: valid, but about no class."""
    arrays = reply.content.array_records[PAYLOAD]
    return with_payload(reply, {k: Array(np.ascontiguousarray(v.numpy()[:0])) for k, v in arrays.items()})


@pytest.mark.parametrize("method, state", [("fedproto", "global_set"), ("fd", "global_logits")])
@pytest.mark.parametrize("empty", ["no valid reply", "zero classes"])
def test_hostile_empty_round_keeps_the_global_state(run_config, method, state, empty):
    """FedProto/FD: a round in which every train reply is unusable, or whose only valid reply
    uploads zero classes, keeps the last global prototypes/logits (and sends them in the next
    round) instead of forgetting them."""
    rc = run_config(**{"method": method, "num-clients": 3, "num-server-rounds": 3})
    seen = []

    def tamper(node, reply):
        if reply.metadata.message_type == "train":
            seen.append(node)
            if 4 <= len(seen) <= 6:  # every reply of round 2
                return zero_classes(reply) if empty == "zero classes" and len(seen) == 4 else lost(reply)
        return reply

    strategy, grid = federation(rc, tamper)
    kept = []
    original = strategy.method.aggregate_train

    def aggregate_train(server_round, replies):
        metrics = original(server_round, replies)
        kept.append({k: v.copy() for k, v in getattr(strategy.method, state).items()})
        return metrics

    strategy.method.aggregate_train = aggregate_train
    strategy.start(grid)
    assert [r["num_clients"] for r in strategy.rows] == [3, 0 if empty == "no valid reply" else 1, 3]
    assert kept[0] and kept[1].keys() == kept[0].keys()
    assert all(np.array_equal(kept[1][k], kept[0][k]) for k in kept[0])
    round3 = [m for m in grid.sent if m.metadata.message_type == "train"][6:]
    assert all(m.content.array_records for m in round3)  # round 3 still carries the global state


class _Payload:
    """A pickle that would leave a marker file behind if it were ever unpickled."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_hostile_pickle_checkpoint_is_refused_not_run(tmp_path):
    from common.config import ConfigError
    from common.run_folder import CHECKPOINT, load_checkpoint

    marker = tmp_path / "code-ran"
    torch.save({"round": 1, "server": _Payload(marker)}, tmp_path / CHECKPOINT)
    with pytest.raises(ConfigError, match="resume-from"):
        load_checkpoint(tmp_path)
    assert not marker.exists()


def test_hostile_checkpoint_round_trips_numpy_state(run_config, tmp_path):
    """A real checkpoint (numpy arrays, RNG states, rows) loads with weights_only=True unchanged."""
    from common.run_folder import ResultsWriter, load_checkpoint

    state = {
        "round": 2,
        "method": "fedproto",
        "config": {},
        "state-key": "run",
        "traffic": {},
        "dropped": {},
        "rng": np.random.default_rng(3).bit_generator.state,
        "rows": [{"round": 2, "a": None, "b": [1.5]}],
        "server": {
            "global_set": {"protos": np.arange(6, dtype=np.float32).reshape(2, 3), "mask": np.array([True, False])},
            "generator": torch.Generator().get_state(),
        },
    }
    writer = ResultsWriter.__new__(ResultsWriter)
    writer.path = tmp_path
    writer.write_checkpoint(state)
    loaded = load_checkpoint(tmp_path)
    assert loaded["rng"] == state["rng"] and loaded["rows"] == state["rows"]
    for k, v in state["server"]["global_set"].items():
        assert loaded["server"]["global_set"][k].dtype == v.dtype and np.array_equal(
            loaded["server"]["global_set"][k], v
        )
    assert torch.equal(loaded["server"]["generator"], state["server"]["generator"])
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]  # no temporary left


def test_hostile_torn_state_file_is_ignored_and_rewritten(run_config, tmp_path):
    """A half-written client state file (a crash mid-write by an older version, a full disk)
    must not make that partition fail on every later message: it trains afresh and saves anew."""
    from client_app.app import app as client_app
    from common.config import RunConfig
    from common.runtime import MODEL_STATE
    from fakegrid import FakeGrid
    from methods.registry import build_run

    rc = run_config(**{"num-clients": 3, "num-server-rounds": 1})
    cfg = RunConfig.from_dict(rc)
    strategy = build_run(cfg)
    grid = FakeGrid(client_app, rc, 3, node_config={"state-dir": str(tmp_path / "state")})
    torn = tmp_path / "state" / strategy.federation.transport.state_key / "partition-1" / f"{MODEL_STATE}.pt"
    torn.parent.mkdir(parents=True)
    buffer = io.BytesIO()
    torch.save({"w": torch.zeros(1000)}, buffer)
    torn.write_bytes(buffer.getvalue()[:500])
    strategy.start(grid)
    (row,) = strategy.rows
    assert row["num_clients"] == 3 and row["dropped_clients"] == [] and row["client_state_restores"] == 0
    assert torch.load(torn, weights_only=True).keys()  # rewritten whole after training


def test_hostile_failed_write_keeps_the_old_file(tmp_path):
    from common.files import atomic_write

    path = tmp_path / "state.pt"
    path.write_bytes(b"old")

    def crash(f):
        f.write(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, crash)
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["state.pt"]


def _fedgh(run_config, rounds, **grid_options):
    from client_app.app import app as client_app
    from common.config import RunConfig
    from fakegrid import FakeGrid
    from methods.registry import build_run

    rc = run_config(**{"num-clients": 3, "num-server-rounds": rounds})
    return build_run(RunConfig.from_dict(rc)), FakeGrid(client_app, rc, 3, **grid_options)


def test_hostile_impostor_cannot_take_a_connected_partition(run_config):
    """A new node claiming partition 1 while node 1001 is connected is refused: 1001 keeps
    training and the impostor never receives that client's payload."""
    strategy, grid = _fedgh(run_config, 3)
    original = strategy.train_round

    def train_round(server_round):
        if server_round == 2:
            grid.add_node(6666, 1)  # joins before round 3's refresh
        return original(server_round)

    strategy.train_round = train_round
    strategy.start(grid)
    assert strategy.federation.roster.nodes == [1000, 1001, 1002] and strategy.counters.dropped["query"] == 1
    assert [r["num_clients"] for r in strategy.rows] == [3, 3, 3]
    to_impostor = [m.metadata.message_type for m in grid.sent if m.metadata.dst_node_id == 6666]
    assert to_impostor == ["query"]


def test_hostile_duplicate_claim_at_the_handshake_drops_the_later_node(run_config):
    strategy, grid = _fedgh(run_config, 1)
    grid.add_node(6666, 0)  # a fourth node claiming partition 0, listed after node 1000
    strategy.start(grid)
    assert strategy.federation.roster.nodes == [1000, 1001, 1002] and strategy.counters.dropped["query"] == 1
    assert strategy.rows[0]["num_clients"] == 3


def test_hostile_silent_new_node_is_asked_with_backoff(run_config):
    """A node that connects but never answers is asked in rounds 1, 2 and 4 of 6, not every
    round (each ask costs up to QUERY_SECONDS of waiting in a deployment)."""
    strategy, grid = _fedgh(run_config, 6)
    original = strategy.federation.roster.handshake

    def handshake():
        original()
        grid.add_node(6666, 2)
        grid.silent.add(6666)

    strategy.federation.roster.handshake = handshake
    strategy.start(grid)
    assert sum(m.metadata.dst_node_id == 6666 for m in grid.sent) == 3
    assert [r["num_clients"] for r in strategy.rows] == [3] * 6


def test_hostile_restarted_node_takes_its_partition_once_the_old_one_is_gone(run_config):
    """Without node auth a restarted SuperNode has a new id while the old one may still be listed:
    its claim waits (no new query) and is granted in the first round the old node is gone."""
    strategy, grid = _fedgh(run_config, 4)
    original = strategy.train_round

    def train_round(server_round):
        if server_round == 1:
            grid.silent.add(1002)  # killed, still listed
            grid.add_node(2002, 2)  # restarted under a new id
        if server_round == 2:
            grid.gone.add(1002)  # its heartbeat expired
        if server_round == 1:  # a node of another federation: asked once, then left alone
            grid.add_node(7777, 9).node_config["num-partitions"] = 10
        return original(server_round)

    strategy.train_round = train_round
    strategy.start(grid)
    assert strategy.federation.roster.nodes == [1000, 1001, 2002]
    assert [r["num_clients"] for r in strategy.rows] == [2, 2, 3, 3]
    assert sum(m.metadata.dst_node_id == 2002 and m.metadata.message_type == "query" for m in grid.sent) == 1
    assert sum(m.metadata.dst_node_id == 7777 for m in grid.sent) == 1


def test_hostile_num_params_claim_is_bounded_by_the_model_group(run_config):
    """MH-pFedHN allocates a hypernetwork head of the claimed size K: a claim above the largest
    model of the run's group (here 1e8, ~51 GB of head) is dropped before anything is allocated."""
    from common.config import RunConfig
    from methods.blocks.hypernetwork import num_params

    rc = run_config(
        **{
            "method": "mh-pfedhn",
            "model-group": "mh-lenet",
            "num-clients": 3,
            "num-server-rounds": 1,
            "connect-timeout": 1.0,
        }
    )
    strategy, grid = federation(rc, attacker("query", lambda reply: with_metrics(reply, **{"num-params": 10**8})))
    with pytest.raises(RuntimeError, match="only 2 of num-clients=3"):
        strategy.start(grid)
    assert (
        strategy.counters.dropped["query"] >= 1 and "p1" not in strategy.method.hn.sizes
    )  # no head was made for the claim
    # the bound is the group's largest model: an honest client's K is within it
    from models.groups import MODEL_GROUPS

    cfg = RunConfig.from_dict(rc)
    assert num_params(MODEL_GROUPS["mh-lenet"].build(0, 10, 3, 32, cfg.seed)) <= strategy.method.max_params < 10**8


def test_hostile_handshake_size_claim_beyond_the_dataset_is_dropped(run_config):
    """num-train bounds every later num-examples claim, so it is itself bounded by the dataset."""
    rc = run_config(**{"num-clients": 3, "num-server-rounds": 1, "connect-timeout": 1.0})
    strategy, grid = federation(rc, attacker("query", lambda reply: with_metrics(reply, **{"num-train": 10**9})))
    with pytest.raises(RuntimeError, match="only 2 of num-clients=3"):
        strategy.start(grid)
    assert strategy.counters.dropped["query"] == 1 and ATTACKER not in strategy.federation.roster.clients


def scaled(key: str, value: float):
    """An attack setting one entry of payload array ``key`` to ``value``."""

    def attack(reply):
        arrays = dict(reply.content.array_records[PAYLOAD])
        a = arrays[key].numpy().copy()
        a.reshape(-1)[0] = value
        arrays[key] = Array(a)
        return with_payload(reply, arrays)

    return attack


MH = {"model-group": "mh-lenet"}


@pytest.mark.parametrize(
    "method, key, value, options",
    [
        ("fedgh", "lar", 1e30, {}),
        ("fedgh", "lar", 3e38, {}),
        ("fedre", "z", 1e30, {}),
        ("fedtgp", "protos", 1e38, {"fedtgp.server-epochs": 2}),
        ("fedproto", "protos", 1e38, {}),
        ("fd", "logits", 1e38, {}),
        ("mh-pfedhn", "delta_theta", 3e38, MH),
    ],
)
def test_hostile_huge_finite_uploads_are_dropped(run_config, method, key, value, options):
    """Finite but absurd magnitudes (FedRE's z = 1e30 would drive the head to ~1e28 in one
    step, FedTGP's prototypes of 1e38 make the generator NaN, an MH-pFedHN delta of 3e38 the
    shared trunk) are refused by the schema's bound: the method's server state equals that of
    a run in which the reply was lost."""
    options = {"method": method, **options}
    assert_dropped_like_lost(*run(run_config, scaled(key, value), 1, **options), run(run_config, lost, 1, **options))


def test_hostile_rebuilt_fedkd_weights_beyond_the_bound_are_dropped(run_config):
    """FedKD: SVD factors each within the entry bound can rebuild a weight of ~1e18 (or inf);
    the rebuilt weights are checked, so the mentee stays what it is without the reply."""

    def attack(reply):
        arrays = dict(reply.content.array_records[PAYLOAD])
        for key in [k for k in arrays if k.endswith((".u", ".s", ".v"))][:3]:
            arrays[key] = Array(np.full_like(arrays[key].numpy(), 1e6))
        return with_payload(reply, arrays)

    assert_dropped_like_lost(*run(run_config, attack, 1, method="fedkd"), run(run_config, lost, 1, method="fedkd"))


@pytest.mark.parametrize("method", ["lg-fedavg", "fedmrl"])
def test_hostile_num_examples_beyond_the_handshake_is_dropped(run_config, method):
    """FedAvg family: a claim of 1e15 training examples would make the mean that client's own
    model; claims above the handshake's ``num-train`` are dropped."""
    assert_dropped_like_lost(
        *run(run_config, lambda reply: with_metrics(reply, **{"num-examples": 10**15}), 1, method=method),
        run(run_config, lost, 1, method=method),
    )


def test_hostile_outlying_representation_is_scaled_to_the_round_bound(run_config):
    """FedRE's server step has no clipping: a z within the entry bound but ~1e5 times the others'
    length would dominate the head. It is scaled to ROW_NORM_FACTOR times the longest other
    upload, counted in ``clipped_rows``; honest rounds clip nothing."""
    from common.payload import ROW_NORM_FACTOR

    def attack(reply):
        arrays = dict(reply.content.array_records[PAYLOAD])
        arrays["z"] = Array(np.full_like(arrays["z"].numpy(), 1e5))
        return with_payload(reply, arrays)

    seen = []
    rc = run_config(**{"method": "fedre", "num-clients": 3, "num-server-rounds": 2})
    strategy, grid = federation(rc, attacker("train", attack))
    original = strategy.method.aggregate_train

    def aggregate_train(server_round, replies):
        seen.append({r.partition_id: float(np.linalg.norm(r.arrays["z"])) for r in replies})
        return original(server_round, replies)

    strategy.method.aggregate_train = aggregate_train
    strategy.start(grid)
    assert [r["clipped_rows"] for r in strategy.rows] == [1, 1]
    for norms in seen:
        honest = max(norms[0], norms[2])
        assert norms[1] == pytest.approx(ROW_NORM_FACTOR * honest, rel=1e-5)
    weights = state_arrays(strategy.method.server_state())["head.weight."]
    assert np.isfinite(weights).all() and np.abs(weights).max() < 1  # 0.06 here; unclipped 333 after two rounds
    honest_rows, _ = run(run_config, lambda reply: reply, 2, method="fedre")
    assert [r["clipped_rows"] for r in honest_rows] == [0, 0]


def test_hostile_update_that_breaks_the_server_state_is_rolled_back(run_config):
    """Whatever gets through: a server update that leaves the state non-finite is undone, the
    round is recorded as rolled back, and the next round sends the last finite state."""
    rc = run_config(**{"num-clients": 3, "num-server-rounds": 3})
    strategy, grid = federation(rc)
    original = strategy.method.aggregate_train
    headers = []

    def aggregate_train(server_round, replies):
        metrics = original(server_round, replies)
        if server_round == 2:
            strategy.method.header.weight.data[0, 0] = float("nan")
        headers.append({k: v.copy() for k, v in strategy.method.global_arrays().items()})
        return metrics

    strategy.method.aggregate_train = aggregate_train
    strategy.start(grid)
    assert [r.get("server_rolled_back", 0) for r in strategy.rows] == [0, 1, 0]
    round3 = [m for m in grid.sent if m.metadata.message_type == "train"][6:9]
    sent = round3[0].content.array_records[PAYLOAD]["head.weight"].numpy()
    assert np.isfinite(sent).all() and np.array_equal(sent, headers[0]["head.weight"])


def test_hostile_secrets_are_private_and_never_written_through_a_link(tmp_path):
    import os
    import stat

    from tools.deploy import write_certificates, write_node_keys

    out = tmp_path / "certs"
    out.mkdir()
    (out / "server.key").write_bytes(b"old")
    (out / "server.key").chmod(0o644)  # a readable file left from before
    paths = write_certificates(out, [], [])
    assert paths["ca-key"].parent == tmp_path / "certs-ca" and not (out / "ca.key").exists()
    for name in ("ca-key", "key"):
        assert stat.S_IMODE(paths[name].stat().st_mode) == 0o600, name
    keys = tmp_path / "keys"
    keys.mkdir()
    target = tmp_path / "elsewhere"
    os.symlink(target, keys / "node-0")  # a link planted where the private key goes
    with pytest.raises(OSError):
        write_node_keys(keys, 1)
    assert not target.exists()


def test_hostile_unexpected_arrays_are_refused_before_any_is_decoded(run_config, baseline, monkeypatch, caplog):
    """20,000 extra one-element arrays: refused by their names before one of them is decoded,
    and the log line about the reply stays short."""
    import common.payload as payload

    decoded = []
    decode = payload.decode_array
    monkeypatch.setattr(payload, "decode_array", lambda name, array: decoded.append(name) or decode(name, array))

    def attack(reply):
        arrays = dict(reply.content.array_records[PAYLOAD])
        extra = Array(np.zeros(1, np.float32))
        return with_payload(reply, {**arrays, **{f"x{i}": extra for i in range(20_000)}})

    with caplog.at_level("WARNING"):
        rows, arrays = run(run_config, attack)
    assert_dropped_like_lost(rows, arrays, baseline)
    assert decoded and not [name for name in decoded if name.startswith("x")]
    dropped = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Dropped train reply")]
    assert len(dropped) == 2 and max(len(m) for m in dropped) < 500, dropped
    assert "20002 arrays" in dropped[0] and "and 19995 more" in dropped[0]


def test_hostile_invented_metric_keys_are_dropped_and_rows_stay_small(run_config, baseline):
    """5,000 invented ``eval-test-acc-*`` keys made one row 154 KB: now the reply is dropped."""
    import json

    invented = {f"eval-test-acc-x{i}": 0.5 for i in range(5000)}
    rows, arrays = run(run_config, lambda reply: with_metrics(reply, **invented))
    assert_dropped_like_lost(rows, arrays, baseline)
    assert max(len(json.dumps(row, allow_nan=False)) for row in rows) < 5000


def test_hostile_second_reply_of_a_partition_is_dropped(run_config):
    """A replayed (or spoofed) second reply of partition 1 in one exchange is dropped and counted;
    the server step uses partition 1 once, as in an untouched run."""
    rc = run_config(**{"num-clients": 3, "num-server-rounds": 2})
    clean, grid = federation(rc)
    clean.start(grid)

    strategy, grid = federation(rc)
    exchange = strategy.federation.transport.exchange

    def replayed(messages, timeout=None, key="round-timeout"):
        replies = exchange(messages, timeout, key)
        return replies + [
            r for r in replies if r.metadata.src_node_id == ATTACKER and r.metadata.message_type == "train"
        ]

    strategy.federation.transport.exchange = replayed
    strategy.start(grid)
    assert strategy.counters.dropped["train"] == 2  # one replay per round
    for row, clean_row in zip(strategy.rows, clean.rows):
        assert (
            row["num_clients"] == 3
            and row["dropped_clients"] == []
            and row["accuracy_mean"] == clean_row["accuracy_mean"]
        )
    mine, theirs = state_arrays(strategy.method.server_state()), state_arrays(clean.method.server_state())
    assert mine.keys() == theirs.keys() and all(np.array_equal(mine[k], theirs[k]) for k in mine)


def without(key: str):
    """An attack removing metric ``key`` from the reply."""

    def attack(reply):
        metrics = MetricRecord({k: v for k, v in reply.content.metric_records["metrics"].items() if k != key})
        reply.content = RecordDict({**dict(reply.content.array_records), "metrics": metrics})
        return reply

    return attack


SAMPLED = {"handshake": "sampled", "eval-clients": "trained", "fraction-train": 1.0}


@pytest.mark.parametrize(
    "attack, counted",
    [
        (lambda reply: with_metrics(reply, **{"num-train": 10**9}), "query"),  # beyond the dataset
        (without("num-train"), "query"),  # no handshake answer
        (lambda reply: with_metrics(reply, **{"num-partitions": 7}), "outsider"),  # a partition outside the run
        (lambda reply: with_metrics(reply, **{"num-examples": 10**15}), "train"),  # beyond its own num-train
    ],
)
def test_hostile_handshake_answered_in_a_train_reply_is_checked_like_a_query(run_config, attack, counted):
    """Handshake ``sampled``: a new node answers the handshake's query inside its first train reply. Its
    answer is checked as a query reply's before the node is admitted (a node outside the run is not asked
    again), and the train part against the answer: the run goes on exactly as if partition 1's replies
    were lost."""
    rc = run_config(**{"num-clients": 3, "num-server-rounds": 2, **SAMPLED})
    strategy, grid = federation(rc, attacker("train", attack))
    strategy.start(grid)
    lost_rows, lost_arrays = run(run_config, lost, 2, **SAMPLED)
    assert not [m for m in grid.sent if m.metadata.message_type == "query"]  # FedGH: no query of its own
    assert (ATTACKER in strategy.federation.roster.clients) == (counted == "train")
    assert (ATTACKER in strategy.federation.roster.outsiders) == (counted == "outsider")
    if counted != "outsider":
        assert strategy.counters.dropped[counted] >= 1
    for row, lost_row in zip(strategy.rows, lost_rows, strict=True):
        assert row["num_clients"] == lost_row["num_clients"] == 2
        # an admitted client whose train reply was dropped is still evaluated, as after a full handshake
        assert counted == "train" or row["accuracy_per_client"] == lost_row["accuracy_per_client"]
    arrays = state_arrays(strategy.method.server_state())
    assert arrays.keys() == lost_arrays.keys() and all(np.array_equal(arrays[k], lost_arrays[k]) for k in arrays)
