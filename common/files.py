"""Files that survive a crash: atomic, durable writes shared by the server's results and the clients'
state; and the one reader of each JSON file we write and read back (a run's round rows, its summary,
a grid's ``grid.json``), which checks that the file is what we wrote."""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

from common.errors import ConfigError

log = logging.getLogger("flwr." + __name__)  # streamed with Flower's own log


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


#: the per-round rows of a run, one JSON object per line (written by ``common.results``)
ROWS_FILE = "metrics.jsonl"
#: a run's summary (``common.results``) and the keys (with their types) every summary has
SUMMARY_FILE = "summary.json"
SUMMARY_KEYS: dict[str, type] = {"status": str, "rounds_completed": int}
#: a run folder's checkpoint of its last completed round (:class:`common.results.ResultsWriter`)
CHECKPOINT = "checkpoint.pt"


def _strict(token: str) -> Any:
    raise ValueError(f"non-finite number {token} (not strict JSON)")


def parse_json(text: str, where: str) -> Any:
    """``text`` parsed as strict JSON (``NaN`` and ``Infinity`` refused).

    Raises:
        ConfigError: naming ``where`` (a file, a file and line) and what is wrong.
    """
    try:
        return json.loads(text, parse_constant=_strict)
    except ValueError as exc:  # JSONDecodeError is a ValueError
        raise ConfigError(f"{where} is not valid JSON: {exc}") from None


def check_keys(obj: Any, keys: Mapping[str, type], where: str) -> dict[str, Any]:
    """``obj`` if it is a JSON object holding every key of ``keys`` with a value of its type.

    Raises:
        ConfigError: naming ``where`` and the first key missing or of the wrong type.
    """
    if not isinstance(obj, dict):
        raise ConfigError(f"{where} holds a JSON {type(obj).__name__}, not an object")
    for key, kind in keys.items():
        value = obj.get(key)
        if key not in obj or isinstance(value, bool) is not (kind is bool) or not isinstance(value, kind):
            raise ConfigError(f"{where}: key '{key}' is {value!r}, expected a {kind.__name__}")
    return obj


def read_json_object(path: str | os.PathLike, keys: Mapping[str, type]) -> dict[str, Any]:
    """The JSON object in ``path``, checked to hold ``keys`` (:func:`check_keys`).

    Raises:
        ConfigError: naming ``path`` when it cannot be read, is not strict JSON, not an object, or
            lacks a key.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} cannot be read: {exc}") from None
    return check_keys(parse_json(text, str(path)), keys, str(path))


def read_summary(run_dir: str | os.PathLike) -> dict[str, Any]:
    """``<run_dir>/summary.json``, checked to hold :data:`SUMMARY_KEYS`.

    Raises:
        ConfigError: naming the file and what is wrong (see :func:`read_json_object`).
    """
    return read_json_object(Path(run_dir) / SUMMARY_FILE, SUMMARY_KEYS)


def read_rows(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The round rows in ``<run_dir>/metrics.jsonl`` in file order, blank lines skipped; ``[]``
    when the run wrote none yet. Each row must be a JSON object with an integer ``round``.

    A last line without its newline that does not parse is the row a crash cut off while it was
    being appended: it is logged and left out (the run's checkpoint holds that round's state only
    once the row was written, so nothing is lost that a resume would use).

    Raises:
        ConfigError: naming the file and line of any other line that is not such a row.
    """
    path = Path(run_dir) / ROWS_FILE
    if not path.is_file():
        return []
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} cannot be read: {exc}") from None
    lines = text.split("\n")
    torn = lines.pop() if lines else ""  # after the last newline: empty, or a line cut off mid-append
    rows = [
        check_keys(parse_json(line, f"{path} line {n}"), {"round": int}, f"{path} line {n}")
        for n, line in enumerate(lines, 1)
        if line.strip()
    ]
    if torn.strip():
        try:
            rows.append(check_keys(parse_json(torn, str(path)), {"round": int}, str(path)))
        except ConfigError as exc:
            log.warning("%s: ignoring its last line, cut off while it was written (%s)", path, exc)
    return rows
