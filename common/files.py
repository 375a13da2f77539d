"""Files that survive a crash: atomic, durable writes shared by the server's results and the clients'
state; and the reader of a run's round rows."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any


def atomic_write(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Write ``path`` so that a reader sees the old file or the whole new one, also after a crash.

    ``write(f)`` fills a temporary file of a unique name in the same folder (two writers of one
    path never share a temporary), which is flushed and ``fsync``-ed, renamed over ``path``
    (``os.replace``, atomic on POSIX), and then the folder is ``fsync``-ed so that the rename
    itself is durable. On an error the temporary file is removed and the error re-raised.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


#: the per-round rows of a run, one JSON object per line (written by ``server_app.results``)
ROWS_FILE = "metrics.jsonl"


def read_rows(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The round rows in ``<run_dir>/metrics.jsonl`` in file order, blank lines skipped; ``[]``
    when the run wrote none yet."""
    path = Path(run_dir) / ROWS_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
