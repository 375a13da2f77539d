"""``tools.privacy`` on a recorded run folder: its table, rows and figure, resumable cells, the label leakage
of a per-class upload, and clear errors for a run that recorded nothing or has no public auxiliary data."""

import json
import shutil

import pytest

from common.config import RunConfig
from common.data import DataSpec, load_client_data
from common.results import ResultsWriter
from strategies.registry import build_strategy
from tools import privacy
from tools.privacy_view import RunView

BUDGET = ["--steps", "5", "--images", "4", "--samples", "2", "--epochs", "1"]


@pytest.fixture(scope="module")
def fedgh_run(tmp_path_factory):
    """A 2-round FedGH run of 3 clients on the fake grid that recorded both rounds (as a simulation: the
    clients' state in the run folder)."""
    from client_app.app import app as client_app
    from conftest import make_run_config
    from fakegrid import FakeGrid

    out = tmp_path_factory.mktemp("privacy")
    rc = make_run_config(
        method="fedgh",
        **{"output-dir": str(out), "num-clients": 3, "max-examples-per-client": 60, "record-payloads": "1,2"},
    )
    cfg = RunConfig.from_dict(rc)
    strategy = build_strategy(cfg, ResultsWriter(cfg.output_dir, "fedgh", cfg.as_dict()))
    strategy.start(FakeGrid(client_app, rc, cfg.num_clients), state_in_run_folder=True)
    return strategy.results.path, cfg


def test_it_writes_table_rows_and_figure_and_resumes(fedgh_run, tmp_path, capsys):
    run, cfg = fedgh_run
    out = tmp_path / "report"
    args = [str(run), "--rounds", "2", "--clients", "0,1", "--attacks", "inversion,labels", "--out", str(out)]
    assert privacy.main(args + BUDGET) == 0
    rows = json.loads((out / "privacy.json").read_text())
    payloads = {(r["attack"], r["payload"]) for r in rows}
    ladder = {"lar", "per-sample representation", "class mean representation"}
    assert {("inversion", name) for name in ladder} <= payloads
    assert {r["partition"] for r in rows} == {0, 1} and {r["round"] for r in rows} == {2}
    for r in rows:
        if r["attack"] == "inversion":
            assert r["n"] >= 1 and r["best_psnr"] > 0 and 0 <= r["best_mse"] <= 255**2
    assert "| inversion | server | white-box | lar |" in (out / "privacy.md").read_text()
    assert (out / privacy.FIGURE).stat().st_size > 0
    # the label leakage of FedGH's upload: its class ids are the client's class set exactly
    spec = DataSpec.from_config(cfg, 3)
    labelled = [r for r in rows if r["attack"] == "labels"]
    assert len(labelled) == 2
    for r in labelled:
        held = set(load_client_data(spec, r["partition"]).train_y.tolist())
        assert len(held) == cfg.classes_per_client and r["label_precision"] == r["label_recall"] == 1.0
    # a second invocation reuses every finished cell: nothing is attacked again
    cells = sorted((out / "cells").glob("*.json"))
    stamps = [c.stat().st_mtime_ns for c in cells]
    assert len(cells) == 4
    assert privacy.main(args + BUDGET) == 0
    assert [c.stat().st_mtime_ns for c in cells] == stamps


def test_a_run_without_recorded_payloads_names_the_key(fedgh_run, tmp_path, capsys):
    run, _ = fedgh_run
    bare = tmp_path / "bare"
    shutil.copytree(run, bare, ignore=shutil.ignore_patterns("payloads"))
    assert privacy.main([str(bare)]) == 2
    assert "record-payloads" in capsys.readouterr().err


def test_black_box_needs_public_images(fedgh_run, tmp_path, capsys):
    run, _ = fedgh_run
    copy = tmp_path / "pooled"
    shutil.copytree(run, copy)
    summary = json.loads((copy / "summary.json").read_text())
    summary["config"]["data-pool"] = "train+test"
    (copy / "summary.json").write_text(json.dumps(summary))
    assert privacy.main([str(copy), "--rounds", "2", "--clients", "0", "--attacks", "decoder"] + BUDGET) == 2
    assert "data-pool" in capsys.readouterr().err


def test_a_run_recorded_before_a_key_existed_is_read_with_that_keys_default(fedgh_run, tmp_path):
    """A summary whose config lacks a key added later (here ``min-clients``) describes a run that ran as
    that key's default does; the attacks read it instead of refusing it."""
    run, cfg = fedgh_run
    old = tmp_path / "old"
    shutil.copytree(run, old)
    summary = json.loads((old / "summary.json").read_text())
    del summary["config"]["min-clients"]
    (old / "summary.json").write_text(json.dumps(summary))
    view = RunView(old)
    assert view.cfg.min_clients == cfg.min_clients and view.rounds() == [1, 2]
