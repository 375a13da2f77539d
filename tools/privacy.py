"""Attack what a finished run's clients shared: ``python -m tools.privacy <run folder>``.

The run must have recorded its payloads (run config ``record-payloads``, ``engine.payload_recorder``):
the server's view of every upload and download of the named rounds, and each client's personal model
after those rounds (the white-box attacker's knowledge; read by ``tools.privacy_view``). Each (round,
client, attack) is one cell, written to ``<out>/cells/`` as it finishes and skipped when the command is
given again, so a stopped evaluation resumes. At the end ``privacy.md`` (the tables), ``privacy.json``
(every row) and ``reconstructions.png`` (originals above reconstructions, per payload kind) are written
to ``<out>`` (default ``<run folder>/privacy``). The attacks (``--attacks``, default all that apply to
the run's method: ``inversion``, ``decoder``, ``labels``, ``update``, ``membership``) and their scores:
``tools.privacy_attacks``; threat models, attacks and scores: ``docs/privacy.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common.errors import ConfigError
from common.files import atomic_write, check_keys, parse_json, read_text
from privacy import scores
from tools.privacy_attacks import ATTACKS, Attacker, Settings, applicable, cell_path, run_cell
from tools.privacy_view import RunView

FIGURE = "reconstructions.png"
#: the keys (with their types) of every row of ``privacy.json`` and of a cell; a row's other keys are
#: scores: numbers, or null where the attack gives none
ROW_KEYS = {"round": int, "partition": int, "attack": str, "threat": str, "knowledge": str, "payload": str}
#: the keys of a cell file (``tools.privacy_attacks.run_cell``) and of each of its figure pairs
CELL_KEYS = {"rows": list, "figure": list}
PAIR_KEYS = {"payload": str, "caption": str, "original": list, "reconstruction": list}


def check_rows(rows: Any, where: str) -> list[dict[str, Any]]:
    """``rows`` if it is a list of rows of ``privacy.json``: objects with :data:`ROW_KEYS`, every other
    value a number or null.

    Raises:
        ConfigError: naming ``where``, the row and the key that is not so.
    """
    if not isinstance(rows, list):
        raise ConfigError(f"{where} holds a JSON {type(rows).__name__}, not a list of rows")
    for n, row in enumerate(rows):
        check_keys(row, ROW_KEYS, f"{where} row {n}")
        for key, value in row.items():
            score = value is None or (isinstance(value, int | float) and not isinstance(value, bool))
            if key not in ROW_KEYS and not score:
                raise ConfigError(f"{where} row {n}: key '{key}' is {str(value)[:80]!r}, expected a number or null")
    return rows


def read_privacy_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a ``privacy.json`` (read bounded, :func:`common.files.read_text`), checked (:func:`check_rows`).

    Raises:
        ConfigError: naming the file: it cannot be read, is not JSON, or is not a list of rows.
    """
    return check_rows(parse_json(read_text(path), str(path), strict=False), str(path))


def read_cell(path: Path) -> dict[str, Any]:
    """One cell file (``<out>/cells/*.json``), checked: :data:`CELL_KEYS`, its rows (:func:`check_rows`)
    and its figure pairs (:data:`PAIR_KEYS`).

    Raises:
        ConfigError: naming the file and what is wrong.
    """
    cell = check_keys(parse_json(read_text(path), str(path), strict=False), CELL_KEYS, str(path))
    check_rows(cell["rows"], f"{path} key 'rows'")
    for n, pair in enumerate(cell["figure"]):
        check_keys(pair, PAIR_KEYS, f"{path} figure pair {n}")
    return cell


ROW_COLUMNS = (
    ("best_psnr", "PSNR best (dB)"),
    ("best_ssim", "SSIM best"),
    ("best_mse", "MSE best"),
    ("mean_psnr", "PSNR mean (dB)"),
    ("psnr_own", "PSNR to its image (dB)"),
    ("gray_psnr", "gray image PSNR best (dB)"),
    ("gray_psnr_own", "gray image PSNR to the image (dB)"),
)
#: columns shown only when a row has them (rows written before these scores existed do not)
OPTIONAL_COLUMNS = (
    ("ssim_own", "SSIM to its image"),
    ("mean_image_psnr_own", "mean image PSNR to the image (dB)"),
    ("gray_mean_psnr", "gray image PSNR mean (dB)"),
    ("ceiling_mean_psnr", "exact class mean PSNR mean (dB)"),
    ("recognised", "recognised (fraction)"),
    ("ceiling_recognised", "exact class mean recognised (fraction)"),
)


#: a label row's columns: (key, header)
LABEL_COLUMNS = (
    ("label_precision", "label-set precision"),
    ("label_recall", "label-set recall"),
    ("distribution_l1", "distribution L1"),
    ("counts_exact", "class counts revealed exactly"),
    ("counts_within_10pct", "class counts within ±10 %"),
    ("set_only_within_10pct", "within ±10 % knowing the set only"),
)
#: a membership row's columns (``tools.privacy_attacks.Attacker.membership``): (key, header)
MEMBERSHIP_COLUMNS = (
    ("mia_auc", "AUC"),
    ("mia_tpr_at_1pct_fpr", "TPR at 1 % FPR"),
    ("mia_distance_auc", "distance AUC"),
    ("mia_distance_tpr_at_1pct_fpr", "distance TPR at 1 % FPR"),
    ("mia_members", "members"),
    ("mia_nonmembers", "non-members"),
)


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown tables: per round and (attack, threat, knowledge, payload) over victims, image scores as
    mean ± std over every reconstruction, then the label leakage and the membership inference (mean ±
    std over victims), and the CPU seconds per cell."""
    columns = ROW_COLUMNS + tuple(c for c in OPTIONAL_COLUMNS if any(c[0] in r for r in rows))
    # rows from before a score existed lack its key: their tables keep the columns they had
    label_columns = tuple(c for c in LABEL_COLUMNS if c in LABEL_COLUMNS[:3] or any(c[0] in r for r in rows))
    groups: dict[tuple, list[dict]] = {}
    for row in sorted(rows, key=lambda r: r["round"]):
        groups.setdefault((row["round"], row["attack"], row["threat"], row["knowledge"], row["payload"]), []).append(
            row
        )
    lines = [
        "| attack | threat | attacker knows | payload | round | victims | "
        + " | ".join(t for _, t in columns)
        + " | CPU s / cell |",
        "|" + "---|" * (7 + len(columns)),
    ]
    label_lines = [
        "| payload | round | victims | " + " | ".join(t for _, t in label_columns) + " |",
        "|" + "---|" * (3 + len(label_columns)),
    ]
    membership_lines = [
        "| payload | round | victims | attacker knows | " + " | ".join(t for _, t in MEMBERSHIP_COLUMNS) + " |",
        "|" + "---|" * (4 + len(MEMBERSHIP_COLUMNS)),
    ]
    for (rounds, attack, threat, knowledge, payload), group in groups.items():
        victims = ",".join(str(p) for p in sorted({g["partition"] for g in group}))
        seconds = np.mean([g["cpu_seconds"] for g in group])
        if attack == "labels":
            cells = [fmt(spread([g.get(k) for g in group]), 2) for k, _ in label_columns]
            label_lines.append(f"| {payload} | {rounds} | {victims} | " + " | ".join(cells) + " |")
            continue
        if attack == "membership":
            cells = [
                fmt(spread([g.get(k) for g in group]), 0 if k.endswith("members") else 2) for k, _ in MEMBERSHIP_COLUMNS
            ]
            membership_lines.append(f"| {payload} | {rounds} | {victims} | {knowledge} | " + " | ".join(cells) + " |")
            continue
        cells = [fmt(pooled(group, k), 3 if "ssim" in k else 0 if "mse" in k else 1) for k, _ in columns]
        lines.append(
            f"| {attack} | {threat} | {knowledge} | {payload} | {rounds} | {victims} | "
            + " | ".join(cells)
            + f" | {seconds:.0f} |"
        )
    membership = (
        "\nMembership inference (server, from each upload; no leak: AUC 0.5 and TPR (⌊0.01 m⌋ + 1) / (m + 1) "
        "with m non-members, 0.02 at 100; docs/privacy.md):\n\n" + "\n".join(membership_lines) + "\n"
        if len(membership_lines) > 2
        else ""
    )
    return (
        "\n".join(lines)
        + "\n\nLabel leakage (server, from each upload):\n\n"
        + "\n".join(label_lines)
        + "\n"
        + membership
    )


def pooled(group: list[dict[str, Any]], key: str) -> tuple[float, float] | None:
    """Mean and std of ``key`` over every reconstruction of ``group``'s rows (each row holds its mean,
    std and count: ``<key>_n`` where the row has one, else ``n``), or None when no row has it."""
    parts = [(g.get(key + "_n", g["n"]), g[key], g.get(key + "_std", 0.0)) for g in group if g.get(key) is not None]
    if not parts:
        return None
    n = np.array([p[0] for p in parts], dtype=np.float64)
    m = np.array([p[1] for p in parts], dtype=np.float64)
    sd = np.array([p[2] for p in parts], dtype=np.float64)
    mean = float((n * m).sum() / n.sum())
    return mean, float(np.sqrt(max((n * (sd**2 + m**2)).sum() / n.sum() - mean**2, 0.0)))


def spread(values: list) -> tuple[float, float] | None:
    """Mean and std over the rows that have a value, or None."""
    present = [v for v in values if v is not None]
    return (float(np.mean(present)), float(np.std(present))) if present else None


def fmt(stats: tuple[float, float] | None, digits: int) -> str:
    """``mean ± std``, or ``-``."""
    return "-" if stats is None else f"{stats[0]:.{digits}f} ± {stats[1]:.{digits}f}"


def write_report(view: RunView, out: Path, cells: list[dict[str, Any]], command: str) -> None:
    """``privacy.md``, ``privacy.json`` and ``reconstructions.png`` of the cells."""
    rows = [row for cell in cells for row in cell["rows"]]
    atomic_write(out / "privacy.json", lambda f: f.write(json.dumps(rows, indent=1).encode("utf-8")))
    seen, pairs = set(), []
    for cell in cells:
        for pair in cell["figure"]:
            if pair["payload"] not in seen:
                seen.add(pair["payload"])
                pairs.append(
                    (
                        torch.tensor(pair["original"], dtype=torch.uint8),
                        torch.tensor(pair["reconstruction"], dtype=torch.uint8),
                        f"{pair['payload']}\n{pair['caption']}",
                    )
                )
    if pairs:
        scores.reconstruction_figure(
            pairs, out / FIGURE, f"{view.cfg.method}: best-matching original (top) and reconstruction (bottom)"
        )
    cfg = view.cfg
    text = (
        f"# Privacy evaluation: {cfg.method} on {cfg.dataset}, model group {cfg.model_group}\n\n"
        f"Run folder `{view.run_dir.name}`; command `{command}`. PSNR in dB (higher: closer to the image), "
        "SSIM in [-1, 1], MSE on the 0-255 scale; best: the reference image the reconstruction is closest to, mean: "
        "over the images it stands for; mean ± std over reconstructions (rounds x victims x rows). Threat models "
        "and attacks: docs/privacy.md. Budgets (tools.privacy flags) of the cells: "
        + "; ".join(sorted({json.dumps(c.get("settings"), sort_keys=True) for c in cells}))
        + ".\n\n"
        + table(rows)
        + (f"\n![reconstructions]({FIGURE})\n" if pairs else "")
    )
    atomic_write(out / "privacy.md", lambda f: f.write(text.encode("utf-8")))


def parse_list(text: str | None, allowed: list, what: str) -> list:
    """A comma-separated flag's values (None: ``allowed``). Raises SystemExit naming a value not allowed."""
    if text is None:
        return list(allowed)
    values = [
        int(v) if isinstance(allowed[0] if allowed else 0, int) else v
        for v in (t.strip() for t in text.split(","))
        if v
    ]
    bad = [v for v in values if v not in allowed]
    if bad:
        raise SystemExit(f"--{what}: {bad} not available; this run has {allowed}")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.privacy", description=__doc__.split("\n")[0])
    parser.add_argument("run", help="a run folder of a run with record-payloads")
    parser.add_argument("--rounds", help="recorded rounds to attack, e.g. 1,10 (default: every recorded round)")
    parser.add_argument("--clients", help="victim partitions, e.g. 0,1,2 (default: every recorded one)")
    parser.add_argument("--attacks", help=f"comma-separated of {', '.join(ATTACKS)} (default: those that apply)")
    parser.add_argument("--out", help="output folder (default <run>/privacy)")
    parser.add_argument(
        "--threads", type=int, default=1, help="PyTorch CPU threads (default 1: the attacks are small and sequential)"
    )
    for f in Settings.__dataclass_fields__.values():
        parser.add_argument(
            f"--{f.name.replace('_', '-')}",
            type=type(f.default),
            default=f.default,
            choices=("tv", "dip") if f.name == "prior" else None,
        )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        return evaluate(args, argv if argv is not None else sys.argv[1:])
    except (ConfigError, FileNotFoundError) as exc:  # a bad file or run, missing data: one line naming it
        print(f"tools.privacy: {exc}", file=sys.stderr)
        return 2


def evaluate(args: argparse.Namespace, given: list[str]) -> int:
    """Run :func:`main`'s cells and write the report; returns the exit status.

    Every recorded payload the cells read is read (and checked, ``engine.payload_recorder.read_arrays``)
    before the first cell runs, so a bad payload file stops the command before it writes anything.

    Raises:
        ConfigError: the run folder, a payload, a client's model or a cell file is not what this
            system wrote (naming it), or an attack needs what the run lacks.
    """
    view = RunView(args.run)
    rounds = parse_list(args.rounds, view.rounds(), "rounds")
    attacks = parse_list(args.attacks, applicable(view), "attacks") if args.attacks else applicable(view)
    unknown = [a for a in attacks if a not in ATTACKS]
    if unknown:
        raise SystemExit(f"--attacks: {unknown} unknown; allowed {list(ATTACKS)}")
    settings = Settings(**{k: getattr(args, k) for k in Settings.__dataclass_fields__})
    out = Path(args.out) if args.out else view.run_dir / "privacy"
    attacker = Attacker(view, settings)
    todo = [(r, p, a) for r in rounds for p in parse_list(args.clients, view.partitions(r), "clients") for a in attacks]
    for r, p in dict.fromkeys((r, p) for r, p, _ in todo):
        for direction in ("up", "down"):
            view.payload(r, p, direction)
    from tqdm import tqdm

    for r, p, a in tqdm(todo, desc="privacy cells", unit="cell"):
        if not cell_path(out, r, p, a).is_file():
            run_cell(attacker, r, p, a, out)
    # the report covers every cell in the folder, also those of earlier invocations (other rounds, clients)
    cells = [read_cell(path) for path in sorted((out / "cells").glob("*.json"))]
    # the run folder is a local output (never committed): the command names it by its role
    command = "python -m tools.privacy " + " ".join("<run folder>" if a == args.run else a for a in given)
    write_report(view, out, cells, command)
    print(f"tools.privacy: {len(todo)} cells asked, {len(cells)} in the report {out / 'privacy.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
