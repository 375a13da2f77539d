"""A run's outcome from its run folder: finding it (:func:`run_folder`), giving a run left ``running`` a
final status (:func:`mark_failed`, :func:`mark_stopped`) and the last lines a launcher prints
(:func:`print_outcome`, :func:`used_requested_config`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tools.runconfig import config_mismatch


def run_folder(output_dir: str | os.PathLike, run_id: int) -> Path | None:
    """The run folder the ServerApp of Flower run ``run_id`` wrote under ``output_dir`` (its name ends
    in the run id), or None when it wrote none."""
    found = sorted(Path(output_dir).glob(f"*-{run_id}/summary.json"))
    return found[-1].parent if found else None


def summary_status(folder: Path | None) -> str | None:
    """The ``status`` of ``<folder>/summary.json`` (``running``, ``completed``, ``failed``, ...); None when
    there is no folder or no readable summary in it."""
    from common.errors import ConfigError
    from common.files import read_summary

    try:
        return read_summary(folder)["status"] if folder is not None else None
    except ConfigError:
        return None


def mark_stopped(folder: Path, reason: str, status_before: str | None) -> None:
    """Give the run folder of a run the launcher stopped a final status: ``summary.json`` status
    ``interrupted`` with ``reason`` under ``error``, when the ServerApp left it ``running`` (killed
    before it could write) or recorded ``failed`` after the stop (``status_before``, its status when
    the signal came, was ``running`` or None: the failure is the stop's doing; its error is kept after
    ``reason``). A run that had ended before the signal keeps its summary, as does a folder without
    a readable one."""

    def final(summary: dict) -> tuple[str, str] | None:
        if summary["status"] != "running" and not (
            summary["status"] == "failed" and status_before in (None, "running")
        ):
            return None
        return "interrupted", reason + (
            f"; the ServerApp then recorded: {summary['error']}" if summary.get("error") else ""
        )

    _finish_summary(folder, final)


def mark_failed(folder: Path, reason: str) -> None:
    """Give the run folder of a run that ended while its ``summary.json`` still said ``running`` (its
    ServerApp was killed or died before it could write) the status ``failed`` with ``reason`` under
    ``error``; any other summary, or a folder without a readable one, is left as it is."""
    _finish_summary(folder, lambda summary: ("failed", reason) if summary["status"] == "running" else None)


def _finish_summary(folder: Path, final: Callable[[dict], tuple[str, str] | None]) -> None:
    """Rewrite ``<folder>/summary.json`` (atomically) with the ``(status, error)`` that ``final`` gives
    for it; unchanged when ``final`` gives None or there is no readable summary."""
    from common.errors import ConfigError
    from common.files import SUMMARY_FILE, atomic_write, read_summary

    try:
        summary = read_summary(folder)
    except ConfigError:
        return
    if (outcome := final(summary)) is None:
        return
    summary.update(status=outcome[0], error=outcome[1])
    text = json.dumps(summary, indent=2, allow_nan=False).encode("utf-8")
    atomic_write(folder / SUMMARY_FILE, lambda f: f.write(text))


def print_outcome(folder: Path | None, status: str) -> None:
    """The run's last lines: its status (and the reason when it failed), final and best accuracy (mean over
    clients and pooled, each best with its round), total payload bytes and its folder, from ``summary.json``."""
    from common.errors import ConfigError
    from common.files import read_summary

    try:
        summary = read_summary(folder) if folder is not None else None
    except ConfigError as exc:
        print(f"status {status}; {exc}")
        return
    if summary is None:
        print(f"status {status}; the run wrote no results folder")
        return
    if summary.get("error") or summary["status"] != "completed":
        print(f"status {status} ({summary['status']}): {summary.get('error') or 'no reason recorded'}")

    def pct(key: str) -> str:
        return f"{100 * summary[key]:.2f} %" if summary.get(key) is not None else "-"

    total = sum(summary.get(f"total_{k}", 0) for k in ("bytes_up", "bytes_down", "eval_bytes_up", "eval_bytes_down"))
    best_mean = f"{pct('best_accuracy_mean')} (mean over clients) in round {summary.get('best_round')}"
    best_pooled = f"{pct('best_accuracy_weighted')} (pooled) in round {summary.get('best_round_weighted')}"
    print(
        f"{summary['rounds_completed']} rounds: final accuracy {pct('final_accuracy_mean')} (mean over clients), "
        f"{pct('final_accuracy_weighted')} (pooled); best {best_mean}, {best_pooled}; "
        f"payload {total / 2**20:.2f} MiB in all (training and evaluation, both ways)"
    )
    if summary.get("incomplete_evaluations"):
        print(
            f"rounds {summary['incomplete_evaluations']} left out of final and best: some clients asked to "
            "evaluate gave no valid evaluation (row key eval_missing)"
        )
    print(f"results: {folder} (python -m tools.report {folder} draws its curves)")


def used_requested_config(folder: Path | None, config: dict[str, Any]) -> bool:
    """Whether the run in ``folder`` used ``config`` (its ``summary.json``); prints what differs if not.
    A run without a readable summary has nothing to compare (:func:`print_outcome` said why)."""
    from common.errors import ConfigError
    from common.files import read_summary

    try:
        used = read_summary(folder).get("config") if folder is not None else None
    except ConfigError:
        used = None
    differs = config_mismatch(config, used) if used is not None else []
    if differs:
        print(f"error: the run did not use the requested run config: {'; '.join(differs)}")
    return not differs
