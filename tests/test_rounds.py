"""Whole rounds in-process through the real ClientApp (FakeGrid, no Ray)."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord

from common.config import RunConfig
from common.files import read_rows
from conftest import federation
from models.groups import MODEL_GROUPS
from server_app.app import run


def test_client_state_persists_across_rounds(run_config):
    # With 0 local epochs FedGH only swaps in the header, so round 2 must start from (and
    # keep) exactly the extractor stored after round 1; a fresh model would differ.
    rc = run_config(**{"num-server-rounds": 1})
    strategy, grid = federation(rc)
    strategy.start(grid)
    after_round1 = {n: ctx.state.array_records["model"].to_torch_state_dict() for n, ctx in grid.contexts.items()}
    rc2 = {**rc, "local-epochs": 0}
    strategy2, _ = federation(rc2)
    grid.contexts = {
        n: type(ctx)(run_id=1, node_id=n, node_config=ctx.node_config, state=ctx.state, run_config=rc2)
        for n, ctx in grid.contexts.items()
    }
    strategy2.start(grid)
    for node, ctx in grid.contexts.items():
        state = ctx.state.array_records["model"].to_torch_state_dict()
        for key, value in state.items():
            if key.startswith("extractor."):
                assert torch.equal(value, after_round1[node][key]), key
    # and training really changes the model (round 1 moved it away from its initialisation)
    init = MODEL_GROUPS["hetero-cnn5"].build(0, 10, 3, 32, rc["seed"]).state_dict()
    assert not torch.equal(init["extractor.0.weight"], after_round1[1000]["extractor.0.weight"])


def test_malformed_replies_are_dropped_and_round_goes_on(run_config):
    def corrupt(node, reply):
        if reply.metadata.message_type != "train" or reply.has_error():
            return reply
        payload = reply.content.array_records["payload"]
        lar, labels = payload["lar"].numpy().copy(), payload["lar_labels"].numpy().copy()
        if node == 1000:
            lar = np.zeros((lar.shape[0] + 1, lar.shape[1]), np.float32)  # wrong shape
        elif node == 1001:
            lar[0, 0] = np.nan  # non-finite
        elif node == 1002:
            labels[0] = 10  # unknown class id
        reply.content["payload"] = ArrayRecord({"lar": Array(lar), "lar_labels": Array(labels)})
        return reply

    rc = run_config(**{"num-clients": 5, "num-server-rounds": 2})
    strategy, grid = federation(rc, tamper=corrupt)
    strategy.start(grid)
    for row in strategy.rows:
        assert row["num_clients"] == 2 and row["server_num_lars"] == 4
        assert row["accuracy_mean"] is not None
    assert strategy.counters.dropped["train"] == 6


def test_client_exception_is_dropped(run_config):
    rc = run_config(**{"num-clients": 3, "num-server-rounds": 1})
    strategy, grid = federation(rc)
    # a client whose node config names a partition that does not exist raises in the ClientApp
    grid.contexts[1002].node_config["partition-id"] = 2
    original = grid.client_app

    def flaky(msg, ctx):
        if msg.metadata.message_type == "train" and ctx.node_id == 1001:
            raise RuntimeError("disk full")
        return original(msg, ctx)

    grid.client_app = flaky
    strategy.start(grid)
    assert strategy.rows[0]["num_clients"] == 2 and strategy.counters.dropped["train"] == 1


def test_results_files_written_each_round_and_learning(run_config, tmp_path):
    rc = run_config(
        **{
            "method": "local",
            "num-server-rounds": 3,
            "max-examples-per-client": 400,
            "local-epochs": 2,
            "partitioner": "iid",
        }
    )
    strategy, grid = federation(rc)
    writer = run(grid, RunConfig.from_dict(rc), "t1")
    rows = read_rows(writer.path)
    assert [r["round"] for r in rows] == [1, 2, 3]
    for r in rows:
        for key in ("accuracy_mean", "accuracy_weighted", "bytes_up", "bytes_down", "num_clients", "round_seconds"):
            assert key in r
        assert r["bytes_up"] == r["bytes_down"] == 0  # local: nothing exchanged
        assert r["num_clients"] == 4 and len(r["accuracy_per_client"]) == 4
    summary = json.loads((writer.path / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds_completed"] == 3
    assert summary["config"]["method"] == "local"
    for metric, round_key in (("accuracy_mean", "best_round"), ("accuracy_weighted", "best_round_weighted")):
        best = max(rows, key=lambda r: r[metric])  # the first round that reached the best
        assert (summary[f"best_{metric}"], summary[round_key]) == (best[metric], best["round"])
    # learning: 10 iid classes, chance is 0.1; the training loss falls over the rounds
    assert rows[-1]["accuracy_mean"] > 0.2
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]
    assert all(r["client_train_seconds"] > 0 for r in rows)
    # throughput per architecture: images (num-examples x local-epochs) over the clients' train-seconds
    archs = {MODEL_GROUPS[rc["model-group"]].architecture_for(p) for p in range(4)}
    assert len(archs) == 4  # hetero-cnn5: one architecture per client here
    for r in rows:
        assert set(r["train_images_per_second"]) == archs and all(v > 0 for v in r["train_images_per_second"].values())


def test_failed_run_is_marked_in_summary(run_config):
    rc = run_config(**{"num-server-rounds": 1})
    _, grid = federation(rc)
    grid.contexts.clear()  # no node ever connects
    rc["connect-timeout"] = 0.1
    with pytest.raises(RuntimeError, match="num-clients=4"):
        run(grid, RunConfig.from_dict(rc), "t2")
    summaries = list(Path(rc["output-dir"]).glob("*/summary.json"))
    assert json.loads(summaries[0].read_text())["status"] == "failed"


def test_evaluation_in_train_reply_equals_separate_evaluation(run_config):
    rc = run_config(**{"num-clients": 4, "num-server-rounds": 2, "fraction-train": 0.5})
    rows = []
    for in_train in (True, False):
        strategy, grid = federation(rc)
        strategy.method.eval_after_training = in_train
        strategy.start(grid)
        rows.append(strategy.rows)
        kinds = [m.metadata.message_type for m in grid.sent]
        assert kinds.count("evaluate") == (2 * 2 if in_train else 2 * 4)
    for a, b in zip(*rows):
        assert a["accuracy_per_client"] == b["accuracy_per_client"]
        assert a["accuracy_mean"] == b["accuracy_mean"]


def test_bf16_precision_trains_in_bfloat16_and_learns(run_config):
    """``precision = "bf16"``: the forward pass runs in bfloat16 (the logits are bf16), weights and
    gradients stay float32, the loss still falls, and the result differs from fp32's."""
    from common.training import train_supervised
    from conftest import client_runtime, train_config

    rc = run_config(**{"max-examples-per-client": 300, "partitioner": "iid", "model-group": "cnn1"})
    results = {}
    for precision in ("fp32", "bf16"):
        client = client_runtime(rc)
        seen = []
        hook = client.model.head.register_forward_hook(lambda m, i, out, seen=seen: seen.append(out.dtype))
        config = train_config(rc, **{"precision": precision, "local-epochs": 1})
        first = train_supervised(client.model, client.data, config, client.device, torch.Generator().manual_seed(0))
        for _ in range(3):
            last = train_supervised(client.model, client.data, config, client.device, torch.Generator().manual_seed(1))
        hook.remove()
        assert set(seen) == {torch.bfloat16 if precision == "bf16" else torch.float32}
        assert all(p.dtype == torch.float32 for p in client.model.parameters())
        assert last["train-loss"] < first["train-loss"]
        results[precision] = torch.cat([p.detach().flatten() for p in client.model.parameters()])
    assert not torch.equal(results["fp32"], results["bf16"])


def test_fixed_batch_order_is_the_partitions_order_without_the_last_partial_batch(run_config):
    """``batch-order = "fixed"`` (HtFLlib's loader): every epoch takes the train split in its own order
    and drops the last partial batch; ``shuffle`` reorders every epoch and keeps it; ``shuffle-drop``
    (PFLlib's loader) reorders every epoch and drops it."""
    from common.training import train_supervised
    from conftest import client_runtime, train_config

    rc = run_config(**{"max-examples-per-client": 60, "partitioner": "iid", "model-group": "cnn1"})
    client = client_runtime(rc)
    labels = client.data.train_y
    n, size = len(labels), 8
    assert n % size  # a last partial batch exists
    seen = {}
    for order in ("fixed", "shuffle", "shuffle-drop"):
        batches = seen[order] = []

        def loss(x, features, logits, y, batches=batches):
            batches.append(y.clone())
            return torch.nn.functional.cross_entropy(logits, y)

        config = train_config(rc, **{"batch-order": order, "batch-size": size, "local-epochs": 2})
        train_supervised(client.model, client.data, config, client.device, torch.Generator().manual_seed(0), None, loss)
    full = n // size * size
    assert [len(b) for b in seen["fixed"]] == [size] * (2 * (n // size))
    assert torch.equal(torch.cat(seen["fixed"]), torch.cat([labels[:full], labels[:full]]))
    shuffled = torch.cat(seen["shuffle"])
    assert len(shuffled) == 2 * n and not torch.equal(shuffled[:n], labels)
    assert torch.equal(shuffled[:n].sort().values, labels.sort().values)
    dropped = seen["shuffle-drop"]
    assert [len(b) for b in dropped] == [size] * (2 * (n // size))
    # each epoch a new order: the epochs' batches differ, and each epoch's are the same permutation's
    # first full batches as shuffle's (one generator, the same draws)
    first = torch.cat(dropped[: n // size])
    assert torch.equal(first, shuffled[:full])
    assert not torch.equal(first, torch.cat(dropped[n // size :]))
