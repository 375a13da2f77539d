"""FedGen: payload bytes, the label counts, the server step by hand, the generated term training the head alone,
learning on CIFAR-10, hostile uploads and resume (docs/methods/fedgen.md)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Array
from test_hostile import attacker, scaled, with_payload
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
from methods.fedgen import build_generator, train_generator
from methods.registry import build_run, client_procedure


def generator_size(noise_dim: int, num_classes: int, hidden: int, k: int) -> int:
    """P_G of docs/methods/fedgen.md §2."""
    return (noise_dim + num_classes + 1) * hidden + 2 * hidden + (hidden + 1) * k


def test_payload_bytes_are_the_formula_and_the_counts_are_the_clients(run_config):
    rc = run_config(method="fedgen", **{"num-clients": 3, "num-server-rounds": 2, "fedgen.server-epochs": 2})
    run, grid, replies = captured_federation(rc)
    run.start(grid)
    k, c = RunConfig.from_dict(rc).representation_dim, 10
    head = 4 * c * (k + 1)
    down = head + 4 * generator_size(32, c, 512, k) + 8 * c
    assert [row["bytes_down"] for row in run.rows] == [3 * down, 3 * down]
    assert [row["bytes_up"] for row in run.rows] == [3 * (head + 8 * c)] * 2
    uploads = [r for r in replies if r.metadata.message_type == "train"]
    # batch-order "shuffle": every training example is counted
    counts = [np.bincount(client_runtime(rc, p).data.train_y.numpy(), minlength=c) for p in range(3)]
    uploaded = [r.content.array_records[PAYLOAD]["class_counts"].numpy() for r in uploads[:3]]
    assert sorted(map(tuple, uploaded)) == sorted(map(tuple, counts))
    sent = [
        m.content.array_records[PAYLOAD]["label_counts"].numpy()
        for m in grid.sent
        if m.metadata.message_type == "train"
    ]
    assert all(not s.any() for s in sent[:3])  # round 1: nothing reported yet
    assert all(np.array_equal(s, sum(counts)) for s in sent[3:])


def test_fixed_batch_order_counts_the_full_batches_only(run_config):
    rc = run_config(method="fedgen", **{"batch-order": "fixed", "batch-size": 32})
    client = client_runtime(rc, 0)
    config = train_config(rc)
    counts = client_procedure(RunConfig.from_dict(rc)).class_counts(client, config)
    n = len(client.data.train_y) // 32 * 32
    assert counts.sum() == n and np.array_equal(counts, np.bincount(client.data.train_y[:n].numpy(), minlength=10))


def test_server_step_by_hand():
    # the head: the sample-weighted mean; the counts: summed, a claim beyond num-examples scaled down to it;
    # the generator: trained against the new head (its loss falls), or left alone with generator = "initial"
    rc = make_run_config(method="fedgen", aggregation="mean", **{"fedgen.server-epochs": 30})
    server = build_run(RunConfig.from_dict(rc)).method
    before = {k: v.copy() for k, v in server.global_arrays().items()}
    rng = np.random.default_rng(0)
    heads = [
        {k: rng.normal(size=v.shape).astype(np.float32) for k, v in before.items() if k.startswith("head.")}
        for _ in range(2)
    ]
    honest = np.array([30, 10, 0, 0, 0, 0, 0, 0, 0, 0], np.int64)
    inflated = np.array([0, 0, 1000, 1000, 0, 0, 0, 0, 0, 0], np.int64)
    replies = [
        ClientReply(1000, 0, {**heads[0], "class_counts": honest}, {"num-examples": 40}),
        ClientReply(1001, 1, {**heads[1], "class_counts": inflated}, {"num-examples": 20}),
    ]
    counts = torch.tensor([30, 10, 10, 10, 0, 0, 0, 0, 0, 0])
    head = server.shared["head"]
    generator = build_generator(server.cfg, server.options)
    generator.load_state_dict(server.generator.state_dict())

    def loss_of(g):
        g.train()
        labels = torch.multinomial(counts.double(), 256, replacement=True, generator=torch.Generator().manual_seed(9))
        with torch.no_grad():
            return float(torch.nn.functional.cross_entropy(head(g(labels, torch.Generator().manual_seed(9))), labels))

    metrics = server.aggregate_train(1, replies)
    mean = (40 * heads[0]["head.weight"].astype(np.float64) + 20 * heads[1]["head.weight"]) / 60
    np.testing.assert_allclose(server.global_arrays()["head.weight"], mean, atol=1e-6)
    assert np.array_equal(server.global_arrays()["label_counts"], counts.numpy())
    assert np.isfinite(metrics["server-generator-loss"])
    assert loss_of(server.generator) < 0.5 * loss_of(generator)
    assert not any(
        np.array_equal(server.global_arrays()[k], v) for k, v in before.items() if k.startswith("generator.")
    )

    initial = build_run(RunConfig.from_dict({**rc, "fedgen.generator": "initial"})).method
    initial.aggregate_train(1, replies)
    assert "server-generator-loss" not in initial.aggregate_train(2, replies)
    assert all(np.array_equal(initial.global_arrays()[k], v) for k, v in before.items() if k.startswith("generator."))


def test_train_generator_fits_a_fixed_head():
    torch.manual_seed(0)
    cfg = RunConfig.from_dict(make_run_config(method="fedgen"))
    generator = build_generator(cfg, build_run(cfg).method.options)
    head = torch.nn.Linear(cfg.representation_dim, 10)
    counts = torch.ones(10, dtype=torch.int64)
    first = train_generator(generator, head, counts, 1, 64, 0.01, torch.Generator().manual_seed(1))
    last = train_generator(generator, head, counts, 200, 64, 0.01, torch.Generator().manual_seed(2))
    assert last < 0.1 * first
    assert all(p.grad is None for p in head.parameters())  # the head is read, not trained


def test_the_generated_term_trains_the_head_alone(run_config):
    # one batch of plain SGD from the same model: the extractor moves identically with and without generated
    # representations (the term reads the head only), the head differently
    rc = run_config(method="fedgen", **{"max-examples-per-client": 40, "batch-size": 64, "local-epochs": 1})
    cfg = RunConfig.from_dict(rc)
    server = build_run(cfg).method
    server.label_counts["label_counts"] = np.full(10, 5, np.int64)
    payload = server.global_arrays()
    config = train_config(rc, **{"momentum": 0.0, "weight-decay": 0.0, "clip-norm": 0.0})
    models = []
    for counts in (payload["label_counts"], np.zeros(10, np.int64)):
        client = client_runtime(rc, 0)
        client_procedure(cfg).train(client, {**payload, "label_counts": counts}, config)
        models.append(client.model)
    with_term, without = models
    for a, b in zip(with_term.extractor.parameters(), without.extractor.parameters()):
        assert torch.equal(a, b)
    assert not torch.equal(with_term.head.weight, without.head.weight)


def test_record_level_dp_and_client_level_dp_are_refused_naming_the_key():
    with pytest.raises(ConfigError, match="'dp.epsilon'"):
        build_run(RunConfig.from_dict(make_run_config(method="fedgen", **{"dp.epsilon": 8.0})))
    with pytest.raises(ConfigError, match="'client-dp.epsilon'"):
        build_run(RunConfig.from_dict(make_run_config(method="fedgen", **{"client-dp.epsilon": 8.0})))


def test_learns_on_cifar10(run_config):
    # 5 rounds of 2 epochs on 400 CIFAR-10 examples a client (conftest.run_method's budget); the generator trains
    # from round 1's counts on, so the rows of rounds 1-5 carry its loss
    rc, run, _, _ = run_method(run_config, "fedgen")
    assert_learns(rc, run)
    assert all(np.isfinite(row["server_generator_loss"]) for row in run.rows)


@pytest.mark.parametrize("value", [float("nan"), 1e30])
def test_a_hostile_head_is_dropped_or_bounded(run_config, value):
    rc = run_config(method="fedgen", **{"num-clients": 3, "num-server-rounds": 2, "fedgen.server-epochs": 5})
    run, grid = federation(rc, attacker("train", scaled("head.weight", value)))
    run.start(grid)
    arrays = run.method.global_arrays()
    assert all(np.isfinite(v).all() for k, v in arrays.items() if v.dtype == np.float32)
    assert np.abs(arrays["head.weight"]).max() < 10
    if value != value:
        assert run.counters.dropped["train"] == 2


@pytest.mark.parametrize("bad", ["negative", "wrong-length"])
def test_malformed_counts_are_dropped(run_config, bad):
    def tampered(reply):
        arrays = dict(reply.content.array_records[PAYLOAD])
        counts = np.full(10, -1, np.int64) if bad == "negative" else np.ones(7, np.int64)
        arrays["class_counts"] = Array(counts)
        return with_payload(reply, arrays)

    rc = run_config(method="fedgen", **{"num-clients": 3, "num-server-rounds": 1, "fedgen.server-epochs": 1})
    run, grid = federation(rc, attacker("train", tampered))
    run.start(grid)
    assert run.counters.dropped["train"] == 1 and run.rows[0]["num_clients"] == 2


def test_resume_continues_exactly(run_config):
    base = run_config(method="fedgen", **{"num-clients": 3, "fraction-train": 0.67, "fedgen.server-epochs": 5})
    whole, _ = run_with_results({**base, "num-server-rounds": 3}, name="whole")
    first, grid = run_with_results({**base, "num-server-rounds": 2}, name="first")
    second, _ = run_with_results(
        {**base, "num-server-rounds": 3, "resume-from": str(first.results.path)}, grid, name="second"
    )
    assert [r["accuracy_per_client"] for r in whole.rows] == [r["accuracy_per_client"] for r in second.rows]
    for name, array in whole.method.global_arrays().items():
        assert np.array_equal(array, second.method.global_arrays()[name]), name


def test_a_held_out_client_is_served_the_head_generator_and_counts_and_the_server_is_untouched(run_config):
    rc = run_config(
        method="fedgen",
        **{"generalization.held-out-clients": 1.0, "generalization.rounds": 2, "fedgen.server-epochs": 2},
    )
    run, grid = federation(rc)
    run.start(grid)
    row = run.rows[-1]
    assert row["heldout_partitions"] == [3] and len(row["heldout_curve_mean"]) == 3
    k = RunConfig.from_dict(rc).representation_dim
    down = 4 * 10 * (k + 1) + 4 * generator_size(32, 10, 512, k) + 8 * 10
    assert row["heldout_bytes_down"] == 2 * down  # two personalisation rounds of one client
    sent = [m for m in grid.sent if m.metadata.message_type == "train"][-1].content.array_records[PAYLOAD]
    for name, array in run.method.global_arrays().items():  # the phase changed nothing on the server
        assert np.array_equal(sent[name].numpy(), array), name
