"""Run config ``handshake`` / ``eval-clients`` = ``auto`` (the defaults): what they choose from N."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest

from common.config import AUTO_SAMPLED_CLIENTS, ConfigError, RunConfig
from conftest import make_run_config


def resolved(**overrides) -> RunConfig:
    return RunConfig.from_dict(make_run_config(dataset="mnist", **overrides))


def test_auto_keeps_every_client_asked_up_to_the_threshold_and_samples_above_it():
    small = resolved(**{"num-clients": AUTO_SAMPLED_CLIENTS, "handshake": "auto", "eval-clients": "auto"})
    assert (small.handshake, small.eval_clients, small.auto_chosen) == ("all", "all", ("handshake", "eval-clients"))
    large = resolved(**{"num-clients": AUTO_SAMPLED_CLIENTS + 1, "fraction-train": 0.002})
    assert (large.handshake, large.eval_clients) == ("sampled", "trained")
    every = resolved(**{"num-clients": 0})  # N from the nodes: nothing known up front, so all
    assert (every.handshake, every.eval_clients) == ("all", "all")


@pytest.mark.parametrize(
    "overrides",
    [
        {"eval-clients": "all"},
        {"min-clients": 10},
        {"generalization.held-out-clients": 5},
        {"method": "lg-fedavg", "client-dp.epsilon": 8.0},
    ],
)
def test_auto_asks_every_client_when_a_key_needs_them_all(overrides):
    cfg = resolved(**{"num-clients": 5000, **overrides})
    assert cfg.handshake == "all"
    assert cfg.auto_chosen[0] == "handshake"


def test_a_value_set_by_hand_stands():
    assert resolved(**{"num-clients": 5000, "handshake": "all"}).handshake == "all"
    cfg = resolved(**{"num-clients": 20, "handshake": "sampled", "eval-clients": "trained"})
    assert (cfg.handshake, cfg.eval_clients, cfg.auto_chosen) == ("sampled", "trained", ())
    sampled = resolved(**{"num-clients": 20, "handshake": "sampled"})  # eval-clients auto follows it
    assert (sampled.eval_clients, sampled.auto_chosen) == ("trained", ("eval-clients",))
    with pytest.raises(ConfigError, match="eval-clients"):
        resolved(**{"num-clients": 20, "handshake": "sampled", "eval-clients": "all"})


def test_the_recorded_config_holds_the_choice_not_auto():
    cfg = resolved(**{"num-clients": 5000})
    recorded = cfg.as_dict()
    assert (recorded["handshake"], recorded["eval-clients"]) == ("sampled", "trained")
    assert "auto-chosen" not in recorded
    assert RunConfig.from_dict(recorded) == replace(cfg, auto_chosen=())


def test_the_server_logs_what_auto_chose(caplog):
    from methods.registry import build_run

    strategy = build_run(resolved(**{"num-clients": 5000, "fraction-train": 0.002, "method": "fedproto"}))
    with caplog.at_level(logging.INFO):
        strategy.log_settings()
    assert "handshake = 'sampled' (auto), eval-clients = 'trained' (auto) for num-clients = 5000" in caplog.text
