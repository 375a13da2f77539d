"""The matplotlib figures of a report: accuracy against round and against cumulative payload bytes
(:func:`plot_curves`), the partitions' label distribution (:func:`plot_partitions`), and one fixed
colour per method (:func:`method_colors`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tools.grid_rows import Cell, base_method
from tools.grid_stats import seed_curves
from tools.runconfig import app_defaults

FIGURES = ("accuracy_vs_round.png", "accuracy_vs_bytes.png", "label_distribution.png")


def method_colors(methods: list[str]) -> dict[str, tuple]:
    """One fixed colour per method, the same in every figure and report (registry order): the ten
    colours of tab10, then black, dark goldenrod, magenta, navy, lime and maroon (one each for the sixteen
    registered methods); grey for an unknown name."""
    import matplotlib
    from matplotlib.colors import to_rgba

    from methods.registry import METHODS

    extra = ("black", "darkgoldenrod", "magenta", "navy", "lime", "maroon")
    palette = [*matplotlib.colormaps["tab10"].colors, *map(to_rgba, extra)]
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
    partitioner = partitioner_for(DataSpec.from_config(cfg, cfg.num_clients), labels_only=True)
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
