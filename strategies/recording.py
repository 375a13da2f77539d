"""What the server saw, kept for the privacy evaluation: run config ``record-payloads``.

In a recorded round the server writes every payload it sends (downloads: what a curious client
sees) and every valid reply's payload and metrics (uploads: what an honest-but-curious server sees)
into the run folder, and the train instruction asks each client to keep a copy of its personal
model as it was after that round's training (``record``, :func:`common.protocol.snapshot_name`): the white-box
attacker's knowledge, used by ``tools.privacy`` only to attack and score, never by the run.

Layout, one folder per round and partition::

    <run folder>/payloads/round-<r>/partition-<p>/<message type>.down.npz   arrays sent
    <run folder>/payloads/round-<r>/partition-<p>/<message type>.up.npz     arrays of the valid reply
    <run folder>/payloads/round-<r>/partition-<p>/<message type>.up.json    its scalar metrics

A payload costs its tensor bytes on disk (uncompressed ``.npz``, the row's ``bytes_up`` and
``bytes_down`` of that round plus a few hundred bytes per file); the clients' model copies cost one
personal model per client and recorded round in their state folder.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from common.config import RunConfig
from common.files import atomic_write

#: the run folder's sub-folder of recorded payloads
PAYLOADS = "payloads"


def round_folder(run_dir: str | Path, server_round: int, partition_id: int) -> Path:
    """``<run_dir>/payloads/round-<r>/partition-<p>``: the recorded payloads of one client in one round."""
    return Path(run_dir) / PAYLOADS / f"round-{server_round}" / f"partition-{partition_id}"


class PayloadRecorder:
    """Writes the payloads of the rounds ``record-payloads`` names into a run folder.

    Args:
        cfg: the run config (``record-payloads``: :meth:`common.config.RunConfig.records_round`).
        run_dir: the run folder; None (a strategy without results) records nothing.
    """

    def __init__(self, cfg: RunConfig, run_dir: str | Path | None) -> None:
        self.cfg = cfg
        self.run_dir = None if run_dir is None else Path(run_dir)

    def records(self, server_round: int) -> bool:
        """True when round ``server_round``'s payloads are recorded."""
        return self.run_dir is not None and self.cfg.records_round(server_round)

    def download(
        self, server_round: int, partition_id: int, message_type: str, arrays: Mapping[str, np.ndarray]
    ) -> None:
        """Keep the arrays sent to ``partition_id`` with a ``message_type`` message (nothing for an empty payload)."""
        if arrays and self.records(server_round):
            self._write(server_round, partition_id, f"{message_type}.down.npz", arrays)

    def upload(
        self,
        server_round: int,
        partition_id: int,
        message_type: str,
        arrays: Mapping[str, np.ndarray],
        metrics: Mapping[str, Any],
    ) -> None:
        """Keep a valid reply's arrays and scalar metrics (nothing for a reply without arrays)."""
        if not arrays or not self.records(server_round):
            return
        self._write(server_round, partition_id, f"{message_type}.up.npz", arrays)
        folder = round_folder(self.run_dir, server_round, partition_id)
        text = json.dumps(dict(metrics), sort_keys=True, default=str).encode("utf-8")
        atomic_write(folder / f"{message_type}.up.json", lambda f: f.write(text))

    def _write(self, server_round: int, partition_id: int, name: str, arrays: Mapping[str, np.ndarray]) -> None:
        folder = round_folder(self.run_dir, server_round, partition_id)
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write(folder / name, lambda f: np.savez(f, **{k: np.asarray(v) for k, v in arrays.items()}))


def read_arrays(path: str | Path) -> dict[str, np.ndarray]:
    """The arrays of one recorded payload file (name -> array, as sent).

    Raises:
        FileNotFoundError: naming the file.
    """
    with np.load(Path(path), allow_pickle=False) as data:
        return {k: data[k] for k in data.files}
