"""bench.crosscheck without HtFLlib: the option mapping covers every option, the partitions are
written in PFLlib's layout with exactly our clients' data, the reference's log is parsed, a recipe
the reference cannot follow is refused, and a stand-in ``system/main.py`` runs through the
bootstrap with its seed mapped."""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from bench import crosscheck
from common.config import RunConfig
from common.data import DataSpec, load_client_data, normalize
from common.datasets import DATASETS, with_recipe
from common.errors import ConfigError
from common.options import option_key
from models.zoo import HTCNN8
from strategies.registry import METHODS
from tools.run import read_config

DATA_DIR = Path(__file__).resolve().parents[2] / "shared" / "data"
PRESET = Path(__file__).resolve().parents[1] / "presets" / "fedtgp-cifar10-htfe2.toml"


def small_config(**overrides) -> dict:
    config, _ = read_config(PRESET, [])
    return {
        **config,
        "num-clients": 3,
        "max-examples-per-client": 40,
        "partition-seed": 0,
        "data-dir": str(DATA_DIR),
        **overrides,
    }


@pytest.mark.parametrize("method", list(crosscheck.REFERENCE_METHODS))
def test_every_option_is_mapped_tied_or_listed_once(method):
    ref = crosscheck.REFERENCE_METHODS[method]
    declared = sorted(option_key(f) for f in dataclasses.fields(METHODS[method].options))
    placed = [*ref.flags.values(), *ref.tied, *ref.unexpressed]
    assert sorted(placed) == declared  # none forgotten, none twice, none invented


def test_partitions_are_our_clients_data_in_pflib_layout(tmp_path):
    config = small_config()
    written = crosscheck.write_partitions(config, tmp_path)
    cfg = RunConfig.from_dict(config)
    spec = DataSpec.from_config(cfg, 3)
    info = with_recipe(DATASETS["cifar10"], cfg.augment, cfg.normalize)
    for i in range(3):
        ours = load_client_data(spec, i)
        for split, x, y in (("train", ours.train_x, ours.train_y), ("test", ours.test_x, ours.test_y)):
            with open(tmp_path / split / f"{i}.npz", "rb") as f:  # as HtFLlib's read_data opens it
                data = np.load(f, allow_pickle=True)["data"].tolist()
            assert data["x"].dtype == np.float32 and data["y"].dtype == np.int64
            np.testing.assert_array_equal(data["x"], normalize(x, info).numpy())
            np.testing.assert_array_equal(data["y"], y.numpy())
        counts = dict(map(tuple, written["Size of samples for labels in clients"][i]))
        assert sum(counts.values()) == len(ours.train_y) + len(ours.test_y)
    assert written["num_clients"] == 3 and written["num_classes"] == 10
    before = (tmp_path / "train" / "0.npz").stat().st_mtime_ns
    crosscheck.write_partitions(config, tmp_path)  # same partitions: kept
    assert (tmp_path / "train" / "0.npz").stat().st_mtime_ns == before


def test_reference_log_is_parsed_per_repetition_and_round():
    log = textwrap.dedent(
        """
        ============= Running time: 0th =============
        -------------Round number: 0-------------
        Averaged Test Accuracy: 0.1000
        Std Test Accuracy: 0.0100
        -------------Round number: 1-------------
        Averaged Test Accuracy: 0.2500
        ============= Running time: 1th =============
        -------------Round number: 0-------------
        Averaged Test Accuracy: 0.0900
        -------------Round number: 1-------------
        """
    )
    assert crosscheck.parse_reference_log(log) == [{0: 0.1, 1: 0.25}, {0: 0.09}]


def test_a_recipe_the_reference_cannot_follow_is_refused():
    crosscheck.check_expressible(small_config(), "fedtgp")
    with pytest.raises(ConfigError, match=r"momentum = 0\.9.*fedtgp\.server-lr = 0\.1 \(HtFLlib uses lr = 0\.01\)"):
        crosscheck.check_expressible(small_config(**{"momentum": 0.9, "fedtgp.server-lr": 0.1}), "fedtgp")
    with pytest.raises(ConfigError, match="model-group"):
        crosscheck.check_expressible(small_config(**{"model-group": "cnn1"}), "fedgh")
    with pytest.raises(ConfigError, match="no HtFLlib counterpart"):
        crosscheck.check_expressible(small_config(), "fedre")
    # FML's client in HtFLlib clips each model's gradient norm at 10: that is its recipe, not ours
    with pytest.raises(ConfigError, match=r"clip-norm = 0\.0 \(HtFLlib: 10\.0\)"):
        crosscheck.check_expressible(small_config(), "fml")
    crosscheck.check_expressible(small_config(**{"clip-norm": 10.0}), "fml")
    with pytest.raises(ConfigError, match=r"clip-norm = 10\.0 \(HtFLlib: 0\.0\)"):
        crosscheck.check_expressible(small_config(**{"clip-norm": 10.0}), "fedgh")


def test_the_reference_gets_our_option_values_as_the_run_config_has_them():
    config, _ = read_config(PRESET, ["fedtgp.lambda=1.0 fedtgp.server-epochs=7"])  # flat keys, as tools.run reads
    cmd = " ".join(crosscheck.reference_command({**config, "num-server-rounds": 2}, "fedtgp", "d"))
    assert "-lam 1.0" in cmd and "-se 7" in cmd and "-mart 100.0" in cmd  # overrides, then the preset's value
    assert crosscheck.method_options(config, "fedgh")["server-epochs"] == 1  # another method's: its default


def test_compare_gives_spread_and_largest_gap():
    c = crosscheck.compare([[0.1, 0.5], [0.3, 0.3]], [[0.2, 0.2], [0.2, 0.2]])
    assert c["ours"]["final_mean"] == pytest.approx(0.4) and c["ours"]["final_std"] == pytest.approx(0.1)
    assert c["ours"]["best_mean"] == pytest.approx(0.4) and c["reference"]["best_std"] == 0
    assert c["largest_gap"] == pytest.approx(0.2) and c["largest_gap_round"] == 2
    assert c["ours"]["diverged"] == 0


def test_compare_leaves_a_diverged_seed_out_of_final_and_best_and_counts_it():
    c = crosscheck.compare([[0.5, 0.6], [0.5, 0.8]], [[0.2, None], [0.3, 0.4]])
    assert c["reference"]["diverged"] == 1
    assert c["reference"]["final_mean"] == pytest.approx(0.4) and c["reference"]["final_std"] == 0
    assert c["reference"]["best_mean"] == pytest.approx(0.4)
    # round 1: 0.5 - 0.25; round 2: 0.7 - 0.4 (the seed that reached it)
    assert c["largest_gap"] == pytest.approx(0.3) and c["largest_gap_round"] == 2
    every = crosscheck.compare([[0.5, 0.6]], [[None, None]])
    assert every["reference"]["final_mean"] is None and every["reference"]["diverged"] == 1


def test_a_stand_in_reference_runs_through_the_bootstrap_with_its_seed(tmp_path):
    """A fake HtFLlib ``system/main.py`` that reads client 0's partition as HtFLlib does, seeds
    torch with 0 as HtFLlib does, draws from numpy's and Python's generators unseeded as HtFLlib's
    client order does, and prints HtFLlib's log lines: seed 0 leaves torch's draw unchanged and seeds
    the other two with 0, seed 1 changes the draw, a failing optional server import is replaced, and
    every run is kept."""
    system = tmp_path / "ref" / "system"
    (system / "flcore" / "servers").mkdir(parents=True)
    (system / "flcore" / "__init__.py").write_text("")
    (system / "flcore" / "servers" / "__init__.py").write_text("")
    (system / "flcore" / "servers" / "serverbroken.py").write_text("import not_installed_anywhere\n")
    (system / "main.py").write_text(
        textwrap.dedent(
            """
            import argparse, random, numpy as np, torch
            from flcore.servers.serverbroken import Broken
            p = argparse.ArgumentParser()
            p.add_argument("-data"); p.add_argument("-gr", type=int)
            args, _ = p.parse_known_args()
            data = np.load(f"../dataset/{args.data}/train/0.npz", allow_pickle=True)["data"].tolist()
            torch.manual_seed(0)
            draw = torch.rand(1).item() + np.random.rand() + random.random()
            print("Running time: 0th")
            for r in range(args.gr + 1):
                print(f"Round number: {r}")
                print(f"Averaged Test Accuracy: {draw + r / 100 + len(data['y']) / 1e6:.6f}")
            """
        )
    )
    config = small_config(**{"num-server-rounds": 2})
    partitions = tmp_path / "cc" / "partitions"
    crosscheck.write_partitions(config, partitions)
    n = len(np.load(partitions / "train" / "0.npz", allow_pickle=True)["data"].tolist()["y"])
    out = tmp_path / "cc" / "fedgh"
    runs = [crosscheck.run_reference(tmp_path / "ref", config, "fedgh", s, partitions, out) for s in (0, 1)]
    torch.manual_seed(0)
    unchanged = torch.rand(1).item() + np.random.RandomState(0).rand() + random.Random(0).random()
    assert runs[0]["curve"] == pytest.approx([unchanged + 0.01 + n / 1e6, unchanged + 0.02 + n / 1e6], abs=1e-6)
    assert runs[1]["initial"] != pytest.approx(runs[0]["initial"])
    assert "-algo FedGH" in runs[0]["command"] and runs[0]["cpu_seconds"] > 0
    assert "placeholder" in (out / "reference-seed-0.log").read_text()
    saved = json.loads((out / "reference-seed-1.json").read_text())
    assert saved == runs[1]
    (system / "main.py").write_text("raise SystemExit(3)\n")  # a finished run is reused, not run again
    assert (
        crosscheck.run_reference(tmp_path / "ref", config, "fedgh", 1, partitions, tmp_path / "cc" / "fedgh") == saved
    )
    key = json.loads((partitions / "config.json").read_text())["partition_key"]
    copied = {**config, "data-dir": str(tmp_path / "data")}  # the data folder copied: the same partitions written again
    shutil.copytree(DATA_DIR / "cifar10", tmp_path / "data" / "cifar10")
    crosscheck.write_partitions(copied, partitions)
    assert json.loads((partitions / "config.json").read_text())["partition_key"] != key
    assert crosscheck.run_reference(tmp_path / "ref", copied, "fedgh", 1, partitions, out) == saved
    elsewhere = tmp_path / "cc2" / "partitions"  # another output folder: another dataset name, same data
    crosscheck.write_partitions(config, elsewhere)
    (tmp_path / "cc2" / "fedgh").mkdir()
    shutil.copy(out / "reference-seed-1.json", tmp_path / "cc2" / "fedgh")
    assert (
        crosscheck.run_reference(tmp_path / "ref", config, "fedgh", 1, elsewhere, tmp_path / "cc2" / "fedgh") == saved
    )
    with pytest.raises(RuntimeError, match="exit code 3"):  # another lr is another command: run again
        crosscheck.run_reference(tmp_path / "ref", {**config, "lr": 0.02}, "fedgh", 1, partitions, out)
    other = small_config(**{"num-server-rounds": 2, "max-examples-per-client": 30})
    crosscheck.write_partitions(other, partitions)  # other content: run again
    with pytest.raises(RuntimeError, match="exit code 3"):
        crosscheck.run_reference(tmp_path / "ref", other, "fedgh", 1, partitions, out)


def test_a_family_htflib_removed_is_put_back_for_the_run(tmp_path):
    """HtCNN8 (FedTGP's ``HCNNs8``, gone from today's HtFLlib): the bootstrap adds its branch to a
    stand-in ``main.py``'s family chain, with our eight members' convs and widths and the dataset's
    channels and side; a family the chain has is left alone."""
    system = tmp_path / "ref" / "system"
    system.mkdir(parents=True)
    (system / "main.py").write_text(
        textwrap.dedent(
            """
            import argparse, json
            def run(args):
                for i in range(1):
                    if args.model_family == "HtFE-img-2":
                        args.models = ["FedAvgCNN()"]
                    else:
                        raise NotImplementedError
                    print("models:", json.dumps(args.models))
                    print("Running time: 0th")
                    for r in range(args.gr + 1):
                        print(f"Round number: {r}")
                        print("Averaged Test Accuracy: 0.5")
            p = argparse.ArgumentParser()
            p.add_argument("-m", dest="model_family"); p.add_argument("-gr", type=int)
            run(p.parse_known_args()[0])
            """
        )
    )
    config = small_config(
        **{"dataset": "fashion-mnist", "model-group": "htcnn8", "num-server-rounds": 1, "max-examples-per-client": 20}
    )
    partitions = tmp_path / "cc" / "partitions"
    crosscheck.write_partitions(config, partitions)
    run = crosscheck.run_reference(tmp_path / "ref", config, "local", 0, partitions, tmp_path / "cc" / "local")
    log = (tmp_path / "cc" / "local" / "reference-seed-0.log").read_text()
    models = json.loads(log.split("models: ", 1)[1].splitlines()[0])
    assert len(models) == 8 and "-m HCNNs8" in run["command"] and "CROSSCHECK_FAMILY=" in run["command"]
    for constructor, (convs, widths) in zip(models, HTCNN8.values(), strict=True):
        assert f"num_cov={convs}, hidden_dims={list(widths[:-1])}, in_features=1, height=28," in constructor
    assert crosscheck.restored_family("HtFE-img-2", "cifar10") is None
    cifar = crosscheck.run_reference(
        tmp_path / "ref", small_config(**{"num-server-rounds": 1}), "local", 0, partitions, tmp_path / "cc" / "htfe2"
    )
    assert "CROSSCHECK_FAMILY" not in cifar["command"]


def test_fedgh_is_compared_on_the_model_htflib_evaluates_when_ours_reports_it():
    config = small_config(method="fedgh")
    assert crosscheck.compared_metric(config, "fedgh") == "accuracy_weighted"  # our primary metric
    on = {**config, "fedgh.eval-global-head": True}
    assert crosscheck.compared_metric(on, "fedgh") == "accuracy_weighted_global_head"
    assert crosscheck.compared_metric(on, "fedproto") == "accuracy_weighted"
    assert not crosscheck.evaluates_as_reference(config, "fedgh") and crosscheck.evaluates_as_reference(on, "fedgh")
    mrl = {**config, "fedmrl.eval-protocol": "deployment"}  # a non-boolean option: compared by value
    assert not crosscheck.evaluates_as_reference(config, "fedmrl") and crosscheck.evaluates_as_reference(mrl, "fedmrl")
    assert crosscheck.compared_metric(mrl, "fedmrl") == "accuracy_weighted"


def test_a_finished_run_is_reused_only_for_the_same_config(tmp_path, monkeypatch):
    """Ours: a completed seed is reused when the whole run config is the same, and run again when the
    preset's content or an override changed (a stale curve must not stand for another config)."""
    calls = []

    def fake_run(cmd, cwd, log, env=None):
        out = Path(json.loads(cmd[-1].split("output-dir=", 1)[1]))
        calls.append(cmd)
        run = out / f"run-{len(calls)}"
        run.mkdir(parents=True)
        (run / "summary.json").write_text(json.dumps({"status": "completed"}))
        row = {"round": 1, "accuracy_weighted": 0.5, "accuracy_weighted_global_head": 0.25}
        (run / "metrics.jsonl").write_text(json.dumps(row) + "\n")
        return 0, 1.0, 1.0

    monkeypatch.setattr(crosscheck, "run_measured", fake_run)
    monkeypatch.setattr(crosscheck, "read_summary", lambda folder: json.loads((folder / "summary.json").read_text()))
    preset = tmp_path / "preset.toml"
    preset.write_text('method = "fedproto"\nbatch-order = "fixed"\n')
    out = tmp_path / "seed-0"
    first = crosscheck.run_ours(["num-server-rounds=1"], str(preset), 0, out)
    assert crosscheck.run_ours(["num-server-rounds=1"], str(preset), 0, out) == first and len(calls) == 1
    assert first["curve"] == [0.5] and first["metric"] == "accuracy_weighted"
    other = crosscheck.run_ours(["num-server-rounds=1"], str(preset), 0, out, "accuracy_weighted_global_head")
    assert other["curve"] == [0.25] and len(calls) == 1  # another row key of the same run: read, not run
    preset.write_text('method = "fedproto"\nbatch-order = "shuffle"\n')  # the preset changed
    assert crosscheck.run_ours(["num-server-rounds=1"], str(preset), 0, out)["config"]["batch-order"] == "shuffle"
    crosscheck.run_ours(["num-server-rounds=2"], str(preset), 0, out)  # an override changed
    assert len(calls) == 3


def run_stand_in_reference(tmp_path, main: str, seed: int, method: str) -> dict:
    """``run_reference`` for 3 rounds on a stand-in HtFLlib whose ``system/main.py`` is ``main``."""
    system = tmp_path / "ref" / "system"
    system.mkdir(parents=True, exist_ok=True)
    (system / "main.py").write_text(textwrap.dedent(main))
    config = small_config(**{"num-server-rounds": 3})
    partitions = tmp_path / "cc" / "partitions"
    if not partitions.exists():
        crosscheck.write_partitions(config, partitions)
    return crosscheck.run_reference(tmp_path / "ref", config, method, seed, partitions, tmp_path / "cc" / method)


def test_a_reference_whose_models_diverge_is_a_result_and_another_failure_is_not(tmp_path):
    """HtFLlib stops on NaN outputs (scikit-learn's "Input contains NaN" in its evaluation): the curve
    keeps the rounds printed, None after, and names the round; any other early exit raises."""
    main = """
    import sys
    print("Running time: 0th")
    for r in range(2):
        print(f"Round number: {r}")
        print("Averaged Test Accuracy: 0.3")
    print("Round number: 2")
    raise SystemExit("ValueError: Input contains NaN.")
    """
    run = run_stand_in_reference(tmp_path, main, 0, "fd")
    assert run["curve"] == [0.3, None, None] and run["diverged_round"] == 2
    infinite = "Input contains infinity or a value too large for dtype('float32')."
    assert (
        run_stand_in_reference(tmp_path, main.replace("Input contains NaN.", infinite), 2, "fd")["diverged_round"] == 2
    )
    with pytest.raises(RuntimeError, match="exit code 1"):
        run_stand_in_reference(tmp_path, main.replace("Input contains NaN.", "CUDA out of memory"), 1, "fd")


def test_a_reference_that_prints_a_nonfinite_loss_and_goes_on_has_diverged_from_the_next_round(tmp_path):
    """FedTGP's server prints ``Server loss: nan`` and HtFLlib goes on, printing chance accuracy of
    NaN models with exit code 0: the curve stops at the round that printed it."""
    main = """
    print("Running time: 0th")
    for r in range(4):
        print(f"Round number: {r}")
        print(f"Averaged Test Accuracy: {0.3 if r < 2 else 0.0999}")
        print(f"Server loss: {float('nan') if r >= 1 else 2.5}")
    """
    run = run_stand_in_reference(tmp_path, main, 0, "fedtgp")
    assert run["curve"] == [0.3, None, None] and run["diverged_round"] == 2
    assert (
        run_stand_in_reference(tmp_path, main.replace("float('nan')", "float('inf')"), 1, "fedtgp")["diverged_round"]
        == 2
    )
    run = run_stand_in_reference(tmp_path, main.replace("float('nan')", "7.25"), 2, "fedtgp")
    assert run["curve"] == [0.3, 0.0999, 0.0999] and run["diverged_round"] is None
