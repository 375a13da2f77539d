"""bench.mhpfedhn_authors: their step lines parse into rows, the run config maps to their flags (the old
wrapper's flag set) or is refused naming the key, a reference that is no checkout of theirs or lies
inside this repository is refused, and the bootstrap feeds a script our partitions and records every
step (a fake tree: no run of their real script)."""

from __future__ import annotations

import dataclasses
import json
import re
import textwrap
from pathlib import Path

import numpy as np
import pytest

import bench.mhpfedhn_authors as authors
from bench.measure import Measured
from common.errors import ConfigError
from tools.runconfig import ROOT, read_config

PRESET = "presets/mh-pfedhn-table7-cifar10.toml"
OLD_WRAPPER = ROOT / "results" / "crosscheck" / "{}-table7" / "seed-0" / "authors.json"
CHECKOUT = Path("/work/refs/DangDang1895+MH-pFL")


def config(*items: str) -> dict:
    return read_config(PRESET, ["partition-seed=0 num-server-rounds=20", *items])[0]


def test_parse_steps_reads_every_printed_step_and_skips_noise():
    text = (
        "0 \t {3: 2812, 9: 2813}\n"
        "  0%|          | 0/3 [00:00<?, ?it/s]Step: 1, AVG Loss: 1.9900,  AVG Acc: 0.1185\n"
        " 33%|###3      | 1/3 [00:28<00:57, 28.85s/it]\x1b[2K\rStep: 2, AVG Loss: 1.9071,  AVG Acc: 0.1906\n"
        "Step: 3, AVG Loss: nan,  AVG Acc: 0.1000\n"
        "Step: 4, AVG Loss: 1.5000,  AVG Acc: 0.21"  # cut off mid-number by an interrupted run: not a step
    )
    rows = authors.parse_steps(text)
    assert rows == [
        {"round": 1, "loss": 1.99, "accuracy": 0.1185},
        {"round": 2, "loss": 1.9071, "accuracy": 0.1906},
        {"round": 3, "loss": pytest.approx(float("nan"), nan_ok=True), "accuracy": 0.1},
    ]


@pytest.mark.parametrize("method", ["mh-pfedhn", "mh-pfedhngd"])
def test_their_argv_is_the_old_wrappers_flag_set(method, tmp_path):
    old = json.loads(Path(str(OLD_WRAPPER).format(method)).read_text())
    script = {v: k for k, v in authors.SCRIPTS.items()}[method]
    argv = authors.their_argv(config(f"method='{method}'"), script, 0, tmp_path)

    def pairs(flags: list[str]) -> dict[str, str | float]:
        parsed = dict(zip(flags[::2], flags[1::2], strict=True))
        parsed.pop("--save-dir")  # where each run writes; the old one's folder is gone
        return {
            k: float(v) if v.replace(".", "").replace("e-", "").lstrip("-").isdigit() else v for k, v in parsed.items()
        }

    assert pairs(argv) == pairs(old["their_argv"])
    assert argv[argv.index("--save-dir") + 1] == str(tmp_path)


def test_their_argv_follows_the_run_config():
    argv = authors.their_argv(
        config("seed=7 lr=0.01 batch-size=32 num-clients=4 mh-pfedhn.server-lr=0.001 mh-pfedhn.chunk-size=1000"),
        "MH-pFedHN",
        3,
        Path("out"),
    )
    flags = dict(zip(argv[::2], argv[1::2], strict=True))
    assert flags["--inner-lr"] == "0.01" and flags["--batch-size"] == "32" and flags["--num-nodes"] == "4"
    assert flags["--lr"] == "0.001" and flags["--hnet-output-size"] == "1000"
    assert flags["--seed"] == "3"  # the training seed given, not the config's
    assert "--alpha" not in flags


@pytest.mark.parametrize(
    ("items", "script", "named"),
    [
        (("momentum=0.5",), "MH-pFedHN", "momentum = 0.5"),
        (("clip-norm=10.0",), "MH-pFedHN", "clip-norm = 10.0"),
        (("mh-pfedhn.schedule='parallel'",), "MH-pFedHN", "mh-pfedhn.schedule"),
        (("mh-pfedhn.server-clip-norm=2.5",), "MH-pFedHN", "a whole number"),
        (("method='mh-pfedhngd' mh-pfedhngd.kd-temperature=2.5",), "MH-pFedHNGD", "mh-pfedhngd.kd-temperature"),
        ((), "MH-pFedHNGD", "method = 'mh-pfedhn'"),
    ],
)
def test_a_setting_their_script_hard_codes_otherwise_is_refused(items, script, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        authors.their_argv(config(*items), script, 0, Path("out"))


def fake_checkout(folder: Path, script: str = "") -> Path:
    """A tree with their file names: ``dataset.get_classes``, ``display.ExperimentLogger``,
    ``utils.set_seed`` as theirs are named, and ``MH-pFedHN.py`` = ``script``."""
    (folder / "config").mkdir(parents=True)
    (folder / "config" / "All_Layers.json").write_text("{}")
    (folder / "MH-pFedHNGD.py").write_text("")
    (folder / "dataset.py").write_text(
        "import torchvision.transforms as transforms\n"
        "def get_classes(data_name, dataroot, num_clients, batch_size, num_classes_per_client, seed):\n"
        "    if data_name =='cifar10':\n"
        "        normalization = transforms.Normalize((0.5, 0.25, 0.125), (0.2, 0.3, 0.4))\n"
        "    raise RuntimeError('the real loader ran')\n"
    )
    (folder / "display.py").write_text(
        "class ExperimentLogger:\n"
        "    def log(self, values):\n"
        "        self.__dict__.setdefault('logged', []).append(values)\n"
    )
    (folder / "utils.py").write_text(
        "import random, torch\nSEEDS = []\n"
        "def set_seed(seed=42):\n    SEEDS.append(seed)\n    random.seed(seed)\n    torch.manual_seed(seed)\n"
    )
    (folder / "MH-pFedHN.py").write_text(textwrap.dedent(script))
    return folder


def test_a_reference_that_is_no_checkout_of_theirs_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="no MH-pFedHN.py"):
        authors.check_reference(tmp_path)
    tree = fake_checkout(tmp_path / "tree")
    (tree / "dataset.py").write_text("def dirichlet_distribution(): pass\n")
    with pytest.raises(ConfigError, match="get_classes"):
        authors.check_reference(tree)


def test_a_reference_inside_this_repository_is_refused(tmp_path, monkeypatch):
    tree = fake_checkout(tmp_path / "repo" / "refs" / "MH-pFL")
    assert authors.check_reference(tree) == tree.resolve()
    monkeypatch.setattr(authors, "ROOT", (tmp_path / "repo").resolve())
    with pytest.raises(ConfigError, match="inside this repository"):
        authors.check_reference(tree)
    with pytest.raises(ConfigError, match="inside this repository"):
        authors.check_reference(tmp_path / "repo")


def test_their_normalization_is_read_from_their_get_classes(tmp_path):
    tree = fake_checkout(tmp_path / "tree")
    assert authors.their_normalization(tree, "cifar10") == ((0.5, 0.25, 0.125), (0.2, 0.3, 0.4))
    with pytest.raises(ConfigError, match="cifar100"):
        authors.their_normalization(tree, "cifar100")
    if CHECKOUT.is_dir():
        from common.datasets import DATASETS, with_recipe

        ours = with_recipe(DATASETS["cifar10"], "none", "dataset")  # the preset's normalize = "dataset"
        assert authors.their_normalization(CHECKOUT, "cifar10") == (tuple(ours.mean), tuple(ours.std))


#: stands in for their script: loads through dataset.get_classes, "trains" nothing, evaluates a fixed
#: rule (predict label 1) per client, prints and logs each step as theirs do
FAKE_SCRIPT = """
import argparse, random, torch
import utils
from dataset import get_classes
from display import ExperimentLogger
parser = argparse.ArgumentParser()
for flag in ("--num-nodes", "--batch-size", "--num-steps", "--seed"):
    parser.add_argument(flag, type=int)
args, _ = parser.parse_known_args()
utils.set_seed(args.seed)
train, test, data_len = get_classes("cifar10", "x", args.num_nodes, args.batch_size, 2, args.seed)
assert utils.SEEDS == [args.seed, args.seed] and torch.get_num_threads() == 1
stats = ExperimentLogger()
for step in range(args.num_steps):
    correct = [sum(int((y == 1).sum()) for _, y in loader) for loader in test]
    total = [sum(len(y) for _, y in loader) for loader in test]
    batches = [len(list(loader)) for loader in train]
    acc, loss = [c / n for c, n in zip(correct, total)], [float(b) for b in batches]
    print(f"Step: {step+1}, AVG Loss: {sum(loss) / len(loss):.4f},  AVG Acc: {sum(correct) / sum(total):.4f}")
    stats.log({"rounds": step, "client_acc": acc, "client_loss": loss})
"""


def write_fake_partitions(folder: Path, labels: dict[str, list[list[int]]]) -> None:
    for split, per_client in labels.items():
        (folder / split).mkdir(parents=True)
        for i, y in enumerate(per_client):
            x = np.full((len(y), 3, 32, 32), float(i), dtype=np.float32)
            np.savez_compressed(folder / split / f"{i}.npz", data={"x": x, "y": np.asarray(y, dtype=np.int64)})
    (folder / "config.json").write_text(json.dumps({"content_digest": "fake"}))


@dataclasses.dataclass
class AuthorsRun:
    """:func:`authors_run`'s run: its tree, config, partitions, output folder and result, and the rows
    file and log as the run left them."""

    tree: Path
    config: dict
    partitions: Path
    out: Path
    result: dict
    rows: str
    log: str


@pytest.fixture(scope="module")
def authors_run(tmp_path_factory) -> AuthorsRun:
    """One run of :data:`FAKE_SCRIPT` through the bootstrap for training seed 5: 2 clients (train labels
    0 0 0 0 0 and 1 1 1, test labels 1 1 0 and 1 0 0 0 0 0 0), 3 rounds, batches of 2 (it starts
    PyTorch: seconds; the tests share it)."""
    tmp = tmp_path_factory.mktemp("authors")
    tree = fake_checkout(tmp / "tree", FAKE_SCRIPT)
    partitions = tmp / "partitions"
    write_fake_partitions(partitions, {"train": [[0] * 5, [1] * 3], "test": [[1, 1, 0], [1, 0, 0, 0, 0, 0, 0]]})
    cfg = config("num-clients=2 num-server-rounds=3 batch-size=2")
    out = tmp / "seed-5"
    result = authors.run_authors(tree, cfg, "MH-pFedHN", 5, partitions, out)
    rows, log = (out / "authors.rounds.jsonl").read_text(), (out / "authors.log").read_text()
    return AuthorsRun(tree, cfg, partitions, out, result, rows, log)


def test_run_authors_feeds_our_partitions_and_records_every_step(authors_run):
    result = authors_run.result
    # client 0: 2 of 3 test labels are 1, client 1: 1 of 7; train batches of 2: 3 and 2
    assert result["curve"] == [3 / 10] * 3
    assert result["accuracy_mean"] == [pytest.approx((2 / 3 + 1 / 7) / 2)] * 3
    assert result["loss"] == [2.5] * 3
    assert result["accuracy_per_client"][0] == [2 / 3, 1 / 7]
    assert result["test_examples"] == [3, 7]
    assert result["their_argv"][result["their_argv"].index("--seed") + 1] == "5"
    assert [p["round"] for p in result["printed_steps"]] == [1, 2, 3]
    assert len(result["round_cpu_seconds"]) == 3 and all(s >= 0 for s in result["round_wall_seconds"])
    assert [json.loads(r)["round"] for r in authors_run.rows.splitlines()] == [1, 2, 3]
    # kept: the same flags and partitions are not run again
    (authors_run.out / "authors.rounds.jsonl").unlink()
    again = authors.run_authors(
        authors_run.tree, authors_run.config, "MH-pFedHN", 5, authors_run.partitions, authors_run.out
    )
    assert again == result


def test_run_authors_refuses_a_run_whose_printed_accuracy_is_not_the_recorded_one(authors_run, tmp_path, monkeypatch):
    """A script that prints 0.9000 where it logs :func:`authors_run`'s accuracies: its run is that one's
    rows and log with the printed accuracy replaced (replayed as ``run_measured``: no second run)."""
    lying = FAKE_SCRIPT.replace("AVG Acc: {sum(correct) / sum(total):.4f}", "AVG Acc: 0.9000")
    tree = fake_checkout(tmp_path / "tree", lying)
    printed = re.sub(r"AVG Acc: [0-9.]+", "AVG Acc: 0.9000", authors_run.log)
    assert printed != authors_run.log

    def replay(cmd, cwd, log, env=None):
        Path(env[authors.ROWS_VARIABLE]).write_text(authors_run.rows)
        log.write_text(printed)
        return Measured(0, 1.0, 1.0, 0, {})

    monkeypatch.setattr(authors, "run_measured", replay)
    with pytest.raises(RuntimeError, match="printed vs recorded"):
        authors.run_authors(tree, authors_run.config, "MH-pFedHN", 5, authors_run.partitions, tmp_path / "o")
