"""What differential privacy costs: accuracy and attack scores against ε, over grids of one preset.

Usage (from the repository root)::

    uv run --frozen python -m tools.dp_report results/privacy-dp \\
        --grid inf=outputs/grids/privacy-cifar10-cnn5 --grid 8=outputs/grids/privacy-dp-eps8 ...
    uv run --frozen python -m tools.dp_report results/privacy-dp      # regenerate from the copies

Each ``--grid <ε>=<folder>`` is a ``tools.grid`` folder of the same preset run with run config
``dp.epsilon`` = ε (``inf``: without DP). Its ``grid.json``, each cell's newest ``metrics.jsonl`` and
``summary.json`` and, where ``tools.privacy`` attacked that run, its ``privacy/privacy.json`` are
copied to ``<folder>/eps-<ε>/`` (``tools.grid_rows.copy_runs``'s layout), so the report is regenerated
from the copies alone. Writes ``<folder>/report.md`` and ``<folder>/accuracy_vs_epsilon.png``.

Per method and ε, over its seeds (mean ± sample std): final pooled and mean-over-clients accuracy
(percent, the last evaluated round), the pooled one's gain over the class prior of its seed (points),
the largest ε any client spent (the rows' ``dp_epsilon_max``, PLD, and the largest ``epsilon_rdp`` of their
``dp_per_client``, RDP), the noise multipliers DP-SGD and the payload releases ran at (the last rows'
``dp_per_client``, mean over clients and seeds; "-" for rows written before they were recorded), and from
the privacy evaluation the
server's white-box attack on the upload (inversion of a per-class payload, or the update attack on a
weight payload): best-match PSNR against a mid-gray image's, and the recall of the client's class set
from the upload.
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from common.errors import ConfigError  # noqa: E402
from common.files import new_folder_or_none  # noqa: E402
from tools.figures import method_colors  # noqa: E402
from tools.grid import newest_run  # noqa: E402
from tools.grid_rows import copy_files, load_grid, run_copies  # noqa: E402
from tools.grid_stats import mean_std, prior_by_seed, prior_stats  # noqa: E402
from tools.privacy import read_privacy_rows  # noqa: E402
from tools.privacy_report import cell as score_cell  # noqa: E402
from tools.privacy_report import stat  # noqa: E402
from tools.report import pct  # noqa: E402

#: subfolder of a report folder holding the grid run at one ε
PREFIX = "eps-"
#: the label of the grid without DP
NO_DP = "inf"
#: the privacy evaluation's output inside a run folder (``tools.privacy``'s default ``--out``)
PRIVACY = Path("privacy") / "privacy.json"
#: payloads of the Q2 ladder, attacked from the victim's model rather than from its upload
NOT_UPLOADS = ("per-sample representation", "class mean representation")


def epsilon_value(label: str) -> float:
    """ε of a label: ``inf`` or a positive number.

    Raises:
        ConfigError: any other label.
    """
    if label == NO_DP:
        return math.inf
    try:
        value = float(label)
    except ValueError:
        value = -1.0
    if not 0 < value < math.inf:
        raise ConfigError(f"ε label {label!r}: allowed are '{NO_DP}' and positive numbers")
    return value


def grid_copies(grid: Path, target: Path) -> list[tuple[Path, Path]]:
    """(file, its copy) of :func:`tools.grid_rows.run_copies` plus each cell's ``privacy/privacy.json``
    (when attacked), all read and checked first.

    Raises:
        ConfigError: ``grid`` is no grid, or a file of it is not what the grid or ``tools.privacy``
            wrote (naming the file).
    """
    copies = run_copies(grid, target)
    for folder in sorted(p for p in grid.iterdir() if p.is_dir() and "-seed" in p.name):
        newest = newest_run(folder)
        if newest is not None and (newest[0] / PRIVACY).is_file():
            read_privacy_rows(newest[0] / PRIVACY)
            copies.append((newest[0] / PRIVACY, target / folder.name / newest[0].name / PRIVACY))
    return copies


def attack_rows(grid: Path, method: str) -> list[dict[str, Any]]:
    """Every row of the method's cells' ``privacy.json`` in ``grid``.

    Raises:
        ConfigError: naming a ``privacy.json`` that is not a list of rows.
    """
    rows = []
    for path in sorted(grid.glob(f"{method}-seed*/*/{PRIVACY}")):
        rows += read_privacy_rows(path)
    return rows


def upload_attack(rows: list[dict[str, Any]]) -> tuple[tuple[float, float] | None, tuple[float, float] | None]:
    """(best-match PSNR, gray PSNR) of the server's white-box attacks on the upload, pooled."""
    uploads = [
        r
        for r in rows
        if r.get("threat") == "server"
        and r.get("knowledge") == "white-box"
        and r.get("attack") in ("inversion", "update")
        and r.get("payload") not in NOT_UPLOADS
    ]
    return stat(uploads, "best_psnr"), stat(uploads, "gray_psnr")


def collect(folder: Path, data_dir: str | None = None) -> tuple[dict, dict[str, dict[str, dict[str, Any]]]]:
    """(the first grid's ``grid.json``, method -> ε label -> its numbers) over ``<folder>/eps-*``, for the
    methods run at two ε or more; a cell counts once its newest run completed. The grid info also gets
    ``prior``, the class prior's accuracy over every cell's seed (``tools.grid_stats.prior_by_seed``,
    :func:`tools.grid_stats.prior_stats`), and each method and ε ``above_prior``: its
    final pooled accuracy minus its seed's prior, mean ± std over seeds; without readable data the info
    gets ``prior_error`` instead and ``above_prior`` is None.

    Raises:
        ConfigError: no ``eps-*`` grid, a bad label, or grids of different presets.
    """
    grids = sorted(p for p in folder.glob(PREFIX + "*") if p.is_dir())
    if not grids:
        raise ConfigError(f"{folder} holds no {PREFIX}<ε> grid: give them with --grid <ε>=<grid folder>")
    info, out, every_cell, finals = None, {}, [], {}
    for grid in sorted(grids, key=lambda p: -epsilon_value(p.name[len(PREFIX) :])):  # no DP first, then ε down
        label = grid.name[len(PREFIX) :]
        grid_info, cells = load_grid(grid)
        # an interrupted run's last round is not its final accuracy: only completed runs count
        cells = [c for c in cells if c.summary.get("status") == "completed"]
        every_cell += cells
        if info is None:
            info = grid_info
        elif grid_info["preset"] != info["preset"]:
            raise ConfigError(f"{grid}: preset {grid_info['preset']!r}, the others {info['preset']!r}")
        for method in sorted({c.method for c in cells}):
            mine = [c for c in cells if c.method == method]
            spent = [r["dp_epsilon_max"] for c in mine for r in c.rows if r.get("dp_epsilon_max") is not None]
            clients = [entry for c in mine for r in c.rows for entry in (r.get("dp_per_client") or {}).values()]
            last = [entry for c in mine if c.rows for entry in (c.rows[-1].get("dp_per_client") or {}).values()]
            attacks = attack_rows(grid, method)
            psnr, gray = upload_attack(attacks)
            recalls = [r["label_recall"] for r in attacks if r.get("label_recall") is not None]
            labels = mean_std(recalls) if recalls else None  # one recall per (round, victim): no pooling
            finals[method, label] = [(c.seed, c.curve("accuracy_weighted")[1][-1]) for c in mine]
            out.setdefault(method, {})[label] = {
                "seeds": sorted(c.seed for c in mine),
                "weighted": mean_std([c.curve("accuracy_weighted")[1][-1] for c in mine]),
                "mean": mean_std([c.curve("accuracy_mean")[1][-1] for c in mine]),
                "spent": max(spent) if spent else None,
                "spent_rdp": max((e["epsilon_rdp"] for e in clients), default=None),
                "sigma": mean_of(last, "noise_multiplier"),
                "release_sigma": mean_of(last, "release_noise_multiplier"),
                "psnr": psnr,
                "gray": gray,
                "labels": labels,
            }
    try:
        priors = prior_by_seed(info["preset_config"], every_cell, data_dir)["training"]
        info["prior"] = prior_stats(priors)
    except ConfigError as exc:  # regenerating without the dataset: the rest of the report stands
        info["prior_error"], priors = str(exc), None
    for (method, label), seeds in finals.items():
        out[method][label]["above_prior"] = None if priors is None else mean_std([a - priors[s][1] for s, a in seeds])
    # a method run at one ε only (the no-DP grid may hold every method) has no curve
    return info, {m: by_eps for m, by_eps in out.items() if len(by_eps) > 1}


def mean_of(entries: list[dict[str, Any]], key: str) -> float | None:
    """The mean of ``key`` over the rows' ``dp_per_client`` ``entries`` that carry it (None: none does)."""
    values = [e[key] for e in entries if e.get(key) is not None]
    return sum(values) / len(values) if values else None


def number(value: float | None, digits: int = 3) -> str:
    """``value`` to ``digits`` significant digits, "-" for None."""
    return "-" if value is None else f"{value:.{digits}g}"


def prior_line(info: dict) -> str:
    """The class prior's accuracy (the floor a DP run that learnt only its clients' label skew reaches)."""
    if "prior" not in info:
        return f"Class prior alone: not computed ({info['prior_error']}; pass --data-dir)."
    prior = info["prior"]
    return (
        "Class prior alone (every client predicts its most frequent training class; "
        "`tools.grid_stats.prior_accuracy`): "
        f"{pct(prior['weighted'])} pooled, {pct(prior['mean'])} mean over clients. A model at this accuracy has "
        "learnt its client's label skew and nothing of the images."
    )


def render(info: dict, stats: dict[str, dict[str, dict[str, Any]]]) -> str:
    lines = [
        f"# What differential privacy costs: {info['preset']}",
        "",
        "Record-level DP of every upload (run config `dp.epsilon`; docs/privacy.md), per method and ε: final accuracy",
        "(percent, mean ± sample std over seeds), the pooled one's gain over its seed's class prior (points),",
        "the largest ε a client spent (at `dp.delta`: PLD, and RDP beside it), the mean noise multipliers σ of",
        "DP-SGD and of the payload releases in the last round, and the server's white-box attack on the upload",
        "(best-match PSNR in dB against a mid-gray image's, and the recall of the client's class set;",
        f"`tools.privacy`, where it was run). ε = {NO_DP}: without DP.",
        "",
        prior_line(info),
        "",
        "| method | ε | seeds | final acc weighted | above prior (points) | final acc mean | ε spent (max) "
        "| ε RDP (max) | σ DP-SGD | σ release | attack PSNR | gray PSNR | label recall |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for method, by_eps in stats.items():
        for label, s in by_eps.items():
            mechanisms = f"{number(s['spent_rdp'])} | {number(s['sigma'])} | {number(s['release_sigma'])}"
            lines.append(
                f"| {method} | {label} | {','.join(map(str, s['seeds']))} | {pct(s['weighted'])} "
                f"| {pct(s['above_prior'])} | {pct(s['mean'])} | {number(s['spent'])} | {mechanisms} "
                f"| {score_cell(s['psnr'])} "
                f"| {score_cell(s['gray'])} | {score_cell(s['labels'], 2)} |"
            )
    return "\n".join(lines) + "\n"


def plot(info: dict, stats: dict[str, dict[str, dict[str, Any]]], out: Path) -> None:
    """``accuracy_vs_epsilon.png``: per method against ε (log scale; ε = ∞ drawn at the right edge), the
    final pooled accuracy beside the class prior (what DP costs), and the server's white-box attack's
    best-match PSNR minus a mid-gray image's (what it buys: above 0 dB the attack recovers more than a
    constant image); accuracy: mean ± std over seeds, PSNR: over every reconstruction."""
    labels = sorted({label for by_eps in stats.values() for label in by_eps if label != NO_DP}, key=float)
    positions = {label: float(label) for label in labels}
    positions[NO_DP] = 4 * max([float(v) for v in labels], default=1.0)
    colors = method_colors(list(stats))
    fig, (acc_ax, psnr_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    for method, by_eps in stats.items():
        points = sorted((positions[label], s) for label, s in by_eps.items())
        acc_ax.errorbar(
            [p for p, _ in points],
            [100 * s["weighted"][0] for _, s in points],
            yerr=[100 * s["weighted"][1] for _, s in points],
            label=method,
            color=colors[method],
            marker="o",
            capsize=3,
        )
        gaps = [(p, s["psnr"][0] - s["gray"][0], s["psnr"][1]) for p, s in points if s["psnr"] and s["gray"]]
        if gaps:
            psnr_ax.errorbar(
                [p for p, _, _ in gaps],
                [g for _, g, _ in gaps],
                yerr=[e for _, _, e in gaps],
                label=method,
                color=colors[method],
                marker="o",
                capsize=3,
            )
    if "prior" in info:
        acc_ax.axhline(100 * info["prior"]["weighted"][0], color="gray", linestyle="--", label="class prior alone")
    psnr_ax.axhline(0.0, color="gray", linestyle="--", label="a mid-gray image")
    ticks = [*labels, NO_DP]
    for ax in (acc_ax, psnr_ax):
        ax.set_xscale("log")
        ax.set_xticks([positions[t] for t in ticks], [("∞ (no DP)" if t == NO_DP else t) for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("ε per client over the run (δ as configured)")
        ax.legend(fontsize=7)
    acc_ax.set_ylabel("final accuracy, pooled (%)")
    psnr_ax.set_ylabel("attack PSNR − gray image's PSNR (dB)")
    acc_ax.set_title(f"{info['preset']}: what DP costs", fontsize=10)
    psnr_ax.set_title("what it buys: the server's white-box attack on the upload", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "accuracy_vs_epsilon.png", dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder", type=Path, help="the report folder (holds eps-<ε>/ grid copies)")
    parser.add_argument("--grid", action="append", default=[], help="<ε>=<grid folder> (ε: inf or a number)")
    parser.add_argument("--data-dir", default=None, help="dataset folder for the class prior (default: the runs')")
    args = parser.parse_args(argv)
    try:
        with new_folder_or_none(args.folder):
            copies = {}  # every grid is checked before any copy replaces an earlier one
            for item in args.grid:
                label, _, path = item.partition("=")
                epsilon_value(label)
                if not Path(path).is_dir():
                    raise ConfigError(f"--grid {item!r}: {path!r} is no folder")
                target = args.folder / f"{PREFIX}{label}"
                copies[target] = grid_copies(Path(path), target)
            for target, files in copies.items():
                if target.exists():  # a stale cell of an earlier copy must not stay
                    shutil.rmtree(target)
                copy_files(files)
            info, stats = collect(args.folder, args.data_dir)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    (args.folder / "report.md").write_text(render(info, stats))
    plot(info, stats, args.folder)
    print(f"wrote {args.folder / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
