"""Simulation on an existing Ray cluster (``tools.run --ray-address``): placement recorded per round,
the cluster checked before anything starts, and a real two-node cluster on loopback.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import psutil
import pytest

from common.errors import ConfigError
from common.files import read_rows
from conftest import DATA_DIR, ROOT, federation
from tools import processes, ray_cluster

RAY = str(Path(sys.executable).with_name("ray"))


def test_rows_count_the_replies_of_each_ray_node(run_config, monkeypatch):
    """In a Ray actor every reply names its Ray node; the row counts the round's valid replies per node."""
    node = "ab" * 28
    context = types.SimpleNamespace(get_assigned_resources=lambda: {"CPU": 1.0}, get_node_id=lambda: node)
    monkeypatch.setitem(
        sys.modules, "ray", types.SimpleNamespace(is_initialized=lambda: True, get_runtime_context=lambda: context)
    )
    strategy, grid = federation(run_config(**{"num-clients": 3, "num-server-rounds": 2, "max-examples-per-client": 60}))
    strategy.start(grid)
    replies_per_round = 3 if strategy.method.eval_after_training else 6  # train (+ evaluate) replies of 3 clients
    assert [r["replies_per_ray_node"] for r in strategy.rows] == [{node: replies_per_round}] * 2


def test_rows_outside_ray_have_no_placement(run_config):
    strategy, grid = federation(run_config(**{"num-clients": 2, "num-server-rounds": 1, "max-examples-per-client": 60}))
    strategy.start(grid)
    assert "replies_per_ray_node" not in strategy.rows[0]


@pytest.mark.parametrize(
    "resources, cpus, gpus, fits",
    [
        ({"CPU": 4.0}, 1, 0.0, 4),
        ({"CPU": 4.0}, 3, 0.0, 1),
        ({"CPU": 0.0, "memory": 1e9}, 1, 0.0, 0),  # a head started with --num-cpus=0
        ({"CPU": 8.0, "GPU": 1.0}, 1, 0.25, 4),
        ({"CPU": 8.0}, 1, 0.25, 0),  # a node without the GPU asked for fits none (Flower's rule)
    ],
)
def test_client_slots_per_node(resources, cpus, gpus, fits):
    assert ray_cluster.client_slots(resources, cpus, gpus) == fits


def test_an_address_where_nothing_listens_fails_fast_naming_the_option():
    port = processes.free_port()  # bound and released: nothing listens there
    began = time.monotonic()
    with pytest.raises(ConfigError, match=rf"--ray-address 127.0.0.1:{port}: no Ray cluster answers there"):
        ray_cluster.check_ray_cluster(f"127.0.0.1:{port}", 1, None)
    with pytest.raises(ConfigError, match="expected HOST:PORT"):
        ray_cluster.check_ray_cluster("nowhere", 1, None)
    assert time.monotonic() - began < 20


@contextlib.contextmanager
def ray_node(temp_dir: str, *args: str):
    """One Ray node (``ray start --block``), stopped afterwards by PID: SIGTERM to ``ray start``, which
    shuts its node down, then a kill of whatever of its process tree is left."""
    proc = subprocess.Popen(
        [RAY, "start", "--block", "--disable-usage-stats", "--temp-dir", temp_dir, *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        yield proc
    finally:
        with contextlib.suppress(psutil.Error):
            tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
            proc.send_signal(signal.SIGTERM)
            psutil.wait_procs(tree, timeout=20)
            processes.kill_all(tree)


def wait_nodes(address: str, count: int, timeout: float = 90) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        error, nodes = ray_cluster.cluster_nodes(address)
        if not error and len(nodes) == count:
            return nodes
        time.sleep(1)
    raise TimeoutError(f"the cluster at {address} did not show {count} nodes within {timeout} s")


def launch(address: str, out: Path) -> subprocess.CompletedProcess:
    config = (
        f"method='fedgh' dataset='mnist' model-group='cnn1' num-clients=3 num-server-rounds=2 "
        f"max-examples-per-client=60 data-dir='{DATA_DIR}' output-dir='{out}'"
    )
    cmd = [sys.executable, "-m", "tools.run", "--ray-address", address, "-c", config]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400)


@pytest.mark.slow
def test_a_simulation_on_a_two_node_loopback_cluster_runs_every_clientapp_on_the_worker(tmp_path):
    """A head node with no CPUs for ClientApps, then a worker node with 2: before the worker joins,
    tools.run refuses the cluster (no node fits a ClientApp); after, the run completes and every
    reply of every round came from a ClientApp on the worker node."""
    port = processes.free_port()
    address = f"127.0.0.1:{port}"
    # a short folder: Ray's unix sockets live under it (107 characters at most); and not /tmp/ray, so
    # that no other simulation on this host joins this cluster through Ray's address file
    with tempfile.TemporaryDirectory(prefix="ray-") as temp_dir:
        head_args = ["--head", "--port", str(port), "--num-cpus", "0", "--include-dashboard", "false"]
        with ray_node(temp_dir, *head_args, "--dashboard-agent-listen-port", str(processes.free_port())):
            (head,) = wait_nodes(address, 1)
            refused = launch(address, tmp_path / "refused")
            assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
            assert "no alive node of the cluster can host a ClientApp of 1 CPUs" in refused.stdout
            assert not (tmp_path / "refused").exists()  # nothing started
            worker_args = ["--address", address, "--num-cpus", "2"]
            with ray_node(temp_dir, *worker_args, "--dashboard-agent-listen-port", str(processes.free_port())):
                worker = next(n for n in wait_nodes(address, 2) if n["id"] != head["id"])
                assert worker["resources"]["CPU"] == 2 and head["resources"].get("CPU", 0) == 0
                proc = launch(address, tmp_path / "out")
                assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = list((tmp_path / "out").iterdir())
    rows = read_rows(run_dir)
    assert [r["round"] for r in rows] == [1, 2]
    # 3 clients trained (and were evaluated) each round, all in ClientApps on the worker node
    assert all(set(r["replies_per_ray_node"]) == {worker["id"]} for r in rows)
    assert all(r["replies_per_ray_node"][worker["id"]] >= r["num_clients"] == 3 for r in rows)
