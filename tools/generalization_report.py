"""Clients that never trained: training against held-out accuracy, per method and setting, over grids.

Usage (from the repository root)::

    uv run --frozen python -m tools.generalization_report results/generalization \\
        --grid homogeneous=outputs/grids/generalization-cifar10-mh-lenet \\
        --grid heterogeneous=outputs/grids/generalization-cifar10-mh-zoo
    uv run --frozen python -m tools.generalization_report results/generalization   # from the copies

Each ``--grid <setting>=<folder>`` is a ``tools.grid`` folder of a preset with held-out clients (run
config ``generalization.*``, docs/generalization.md). Its ``grid.json`` and each cell's newest
``metrics.jsonl`` and ``summary.json`` are copied to ``<folder>/<setting>/`` (``tools.grid_rows.copy_runs``),
so the report is regenerated from the copies alone. Writes ``<folder>/report.md`` and per setting
``generalization_<setting>.png`` (accuracy against round: training clients dashed, held-out clients
solid, as MH-pFedHN's Figures 3-5) and ``personalization_<setting>.png`` (the last phase's held-out
accuracy against its personalisation rounds).

Per method and setting, over its seeds (mean ± sample std, percent, unweighted over clients): the
training clients' final accuracy (last evaluated round) and, per seed, how far it is above that seed's
class prior (the training clients' :func:`tools.grid_stats.prior_accuracy`), the held-out clients'
accuracy after the last phase's personalisation and before it (what a new client gets), the personalisation rounds
the held-out clients took to reach the training clients' final accuracy (per seed; ``-``: not
within the phase), and the bytes of the last phase. Then the verdicts on MH-pFedHN's claims (§4.4):
MH-pFedHNGD generalises better than MH-pFedHN, and both beat the baselines on held-out clients.
"""

from __future__ import annotations

import argparse
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
from tools.grid_rows import Cell, copy_files, load_grid, run_copies  # noqa: E402
from tools.grid_stats import mean_std, prior_by_seed, prior_stats, seed_curves  # noqa: E402
from tools.report import pct  # noqa: E402

#: MH-pFedHN's methods and the claims of its §4.4 the verdicts test
HYPERNETWORKS = ("mh-pfedhn", "mh-pfedhngd")
CLAIMS = {
    "gd": "MH-pFedHNGD generalises better than MH-pFedHN (§4.4, Figures 3-4)",
    "baselines": "MH-pFedHN and MH-pFedHNGD beat the baselines on held-out clients, by up to 20 % (homogeneous "
    "models) and up to 50 % (heterogeneous models) (§4.4)",
}


def last_phase(cell: Cell) -> dict[str, Any] | None:
    """The row of the cell's last generalisation phase (None: the run had none)."""
    phases = [r for r in cell.rows if r.get("heldout_curve_mean")]
    return phases[-1] if phases else None


def rounds_to_level(cell: Cell) -> int | None:
    """Personalisation rounds of the last phase until the held-out clients' mean accuracy reaches the
    training clients' final mean accuracy (0: before any); None when it never does."""
    phase, training = last_phase(cell), cell.curve("accuracy_mean")[1]
    if phase is None or not len(training):
        return None
    return next((i for i, a in enumerate(phase["heldout_curve_mean"]) if a is not None and a >= training[-1]), None)


def method_numbers(cells: list[Cell]) -> dict[str, Any]:
    """The report's numbers of one method's cells (seeds) in one setting (module docstring)."""
    phased = [(c, last_phase(c)) for c in cells if last_phase(c) is not None]
    return {
        "seeds": sorted(c.seed for c in cells),
        "training": mean_std([c.curve("accuracy_mean")[1][-1] for c in cells]),
        "training_by_seed": {c.seed: c.curve("accuracy_mean")[1][-1] for c in cells},
        "heldout": mean_std([p["heldout_accuracy_mean"] for _, p in phased]) if phased else None,
        "untouched": mean_std([p["heldout_curve_mean"][0] for _, p in phased]) if phased else None,
        "to_level": [rounds_to_level(c) for c, _ in phased],
        "phase_bytes": mean_std([p["heldout_bytes_up"] + p["heldout_bytes_down"] for _, p in phased])
        if phased
        else None,
        "personalization": [p["heldout_curve_mean"] for _, p in phased],
    }


def collect(folder: Path, data_dir: str | None = None) -> dict[str, tuple[dict, dict[str, dict[str, Any]], list[Cell]]]:
    """setting -> (its ``grid.json``, method -> :func:`method_numbers`, its cells) over ``<folder>/*/grid.json``.
    The grid info also gets ``prior``: the class prior's accuracy of its training and held-out clients
    (``tools.grid_stats.prior_stats``) and ``prior_by_seed`` (``tools.grid_stats.prior_by_seed``), or
    ``prior_error`` when the data are not readable.

    Raises:
        ConfigError: no grid copy in ``folder``.
    """
    grids = sorted(p.parent for p in folder.glob("*/grid.json"))
    if not grids:
        raise ConfigError(f"{folder} holds no grid copy: give them with --grid <setting>=<grid folder>")
    out = {}
    for grid in grids:
        info, cells = load_grid(grid)
        by_method = {m: method_numbers([c for c in cells if c.method == m]) for m in sorted({c.method for c in cells})}
        try:
            info["prior_by_seed"] = prior_by_seed(info["preset_config"], cells, data_dir)
            info["prior"] = {label: prior_stats(scores) for label, scores in info["prior_by_seed"].items()}
        except ConfigError as exc:  # regenerating without the dataset: the rest of the report stands
            info["prior_error"] = str(exc)
        out[grid.name] = (info, by_method, cells)
    return out


def verdict_gd(stats: dict[str, dict[str, Any]]) -> str:
    """Held-out accuracy of MH-pFedHNGD against MH-pFedHN, with the seed spread."""
    gd, hn = (stats.get(m, {}).get("heldout") for m in ("mh-pfedhngd", "mh-pfedhn"))
    if gd is None or hn is None:
        return "not run"
    diff = 100 * (gd[0] - hn[0])
    spread = 100 * max(gd[1], hn[1])
    word = "higher" if diff > 0 else "lower"
    if min(len(stats[m]["seeds"]) for m in ("mh-pfedhngd", "mh-pfedhn")) < 2:
        return f"GD {word} by {abs(diff):.2f} points on one seed, no spread to judge it against: undecided"
    sure = "beyond" if abs(diff) > spread else "within"
    return f"GD {word} by {abs(diff):.2f} points ({sure} the larger seed std, {spread:.2f}): " + (
        "holds" if diff > spread else "does not hold"
    )


def verdict_baselines(stats: dict[str, dict[str, Any]]) -> str:
    """Held-out accuracy of each hypernetwork method against the best baseline (Local excluded: the control).

    It holds when every hypernetwork method run is above the best baseline by more than the larger seed
    std of the methods compared (percentage points); on one seed it is undecided.
    """
    baselines = {m: s["heldout"] for m, s in stats.items() if m not in (*HYPERNETWORKS, "local") and s["heldout"]}
    if not baselines:
        return "no baseline run"
    mine = {m: stats[m]["heldout"] for m in HYPERNETWORKS if stats.get(m, {}).get("heldout")}
    if not mine:
        return "no hypernetwork method run"
    best = max(baselines, key=lambda m: baselines[m][0])
    diffs = {m: 100 * (held[0] - baselines[best][0]) for m, held in mine.items()}
    parts = ", ".join(f"{m} {'+' if d >= 0 else ''}{d:.2f} points" for m, d in diffs.items())
    head = f"against the best baseline ({best}, {pct(baselines[best])}): {parts}"
    if min(len(stats[m]["seeds"]) for m in (*mine, best)) < 2:
        return f"{head} on one seed, no spread to judge it against: undecided"
    spread = 100 * max(held[1] for held in (*mine.values(), baselines[best]))
    holds = all(d > spread for d in diffs.values())
    return f"{head} (the larger seed std {spread:.2f}): " + ("holds" if holds else "does not hold")


def render(settings: dict[str, tuple[dict, dict[str, dict[str, Any]], list[Cell]]]) -> str:
    lines = [
        "# Clients that never trained: held-out against training accuracy",
        "",
        "Accuracy in percent, unweighted over clients, mean ± sample std over seeds (docs/generalization.md).",
        "*training*: the training clients' final accuracy; *held-out, new*: the held-out clients before any",
        "personalisation (what a new client gets); *held-out*: after the last phase's personalisation rounds;",
        "*above the prior*: per seed, the training clients' final accuracy minus their class prior's (points;",
        "the learning budget asks for at least 15);",
        "*rounds to level*: per seed, the personalisation rounds until the held-out mean reached the training",
        "mean (`-`: not within the phase); *phase bytes*: payload bytes of the last phase, both ways.",
        "*class prior alone*: every client predicts its most frequent training class "
        "(`tools.grid_stats.prior_accuracy`):",
        "what a model that learnt only its client's label skew scores.",
    ]
    for setting, (info, stats, cells) in settings.items():
        overrides = ", ".join(f"{k}={v}" for k, v in info.get("overrides", {}).items()) or "none"
        lines += [
            "",
            f"## {setting}: {info['preset']} (overrides: {overrides})",
            "",
            "| method | seeds | training | above the prior | held-out, new | held-out | rounds to level "
            "| phase bytes |",
            "|---|---|---|---|---|---|---|---|",
        ]
        by_seed = info.get("prior_by_seed", {}).get("training")
        for method, s in stats.items():
            level = ", ".join("-" if r is None else str(r) for r in s["to_level"]) or "-"
            phase_bytes = "-" if s["phase_bytes"] is None else f"{s['phase_bytes'][0]:,.0f}"
            above = "-"
            if by_seed is not None:
                gaps = (100 * (a - by_seed[seed][0]) for seed, a in sorted(s["training_by_seed"].items()))
                above = ", ".join(f"{gap:.2f}" for gap in gaps)
            lines.append(
                f"| {method} | {','.join(map(str, s['seeds']))} | {pct(s['training'])} | {above} "
                f"| {pct(s['untouched'])} | {pct(s['heldout'])} | {level} | {phase_bytes} |"
            )
        if "prior" in info:
            prior = info["prior"]
            lines.append(
                f"| class prior alone | {','.join(map(str, sorted({c.seed for c in cells})))} "
                f"| {pct(prior['training']['mean'])} | - | {pct(prior.get('held-out', {}).get('mean'))} "
                f"| {pct(prior.get('held-out', {}).get('mean'))} | - | - |"
            )
        else:
            lines += ["", f"Class prior alone: not computed ({info['prior_error']}; pass --data-dir)."]
        lines += [
            "",
            f"- {CLAIMS['gd']}: {verdict_gd(stats)}.",
            f"- {CLAIMS['baselines']}: {verdict_baselines(stats)}.",
        ]
    return "\n".join(lines) + "\n"


def plot(setting: str, stats: dict[str, dict[str, Any]], cells: list[Cell], out: Path) -> None:
    """The two figures of one setting (module docstring), means over seeds."""
    colors = method_colors(list(stats))
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for method in stats:
        mine = [c for c in cells if c.method == method]
        rounds, values = seed_curves(mine, "accuracy_mean")
        ax.plot(rounds, 100 * values.sum(0) / len(mine), linestyle="--", color=colors[method], alpha=0.7)
        phases = [
            [(r["round"], r["heldout_accuracy_mean"]) for r in c.rows if r.get("heldout_curve_mean")] for c in mine
        ]
        m = min(len(p) for p in phases)
        if m:
            xs = [phases[0][i][0] for i in range(m)]
            ys = [100 * sum(p[i][1] for p in phases) / len(phases) for i in range(m)]
            ax.plot(xs, ys, linestyle="-", marker="o", color=colors[method], label=method)
    ax.set_xlabel("round")
    ax.set_ylabel("accuracy, mean over clients (%)")
    ax.set_title(f"{setting}: held-out clients (solid) and training clients (dashed)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / f"generalization_{setting}.png", dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    for method, s in stats.items():
        curves = s["personalization"]
        if curves:
            n = min(len(c) for c in curves)
            ys = [100 * sum(c[i] for c in curves) / len(curves) for i in range(n)]
            ax.plot(range(n), ys, marker="o", color=colors[method], label=method)
            ax.axhline(100 * s["training"][0], color=colors[method], linestyle="--", alpha=0.5)
    ax.set_xlabel("personalisation round of the last phase (0: before any)")
    ax.set_ylabel("held-out accuracy, mean over clients (%)")
    ax.set_title(f"{setting}: held-out clients after the last round (dashed: training clients)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / f"personalization_{setting}.png", dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder", type=Path, help="the report folder (holds <setting>/ grid copies)")
    parser.add_argument("--grid", action="append", default=[], help="<setting>=<grid folder>")
    parser.add_argument("--data-dir", default=None, help="dataset folder for the class prior (default: the runs')")
    args = parser.parse_args(argv)
    try:
        with new_folder_or_none(args.folder):
            copies = {}  # every grid is checked before any copy replaces an earlier one
            for item in args.grid:
                setting, _, path = item.partition("=")
                if not setting.replace("-", "").isalnum() or not Path(path).is_dir():
                    raise ConfigError(f"--grid {item!r}: give <setting>=<grid folder>, the setting a plain name")
                copies[args.folder / setting] = run_copies(Path(path), args.folder / setting)
            for target, files in copies.items():
                if target.exists():  # a stale cell of an earlier copy must not stay
                    shutil.rmtree(target)
                copy_files(files)
            settings = collect(args.folder, args.data_dir)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    (args.folder / "report.md").write_text(render(settings))
    for setting, (_, stats, cells) in settings.items():
        plot(setting, stats, cells, args.folder)
    print(f"wrote {args.folder / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
