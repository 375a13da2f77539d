"""GPUs that share fairly (common.gpu), with CUDA replaced by fakes: this machine and CI have no GPU.

The real check runs on a GPU machine (a loopback deployment with device='cuda'; the simulation
with --gpus-per-client where Ray is installed): see docs/running.md for what ran on an H100.
"""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch

from common import gpu
from common.config import ConfigError
from conftest import federation

CUDA = torch.device("cuda", 0)


def fake_ray(granted: dict[str, float]) -> types.ModuleType:
    """A stand-in for an imported, initialised Ray whose actor was granted ``granted``."""
    context = types.SimpleNamespace(get_assigned_resources=lambda: dict(granted))
    return types.SimpleNamespace(is_initialized=lambda: True, get_runtime_context=lambda: context)


@pytest.mark.parametrize(
    "node, granted, share",
    [
        ({"gpu-memory-fraction": 0.5}, {"GPU": 0.25}, 0.5),  # the node config wins
        ({}, {"GPU": 0.25, "CPU": 1.0}, 0.25),  # a simulation's fractional grant
        ({}, {"GPU": 1.0}, None),  # a whole GPU needs no cap
        ({}, {"CPU": 1.0}, None),
        ({}, None, None),  # no Ray in this process: a deployed ClientApp
    ],
)
def test_the_share_comes_from_the_node_config_or_the_ray_grant(monkeypatch, node, granted, share):
    if granted is None:
        monkeypatch.delitem(sys.modules, "ray", raising=False)
    else:
        monkeypatch.setitem(sys.modules, "ray", fake_ray(granted))
    assert gpu.gpu_share(node) == share


@pytest.mark.parametrize("value", [0, -0.5, 1.5, float("nan"), "half", True])
def test_a_bad_node_share_names_the_key(value):
    with pytest.raises(ConfigError, match="'gpu-memory-fraction'.*> 0 and <= 1"):
        gpu.gpu_share({"gpu-memory-fraction": value})


@pytest.mark.parametrize("device, index", [(torch.device("cuda"), 0), (torch.device("cuda", 1), 1)])
def test_the_allocator_is_capped_once_per_process(monkeypatch, device, index):
    """On the device pick_device gives (plain "cuda") too: PyTorch's own check of the device argument
    (which raises ValueError for a device without an index) runs in the stand-in."""
    from torch.cuda._utils import _get_device_index

    calls = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(
        torch.cuda, "set_per_process_memory_fraction", lambda f, d: calls.append((f, _get_device_index(d)))
    )
    gpu.limit_memory.cache_clear()
    for _ in range(3):
        gpu.limit_memory(device, 0.25)
    assert calls == [(0.25, index)]
    gpu.limit_memory.cache_clear()


def test_a_client_over_its_share_gets_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(total_memory=80 * 2**30))
    error = gpu.share_exceeded(torch.cuda.OutOfMemoryError("Tried to allocate 2 GiB"), 3, CUDA, 0.25)
    assert isinstance(error, gpu.GPUShareExceeded)
    text = str(error)
    assert "partition 3" in text and "its share 0.25 of 81920 MiB" in text and "--gpus-per-client" in text


def test_peak_memory_and_device_name_are_reported_on_a_gpu_only(monkeypatch):
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: 300 * 2**20)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: "Fake H100")
    assert gpu.report(CUDA) == ({"gpu-peak-mib": 300.0}, "Fake H100")
    assert gpu.report(torch.device("cpu")) == ({}, None)


def test_rows_carry_each_gpu_clients_peak_and_device_and_an_oom_drops_only_that_client(run_config, monkeypatch, caplog):
    """Through whole rounds: clients report as if on a GPU (``gpu.report`` faked), partition 1 runs out
    of memory in round 2; its reply is dropped with the clear error, the others go on."""
    from methods.fedgh import FedGHClient

    monkeypatch.setattr(gpu, "report", lambda device: ({"gpu-peak-mib": 123.5}, "Fake H100"))
    train = FedGHClient.train

    def out_of_memory_in_round_2(self, client, payload, config):
        if client.partition_id == 1 and config["server-round"] == 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return train(self, client, payload, config)

    monkeypatch.setattr(FedGHClient, "train", out_of_memory_in_round_2)
    strategy, grid = federation(run_config(**{"num-clients": 3, "num-server-rounds": 2, "max-examples-per-client": 60}))
    with caplog.at_level(logging.WARNING):
        strategy.start(grid)
    first, second = strategy.rows
    assert first["gpu_per_client"] == {str(p): {"device": "Fake H100", "peak_mib": 123.5} for p in range(3)}
    # partition 1's evaluate message (sent since its train reply was dropped) still reports its GPU
    assert second["dropped_clients"] == [1] and set(second["gpu_per_client"]) == {"0", "1", "2"}
    assert "GPUShareExceeded: partition 1 ran out of CUDA memory" in caplog.text


def test_rows_of_cpu_clients_have_no_gpu_key(run_config):
    strategy, grid = federation(run_config(**{"num-clients": 2, "num-server-rounds": 1, "max-examples-per-client": 60}))
    strategy.start(grid)
    assert "gpu_per_client" not in strategy.rows[0]


MALFORMED = [{"name": "x" * 101}, {"name": "a\nb"}, {"name": "H100", "extra": "x"}, {"name": 3}, {"ray-node": 3}, {}]


@pytest.mark.parametrize("record", MALFORMED)
def test_a_malformed_device_record_is_refused(record):
    from flwr.app import ConfigRecord, RecordDict

    from common.payload import PayloadError
    from engine.transport import device_record

    where = {"name": "NVIDIA H100 80GB HBM3", "ray-node": "ab" * 28}
    assert device_record(RecordDict({"device": ConfigRecord(where)})) == where
    assert device_record(RecordDict({})) == {}
    with pytest.raises(PayloadError, match="record 'device'"):
        device_record(RecordDict({"device": ConfigRecord(record)}))


def test_a_reply_with_a_malformed_device_record_is_dropped(run_config):
    from flwr.app import ConfigRecord, RecordDict
    from test_hostile import ATTACKER, attacker

    def attack(reply):
        content = reply.content
        reply.content = RecordDict(
            {**dict(content.array_records), **dict(content.metric_records), "device": ConfigRecord(MALFORMED[0])}
        )
        return reply

    rc = run_config(**{"num-clients": 3, "num-server-rounds": 1, "max-examples-per-client": 60})
    strategy, grid = federation(rc, attacker("train", attack))
    strategy.start(grid)
    assert strategy.rows[0]["dropped_clients"] == [ATTACKER - 1000] and "gpu_per_client" not in strategy.rows[0]
