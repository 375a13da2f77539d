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

import io
import json
import math
import zipfile
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

import numpy as np

from common.config import RunConfig
from common.errors import ConfigError
from common.files import MAX_READ_BYTES, atomic_write, read_bounded

#: the run folder's sub-folder of recorded payloads
PAYLOADS = "payloads"


def round_folder(run_dir: str | Path, server_round: int, partition_id: int) -> Path:
    """``<run_dir>/payloads/round-<r>/partition-<p>``: the recorded payloads of one client in one round."""
    return Path(run_dir) / PAYLOADS / f"round-{server_round}" / f"partition-{partition_id}"


class PayloadRecorder:
    """Writes the payloads of the rounds ``record-payloads`` names into a run folder.

    Args:
        cfg: the run config (``record-payloads``: :meth:`common.config.RunConfig.records_round`).
        run_dir: the run folder; None (a run without results) records nothing.
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

    The file is read whole through :func:`common.files.read_bounded` (a regular file of at most
    ``MAX_READ_BYTES``), and each member's ``.npy`` header is checked before its data is read: a
    numeric dtype (no objects, so nothing is unpickled) and a shape whose bytes are the member's.

    Raises:
        ConfigError: naming the file: it cannot be read (:func:`common.files.read_bounded`), is no
            ``.npz`` archive (e.g. cut short), or holds a member that is not such an array.
    """
    data = read_bounded(path)
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            infos = archive.infolist()
            if sum(info.file_size for info in infos) > MAX_READ_BYTES:  # a compressed member may claim more
                raise ValueError(f"its members hold more than {MAX_READ_BYTES} bytes")
            arrays = {}
            for info in infos:
                if not info.filename.endswith(".npy"):
                    raise ValueError(f"member {info.filename!r} is not an .npy array")
                with archive.open(info) as f:
                    arrays[info.filename.removesuffix(".npy")] = _read_member(f, info)
            return arrays
    except (ValueError, EOFError, OSError, zipfile.BadZipFile, zlib.error) as exc:
        raise ConfigError(f"{path} is not a payload file this system recorded: {exc}") from None


def _read_member(f: IO[bytes], info: zipfile.ZipInfo) -> np.ndarray:
    """The array of one ``.npy`` member, its header checked first. Raises ValueError naming the member."""
    version = np.lib.format.read_magic(f)
    header = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}.get(version)
    if header is None:
        raise ValueError(f"member {info.filename!r}: .npy format {version} (allowed: 1.0, 2.0)")
    shape, fortran, dtype = header(f)
    if dtype.kind not in "biufc" or dtype.hasobject:
        raise ValueError(f"member {info.filename!r}: dtype {dtype} (allowed: booleans and numbers)")
    size = math.prod(shape) * dtype.itemsize  # Python integers: a huge declared shape does not overflow
    if size != info.file_size - f.tell():
        raise ValueError(
            f"member {info.filename!r}: shape {shape} of {dtype} is {size} bytes, the member holds "
            f"{info.file_size - f.tell()}"
        )
    array = np.frombuffer(f.read(size), dtype=dtype)
    if array.nbytes != size:
        raise ValueError(f"member {info.filename!r} is cut short")
    return array.reshape(shape, order="F" if fortran else "C").copy()
