"""LG-FedAvg: only the head travels, the server averages it by samples, and the federation learns."""

import numpy as np
import pytest

from common.config import ConfigError
from common.payload import tensor_bytes
from common.protocol import PAYLOAD
from conftest import assert_learns, federation, run_method, shapes_of
from methods.blocks.shared_model import module_arrays


def test_lg_fedavg_shares_only_the_head_and_learns(run_config):
    rc, strategy, grid, replies = run_method(run_config, "lg-fedavg", aggregation="mean")
    for m in replies:
        assert shapes_of(m) == {"head.weight": (10, 500), "head.bias": (10,)}
        assert tensor_bytes(m.content) == 20_040
    # the server's head is the sample-weighted mean of the last replies
    last = replies[-rc["num-clients"] :]
    weights = np.array([r.content.metric_records["metrics"]["num-examples"] for r in last], np.float64)
    mean = (
        sum(w * r.content.array_records[PAYLOAD]["head.weight"].numpy() for w, r in zip(weights, last)) / weights.sum()
    )
    assert np.allclose(module_arrays(strategy.method.shared)["head.weight"], mean, atol=1e-6)
    assert_learns(rc, strategy)
    with pytest.raises(ConfigError, match="non-linear heads"):
        federation(run_config(method="lg-fedavg", model_group="htfe8-htc4"))


def test_eval_global_head_reports_the_averaged_head_after_the_round(run_config):
    """With ``eval-global-head`` every client is evaluated after the server's average, with its own
    extractor and that head (HtFLlib's metric), beside its personal model; the head travels down
    once per evaluated client as evaluation traffic."""
    rc = run_config(**{"method": "lg-fedavg", "num-server-rounds": 1, "lg-fedavg.eval-global-head": True})
    strategy, grid = federation(rc)
    assert not strategy.method.eval_after_training
    strategy.start(grid)
    row = strategy.rows[-1]
    assert row["eval_bytes_down"] == rc["num-clients"] * 20_040
    assert 0.0 <= row["accuracy_weighted_global_head"] <= 1.0
    assert 0.0 <= row["accuracy_mean_global_head"] <= 1.0
    sent = [m for m in grid.sent if m.metadata.message_type == "evaluate"]
    assert sent and all(
        np.array_equal(
            m.content.array_records[PAYLOAD]["head.weight"].numpy(),
            module_arrays(strategy.method.shared)["head.weight"],
        )
        for m in sent
    )
