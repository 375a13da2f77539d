"""FedTGP (spec fedtgp.md section 12) and FedProto (its appendix): the checklists, automated."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.app import Context, RecordDict

from client_app.data import normalize
from client_app.runtime import ClientRuntime
from common.config import ConfigError, RunConfig
from conftest import federation, make_run_config
from strategies.base import ClientReply
from strategies.fedproto import (
    FedProtoClient,
    FedProtoStrategy,
    PrototypeRegularizer,
    RegularizerOptions,
    nearest_prototype_correct,
)
from strategies.fedtgp import (
    FedTGPClient,
    FedTGPOptions,
    FedTGPStrategy,
    PrototypeGenerator,
    acl_loss,
    adaptive_margin,
    train_generator,
)
from strategies.local import LocalClient
from strategies.payload import tensor_bytes

K = 512
MNIST = {"dataset": "mnist", "model-group": "htcnn8", "partitioner": "dirichlet", "dirichlet-alpha": 0.1}


def runtime(rc, partition_id=0):
    ctx = Context(
        run_id=1,
        node_id=1,
        node_config={"partition-id": partition_id, "num-partitions": rc["num-clients"]},
        state=RecordDict(),
        run_config=rc,
    )
    return ClientRuntime(ctx)


def train_config(rc, **kw):
    return {
        "server-round": 1,
        "local-epochs": rc["local-epochs"],
        "batch-size": rc["batch-size"],
        "lr": rc["lr"],
        "momentum": 0.0,
        "weight-decay": 0.0,
        "clip-norm": 0.0,
        "precision": "fp32",
        **kw,
    }


def tgp_options(**kw):
    base = dict(margin="nearest", tau=100.0, server_epochs=100, server_lr=0.01, server_batch_size=10, hidden_dim=K)
    return FedTGPOptions(**{**base, **kw})


def cluster_replies(num_classes=5, clients=4, k=K, seed=0):
    """Synthetic uploads: every client holds every class; class c is a Gaussian cluster."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(scale=3.0, size=(num_classes, k))
    out = []
    for i in range(clients):
        protos = (centres + rng.normal(scale=0.3, size=centres.shape)).astype(np.float32)
        out.append(ClientReply(i, i, {"protos": protos, "proto_labels": np.arange(num_classes, dtype=np.int64)}, {}))
    return out, centres


# 4: the margin is the code's nearest-centre rule, not the paper's max pairwise distance
def test_margin_nearest_centre_not_max_pairwise():
    protos = torch.tensor([[0.0, 0.0], [3.0, 0.0], [0.0, 10.0]])
    labels = torch.tensor([0, 1, 2])
    assert adaptive_margin(protos, labels, tau=100) == pytest.approx(10.0)
    assert adaptive_margin(protos, labels, tau=5) == pytest.approx(5.0)
    assert adaptive_margin(protos, labels, tau=100, mode="max-pairwise") == pytest.approx(np.hypot(3, 10))
    assert adaptive_margin(protos[:1], labels[:1], tau=100) == 0.0
    # Q^c is the unweighted mean over the clients that uploaded c
    two = torch.tensor([[0.0, 0.0], [2.0, 0.0], [7.0, 0.0]])
    assert adaptive_margin(two, torch.tensor([0, 0, 1]), tau=100) == pytest.approx(6.0)


# 5: the implemented ACL is Eq. 10
def test_acl_matches_equation_10():
    torch.manual_seed(0)
    p, g, y = torch.randn(6, 8), torch.randn(4, 8), torch.tensor([0, 1, 2, 3, 0, 1])
    dist = torch.cdist(p, g)
    assert float(acl_loss(p, y, g, 0.0)) == pytest.approx(float(F.cross_entropy(-dist, y)), abs=1e-5)
    delta = 2.5
    explicit = []
    for b in range(6):
        own = torch.exp(-(dist[b, y[b]] + delta))
        others = sum(torch.exp(-dist[b, c]) for c in range(4) if c != y[b])
        explicit.append(-torch.log(own / (own + others)))
    assert float(acl_loss(p, y, g, delta)) == pytest.approx(float(torch.stack(explicit).mean()), abs=1e-5)
    assert float(acl_loss(p, y, g, delta)) > float(acl_loss(p, y, g, 0.0))


# 11 (server part): identical vectors give finite gradients
def test_acl_finite_at_zero_distance():
    g = torch.randn(3, 8, requires_grad=True)
    loss = acl_loss(g.detach()[:2].clone(), torch.tensor([0, 1]), g, 1.0)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(g.grad).all()


# 6, 7: the server learns, preserves class semantics, and keeps its generator across rounds
def test_generator_learns_and_persists():
    replies, centres = cluster_replies()
    gen = PrototypeGenerator(5, K, K)
    fresh = copy.deepcopy(gen.state_dict())
    m = train_generator(gen, replies, tgp_options(), torch.Generator().manual_seed(0))
    assert m["server-acl-after"] < 0.1 * m["server-acl-before"]
    with torch.no_grad():
        dist = torch.cdist(gen(), torch.from_numpy(centres).float())
    assert dist.argmin(1).tolist() == list(range(5))
    strategy = FedTGPStrategy(RunConfig.from_dict(make_run_config(method="fedtgp", **{"model-group": "htfe2"})))
    strategy.dims = {"C": 10, "d": K}
    strategy.server_update(
        1,
        [
            ClientReply(0, 0, {"protos": r.arrays["protos"], "proto_labels": r.arrays["proto_labels"]}, {})
            for r in replies
        ],
    )
    after_round1 = copy.deepcopy(strategy.generator.state_dict())
    assert any(not torch.equal(after_round1[k], v) for k, v in fresh.items())
    start_round2 = copy.deepcopy(strategy.generator.state_dict())
    assert all(torch.equal(after_round1[k], start_round2[k]) for k in after_round1)


# 1, 3: upload content; eval-mode exact prototypes (train mode differs with BatchNorm)
def test_upload_is_eval_mode_class_means(run_config):
    rc = run_config(method="fedtgp", **{"model-group": "htfe2", "num-clients": 4, "max-examples-per-client": 120})
    client = runtime(rc, partition_id=1)  # resnet18: has BatchNorm
    arrays, _ = FedTGPClient(RunConfig.from_dict(rc)).train(client, {}, train_config(rc))
    assert set(arrays) == {"protos", "proto_labels"}
    labels = np.unique(client.data.train_y.numpy())
    assert arrays["protos"].dtype == np.float32 and arrays["protos"].shape == (len(labels), K)
    assert arrays["proto_labels"].dtype == np.int64 and arrays["proto_labels"].tolist() == labels.tolist()
    model = client.model.eval()
    with torch.no_grad():
        feats = model.extractor(normalize(client.data.train_x, client.data.info))
        model.train()
        train_feats = model.extractor(normalize(client.data.train_x, client.data.info))
    for row, c in zip(arrays["protos"], labels):
        np.testing.assert_allclose(row, feats[client.data.train_y == int(c)].mean(0).numpy(), rtol=1e-4, atol=1e-5)
    assert not np.allclose(
        arrays["protos"][0], train_feats[client.data.train_y == int(labels[0])].mean(0).numpy(), atol=1e-5
    )


# 9: lambda = 0 is Local step for step; the regulariser vanishes (with its gradient) at P = f(x)
def test_regulariser_sanity(run_config):
    rc = run_config(**MNIST, **{"num-clients": 5, "fedtgp.lambda": 0.0, "method": "fedtgp"})
    a, b = runtime(rc, 2), runtime(rc, 2)
    payload = {"global_protos": np.random.default_rng(0).normal(size=(10, K)).astype(np.float32)}
    FedTGPClient(RunConfig.from_dict(rc)).train(a, payload, train_config(rc))
    LocalClient(RunConfig.from_dict(rc)).train(b, {}, train_config(rc))
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
    client = runtime(rc, 0)
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


def test_fedproto_server_is_unweighted_class_mean():
    strategy = FedProtoStrategy(RunConfig.from_dict(make_run_config(method="fedproto", **{"model-group": "htfe2"})))
    rng = np.random.default_rng(0)
    replies = [
        ClientReply(
            i,
            i,
            {
                "protos": rng.normal(size=(len(labels), K)).astype(np.float32),
                "proto_labels": np.array(labels, np.int64),
            },
            {},
        )
        for i, labels in enumerate([[0, 2], [2], [2, 5]])
    ]
    strategy.server_update(1, replies)
    out = strategy.global_arrays()
    assert out["mask"].tolist() == [c in (0, 2, 5) for c in range(10)]
    expected2 = (replies[0].arrays["protos"][1] + replies[1].arrays["protos"][0] + replies[2].arrays["protos"][0]) / 3
    np.testing.assert_allclose(out["protos"][1], expected2, atol=1e-6)
    np.testing.assert_allclose(out["protos"][0], replies[0].arrays["protos"][0], atol=1e-6)
    assert tensor_bytes(strategy.message("train", 1, out, strategy.train_config(1), 1).content) == 4 * K * 3 + 10


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
    c_i = [len(np.unique(runtime(rc, p).data.train_y)) for p in range(5)]
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
        assert np.array_equal(again.global_set["global_protos"], strategy.global_set["global_protos"])


# 11: a single-class client and an empty upload both work
def test_degenerate_uploads():
    gen = PrototypeGenerator(10, K, K)
    empty = ClientReply(0, 0, {"protos": np.zeros((0, K), np.float32), "proto_labels": np.zeros(0, np.int64)}, {})
    assert train_generator(gen, [empty], tgp_options(), torch.Generator()) == {"server-num-protos": 0}
    one = ClientReply(1, 1, {"protos": np.ones((1, K), np.float32), "proto_labels": np.array([3], np.int64)}, {})
    m = train_generator(gen, [empty, one], tgp_options(server_epochs=2), torch.Generator())
    assert m["server-num-protos"] == 1 and m["server-margin"] == 0.0
    assert all(torch.isfinite(p).all() for p in gen.parameters())


def test_fedtgp_options_and_fedgh_head_check():
    with pytest.raises(ConfigError, match="'fedtgp.margin'.*'nearest', 'max-pairwise'"):
        FedTGPStrategy(RunConfig.from_dict(make_run_config(method="fedtgp", **{"fedtgp.margin": "widest"})))
    with pytest.raises(ConfigError, match="'fedtgp.reg-form'"):
        FedTGPStrategy(RunConfig.from_dict(make_run_config(method="fedtgp", **{"fedtgp.reg-form": "l1"})))
    from strategies.registry import build_strategy

    with pytest.raises(ConfigError, match="fedgh.*linear header"):
        build_strategy(RunConfig.from_dict(make_run_config(**{"model-group": "htfe8-htc4"})))
    assert isinstance(
        FedProtoClient(RunConfig.from_dict(make_run_config(method="fedproto"))).options, RegularizerOptions
    )


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


def test_fedtgp_rows_carry_prototype_diagnostics(run_config):
    rc = run_config(
        **MNIST, **{"num-clients": 4, "num-server-rounds": 3, "method": "fedtgp", "fedtgp.server-epochs": 5}
    )
    strategy, grid = federation(rc)
    olds = []
    original = strategy.server_update

    def spy(server_round, replies):
        olds.append(strategy.global_set.get("global_protos"))
        return original(server_round, replies)

    strategy.server_update = spy
    strategy.start(grid)
    rows = strategy.rows
    assert all(r["server_margin"] > 0 for r in rows) and "server_proto_shift" not in rows[0]
    final = strategy.global_set["global_protos"].astype(np.float64)
    dist = np.linalg.norm(final[:, None] - final[None], axis=2) + np.diag(np.full(10, np.inf))
    assert rows[-1]["server_proto_min_distance"] == pytest.approx(dist.min(), rel=1e-6)
    shift = np.linalg.norm(final - olds[-1].astype(np.float64), axis=1).mean()
    assert rows[-1]["server_proto_shift"] == pytest.approx(shift, rel=1e-6) and shift > 0
