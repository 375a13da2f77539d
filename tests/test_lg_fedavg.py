"""LG-FedAvg: only the head travels, the server averages it by samples, and the federation learns."""

import numpy as np
import pytest

from common.config import ConfigError
from conftest import assert_learns, federation, run_method, shapes_of
from strategies.payload import PAYLOAD, tensor_bytes
from strategies.shared_model import module_arrays


def test_lg_fedavg_shares_only_the_head_and_learns(run_config):
    rc, strategy, grid, replies = run_method(run_config, "lg-fedavg")
    for m in replies:
        assert shapes_of(m) == {"head.weight": (10, 500), "head.bias": (10,)}
        assert tensor_bytes(m.content) == 20_040
    # the server's head is the sample-weighted mean of the last replies
    last = replies[-rc["num-clients"] :]
    weights = np.array([r.content.metric_records["metrics"]["num-examples"] for r in last], np.float64)
    mean = (
        sum(w * r.content.array_records[PAYLOAD]["head.weight"].numpy() for w, r in zip(weights, last)) / weights.sum()
    )
    assert np.allclose(module_arrays(strategy.shared)["head.weight"], mean, atol=1e-6)
    assert_learns(rc, strategy)
    with pytest.raises(ConfigError, match="non-linear heads"):
        federation(run_config(method="lg-fedavg", model_group="htfe8-htc4"))
