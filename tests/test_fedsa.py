"""FedSA: payload bytes, the anchors' initialisation, the client's loss against a hand computation, the margin's
state, the server's EMA by hand, learning on CIFAR-10, hostile uploads and resume (docs/methods/fedsa.md)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_hostile import attacker, scaled
from test_resume import run_with_results

from common.config import ConfigError, RunConfig
from common.payload import ClientReply
from common.protocol import PAYLOAD
from conftest import (
    assert_learns,
    captured_federation,
    client_runtime,
    federation,
    make_run_config,
    run_method,
    train_config,
)
from methods.fedsa import LOCAL_GAP_STATE, FedSAOptions, LocalGap, anchor_loss, initial_anchors, mean_nearest_distance
from methods.registry import build_run, client_procedure


def test_payload_bytes_are_the_formula(run_config):
    rc = run_config(method="fedsa", **{"num-clients": 3, "num-server-rounds": 2})
    run, grid, replies = captured_federation(rc)
    run.start(grid)
    k, c = RunConfig.from_dict(rc).representation_dim, 10
    assert [row["bytes_down"] for row in run.rows] == [3 * 4 * c * k] * 2  # the anchors, round 1 included
    uploads = [r.content.array_records[PAYLOAD] for r in replies if r.metadata.message_type == "train"]
    rows = sum(u["proto_labels"].shape[0] for u in uploads)
    assert sum(row["bytes_up"] for row in run.rows) == rows * (4 * k + 8)
    evaluate = [m for m in grid.sent if m.metadata.message_type == "evaluate"]
    available = int(evaluate[-1].content.array_records[PAYLOAD]["mask"].numpy().sum())
    assert run.rows[-1]["eval_bytes_down"] == 3 * (4 * available * k + c)


def test_initial_anchors_are_the_seeds_mlp_output():
    # batch-statistic BatchNorm then ReLU: every entry >= 0 and about half of each dimension's entries zero
    anchors = initial_anchors(10, 64, seed=3)
    assert anchors.shape == (10, 64) and anchors.dtype == torch.float32
    assert torch.equal(anchors, initial_anchors(10, 64, seed=3))
    assert not torch.equal(anchors, initial_anchors(10, 64, seed=4))
    assert float(anchors.min()) == 0.0
    zeros = (anchors == 0).float().mean(0)
    assert 0.2 < float(zeros.mean()) < 0.8
    state = torch.random.get_rng_state()
    initial_anchors(10, 64, seed=5)
    assert torch.equal(state, torch.random.get_rng_state())  # the global RNG untouched


def test_anchor_loss_is_the_three_terms_by_hand():
    torch.manual_seed(0)
    features, y = torch.randn(5, 4, dtype=torch.float64), torch.tensor([0, 2, 2, 1, 0])
    anchors = torch.rand(3, 4, dtype=torch.float64)
    head = torch.nn.Linear(4, 3).double()
    options = FedSAOptions(lambda_=2.0, mcl=0.5, cc=3.0)
    margin = 0.7
    calibration = F.cross_entropy(head(anchors), torch.arange(3))
    regulariser = ((features - anchors[y]) ** 2).mean()
    distances = torch.cdist(features, anchors)
    distances[torch.arange(5), y] += margin
    contrastive = F.cross_entropy(-distances, y)
    expected = 3.0 * calibration + 2.0 * regulariser + 0.5 * contrastive
    torch.testing.assert_close(anchor_loss(features, y, head, anchors, margin, options), expected)


def test_mean_nearest_distance_by_hand():
    rows = torch.tensor([[0.0, 0.0], [3.0, 4.0], [3.0, 0.0]])
    # nearest: 0 -> 2 (3), 1 -> 2 (4), 2 -> 0 (3)
    assert mean_nearest_distance(rows) == pytest.approx(10 / 3)
    assert mean_nearest_distance(rows[:1]) == 0.0


def test_the_margin_reads_the_clients_last_upload(run_config):
    rc = run_config(method="fedsa", **{"num-clients": 2})
    cfg = RunConfig.from_dict(rc)
    procedure = client_procedure(cfg)
    payload = build_run(cfg).method.global_arrays()
    client = client_runtime(rc, 0)
    gap = LocalGap()
    assert not client.restore(LOCAL_GAP_STATE, gap) and float(gap.gap) == 0.0  # never uploaded
    arrays, _ = procedure.train(client, payload, train_config(rc))
    assert client.restore(LOCAL_GAP_STATE, gap)
    assert float(gap.gap) == pytest.approx(mean_nearest_distance(torch.from_numpy(arrays["protos"])), rel=1e-6)
    assert len(arrays["proto_labels"]) == 2 and float(gap.gap) > 0  # two classes a client


def test_server_step_by_hand():
    rc = make_run_config(method="fedsa", aggregation="mean", **{"fedsa.ema": 0.25})
    server = build_run(RunConfig.from_dict(rc)).method
    before = server.global_arrays()["anchors"].astype(np.float64)
    k = before.shape[1]
    replies = [
        ClientReply(1000, 0, {"protos": np.full((2, k), 1.0, np.float32), "proto_labels": np.array([0, 3])}, {}),
        ClientReply(1001, 1, {"protos": np.full((1, k), 3.0, np.float32), "proto_labels": np.array([3])}, {}),
    ]
    metrics = server.aggregate_train(1, replies)
    expected = before.copy()
    expected[0] = 0.75 * before[0] + 0.25 * 1.0
    expected[3] = 0.75 * before[3] + 0.25 * 2.0  # P̄_3 = (1 + 3) / 2, unweighted
    after = server.global_arrays()["anchors"]
    np.testing.assert_allclose(after, expected, atol=1e-6)
    assert metrics["server-anchor-shift"] == pytest.approx(np.linalg.norm(after - before), rel=1e-5)
    evaluation = server.configure_evaluate(1000, 1)
    assert evaluation["mask"].tolist() == [c in (0, 3) for c in range(10)]
    np.testing.assert_allclose(evaluation["protos"], [[1.0] * k, [2.0] * k])


def test_record_level_dp_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="'dp.epsilon'"):
        build_run(RunConfig.from_dict(make_run_config(method="fedsa", **{"dp.epsilon": 8.0})))


def test_learns_on_cifar10(run_config):
    # 5 rounds of 2 epochs on 400 CIFAR-10 examples a client (conftest.run_method's budget)
    rc, run, _, _ = run_method(run_config, "fedsa")
    assert_learns(rc, run)


@pytest.mark.parametrize("value", [float("nan"), 1e30])
def test_a_hostile_upload_is_dropped_or_bounded(run_config, value):
    # a non-finite row is dropped; an extreme one is bounded by the default norm-bound: the anchors stay finite
    # and close to where they started (the EMA moves them by ema times the bounded prototypes)
    rc = run_config(method="fedsa", **{"num-clients": 3, "num-server-rounds": 2})
    run, grid = federation(rc, attacker("train", scaled("protos", value)))
    run.start(grid)
    anchors = run.method.global_arrays()["anchors"]
    start = build_run(RunConfig.from_dict(rc)).method.global_arrays()["anchors"]
    assert np.isfinite(anchors).all() and np.abs(anchors - start).max() < 1.0
    if value != value:
        assert run.counters.dropped["train"] == 2


def test_resume_continues_exactly(run_config):
    base = run_config(method="fedsa", **{"num-clients": 3, "fraction-train": 0.67})
    whole, _ = run_with_results({**base, "num-server-rounds": 3}, name="whole")
    first, grid = run_with_results({**base, "num-server-rounds": 2}, name="first")
    second, _ = run_with_results(
        {**base, "num-server-rounds": 3, "resume-from": str(first.results.path)}, grid, name="second"
    )
    assert [r["accuracy_per_client"] for r in whole.rows] == [r["accuracy_per_client"] for r in second.rows]
    assert np.array_equal(whole.method.global_arrays()["anchors"], second.method.global_arrays()["anchors"])


def test_a_held_out_client_is_served_the_anchors_and_evaluated_on_the_global_prototypes(run_config):
    rc = run_config(method="fedsa", **{"generalization.held-out-clients": 1.0, "generalization.rounds": 2})
    run, grid = federation(rc)
    run.start(grid)
    row = run.rows[-1]
    assert row["heldout_partitions"] == [3] and len(row["heldout_curve_mean"]) == 3
    assert row["heldout_curve_mean"][-1] > 0  # nearest global prototype: the held-out client's classes have one
    anchors = run.method.global_arrays()["anchors"]
    sent = [m for m in grid.sent if m.metadata.message_type == "train"][-1].content.array_records[PAYLOAD]
    assert np.array_equal(sent["anchors"].numpy(), anchors)  # the phase left the server's anchors alone
