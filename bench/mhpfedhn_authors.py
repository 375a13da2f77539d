"""MH-pFedHN / MH-pFedHNGD against the authors' own scripts on our partitions, round by round.

Usage (from the repository root; the reference is a checkout of https://github.com/DangDang1895/MH-pFL
*outside* this repository, never copied into it):

    uv run --frozen python -m bench.mhpfedhn_authors --reference ../MH-pFL --script MH-pFedHN \\
        --preset presets/mh-pfedhn-table7-cifar10.toml --seeds 0,1,2 --rounds 100 \\
        [-c "partition-seed=0"] [--out outputs/authors/mh-pfedhn-table7-cifar10]

For every training seed it

1. writes our partitions once (our partitioner, our 75/25 split, ``partition-seed`` of the run
   config, else the first seed; images normalised as run config ``normalize`` says) in PFLlib's
   layout (:func:`bench.pfllib.write_partitions`), and checks that their transform (torchvision
   ``ToTensor`` + ``Normalize`` with the constants of their ``dataset.get_classes`` for the dataset,
   read from their source) of every one of our uint8 images equals, bitwise, the float32 image
   written (:func:`check_normalisation`; a difference stops the run);
2. runs their ``MH-pFedHN.py`` or ``MH-pFedHNGD.py`` unmodified, in their checkout, with the flags
   that map the run config (:func:`their_argv`; a setting their script cannot take is refused,
   naming the key), through :data:`BOOTSTRAP`, which replaces only:

   - ``dataset.get_classes``, their data loading (it partitions CIFAR-10 by its own U(0.4, 0.6)
     shares and splits each client 75/25 itself): the replacement gives client ``i`` exactly our
     client ``i``'s train and test split, the same loaders (``DataLoader``, ``batch-size``, train
     shuffled, test in order) and ``data_len`` (train sizes; MH-pFedHNGD weights its global step by
     them), and calls their ``utils.set_seed(seed)`` first, as theirs does;
   - ``IPython`` when it is not installed (it is not among our dependencies): while their
     ``display.py`` is imported, a stand-in gives it ``IPython.display.clear_output`` (it only
     clears a notebook cell) as a no-op, and ``get_ipython()`` (matplotlib asks it when
     ``display.py`` picks the svg backend) returns None, as IPython's does outside an interactive
     shell; the stand-in is removed right after, so matplotlib sees no IPython from then on;

   and observes ``display.ExperimentLogger.log`` (called once per step with every client's test
   accuracy and loss; their logger runs unchanged) to append the step's row, at full precision, to
   ``seed-<s>/authors.rounds.jsonl`` as it happens. Their ``utils.set_seed`` gets the training seed
   (``--seed``) and torch runs on :data:`~bench.crosscheck_pairing.CLIENT_THREADS` threads, as each of
   our clients does. Their loop has no checkpoint: an interrupted run starts again from step 1 (its
   rows file is restarted); a finished run (``seed-<s>/authors.json``) is reused when the command
   line and the partitions are the same;
3. runs ours (``tools.run``, :func:`bench.our_side.run_ours`) for the same seed, rounds and
   partition; a completed run with the same run config is reused;
4. writes ``report.md`` (final and best pooled accuracy and mean over clients of both sides, mean
   and population std over seeds, the largest gap of the mean curves with its round, the per-round
   table, commits, CPU seconds) and ``<script>.png`` (pooled accuracy by round, both sides).

Their ``Step: r`` (printed as ``step + 1``) is our round r: every client once, in a fresh random
order (``random.sample``), one hypernetwork step per client (GD: first one data-weighted step from
every client's training of the global model), then every client's generated model evaluated on its
own test split. Their ``AVG Acc`` is pooled over all clients' test examples, our
``accuracy_weighted``; their ``AVG Loss`` is the mean over clients of (sum of per-batch mean CE) /
(test batches + 1), not comparable with our loss (recorded, not compared).

Same seed, same partitions and the same random draws do not make equal numbers across PyTorch
builds: their kernels round differently (on this machine, turning off oneDNN alone moves round 1 of
seed 0 by one test image or two per client), and training amplifies it; ``authors.json`` records
the PyTorch version that ran their script.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import re
import sys
from pathlib import Path

import numpy as np

from bench.crosscheck_pairing import CLIENT_THREADS
from bench.crosscheck_report import PRINTED_HALF_STEP, compare, plot
from bench.measure import git_head, run_measured
from bench.our_side import method_options, run_ours
from bench.pfllib import write_partitions
from common.errors import ConfigError
from common.files import atomic_write, read_rows
from tools.grid import git_commit
from tools.processes import stop_on_signals
from tools.runconfig import ROOT, add_config_arguments, read_config

#: their script name -> our method
SCRIPTS = {"MH-pFedHN": "mh-pfedhn", "MH-pFedHNGD": "mh-pfedhngd"}
#: the files a checkout of DangDang1895/MH-pFL has that this tool runs or replaces parts of
REFERENCE_FILES = ("MH-pFedHN.py", "MH-pFedHNGD.py", "dataset.py", "display.py", "utils.py", "config/All_Layers.json")
#: datasets both their scripts (``--data-name``) and ours have
DATASETS = ("cifar10", "cifar100")
#: our hypernetwork trunk: Linear(D_e, H) then two Linear(H, H), ReLU after each (their --hidden-layers 3)
HIDDEN_LAYERS = 3
#: their step line, ``print(f"Step: {step+1}, AVG Loss: {avg_loss:.4f},  AVG Acc: {avg_acc:.4f}")``
STEP_LINE = re.compile(r"Step: (\d+), AVG Loss: (\S+),\s+AVG Acc: (\d+\.\d{4})$")

#: the environment variables :data:`BOOTSTRAP` reads
PARTITIONS_VARIABLE = "MHPFL_PARTITIONS"
ROWS_VARIABLE = "MHPFL_ROWS"
THREADS_VARIABLE = "MHPFL_THREADS"

#: runs ``argv[1]`` (their script, with argv[2:] its flags) in their checkout (see the module docstring)
BOOTSTRAP = r"""
import json, os, runpy, sys, time, types
import numpy, torch
torch.set_num_threads(int(os.environ["MHPFL_THREADS"]))
sys.path.insert(0, os.getcwd())
try:
    import IPython.display
    stubs = {}
except ImportError:
    stubs = {"IPython": types.ModuleType("IPython"), "IPython.display": types.ModuleType("IPython.display")}
    stubs["IPython.display"].clear_output = lambda wait=False: None
    stubs["IPython"].display, stubs["IPython"].get_ipython = stubs["IPython.display"], lambda: None
    sys.modules.update(stubs)
import dataset, display, utils
for name in stubs:
    del sys.modules[name]
from torch.utils.data import DataLoader, TensorDataset
folder, rows_file = os.environ["MHPFL_PARTITIONS"], os.environ["MHPFL_ROWS"]
state = {}
def load(split, i):
    data = numpy.load(os.path.join(folder, split, f"{i}.npz"), allow_pickle=True)["data"].item()
    return TensorDataset(torch.from_numpy(data["x"]), torch.from_numpy(data["y"]))
def get_classes(data_name, dataroot, num_clients, batch_size, num_classes_per_client, seed):
    utils.set_seed(seed)
    train = [load("train", i) for i in range(num_clients)]
    test = [load("test", i) for i in range(num_clients)]
    state.update(test_sizes=[len(d) for d in test], wall=time.perf_counter(), cpu=time.process_time())
    return ([DataLoader(d, batch_size=batch_size, shuffle=True) for d in train],
            [DataLoader(d, batch_size=batch_size, shuffle=False) for d in test], [len(d) for d in train])
dataset.get_classes = get_classes
log = display.ExperimentLogger.log
def recorded_log(self, values):
    log(self, values)
    wall, cpu = time.perf_counter(), time.process_time()
    acc, loss = [float(a) for a in values["client_acc"]], [float(v) for v in values["client_loss"]]
    sizes = state["test_sizes"]
    correct = [round(a * n) for a, n in zip(acc, sizes)]
    row = {"round": values["rounds"] + 1, "accuracy_weighted": sum(correct) / sum(sizes),
           "accuracy_mean": float(numpy.mean(acc)), "loss": float(numpy.mean(loss)), "accuracy_per_client": acc,
           "loss_per_client": loss, "correct_per_client": correct, "test_examples": sizes,
           "wall_seconds": wall - state["wall"], "cpu_seconds": cpu - state["cpu"]}
    state.update(wall=wall, cpu=cpu)
    with open(rows_file, "a") as out:
        out.write(json.dumps(row) + "\n")
display.ExperimentLogger.log = recorded_log
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def check_reference(path: Path) -> Path:
    """``path`` resolved, when it is a checkout of DangDang1895/MH-pFL outside this repository.

    Raises:
        ConfigError: a file of :data:`REFERENCE_FILES` is missing, ``dataset.py`` has no
            ``get_classes`` or ``display.py`` no ``ExperimentLogger`` (what :data:`BOOTSTRAP` replaces
            or observes), or ``path`` is this repository or inside it.
    """
    reference = path.resolve()
    if ROOT in (reference, *reference.parents):
        raise ConfigError(f"--reference {reference} is inside this repository; use a checkout outside it")
    missing = [f for f in REFERENCE_FILES if not (reference / f).is_file()]
    if missing:
        raise ConfigError(
            f"--reference {reference}: no {', '.join(missing)} (expected a checkout of DangDang1895/MH-pFL)"
        )
    for file, name in (("dataset.py", "def get_classes("), ("display.py", "class ExperimentLogger")):
        if name not in (reference / file).read_text(errors="replace"):
            raise ConfigError(f"--reference {reference}: {file} has no {name!r}, which this tool replaces or observes")
    return reference


def check_followable(config: dict, script: str) -> None:
    """Refuse a run config that ``script`` cannot run as ours would.

    Their scripts hard-code what ours make keys: local SGD momentum 0.9 and gradient clip 50, every
    client every step in a random order, one copy of the same CNN per client (``--only-cnn True``, our
    ``mh-lenet``), no augmentation, Adam at the server; integer flags ``--grad-clip`` and ``--temp``.

    Raises:
        ConfigError: naming each key whose value they cannot take, and the value they need.
    """
    method = SCRIPTS[script]
    options = method_options(config, method)
    needs = {
        "method": (config["method"], method),
        "dataset": (config["dataset"], config["dataset"] if config["dataset"] in DATASETS else " or ".join(DATASETS)),
        "model-group": (config["model-group"], "mh-lenet"),
        "momentum": (config["momentum"], 0.9),
        "clip-norm": (config["clip-norm"], 50.0),
        "fraction-train": (config["fraction-train"], 1.0),
        "augment": (config["augment"], "none"),
        f"{method}.schedule": (options["schedule"], "sequential"),
        f"{method}.server-clip-norm": (
            options["server-clip-norm"],
            options["server-clip-norm"] if float(options["server-clip-norm"]).is_integer() else "a whole number",
        ),
    }
    if method == "mh-pfedhngd":
        t = options["kd-temperature"]
        needs[f"{method}.global-model"] = (options["global-model"], "lenet")
        needs[f"{method}.kd-temperature"] = (t, t if float(t).is_integer() else "a whole number")
        needs["aggregation"] = (config["aggregation"], "mean")
    wrong = [f"{key} = {got!r} (theirs: {need})" for key, (got, need) in needs.items() if got != need]
    if wrong:
        raise ConfigError(f"{script}.py cannot follow this run config: " + "; ".join(wrong))


def their_argv(config: dict, script: str, seed: int, save_dir: Path) -> list[str]:
    """The flags of their ``<script>.py`` for ``config`` (:func:`check_followable` first).

    ``--data-path`` is a placeholder (``get_classes`` is replaced, nothing reads it);
    ``--data-distribution incomplete_label`` selects ``get_classes``. Steps are
    ``num-server-rounds``, ``--seed`` the training ``seed``, ``--save-dir`` where their best-accuracy
    JSON and per-step figure go.

    Raises:
        ConfigError: as :func:`check_followable`.
    """
    check_followable(config, script)
    method = SCRIPTS[script]
    o = method_options(config, method)
    argv = [
        *("--data-name", config["dataset"], "--data-path", "unused-get_classes-is-replaced"),
        *("--data-distribution", "incomplete_label", "--num-nodes", str(config["num-clients"])),
        *("--only-cnn", "True", "--cuda", "-1", "--optim", "adam", "--lr", str(o["server-lr"])),
        *("--grad-clip", str(int(o["server-clip-norm"])), "--embed-dim", str(o["embedding-dim"])),
        *("--hidm", str(o["hidden-dim"]), "--hidden-layers", str(HIDDEN_LAYERS)),
        *("--hnet-output-size", str(o["chunk-size"]), "--norm-var", str(o["embedding-std"])),
        *("--batch-size", str(config["batch-size"]), "--inner-steps", str(config["local-epochs"])),
        *("--inner-lr", str(config["lr"]), "--inner-wd", str(config["weight-decay"]), "--topk", "False"),
        *("--train-clients", "-1", "--save-model", "False", "--num-steps", str(config["num-server-rounds"])),
        *("--seed", str(seed), "--save-dir", str(save_dir)),
    ]
    if method == "mh-pfedhngd":
        argv += ["--alpha", str(o["kd-alpha"]), "--temp", str(int(o["kd-temperature"]))]
    return argv


def parse_steps(text: str) -> list[dict]:
    """Their printed steps from their stdout: ``[{"round": r, "loss": AVG Loss, "accuracy": AVG Acc}]``
    (floats as printed, 4 decimals; accuracy a fraction), in print order.

    A line is read wherever the step text starts in it (tqdm's bar and terminal control characters
    may precede it); a line cut off before its accuracy's 4th decimal is not a step.
    """
    rows = []
    for line in text.replace("\r", "\n").splitlines():
        if m := STEP_LINE.search(line.rstrip()):
            rows.append({"round": int(m.group(1)), "loss": float(m.group(2)), "accuracy": float(m.group(3))})
    return rows


def their_normalization(reference: Path, data_name: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """``(mean, std)`` of the ``transforms.Normalize`` their ``dataset.get_classes`` builds for
    ``data_name``, read from their source (the ``normalization = transforms.Normalize(...)`` in the
    ``data_name == '<data_name>'`` branch).

    Raises:
        ConfigError: ``get_classes`` has no such branch with literal constants.
    """
    tree = ast.parse((reference / "dataset.py").read_text())
    for function in tree.body:
        if not (isinstance(function, ast.FunctionDef) and function.name == "get_classes"):
            continue
        for node in ast.walk(function):
            test = node.test if isinstance(node, ast.If) else None
            values = [getattr(c, "value", None) for c in test.comparators] if isinstance(test, ast.Compare) else []
            if values != [data_name]:
                continue
            for stmt in node.body:
                call = stmt.value if isinstance(stmt, ast.Assign) else None
                if isinstance(call, ast.Call) and getattr(call.func, "attr", None) == "Normalize":
                    mean, std = (ast.literal_eval(a) for a in call.args[:2])
                    return tuple(map(float, mean)), tuple(map(float, std))
    raise ConfigError(f"{reference / 'dataset.py'}: get_classes builds no Normalize for {data_name!r}")


def check_normalisation(config: dict, reference: Path, partitions: Path) -> dict:
    """Their transform (``ToTensor`` + ``Normalize`` with :func:`their_normalization`, on each of our
    uint8 images as a PIL image, as torchvision's CIFAR datasets give it) against the float32 images
    written to ``partitions`` (our ``normalize``), every image of every client's train and test
    split. Kept in ``partitions/normalisation.json`` for the same partitions and constants.

    Returns:
        ``{"their_transform": repr, "images_checked", "max_abs_diff_vs_our_normalize",
        "bitwise_equal", "shape_dtype": [[C, H, W], dtype], "content_digest"}``.
    """
    import torch
    from PIL import Image
    from torchvision import transforms

    from common.config import RunConfig
    from common.data import DataSpec, load_client_data

    mean, std = their_normalization(reference, config["dataset"])
    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize(mean, std)])
    digest = json.loads((partitions / "config.json").read_text())["content_digest"]
    done = partitions / "normalisation.json"
    if done.exists():
        kept = json.loads(done.read_text())
        if kept["content_digest"] == digest and kept["their_transform"] == repr(transform):
            return kept
    cfg = RunConfig.from_dict(config)
    spec = DataSpec.from_config(cfg, cfg.num_clients)
    worst, count, equal, first = 0.0, 0, True, None
    for i in range(cfg.num_clients):
        data = load_client_data(spec, i)
        for split, raw in (("train", data.train_x), ("test", data.test_x)):
            ours = torch.from_numpy(np.load(partitions / split / f"{i}.npz", allow_pickle=True)["data"].item()["x"])
            theirs = torch.stack([transform(Image.fromarray(img.permute(1, 2, 0).numpy())) for img in raw])
            first = first or [list(theirs.shape[1:]), str(theirs.dtype)]
            equal = equal and theirs.dtype == ours.dtype and torch.equal(theirs, ours)
            worst = max(worst, float((theirs - ours).abs().max()) if len(raw) else 0.0)
            count += len(raw)
    result = {
        "their_transform": repr(transform),
        "images_checked": count,
        "max_abs_diff_vs_our_normalize": worst,
        "bitwise_equal": equal,
        "shape_dtype": first,
        "content_digest": digest,
    }
    done.write_text(json.dumps(result, indent=1))
    return result


def run_authors(reference: Path, config: dict, script: str, seed: int, partitions: Path, out: Path) -> dict:
    """Run their ``<script>.py`` for one training seed into ``out`` (``seed-<s>/``), or reuse its
    finished run (``authors.json``: same flags, same partitions, same script content).

    Rows are appended to ``out/authors.rounds.jsonl`` per step as it ends (restarted with the run);
    their stdout and stderr go to ``out/authors.log``.

    Returns:
        ``authors.json``'s content: per round 1..R (lists) ``curve`` (pooled accuracy, fraction),
        ``accuracy_mean``, ``loss`` (theirs), ``accuracy_per_client``, ``round_wall_seconds``,
        ``round_cpu_seconds``; ``printed_steps`` (:func:`parse_steps`), ``their_argv``,
        ``command``, ``commit``, ``script_sha256``, ``content_digest``, ``test_examples``,
        ``wall_seconds``, ``cpu_seconds`` (the whole process, setup included), ``peak_pss_gib``, ``torch_threads``,
        ``torch_version`` (this interpreter's, which runs theirs).

    Raises:
        RuntimeError: the run ended before step R (exit code and log tail), or a recorded pooled
            accuracy differs from their printed one by more than its rounding.
    """
    import torch

    rounds = config["num-server-rounds"]
    written = json.loads((partitions / "config.json").read_text())
    script_file = reference / f"{script}.py"
    argv = their_argv(config, script, seed, out / "Output")
    sha = hashlib.sha256(script_file.read_bytes()).hexdigest()
    done = out / "authors.json"
    if done.exists():
        saved = json.loads(done.read_text())
        if (saved["their_argv"], saved["content_digest"], saved["script_sha256"]) == (
            argv,
            written["content_digest"],
            sha,
        ):
            return saved
    out.mkdir(parents=True, exist_ok=True)
    recorded = out / "authors.rounds.jsonl"
    recorded.unlink(missing_ok=True)  # no checkpoint of theirs: a new run starts at step 1
    env = {
        **os.environ,
        PARTITIONS_VARIABLE: str(partitions.resolve()),
        ROWS_VARIABLE: str(recorded.resolve()),
        THREADS_VARIABLE: str(CLIENT_THREADS),
        "OMP_NUM_THREADS": str(CLIENT_THREADS),
    }
    command = [sys.executable, "-c", BOOTSTRAP, script_file.name, *argv]
    log = out / "authors.log"
    code, wall, cpu, peak_pss, _ = run_measured(command, reference, log, env)
    rows = [json.loads(line) for line in recorded.read_text().splitlines()] if recorded.exists() else []
    text = log.read_text(errors="replace")
    if code != 0 or [r["round"] for r in rows] != list(range(1, rounds + 1)):
        raise RuntimeError(f"{script} seed {seed} ended with exit code {code} after {len(rows)} steps:\n{text[-2000:]}")
    printed = parse_steps(text)
    off = [
        (p["round"], p["accuracy"], r["accuracy_weighted"])
        for p, r in zip(printed, rows, strict=False)
        if abs(p["accuracy"] - r["accuracy_weighted"]) > PRINTED_HALF_STEP + 1e-12
    ]
    if len(printed) != rounds or off:
        raise RuntimeError(f"{script} seed {seed}: {len(printed)} printed steps; printed vs recorded pooled: {off}")
    result = {
        "script": f"{script}.py",
        "seed": seed,
        "curve": [r["accuracy_weighted"] for r in rows],
        "accuracy_mean": [r["accuracy_mean"] for r in rows],
        "loss": [r["loss"] for r in rows],
        "accuracy_per_client": [r["accuracy_per_client"] for r in rows],
        "round_wall_seconds": [r["wall_seconds"] for r in rows],
        "round_cpu_seconds": [r["cpu_seconds"] for r in rows],
        "printed_steps": printed,
        "their_argv": argv,
        "command": " ".join([Path(sys.executable).name, "-c", "<BOOTSTRAP>", script_file.name, *argv]),
        "commit": git_head(reference),
        "script_sha256": sha,
        "content_digest": written["content_digest"],
        "test_examples": rows[0]["test_examples"],
        "wall_seconds": wall,
        "cpu_seconds": cpu,
        "peak_pss_gib": peak_pss / 2**30,
        "torch_threads": CLIENT_THREADS,
        # the same curve differs by a few test images between PyTorch builds (their kernels' rounding)
        "torch_version": torch.__version__,
    }
    atomic_write(done, lambda f: f.write(json.dumps(result, indent=1).encode()))
    return result


def our_mean_curve(ours: dict) -> list[float]:
    """``accuracy_mean`` by round of the run :func:`bench.our_side.run_ours` returned (its folder's rows)."""
    return [r["accuracy_mean"] for r in read_rows(Path(ours["folder"]))]


def write_report(out: Path, info: dict, authors: list[dict], ours: list[dict]) -> None:
    """``out/report.md`` and ``out/<script>.png`` from one result per seed of each side (same seeds,
    same order): final, best and largest gap (:func:`bench.crosscheck_report.compare`) of the
    pooled accuracy and the mean over clients, the per-round mean over seeds, commits and CPU time."""
    script, rounds, seeds = info["script"], info["rounds"], info["seeds"]
    theirs = {"pooled": [a["curve"] for a in authors], "mean": [a["accuracy_mean"] for a in authors]}
    mine = {"pooled": [o["curve"] for o in ours], "mean": [our_mean_curve(o) for o in ours]}
    norm = info["normalisation"]
    lines = [
        f"# {script}: ours against the authors' code on identical partitions",
        "",
        f"Command: `{info['command']}`  ",
        f"Setting: `{info['preset']}`, `partition-seed` {info['partition_seed']} for both sides, {rounds} rounds,"
        f" training seeds {seeds}; test examples pooled over clients: {sum(authors[0]['test_examples'])}.  ",
        f"Authors: DangDang1895/MH-pFL at {info['reference_commit']}, `{script}.py` (sha256"
        f" {authors[0]['script_sha256'][:12]}) run unmodified by `bench.mhpfedhn_authors` (their"
        " `dataset.get_classes` replaced by our partitions; their transform, loaders, models, hypernetwork,"
        f" evaluation), {CLIENT_THREADS} torch thread; their normalisation of our images bitwise equal to ours:"
        f" {norm['bitwise_equal']} ({norm['images_checked']} images,"
        f" max |diff| {norm['max_abs_diff_vs_our_normalize']}).  ",
        f"Ours: commit {info['commit']}, `{ours[0]['command']}` (seed and output folder per seed).",
        "",
        "| metric | ours final | authors final | ours best | authors best | largest gap (round) |",
        "|---|---|---|---|---|---|",
    ]
    for label, key in (("pooled (`accuracy_weighted`, their AVG Acc)", "pooled"), ("mean over clients", "mean")):
        c = compare(mine[key], theirs[key])
        o, t = c["ours"], c["reference"]
        lines.append(
            f"| {label} | {100 * o['final_mean']:.2f} ± {100 * o['final_std']:.2f} | {100 * t['final_mean']:.2f} ±"
            f" {100 * t['final_std']:.2f} | {100 * o['best_mean']:.2f} ± {100 * o['best_std']:.2f} |"
            f" {100 * t['best_mean']:.2f} ± {100 * t['best_std']:.2f} |"
            f" {100 * c['largest_gap']:+.2f} ({c['largest_gap_round']}) |"
        )
    cpu = lambda runs: " + ".join(f"{r['cpu_seconds']:.0f}" for r in runs)  # noqa: E731
    lines += [
        "",
        "Accuracy in %, mean ± population std over seeds (ddof 0); gap = ours − authors of the mean curves."
        f" Figure: `{script}.png` (mean line, min-max band).",
        f"CPU seconds per seed, authors (one process): {cpu(authors)}; ours (process tree): {cpu(ours)}.",
        "",
        "Per round, mean over seeds (%):",
        "",
        "| round | ours pooled | authors pooled | ours mean over clients | authors mean over clients |",
        "|---|---|---|---|---|",
    ]
    means = {k: (np.mean(mine[k], axis=0), np.mean(theirs[k], axis=0)) for k in mine}
    for r in range(rounds):
        lines.append(
            f"| {r + 1} | {100 * means['pooled'][0][r]:.2f} | {100 * means['pooled'][1][r]:.2f} |"
            f" {100 * means['mean'][0][r]:.2f} | {100 * means['mean'][1][r]:.2f} |"
        )
    lines += [
        "",
        "Rows: `seed-<s>/authors.json` (their curves, per-client accuracies, flags, timing),"
        " `seed-<s>/authors.rounds.jsonl` (one row per step, written as it ran), `seed-<s>/authors.log`"
        " (their stdout), and our run folder under `seed-<s>/`.",
        "",
    ]
    atomic_write(out / "report.md", lambda f: f.write("\n".join(lines).encode()))
    plot(script, mine["pooled"], theirs["pooled"], out / f"{script}.png", reference_name="authors' MH-pFL")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_config_arguments(parser)
    parser.add_argument("--reference", type=Path, required=True, help="a checkout of DangDang1895/MH-pFL (outside)")
    parser.add_argument("--script", required=True, choices=tuple(SCRIPTS), help="their script to run")
    parser.add_argument("--seeds", default="0,1,2", help="training seeds (default 0,1,2)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default: the config's num-server-rounds)")
    parser.add_argument("--out", type=Path, default=None, help="default outputs/authors/<script>-<preset stem>")
    args = parser.parse_args(argv)
    with stop_on_signals():
        try:
            reference = check_reference(args.reference)
            seeds = [int(s) for s in args.seeds.split(",") if s]
            if not seeds or (args.rounds is not None and args.rounds < 1):
                raise ConfigError("--seeds needs at least one value, --rounds at least 1")
            base, _ = read_config(args.preset, args.run_config)
            pinned = {
                "method": SCRIPTS[args.script],
                "partition-seed": base["partition-seed"] if base["partition-seed"] >= 0 else seeds[0],
                "stop-patience": 0,  # every round on both sides
            }
            if args.rounds is not None:
                pinned["num-server-rounds"] = args.rounds
            items = [*args.run_config, " ".join(f"{k}={json.dumps(v)}" for k, v in pinned.items())]
            config, _ = read_config(args.preset, items)
            check_followable(config, args.script)
        except (ConfigError, ValueError) as exc:
            print(f"error: {exc}")
            return 2
        stem = Path(args.preset).stem if args.preset else "config"
        out = (args.out or ROOT / "outputs" / "authors" / f"{args.script}-{stem}").resolve()
        out.mkdir(parents=True, exist_ok=True)
        partitions = out / "partitions"
        print(f"writing partitions to {partitions}", flush=True)
        write_partitions(config, partitions)
        normalisation = check_normalisation(config, reference, partitions)
        print(f"normalisation: {json.dumps(normalisation)}", flush=True)
        if not normalisation["bitwise_equal"]:
            print("error: their transform of our images differs from the images written; not comparable")
            return 1
        info = {
            "command": "python -m bench.mhpfedhn_authors " + " ".join(argv if argv is not None else sys.argv[1:]),
            "commit": git_commit(),
            "reference_commit": git_head(reference),
            "script": args.script,
            "preset": args.preset,
            "partition_seed": config["partition-seed"],
            "rounds": config["num-server-rounds"],
            "seeds": seeds,
            "normalisation": normalisation,
        }
        authors, ours = [], []
        try:
            for seed in seeds:
                print(f"{args.script}, seed {seed}: authors", flush=True)
                authors.append(run_authors(reference, config, args.script, seed, partitions, out / f"seed-{seed}"))
                print(f"{args.script}, seed {seed}: ours", flush=True)
                ours.append(run_ours(items, args.preset, seed, out / f"seed-{seed}"))
                write_report(out, {**info, "seeds": seeds[: len(authors)]}, authors, ours)
        except RuntimeError as exc:
            print(f"error: {exc}")
            return 1
        except KeyboardInterrupt:
            print(f"interrupted; finished seeds are kept in {out} and reused when the command is given again")
            return 130
    print(f"report: {out / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
