"""Bad configuration fails fast, naming the key and the allowed values."""

import math

import pytest

from common.config import ConfigError, RunConfig
from conftest import make_run_config
from methods.registry import build_run


def test_defaults_are_valid():
    cfg = RunConfig.from_dict(make_run_config())
    assert cfg.method == "fedgh" and cfg.num_clients == 4
    assert build_run(cfg).method.options.server_mode == "per-lar"


@pytest.mark.parametrize(
    "key,value,fragment",
    [
        ("partitioner", "shards", "'iid', 'dirichlet', 'pathological'"),
        ("dataset", "imagenet", "'cifar10'"),
        ("model-group", "resnet", "'cnn1', 'hetero-cnn5'"),
        ("fraction-train", 0.0, "> 0"),
        ("fraction-train", 1.5, "<= 1"),
        ("num-server-rounds", 2.5, "an integer"),
        ("lr", "fast", "a number"),
        ("device", "tpu", "'auto', 'cpu', 'cuda'"),
        ("batch-order", "sorted", "'shuffle', 'fixed', 'shuffle-drop'"),
        ("classes-per-client", 11, "from 1 to 10"),
    ],
)
def test_bad_value_names_key_and_allowed_values(key, value, fragment):
    with pytest.raises(ConfigError) as err:
        RunConfig.from_dict(make_run_config(**{key: value}))
    assert f"'{key}'" in str(err.value) and fragment in str(err.value)


def test_unknown_method_and_method_option():
    with pytest.raises(ConfigError, match="'method'.*'fedgh', 'local'"):
        build_run(RunConfig.from_dict(make_run_config(method="fedx")))
    with pytest.raises(ConfigError, match="'fedgh.server-mode'.*'per-lar'"):
        build_run(RunConfig.from_dict(make_run_config(**{"fedgh.server-mode": "fast"})))


def test_missing_key():
    rc = make_run_config()
    del rc["seed"]
    with pytest.raises(ConfigError, match="missing key.*seed"):
        RunConfig.from_dict(rc)


def test_launcher_rejects_bad_config_before_starting(capsys):
    from tools.run import main

    assert main(["-c", "partitioner='shards'"]) == 2
    assert "'partitioner'" in capsys.readouterr().out
    assert main(["-c", "no-such-key=1"]) == 2


def test_device_choice():
    import torch

    from common.runtime import pick_device

    assert pick_device("cpu").type == "cpu"
    assert pick_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="'device' = 'cuda'.*client-resources-num-gpus"):
            pick_device("cuda")


def _numeric_keys() -> list[tuple[str, type]]:
    """(key, int or float) of every numeric run config key and method option, from their declarations."""
    import dataclasses
    import typing

    from common.options import option_key
    from methods.registry import OPTION_TABLES

    hints = typing.get_type_hints(RunConfig)
    keys = [
        (f.name.replace("_", "-"), hints[f.name])
        for f in dataclasses.fields(RunConfig)
        if hints[f.name] in (int, float)
    ]
    for name, table in OPTION_TABLES.items():
        options = typing.get_type_hints(table)
        keys += [
            (f"{name}.{option_key(f)}", options[f.name])
            for f in dataclasses.fields(table)
            if options[f.name] in (int, float)
        ]
    return keys


NUMERIC_KEYS = _numeric_keys()


@pytest.mark.parametrize("key, kind", NUMERIC_KEYS, ids=[k for k, _ in NUMERIC_KEYS])
def test_every_numeric_key_refuses_nan_infinity_and_integers_beyond_64_bits(key, kind):
    """NaN slipped through every range check (``<``/``>`` are false for NaN): a run 'completed' with
    0 clients, crashed in sampling, never ended (round-timeout) or failed every ClientApp call."""
    from methods.registry import METHODS

    table = key.split(".")[0] if "." in key else ""
    method = table if table in METHODS else "fedgh"
    bad = [math.nan, math.inf, -math.inf, 10**400] + ([2**63, -(2**63) - 1, 10**30, 1.0] if kind is int else [])
    for value in bad:
        with pytest.raises(ConfigError) as err:
            build_run(RunConfig.from_dict(make_run_config(method=method, **{key: value})))
        assert f"'{key}'" in str(err.value) and "allowed values are" in str(err.value), (key, value, err.value)


def test_the_largest_seed_runs_a_round(run_config):
    """seed = 2^63 - 1 (the largest Flower carries) is accepted and every consumer takes it: the
    partitioner, the model initialisation and the per-round client RNG (derived seeds wrap at 2^64)."""
    from conftest import federation

    rc = run_config(**{"seed": 2**63 - 1, "num-clients": 2, "num-server-rounds": 1, "max-examples-per-client": 60})
    strategy, grid = federation(rc)
    strategy.start(grid)
    assert strategy.rows[0]["num_clients"] == 2 and strategy.rows[0]["dropped_clients"] == []
    with pytest.raises(ConfigError, match="'seed'.*<= 9223372036854775807"):
        RunConfig.from_dict(make_run_config(seed=2**63))


def test_min_clients_above_num_clients_is_refused_naming_both_keys():
    """It was clamped to num-clients silently: the run waited for every client, not for min-clients."""
    with pytest.raises(ConfigError, match=r"'min-clients' = 5 is invalid: allowed values are 0 to 'num-clients' = 4"):
        RunConfig.from_dict(make_run_config(**{"num-clients": 4, "min-clients": 5}))
    assert RunConfig.from_dict(make_run_config(**{"num-clients": 4, "min-clients": 4})).min_clients == 4
    # num-clients = 0 follows the federation: its size is known only at the handshake
    assert RunConfig.from_dict(make_run_config(**{"num-clients": 0, "min-clients": 5})).min_clients == 5


@pytest.mark.parametrize("item", ["seed=1 seed=2", "lr=0.1 seed=1 'seed'=2", "fedgh.server-lr=1 fedgh.server-lr=2"])
def test_a_key_given_twice_in_one_item_is_named(item):
    """Flower's message ("invalid format") did not say which key; the same key in two items is an override."""
    from tools.runconfig import read_config

    key = item.split()[-1].partition("=")[0].strip("'")
    with pytest.raises(ConfigError, match=rf"\['{key}'\] given twice in one item: allowed is each key once per item"):
        read_config(None, [item])
    assert read_config(None, ["seed=1", "seed=2"])[0]["seed"] == 2
