"""Summarise a grid (``tools.grid``): a table per preset with the paper's numbers beside ours, and figures.

Usage (from the repository root):

    uv run --frozen python -m tools.report outputs/grids/<preset> [--out results/<preset>] [--ablation <grid>]
    uv run --frozen python -m tools.report outputs/<run folder>       # one run of tools.run: same figures

Writes ``report.md`` and three PNGs (accuracy vs round, accuracy vs cumulative bytes, the
label distribution of the partitions) into ``--out`` (default: the grid folder). With
``--out`` it also copies ``grid.json`` and each cell's newest ``metrics.jsonl`` and
``summary.json`` there, in the grid's layout, so ``tools.report <out>`` regenerates the same
report from the copies alone.

Ablations: a grid of the same preset started with more ``-c`` overrides (``tools.grid ... -c
"fedre.server-lr=0.0" --out <other folder>``) joins the report with ``--ablation <that folder>``
(repeatable): its cells are copied to ``<out>/ablations/<folder name>/`` and reported as
``<method> (<the overrides it adds>)`` beside the grid's own, in the tables and figures (dotted, in
the method's colour). Every ``ablations/*`` grid under a report folder is read again on
regeneration.

The table, per method over its seeds (mean ± sample std; accuracies in percent):
final and best ``accuracy_mean`` and ``accuracy_weighted``; rounds to the paper's target
accuracy (on the metric the paper reports, named by ``ours`` in ``presets/<preset>.paper.toml``)
and the total bytes (training and evaluation payloads, both ways) until then; training payload
bytes per client-round up/down; the median seconds per round; training FLOPs per client-round (forward +
backward of the client's personal model, counted with ``torch.utils.flop_counter``, times its
training samples and local epochs, averaged over clients; methods that train a second model,
such as FedMRL, FML and FedKD, cost more than this); and the paper's number. Then the verdicts
against the paper and its ranking (:func:`paper_comparison`); with ``local`` in the grid, where
each method is above Local: first round, the final stretch, how many rounds
(:func:`above_baseline`).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.errors import ConfigError
from common.files import ROWS_FILE, read_rows
from tools.grid import GRID_FILE, newest_run, read_grid_info, run_summary
from tools.runconfig import ROOT, app_defaults

FIGURES = ("accuracy_vs_round.png", "accuracy_vs_bytes.png", "label_distribution.png")


@dataclass
class Cell:
    """One (method, seed) run of a grid: its rows (one per round) and summary."""

    method: str
    seed: int
    rows: list[dict]
    summary: dict

    def curve(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """(rounds, values) of the evaluated rounds for row key ``key``."""
        rows = [r for r in self.rows if r.get(key) is not None]
        return np.array([r["round"] for r in rows]), np.array([r[key] for r in rows], dtype=np.float64)

    def cumulative_bytes(self) -> np.ndarray:
        """Total payload bytes (training and evaluation, up and down) after each round."""
        return np.cumsum(
            [r["bytes_up"] + r["bytes_down"] + r["eval_bytes_up"] + r["eval_bytes_down"] for r in self.rows]
        )


def load_grid(grid: Path) -> tuple[dict, list[Cell]]:
    """``grid.json`` and every cell's newest run (cells without a finished round are left out; a cell
    whose summary is unreadable is reported from its rows, its summary saying why).

    Raises:
        ConfigError: ``grid.json`` or a cell's ``metrics.jsonl`` is not what the grid wrote (naming
            the file and line).
    """
    info = read_grid_info(grid)
    cells = []
    for folder, (_, summary, rows) in finished_runs(grid):
        method, seed = folder.name.rsplit("-seed", 1)
        cells.append(Cell(method, int(seed), rows, summary))
    return info, cells


def finished_runs(grid: Path) -> list[tuple[Path, tuple[Path, dict, list[dict]]]]:
    """``(cell folder, (newest run, its summary, its rows))`` for every cell of ``grid`` whose newest
    run (:func:`tools.grid.newest_run`) has at least one finished round; a cell just started is left out.

    Raises:
        ConfigError: a ``metrics.jsonl`` is not what the grid wrote (naming the file and line).
    """
    found = []
    for folder in sorted(p for p in grid.iterdir() if p.is_dir() and "-seed" in p.name):
        newest = newest_run(folder)
        if newest is not None and (newest[0] / ROWS_FILE).is_file():
            rows = read_rows(newest[0])
            if rows:
                found.append((folder, (*newest, rows)))
    return found


ABLATIONS = "ablations"
#: an ablation's cells are named ``<method> (<overrides>)``
ABLATION_MARK = " ("


def base_method(name: str) -> str:
    """The method an ablation's name (``<method> (<overrides>)``) varies; a method's name as it is."""
    return name.split(ABLATION_MARK, 1)[0]


def load_ablations(grid: Path, info: dict) -> tuple[list[Cell], list[dict]]:
    """The cells and ``grid.json`` of every grid under ``<grid>/ablations/``, each cell's method
    renamed ``<method> (<key>=<value> ...)`` by the overrides its grid adds to ``info``'s.

    Raises:
        ConfigError: an ablation grid of another preset, or one that adds no override (naming it).
    """
    folder, cells, infos = grid / ABLATIONS, [], []
    for sub in sorted(p for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []:
        sub_info, sub_cells = load_grid(sub)
        if sub_info["preset"] != info["preset"]:
            raise ConfigError(f"{sub / GRID_FILE}: preset {sub_info['preset']!r}, not the grid's {info['preset']!r}")
        base = info.get("overrides", {})
        added = {k: v for k, v in sub_info.get("overrides", {}).items() if base.get(k) != v}
        if not added:
            raise ConfigError(f"{sub / GRID_FILE}: adds no override to the grid's {base}: not an ablation")
        label = " ".join(f"{k}={v}" for k, v in added.items())
        cells += [Cell(f"{c.method}{ABLATION_MARK}{label})", c.seed, c.rows, c.summary) for c in sub_cells]
        infos.append({**sub_info, "label": label, "folder": sub.name})
    return cells, infos


PAPER_KEYS = (
    "paper",
    "setting",
    "metric",
    "ours",
    "target",
    "rounds",
    "tolerance",
    "notes",
    "reported",
    "reported-std",
    "crosscheck",
)


def paper_info(preset: str) -> dict:
    """``presets/<preset>.paper.toml`` (empty when the preset has none): ``paper``, ``setting``,
    ``metric`` (text), ``ours`` (the row metric beside the paper's), ``target`` (accuracy as a
    fraction), ``rounds`` (the paper's budget), ``tolerance`` (points: the least gap a verdict
    allows, where the method's spec fixes one for a paper without ±), ``notes``, ``[reported]``
    (method -> percent), ``[reported-std]`` (method -> the paper's ± in points, for methods in
    ``[reported]``) and ``[crosscheck]`` (method -> text: what running ours beside a reference
    implementation showed, with where the rows are; :func:`paper_comparison` prints it where the
    paper is not reproduced).

    Raises:
        ConfigError: a key outside these, a ``[reported-std]`` method without a paper number, or a
            ``[crosscheck]`` entry that is not text (naming the file and the key).
    """
    import tomllib

    path = ROOT / "presets" / f"{Path(preset).stem}.paper.toml"
    if not path.is_file():
        return {}
    paper = tomllib.loads(path.read_text(encoding="utf-8"))
    unknown = sorted(set(paper) - set(PAPER_KEYS))
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {unknown}; allowed: {list(PAPER_KEYS)}")
    orphans = sorted(set(paper.get("reported-std", {})) - set(paper.get("reported", {})))
    if orphans:
        raise ConfigError(f"{path}: [reported-std] names {orphans}, which [reported] has no number for")
    not_text = sorted(m for m, text in paper.get("crosscheck", {}).items() if not isinstance(text, str))
    if not_text:
        raise ConfigError(f"{path}: [crosscheck] {not_text}: allowed values are text (what the cross-check showed)")
    return paper


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (ddof 1; 0 for a single value)."""
    a = np.asarray(values, dtype=np.float64)
    return float(a.mean()), float(a.std(ddof=1)) if len(a) > 1 else 0.0


def seed_curves(cells: list[Cell], key: str) -> tuple[np.ndarray, np.ndarray]:
    """``(rounds [n], values [seeds, n])`` of ``key`` over the first n evaluated rounds, n that
    of the shortest cell (fractions, float64)."""
    curves = [c.curve(key) for c in cells]
    n = min(len(rounds) for rounds, _ in curves)
    return curves[0][0][:n], np.stack([values[:n] for _, values in curves])


def above_baseline(cells: list[Cell], baseline: list[Cell], key: str) -> dict:
    """Where the mean over seeds of ``key`` is above ``baseline``'s (also a mean over its seeds),
    over the rounds both have: ``first`` (the first round above, None if never), ``stays_from``
    (the first round of the final stretch above, None when it ends at or below), ``above`` (how
    many rounds are above) and ``of`` (how many rounds were compared)."""
    rounds, ours = seed_curves(cells, key)
    theirs = seed_curves(baseline, key)[1]
    n = min(len(rounds), theirs.shape[1])
    is_above = ours.mean(0)[:n] > theirs.mean(0)[:n]
    behind = np.nonzero(~is_above)[0]
    stays_from = None
    if n and is_above[-1]:  # the final stretch starts right after the last round not above
        stays_from = int(rounds[behind[-1] + 1]) if len(behind) else int(rounds[0])
    first = int(rounds[np.argmax(is_above)]) if is_above.any() else None
    return {"first": first, "stays_from": stays_from, "above": int(is_above.sum()), "of": n}


def describe_above(method: str, above: dict) -> str:
    """One clause of the report's "Above Local" line for :func:`above_baseline`'s result."""
    if above["first"] is None:
        return f"{method} never"
    share = f"{above['above']} of {above['of']} rounds"
    if above["stays_from"] is None:
        return f"{method} first at round {above['first']}, {share}, not at the end"
    return f"{method} from round {above['stays_from']} to the end (first at round {above['first']}, {share})"


def rounds_to_target(cell: Cell, key: str, target: float) -> int | None:
    """First round whose ``key`` reaches ``target`` (a fraction), None if never."""
    rounds, values = cell.curve(key)
    hit = np.nonzero(values >= target)[0]
    return int(rounds[hit[0]]) if len(hit) else None


def method_stats(cells: list[Cell], key: str, target: float | None) -> dict:
    """The table's numbers for one method's cells (its seeds)."""
    out = {"seeds": sorted(c.seed for c in cells), "rounds": sorted({len(c.rows) for c in cells})}
    # a run that stop-patience ended is finished; any other with fewer rounds than the paper's is not
    out["stopped"] = sum(bool(c.rows[-1].get("stop_reason")) for c in cells)
    out["open_rounds"] = sorted({len(c.rows) for c in cells if not c.rows[-1].get("stop_reason")})
    for metric in ("accuracy_mean", "accuracy_weighted"):
        curves = [values for values in (c.curve(metric)[1] for c in cells) if len(values)]
        finals = [values[-1] for values in curves]
        bests = [values.max() for values in curves]
        out[f"final_{metric}"] = mean_std(finals) if finals else None
        out[f"best_{metric}"] = mean_std(bests) if bests else None
    clients = sum(r["num_clients"] for c in cells for r in c.rows)
    out["up_per_client_round"] = sum(r["bytes_up"] for c in cells for r in c.rows) / max(clients, 1)
    out["down_per_client_round"] = sum(r["bytes_down"] for c in cells for r in c.rows) / max(clients, 1)
    # the median: a grid's launches may run beside other jobs, which inflates some rounds many times
    out["seconds_per_round"] = float(np.median([r["round_seconds"] for c in cells for r in c.rows]))
    if target is not None:
        hits = [(rounds_to_target(c, key, target), c) for c in cells]
        reached = [(r, c) for r, c in hits if r is not None]
        out["reached"] = f"{len(reached)}/{len(cells)}"
        out["rounds_to_target"] = mean_std([r for r, _ in reached]) if reached else None
        out["bytes_to_target"] = float(np.mean([c.cumulative_bytes()[r - 1] for r, c in reached])) if reached else None
    return out


def with_federation_size(config: dict, cells: list[Cell]) -> dict:
    """``config`` (a run's or a grid's run config) with ``num-clients`` the size of the federation its
    ``cells`` ran in, for the partition figure and the FLOPs, which partition the data as the clients did.

    A config with ``num-clients`` > 0 is returned as it is. With 0 (the default: the server takes every
    node, as a plain ``flwr run`` does) the size is the ``num_clients`` the runs' summaries recorded,
    else the most clients one round of theirs saw (its ``num_clients``, or its highest partition id of
    ``accuracy_per_client`` + 1).

    Raises:
        ConfigError: ``num-clients`` is 0 and neither the summaries nor the rows say how many clients
            there were.
    """
    if {**app_defaults(), **config}["num-clients"]:
        return config
    recorded = [n for c in cells if isinstance(n := c.summary.get("num_clients"), int) and n > 0]
    seen = [
        max([int(r.get("num_clients") or 0), *(int(p) + 1 for p in r.get("accuracy_per_client") or {})])
        for c in cells
        for r in c.rows
    ]
    size = max(recorded) if recorded else max(seen, default=0)
    if size < 1:
        raise ConfigError("run config num-clients = 0 and no summary or round row says how many clients took part")
    return {**config, "num-clients": size}


def training_flops(config: dict, data_dir: str | None = None) -> float:
    """Training FLOPs per client-round: forward + backward of each client's personal model on one
    sample (``FlopCounterMode``), times its training samples and ``local-epochs``, averaged over clients.

    ``config`` is the run config of one cell (its seed fixes the partition, hence the sample counts).
    """
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from common.config import RunConfig
    from common.data import DataSpec, partition_split
    from common.datasets import DATASETS
    from models.groups import MODEL_GROUPS

    cfg = RunConfig.from_dict({**app_defaults(), **config, **({"data-dir": data_dir} if data_dir else {})})
    info, group = DATASETS[cfg.dataset], MODEL_GROUPS[cfg.model_group]
    spec = DataSpec.from_config(cfg, cfg.num_clients)
    per_sample: dict[tuple[str, str], float] = {}
    total = 0.0
    for pid in range(cfg.num_clients):
        key = (group.architecture_for(pid), group.head_for(pid))
        if key not in per_sample:
            model = group.build(pid, info.num_classes, info.channels, info.image_size, cfg.seed, cfg.feature_dim)
            x = torch.zeros(2, info.channels, info.image_size, info.image_size)  # 2: BatchNorm in train mode
            with FlopCounterMode(display=False) as counter:
                model(x).sum().backward()
            per_sample[key] = counter.get_total_flops() / 2
        total += per_sample[key] * len(partition_split(spec, pid)[2]) * cfg.local_epochs
    return total / cfg.num_clients


def method_colors(methods: list[str]) -> dict[str, tuple]:
    """One fixed colour per method, the same in every figure and report (registry order): the ten
    colours of tab10, then black and dark goldenrod; grey for an unknown name."""
    import matplotlib
    from matplotlib.colors import to_rgba

    from strategies.registry import METHODS

    palette = [*matplotlib.colormaps["tab10"].colors, to_rgba("black"), to_rgba("darkgoldenrod")]
    order = list(METHODS)
    base = {m: base_method(m) for m in methods}  # an ablation takes its method's colour
    return {m: palette[order.index(base[m]) % len(palette)] if base[m] in order else to_rgba("grey") for m in methods}


def plot_curves(cells: list[Cell], key: str, out: Path, preset: str) -> None:
    """accuracy_vs_round.png and accuracy_vs_bytes.png: mean over seeds, band from min to max."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    methods = sorted({c.method for c in cells})
    colors = method_colors(methods)
    label = key.replace("_", " ")
    for name, xlabel in (
        ("accuracy_vs_round.png", "round"),
        ("accuracy_vs_bytes.png", "cumulative payload bytes, both ways (log scale)"),
    ):
        fig, ax = plt.subplots(figsize=(7.5, 4.5))
        for method in methods:
            runs = [c for c in cells if c.method == method]
            rounds, acc = seed_curves(runs, key)
            if len(rounds) == 0:
                continue
            acc = 100 * acc
            if name == "accuracy_vs_round.png":
                x = rounds
            else:
                x = np.mean([c.cumulative_bytes()[rounds - 1] for c in runs], axis=0)
                if not x.any():  # no payload at all (local): a level line, not a point at 0 on a log axis
                    ax.axhline(acc.mean(0)[-1], color=colors[method], ls="--", label=f"{method} (0 B, final)")
                    continue
            ax.plot(
                x,
                acc.mean(0),
                color=colors[method],
                ls=":" if base_method(method) != method else "-",  # an ablation: dotted, in its method's colour
                label=f"{method} ({len(runs)} seed{'s' * (len(runs) > 1)})",
            )
            if len(runs) > 1:
                ax.fill_between(x, acc.min(0), acc.max(0), color=colors[method], alpha=0.2, lw=0)
        if name == "accuracy_vs_bytes.png":
            ax.set_xscale("log")
        else:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"{label} (%)")
        ax.set_title(f"{preset}: {label} per {'round' if name == 'accuracy_vs_round.png' else 'payload bytes'}")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
        fig.tight_layout()
        fig.savefig(out / name, dpi=120)
        plt.close(fig)


def prior_accuracy(config: dict, partitions: list[int], data_dir: str | None = None) -> tuple[float, float]:
    """(mean over clients, pooled) test accuracy, fractions, of the class prior alone: each client of
    ``partitions`` predicts its most frequent training class (the lowest id on a tie) for every test
    example. A model that learnt only its client's label skew scores this; the rows' accuracies are
    read against it.

    ``config`` is the run config of one cell (its seed and ``num-clients`` fix the partitions);
    ``data_dir`` overrides its ``data-dir``.

    Raises:
        ConfigError: the dataset is not readable there (``common.data.load_client_data``), or
            ``partitions`` is empty.
    """
    from common.config import RunConfig
    from common.data import DataSpec, class_counts, load_client_data

    if not partitions:
        raise ConfigError("no partitions to score the class prior on")
    cfg = RunConfig.from_dict({**app_defaults(), **config, **({"data-dir": data_dir} if data_dir else {})})
    spec = DataSpec.from_config(cfg, cfg.num_clients)
    hits, totals = [], []
    for pid in partitions:
        data = load_client_data(spec, pid)
        majority = int(class_counts(data.train_y, data.info.num_classes).argmax())
        hits.append(int((data.test_y == majority).sum()))
        totals.append(len(data.test_y))
    per_client = [h / t for h, t in zip(hits, totals, strict=True) if t]
    return float(np.mean(per_client)), sum(hits) / max(1, sum(totals))


def prior_by_seed(
    preset_config: dict, cells: list[Cell], data_dir: str | None = None
) -> dict[str, dict[int, tuple[float, float]]]:
    """:func:`prior_accuracy` (mean over clients, pooled) of a grid's clients for each of its cells' seeds:
    ``training`` (every partition but the held-out ones) and, when the summaries name held-out partitions
    (run config ``generalization.held-out-clients``), ``held-out``; each seed -> (mean, pooled).

    Raises:
        ConfigError: see :func:`prior_accuracy` and :func:`with_federation_size`.
    """
    config = with_federation_size(preset_config, cells)
    size = {**app_defaults(), **config}["num-clients"]
    held = sorted({p for c in cells for p in c.summary.get("held_out_partitions") or []})
    groups = {"training": [p for p in range(size) if p not in held], **({"held-out": held} if held else {})}
    seeds = sorted({c.seed for c in cells})
    return {
        label: {seed: prior_accuracy({**config, "seed": seed}, partitions, data_dir) for seed in seeds}
        for label, partitions in groups.items()
    }


def prior_stats(by_seed: dict[int, tuple[float, float]]) -> dict[str, tuple[float, float]]:
    """One group of :func:`prior_by_seed`, mean ± sample std over the seeds: ``{"mean": ..., "weighted": ...}``."""
    return {"mean": mean_std([m for m, _ in by_seed.values()]), "weighted": mean_std([w for _, w in by_seed.values()])}


def prior_over_seeds(
    preset_config: dict, cells: list[Cell], data_dir: str | None = None
) -> dict[str, dict[str, tuple[float, float]]]:
    """:func:`prior_stats` of every group of :func:`prior_by_seed`.

    Raises:
        ConfigError: see :func:`prior_accuracy` and :func:`with_federation_size`.
    """
    return {label: prior_stats(scores) for label, scores in prior_by_seed(preset_config, cells, data_dir).items()}


def plot_partitions(config: dict, out: Path, data_dir: str | None = None) -> None:
    """label_distribution.png: samples per class of every client's partition (flwr-datasets)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from flwr_datasets.visualization import plot_label_distributions

    from common.config import RunConfig
    from common.data import DataSpec, partitioner_for
    from common.datasets import DATASETS

    cfg = RunConfig.from_dict({**app_defaults(), **config, **({"data-dir": data_dir} if data_dir else {})})
    partitioner = partitioner_for(DataSpec.from_config(cfg, cfg.num_clients))
    fig, ax, counts = plot_label_distributions(
        partitioner,
        label_name=DATASETS[cfg.dataset].label_column,
        plot_type="bar",
        size_unit="absolute",
        partition_id_axis="x",
        legend=True,
        legend_title="class",
        verbose_labels=False,
        figsize=(7.5, 4.5),
        title=f"{cfg.dataset}: samples per class of each client's partition ({cfg.partitioner}, seed {cfg.data_seed})",
    )
    ax.set_xlabel("client (partition id)")
    ax.set_ylabel("samples")
    ax.set_ylim(0, 1.05 * counts.sum(axis=1).max())  # flwr-datasets' default limit can cut the tallest bars
    fig.savefig(out / "label_distribution.png", dpi=120, bbox_inches="tight")  # the legend sits outside
    plt.close(fig)


def pct(value: tuple[float, float] | None) -> str:
    return "-" if value is None else f"{100 * value[0]:.2f} ± {100 * value[1]:.2f}"


def difference(a: tuple[float, float], n_a: int, b: tuple[float, float], n_b: int) -> tuple[float, float | None]:
    """``a - b`` in points and in standard errors, sqrt(std_a**2 / n_a + std_b**2 / n_b) (None when
    either has one seed or there is no spread); ``a``, ``b``: (mean, sample std) as fractions."""
    diff = 100 * (a[0] - b[0])
    se = 100 * float(np.sqrt(a[1] ** 2 / n_a + b[1] ** 2 / n_b))
    return diff, diff / se if min(n_a, n_b) > 1 and se > 0 else None


def ablation_comparison(key: str, stats: dict[str, dict]) -> list[str]:
    """One line per ablation (a method named ``<method> (<overrides>)``) against its method on
    ``key``: the difference in points and standard errors (:func:`difference`); none without ablations."""
    pairs = [(m, base_method(m)) for m in stats if base_method(m) != m]
    parts = []
    for ablation, method in pairs:
        if method not in stats or stats[ablation].get(key) is None or stats[method].get(key) is None:
            continue
        diff, z = difference(
            stats[ablation][key], len(stats[ablation]["seeds"]), stats[method][key], len(stats[method]["seeds"])
        )
        apart = (
            "no spread" if z is None else f"{z:+.1f} standard errors, " + ("apart" if abs(z) > 2 else "not separated")
        )
        parts.append(f"{ablation} against {method}: {diff:+.2f} points ({apart})")
    return [f"Ablations on `{key}`: " + "; ".join(parts) + ".", ""] if parts else []


def paper_comparison(paper: dict, stats: dict[str, dict]) -> list[str]:
    """The report's "Against the paper" section (Markdown lines; none without paper numbers).

    Per method with a paper number, on the metric the paper reports (``ours`` in the paper
    file): ours (mean ± sample std over n seeds), the paper's number (± its reported std,
    ``[reported-std]``, 0 when not given), the gap in points and a verdict: *reproduced* when
    |gap| <= 2 * sqrt(std_ours**2 / n + std_paper**2) (two standard errors of our mean, widened
    by the paper's own spread) or the paper file's ``tolerance`` (points), whichever is larger,
    else *not reproduced* by the gap. Then the paper's ranking
    against ours: every pair the paper orders, with our difference in standard errors
    (sqrt(std_a**2 / n_a + std_b**2 / n_b)): *kept* above 2, *reversed* below -2, else *not
    separated*. A method with one seed has no spread and gets no verdict. When a run has fewer
    rounds than the paper's (``rounds`` in the paper file) and the run config's ``stop-patience``
    did not end it, every verdict is marked provisional. Last, for every method not reproduced or
    in a reversed pair, what the cross-check against a reference implementation showed (the paper
    file's ``[crosscheck]``), or that none is recorded, so a reader can tell the method from the code.
    Accuracies in percent; ``stats`` as :func:`method_stats`.
    """
    key, reported = paper.get("ours", "final_accuracy_mean"), paper.get("reported", {})
    spread, least = paper.get("reported-std", {}), paper.get("tolerance", 0.0)
    ours = {m: s[key] for m, s in stats.items() if m in reported and s.get(key) is not None}
    if not ours:
        return []
    n = {m: len(stats[m]["seeds"]) for m in ours}
    lengths = sorted({r for m in ours for r in stats[m]["rounds"]})
    unfinished = sorted({r for m in ours for r in stats[m]["open_rounds"]})
    stopped = sum(stats[m]["stopped"] for m in ours)
    budget = paper.get("rounds")
    provisional = budget is not None and bool(unfinished) and unfinished[0] < budget
    lines = [
        "## Against the paper",
        "",
        f"On `{key}`, after {lengths[0]}"
        + (f" to {lengths[-1]}" if len(lengths) > 1 else "")
        + " rounds"
        + (f" ({stopped} run(s) ended by stop-patience)" if stopped else "")
        + (
            f"; a run stop-patience did not end has {unfinished[0]} of the paper's {budget}: "
            "every verdict is provisional"
            if provisional
            else ""
        )
        + ". Reproduced: |gap| <= 2 sqrt(std² / n + paper std²)"
        + (f" or {least:g} points (the paper file's tolerance), whichever is larger" if least else "")
        + "; pairs: our difference in standard errors.",
        "",
        "| method | ours | paper | gap (points) | verdict |",
        "|---|---|---|---|---|",
    ]
    missed = set()  # not reproduced, or in a reversed pair: the methods the cross-check must speak to
    for m, (mean, std) in ours.items():
        gap = 100 * mean - reported[m]
        tolerance = max(2 * float(np.hypot(100 * std / np.sqrt(n[m]), spread.get(m, 0.0))), least)
        if n[m] >= 2 and abs(gap) > tolerance:
            missed.add(m)
        verdict = (
            "one seed: no verdict"
            if n[m] < 2
            else f"not reproduced ({abs(gap):.2f} {'above' if gap > 0 else 'below'})"
            if m in missed
            else "reproduced"
        )
        lines.append(
            f"| {m} | {pct((mean, std))} (n={n[m]}) | {reported[m]:.2f}"
            + (f" ± {spread[m]:.2f}" if m in spread else "")
            + f" | {gap:+.2f} "
            f"(tolerance {tolerance:.2f}) | {verdict}{' (provisional)' if provisional else ''} |"
        )
    order = sorted(ours, key=lambda m: -reported[m])
    if len(order) >= 2:
        ranking, reversed_pairs = ranking_comparison(order, reported, ours, n)
        lines += ranking
        missed |= reversed_pairs
    return lines + crosscheck_notes(paper.get("crosscheck", {}), [m for m in ours if m in missed])


def ranking_comparison(
    order: list[str], reported: dict, ours: dict[str, tuple[float, float]], n: dict[str, int]
) -> tuple[list[str], set[str]]:
    """The paper's ranking against ours (:func:`paper_comparison`): its Markdown lines, and the
    methods of every reversed pair."""
    reversed_pairs: set[str] = set()
    lines = [
        "",
        "Ranking, paper: " + " > ".join(order) + "; ours: " + " > ".join(sorted(ours, key=lambda m: -ours[m][0])) + ".",
        "",
        "| paper's order | paper gap | our gap | standard errors | ranking |",
        "|---|---|---|---|---|",
    ]
    for i, a in enumerate(order):
        for b in order[i + 1 :]:
            diff, z = difference(ours[a], n[a], ours[b], n[b])
            verdict = "no spread" if z is None else "kept" if z > 2 else "reversed" if z < -2 else "not separated"
            if verdict == "reversed":
                reversed_pairs |= {a, b}
            lines.append(
                f"| {a} > {b} | {reported[a] - reported[b]:+.2f} | {diff:+.2f} | "
                f"{'-' if z is None else f'{z:+.1f}'} | {verdict} |"
            )
    return lines, reversed_pairs


def crosscheck_notes(notes: dict[str, str], methods: list[str]) -> list[str]:
    """Markdown lines: for each of ``methods`` (not reproduced, or in a reversed pair) its
    ``[crosscheck]`` text from the paper file, or that no cross-check is recorded for it."""
    if not methods:
        return []
    return [
        "",
        "What the cross-check against reference implementations shows for the methods not reproduced "
        "or in a reversed pair (the paper file's `[crosscheck]`):",
        "",
        *(f"- {m}: {notes.get(m, 'no cross-check recorded: the gap may be the method or our code.')}" for m in methods),
    ]


def render(info: dict, paper: dict, stats: dict[str, dict], flops: float | None) -> str:
    """The report as Markdown."""
    key = paper.get("ours", "final_accuracy_mean")
    target = paper.get("target")
    reported = paper.get("reported", {})
    invocations = info.get("invocations", [])
    lines = [f"# {Path(info['preset']).stem}", ""]
    if paper:
        lines += [
            f"Paper: {paper['paper']}. Setting: {paper['setting']}. The paper reports {paper['metric']}; "
            f"ours beside it is `{key}`.",
            "",
        ]
        if paper.get("notes"):
            lines += [paper["notes"], ""]
    changed = ", ".join(f"`{k}={v}`" for k, v in info.get("overrides", {}).items())
    lines += [
        f"Grid: {info['rounds']} rounds per run, seeds {info['seeds']}"
        + (f", preset changed by {changed}" if changed else ", the preset as it is")
        + ". Commits: "
        + ", ".join(sorted({i["commit"] for i in invocations}))
        + ".",
        "",
    ]
    for sub in info.get("ablations", []):
        lines += [
            f"Ablation `{sub['label']}`: {', '.join(sub['methods'])} with it, {sub['rounds']} rounds per run, "
            f"seeds {sub['seeds']} (`{ABLATIONS}/{sub['folder']}`).",
            "",
        ]
    target_text = f"{100 * target:.0f}%" if target is not None else "target"
    head = [
        "method",
        "seeds",
        "rounds",
        "final acc mean",
        "best acc mean",
        "final acc weighted",
        "best acc weighted",
        f"rounds to {target_text}",
        f"bytes to {target_text}",
        "B up / client-round",
        "B down / client-round",
        "median s / round",
        "train GFLOPs / client-round",
        "paper",
    ]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for method, s in stats.items():
        to_target = "-" if s.get("rounds_to_target") is None else f"{s['rounds_to_target'][0]:.1f} ({s['reached']})"
        to_bytes = "-" if s.get("bytes_to_target") is None else f"{s['bytes_to_target']:,.0f}"
        rounds = "/".join(str(r) for r in s["rounds"])
        lines.append(
            "| "
            + " | ".join(
                [
                    method,
                    ",".join(map(str, s["seeds"])),
                    rounds,
                    pct(s["final_accuracy_mean"]),
                    pct(s["best_accuracy_mean"]),
                    pct(s["final_accuracy_weighted"]),
                    pct(s["best_accuracy_weighted"]),
                    to_target,
                    to_bytes,
                    f"{s['up_per_client_round']:,.0f}",
                    f"{s['down_per_client_round']:,.0f}",
                    f"{s['seconds_per_round']:.1f}",
                    "-" if flops is None else f"{flops / 1e9:.1f}",
                    f"{reported[method]:.2f}" if method in reported else "-",
                ]
            )
            + " |"
        )
    lines += [
        "",
        "Accuracies in percent, mean ± sample std over seeds. Rounds to target: mean over the seeds that "
        "reached it (how many in brackets); bytes to target: training and evaluation payloads, both ways, up "
        "to that round. FLOPs: forward + backward of the personal model only.",
        "",
    ]
    ahead = {m: s["ahead_of_local"] for m, s in stats.items() if "ahead_of_local" in s}
    if ahead:
        lines += [
            f"Above Local (`{key.split('_', 1)[1]}`, mean over seeds, up to the last round all have): "
            + "; ".join(describe_above(m, a) for m, a in ahead.items())
            + ".",
            "",
        ]
    lines += ablation_comparison(key, stats) + paper_comparison(paper, stats) + [""]
    lines += [f"![{f}]({f})" for f in FIGURES]
    launches = info.get("launches", [])
    if launches:
        per_method: dict[str, list[float]] = {}
        for launch in launches:
            totals = per_method.setdefault(launch["cell"].rsplit("-seed", 1)[0], [0.0, 0.0])
            totals[0] += launch["wall_seconds"]
            totals[1] += launch["cpu_seconds"]
        lines += [
            "",
            "Time of the grid's launches (start-up included; CPU = all processes of the run): "
            + "; ".join(f"{m} {w / 60:.0f} min wall, {c / 60:.0f} min CPU" for m, (w, c) in per_method.items())
            + f"; in all {sum(w for w, _ in per_method.values()) / 3600:.2f} h wall, "
            f"{sum(c for _, c in per_method.values()) / 3600:.2f} h CPU.",
        ]
    if invocations:
        lines += ["", "Commands:", ""] + [
            f"- `{i['command']}` at {i['started']} ({i['commit']}, {i['machine']})" for i in invocations
        ]
    return "\n".join(lines) + "\n"


def copy_runs(grid: Path, out: Path) -> None:
    """Copy ``grid.json`` and each cell's newest metrics.jsonl and summary.json into ``out`` (grid
    layout), and so every grid under ``<grid>/ablations/``; a cell without a finished round is
    left out, as the report leaves it out."""
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy2(grid / GRID_FILE, out / GRID_FILE)
    if (grid / ABLATIONS).is_dir():
        for sub in sorted(p for p in (grid / ABLATIONS).iterdir() if p.is_dir()):
            copy_runs(sub, out / ABLATIONS / sub.name)
    for folder, (run, _, _) in finished_runs(grid):
        target = out / folder.name / run.name
        target.mkdir(parents=True, exist_ok=True)
        for name in ("metrics.jsonl", "summary.json"):
            if (run / name).is_file():
                shutil.copy2(run / name, target / name)


def report(
    grid: Path,
    out: Path | None = None,
    data_dir: str | None = None,
    figures: bool = True,
    ablations: list[Path] | tuple = (),
) -> dict:
    """Write ``report.md`` (and the figures) for ``grid`` into ``out``, its ``ablations`` (grid
    folders, copied to ``<out>/ablations/``) beside it; returns the per-method stats.

    Raises:
        ConfigError: a file of a grid is not what the grid wrote, or an ablation is not one
            (:func:`load_ablations`).
    """
    out = out or grid
    if out.resolve() != grid.resolve():
        copy_runs(grid, out)
    for ablation in ablations:
        copy_runs(ablation, out / ABLATIONS / ablation.name)
    info, cells = load_grid(out)
    extra, info["ablations"] = load_ablations(out, info)
    cells += extra
    for sub in info["ablations"]:  # their launches and commands beside the grid's, under their labels
        for launch in sub.get("launches", []):
            method, seed = launch["cell"].rsplit("-seed", 1)
            info.setdefault("launches", []).append({**launch, "cell": f"{method} ({sub['label']})-seed{seed}"})
        info.setdefault("invocations", []).extend(sub.get("invocations", []))
    paper = paper_info(info["preset"])
    key = paper.get("ours", "final_accuracy_mean").split("_", 1)[1]  # accuracy_mean or accuracy_weighted
    order = list(info.get("methods", []))
    methods = sorted(  # the grid's order; an ablation right after its method
        {c.method for c in cells},
        key=lambda m: (order.index(base_method(m)) if base_method(m) in order else len(order), m),
    )
    by_method = {m: [c for c in cells if c.method == m] for m in methods}
    stats = {m: method_stats(by_method[m], key, paper.get("target")) for m in methods}
    for m in methods if "local" in by_method else ():
        if m != "local":
            stats[m]["ahead_of_local"] = above_baseline(by_method[m], by_method["local"], key)
    flops = None
    if figures:
        # the partitions of the seeds reported (a seed the grid has only started has none yet)
        seeds = sorted({c.seed for c in cells}) or [None]
        preset_config = with_federation_size(info["preset_config"], cells)
        configs = [{**preset_config, **({"seed": s} if s is not None else {})} for s in seeds]
        flops = float(np.mean([training_flops(c, data_dir) for c in configs]))
        plot_curves(cells, key, out, Path(info["preset"]).stem)
        plot_partitions(configs[0], out, data_dir)
    unreadable = [f"- `{c.method}-seed{c.seed}`: {c.summary['unreadable']}" for c in cells if "unreadable" in c.summary]
    if unreadable:  # reported from their rows above; say so rather than leave them out
        unreadable = ["", "Cells whose summary.json is unreadable (reported from their rows):", "", *unreadable]
    (out / "report.md").write_text(render(info, paper, stats, flops) + "\n".join(unreadable), encoding="utf-8")
    return stats


def report_run(run: Path, out: Path | None = None, data_dir: str | None = None, figures: bool = True) -> dict:
    """``report.md`` and the figures of one run folder (what ``tools.run`` writes), as a grid's for one
    cell: final and best accuracy (mean over clients and pooled), bytes per client-round, seconds per
    round, and the accuracy-vs-round, accuracy-vs-bytes and label-distribution figures. Returns the stats.

    Raises:
        ConfigError: the folder's ``metrics.jsonl`` is not what a run wrote, or it has no rows.
    """
    out = out or run
    out.mkdir(parents=True, exist_ok=True)
    summary, rows = run_summary(run), read_rows(run)
    if not rows:
        raise ConfigError(f"{run / ROWS_FILE} holds no round yet")
    config = summary.get("config", {})
    cell = Cell(str(config.get("method", "run")), int(config.get("seed", 0)), rows, summary)
    stats = method_stats([cell], "accuracy_mean", None)
    if figures:
        plot_curves([cell], "accuracy_mean", out, run.name)
        if config:
            plot_partitions(with_federation_size(config, [cell]), out, data_dir)
    lines = [
        f"# {run.name}",
        "",
        f"Status `{summary['status']}`"
        + (f" ({summary['error']})" if summary.get("error") else "")
        + f", {len(rows)} rounds, method `{cell.method}`, seed {cell.seed}. Accuracies in percent, fractions of the"
        " clients' local test splits: mean over clients and pooled (weighted by test examples).",
        "",
        "| | final | best |",
        "|---|---|---|",
    ]
    for metric in ("accuracy_mean", "accuracy_weighted"):
        final, best = stats[f"final_{metric}"], stats[f"best_{metric}"]
        lines.append(f"| {metric} | {100 * final[0]:.2f} | {100 * best[0]:.2f} |" if final else f"| {metric} | - | - |")
    lines += [
        "",
        f"Payload per client-round: {stats['up_per_client_round']:.0f} B up, {stats['down_per_client_round']:.0f} B"
        f" down (training); median {stats['seconds_per_round']:.2f} s per round.",
        "",
    ]
    (out / "report.md").write_text("\n".join(lines), encoding="utf-8")
    return stats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "grid", type=Path, help="a grid folder (tools.grid), a copy written by --out, or one run folder"
    )
    parser.add_argument("--out", type=Path, default=None, help="where report.md, figures and run copies go")
    parser.add_argument("--data-dir", default=None, help="dataset folder for the partition figure and FLOPs")
    parser.add_argument(
        "--ablation",
        type=Path,
        action="append",
        default=[],
        help="a grid of the same preset with more -c overrides, reported beside this one (repeatable)",
    )
    args = parser.parse_args(argv)
    try:
        if (args.grid / ROWS_FILE).is_file():  # one run folder (tools.run), not a grid
            if args.ablation:
                raise ConfigError(f"--ablation goes with a grid folder; {args.grid} is one run")
            report_run(args.grid, args.out, args.data_dir)
        else:
            report(args.grid, args.out, args.data_dir, ablations=args.ablation)
    except ConfigError as exc:  # a file of the grid is not what the grid wrote: name it, no traceback
        print(f"error: {exc}")
        return 2
    print(f"wrote {(args.out or args.grid) / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
