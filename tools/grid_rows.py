"""Read a grid (``tools.grid``) back: its cells' rows and summaries (:class:`Cell`), the ablation grids
beside it, the preset's paper file, and copies of the runs a report reads (:func:`copy_runs`)."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.errors import ConfigError
from common.files import ROWS_FILE, SUMMARY_FILE, read_rows, read_text
from common.run_folder import counted_rows
from tools.grid import GRID_FILE, newest_run, read_grid_info
from tools.runconfig import ROOT


@dataclass
class Cell:
    """One (method, seed) run of a grid: its rows (one per round) and summary."""

    method: str
    seed: int
    rows: list[dict]
    summary: dict

    def curve(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """(rounds, values) of the evaluated rounds for row key ``key``: those in which every client
        asked to evaluate gave a valid evaluation (:func:`common.run_folder.counted_rows`, as the run's
        summary counts them)."""
        rows = counted_rows(self.rows, key)
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
        label = ablation_label(sub, sub_info, info)
        cells += [Cell(f"{c.method}{ABLATION_MARK}{label})", c.seed, c.rows, c.summary) for c in sub_cells]
        infos.append({**sub_info, "label": label, "folder": sub.name})
    return cells, infos


def ablation_label(sub: Path, sub_info: dict, info: dict) -> str:
    """``<key>=<value> ...``: the overrides that grid ``sub`` (its ``grid.json``: ``sub_info``) adds to
    the grid of ``info``, whose ablation it is.

    Raises:
        ConfigError: ``sub`` is a grid of another preset, or adds no override (naming its ``grid.json``).
    """
    if sub_info["preset"] != info["preset"]:
        raise ConfigError(f"{sub / GRID_FILE}: preset {sub_info['preset']!r}, not the grid's {info['preset']!r}")
    base = info.get("overrides", {})
    added = {k: v for k, v in sub_info.get("overrides", {}).items() if base.get(k) != v}
    if not added:
        raise ConfigError(f"{sub / GRID_FILE}: adds no override to the grid's {base}: not an ablation")
    return " ".join(f"{k}={v}" for k, v in added.items())


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
        ConfigError: the file cannot be read or is not TOML, a key outside these, a
            ``[reported-std]`` method without a paper number, or a ``[crosscheck]`` entry that is not
            text (naming the file and the key).
    """
    import tomllib

    path = ROOT / "presets" / f"{Path(preset).stem}.paper.toml"
    if not path.is_file():
        return {}
    try:
        paper = tomllib.loads(read_text(path))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not TOML: {exc}") from None
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


def run_copies(grid: Path, out: Path) -> list[tuple[Path, Path]]:
    """(file, its copy) for :func:`copy_runs`: ``grid.json`` and each cell's newest ``metrics.jsonl``
    and ``summary.json`` of ``grid`` and of every grid under ``<grid>/ablations/``, in the grid's
    layout under ``out``; a cell without a finished round is left out, as the report leaves it out.
    Every ``grid.json`` and ``metrics.jsonl`` is read and checked here, so that a folder that is no
    grid is refused before anything is written.

    Raises:
        ConfigError: ``grid`` is no grid folder, or a ``grid.json`` or ``metrics.jsonl`` is not what
            the grid wrote (naming the file).
    """
    read_grid_info(grid)
    copies = [(grid / GRID_FILE, out / GRID_FILE)]
    if (grid / ABLATIONS).is_dir():
        for sub in sorted(p for p in (grid / ABLATIONS).iterdir() if p.is_dir()):
            copies += run_copies(sub, out / ABLATIONS / sub.name)
    for folder, (run, _, _) in finished_runs(grid):
        copies += [(run / name, out / folder.name / run.name / name) for name in (ROWS_FILE, SUMMARY_FILE)]
    return [(source, copy) for source, copy in copies if source.is_file()]


def copy_files(copies: list[tuple[Path, Path]]) -> None:
    """Copy each (file, copy) pair (:func:`run_copies`), creating the copies' folders."""
    for source, copy in copies:
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, copy)


def copy_runs(grid: Path, out: Path) -> None:
    """Copy ``grid.json`` and each cell's newest metrics.jsonl and summary.json into ``out`` (grid
    layout), and so every grid under ``<grid>/ablations/`` (:func:`run_copies`); nothing is written
    when ``grid`` is not a grid.

    Raises:
        ConfigError: see :func:`run_copies`.
    """
    copy_files(run_copies(grid, out))
