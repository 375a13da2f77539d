"""bench.fedre_authors: the bootstrap restores exactly one evaluate call, records every evaluation and
gives every seeding call the training seed; a tree without the anchor is refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from bench.fedre_authors import (
    BOOTSTRAP,
    EVALUATE_ANCHOR,
    RESTORE_VARIABLE,
    ROUNDS_VARIABLE,
    SEED_VARIABLE,
    authors_command,
    finished_run,
    main,
)

SERVERBASE = """
class Server:
    def __init__(self):
        self.rs_test_acc = []
    def test_metrics(self):
        # ids, test samples, correct predictions (PFLlib's order)
        return [0, 1], [4, 6], [1, 3]
    def evaluate(self):
        ids, samples, correct = self.test_metrics()
        self.rs_test_acc.append(sum(correct) / sum(samples))
"""

SERVERRE = """
import random, numpy, torch
from flcore.servers.serverbase import Server
class FedRE(Server):
    def train(self, rounds):
        torch.manual_seed(2)
        numpy.random.seed(2)
        random.seed(2)
        print("draws", torch.rand(1).item(), numpy.random.rand(), random.random())
        for i in range(rounds + 1):
            if True:
                print("\\nEvaluate personalized models")
"""

MAIN = """
from flcore.servers.serverre import FedRE
FedRE().train(2)
"""


def fake_tree(root: Path, serverre: str = SERVERRE) -> Path:
    """A tree with the FedRE PFLlib tree's layout: system/main.py and flcore/servers/."""
    servers = root / "system" / "flcore" / "servers"
    servers.mkdir(parents=True)
    for package in (servers.parent, servers):
        (package / "__init__.py").write_text("")
    (servers / "serverbase.py").write_text(textwrap.dedent(SERVERBASE))
    (servers / "serverre.py").write_text(textwrap.dedent(serverre))
    (root / "system" / "main.py").write_text(textwrap.dedent(MAIN))
    return root / "system"


def bootstrap(system: Path, rounds_file: Path, seed: int) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        SEED_VARIABLE: str(seed),
        ROUNDS_VARIABLE: str(rounds_file),
        RESTORE_VARIABLE: EVALUATE_ANCHOR,
    }
    return subprocess.run(
        [sys.executable, "-c", BOOTSTRAP, "main.py"], cwd=system, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module")
def seeded(tmp_path_factory) -> dict[int, tuple[Path, Path, subprocess.CompletedProcess]]:
    """The bootstrap on a fake tree (:func:`fake_tree`) for training seeds 0 and 7: per seed its
    ``system`` folder, rows file and finished process (each run starts PyTorch: seconds; the tests
    share them)."""
    tmp = tmp_path_factory.mktemp("seeded")
    runs = {}
    for seed in (0, 7):
        system = fake_tree(tmp / f"tree{seed}")
        rows_file = tmp / f"rounds{seed}.jsonl"
        runs[seed] = (system, rows_file, bootstrap(system, rows_file, seed))
    return runs


def test_restored_evaluate_is_called_once_per_iteration_and_recorded(seeded):
    system, rows_file, done = seeded[7]
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()]
    # train(2) iterates 3 times: one evaluation each, rounds 0, 1, 2
    assert [r["round"] for r in rows] == [0, 1, 2]
    assert rows[0]["accuracy_weighted"] == pytest.approx(0.4)
    assert rows[0]["accuracy_per_client"] == pytest.approx([0.25, 0.5])
    assert rows[0]["test_examples"] == [4, 6]
    # the tree's own file is untouched: the call exists only in the compiled copy
    assert "self.evaluate()" not in (system / "flcore" / "servers" / "serverre.py").read_text()


def test_every_seeding_call_gets_the_training_seed(seeded):
    draws = {}
    for seed, (_, _, done) in seeded.items():
        assert done.returncode == 0, done.stderr
        draws[seed] = next(line for line in done.stdout.splitlines() if line.startswith("draws"))
    import random

    import numpy
    import torch

    torch.manual_seed(7)
    numpy.random.seed(7)
    random.seed(7)
    # the tree asked for seed 2 everywhere; it got 7
    assert draws[7] == f"draws {torch.rand(1).item()} {numpy.random.rand()} {random.random()}"
    assert draws[0] != draws[7]


def test_a_tree_without_the_anchor_is_refused(tmp_path):
    system = fake_tree(tmp_path / "tree", SERVERRE.replace("Evaluate personalized models", "Evaluate"))
    done = bootstrap(system, tmp_path / "rounds.jsonl", seed=0)
    assert done.returncode != 0
    assert "expected 1" in done.stderr
    assert not (tmp_path / "rounds.jsonl").exists()


def test_flags_follow_the_run_config():
    config = {
        "num-server-rounds": 100,
        "num-clients": 10,
        "fraction-train": 1.0,
        "batch-size": 32,
        "lr": 0.007,
        "local-epochs": 1,
        "fedre.server-batch-size": 10,
    }
    fedre = authors_command(config, "fedre", "Cifar10-x")
    local = authors_command(config, "local", "Cifar10-x")
    flags = lambda cmd: dict(zip(cmd[1::2], cmd[2::2]))  # noqa: E731
    assert flags(fedre)["-algo"] == "FedRE" and flags(local)["-algo"] == "Local"
    for cmd in (fedre, local):
        f = flags(cmd)
        assert (f["-gr"], f["-nc"], f["-lbs"], f["-lr"], f["-ls"], f["-dev"]) == (
            "100",
            "10",
            "32",
            "0.007",
            "1",
            "cpu",
        )
    assert flags(fedre)["-sbs"] == "10"


def test_a_finished_run_is_found_only_for_the_same_flags_and_partitions(tmp_path):
    config = {
        "num-server-rounds": 3,
        "num-clients": 2,
        "fraction-train": 1.0,
        "batch-size": 10,
        "lr": 0.01,
        "local-epochs": 1,
        "fedre.server-batch-size": 10,
    }
    partitions = tmp_path / "partitions"
    partitions.mkdir()
    (partitions / "config.json").write_text(json.dumps({"content_digest": "ab" * 32}))
    name = "Cifar10-mheterofl-" + "ab" * 6
    saved = {"curve": [0.1, 0.2, 0.3], "command": authors_command(config, "local", name), "content_digest": "ab" * 32}
    (tmp_path / "local-seed-1.json").write_text(json.dumps(saved))
    assert finished_run(config, "local", 1, partitions, tmp_path) == saved
    # another seed, another side, other flags, other partitions: none
    assert finished_run(config, "local", 2, partitions, tmp_path) is None
    assert finished_run(config, "fedre", 1, partitions, tmp_path) is None
    assert finished_run({**config, "lr": 0.02}, "local", 1, partitions, tmp_path) is None
    (partitions / "config.json").write_text(json.dumps({"content_digest": "cd" * 32}))
    assert finished_run(config, "local", 1, partitions, tmp_path) is None


def test_sides_other_than_fedre_and_local_are_refused(tmp_path, capsys):
    for system in (tmp_path / "fedre" / "PFLlib" / "system", tmp_path / "pfllib" / "system"):
        system.mkdir(parents=True)
        (system / "main.py").write_text("")
    code = main(["--fedre", str(tmp_path / "fedre"), "--pfllib", str(tmp_path / "pfllib"), "--sides", "fedre,fedavg"])
    assert code == 2
    assert "--sides: 'fedre,fedavg'; allowed: fedre, local" in capsys.readouterr().out


def test_report_gives_each_side_final_best_and_paired_gaps(tmp_path):
    from bench.fedre_authors import FEDRE_LABEL, LOCAL_LABEL, write_report

    sides = {
        FEDRE_LABEL: {0: [0.5, 0.8, 0.7], 1: [0.6, 0.7, 0.75]},
        LOCAL_LABEL: {0: [0.6, 0.9, 0.85], 1: [0.6, 0.8, 0.8]},
        "ours": {0: [0.5, 0.6, 0.72]},
    }
    info = {"command": "c", "commit": "x", "fedre_commit": "y", "pfllib_commit": "z", "preset": "p.toml"}
    write_report(
        tmp_path, {**info, "partition_seed": 0, "rounds": 3, "seeds": [0, 1], "test_examples": 200, "times": []}, sides
    )
    rows: dict[str, str] = {}  # label -> its line of the first table
    for line in (tmp_path / "report.md").read_text().splitlines():
        rows.setdefault(line.split(" | ")[0].lstrip("| "), line)
    # FedRE: final 72.50 ± 3.54 (70, 75), best 77.50 ± 3.54 (80, 75); against Local: final -15, -5; best -10, -5
    assert "| 72.50 ± 3.54 | 77.50 ± 3.54 | +0.00 ± 0.00 (n=2) | -10.00 ± 7.07 (n=2) |" in rows[FEDRE_LABEL]
    assert rows[FEDRE_LABEL].endswith("| +0.00 ± 0.00 (n=2) | -7.50 ± 3.54 (n=2) |")
    # one seed: no spread; ours seed 0 against FedRE: final +2, best -8; against Local: -13, -18
    assert rows["ours"].endswith(
        "| 72.00 ± 0.00 | 72.00 ± 0.00 | +2.00 (n=1) | -13.00 (n=1) | -8.00 (n=1) | -18.00 (n=1) |"
    )
    assert "| ours | 72.00 / 72.00 | - |" in (tmp_path / "report.md").read_text()
