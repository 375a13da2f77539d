"""Shared fixtures: run configs on the real offline data, an in-process federation."""

from __future__ import annotations

import os

# Never reach for the Hub from tests: an offline lookup must fail at once, not hang.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

import fakegrid  # noqa: E402,F401  (sets Flower's task identity, needed to build Messages in tests)
from tools.run import app_defaults  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DATA_DIR = ROOT.parent / "shared" / "data"


def make_run_config(**overrides) -> dict:
    """pyproject defaults + small, fast settings + ``overrides`` (keys with '-' or '_')."""
    rc = app_defaults()
    # round-timeout: the fake grid answers at once, so only a silent node waits for it
    rc.update(
        {
            "data-dir": str(DATA_DIR),
            "num-clients": 4,
            "num-server-rounds": 2,
            "max-examples-per-client": 200,
            "batch-size": 32,
            "round-timeout": 0.5,
        }
    )
    rc.update({k.replace("_", "-"): v for k, v in overrides.items()})
    return rc


@pytest.fixture
def run_config(tmp_path):
    """Factory: a run-config dict writing results under the test's tmp folder."""

    def factory(**overrides):
        return make_run_config(**{"output-dir": str(tmp_path / "outputs"), **overrides})

    return factory


def federation(rc: dict, tamper=None):
    """(strategy, grid) for ``rc`` over a FakeGrid with the real ClientApp."""
    from client_app.app import app as client_app
    from common.config import RunConfig
    from fakegrid import FakeGrid
    from strategies.registry import build_strategy

    cfg = RunConfig.from_dict(rc)
    return build_strategy(cfg), FakeGrid(client_app, rc, cfg.num_clients, tamper)


def client_runtime(rc: dict, partition_id: int = 0):
    """A ClientRuntime of partition ``partition_id`` for run config ``rc``, with empty state."""
    from flwr.app import Context, RecordDict

    from client_app.runtime import ClientRuntime

    ctx = Context(
        run_id=1,
        node_id=1,
        node_config={"partition-id": partition_id, "num-partitions": rc["num-clients"]},
        state=RecordDict(),
        run_config=rc,
    )
    return ClientRuntime(ctx)


def train_config(rc: dict, server_round: int = 1, **kw) -> dict:
    """The config of a train instruction built from ``rc`` (what ``HeteroStrategy.train_config`` sends)."""
    cfg = {
        "server-round": server_round,
        "local-epochs": rc["local-epochs"],
        "batch-size": rc["batch-size"],
        "lr": rc["lr"],
        "momentum": rc["momentum"],
        "weight-decay": rc["weight-decay"],
        "clip-norm": rc["clip-norm"],
        "precision": rc["precision"],
    }
    return {**cfg, **kw}
