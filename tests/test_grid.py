"""Presets and the resumable grid runner (in-process launches over the fake grid)."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
from flwr.common.config import parse_config_args

from common.config import RunConfig
from common.files import CHECKPOINT, read_rows, read_summary
from common.run_folder import ResultsWriter
from conftest import DATA_DIR, ROOT
from engine.runner import Runner
from methods.registry import build_run
from tools.grid import newest_run, plan, read_grid_info, record_invocation, run_grid
from tools.grid_rows import paper_info
from tools.runconfig import app_defaults

PRESETS = sorted((ROOT / "presets").glob("*.toml"))
RUN_PRESETS = [p for p in PRESETS if not p.name.endswith(".paper.toml")]
_run_ids = itertools.count()


def in_process(preset: Path, overrides: dict, minutes: float) -> int:
    """A launcher that runs the cell in this process over a fresh FakeGrid (a new simulation)."""
    from client_app.app import app as client_app
    from fakegrid import FakeGrid
    from server_app.app import run

    rc = {**app_defaults(), **parse_config_args([str(preset)]), **overrides, "data-dir": str(DATA_DIR)}
    cfg = RunConfig.from_dict(rc)
    try:
        run(FakeGrid(client_app, rc, cfg.num_clients), cfg, f"t{next(_run_ids)}")
    except KeyboardInterrupt:
        return 130
    return 0


def test_every_preset_parses_and_a_paper_preset_has_paper_numbers():
    """Every preset is a valid run config; a paper's preset (with a ``.paper.toml``) has its numbers. The
    others are evaluation settings of no paper's table (the privacy evaluation's runs, the held-out clients')."""
    papers = [p for p in RUN_PRESETS if p.with_suffix(".paper.toml").is_file()]
    assert len(papers) >= 6
    evaluations = {"privacy-cifar10-cnn5.toml", "dp-fmnist-cnn5.toml", "generalization-cifar10-mh-lenet.toml"}
    assert {p.name for p in RUN_PRESETS} - {p.name for p in papers} == evaluations
    defaults = app_defaults()
    for preset in RUN_PRESETS:
        config = parse_config_args([str(preset)])
        assert set(config) <= set(defaults), preset.name  # flwr run --run-config accepts only known keys
        cfg = RunConfig.from_dict({**defaults, **config})
        build_run(cfg)  # method options valid
        if preset not in papers:
            continue
        paper = paper_info(preset.name)  # refuses unknown keys
        assert {"paper", "setting", "metric", "ours", "target", "rounds"} <= set(paper), preset.name
        assert isinstance(paper["rounds"], int) and paper["rounds"] >= 1
        assert all(0 <= v < 5 for v in paper.get("reported-std", {}).values())
        assert paper["ours"] in (
            "final_accuracy_mean",
            "final_accuracy_weighted",
            "best_accuracy_mean",
            "best_accuracy_weighted",
        )
        assert all(0 < v <= 100 for v in paper.get("reported", {}).values())


@pytest.mark.parametrize("preset", RUN_PRESETS, ids=lambda p: p.stem)
def test_every_preset_runs_one_round_in_process(preset, tmp_path):
    config = parse_config_args([str(preset)])
    small = {
        "num-server-rounds": 1,
        "max-examples-per-client": 60,
        "local-epochs": 1,
        "num-clients": min(config["num-clients"], 4),
        "fraction-train": 1.0,
        "output-dir": str(tmp_path),
        "fedtgp.server-epochs": 2,
        "mh-pfedhn.hidden-dim": 16,
    }
    if config.get("record-payloads"):  # a preset that records later rounds records the one round here
        small["record-payloads"] = "1"
    held_out = 1 if config.get("generalization.held-out-clients") else 0
    if held_out:  # one of the 4 clients is held out, served after the round
        small.update({"generalization.held-out-clients": 1.0, "generalization.rounds": 1})
    assert in_process(preset, small, 0) == 0
    (run,) = tmp_path.iterdir()
    rows = read_rows(run)
    assert len(rows) == 1 and rows[0]["num_clients"] == small["num-clients"] - held_out
    assert rows[0].get("heldout_clients", 0) == held_out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["config"]["augment"] == config["augment"] and summary["config"]["init"] == config["init"]


def small_preset(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(
        'dataset = "mnist"\npartitioner = "dirichlet"\ndirichlet-alpha = 0.5\nnum-clients = 3\n'
        'model-group = "htcnn8"\nnum-server-rounds = 3\nmax-examples-per-client = 90\n'
        'batch-size = 16\naugment = "none"\nnormalize = "half"\ninit = "identical"\n'
        "[fedtgp]\nserver-epochs = 3\n"
    )
    return path


def rows_of(cell: Path) -> list[dict]:
    run, _ = newest_run(cell)
    return read_rows(run)


def test_grid_interrupted_after_round_one_resumes_to_the_same_rows(tmp_path, monkeypatch):
    preset = small_preset(tmp_path)
    whole = run_grid(preset, ["fedtgp", "local"], [0], tmp_path / "whole", launcher=in_process)
    assert whole == {"fedtgp-seed0": "completed", "local-seed0": "completed"}

    # a crash right after round 1's checkpoint, in every cell
    write_checkpoint = ResultsWriter.write_checkpoint

    def crash(self, state):
        write_checkpoint(self, state)
        raise KeyboardInterrupt

    monkeypatch.setattr(ResultsWriter, "write_checkpoint", crash)
    split = tmp_path / "split"
    first = run_grid(preset, ["fedtgp", "local"], [0], split, launcher=in_process)
    assert set(first.values()) == {"stopped (exit 130)"}
    assert plan(split / "fedtgp-seed0", 3)[0] == "resume"
    monkeypatch.setattr(ResultsWriter, "write_checkpoint", write_checkpoint)
    stopped, _ = newest_run(split / "fedtgp-seed0")

    # stopped again as the resumed run begins, before its first round: its folder holds round 1's rows and
    # checkpoint, and the next launch resumes from it
    resume = Runner.resume

    def stop_after_resume(self):
        resume(self)
        raise KeyboardInterrupt

    monkeypatch.setattr(Runner, "resume", stop_after_resume)
    assert set(run_grid(preset, ["fedtgp", "local"], [0], split, launcher=in_process).values()) == {
        "stopped (exit 130)"
    }
    monkeypatch.setattr(Runner, "resume", resume)
    begun, summary = newest_run(split / "fedtgp-seed0")
    assert begun != stopped and summary["rounds_completed"] == 1
    assert (begun / CHECKPOINT).read_bytes() == (stopped / CHECKPOINT).read_bytes()
    assert plan(split / "fedtgp-seed0", 3) == ("resume", begun)
    # a folder of as many rounds without a checkpoint (an older version's) is passed over for one with it
    (begun / CHECKPOINT).rename(begun / "moved.pt")
    assert plan(split / "fedtgp-seed0", 3) == ("resume", stopped)
    (begun / "moved.pt").rename(begun / CHECKPOINT)
    second = run_grid(preset, ["fedtgp", "local"], [0], split, launcher=in_process)
    assert second == {"fedtgp-seed0": "resumed", "local-seed0": "resumed"}
    for cell in ("fedtgp-seed0", "local-seed0"):
        a, b = rows_of(tmp_path / "whole" / cell), rows_of(split / cell)
        assert [r["round"] for r in b] == [1, 2, 3]
        for key in ("accuracy_per_client", "accuracy_mean", "bytes_up", "bytes_down", "train_loss"):
            assert [r.get(key) for r in a] == [r.get(key) for r in b], (cell, key)
    # the clients continued from their saved state, not from their initial models
    assert any((split / "fedtgp-seed0" / "client-state").rglob("model.pt"))
    # finished cells are skipped
    assert run_grid(preset, ["fedtgp", "local"], [0], split, launcher=in_process) == {
        "fedtgp-seed0": "done",
        "local-seed0": "done",
    }
    info = json.loads((split / "grid.json").read_text())
    assert len(info["invocations"]) == 4 and info["rounds"] == 3 and info["preset_config"]["num-clients"] == 3
    # a preset edited since the grid started would mix two configs in one grid: refused, naming the key
    preset.write_text(preset.read_text() + "prototype-pass = 'before-training'\n")  # into its [fedtgp] table
    with pytest.raises(ValueError, match=r"'fedtgp.prototype-pass': None, now 'before-training'.*another --out"):
        run_grid(preset, ["fedtgp", "local"], [0], split, launcher=in_process)
    assert len(json.loads((split / "grid.json").read_text())["invocations"]) == 4
    # a section of a method the grid holds no cell of yet reads into new cells only: taken and recorded
    # (fedl2g-feat's warm-up, for fedl2g-feat's first cells), but not for a method that has cells already
    preset.write_text(
        preset.read_text().replace("prototype-pass = 'before-training'\n", "") + "\n[fedl2g-feat]\nwarm-up-rounds = 0\n"
    )
    assert run_grid(preset, ["fedtgp", "fedl2g-feat"], [0], split, launcher=in_process) == {
        "fedtgp-seed0": "done",
        "fedl2g-feat-seed0": "completed",
    }
    info = json.loads((split / "grid.json").read_text())
    assert len(info["invocations"]) == 5 and info["preset_config"]["fedl2g-feat.warm-up-rounds"] == 0
    assert read_summary(newest_run(split / "fedl2g-feat-seed0")[0])["config"]["fedl2g-feat.warm-up-rounds"] == 0
    preset.write_text(preset.read_text().replace("warm-up-rounds = 0", "warm-up-rounds = 1"))
    with pytest.raises(ValueError, match=r"'fedl2g-feat.warm-up-rounds': 0, now 1.*another --out"):
        run_grid(preset, ["fedl2g-feat"], [0], split, launcher=in_process)


def test_grid_json_holds_every_invocations_methods_and_seeds(tmp_path):
    """A grid run a seed or a method at a time (then continued): ``grid.json`` names every method in the
    order first asked and every seed, not only the last invocation's; ``rounds`` is the last one's."""
    preset, grid = small_preset(tmp_path), tmp_path / "grid"
    grid.mkdir()
    record_invocation(grid, preset, ["local", "fedtgp"], [1], 3, 0.0, ["--seeds", "1"], {})
    record_invocation(grid, preset, ["fedgh", "local"], [2, 0], 5, 0.0, ["--seeds", "2,0"], {})
    info = read_grid_info(grid)
    assert info["methods"] == ["local", "fedtgp", "fedgh"] and info["seeds"] == [0, 1, 2] and info["rounds"] == 5
    assert [i["command"] for i in info["invocations"]] == [
        "python -m tools.grid --seeds 1",
        "python -m tools.grid --seeds 2,0",
    ]


def test_the_grid_refuses_an_unknown_method_without_importing_the_methods(tmp_path):
    """The grid process waits beside its runs for hours: it checks the methods in a child process, so
    neither torch nor the methods load into it; an unknown method is refused, naming the allowed ones."""
    argv = ["presets/fedtgp-fmnist-htcnn8.toml", "--methods", "fedtgp,bogus", "--out", str(tmp_path / "g")]
    code = (
        "import sys, tools.grid\n"
        f"code = tools.grid.main({argv!r})\n"
        "print(code, 'torch' in sys.modules, 'methods.registry' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert "'method' = 'bogus' is invalid: allowed values are 'fedgh'" in done.stdout
    assert done.stdout.splitlines()[-1] == "2 False False" and not (tmp_path / "g").exists()


def test_a_run_in_process_completes_resumes_and_refuses_a_federation_of_unknown_size(tmp_path, capsys):
    from tools import inprocess

    small = [
        "method='fedproto' dataset='mnist' num-clients=2 max-examples-per-client=40 model-group='cnn1'",
        f"data-dir='{DATA_DIR}' output-dir='{tmp_path}' num-server-rounds=2",
    ]
    args = [item for c in small for item in ("-c", c)]
    assert inprocess.main([*args, "-c", "num-server-rounds=1"]) == 0
    (first,) = tmp_path.iterdir()
    assert len(read_rows(first)) == 1 and read_summary(first)["status"] == "completed"
    assert inprocess.main([*args, "-c", f"resume-from='{first}'"]) == 0
    resumed = next(p for p in tmp_path.iterdir() if p != first)
    assert [row["round"] for row in read_rows(resumed)] == [1, 2]
    assert inprocess.main(["-c", "num-clients=0"]) == 2
    assert "'num-clients' is 0" in capsys.readouterr().err
