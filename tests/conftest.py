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
    rc.update({"data-dir": str(DATA_DIR), "num-clients": 4, "num-server-rounds": 2,
               "max-examples-per-client": 200, "batch-size": 32})
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
