"""Bad configuration fails fast, naming the key and the allowed values."""

import pytest

from common.config import ConfigError, RunConfig
from conftest import make_run_config
from strategies.registry import build_strategy


def test_defaults_are_valid():
    cfg = RunConfig.from_dict(make_run_config())
    assert cfg.method == "fedgh" and cfg.num_clients == 4
    assert build_strategy(cfg).options.server_mode == "per-lar"


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
        ("classes-per-client", 11, "from 1 to 10"),
    ],
)
def test_bad_value_names_key_and_allowed_values(key, value, fragment):
    with pytest.raises(ConfigError) as err:
        RunConfig.from_dict(make_run_config(**{key: value}))
    assert f"'{key}'" in str(err.value) and fragment in str(err.value)


def test_unknown_method_and_method_option():
    with pytest.raises(ConfigError, match="'method'.*'fedgh', 'local'"):
        build_strategy(RunConfig.from_dict(make_run_config(method="fedx")))
    with pytest.raises(ConfigError, match="'fedgh.server-mode'.*'per-lar'"):
        build_strategy(RunConfig.from_dict(make_run_config(**{"fedgh.server-mode": "fast"})))


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

    from client_app.runtime import pick_device

    assert pick_device("cpu").type == "cpu"
    assert pick_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="'device' = 'cuda'.*client-resources-num-gpus"):
            pick_device("cuda")
