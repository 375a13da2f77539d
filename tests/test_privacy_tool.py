"""``tools.privacy`` on a recorded run folder: its table, rows and figure, resumable cells, the label leakage
of a per-class upload, and clear errors for a run that recorded nothing or has no public auxiliary data."""

import io
import json
import shutil
import subprocess
import sys
import zipfile

import numpy as np
import pytest

from common.config import RunConfig
from common.data import DataSpec, load_client_data
from common.run_folder import ResultsWriter
from methods.registry import build_run
from tools import privacy
from tools.privacy_view import RunView

BUDGET = ["--steps", "5", "--images", "4", "--samples", "2", "--epochs", "1"]


def recorded_run(folder, method: str, **extra):
    """(run folder, run config) of a 2-round run of ``method``, 3 clients, on the fake grid that recorded
    the rounds ``extra``'s ``record-payloads`` names (as a simulation: the clients' state in the run folder)."""
    from client_app.app import app as client_app
    from conftest import make_run_config
    from fakegrid import FakeGrid

    rc = make_run_config(method=method, **{"output-dir": str(folder), "num-clients": 3, **extra})
    cfg = RunConfig.from_dict(rc)
    run = build_run(cfg, ResultsWriter(cfg.output_dir, method, cfg.as_dict()))
    run.start(FakeGrid(client_app, rc, cfg.num_clients), state_in_run_folder=True)
    return run.results.path, cfg


@pytest.fixture(scope="module")
def fedgh_run(tmp_path_factory):
    """FedGH, both rounds recorded (:func:`recorded_run`)."""
    extra = {"max-examples-per-client": 60, "record-payloads": "1,2"}
    return recorded_run(tmp_path_factory.mktemp("privacy"), "fedgh", **extra)


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
    # the recogniser's accuracy on the victim's real images rides with every row it read
    assert all(0 < r["recogniser_accuracy"] <= 1 for r in rows if "recognised" in r)
    assert any("recognised" in r for r in rows)
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


def test_recognisability_the_non_member_control_and_one_reference_set_for_the_ladder(fedgh_run, tmp_path):
    """The recogniser (a classifier of the public split) reads the victim's real images far above chance and a
    flat image as one class; a per-class upload's rows carry ``recognised`` and the exact class mean's, beside
    the inversion of public non-members' class means scored against the same images; FedRE's Q2 rungs (one
    image's representation, the class mean) are scored against one sample of the victim's images."""
    import torch

    from tools.privacy_attacks import Attacker, Settings, class_rows, scored

    run, _ = fedgh_run
    view = RunView(run)
    attacker = Attacker(view, Settings(steps=5, images=4, samples=2, epochs=1))
    data = view.data(0)
    accuracy = (attacker.recognise(data.train_x.float() / 255) == data.train_y).float().mean().item()
    assert accuracy > 2 / view.info.num_classes  # 0.48 measured (CIFAR-10, 1 epoch on the test split)
    gray = attacker.recognise(torch.full((8, *attacker.shape), 0.5))
    assert len(set(gray.tolist())) == 1
    found = class_rows(view.payload(2, 0, "up"))
    upload, control, samples, means = attacker.invert_upload(2, 0, found, view.model(0, 2), data, attacker.generator(0))
    assert control.payload.startswith("non-member class mean") and control.classes == upload.classes == found[2]
    assert all(torch.equal(a, b) for a, b in zip(control.references, upload.references, strict=True))
    assert all(torch.equal(refs[1:], means.references[0]) for refs in samples.references)
    row, _ = scored(upload, attacker.recognise)
    assert 0 <= row["recognised"] <= 1 and 0 <= row["ceiling_recognised"] <= 1 and row["n"] == len(found[2])
    # a classifier that always says the row's class recognises everything, one that never does nothing
    assert scored(upload, lambda x: torch.tensor(upload.classes[: len(x)]))[0]["recognised"] == 1.0
    assert scored(upload, lambda x: torch.full((len(x),), -1))[0]["ceiling_recognised"] == 0.0


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


def damaged(path, kind: str) -> str:
    """Damage the recorded payload file ``path`` as ``kind`` says; returns what the error must say."""
    arrays = dict(np.load(path))
    name = next(iter(arrays))
    if kind == "object array":  # np.savez pickles it; reading it back must not unpickle
        np.savez(path, **{**arrays, name: np.array([1, "x"], dtype=object)})
        return f"member '{name}.npy': dtype object (allowed: booleans and numbers)"
    if kind == "truncated":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
        return "File is not a zip file"
    # a header that declares 23 TiB of float32 over 16 bytes of data
    with zipfile.ZipFile(path, "w") as archive:
        for key, value in arrays.items():
            member = io.BytesIO()
            if key == name:
                header = {"descr": "<f4", "fortran_order": False, "shape": ((23 << 40) // 4,)}
                np.lib.format.write_array_header_1_0(member, header)
                member.write(bytes(16))
            else:
                np.lib.format.write_array(member, value)
            archive.writestr(f"{key}.npy", member.getvalue())
    return f"member '{name}.npy': shape ({(23 << 40) // 4},) of float32 is {23 << 40} bytes, the member holds 16"


@pytest.mark.parametrize("kind", ["object array", "truncated", "23 TiB"])
def test_a_bad_recorded_payload_is_one_line_naming_it_with_exit_2_and_no_output(fedgh_run, tmp_path, capsys, kind):
    """A recorded ``.npz`` holding an object array, cut short, or declaring a 23 TiB array raised a
    ValueError, BadZipFile or numpy's memory error; each member's header is checked before its data is
    read, and the command stops before it writes anything."""
    run, _ = fedgh_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    path = copy / "payloads" / "round-2" / "partition-0" / "train.up.npz"
    expected = damaged(path, kind)
    out = tmp_path / "out"
    args = [str(copy), "--rounds", "2", "--clients", "0", "--attacks", "labels", "--out", str(out)]
    assert privacy.main(args + BUDGET) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{path} is not a payload file this system recorded" in err[0], err
    assert expected in err[0] and not out.exists()


@pytest.mark.parametrize("content", [b"PK\x03\x04 torn", b"garbage"])
def test_a_bad_kept_model_is_one_line_naming_it_with_exit_2(fedgh_run, tmp_path, capsys, content):
    """A client's kept model that is cut short or not a checkpoint at all raised a RuntimeError or an
    UnpicklingError from torch.load."""
    run, _ = fedgh_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    path = copy / "client-state" / "partition-0" / "model-round-2.pt"
    path.write_bytes(content)
    out = tmp_path / "out"
    args = [str(copy), "--rounds", "2", "--clients", "0", "--attacks", "inversion", "--out", str(out)]
    assert privacy.main(args + BUDGET) == 2
    lines = capsys.readouterr().err.splitlines()
    err = [line for line in lines if line.strip() and not line.startswith("privacy cells:")]  # tqdm's bar
    assert len(err) == 1 and f"tools.privacy: {path} is not client 0's model as it kept it: " in err[0], err
    assert not out.exists()


def test_a_resume_from_loop_is_refused_naming_its_folders(fedgh_run, tmp_path):
    """A run whose summary's ``resume-from`` named the run itself held ``tools.privacy`` in an endless walk
    of the chain (a child process, so that the test fails instead of hanging)."""
    from conftest import ROOT

    run, _ = fedgh_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    summary = json.loads((copy / "summary.json").read_text())
    summary["config"]["resume-from"] = str(copy)
    (copy / "summary.json").write_text(json.dumps(summary))
    cmd = [sys.executable, "-m", "tools.privacy", str(copy), "--out", str(tmp_path / "out")]
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("tools.privacy still walking the resume-from chain after 120 s")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0] == f"tools.privacy: the resume-from chain of {copy} is a loop: {copy} -> {copy}; " + (
        "each run resumes an older one"
    )
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def lg_fedavg_run(tmp_path_factory):
    """LG-FedAvg, round 2 recorded: a weight upload, the head (:func:`recorded_run`)."""
    extra = {"max-examples-per-client": 40, "record-payloads": "2"}
    return recorded_run(tmp_path_factory.mktemp("privacy-update"), "lg-fedavg", **extra)


@pytest.mark.parametrize("images", [3, 0])
def test_inverting_gradients_fits_the_attackers_guess_or_the_real_local_update(lg_fedavg_run, tmp_path, images):
    """``--update-images N`` fits N images in one batch; 0 the real local update: as many images as the victim
    trained on, in its batches, labelled in the proportions the head's change gives away."""
    run, cfg = lg_fedavg_run
    out = tmp_path / "update"
    budget = [*BUDGET, "--update-steps", "2", "--idlg-steps", "1", "--update-images", str(images)]
    args = [str(run), "--rounds", "2", "--clients", "0", "--attacks", "update", "--out", str(out)]
    assert privacy.main(args + budget) == 0
    rows = json.loads((out / "privacy.json").read_text())
    inverted = [r for r in rows if r["payload"].endswith("(inverting gradients)")]
    trained = len(load_client_data(DataSpec.from_config(cfg, 3), 0).train_y)
    assert len(inverted) == 1 and inverted[0]["n"] == (images or trained)


def test_labels_in_proportion_match_the_distribution_and_the_count():
    import torch

    from tools.privacy_attacks import labels_in_proportion

    got = labels_in_proportion(np.array([0.5, 0.0, 0.3, 0.2]), 7, torch.Generator().manual_seed(0))
    # 3.5, 0, 2.1 and 1.4 of 7: the floors 3, 0, 2, 1 and the one left over to the largest remainder (class 0)
    assert sorted(got.tolist()) == [0, 0, 0, 0, 2, 2, 3]
    assert got.tolist() != sorted(got.tolist())  # mixed, as a client's batches are


def test_fedgens_counts_give_the_label_distribution_exactly_and_its_head_is_attacked_alone(tmp_path):
    """FedGen uploads its head beside its exact per-class counts: the counts read as the whole label distribution
    (no error), the head as LG-FedAvg's weight change (the counts and the downloaded generator left out)."""
    extra = {"max-examples-per-client": 40, "record-payloads": "2", "fedgen.server-epochs": 1}
    run, cfg = recorded_run(tmp_path / "fedgen", "fedgen", **extra)
    out = tmp_path / "report"
    budget = [*BUDGET, "--update-steps", "2", "--idlg-steps", "1", "--update-images", "3"]
    args = [str(run), "--rounds", "2", "--clients", "0", "--attacks", "labels,update", "--out", str(out)]
    assert privacy.main(args + budget) == 0
    rows = json.loads((out / "privacy.json").read_text())
    counts = next(r for r in rows if r["attack"] == "labels" and r["payload"] == "class_counts")
    assert counts["label_precision"] == counts["label_recall"] == 1.0
    assert counts["distribution_l1"] == 0.0 and counts["counts_exact"] == 1.0
    # the head's change also carries the generated representations' classes, so some of the 3 images may be
    # labelled with a class the victim lacks: scored against all of its images, counted as not recognised
    inverted = [r for r in rows if r["attack"] == "update" and r["payload"].endswith("(inverting gradients)")]
    assert len(inverted) == 1 and inverted[0]["n"] == 3


def test_fmls_meme_model_is_attacked_as_trained_with_the_private_model_under_its_own_loss(tmp_path, capsys):
    """FML's meme model trains beside the private model under mutual distillation; the attack simulated it
    alone under cross-entropy. The client now keeps its training module at the start of a recorded round and
    the attack unrolls it whole under FML's loss (knowledge: the private models too); without that record the
    tool stops naming the file."""
    extra = {"max-examples-per-client": 40, "record-payloads": "2"}
    run, _ = recorded_run(tmp_path / "fml", "fml", **extra)
    out = tmp_path / "report"
    budget = [*BUDGET, "--update-steps", "2", "--idlg-steps", "1", "--update-images", "3"]
    args = [str(run), "--rounds", "2", "--clients", "0", "--attacks", "update", "--out", str(out)]
    assert privacy.main(args + budget) == 0
    rows = json.loads((out / "privacy.json").read_text())
    inverted = [r for r in rows if r["payload"].endswith("(inverting gradients)")]
    assert [r["knowledge"] for r in inverted] == ["white-box + private models"]
    idlg = [r for r in rows if r["payload"].endswith("(iDLG)")]
    assert [r["knowledge"] for r in idlg] == ["white-box"]
    kept = run / "client-state" / "partition-0" / "training-module-round-2-start.pt"
    kept.unlink()
    capsys.readouterr()
    assert privacy.main([*args[:-1], str(tmp_path / "again")] + budget) == 2
    assert f"{kept} is missing" in capsys.readouterr().err
