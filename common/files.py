"""Files that survive a crash: atomic, durable writes shared by the server's results and the clients'
state; the one bounded reader of every file a tool reads (:func:`read_bounded`: a regular file under a
size cap, refused by name otherwise); the one reader of each JSON file we write and read back (a run's
round rows, its summary, a grid's ``grid.json``), which checks that the file is what we wrote; and the
one walk along a run's ``resume-from`` chain (:func:`resume_chain`)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator, Mapping
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


@contextlib.contextmanager
def new_folder_or_none(folder: str | os.PathLike) -> Iterator[Path]:
    """A tool's output ``folder`` for the block to write: when the block raises and ``folder`` did not
    exist before it, ``folder`` is removed again, so that a tool stopped by a bad input leaves no
    half-written output folder behind (a folder that existed keeps what it held and what was written)."""
    folder = Path(folder)
    existed = folder.exists()
    try:
        yield folder
    except BaseException:
        if not existed:
            shutil.rmtree(folder, ignore_errors=True)
        raise


#: the largest file a tool reads whole (bytes): far above any file this system writes (a long run's
#: ``metrics.jsonl`` is a few MB, a recorded payload the size of one model), far below what fills memory
MAX_READ_BYTES = 1 << 30


def read_bounded(path: str | os.PathLike, cap: int | None = None, name: str | None = None) -> bytes:
    """The bytes of the regular file ``path``, of at most ``cap`` bytes (default :data:`MAX_READ_BYTES`).

    The file is opened without blocking (a FIFO without a writer would hold ``open`` forever) and
    checked with ``fstat`` on that descriptor before a byte is read: a device (``/dev/zero`` never
    ends), a FIFO, a socket or a folder is refused, and so is a file of more than ``cap`` bytes; at
    most ``cap + 1`` bytes are read, so a file that grows meanwhile is refused too.

    Args:
        path: the file.
        cap: the most bytes allowed (None: :data:`MAX_READ_BYTES`).
        name: how errors name the file (default: ``path`` as given).

    Raises:
        ConfigError: naming the file: it cannot be opened (missing, no permission), is not a regular
            file, or is larger than ``cap`` bytes.
    """
    name = str(path) if name is None else name
    cap = MAX_READ_BYTES if cap is None else cap
    allowed = f"allowed is a regular file of at most {cap} bytes"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"{name} cannot be read: {exc.strerror or exc}") from None
    try:
        mode, size = (info := os.fstat(fd)).st_mode, info.st_size
        if not stat.S_ISREG(mode):
            kind = "a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "a device or socket"
            raise ConfigError(f"{name} cannot be read: it is {kind}; {allowed}")
        if size > cap:
            raise ConfigError(f"{name} cannot be read: it holds {size} bytes; {allowed}")
        chunks, left = [], cap + 1
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as exc:
        raise ConfigError(f"{name} cannot be read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if left <= 0:
        raise ConfigError(f"{name} cannot be read: it grew past {cap} bytes while it was read; {allowed}")
    return b"".join(chunks)


def read_text(path: str | os.PathLike, cap: int | None = None, name: str | None = None) -> str:
    """:func:`read_bounded`'s bytes of ``path`` decoded as UTF-8.

    Raises:
        ConfigError: naming the file: see :func:`read_bounded`, or it is not UTF-8 text.
    """
    data = read_bounded(path, cap, name)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{str(path) if name is None else name} is not UTF-8 text: {exc}") from None


#: the per-round rows of a run, one JSON object per line (written by ``common.run_folder``)
ROWS_FILE = "metrics.jsonl"
#: a run's summary (``common.run_folder``) and the keys (with their types) every summary has
SUMMARY_FILE = "summary.json"
SUMMARY_KEYS: dict[str, type] = {"status": str, "rounds_completed": int}
#: a run folder's checkpoint of its last completed round (:class:`common.run_folder.ResultsWriter`)
CHECKPOINT = "checkpoint.pt"


def _strict(token: str) -> Any:
    raise ValueError(f"non-finite number {token} (not strict JSON)")


def parse_json(text: str, where: str, strict: bool = True) -> Any:
    """``text`` parsed as JSON; ``strict``: ``NaN`` and ``Infinity`` refused (without it they are read,
    for files written by ``json.dumps`` with its default ``allow_nan``, e.g. a perfect reconstruction's
    infinite PSNR).

    Raises:
        ConfigError: naming ``where`` (a file, a file and line) and what is wrong.
    """
    try:
        return json.loads(text, parse_constant=_strict if strict else None)
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
    return check_keys(parse_json(read_text(path), str(path)), keys, str(path))


def read_summary(run_dir: str | os.PathLike) -> dict[str, Any]:
    """``<run_dir>/summary.json``, checked to hold :data:`SUMMARY_KEYS`.

    Raises:
        ConfigError: naming the file and what is wrong (see :func:`read_json_object`).
    """
    return read_json_object(Path(run_dir) / SUMMARY_FILE, SUMMARY_KEYS)


#: the most runs one ``resume-from`` chain may hold: a grid resumes a cell once per launch, far fewer times
MAX_CHAIN = 1000


def resume_chain(run_dir: str | os.PathLike) -> list[Path]:
    """``run_dir`` and the runs it resumed, newest first: each run's ``summary.json`` names the run it
    continued (its config's ``resume-from``); the walk ends at a run that resumed none, or whose
    ``resume-from`` folder is gone.

    Raises:
        ConfigError: a summary that cannot be read or has no ``config`` object, a ``resume-from`` that
            is not text (naming the file), a chain that comes back to a run it passed (naming the
            folders of the loop), or one of more than :data:`MAX_CHAIN` runs.
    """
    chain = [Path(run_dir)]
    seen = {chain[0].resolve(): 0}  # a folder's index in the chain: two spellings of one folder are one
    while True:
        where = str(chain[-1] / SUMMARY_FILE)
        config = check_keys(read_summary(chain[-1]), {"config": dict}, where)["config"]
        previous = config.get("resume-from")
        if not previous:
            return chain
        if not isinstance(previous, str):
            raise ConfigError(f"{where}: key 'resume-from' is {str(previous)[:80]!r}, expected a folder's path")
        if not Path(previous).is_dir():
            return chain
        if (first := seen.get(Path(previous).resolve())) is not None:
            loop = " -> ".join(str(p) for p in [*chain[first:], Path(previous)])
            raise ConfigError(f"the resume-from chain of {chain[0]} is a loop: {loop}; each run resumes an older one")
        if len(chain) == MAX_CHAIN:
            raise ConfigError(
                f"the resume-from chain of {chain[0]} holds more than {MAX_CHAIN} runs; allowed are {MAX_CHAIN}"
            )
        seen[Path(previous).resolve()] = len(chain)
        chain.append(Path(previous))


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
    if not path.exists():
        return []
    lines = read_text(path).split("\n")
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
