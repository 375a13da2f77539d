"""The real thing: ``flwr run`` in Ray simulation through the launcher (tools/run.py)."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from common.config import RunConfig
from common.data import DataSpec, class_counts, load_client_data
from common.files import read_rows
from conftest import DATA_DIR, ROOT, make_run_config


def launch(overrides: dict, *args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    items = [f"{k}={json.dumps(v) if isinstance(v, str) else v}" for k, v in overrides.items()]
    cmd = [sys.executable, "-m", "tools.run", *args]
    for item in items:
        cmd += ["-c", item]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_flwr_run_learns_on_real_cifar10(tmp_path):
    # no num-clients (default 0): the run takes every SuperNode of the federation, here 3
    overrides = {
        "num-server-rounds": 3,
        "max-examples-per-client": 800,
        "local-epochs": 3,
        "data-dir": str(DATA_DIR),
        "output-dir": str(tmp_path),
        # two keys of one table: Flower keeps only the last of separate --run-config items of a table
        "fedgh.server-mode": "minibatch",
        "fedgh.server-lr": 0.02,
    }
    proc = launch(overrides, "--num-supernodes", "3")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "finished:completed" in proc.stdout
    (run_dir,) = list(tmp_path.iterdir())
    rows = read_rows(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [r["round"] for r in rows] == [1, 2, 3] and summary["status"] == "completed"
    # no state-dir: the simulated clients kept their state in the run folder, not in the ServerApp process
    assert sorted(p.name for p in (run_dir / "client-state").iterdir()) == ["partition-0", "partition-1", "partition-2"]
    assert summary["config"]["num-clients"] == 0 and summary["num_clients"] == 3
    assert summary["config"]["fedgh.server-mode"] == "minibatch" and summary["config"]["fedgh.server-lr"] == 0.02
    assert all(r["num_clients"] == 3 and len(r["accuracy_per_client"]) == 3 for r in rows)
    assert all(r["bytes_up"] == 3 * 4_008 and r["bytes_down"] == 3 * 20_040 for r in rows)
    # chance for a client = its majority-class share of its local test split
    cfg = RunConfig.from_dict(make_run_config(**overrides))
    spec = DataSpec.from_config(cfg, 3)
    test_labels = [load_client_data(spec, p).test_y for p in range(3)]
    chance = np.mean([class_counts(y, 10).max() / len(y) for y in test_labels])
    assert summary["final_accuracy_mean"] > chance + 0.1, (summary["final_accuracy_mean"], chance)


@pytest.mark.slow
def test_failed_run_exits_non_zero(tmp_path):
    """A run that starts and then fails: no train reply arrives within a round timeout of 1 ms, so the
    only round is untrained (a missing data folder, which this test used before, is now refused
    before the launch, with exit code 2)."""
    proc = launch(
        {
            "num-clients": 2,
            "num-server-rounds": 1,
            "max-examples-per-client": 60,
            "data-dir": str(DATA_DIR),
            "output-dir": str(tmp_path / "out"),
            "round-timeout": 0.001,
        }
    )
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "finished:failed" in proc.stdout
    summary = json.loads(next(Path(tmp_path / "out").glob("*/summary.json")).read_text())
    assert summary["status"] == "failed"


def test_waiting_for_a_run_streams_its_log_and_asks_the_status_after(monkeypatch):
    from tools import control as controls

    calls, statuses = [], iter(["running", "finished:completed"])

    class Control:
        def stream(self, run_id, timeout=None):
            calls.append(("log", run_id))

        def status(self, run_id):
            calls.append(("list", run_id))
            return next(statuses)

    monkeypatch.setattr(controls.time, "sleep", lambda s: None)
    # the stream ended while the run was still running: it is opened again
    assert controls.wait_finished(Control(), 7, 60) == "finished:completed"
    assert calls == [("log", 7), ("list", 7), ("log", 7), ("list", 7)]

    class Endless(Control):
        def stream(self, run_id, timeout=None):
            raise TimeoutError(f"the log stream of run {run_id} was still open after {timeout:.0f} s")

    with pytest.raises(TimeoutError, match="waiting for run 7"):
        controls.wait_finished(Endless(), 7, 1)
