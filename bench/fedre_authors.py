"""FedRE's Table 12 with the authors' own loop: their PFLlib-tree FedRE and PFLlib's Local on our partitions.

Usage (from the repository root; both references are checkouts *outside* this repository, never
copied into it: https://github.com/AIResearch-Group/FedRE and https://github.com/TsingZ0/PFLlib):

    uv run --frozen --extra crosscheck python -m bench.fedre_authors \\
        --fedre ../FedRE --pfllib ../PFLlib --preset presets/fedre-table12-cifar10.toml \\
        --seeds 0,1,2 [--rounds 100] [--out outputs/authors/fedre-table12-cifar10] \\
        [--sides fedre,local] [--ours "ours (server)=results/fedre-table12-cifar10-100/fedre-seed{seed}"]

The paper's Table 12 (model-homogeneous FedAvgCNN) comes from the authors' PFLlib tree
(``PFLlib/system/flcore/servers/serverre.py``), whose server head *is* client 0's head object and is
sent to every client each round (docs/methods/fedre.md, P1 and P2). Its ``FedRE.train()`` prints
"Evaluate personalized models" but, in the released tree, never evaluates; one stored version of
that file (AIResearch-Group/FedRE 0ccb6fb) has ``self.evaluate()`` on the next line. This tool runs
their ``main.py`` unmodified except for restoring that one call (:data:`BOOTSTRAP`, which compiles
``serverre.py`` with the call put back, and refuses a tree where the print is not found exactly once),
and runs PFLlib's ``Local`` (``-algo Local -m CNN``: the same FedAvgCNN) as the control. Both read
our partitions, written once in PFLlib's layout by :func:`bench.pfllib.write_partitions` (the
preset's data protocol: pool, partitioner, ``partition-seed``, 75/25 split, normalisation).

What is set from outside, and why:

- every seeding call of theirs (``torch.manual_seed``, ``numpy.random.seed``, ``random.seed``; the
  FedRE tree's ``set_random_seed(2)`` and both trees' per-client ``torch.manual_seed(0)``) is given
  the training seed, so seeds vary the initial weights and the batch order as ours do;
- a server module of another algorithm whose imports fail here (PFLlib's FedPAC needs cvxpy) is
  replaced by a placeholder that raises that import error if used;
- torch uses one thread (the FedRE tree's own ``set_random_seed`` does so; PFLlib's Local is given
  the same, as each of our clients has);
- every evaluation's pooled and per-client test accuracy is appended, at full precision, to
  ``<side>-seed-<s>.rounds.jsonl`` as it happens (their stdout rounds to 4 decimals), by wrapping
  their ``Server.evaluate``; nothing else of theirs is touched.

Their iteration ``i`` evaluates after ``i`` rounds of training and after the server's broadcast (for
FedRE: client 0's trained head after the server step), as our row ``i`` does.

A finished side-seed (``<side>-seed-<s>.json``) is kept and skipped when the command is given again
with the same command line and partitions; the authors' loop has no checkpoint, so an interrupted
run starts again (one run is about half an hour here).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from bench.measure import git_head, run_measured
from bench.our_side import method_options
from bench.pfllib import PLACEHOLDER_SERVERS, write_partitions
from common.errors import ConfigError
from common.files import atomic_write, read_rows
from tools.grid import git_commit
from tools.processes import stop_on_signals
from tools.runconfig import ROOT, add_config_arguments, read_config

#: the environment variables :data:`BOOTSTRAP` reads
SEED_VARIABLE = "AUTHORS_SEED"
ROUNDS_VARIABLE = "AUTHORS_ROUNDS_FILE"
RESTORE_VARIABLE = "AUTHORS_RESTORE_EVALUATE"

#: the print in the FedRE tree's ``FedRE.train()`` after which 0ccb6fb calls ``self.evaluate()``
EVALUATE_ANCHOR = 'print("\\nEvaluate personalized models")'

#: runs ``main.py`` (argv[1:]) in a tree's ``system/`` folder (see the module docstring)
BOOTSTRAP = (
    r"""
import json, os, random, re, sys, types
import numpy, torch
seed = int(os.environ["AUTHORS_SEED"])
for owner, name in ((torch, "manual_seed"), (numpy.random, "seed"), (random, "seed")):
    original = getattr(owner, name)
    setattr(owner, name, lambda *args, _original=original, **kwargs: _original(seed))
torch.set_num_threads(1)
sys.argv = sys.argv[1:]
sys.path.insert(0, ".")
if os.environ.get("AUTHORS_RESTORE_EVALUATE"):
    path = "flcore/servers/serverre.py"
    source = open(path).read()
    anchor = os.environ["AUTHORS_RESTORE_EVALUATE"]
    lines = [line for line in source.splitlines() if line.strip() == anchor]
    if len(lines) != 1:
        sys.exit(f"fedre_authors: {path} has {len(lines)} lines {anchor!r}, expected 1")
    indent = lines[0][: len(lines[0]) - len(lines[0].lstrip())]
    source = source.replace(lines[0], lines[0] + "\n" + indent + "self.evaluate()", 1)
    module = types.ModuleType("flcore.servers.serverre")
    module.__file__ = os.path.abspath(path)
    exec(compile(source, path, "exec"), module.__dict__)
    sys.modules["flcore.servers.serverre"] = module
"""
    + PLACEHOLDER_SERVERS
    + r"""from flcore.servers import serverbase
test_metrics, evaluate = serverbase.Server.test_metrics, serverbase.Server.evaluate
def recorded_test_metrics(self):
    self._recorded = test_metrics(self)
    return self._recorded
def recorded_evaluate(self, *args, **kwargs):
    result = evaluate(self, *args, **kwargs)
    _, samples, correct = self._recorded[:3]
    row = {"round": len(self.rs_test_acc) - 1, "accuracy_weighted": float(sum(correct)) / sum(samples),
           "accuracy_per_client": [float(c) / n for c, n in zip(correct, samples)], "test_examples": samples}
    with open(os.environ["AUTHORS_ROUNDS_FILE"], "a") as out:
        out.write(json.dumps(row) + "\n")
    return result
serverbase.Server.test_metrics, serverbase.Server.evaluate = recorded_test_metrics, recorded_evaluate
exec(compile(open("main.py").read(), "main.py", "exec"), {"__name__": "__main__", "__file__": "main.py"})
"""
)


def authors_command(config: dict, side: str, dataset_name: str) -> list[str]:
    """``main.py`` flags of ``side`` (``fedre``: the FedRE tree; ``local``: PFLlib) for ``config``.

    The FedRE tree's server step is hard-coded (SGD lr 0.001 on the summed loss, one epoch), which
    equals ours (mean at ``fedre.server-lr`` 0.01) at a server batch of 10 (docs/methods/fedre.md P6);
    ``-sbs`` passes our ``fedre.server-batch-size``.
    """
    common = [
        *("-data", dataset_name, "-dev", "cpu", "-gr", str(config["num-server-rounds"])),
        *("-nc", str(config["num-clients"]), "-jr", str(config["fraction-train"])),
        *("-lbs", str(config["batch-size"]), "-lr", str(config["lr"]), "-ls", str(config["local-epochs"])),
        *("-eg", "1", "-t", "1"),
    ]
    if side == "fedre":
        return [
            "main.py",
            "-algo",
            "FedRE",
            "-m",
            "cnn",
            "-nb",
            "10",
            "-sbs",
            str(method_options(config, "fedre")["server-batch-size"]),
            *common,
        ]
    return ["main.py", "-algo", "Local", "-m", "CNN", "-ncl", "10", *common]


def run_authors(tree: Path, config: dict, side: str, seed: int, partitions: Path, out: Path) -> dict:
    """Run one side for one training seed, or reuse its finished run (same command, same partitions).

    Returns:
        ``{"curve": [pooled accuracy, fraction, rounds 1..R], "initial": round 0's, "mean_curve":
        [unweighted mean over clients by round], "test_examples", "command", "commit",
        "content_digest", "wall_seconds", "cpu_seconds", "peak_pss_gib"}`` (also in ``<side>-seed-<seed>.json``).

    Raises:
        RuntimeError: the run ended before evaluating round R (exit code and log tail in the message).
    """
    rounds = config["num-server-rounds"]
    digest, name, args = _identity(config, side, partitions)
    saved = finished_run(config, side, seed, partitions, out)
    if saved is not None:
        return saved
    link = tree / "dataset" / name
    link.parent.mkdir(exist_ok=True)
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(partitions.resolve(), target_is_directory=True)
    recorded = out / f"{side}-seed-{seed}.rounds.jsonl"
    recorded.unlink(missing_ok=True)
    env = {**os.environ, SEED_VARIABLE: str(seed), ROUNDS_VARIABLE: str(recorded.resolve())}
    if side == "fedre":
        env[RESTORE_VARIABLE] = EVALUATE_ANCHOR
    log = out / f"{side}-seed-{seed}.log"
    code, wall, cpu, peak_pss, _ = run_measured([sys.executable, "-c", BOOTSTRAP, *args], tree / "system", log, env)
    rows = [json.loads(line) for line in recorded.read_text().splitlines()] if recorded.exists() else []
    by_round = {r["round"]: r for r in rows}
    if code != 0 or any(r not in by_round for r in range(rounds + 1)):
        tail = log.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"{side} seed {seed} ended with exit code {code} after {len(rows)} evaluations:\n{tail}")
    result = {
        "curve": [by_round[r]["accuracy_weighted"] for r in range(1, rounds + 1)],
        "initial": by_round[0]["accuracy_weighted"],
        "mean_curve": [float(np.mean(by_round[r]["accuracy_per_client"])) for r in range(1, rounds + 1)],
        "test_examples": sum(by_round[0]["test_examples"]),
        "command": args,
        "commit": git_head(tree),
        "content_digest": digest,
        "wall_seconds": wall,
        "cpu_seconds": cpu,
        "peak_pss_gib": peak_pss / 2**30,
    }
    atomic_write(out / f"{side}-seed-{seed}.json", lambda f: f.write(json.dumps(result, indent=1).encode()))
    return result


def _identity(config: dict, side: str, partitions: Path) -> tuple[str, str, list[str]]:
    """The partitions' content digest, the dataset name PFLlib reads them by, and ``side``'s flags."""
    digest = json.loads((partitions / "config.json").read_text())["content_digest"]
    # PFLlib picks FedAvgCNN's flattened width by "Cifar10" in the dataset name
    name = f"Cifar10-mheterofl-{digest[:12]}"
    return digest, name, authors_command(config, side, name)


def finished_run(config: dict, side: str, seed: int, partitions: Path, out: Path) -> dict | None:
    """``side``'s finished run for ``seed`` in ``out`` (as :func:`run_authors` returns it) when it ran
    the same flags on the same partitions (by content digest), else None."""
    digest, _, args = _identity(config, side, partitions)
    done = out / f"{side}-seed-{seed}.json"
    if not done.exists():
        return None
    saved = json.loads(done.read_text())
    return saved if saved["command"] == args and saved["content_digest"] == digest else None


def _time_line(side: str, seed: int, run: dict) -> str:
    """``<side> seed <s> <wall> min wall, <cpu> min CPU`` of a run (:func:`run_authors`'s dict)."""
    return f"{side} seed {seed} {run['wall_seconds'] / 60:.0f} min wall, {run['cpu_seconds'] / 60:.0f} min CPU"


def our_curve(folder: Path, rounds: int) -> list[float] | None:
    """``accuracy_weighted`` by round 1..R of the newest completed run under ``folder`` (a grid
    cell or a run folder); None when none reached R rounds."""
    runs = sorted(p.parent for p in folder.glob("**/summary.json"))
    for run in reversed(runs):
        rows = read_rows(run)
        if len(rows) >= rounds and all(r.get("accuracy_weighted") is not None for r in rows[:rounds]):
            return [r["accuracy_weighted"] for r in rows[:rounds]]
    return None


def stats(curves: list[list[float]]) -> dict:
    """Final and best accuracy (%; mean and sample std over seeds, ddof 1 as our reports)."""
    x = 100 * np.asarray(curves, dtype=float)
    std = lambda v: float(v.std(ddof=1)) if len(v) > 1 else 0.0  # noqa: E731
    return {
        "final": float(x[:, -1].mean()),
        "final_std": std(x[:, -1]),
        "best": float(x.max(axis=1).mean()),
        "best_std": std(x.max(axis=1)),
        "n": len(x),
    }


def final(curve: list[float]) -> float:
    """A curve's last round."""
    return curve[-1]


def paired_gap(
    side: dict[int, list[float]], other: dict[int, list[float]], at: Callable[[list[float]], float] = final
) -> tuple[float, float | None, int] | None:
    """The paired (same seed) gap ``at(side) - at(other)`` in points over the seeds both have: (mean,
    sample std or None for one seed, seeds), or None when they share no seed. ``at``: :func:`final` or
    ``max`` (best round); curves are fractions by round."""
    gaps = [100 * (at(side[s]) - at(other[s])) for s in sorted(side) if s in other]
    if not gaps:
        return None
    return float(np.mean(gaps)), (float(np.std(gaps, ddof=1)) if len(gaps) > 1 else None), len(gaps)


def write_report(out: Path, info: dict, sides: dict[str, dict[int, list[float]]]) -> None:
    """``out/report.md``: per side final and best pooled accuracy over seeds, and every side's
    paired (same seed, same partition) gap in final and in best accuracy to the authors' FedRE and
    to PFLlib's Local."""
    seeds = info["seeds"]
    lines = [
        "# FedRE Table 12 with the authors' loop, on our partition",
        "",
        f"Command: `{info['command']}`  ",
        f"Ours: commit {info['commit']}. FedRE tree: {info['fedre_commit']} (PFLlib/, `self.evaluate()` restored after"
        f" the print in `FedRE.train()`, nothing else changed); PFLlib: {info['pfllib_commit']} (`Local`).  ",
        f"Setting: `{info['preset']}` (partition-seed {info['partition_seed']}), {info['rounds']} rounds, training"
        f" seeds {seeds}; test examples pooled over clients: {info['test_examples']} (one image ="
        f" {100 / info['test_examples']:.4f} points). Accuracy: pooled over clients' test splits, %, mean ± sample"
        " std over seeds.",
        "",
        "| side | seeds | final | best | final − authors' FedRE (paired) | final − PFLlib Local (paired) |"
        " best − authors' FedRE (paired) | best − PFLlib Local (paired) |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def paired(side: dict[int, list[float]], other: dict[int, list[float]], at=final) -> str:
        gap = paired_gap(side, other, at)
        if gap is None:
            return "-"
        mean, std, n = gap
        return f"{mean:+.2f}{'' if std is None else f' ± {std:.2f}'} (n={n})"

    for label, curves in sides.items():
        if not curves:
            lines.append(f"| {label} | none | - | - | - | - | - | - |")
            continue
        s = stats([curves[k] for k in sorted(curves)])
        lines.append(
            f"| {label} | {','.join(map(str, sorted(curves)))} | {s['final']:.2f} ± {s['final_std']:.2f} | "
            f"{s['best']:.2f} ± {s['best_std']:.2f} | {paired(curves, sides[FEDRE_LABEL])} | "
            f"{paired(curves, sides[LOCAL_LABEL])} | {paired(curves, sides[FEDRE_LABEL], max)} | "
            f"{paired(curves, sides[LOCAL_LABEL], max)} |"
        )
    lines += ["", "Per seed, pooled accuracy (%), best round / final:", ""]
    lines += ["| side | " + " | ".join(f"seed {s}" for s in seeds) + " |", "|---|" + "---|" * len(seeds)]
    for label, curves in sides.items():
        cells = [f"{100 * max(curves[s]):.2f} / {100 * curves[s][-1]:.2f}" if s in curves else "-" for s in seeds]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "Time (this machine, one thread each): " + "; ".join(info["times"]) + ".", ""]
    lines += [
        "Rows: `fedre-seed-<s>.json`, `local-seed-<s>.json` (curves, command, timing) and `*.rounds.jsonl`"
        " (every evaluation: pooled and per-client accuracy).",
        "",
    ]
    atomic_write(out / "report.md", lambda f: f.write("\n".join(lines).encode()))


#: label -> folder pattern (``{seed}``) of each ``--ours`` run set of the last call, beside the report
OURS_FILE = "ours.json"
FEDRE_LABEL = "authors' FedRE (PFLlib tree)"
LOCAL_LABEL = "PFLlib Local"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_config_arguments(parser)
    parser.add_argument(
        "--fedre", type=Path, required=True, help="a checkout of AIResearch-Group/FedRE (outside this repo)"
    )
    parser.add_argument("--pfllib", type=Path, required=True, help="a checkout of TsingZ0/PFLlib (outside this repo)")
    parser.add_argument("--seeds", default="0,1,2", help="training seeds (default 0,1,2)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default: the config's num-server-rounds)")
    parser.add_argument(
        "--sides",
        default="fedre,local",
        help="which sides to run: fedre, local or both (default); the report shows every finished run in --out, so"
        " two calls with one side each can run side by side on two cores",
    )
    parser.add_argument("--out", type=Path, default=None, help="default outputs/authors/<preset stem>")
    parser.add_argument(
        "--ours",
        action="append",
        default=[],
        metavar="LABEL=FOLDER",
        help="our runs to report beside theirs; FOLDER may hold {seed} (e.g. a grid cell '<grid>/fedre-seed{seed}')",
    )
    args = parser.parse_args(argv)
    with stop_on_signals():
        try:
            trees = {"fedre": args.fedre.resolve() / "PFLlib", "local": args.pfllib.resolve()}
            for flag, tree in (("--fedre", trees["fedre"]), ("--pfllib", trees["local"])):
                if not (tree / "system" / "main.py").is_file():
                    raise ConfigError(f"{flag}: no {tree / 'system' / 'main.py'}")
                if ROOT in (tree, *tree.parents):
                    raise ConfigError(f"{flag}: {tree} is inside this repository; use a checkout outside it")
            seeds = [int(s) for s in args.seeds.split(",") if s]
            run_sides = [s for s in args.sides.split(",") if s]
            if not run_sides or set(run_sides) - {"fedre", "local"}:
                raise ConfigError(f"--sides: {args.sides!r}; allowed: fedre, local or fedre,local")
            ours = dict(item.split("=", 1) for item in args.ours)
            config, _ = read_config(args.preset, args.run_config)
            if config["method"] != "fedre" or config["model-group"] != "fedavgcnn" or config["dataset"] != "cifar10":
                raise ConfigError(
                    "the authors' PFLlib tree runs FedRE with FedAvgCNN on CIFAR-10 only (method, model-group, dataset)"
                )
            if config["partition-seed"] < 0:
                raise ConfigError("run config key 'partition-seed' must be fixed (>= 0): both sides need one partition")
            if args.rounds is not None:
                config["num-server-rounds"] = args.rounds
        except (ConfigError, ValueError) as exc:
            print(f"error: {exc}")
            return 2
        out = (args.out or ROOT / "outputs" / "authors" / Path(args.preset or "config").stem).resolve()
        out.mkdir(parents=True, exist_ok=True)
        # the folders of our runs the report shows, so that its numbers can be regenerated from the rows
        atomic_write(out / OURS_FILE, lambda f: f.write(json.dumps(ours, indent=1).encode()))
        partitions = out / "partitions"
        print(f"writing partitions to {partitions}", flush=True)
        write_partitions(config, partitions)
        rounds = config["num-server-rounds"]
        sides: dict[str, dict[int, list[float]]] = {FEDRE_LABEL: {}, LOCAL_LABEL: {}}
        times, test_examples = [], None
        info = {
            "command": "python -m bench.fedre_authors " + " ".join(argv if argv is not None else sys.argv[1:]),
            "commit": git_commit(),
            "fedre_commit": git_head(trees["fedre"].parent),
            "pfllib_commit": git_head(trees["local"]),
            "preset": args.preset,
            "partition_seed": config["partition-seed"],
            "rounds": rounds,
            "seeds": seeds,
            "times": times,
        }
        failed = []
        try:
            for seed in seeds:
                for side, label in (("fedre", FEDRE_LABEL), ("local", LOCAL_LABEL)):
                    if side not in run_sides:
                        if (kept := finished_run(config, side, seed, partitions, out)) is not None:
                            sides[label][seed], test_examples = kept["curve"], kept["test_examples"]
                            times.append(_time_line(side, seed, kept))
                        continue
                    print(f"{label}, seed {seed}", flush=True)
                    try:
                        result = run_authors(trees[side], config, side, seed, partitions, out)
                    except RuntimeError as exc:
                        print(f"error: {exc}", flush=True)
                        failed.append(f"{side} seed {seed}")
                        continue
                    sides[label][seed] = result["curve"]
                    test_examples = result["test_examples"]
                    times.append(_time_line(side, seed, result))
                    for ours_label, pattern in ours.items():
                        sides[ours_label] = {
                            s: c for s in seeds if (c := our_curve(Path(pattern.format(seed=s)), rounds))
                        }
                    write_report(out, {**info, "test_examples": test_examples}, sides)
        except KeyboardInterrupt:
            print(f"interrupted; finished runs are kept in {out} and reused when the command is given again")
            return 130
    print(f"report: {out / 'report.md'}")
    if failed:
        print(f"error: no run for {', '.join(failed)} (see above)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
