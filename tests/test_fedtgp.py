"""FedTGP: adaptive margin (and its freeze), ACL loss, the generator across rounds, eval-mode uploads, options,
diagnostics."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from common.config import ConfigError, RunConfig
from common.data import normalize
from common.payload import ClientReply
from common.run_folder import CHECKPOINT, ResultsWriter, load_checkpoint
from conftest import client_runtime, federation, make_run_config, plain_sgd_config
from engine.checkpoint import load_server_state
from methods.blocks.prototypes import RegularizerOptions
from methods.fedproto import METHOD as FEDPROTO_METHOD
from methods.fedtgp import METHOD as FEDTGP_METHOD
from methods.fedtgp import (
    FedTGPOptions,
    PrototypeGenerator,
    acl_loss,
    adaptive_margin,
    held_margin,
    train_generator,
)
from methods.registry import build_run

K = 512
MNIST = {"dataset": "mnist", "model-group": "htcnn8", "partitioner": "dirichlet", "dirichlet-alpha": 0.1}


def tgp_options(**kw):
    """FedTGPOptions with their declared defaults, ``kw`` overriding."""
    return FedTGPOptions(**kw)


def cluster_replies(num_classes=5, clients=4, k=K, seed=0, scale=3.0):
    """Synthetic uploads: every client holds every class; class c is a Gaussian cluster (centres of
    standard deviation ``scale``: the margin grows with it)."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(scale=scale, size=(num_classes, k))
    out = []
    for i in range(clients):
        protos = (centres + rng.normal(scale=scale / 10, size=centres.shape)).astype(np.float32)
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


def rule_of(replies):
    """The adaptive rule's margin (tau = 100) of a round's uploads."""
    protos = torch.from_numpy(np.concatenate([r.arrays["protos"] for r in replies]))
    return adaptive_margin(protos, torch.from_numpy(np.concatenate([r.arrays["proto_labels"] for r in replies])), 100)


def freeze_strategy(level, **kw):
    """A FedTGP server (K = 512, C = 10) with ``fedtgp.margin-freeze`` = ``level`` and a one-epoch server
    step, the paper's (``aggregation = "mean"``: the margin of the rows as uploaded)."""
    rc = make_run_config(
        method="fedtgp",
        aggregation="mean",
        **{"model-group": "htfe2", "fedtgp.margin-freeze": level, "fedtgp.server-epochs": 1, "fedtgp.hidden-dim": 16},
        **kw,
    )
    return build_run(RunConfig.from_dict(rc))


#: four rounds of uploads whose rule margins rise past 10 and fall again
FREEZE_ROUNDS = [cluster_replies(seed=i, scale=s)[0] for i, s in enumerate((0.1, 0.5, 2.0, 0.1))]
LEVEL = 10.0


# §11 item 16 (stability option fedtgp.margin-freeze): the rule until it reaches the level, then the level
def test_held_margin_follows_the_rule_then_holds_the_level():
    frozen, deltas, flags = False, [], []
    for rule in (2.0, 7.5, 10.0, 14.0, 3.0, 0.0, 25.0):
        delta, frozen = held_margin(rule, LEVEL, frozen)
        deltas.append(delta)
        flags.append(frozen)
    assert deltas == [2.0, 7.5, 10.0, 10.0, 10.0, 10.0, 10.0]
    assert flags == [False, False, True, True, True, True, True]
    assert held_margin(12.5, LEVEL, False) == (LEVEL, True)  # reached above the level: the level at once
    for rule in (0.0, 3.0, 12.5, 100.0):  # off: the rule's value, never frozen
        assert held_margin(rule, 0.0, False) == (rule, False)


def test_margin_freeze_server_step_holds_the_level_when_the_rule_rises_and_falls():
    rules = [rule_of(u) for u in FREEZE_ROUNDS]
    assert rules[0] < LEVEL < rules[1] < rules[2] and rules[3] < LEVEL
    strategy = freeze_strategy(LEVEL)
    metrics = [strategy.method.aggregate_train(t + 1, u) for t, u in enumerate(FREEZE_ROUNDS)]
    assert [m["server-margin"] for m in metrics] == [rules[0], LEVEL, LEVEL, LEVEL]
    assert [m["server-margin-frozen"] for m in metrics] == [0, 1, 1, 1]
    assert strategy.method.margin_hold == {"frozen": True}
    with pytest.raises(ConfigError, match="'fedtgp.margin-freeze'"):  # above tau: never reached
        freeze_strategy(60.0, **{"fedtgp.tau": 50.0})


def test_margin_freeze_off_is_the_rule_unchanged():
    # off, and on at a level no round reaches: the same margins, metrics and global prototypes' bytes
    off, unreached = freeze_strategy(0.0), freeze_strategy(100.0)
    for t, u in enumerate(FREEZE_ROUNDS):
        a, b = off.method.aggregate_train(t + 1, u), unreached.method.aggregate_train(t + 1, u)
        assert a["server-margin"] == rule_of(u) and "server-margin-frozen" not in a
        assert b["server-margin-frozen"] == 0 and a == {k: v for k, v in b.items() if k != "server-margin-frozen"}
        assert (
            off.method.global_arrays()["global_protos"].tobytes()
            == unreached.method.global_arrays()["global_protos"].tobytes()
        )
    assert off.method.margin_hold == {"frozen": False}


def test_margin_freeze_survives_a_checkpoint_round_trip(tmp_path):
    strategy = freeze_strategy(LEVEL)
    for t, u in enumerate(FREEZE_ROUNDS[:2]):
        strategy.method.aggregate_train(t + 1, u)
    writer = ResultsWriter(tmp_path, "run", strategy.cfg.as_dict())
    writer.write_checkpoint(
        strategy.checkpoints.build(2, "key", strategy.rng, strategy.counters, [], strategy.method.server_state())
    )
    assert (writer.path / CHECKPOINT).is_file()
    resumed, fresh = freeze_strategy(LEVEL), freeze_strategy(LEVEL)
    load_server_state(resumed.method, load_checkpoint(writer.path)["server"])
    assert resumed.method.margin_hold == {"frozen": True}
    # the rule falls below the level in round 4: the resumed server holds it, as the one that went on does
    after = [
        s.aggregate_train(3 + t, u) for s in (strategy.method, resumed.method) for t, u in enumerate(FREEZE_ROUNDS[2:])
    ]
    assert after[:2] == after[2:] and [m["server-margin"] for m in after] == [LEVEL] * 4
    assert fresh.method.aggregate_train(4, FREEZE_ROUNDS[3])["server-margin"] == rule_of(FREEZE_ROUNDS[3]) < LEVEL


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
    strategy = build_run(RunConfig.from_dict(make_run_config(method="fedtgp", **{"model-group": "htfe2"})))
    strategy.method.dims = {"C": 10, "d": K}
    strategy.method.aggregate_train(
        1,
        [
            ClientReply(0, 0, {"protos": r.arrays["protos"], "proto_labels": r.arrays["proto_labels"]}, {})
            for r in replies
        ],
    )
    after_round1 = copy.deepcopy(strategy.method.generator.state_dict())
    assert any(not torch.equal(after_round1[k], v) for k, v in fresh.items())
    start_round2 = copy.deepcopy(strategy.method.generator.state_dict())
    assert all(torch.equal(after_round1[k], start_round2[k]) for k in after_round1)


# 1, 3: upload content; eval-mode exact prototypes (train mode differs with BatchNorm)
def test_upload_is_eval_mode_class_means(run_config):
    rc = run_config(method="fedtgp", **{"model-group": "htfe2", "num-clients": 4, "max-examples-per-client": 120})
    client = client_runtime(rc, partition_id=1)  # resnet18: has BatchNorm
    arrays, _ = FEDTGP_METHOD.build_client(RunConfig.from_dict(rc)).train(client, {}, plain_sgd_config(rc))
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


# §11 item 15: the official code's order uploads the prototypes of the round-start model
def test_before_training_pass_uploads_round_start_prototypes(run_config):
    rc = run_config(method="fedtgp", **MNIST, **{"num-clients": 4, "max-examples-per-client": 120})
    uploads = {}
    for mode in ("before-training", "after-training"):
        client = client_runtime({**rc, "fedtgp.prototype-pass": mode}, partition_id=1)
        start = copy.deepcopy(client.model).eval()
        procedure = FEDTGP_METHOD.build_client(RunConfig.from_dict({**rc, "fedtgp.prototype-pass": mode}))
        uploads[mode], stats = procedure.train(client, {}, plain_sgd_config(rc))
        assert stats["train-seconds"] > 0
        x, y = normalize(client.data.train_x, client.data.info), client.data.train_y
        with torch.no_grad():
            feats = {"before-training": start.extractor(x), "after-training": client.model.eval().extractor(x)}
        for row, c in zip(uploads[mode]["protos"], uploads[mode]["proto_labels"]):
            np.testing.assert_allclose(row, feats[mode][y == int(c)].mean(0).numpy(), rtol=1e-4, atol=1e-5)
    assert not np.allclose(uploads["before-training"]["protos"], uploads["after-training"]["protos"], atol=1e-3)


# 12: under batch-order = "fixed" (HtFLlib's training loader) the prototypes leave out the last partial
# batch, as HtFLlib's collect_protos, which iterates that loader
def test_fixed_batch_order_prototypes_leave_out_the_last_partial_batch(run_config):
    rc = run_config(method="fedtgp", **MNIST, **{"num-clients": 4, "max-examples-per-client": 120})
    rc.update({"fedtgp.prototype-pass": "before-training", "batch-size": 10})
    client = client_runtime(rc, partition_id=1)
    n = len(client.data.train_y)
    assert n % 10, "the partition must end in a partial batch for this test to show anything"
    x, y = normalize(client.data.train_x, client.data.info), client.data.train_y
    with torch.no_grad():
        feats = client.model.eval().extractor(x)
    uploads = {}
    for order, kept in (("fixed", n - n % 10), ("shuffle", n)):
        config = {**rc, "batch-order": order}
        procedure = FEDTGP_METHOD.build_client(RunConfig.from_dict(config))
        uploads[order], _ = procedure.train(client_runtime(config, partition_id=1), {}, plain_sgd_config(config))
        for row, c in zip(uploads[order]["protos"], uploads[order]["proto_labels"]):
            np.testing.assert_allclose(row, feats[:kept][y[:kept] == int(c)].mean(0).numpy(), rtol=1e-4, atol=1e-5)
    assert not np.allclose(uploads["fixed"]["protos"], uploads["shuffle"]["protos"], atol=1e-5)


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
        build_run(RunConfig.from_dict(make_run_config(method="fedtgp", **{"fedtgp.margin": "widest"})))
    with pytest.raises(ConfigError, match="'fedtgp.reg-form'"):
        build_run(RunConfig.from_dict(make_run_config(method="fedtgp", **{"fedtgp.reg-form": "l1"})))

    with pytest.raises(ConfigError, match="fedgh.*linear header"):
        build_run(RunConfig.from_dict(make_run_config(**{"model-group": "htfe8-htc4"})))
    assert isinstance(
        FEDPROTO_METHOD.build_client(RunConfig.from_dict(make_run_config(method="fedproto"))).options,
        RegularizerOptions,
    )


def test_fedtgp_rows_carry_prototype_diagnostics(run_config):
    rc = run_config(  # the paper's step (mean): the margin recomputed below from the rows as uploaded
        **MNIST,
        **{"num-clients": 4, "num-server-rounds": 3, "method": "fedtgp", "fedtgp.server-epochs": 5},
        aggregation="mean",
    )
    strategy, grid = federation(rc)
    olds, rules = [], []
    original = strategy.method.aggregate_train

    def spy(server_round, replies):
        olds.append(strategy.method.global_set.get("global_protos"))
        rules.append(rule_of(replies))
        return original(server_round, replies)

    strategy.method.aggregate_train = spy
    strategy.start(grid)
    rows = strategy.rows
    assert all(r["server_margin"] > 0 for r in rows) and "server_proto_shift" not in rows[0]
    # margin-freeze off (default): the adaptive rule's margin every round, no frozen key
    assert [r["server_margin"] for r in rows] == rules and all("server_margin_frozen" not in r for r in rows)
    final = strategy.method.global_set["global_protos"].astype(np.float64)
    dist = np.linalg.norm(final[:, None] - final[None], axis=2) + np.diag(np.full(10, np.inf))
    assert rows[-1]["server_proto_min_distance"] == pytest.approx(dist.min(), rel=1e-6)
    shift = np.linalg.norm(final - olds[-1].astype(np.float64), axis=1).mean()
    assert rows[-1]["server_proto_shift"] == pytest.approx(shift, rel=1e-6) and shift > 0
