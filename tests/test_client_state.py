"""A simulation without ``state-dir`` keeps client state in its run folder (``<run>/client-state``), not
in ``context.state`` (which Flower keeps in the simulation's one process for every client), so a
resumed simulation, whose contexts start empty, continues every client exactly."""

import subprocess
import sys
from pathlib import Path

import pytest

from common.config import RunConfig
from common.run_folder import ResultsWriter
from common.runtime import MODEL_STATE
from methods.registry import build_run


def run(rc: dict, name: str, in_run_folder: bool = True):
    """A run on a fresh fake grid (a new simulation: every context empty), results under ``name``."""
    from client_app.app import app as client_app
    from fakegrid import FakeGrid

    cfg = RunConfig.from_dict(rc)
    strategy = build_run(cfg, ResultsWriter(cfg.output_dir, name, cfg.as_dict()))
    grid = FakeGrid(client_app, rc, cfg.num_clients)
    strategy.start(grid, state_in_run_folder=in_run_folder)  # what the ServerApp passes on Flower's InMemoryGrid
    return strategy, grid


def test_a_resumed_simulation_without_state_dir_equals_the_run_in_one_go(run_config):
    base = run_config(method="fedgh", **{"num-clients": 3, "fraction-train": 0.67, "max-examples-per-client": 60})
    whole, _ = run({**base, "num-server-rounds": 2}, "whole")
    first, grid = run({**base, "num-server-rounds": 1}, "first")
    saved = sorted((first.results.path / "client-state").glob(f"partition-*/{MODEL_STATE}.pt"))
    assert len(saved) == first.rows[0]["num_clients"] == 2  # the clients that trained in round 1
    # the contexts hold the round of each state file only, no model
    assert all(MODEL_STATE not in ctx.state.array_records for ctx in grid.contexts.values())
    resumed = {**base, "num-server-rounds": 2, "resume-from": str(first.results.path)}
    second, _ = run(resumed, "second")
    assert [r["accuracy_per_client"] for r in second.rows] == [r["accuracy_per_client"] for r in whole.rows]
    assert second.rows[-1]["client_state_restores"] > 0
    # control: with the state in context.state, the new simulation's clients restart from their initial models
    control, _ = run({**base, "num-server-rounds": 1}, "control-first", in_run_folder=False)
    lost, _ = run({**resumed, "resume-from": str(control.results.path)}, "control-second", in_run_folder=False)
    assert lost.rows[-1]["accuracy_per_client"] != whole.rows[-1]["accuracy_per_client"]


def test_state_dir_still_wins(run_config, tmp_path):
    rc = run_config(
        **{
            "num-clients": 2,
            "num-server-rounds": 1,
            "max-examples-per-client": 60,
            "state-dir": str(tmp_path / "state"),
        }
    )
    strategy, _ = run(rc, "run")
    assert not (strategy.results.path / "client-state").exists()
    assert (
        tmp_path / "state" / strategy.federation.transport.state_key / "partition-0" / f"{MODEL_STATE}.pt"
    ).is_file()


def test_all_finite_is_exact_also_where_the_sum_overflows():
    import torch

    from common.state_store import all_finite

    assert all_finite(torch.randn(1000))
    for bad in (float("nan"), float("inf"), -float("inf")):
        t = torch.randn(1000)
        t[417] = bad
        assert not all_finite(t)
    # finite entries whose float32 sum overflows to inf: still finite (the exact check decides)
    assert all_finite(torch.tensor([3e38, 3e38], dtype=torch.float32))
    assert not all_finite(torch.tensor([3e38, float("inf")], dtype=torch.float32))
    assert not all_finite(torch.tensor([float("inf"), -float("inf")]))  # the sum is NaN
    assert all_finite(torch.tensor([], dtype=torch.float32))
    assert all_finite(torch.tensor([1, 2, 3]))  # integer tensors hold no NaN


def test_a_record_is_saved_without_crc_and_reads_back_exactly(tmp_path):
    import torch
    from flwr.app import Context, RecordDict

    from common.state_store import StateStore

    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    store = StateStore(context, tmp_path, "", server_round=2, trains=True, partition_id=0)
    saved = torch.nn.Linear(4, 3)
    store.store("model", saved)
    assert torch.serialization.get_crc32_options()  # the process-wide option is back at its default
    loaded = torch.nn.Linear(4, 3)
    assert StateStore(context, tmp_path, "", server_round=3, trains=True, partition_id=0).restore("model", loaded)
    assert torch.equal(loaded.weight, saved.weight) and torch.equal(loaded.bias, saved.bias)


def test_a_module_on_the_meta_device_takes_the_record_and_training_it_leaves_the_record_alone(tmp_path):
    """The restored model's tensors are the loaded ones (no second copy), trainable as before; restored
    from ``context.state`` (no state folder), they are copies: changing them changes no record."""
    import torch
    from flwr.app import Context, RecordDict

    from common.state_store import StateStore

    saved = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    saved[1].running_mean.add_(0.5)
    for folder in (None, tmp_path):
        context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
        StateStore(context, folder, "", server_round=1, trains=True, partition_id=0).store("model", saved)
        with torch.device("meta"):
            skeleton = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
        store = StateStore(context, folder, "", server_round=2, trains=True, partition_id=0)
        assert store.restore("model", skeleton)
        assert not any(t.is_meta for t in skeleton.state_dict().values())
        assert all(torch.equal(a, b) for a, b in zip(skeleton.state_dict().values(), saved.state_dict().values()))
        assert all(p.requires_grad for p in skeleton.parameters())
        with torch.no_grad():
            skeleton[0].weight.add_(1.0)
        again = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
        assert StateStore(context, folder, "", server_round=2, trains=True, partition_id=0).restore("model", again)
        assert torch.equal(again[0].weight, saved[0].weight)  # the record is what was stored
        with torch.device("meta"):
            other = torch.nn.Linear(4, 3)
        assert not StateStore(context, folder, "", server_round=2, trains=True, partition_id=0).restore("x", other)
        assert other.weight.is_meta  # nothing to take: it stays a skeleton


def test_holds_tells_a_new_client_from_one_with_a_record_in_memory_or_on_disk(tmp_path):
    import torch
    from flwr.app import Context, RecordDict

    from common.state_store import StateStore

    def context():
        return Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})

    for folder in (None, tmp_path):
        ctx = context()
        store = StateStore(ctx, folder, "", server_round=1, trains=True, partition_id=0)
        assert not store.holds("model")
        store.store("model", torch.nn.Linear(2, 2))
        assert store.holds("model") and not store.holds("other")
    # a restarted node: an empty context, the file on disk
    assert StateStore(context(), tmp_path, "", server_round=2, trains=True, partition_id=0).holds("model")


def test_a_new_client_builds_its_model_once_and_a_returning_one_restores_it(run_config, monkeypatch):
    import torch

    from conftest import client_runtime
    from models.groups import ModelGroup

    builds = []
    real = ModelGroup.build
    monkeypatch.setattr(ModelGroup, "build", lambda self, *a, **kw: builds.append(1) or real(self, *a, **kw))
    rc = run_config(**{"num-clients": 2})
    client = client_runtime(rc, 1)
    model = client.model
    assert len(builds) == 1  # no meta-device skeleton: there is nothing to restore into it
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    client.save_model()
    again = type(client)(client.context)
    builds.clear()
    restored = again.model
    assert len(builds) == 1  # the skeleton only, filled from the record
    assert all(torch.equal(a, b) for a, b in zip(restored.state_dict().values(), model.state_dict().values()))


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc_trim and /proc (USS)")
def test_the_client_app_returns_freed_memory_after_each_message():
    """What a message freed (here 3,000 tensors of 100 KiB, every 50th kept, so the heap is
    fragmented and cannot shrink from its top) goes back to the operating system at the end of the
    message, in a fresh process: its USS falls by most of the 290 MiB freed."""
    code = (
        "import psutil, torch\n"
        "from client_app.handlers import return_freed_memory\n"
        "xs = [torch.ones(25_600) for _ in range(3000)]\n"
        "kept = xs[::50]; del xs\n"
        "before = psutil.Process().memory_full_info().uss\n"
        "return_freed_memory()\n"
        "print((before - psutil.Process().memory_full_info().uss) // 2**20)\n"
    )
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, check=True)
    assert int(out.stdout) >= 200, out.stdout
