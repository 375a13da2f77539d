"""FedGH: payloads, bytes, the client and server steps, degenerate cases and determinism (docs/methods/fedgh.md)."""

import copy

import numpy as np
import pytest
import torch
from flwr.app import RecordDict
from torch import nn

from common.config import RunConfig
from common.data import normalize
from common.payload import ClientReply, tensor_bytes
from common.runtime import ClientRuntime
from common.training import class_means
from conftest import client_runtime, federation, make_run_config, train_config
from engine.evaluation import aggregate_evaluation
from methods.fedgh import METHOD as FEDGH_METHOD
from methods.fedgh import FedGHOptions, load_header, train_header
from methods.registry import build_run

C, D = 10, 500


def header_payload(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"head.weight": (torch.randn(C, D, generator=g) * 0.01).numpy(), "head.bias": torch.zeros(C).numpy()}


def synthetic_replies(num_clients=10, classes=2, seed=0):
    """Post-ReLU-like LARs: a sparse non-negative pattern per class plus small noise."""
    rng = np.random.default_rng(seed)
    patterns = np.maximum(rng.normal(size=(C, D)), 0)
    out = []
    for k in range(num_clients):
        labels = np.sort(rng.choice(C, classes, replace=False)).astype(np.int32)
        lar = (patterns[labels] + 0.1 * np.abs(rng.normal(size=(classes, D)))).astype(np.float32)
        out.append(ClientReply(node_id=100 + k, partition_id=k, arrays={"lar": lar, "lar_labels": labels}, metrics={}))
    return out


def options(**kw):
    base = dict(
        server_mode="per-lar",
        server_lr=0.01,
        server_epochs=1,
        server_batch_size=10,
        server_clip_norm=50.0,
        eval_global_head=False,
    )
    return FedGHOptions(**{**base, **kw})


def fresh_header(seed=0):
    torch.manual_seed(seed)
    return nn.Linear(D, C)


# 1, 5: uplink content; LARs come from the post-training extractor
def test_uplink_holds_exact_lars_of_trained_extractor(run_config):
    rc = run_config()
    client = client_runtime(rc)
    before, _ = class_means(
        client.model.extractor, client.data.train_x, client.data.train_y, client.data.info, client.device
    )
    arrays, metrics = FEDGH_METHOD.build_client(RunConfig.from_dict(rc)).train(
        client, header_payload(), train_config(rc)
    )
    assert set(arrays) == {"lar", "lar_labels"}
    labels = np.unique(client.data.train_y.numpy())
    assert arrays["lar"].dtype == np.float32 and arrays["lar"].shape == (len(labels), D)
    assert arrays["lar_labels"].dtype == np.int32 and arrays["lar_labels"].tolist() == labels.tolist()
    assert len(labels) == 2 and (arrays["lar"] >= 0).all()
    assert not np.allclose(arrays["lar"], before.numpy())  # post-training, not pre-training
    # brute force: per-class mean of eval-mode, non-augmented features of the whole train split
    model = client.model.eval()
    with torch.no_grad():
        feats = model.extractor(normalize(client.data.train_x, client.data.info)).double()
    for row, c in zip(arrays["lar"], labels):
        expected = feats[client.data.train_y == int(c)].mean(0).float().numpy()
        np.testing.assert_allclose(row, expected, rtol=1e-4, atol=1e-5)
    assert metrics["num-examples"] == len(client.data.train_y)


# 4: exact mean, independent of the extraction batch size
def test_lars_do_not_depend_on_batch_size(run_config):
    client = client_runtime(run_config(**{"max-examples-per-client": 150}))
    d = client.data
    a, la = class_means(client.model.extractor, d.train_x, d.train_y, d.info, client.device, batch_size=7)
    b, lb = class_means(client.model.extractor, d.train_x, d.train_y, d.info, client.device, batch_size=512)
    assert torch.equal(la, lb)
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)


# 6: header replaced bit for bit, extractor restored, header then fine-tuned
def test_header_replacement_then_fine_tuning(run_config):
    rc = run_config()
    client = client_runtime(rc)
    payload = header_payload(3)
    load_header(client.model.head, payload)
    assert np.array_equal(client.model.head.weight.detach().numpy(), payload["head.weight"])
    assert np.array_equal(client.model.head.bias.detach().numpy(), payload["head.bias"])
    FEDGH_METHOD.build_client(RunConfig.from_dict(rc)).train(client, payload, train_config(rc))
    stored_extractor = copy.deepcopy(client.model.extractor.state_dict())
    assert not np.array_equal(client.model.head.weight.detach().numpy(), payload["head.weight"])
    # next message: a new runtime over the same context restores the stored extractor exactly
    again = ClientRuntime(client.context)
    for k, v in again.model.extractor.state_dict().items():
        assert torch.equal(v, stored_extractor[k])


# 7, 8: the server really learns and lowers CE; mode none / lr 0 leaves the header untouched
@pytest.mark.parametrize("mode", ["per-lar", "per-client", "minibatch"])
def test_server_trains_header_and_lowers_ce(mode):
    header = fresh_header()
    before = copy.deepcopy(header.state_dict())
    metrics = train_header(header, synthetic_replies(), options(server_mode=mode), torch.Generator().manual_seed(0))
    assert metrics["server-num-lars"] == 20
    assert metrics["server-ce-after"] < metrics["server-ce-before"]
    assert (header.weight - before["weight"]).norm() > 0


@pytest.mark.parametrize("opts", [options(server_mode="none"), options(server_lr=0.0)])
def test_header_frozen_without_server_learning(opts):
    header = fresh_header()
    before = copy.deepcopy(header.state_dict())
    train_header(header, synthetic_replies(), opts, torch.Generator())
    assert torch.equal(header.weight, before["weight"]) and torch.equal(header.bias, before["bias"])


# 9: reference equivalence with a hand-written per-LAR loop; arrival order does not matter
def test_matches_hand_written_sgd_and_ignores_arrival_order():
    replies = synthetic_replies(seed=4)
    header = fresh_header(1)
    w = header.weight.detach().double().clone()
    b = header.bias.detach().double().clone()
    for r in sorted(replies, key=lambda r: r.partition_id):
        for rep, s in zip(r.arrays["lar"], r.arrays["lar_labels"]):
            rep = torch.from_numpy(rep).double()
            p = torch.softmax(w @ rep + b, 0)
            p[int(s)] -= 1
            w -= 0.01 * torch.outer(p, rep)
            b -= 0.01 * p
    shuffled = [replies[i] for i in np.random.default_rng(0).permutation(len(replies))]
    train_header(header, shuffled, options(server_clip_norm=0.0), torch.Generator())
    np.testing.assert_allclose(header.weight.detach().numpy(), w.numpy(), atol=1e-6)
    np.testing.assert_allclose(header.bias.detach().numpy(), b.numpy(), atol=1e-6)


# 11: no stale knowledge: an earlier round's replies do not affect this round's update
def test_update_uses_only_this_rounds_lars():
    strategy = build_run(RunConfig.from_dict(make_run_config(aggregation="mean")))
    start = copy.deepcopy(strategy.method.header.state_dict())
    strategy.method.aggregate_train(1, synthetic_replies(seed=9))
    mid = copy.deepcopy(strategy.method.header.state_dict())
    strategy.method.aggregate_train(2, synthetic_replies(seed=1))
    reference = fresh_header()
    reference.load_state_dict(mid)
    train_header(reference, synthetic_replies(seed=1), strategy.method.options, torch.Generator())
    assert torch.equal(reference.weight, strategy.method.header.weight)
    assert not torch.equal(start["weight"], mid["weight"])


# 12: degenerate cases
def test_degenerate_inputs():
    header = fresh_header()
    before = copy.deepcopy(header.state_dict())
    assert train_header(header, [], options(), torch.Generator()) == {"server-num-lars": 0}
    assert torch.equal(header.weight, before["weight"])
    one = ClientReply(1, 0, {"lar": np.ones((1, D), np.float32), "lar_labels": np.array([7], np.int32)}, {})
    metrics = train_header(header, [one], options(), torch.Generator())
    assert metrics["server-num-lars"] == 1 and not torch.equal(header.weight, before["weight"])


# 2, 3, 13 and whole rounds: downlink content, byte formula, locality, one-sampled-client rounds
def test_rounds_payloads_bytes_and_locality(run_config):
    rc = run_config(**{"num-clients": 6, "fraction-train": 0.5, "num-server-rounds": 2})
    strategy, grid = federation(rc)
    strategy.start(grid)
    train_msgs = [m for m in grid.sent if m.metadata.message_type == "train"]
    eval_msgs = [m for m in grid.sent if m.metadata.message_type == "evaluate"]
    # sampled clients evaluate inside their train reply; only the 3 others get evaluate messages
    assert len(train_msgs) == 2 * 3 and len(eval_msgs) == 2 * 3
    for m in train_msgs:
        arrays = m.content.array_records["payload"]
        assert list(arrays) == ["head.weight", "head.bias"]
        assert arrays["head.weight"].shape == (C, D) and arrays["head.weight"].dtype == "float32"
        assert arrays["head.bias"].shape == (C,)
        assert tensor_bytes(m.content) == 4 * C * (D + 1) == 20_040
    assert all(not m.content.array_records for m in eval_msgs)
    for row in strategy.rows:
        assert row["bytes_down"] == 3 * 20_040
        assert row["bytes_up"] == 3 * 4 * 2 * (D + 1)  # pathological: 2 classes each -> 4,008 B per client
        assert row["num_clients"] == 3 and len(row["accuracy_per_client"]) == 6
    # a never-sampled client keeps an untouched (empty) state; sampled ones stored their model
    sampled = {m.metadata.dst_node_id for m in train_msgs}
    for node, ctx in grid.contexts.items():
        assert ("model" in ctx.state.array_records) == (node in sampled)


# 14: metric aggregation (unweighted headline, weighted secondary)
def test_unweighted_and_weighted_accuracy(run_config):
    from flwr.app import Message, MetricRecord

    strategy, grid = federation(run_config())
    replies = []
    for node, (acc, n, acc_global) in zip(grid.contexts, [(1.0, 10, 1.0), (0.0, 1000, 0.5)]):
        msg = strategy.federation.transport.message("evaluate", node, {}, strategy.method.train_config(1), 1)
        metrics = {"partition-id": node - 1000, "test-correct": int(acc * n), "num-examples": n}
        content = RecordDict({"metrics": MetricRecord({**metrics, "test-acc-global-head": acc_global})})
        replies.append(Message(content, reply_to=msg))
    out = aggregate_evaluation(strategy.federation.transport.validate("evaluate", replies))
    assert out["accuracy-mean"] == pytest.approx(0.5)
    assert out["accuracy-weighted"] == pytest.approx(10 / 1010)
    assert out["accuracy-mean-global-head"] == pytest.approx(0.75)  # a secondary metric: both averages too
    assert out["accuracy-weighted-global-head"] == pytest.approx((10 + 500) / 1010)


# 15: determinism, and the secondary global-header metric
def test_same_seed_same_header_and_global_head_metric(run_config):
    rc = run_config(**{"num-server-rounds": 1, "fedgh.eval-global-head": True})
    results = []
    for _ in range(2):
        strategy, grid = federation(rc)
        strategy.start(grid)
        results.append((strategy.method.header.weight.detach().clone(), strategy.rows[-1]))
    assert torch.equal(results[0][0], results[1][0])
    row = results[0][1]
    assert 0.0 <= row["accuracy_mean_global_head"] <= 1.0
    assert 0.0 <= row["accuracy_weighted_global_head"] <= 1.0
    assert row["eval_bytes_down"] == 4 * 20_040


def test_wrong_representation_size_is_rejected(run_config):
    strategy, grid = federation(run_config())

    def shrink(node, reply):
        if reply.metadata.message_type == "train" and node == 1001:
            payload = reply.content.array_records["payload"]
            lar = payload["lar"].numpy()[:, :499].copy()
            reply.content["payload"] = type(payload)(
                {"lar": type(payload["lar"])(lar), "lar_labels": payload["lar_labels"]}
            )
        return reply

    grid.tamper = shrink
    strategy.start(grid)
    assert all(r["num_clients"] == 3 for r in strategy.rows)
    assert strategy.counters.dropped["train"] == 2


def test_header_learns_on_real_rounds(run_config):
    rc = run_config(**{"num-clients": 4, "num-server-rounds": 2})
    strategy, grid = federation(rc)
    theta0 = strategy.method.header.weight.detach().clone()
    strategy.start(grid)
    assert (strategy.method.header.weight.detach() - theta0).norm() > 0
    assert all(r["server_ce_after"] < r["server_ce_before"] for r in strategy.rows)
