"""Results written as the run goes: ``metrics.jsonl`` (one row per round) and ``summary.json``.

Layout: ``<output-dir>/<UTC time>-<method>-<dataset>-<run id>/``. A row is appended and
flushed after every round and the summary rewritten atomically, so a crash loses at most the
round in progress. ``summary.json`` has ``status`` ``running`` until the run ends
(``completed``) or fails (``failed``). ``checkpoint.pt`` holds the strategy's state after the
last completed round (server arrays, optimiser, RNG, byte counters, rows): run config key
``resume-from`` = that folder continues the run in a new folder that starts with the old rows.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

CHECKPOINT = "checkpoint.pt"

log = logging.getLogger("flwr." + __name__)  # streamed with Flower's own log


class ResultsWriter:
    """Appends round rows and keeps ``summary.json`` current.

    Args:
        output_dir: parent folder (created if missing).
        run_name: sub-folder name for this run.
        config: the full run config (stored in the summary).
    """

    def __init__(self, output_dir: str | os.PathLike, run_name: str, config: dict[str, Any]) -> None:
        self.path = Path(output_dir).absolute() / run_name
        self.path.mkdir(parents=True, exist_ok=False)
        self.config = config
        self.start = time.perf_counter()
        self.rows: list[dict[str, Any]] = []
        self.status = "running"
        self._write_summary()
        log.info("Writing results to %s", self.path)

    def write_round(self, row: dict[str, Any]) -> None:
        """Append one round's row to ``metrics.jsonl`` and refresh the summary."""
        self.rows.append(row)
        with open(self.path / "metrics.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self._write_summary()

    def write_checkpoint(self, state: dict[str, Any]) -> None:
        """Save the strategy's state atomically as ``checkpoint.pt`` (replaces the previous one)."""
        tmp = self.path / (CHECKPOINT + ".tmp")
        torch.save(state, tmp)
        tmp.replace(self.path / CHECKPOINT)

    def finish(self, status: str = "completed") -> None:
        """Mark the run ``completed`` (or ``failed``) in the summary."""
        self.status = status
        self._write_summary()

    def summary(self) -> dict[str, Any]:
        """Final and best ``accuracy_mean`` and best ``accuracy_weighted`` (fractions), totals, status."""
        evaluated = [r for r in self.rows if r.get("accuracy_mean") is not None]
        best = max(evaluated, key=lambda r: r["accuracy_mean"], default=None)
        best_weighted = max((r["accuracy_weighted"] for r in evaluated), default=None)
        total = {k: sum(r.get(k, 0) for r in self.rows)
                 for k in ("bytes_up", "bytes_down", "eval_bytes_up", "eval_bytes_down")}
        return {
            "status": self.status,
            "rounds_completed": len(self.rows),
            "final_accuracy_mean": evaluated[-1]["accuracy_mean"] if evaluated else None,
            "final_accuracy_weighted": evaluated[-1]["accuracy_weighted"] if evaluated else None,
            "best_accuracy_mean": best["accuracy_mean"] if best else None,
            "best_round": best["round"] if best else None,
            "best_accuracy_weighted": best_weighted,  # FedTGP's headline: best pooled accuracy
            **{f"total_{k}": v for k, v in total.items()},
            "total_seconds": time.perf_counter() - self.start,
            "config": self.config,
        }

    def _write_summary(self) -> None:
        tmp = self.path / "summary.json.tmp"
        tmp.write_text(json.dumps(self.summary(), indent=2), encoding="utf-8")
        tmp.replace(self.path / "summary.json")


def load_checkpoint(run_dir: str | os.PathLike) -> dict[str, Any]:
    """The state saved by :meth:`ResultsWriter.write_checkpoint` in ``run_dir``.

    Raises:
        FileNotFoundError: naming the run config key when ``run_dir`` holds no checkpoint.
    """
    path = Path(run_dir) / CHECKPOINT
    if not path.is_file():
        raise FileNotFoundError(f"run config key 'resume-from' = {str(run_dir)!r}: no {CHECKPOINT} there")
    return torch.load(path, weights_only=False)
