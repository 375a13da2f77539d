"""FedRE: payloads, bytes, the client and server steps, degenerate cases and determinism (docs/methods/fedre.md)."""

import dataclasses

import numpy as np
import pytest
import torch
from torch import nn

from common.config import ConfigError, RunConfig, read_options
from common.data import class_counts
from common.datasets import DATASETS
from common.payload import ClientReply, array_record, tensor_bytes
from common.protocol import PAYLOAD
from common.runtime import MODEL_STATE
from common.training import class_means
from conftest import client_runtime, federation, train_config
from methods.fedre import METHOD as FEDRE_METHOD
from methods.fedre import (
    FedREOptions,
    entangle,
    entangling_weights,
    soft_label_ce,
    train_head,
)
from methods.registry import build_run
from models.groups import MODEL_GROUPS
from models.zoo import FixedPool

C, D = 10, 512


def fedre_config(run_config, **kw):
    return run_config(method="fedre", model_group="fedavgcnn", **kw)


def head_payload(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "head.weight": (torch.randn(C, D, generator=g) * 0.05).numpy(),
        "head.bias": (torch.randn(C, generator=g) * 0.05).numpy(),
    }


def options(**kw):
    base = dict(re_mode="rap", server_lr=0.01, server_batch_size=10, server_epochs=1, server_loss_reduction="mean")
    return FedREOptions(**{**base, **kw})


def pair_replies(k=6, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for p in range(k):
        classes = rng.choice(C, 2, replace=False)
        y = np.zeros((1, C), np.float32)
        w = rng.uniform(size=2)
        y[0, classes] = w / w.sum()
        z = np.abs(rng.normal(size=(1, D))).astype(np.float32)
        out.append(ClientReply(node_id=100 + p, partition_id=p, arrays={"z": z, "y": y}, metrics={}))
    return out


def prototype_mix(client, y):
    """Σ_c y_c p_c from prototypes recomputed independently from the client's *saved* model."""
    model = MODEL_GROUPS[client.cfg.model_group].build(client.partition_id, C, 3, 32, client.cfg.seed)
    model.load_state_dict(client.context.state.array_records[MODEL_STATE].to_torch_state_dict())
    means, labels = class_means(
        model.extractor, client.data.train_x, client.data.train_y, client.data.info, torch.device("cpu")
    )
    return (torch.from_numpy(y[0, labels.numpy()]).double() @ means.double()).numpy(), labels.numpy()


# 1, 3, 4, 12: one (z, y) of the post-training extractor, a valid soft label on the present classes
def test_upload_is_one_entangled_pair_of_the_trained_extractor(run_config):
    rc = fedre_config(run_config, lr=0.05)
    client = client_runtime(rc)
    cfg = RunConfig.from_dict(rc)
    alpha = entangling_weights(client.data.train_y, "rap", client.generator(1, 7))
    z_before, _ = entangle(
        client.model.extractor, client.data.train_x, client.data.train_y, alpha, client.data.info, client.device
    )
    arrays, metrics = FEDRE_METHOD.build_client(cfg).train(client, head_payload(), train_config(rc))
    assert set(arrays) == {"z", "y"}
    assert arrays["z"].shape == (1, D) and arrays["y"].shape == (1, C)
    assert arrays["z"].dtype == arrays["y"].dtype == np.float32
    assert arrays["z"].nbytes + arrays["y"].nbytes == 4 * (D + C) == 2088
    y = arrays["y"]
    present = sorted(np.unique(client.data.train_y.numpy()).tolist())
    assert (y >= 0).all() and abs(float(y.sum(dtype=np.float64)) - 1) < 1e-6
    assert np.flatnonzero(y[0]).tolist() == present and metrics["num-classes-present"] == len(present) == 2
    assert y.max() < 1
    mix, labels = prototype_mix(client, y)
    assert labels.tolist() == present
    assert np.abs(mix - arrays["z"][0]).max() < 1e-4  # reconstruction from the saved model
    assert np.abs(z_before.numpy() - arrays["z"]).max() > 1e-3  # not the pre-training extractor


# 5: every member maps to d = 512; ResNet-50's mapping averages groups of 4
@pytest.mark.parametrize("arch", ["fedavgcnn", "resnet18", "resnet50", "mobilenet_v2", "googlenet"])
def test_entangled_representation_is_512d_for_every_family_member(arch):
    group = MODEL_GROUPS["fedre10"]
    model = group.build(group.architectures.index(arch), C, 3, 32, seed=0)
    x = torch.randint(0, 256, (6, 3, 32, 32), dtype=torch.uint8)
    labels = torch.tensor([0, 0, 3, 3, 3, 7])

    z, y = entangle(
        model.extractor,
        x,
        labels,
        entangling_weights(labels, "rap", torch.Generator().manual_seed(0)),
        DATASETS["cifar10"],
        torch.device("cpu"),
    )
    assert z.shape == (1, 512) and y.shape == (1, C)
    assert model.head.weight.shape == (C, 512)


def test_resnet50_mapping_is_mean_of_groups_of_four():
    v = torch.randn(3, 2048)
    assert torch.allclose(FixedPool(512)(v), v.view(3, 512, 4).mean(-1), atol=1e-6)


# 6: RAP weights are U(0,1) normalised: P(y_c1 < 1/4) = 1/6 for 2 classes (Dirichlet(1) gives 1/4)
def test_rap_weight_distribution():
    labels = torch.tensor([2] * 5 + [6] * 3)
    g = torch.Generator().manual_seed(0)
    draws = torch.stack(
        [
            torch.zeros(C, dtype=torch.float64).index_add_(0, labels, entangling_weights(labels, "rap", g))
            for _ in range(3000)
        ]
    )
    assert abs(float((draws[:, 2] < 0.25).double().mean()) - 1 / 6) < 0.02
    labels = torch.tensor([0, 1, 1, 4, 4, 4, 9])
    draws = torch.stack(
        [
            torch.zeros(C, dtype=torch.float64).index_add_(0, labels, entangling_weights(labels, "rap", g))
            for _ in range(3000)
        ]
    )
    present = draws[:, [0, 1, 4, 9]]
    assert torch.allclose(present.mean(0), torch.full((4,), 0.25, dtype=torch.float64), atol=0.015)
    assert bool(((present > 0) & (present < 1)).all())
    assert torch.allclose(draws.sum(1), torch.ones(3000, dtype=torch.float64))


@pytest.mark.parametrize("mode", ["rap", "vap", "rsp", "rar", "var", "rsr", "rap-fixed"])
def test_every_mode_gives_a_distribution_over_samples(mode):
    labels = torch.tensor([1, 1, 1, 5, 8, 8])
    alpha = entangling_weights(labels, mode, torch.Generator().manual_seed(3))
    assert alpha.shape == (6,) and alpha.dtype == torch.float64
    assert bool((alpha >= 0).all()) and abs(float(alpha.sum()) - 1) < 1e-12
    y = torch.zeros(C, dtype=torch.float64).index_add_(0, labels, alpha)
    if mode in ("rsp", "rsr"):
        assert sorted(y.tolist()).count(1.0) == 1  # one-hot
    elif mode == "vap":
        assert torch.allclose(y[[1, 5, 8]], torch.full((3,), 1 / 3, dtype=torch.float64))
    elif mode == "var":
        assert torch.allclose(y[[1, 5, 8]], torch.tensor([0.5, 1 / 6, 1 / 3], dtype=torch.float64))
    else:
        assert set(torch.nonzero(y).flatten().tolist()) == {1, 5, 8}


# 7: fresh weights every round; vap and rap-fixed repeat
@pytest.mark.parametrize("mode,same", [("rap", False), ("vap", True), ("rap-fixed", True)])
def test_weights_resampled_each_round_unless_fixed(run_config, mode, same):
    rc = fedre_config(run_config, lr=0.0, **{"fedre.re-mode": mode})
    client, procedure = client_runtime(rc), FEDRE_METHOD.build_client(RunConfig.from_dict(rc))
    payload = head_payload()
    a, _ = procedure.train(client, payload, train_config(rc, 1))
    b, _ = procedure.train(client, payload, train_config(rc, 2))
    assert np.array_equal(a["y"], b["y"]) is same
    assert np.array_equal(a["z"], b["z"]) is same
    if mode == "vap":
        assert np.allclose(a["y"][a["y"] > 0], 0.5)


# 8: a single-class client uploads its prototype with a one-hot label
def test_single_class_client_uploads_its_prototype(run_config):
    rc = fedre_config(run_config)
    client = client_runtime(rc)
    data = client.data
    keep = data.train_y == data.train_y[0]
    client.__dict__["data"] = dataclasses.replace(data, train_x=data.train_x[keep], train_y=data.train_y[keep])
    arrays, _ = FEDRE_METHOD.build_client(RunConfig.from_dict(rc)).train(client, head_payload(), train_config(rc))
    c = int(data.train_y[0])
    assert arrays["y"][0].tolist() == np.eye(C, dtype=np.float32)[c].tolist()
    proto, _ = class_means(client.model.extractor, client.data.train_x, client.data.train_y, data.info, client.device)
    assert np.allclose(arrays["z"], proto.numpy(), atol=1e-6, rtol=0)


# 9, 10: the server step is exactly one SGD step on the mean (default) or summed soft-label CE, and lowers it
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_server_step_is_exact(reduction):
    torch.manual_seed(0)
    head = nn.Linear(D, C)
    w0, b0 = head.weight.detach().double().clone(), head.bias.detach().double().clone()
    replies = pair_replies(6)
    opts = options() if reduction == "mean" else options(server_loss_reduction="sum")
    metrics = train_head(head, replies, opts, torch.Generator().manual_seed(0))
    z = torch.from_numpy(np.concatenate([r.arrays["z"] for r in replies])).double()
    y = torch.from_numpy(np.concatenate([r.arrays["y"] for r in replies])).double()
    err = torch.softmax(z @ w0.T + b0, dim=1) - y
    step = 0.01 / (len(replies) if reduction == "mean" else 1)  # one batch: 6 uploads <= B_s = 10
    assert torch.allclose(head.weight.detach().double(), w0 - step * err.T @ z, atol=1e-5)
    assert torch.allclose(head.bias.detach().double(), b0 - step * err.sum(0), atol=1e-5)
    assert metrics["server-num-uploads"] == 6


def test_default_reduction_is_mean(run_config):
    assert read_options(FedREOptions, RunConfig.from_dict(fedre_config(run_config))).server_loss_reduction == "mean"


def test_server_loss_falls_and_no_upload_leaves_head_unchanged():
    torch.manual_seed(1)
    head = nn.Linear(D, C)
    replies = pair_replies(10, seed=2)
    metrics = train_head(head, replies, options(server_lr=1e-3), torch.Generator().manual_seed(0))
    assert metrics["server-loss-after"] < metrics["server-loss-before"]
    z = torch.from_numpy(np.concatenate([r.arrays["z"] for r in replies]))
    y = torch.from_numpy(np.concatenate([r.arrays["y"] for r in replies]))
    with torch.no_grad():
        assert abs(float(soft_label_ce(head, z, y, "mean")) - metrics["server-loss-after"]) < 1e-6
    before = head.weight.detach().clone()
    assert train_head(head, [], options(), torch.Generator()) == {"server-num-uploads": 0}
    empty = ClientReply(1, 0, {}, {})
    assert train_head(head, [empty], options(), torch.Generator()) == {"server-num-uploads": 0}
    assert torch.equal(head.weight, before)


def test_mean_reduction_scales_the_step():
    replies = pair_replies(5)
    heads = []
    for reduction, lr in (("sum", 0.01), ("mean", 0.05)):
        torch.manual_seed(0)
        heads.append(nn.Linear(D, C))
        train_head(heads[-1], replies, options(server_loss_reduction=reduction, server_lr=lr), torch.Generator())
    assert torch.allclose(heads[0].weight, heads[1].weight, atol=1e-6)  # sum with lr = mean with lr * K


# 2, 11, 13: payloads and bytes over real rounds; every client holds the broadcast head after evaluation
def test_rounds_payloads_bytes_and_head_replacement(run_config):
    rc = fedre_config(run_config, **{"num-clients": 3, "num-server-rounds": 2})
    strategy, grid = federation(rc)
    result = strategy.start(grid)
    head = strategy.method.global_arrays()
    for ctx in grid.contexts.values():  # after the last evaluation: the global head, bit for bit
        state = ctx.state.array_records[MODEL_STATE]
        assert np.array_equal(state["head.weight"].numpy(), head["head.weight"])
        assert np.array_equal(state["head.bias"].numpy(), head["head.bias"])
    assert np.array_equal(result.arrays["head.weight"].numpy(), head["head.weight"])
    extractor_shapes = {
        tuple(v.shape)
        for k, v in MODEL_GROUPS["fedavgcnn"].build(0, C, 3, 32, 0).state_dict().items()
        if k.startswith("extractor")
    }
    sent = {t: [m for m in grid.sent if m.metadata.message_type == t] for t in ("train", "evaluate")}
    assert len(sent["train"]) == len(sent["evaluate"]) == 6  # all clients train and are evaluated each round
    for m in sent["train"] + sent["evaluate"]:
        assert {k: tuple(a.shape) for k, a in m.content.array_records[PAYLOAD].items()} == {
            "head.weight": (C, D),
            "head.bias": (C,),
        }
        assert tensor_bytes(m.content) == 4 * C * (D + 1) == 20520
    for row in strategy.rows:  # head-source = server (default): no client uploads a head (P13)
        assert row["bytes_up"] == 3 * 2088 and row["bytes_down"] == 3 * 20520
        assert "server_head_from_client_0" not in row
        assert row["eval_bytes_down"] == 3 * 20520 and row["eval_bytes_up"] == 0
        assert row["server_num_uploads"] == 3
        acc = np.array(list(row["accuracy_per_client"].values()))
        assert len(acc) == 3 and abs(row["accuracy_mean"] - acc.mean()) < 1e-12
    assert extractor_shapes.isdisjoint({(1, D), (1, C)})


# 11: receiving the head changes the head only
def test_receiving_the_head_changes_nothing_else(run_config):
    rc = fedre_config(run_config, **{"local-epochs": 0})
    client = client_runtime(rc)
    extractor = {k: v.clone() for k, v in client.model.extractor.state_dict().items()}
    payload = head_payload(5)
    FEDRE_METHOD.build_client(RunConfig.from_dict(rc)).train(client, payload, train_config(rc, **{"local-epochs": 0}))
    assert np.array_equal(client.model.head.weight.detach().numpy(), payload["head.weight"])
    assert all(torch.equal(v, client.model.extractor.state_dict()[k]) for k, v in extractor.items())
    _, metrics = FEDRE_METHOD.build_client(RunConfig.from_dict(rc)).evaluate(client, head_payload(6), {})
    saved = client.context.state.array_records[MODEL_STATE]
    assert np.array_equal(saved["head.weight"].numpy(), head_payload(6)["head.weight"])
    assert 0 <= metrics["test-acc"] <= 1


# 14: determinism
def test_same_seed_same_round(run_config):
    rc = fedre_config(run_config, **{"num-clients": 2, "num-server-rounds": 1})
    heads, pairs = [], []
    for _ in range(2):
        uploads = []
        strategy, grid = federation(rc, lambda node, reply, uploads=uploads: uploads.append(reply) or reply)
        strategy.start(grid)
        heads.append(strategy.method.global_arrays()["head.weight"])
        pairs.append(
            [
                {k: v.numpy() for k, v in r.content.array_records[PAYLOAD].items()}
                for r in uploads
                if r.metadata.message_type == "train"
            ]
        )
    assert np.array_equal(heads[0], heads[1])
    assert len(pairs[0]) == 2
    for a, b in zip(*pairs):
        assert np.array_equal(a["z"], b["z"]) and np.array_equal(a["y"], b["y"])


# 15 and malformed uploads: a client without a pair, a bad soft label; the round goes on
def test_missing_and_malformed_uploads(run_config):
    def tamper(node, reply):
        if reply.metadata.message_type != "train" or reply.has_error():
            return reply
        if node == 1000:  # a client without training samples sends no pair
            del reply.content[PAYLOAD]
        elif node == 1001:  # y does not sum to 1
            arrays = {k: v.numpy() for k, v in reply.content.array_records[PAYLOAD].items()}
            reply.content[PAYLOAD] = array_record({"z": arrays["z"], "y": arrays["y"] * 2})
        return reply

    rc = fedre_config(run_config, **{"num-clients": 4, "num-server-rounds": 1})
    strategy, grid = federation(rc, tamper)
    strategy.start(grid)
    row = strategy.rows[0]
    assert row["num_clients"] == 3 and row["server_num_uploads"] == 2
    assert strategy.counters.dropped["train"] == 1
    assert row["accuracy_mean"] is not None and len(row["accuracy_per_client"]) == 4


def test_degenerate_client_sends_nothing(run_config):
    rc = fedre_config(run_config)
    client = client_runtime(rc)
    data = client.data
    client.__dict__["data"] = dataclasses.replace(data, train_x=data.train_x[:0], train_y=data.train_y[:0])
    arrays, metrics = FEDRE_METHOD.build_client(RunConfig.from_dict(rc)).train(client, head_payload(), train_config(rc))
    assert arrays == {} and metrics["num-examples"] == 0


def test_learning_beats_chance_and_server_loss_falls(run_config):
    rc = fedre_config(
        run_config,
        **{
            "num-clients": 3,
            "num-server-rounds": 4,
            "max-examples-per-client": 400,
            "lr": 0.03,
            "momentum": 0.0,
            "weight-decay": 0.0,
        },
    )
    strategy, grid = federation(rc)
    strategy.start(grid)
    # chance for a client = its majority-class share of its local test split
    tests = [client_runtime(rc, p).data.test_y for p in range(3)]
    chance = np.mean([class_counts(y, C).max() / len(y) for y in tests])
    assert strategy.rows[-1]["accuracy_mean"] > chance + 0.1, (strategy.rows[-1]["accuracy_mean"], chance)
    assert all(r["server_loss_after"] < r["server_loss_before"] for r in strategy.rows)


def test_bad_options_fail_fast(run_config):
    with pytest.raises(ConfigError, match="fedre.re-mode"):
        build_run(RunConfig.from_dict(fedre_config(run_config, **{"fedre.re-mode": "gaussian"})))
    with pytest.raises(ConfigError, match="non-linear heads"):
        build_run(RunConfig.from_dict(run_config(method="fedre", model_group="htfe8-htc4")))


# P13: head-source = client-0 (the PFLlib tree): partition 0's trained head is the head of the server step
def client0_config(run_config, **kw):
    return fedre_config(run_config, **{"fedre.head-source": "client-0", "aggregation": "mean", **kw})


def expected_server_step(head, pairs, lr=0.01):
    """One SGD step (lr, mean over the batch) of the soft-label CE from ``head`` (name -> array) on
    ``pairs`` (a list of {z, y}), in float64: the server step of a round of at most B_s pairs."""
    w, b = (torch.from_numpy(head[k]).double() for k in ("head.weight", "head.bias"))
    z = torch.from_numpy(np.concatenate([p["z"] for p in pairs])).double()
    y = torch.from_numpy(np.concatenate([p["y"] for p in pairs])).double()
    err = torch.softmax(z @ w.T + b, dim=1) - y
    return (w - lr / len(z) * err.T @ z).numpy(), (b - lr / len(z) * err.sum(0)).numpy()


def payload_of(message):
    return {k: v.numpy() for k, v in message.content.array_records[PAYLOAD].items()}


def assert_head(strategy, weight, bias):
    head = strategy.method.global_arrays()
    assert np.allclose(head["head.weight"], weight, atol=1e-6) and np.allclose(head["head.bias"], bias, atol=1e-6)


def test_client0_head_is_partition_0s_trained_head_after_the_server_step(run_config):
    rc = client0_config(run_config, **{"num-clients": 3, "num-server-rounds": 1})
    replies = []
    strategy, grid = federation(rc, lambda node, reply: replies.append(reply) or reply)
    initial = strategy.method.global_arrays()
    strategy.start(grid)
    train = {r.metadata.src_node_id: r for r in replies if r.metadata.message_type.startswith("train")}
    assert {n: r.metadata.message_type for n, r in train.items()} == {1000: "train.head", 1001: "train", 1002: "train"}
    uploads = {n: payload_of(r) for n, r in train.items()}
    assert set(uploads[1000]) == {"z", "y", "head.weight", "head.bias"}  # only partition 0 uploads a head
    assert set(uploads[1001]) == set(uploads[1002]) == {"z", "y"}
    uploaded = uploads[1000]
    assert not np.allclose(uploaded["head.weight"], initial["head.weight"], atol=1e-3)  # it trained the head
    assert_head(strategy, *expected_server_step(uploaded, list(uploads.values())))
    row = strategy.rows[0]
    assert row["server_head_from_client_0"] == 1 and row["server_num_uploads"] == 3
    assert row["bytes_up"] == 3 * 2088 + 4 * C * (D + 1) and row["bytes_down"] == 3 * 20520


def test_client0_absent_partition_0_leaves_the_step_on_the_servers_head(run_config):
    rc = client0_config(run_config, **{"num-clients": 3, "num-server-rounds": 2})
    replies, heads = [], []
    strategy, grid = federation(rc, lambda node, reply: replies.append(reply) or reply)
    original_round = strategy.train_round

    def train_round(server_round):
        if server_round == 2:  # partition 0 stops answering after round 1
            grid.silent.add(1000)
            heads.append(strategy.method.global_arrays())
            replies.clear()
        return original_round(server_round)

    strategy.train_round = train_round
    strategy.start(grid)
    pairs = [payload_of(r) for r in replies if r.metadata.message_type == "train"]
    assert len(pairs) == 2 and not any(r.metadata.src_node_id == 1000 for r in replies)
    assert_head(strategy, *expected_server_step(heads[0], pairs))
    assert [r["server_head_from_client_0"] for r in strategy.rows] == [1, 0]
    assert strategy.rows[1]["dropped_clients"] == [0] and strategy.rows[1]["bytes_up"] == 2 * 2088


@pytest.mark.parametrize(
    "name,bad,reason",
    [
        ("head.weight", lambda a: a[:, :-1], "shape"),
        ("head.weight", lambda a: a.astype(np.float64), "dtype"),
        ("head.bias", lambda a: np.full_like(a, np.nan), "non-finite"),
    ],
)
def test_client0_malformed_head_is_dropped_and_the_round_goes_on(run_config, caplog, name, bad, reason):
    pairs = []

    def tamper(node, reply):
        if reply.metadata.message_type == "train.head":
            arrays = payload_of(reply)
            reply.content[PAYLOAD] = array_record({**arrays, name: bad(arrays[name])})
        elif reply.metadata.message_type == "train":
            pairs.append(payload_of(reply))
        return reply

    rc = client0_config(run_config, **{"num-clients": 3, "num-server-rounds": 1})
    strategy, grid = federation(rc, tamper)
    initial = strategy.method.global_arrays()
    strategy.start(grid)
    assert "Dropped train.head reply from node 1000" in caplog.text and reason in caplog.text
    row = strategy.rows[0]
    assert strategy.counters.dropped["train"] == 1 and row["num_clients"] == 2
    assert row["server_head_from_client_0"] == 0 and row["server_num_uploads"] == 2
    assert_head(strategy, *expected_server_step(initial, pairs))
    assert row["accuracy_mean"] is not None and len(row["accuracy_per_client"]) == 3
