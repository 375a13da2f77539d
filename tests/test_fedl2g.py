"""FedL2G (both variants): payload bytes, the quiz gradient against finite differences, the server step by
hand, the warm-up and the quiz set, learning on CIFAR-10, hostile uploads and resume (docs/methods/fedl2g.md)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from flwr.app import Array
from test_hostile import attacker, scaled, with_payload
from test_resume import run_with_results

from common.config import ConfigError, RunConfig
from common.payload import ClientReply
from common.protocol import PAYLOAD
from conftest import captured_federation, chance, client_runtime, federation, make_run_config, run_method
from methods.fedl2g import quiz_gradient
from methods.registry import build_run
from models.base import SplitModel

VARIANTS = ["fedl2g-feat", "fedl2g-logit"]


def fedl2g_config(run_config, method, **kw):
    return run_config(method=method, **{f"{method}.warm-up-rounds": 1, **kw})


@pytest.mark.parametrize("method", VARIANTS)
def test_payload_bytes_are_the_formula(run_config, method):
    # down 4·C·D to each sampled client; up (4·D + 8)·m_i, m_i the classes of its study batch
    rc = fedl2g_config(run_config, method, **{"num-clients": 3, "num-server-rounds": 2})
    run, grid, replies = captured_federation(rc)
    run.start(grid)
    width = RunConfig.from_dict(rc).representation_dim if method == "fedl2g-feat" else 10
    train = [m for m in grid.sent if m.metadata.message_type == "train"]
    assert all(tuple(m.content.array_records[PAYLOAD]["guiding"].shape) == (10, width) for m in train)
    for row in run.rows:
        assert row["bytes_down"] == 3 * 4 * 10 * width
    uploads = [r for r in replies if r.metadata.message_type == "train"]
    rows = sum(r.content.array_records[PAYLOAD]["grad_labels"].shape[0] for r in uploads)
    assert sum(row["bytes_up"] for row in run.rows) == rows * (4 * width + 8)
    assert all(1 <= r.content.array_records[PAYLOAD]["grad_labels"].shape[0] <= 2 for r in uploads)  # 2 classes


@pytest.mark.parametrize("on_logits", [False, True])
def test_quiz_gradient_is_the_derivative_through_one_step(on_logits):
    # an independent computation: central differences of L_q(θ − η∇_θ L_s(θ; G)) in float64
    torch.manual_seed(0)
    model = SplitModel(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 5), torch.nn.Tanh()), 5, 3).double()
    width = 3 if on_logits else 5
    guiding = torch.randn(3, width, dtype=torch.float64)
    study = [(torch.randn(4, 3, 2, 2, dtype=torch.float64), torch.tensor([0, 1, 1, 0]))]
    quiz = [(torch.randn(4, 3, 2, 2, dtype=torch.float64), torch.tensor([2, 0, 1, 1]))]
    lr, weight = 0.3, 1.5
    got = quiz_gradient(model, guiding, study, quiz, lr, weight, on_logits)

    def quiz_loss(rows):
        x, y = study[0]
        features = model.extractor(x)
        logits = model.head(features)
        guided = logits if on_logits else features
        loss = torch.nn.functional.cross_entropy(logits, y) + weight * torch.nn.functional.mse_loss(guided, rows[y])
        grads = torch.autograd.grad(loss, list(model.parameters()))
        with torch.no_grad():
            for p, g in zip(model.parameters(), grads):
                p -= lr * g
            out = torch.nn.functional.cross_entropy(model(quiz[0][0]), quiz[0][1])
            for p, g in zip(model.parameters(), grads):
                p += lr * g
        return float(out)

    numeric = torch.zeros_like(guiding)
    for c in range(3):
        for j in range(width):
            up, down = guiding.clone(), guiding.clone()
            up[c, j] += 1e-6
            down[c, j] -= 1e-6
            numeric[c, j] = (quiz_loss(up) - quiz_loss(down)) / 2e-6
    assert float(got[2].abs().sum()) == 0.0  # class 2 is in no study example
    assert float(got.abs().max()) > 1e-4
    torch.testing.assert_close(got, numeric, rtol=1e-5, atol=1e-8)


def test_server_step_is_the_clipped_mean_by_hand():
    cfg = RunConfig.from_dict(
        make_run_config(method="fedl2g-logit", aggregation="mean", **{"fedl2g-logit.server-clip-norm": 1.0})
    )
    server = build_run(cfg).method
    before = server.global_arrays()["guiding"].astype(np.float64)
    rows = {0: np.full((2, 10), 0.5, np.float32), 1: np.full((1, 10), 0.1, np.float32)}
    replies = [
        ClientReply(1000, 0, {"grads": rows[0], "grad_labels": np.array([0, 3], np.int64)}, {}),
        ClientReply(1001, 1, {"grads": rows[1], "grad_labels": np.array([3], np.int64)}, {}),
    ]
    metrics = server.aggregate_train(1, replies)
    mean = np.zeros((10, 10))
    mean[0], mean[3] = 0.5, 0.3  # class 3: (0.5 + 0.1) / 2; the other classes: nobody sent, zero
    norm = np.linalg.norm(mean)
    assert metrics["server-guide-grad-norm"] == pytest.approx(norm)
    expected = before - 0.1 * mean / norm  # clipped to norm 1, step 0.1 (the logit variant's server-lr)
    np.testing.assert_allclose(server.global_arrays()["guiding"], expected, atol=1e-6)


def test_warm_up_trains_nothing_and_the_quiz_set_is_never_trained_on(run_config):
    rc = fedl2g_config(run_config, "fedl2g-feat", **{"num-clients": 2, "num-server-rounds": 2})
    run, grid, replies = captured_federation(rc)
    run.start(grid)
    assert "train_loss" not in run.rows[0] and run.rows[1]["train_loss"] > 0  # round 1: the warm-up
    n = [len(client_runtime(rc, p).data.train_y) for p in range(2)]
    uploads = [r for r in replies if r.metadata.message_type == "train"]
    assert sorted(int(r.content.metric_records["metrics"]["num-examples"]) for r in uploads) == sorted(
        2 * [m - rc["batch-size"] for m in n]
    )


def test_a_partition_too_small_for_a_quiz_set_fails_at_the_handshake(run_config):
    rc = fedl2g_config(run_config, "fedl2g-feat", **{"max-examples-per-client": 40, "batch-size": 32})
    run, grid = federation(rc)
    with pytest.raises(ConfigError, match="quiz-batches"):
        run.start(grid)


def test_record_level_dp_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="'dp.epsilon'"):
        build_run(RunConfig.from_dict(make_run_config(method="fedl2g-feat", **{"dp.epsilon": 8.0})))


@pytest.mark.parametrize("method", VARIANTS)
def test_learns_on_cifar10(run_config, method):
    # 5 rounds of 2 epochs on 400 CIFAR-10 examples a client, the first the warm-up (nothing trains)
    rc, run, _, _ = run_method(run_config, method, **{f"{method}.warm-up-rounds": 1})
    rows = run.rows
    assert rows[-1]["accuracy_mean"] > chance(rc, rc["num-clients"]) + 0.05, rows[-1]["accuracy_mean"]
    assert rows[-1]["train_loss"] < rows[1]["train_loss"]


@pytest.mark.parametrize("value", [float("nan"), 1e30])
def test_a_hostile_upload_is_dropped_or_bounded(run_config, value):
    # a non-finite row is dropped; an extreme one is bounded by the default norm-bound: G stays finite and
    # moves no further than the honest round's clipped step allows
    rc = fedl2g_config(run_config, "fedl2g-feat", **{"num-clients": 3, "num-server-rounds": 2})
    run, grid = federation(rc, attacker("train", scaled("grads", value)))
    run.start(grid)
    guiding = run.method.global_arrays()["guiding"]
    start = build_run(RunConfig.from_dict(rc)).method.global_arrays()["guiding"]
    assert np.isfinite(guiding).all()
    assert np.linalg.norm(guiding - start) <= 2 * 100.0 * 100.0  # two steps of at most server-lr · clip
    if value != value:
        assert run.counters.dropped["train"] == 2


def test_a_malformed_upload_is_dropped(run_config):
    def wrong_width(reply):
        arrays = dict(reply.content.array_records[PAYLOAD])
        arrays["grads"] = Array(np.zeros((1, 7), np.float32))
        return with_payload(reply, arrays)

    rc = fedl2g_config(run_config, "fedl2g-logit", **{"num-clients": 3, "num-server-rounds": 1})
    run, grid = federation(rc, attacker("train", wrong_width))
    run.start(grid)
    assert run.counters.dropped["train"] == 1 and run.rows[0]["num_clients"] == 2


@pytest.mark.parametrize("method", VARIANTS)
def test_resume_continues_exactly(run_config, method):
    base = fedl2g_config(run_config, method, **{"num-clients": 3, "fraction-train": 0.67})
    whole, _ = run_with_results({**base, "num-server-rounds": 3}, name="whole")
    first, grid = run_with_results({**base, "num-server-rounds": 2}, name="first")
    second, _ = run_with_results(
        {**base, "num-server-rounds": 3, "resume-from": str(first.results.path)}, grid, name="second"
    )
    assert [r["accuracy_per_client"] for r in whole.rows] == [r["accuracy_per_client"] for r in second.rows]
    assert np.array_equal(whole.method.global_arrays()["guiding"], second.method.global_arrays()["guiding"])


def test_the_privacy_evaluation_reads_the_uploads_class_ids(tmp_path):
    """The quiz gradients' rows are in no space the attacks invert: ``tools.privacy`` reads their class ids
    for label leakage only, and those are classes the client holds (precision 1)."""
    from test_privacy_tool import recorded_run

    from common.data import DataSpec, load_client_data
    from tools import privacy
    from tools.privacy_attacks import applicable
    from tools.privacy_view import RunView

    extra = {"record-payloads": "2", "fedl2g-feat.warm-up-rounds": 1}
    path, cfg = recorded_run(tmp_path / "runs", "fedl2g-feat", **{"num-server-rounds": 2, **extra})
    assert applicable(RunView(path)) == ["labels"]
    out = tmp_path / "privacy"
    assert privacy.main([str(path), "--rounds", "2", "--out", str(out)]) == 0
    rows = json.loads((out / "privacy.json").read_text())
    assert {(r["attack"], r["payload"]) for r in rows} == {("labels", "grads class ids")}
    spec = DataSpec.from_config(cfg, 3)
    for r in rows:
        held = set(load_client_data(spec, r["partition"]).train_y.tolist())
        assert r["label_precision"] == 1.0 and 0 < r["label_recall"] <= 1.0 and len(held) == cfg.classes_per_client
    assert {r["partition"] for r in rows} == {0, 1, 2}
