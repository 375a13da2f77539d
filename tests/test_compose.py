"""The docker compose demo (tools/compose_demo.py): its checks in-process, and the demo itself end to end.

The end-to-end test builds and starts the whole stack (minutes), so it runs only with
``MHFL_COMPOSE_TEST=1``, a Docker engine that answers and the flwr/* images present
(docker/setup-host.sh makes all three on a Debian machine; see docs/compose.md).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import DATA_DIR, ROOT, federation, make_run_config
from tools.compose_demo import NUM_NODES, check_rows, demo_run_config, fedgh_payload_bytes, locked_flwr


def test_payload_bytes_equal_what_a_fedgh_round_records(tmp_path):
    """The byte counts the demo expects, computed from partition labels alone, equal the strategy's
    own accounting of a real FedGH round, also when clients hold different numbers of classes."""
    rc = make_run_config(
        **{
            "method": "fedgh",
            "num-clients": 4,
            "num-server-rounds": 1,
            "partitioner": "dirichlet",
            "dirichlet-alpha": 0.1,
            "output-dir": str(tmp_path),
        }
    )
    down, up = fedgh_payload_bytes(rc, str(DATA_DIR))
    strategy, grid = federation(rc)
    strategy.start(grid)
    (row,) = strategy.rows
    assert (row["bytes_down"], row["bytes_up"]) == (down, up)
    assert up % (4 * 501) == 0 and up // (4 * 501) not in (0, 4 * 10)  # some clients miss some classes
    # the demo's own job: pathological partitions, 2 classes per client
    assert fedgh_payload_bytes(demo_run_config(2), str(DATA_DIR)) == (3 * 20_040, 3 * 4_008)


def test_checks_flag_missing_rounds_clients_and_bytes():
    row = {"round": 1, "num_clients": NUM_NODES, "dropped_clients": [], "bytes_down": 30, "bytes_up": 12}
    assert check_rows([row, {**row, "round": 2}], {"status": "completed"}, 2, 30, 12) == []
    problems = check_rows(
        [row, {**row, "round": 2, "num_clients": 2, "dropped_clients": [1], "bytes_up": 8}],
        {"status": "failed"},
        3,
        30,
        12,
    )
    assert len(problems) == 4 and "status 'failed'" in problems[0] and "expected 1..3" in problems[1]
    assert "dropped [1]" in problems[2] and "8, expected 30/12" in problems[3]


def _skip_reason() -> str | None:
    if os.environ.get("MHFL_COMPOSE_TEST") != "1":
        return "the compose demo takes minutes: set MHFL_COMPOSE_TEST=1 to run it"
    if shutil.which("docker") is None or subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        return "no Docker engine answers: docker/setup-host.sh once, then docker/dockerd.sh start (as root)"
    for image in (f"flwr/{tool}:{locked_flwr()}" for tool in ("superlink", "supernode", "superexec")):
        if subprocess.run(["docker", "image", "inspect", image], capture_output=True).returncode:
            return f"image {image} missing: docker pull it, or docker/local-images.sh"
    return None


SKIP = _skip_reason()


@pytest.mark.skipif(SKIP is not None, reason=str(SKIP))
def test_compose_demo_end_to_end():
    proc = subprocess.run(
        [sys.executable, "-m", "tools.compose_demo", "--rounds", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "checks passed: 2 rounds completed, 3 clients each, payload bytes exact" in proc.stdout
    assert re.search(r"build_s=[\d.]+ startup_s=[\d.]+ round_s=[\d.]+", proc.stdout)
    assert "stack removed" in proc.stdout
    left = subprocess.run(
        ["docker", "ps", "-a", "-q", "--filter", "label=com.docker.compose.project=mheterofl"],
        capture_output=True,
        text=True,
    ).stdout.split()
    volumes = subprocess.run(
        ["docker", "volume", "ls", "-q", "--filter", "label=com.docker.compose.project=mheterofl"],
        capture_output=True,
        text=True,
    ).stdout.split()
    assert left == [] and volumes == []
