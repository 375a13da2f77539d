"""Run config ``record-payloads``: the server keeps what it sent and received in the named rounds, and each
client keeps its just-trained model of those rounds, for the privacy evaluation (``engine.payload_recorder``)."""

import numpy as np
import pytest
import torch

from common.config import RunConfig
from common.errors import ConfigError
from common.protocol import PAYLOAD, snapshot_name
from common.run_folder import ResultsWriter
from common.runtime import MODEL_STATE
from engine.payload_recorder import read_arrays, round_folder
from methods.registry import build_run


def recorded_run(rc: dict):
    """A run on a fake grid with a results folder and the clients' state in it (as a simulation), every
    reply the server received kept in order."""
    from client_app.app import app as client_app
    from fakegrid import FakeGrid

    cfg = RunConfig.from_dict(rc)
    strategy = build_run(cfg, ResultsWriter(cfg.output_dir, "run", cfg.as_dict()))
    replies = []
    grid = FakeGrid(client_app, rc, cfg.num_clients, lambda node, reply: replies.append(reply) or reply)
    strategy.start(grid, state_in_run_folder=True)
    return strategy, replies


def test_the_named_round_keeps_downloads_uploads_and_the_trained_models(run_config):
    rc = run_config(method="fedgh", **{"num-clients": 3, "max-examples-per-client": 60, "record-payloads": "2"})
    strategy, replies = recorded_run(rc)
    run = strategy.results.path
    assert not (run / "payloads" / "round-1").exists()
    train_replies = [r for r in replies if r.metadata.message_type == "train" and r.metadata.group_id == "2"]
    assert len(train_replies) == 3
    stored = 0
    for reply in train_replies:
        pid = reply.content.metric_records["metrics"]["partition-id"]
        folder = round_folder(run, 2, pid)
        up = read_arrays(folder / "train.up.npz")
        sent = {k: v.numpy() for k, v in reply.content.array_records[PAYLOAD].items()}
        assert up.keys() == sent.keys() and all(np.array_equal(up[k], sent[k]) for k in sent)
        down = read_arrays(folder / "train.down.npz")
        assert down.keys() == {"head.weight", "head.bias"}
        assert (folder / "train.up.json").is_file()
        stored += sum(a.nbytes for a in (*up.values(), *down.values()))
        # the client's copy of round 2's model is the model it ended round 2 with (the run's last round)
        state = run / "client-state" / f"partition-{pid}"
        snapshot = torch.load(state / f"{snapshot_name(2)}.pt", weights_only=True)
        final = torch.load(state / f"{MODEL_STATE}.pt", weights_only=True)
        assert snapshot["round"] == 2 and all(torch.equal(snapshot["state"][k], v) for k, v in final["state"].items())
        assert not (state / f"{snapshot_name(1)}.pt").exists()
    row = strategy.rows[1]
    assert stored == row["bytes_up"] + row["bytes_down"]  # what the recording costs: the round's payload bytes


def test_no_recording_without_the_key(run_config):
    rc = run_config(method="fedgh", **{"num-clients": 2, "num-server-rounds": 1, "max-examples-per-client": 40})
    strategy, _ = recorded_run(rc)
    assert not (strategy.results.path / "payloads").exists()
    assert not list((strategy.results.path / "client-state").glob("*/model-round-*"))


@pytest.mark.parametrize("value", ["0", "1,x", "-1", "1;2", "al"])
def test_a_bad_round_list_is_refused_naming_the_key(run_config, value):
    with pytest.raises(ConfigError, match="record-payloads"):
        RunConfig.from_dict(run_config(**{"record-payloads": value}))


@pytest.mark.parametrize(("value", "rounds"), [("", []), ("all", [1, 2, 3]), (" 3, 1 ", [1, 3])])
def test_the_named_rounds(run_config, value, rounds):
    cfg = RunConfig.from_dict(run_config(**{"record-payloads": value, "num-server-rounds": 3}))
    assert [r for r in range(0, 4) if cfg.records_round(r)] == rounds


@pytest.mark.parametrize("value", ["999999", str(10**23), "1,3", "¹"])
def test_a_round_after_the_last_is_refused_naming_the_rounds_allowed(run_config, value):
    """A round the run never reaches was accepted and nothing was recorded."""
    with pytest.raises(ConfigError, match=r"'record-payloads' .*rounds from 1 to 'num-server-rounds' = 2"):
        RunConfig.from_dict(run_config(**{"record-payloads": value, "num-server-rounds": 2}))


def recorded_bytes(run) -> int:
    """Bytes a run's recording took on disk: its payload files and the clients' copies of their models."""
    kept = ("*/model-round-*", "*/training-module-round-*")
    files = [*(run / "payloads").rglob("*.npz"), *(f for k in kept for f in (run / "client-state").glob(k))]
    return sum(f.stat().st_size for f in files)


@pytest.mark.parametrize(
    "method, extra",
    [
        ("fedgh", {}),
        ("mh-pfedhn", {"model-group": "mh-lenet", "mh-pfedhn.hidden-dim": 16}),
        ("fml", {}),
        ("fedkd", {}),
        ("fedmrl", {}),
    ],
)
def test_the_disk_estimate_bounds_what_a_recorded_run_writes(run_config, method, extra):
    """``record-payloads = "all"`` had no disk guard (MH-pFedHN, 2 clients: 7 MB a round, linear in
    rounds x clients): the estimate is at least what the run writes and not far above it, also where the
    clients keep the module they train with companions at the start of the round (FML, FedKD, FedMRL)."""
    rc = run_config(
        method=method, **{"num-clients": 2, "max-examples-per-client": 40, "record-payloads": "all", **extra}
    )
    strategy, _ = recorded_run(rc)
    written = recorded_bytes(strategy.results.path)
    starts = list((strategy.results.path / "client-state").glob("*/training-module-round-*"))
    assert len(starts) == (4 if method in ("fml", "fedkd", "fedmrl") else 0)  # 2 clients x 2 rounds
    estimate = strategy.recording_estimate(2)
    assert written <= estimate <= 1.5 * written, (written, estimate)
    members = {"mh-pfedhn": 1}.get(method, 5)  # of the model group (hetero-cnn5 or mh-lenet), cycled
    assert strategy.recording_estimate(2 * members) == 2 * strategy.recording_estimate(members)
    one_round = build_run(RunConfig.from_dict({**rc, "record-payloads": "2"}))
    assert one_round.recording_estimate(2) * 2 == estimate
    assert build_run(RunConfig.from_dict({**rc, "record-payloads": ""})).recording_estimate(2) == 0


def test_a_recording_above_its_cap_is_refused_naming_both_keys(run_config):
    rc = run_config(method="fedgh", **{"record-payloads": "all", "record-payloads-max-gib": 0.05})
    strategy = build_run(RunConfig.from_dict(rc))
    with pytest.raises(ConfigError, match=r"'record-payloads' = 'all' writes up to .* above 'record-payloads-max-gib'"):
        strategy.check_recording(100)
    line = strategy.check_recording(2)
    assert "MiB per client and round x 2 rounds x 2 clients" in line and "'record-payloads-max-gib' = 0.05" in line


def test_every_method_has_a_disk_estimate(run_config):
    """Every symbol of every method's payload schemas has a largest value (a missing one is a KeyError)."""
    from methods.registry import METHODS

    for method in METHODS:
        cfg = RunConfig.from_dict(run_config(method=method, **{"record-payloads": "1"}))
        line = build_run(cfg).check_recording(2)
        assert "x 1 rounds x 2 clients" in line, method
