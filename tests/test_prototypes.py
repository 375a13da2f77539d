"""The prototype machinery FedProto and FedTGP share (regulariser, nearest-prototype inference), and
whole rounds of both methods: payloads, bytes, single-class clients."""

import numpy as np
import pytest
import torch

from common.config import RunConfig
from common.data import normalize
from conftest import client_runtime, federation, plain_sgd_config
from methods.blocks.prototypes import PrototypeRegularizer, RegularizerOptions, nearest_prototype_correct
from methods.fedtgp import METHOD as FEDTGP_METHOD
from methods.local import METHOD as LOCAL_METHOD

K = 512
MNIST = {"dataset": "mnist", "model-group": "htcnn8", "partitioner": "dirichlet", "dirichlet-alpha": 0.1}


# 9: lambda = 0 is Local step for step; the regulariser vanishes (with its gradient) at P = f(x)
def test_regulariser_sanity(run_config):
    rc = run_config(**MNIST, **{"num-clients": 5, "fedtgp.lambda": 0.0, "method": "fedtgp"})
    a, b = client_runtime(rc, 2), client_runtime(rc, 2)
    payload = {"global_protos": np.random.default_rng(0).normal(size=(10, K)).astype(np.float32)}
    FEDTGP_METHOD.build_client(RunConfig.from_dict(rc)).train(a, payload, plain_sgd_config(rc))
    LOCAL_METHOD.build_client(RunConfig.from_dict(rc)).train(b, {}, plain_sgd_config(rc))
    for (ka, va), vb in zip(a.model.state_dict().items(), b.model.state_dict().values()):
        assert torch.equal(va, vb), ka
    feats = torch.randn(4, K, requires_grad=True)
    labels = torch.tensor([0, 1, 2, 3])
    protos = torch.zeros(10, K)
    protos[labels] = feats.detach()
    value = PrototypeRegularizer(protos, torch.ones(10, dtype=torch.bool), RegularizerOptions(10.0, "mse-mean"))(
        feats, labels
    )
    value.backward()
    assert float(value.detach()) == 0.0 and float(feats.grad.abs().max()) == 0.0
    paper = PrototypeRegularizer(protos, torch.ones(10, dtype=torch.bool), RegularizerOptions(10.0, "paper-l2"))
    assert float(paper(feats.detach(), labels)) < 1e-4  # lambda * sqrt(1e-12): the clamped square root
    moved = PrototypeRegularizer(protos + 1, torch.ones(10, dtype=torch.bool), RegularizerOptions(10.0, "mse-mean"))
    assert float(moved(feats.detach(), labels)) == pytest.approx(10.0)  # lambda * mean of 1^2


# 10: inference is nearest prototype: independent of the head, argmin of the Euclidean distance
def test_nearest_prototype_inference(run_config):
    rc = run_config(**MNIST, **{"num-clients": 5, "method": "fedtgp"})
    client = client_runtime(rc, 0)
    data = client.data
    with torch.no_grad():
        feats = client.model.extractor.eval()(normalize(data.test_x, data.info))
    protos = torch.randn(10, K) + feats.mean(0)
    mask = torch.ones(10, dtype=torch.bool)
    correct, n = nearest_prototype_correct(client, protos, mask)
    assert n == len(data.test_y) and correct == int((torch.cdist(feats, protos).argmin(1) == data.test_y).sum())
    with torch.no_grad():
        client.model.head.weight.mul_(-3.0)
    assert nearest_prototype_correct(client, protos, mask) == (correct, n)
    # prototypes equal to the true class means of the client's own features classify well above chance
    true = torch.stack(
        [feats[data.test_y == c].mean(0) if (data.test_y == c).any() else torch.full((K,), 1e6) for c in range(10)]
    )
    assert nearest_prototype_correct(client, true, mask)[0] / n > 0.5
    # FedProto: a class without a global prototype is never predicted
    only = torch.zeros(10, dtype=torch.bool)
    only[int(data.test_y[0])] = True
    c1, _ = nearest_prototype_correct(client, true, only)
    assert c1 == int((data.test_y == data.test_y[0]).sum())


# 2, 8, 12, 13, 14 over whole rounds: payload keys, byte formulas, round 1, determinism
@pytest.mark.parametrize("method", ["fedtgp", "fedproto"])
def test_rounds_payloads_and_bytes(run_config, method):
    rc = run_config(**MNIST, **{"num-clients": 5, "num-server-rounds": 2, "method": method, "fedtgp.server-epochs": 5})
    strategy, grid = federation(rc)
    strategy.start(grid)
    train_msgs = [m for m in grid.sent if m.metadata.message_type == "train"]
    round1, round2 = train_msgs[:5], train_msgs[5:]
    assert all(not m.content.array_records for m in round1)  # no prototypes before the first update
    for m in round2:
        arrays = m.content.array_records["payload"]
        if method == "fedtgp":
            assert list(arrays) == ["global_protos"] and arrays["global_protos"].shape == (10, K)
            assert np.isfinite(arrays["global_protos"].numpy()).all()
        else:
            assert list(arrays) == ["protos", "mask"]
    c_i = [len(np.unique(client_runtime(rc, p).data.train_y)) for p in range(5)]
    for row in strategy.rows:
        assert row["bytes_up"] == sum(4 * K * c + 8 * c for c in c_i)
    if method == "fedtgp":
        assert strategy.rows[1]["bytes_down"] == 5 * 4 * 10 * K
        assert strategy.rows[0]["eval_bytes_down"] == 5 * 4 * 10 * K  # P̂ exists after round 1's update
    # evaluation covers every client, pooled and unweighted
    assert len(strategy.rows[-1]["accuracy_per_client"]) == 5
    again, grid2 = federation(rc)
    again.start(grid2)
    assert [r["accuracy_per_client"] for r in again.rows] == [r["accuracy_per_client"] for r in strategy.rows]
    if method == "fedtgp":
        assert np.array_equal(again.method.global_set["global_protos"], strategy.method.global_set["global_protos"])


@pytest.mark.parametrize("method", ["fedtgp", "fedproto"])
def test_single_class_clients(run_config, method):
    rc = run_config(
        **{
            "dataset": "mnist",
            "model-group": "htcnn8",
            "partitioner": "pathological",
            "classes-per-client": 1,
            "num-clients": 3,
            "num-server-rounds": 2,
            "method": method,
            "fedtgp.server-epochs": 3,
        }
    )
    strategy, grid = federation(rc)
    strategy.start(grid)
    for row in strategy.rows:
        assert row["num_clients"] == 3 and row["bytes_up"] == 3 * (4 * K + 8)  # one [1, K] prototype each
    assert strategy.rows[-1]["accuracy_mean"] is not None
