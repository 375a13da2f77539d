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
(:func:`tools.grid_stats.above_baseline`).

This module writes the Markdown and holds the command line; the grid's rows are read by
``tools.grid_rows``, the numbers computed by ``tools.grid_stats`` and the figures drawn by
``tools.figures``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from common.errors import ConfigError
from common.files import ROWS_FILE, SUMMARY_FILE, check_keys, new_folder_or_none, read_rows
from tools.figures import FIGURES, plot_curves, plot_partitions
from tools.grid import read_grid_info, run_summary
from tools.grid_rows import (
    ABLATIONS,
    Cell,
    ablation_label,
    base_method,
    copy_files,
    load_ablations,
    load_grid,
    paper_info,
    run_copies,
)
from tools.grid_stats import above_baseline, difference, method_stats, training_flops, with_federation_size


def pct(value: tuple[float, float] | None, seeds: int = 2) -> str:
    """``value`` = (mean, sample std) of fractions as ``"M ± S"`` in percent, 2 decimals; ``"-"`` for
    None; over ``seeds`` = 1 the mean alone (a sample std of one seed does not exist)."""
    if value is None:
        return "-"
    return f"{100 * value[0]:.2f}" + (f" ± {100 * value[1]:.2f}" if seeds > 1 else "")


def describe_above(method: str, above: dict) -> str:
    """One clause of the report's "Above Local" line for :func:`above_baseline`'s result."""
    if above["first"] is None:
        return f"{method} never"
    share = f"{above['above']} of {above['of']} rounds"
    if above["stays_from"] is None:
        return f"{method} first at round {above['first']}, {share}, not at the end"
    return f"{method} from round {above['stays_from']} to the end (first at round {above['first']}, {share})"


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
    # not reproduced, or in a reversed pair: the methods the cross-check must speak to
    rows, missed = reproduction_verdicts(ours, n, reported, spread, least, provisional)
    lines += rows
    order = sorted(ours, key=lambda m: -reported[m])
    if len(order) >= 2:
        ranking, reversed_pairs = ranking_comparison(order, reported, ours, n)
        lines += ranking
        missed |= reversed_pairs
    return lines + crosscheck_notes(paper.get("crosscheck", {}), [m for m in ours if m in missed])


def reproduction_verdicts(
    ours: dict[str, tuple[float, float]],
    n: dict[str, int],
    reported: dict,
    spread: dict,
    least: float,
    provisional: bool,
) -> tuple[list[str], set[str]]:
    """The rows of :func:`paper_comparison`'s table, one per method of ``ours`` (mean, sample std over
    ``n[method]`` seeds, fractions) against ``reported`` (method -> percent) ± ``spread`` (points), with
    its verdict (tolerance at least ``least`` points; marked provisional when ``provisional``): the
    Markdown lines, and the methods not reproduced."""
    rows, missed = [], set()
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
        rows.append(
            f"| {m} | {pct((mean, std))} (n={n[m]}) | {reported[m]:.2f}"
            + (f" ± {spread[m]:.2f}" if m in spread else "")
            + f" | {gap:+.2f} "
            f"(tolerance {tolerance:.2f}) | {verdict}{' (provisional)' if provisional else ''} |"
        )
    return rows, missed


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
    """The report as Markdown: the setup, the results table, where each method is above Local, the
    ablations, the verdicts against the paper, the figures, the compute time and the commands."""
    key = paper.get("ours", "final_accuracy_mean")
    lengths = sorted({r for s in stats.values() for r in s["rounds"]})
    lines = setup_section(info, paper, key, lengths)
    lines += results_table(stats, paper.get("reported", {}), paper.get("target"), flops)
    lines += above_local_section(key, stats)
    lines += ablation_comparison(key, stats) + paper_comparison(paper, stats) + [""]
    lines += [f"![{f}]({f})" for f in FIGURES]
    lines += compute_time_section(info.get("launches", [])) + commands_section(info.get("invocations", []))
    return "\n".join(lines) + "\n"


def setup_section(info: dict, paper: dict, key: str, lengths: list[int]) -> list[str]:
    """Markdown lines: the title, the paper and its setting (with the paper file's ``notes``), the grid
    (rounds, seeds, overrides, commits) and each ablation grid; ``key`` is the row metric beside the paper's.
    ``lengths``: the rounds the grid's runs have (sorted); where they are not all ``info['rounds']`` the
    grid line names them (a grid whose cells were run with another ``--rounds``), not the grid's own."""
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
    if lengths and lengths != [info["rounds"]]:
        rounds_text = " or ".join(str(r) for r in lengths) + " rounds per run (the table's rounds column)"
    else:
        rounds_text = f"{info['rounds']} rounds per run"
    lines += [
        f"Grid: {rounds_text}, seeds {info['seeds']}"
        + (f", preset changed by {changed}" if changed else ", the preset as it is")
        + ". Commits: "
        + ", ".join(sorted({i["commit"] for i in info.get("invocations", [])}))
        + ".",
        "",
    ]
    for sub in info.get("ablations", []):
        lines += [
            f"Ablation `{sub['label']}`: {', '.join(sub['methods'])} with it, {sub['rounds']} rounds per run, "
            f"seeds {sub['seeds']} (`{ABLATIONS}/{sub['folder']}`).",
            "",
        ]
    return lines


def results_table(stats: dict[str, dict], reported: dict, target: float | None, flops: float | None) -> list[str]:
    """Markdown lines: the table of :func:`tools.grid_stats.method_stats`' numbers, one row per method
    of ``stats``, with the paper's number (``reported``: method -> percent), and its footnote. ``target``
    is the paper's target accuracy (a fraction; None without one), ``flops`` the training FLOPs per
    client-round (None: not counted)."""
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
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for method, s in stats.items():
        to_target = "-" if s.get("rounds_to_target") is None else f"{s['rounds_to_target'][0]:.1f} ({s['reached']})"
        to_bytes = "-" if s.get("bytes_to_target") is None else f"{s['bytes_to_target']:,.0f}"
        row = [
            method,
            ",".join(map(str, s["seeds"])),
            "/".join(str(r) for r in s["rounds"]),
            pct(s["final_accuracy_mean"], len(s["seeds"])),
            pct(s["best_accuracy_mean"], len(s["seeds"])),
            pct(s["final_accuracy_weighted"], len(s["seeds"])),
            pct(s["best_accuracy_weighted"], len(s["seeds"])),
            to_target,
            to_bytes,
            f"{s['up_per_client_round']:,.0f}",
            f"{s['down_per_client_round']:,.0f}",
            f"{s['seconds_per_round']:.1f}",
            "-" if flops is None else f"{flops / 1e9:.1f}",
            f"{reported[method]:.2f}" if method in reported else "-",
        ]
        lines.append("| " + " | ".join(row) + " |")
    return lines + [
        "",
        "Accuracies in percent, mean ± sample std over seeds. Rounds to target: mean over the seeds that "
        "reached it (how many in brackets); bytes to target: training and evaluation payloads, both ways, up "
        "to that round. FLOPs: forward + backward of the personal model only.",
        "",
    ]


def above_local_section(key: str, stats: dict[str, dict]) -> list[str]:
    """Markdown lines: where each method is above Local on ``key`` (the ``ahead_of_local`` of ``stats``,
    :func:`tools.grid_stats.above_baseline`); none without Local in the grid."""
    ahead = {m: s["ahead_of_local"] for m, s in stats.items() if "ahead_of_local" in s}
    if not ahead:
        return []
    return [
        f"Above Local (`{key.split('_', 1)[1]}`, mean over seeds, up to the last round all have): "
        + "; ".join(describe_above(m, a) for m, a in ahead.items())
        + ".",
        "",
    ]


def compute_time_section(launches: list[dict]) -> list[str]:
    """Markdown lines: wall-clock and CPU time of the grid's launches (``grid.json``'s ``launches``),
    per method (minutes) and in all (hours); none without launches."""
    if not launches:
        return []
    per_method: dict[str, list[float]] = {}
    for launch in launches:
        totals = per_method.setdefault(launch["cell"].rsplit("-seed", 1)[0], [0.0, 0.0])
        totals[0] += launch["wall_seconds"]
        totals[1] += launch["cpu_seconds"]
    return [
        "",
        "Time of the grid's launches (start-up included; CPU = all processes of the run): "
        + "; ".join(f"{m} {w / 60:.0f} min wall, {c / 60:.0f} min CPU" for m, (w, c) in per_method.items())
        + f"; in all {sum(w for w, _ in per_method.values()) / 3600:.2f} h wall, "
        f"{sum(c for _, c in per_method.values()) / 3600:.2f} h CPU.",
    ]


def commands_section(invocations: list[dict]) -> list[str]:
    """Markdown lines: each command that ran the grid (``grid.json``'s ``invocations``), when, at which
    commit and on which machine; none without invocations."""
    if not invocations:
        return []
    return ["", "Commands:", ""] + [
        f"- `{i['command']}` at {i['started']} ({i['commit']}, {i['machine']})" for i in invocations
    ]


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
        ConfigError: a folder is no grid, a file of a grid is not what the grid wrote, or an ablation
            is not one (:func:`load_ablations`); all checked before anything is copied to ``out``.
    """
    out = out or grid
    info = read_grid_info(grid)
    for ablation in ablations:
        ablation_label(ablation, read_grid_info(ablation), info)
    sources = [(grid, out)] if out.resolve() != grid.resolve() else []
    sources += [(ablation, out / ABLATIONS / ablation.name) for ablation in ablations]
    copy_files([copy for source, target in sources for copy in run_copies(source, target)])
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
        ConfigError: the folder's ``metrics.jsonl`` is not what a run wrote, it has no rows, or its
            ``summary.json`` has a ``config`` that is not an object; ``out`` is created only after.
    """
    out = out or run
    summary, rows = run_summary(run), read_rows(run)
    if not rows:
        raise ConfigError(f"{run / ROWS_FILE} holds no round yet")
    config = check_keys(summary, {"config": dict}, str(run / SUMMARY_FILE))["config"] if "config" in summary else {}
    out.mkdir(parents=True, exist_ok=True)
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
        with new_folder_or_none(args.out or args.grid):
            if (args.grid / ROWS_FILE).is_file():  # one run folder (tools.run), not a grid
                if args.ablation:
                    raise ConfigError(f"--ablation goes with a grid folder; {args.grid} is one run")
                report_run(args.grid, args.out, args.data_dir)
            else:
                report(args.grid, args.out, args.data_dir, ablations=args.ablation)
    except ConfigError as exc:  # a file of the grid is not what the grid wrote: name it, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {(args.out or args.grid) / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
