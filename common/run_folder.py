"""Results written as the run goes: ``metrics.jsonl`` (one row per round) and ``summary.json``.

Layout: ``<output-dir>/<UTC time>-<method>-<dataset>-<run id>/``. A row is appended and
flushed after every round and the summary rewritten atomically, so a crash loses at most the
round in progress. ``summary.json`` has ``status`` ``running`` until the run ends
(``completed``) or fails (``failed``). ``checkpoint.pt`` holds the run's state after the
last completed round (server arrays, optimiser, RNG, byte counters, rows): run config key
``resume-from`` = that folder continues the run in a new folder that starts with the old rows and
the old checkpoint.

With run config ``logger = "tensorboard"`` every row is also written as TensorBoard scalars
into the same folder (``tensorboard --logdir <output-dir>`` shows all runs side by side).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common.config import ConfigError
from common.files import CHECKPOINT, ROWS_FILE, SUMMARY_FILE, atomic_write

#: the run's final global arrays (the runner's ``Result.arrays``), a torch state dict
GLOBAL_ARRAYS = "global_arrays.pt"

log = logging.getLogger("flwr." + __name__)  # streamed with Flower's own log


def counted_rows(rows: list[dict[str, Any]], metric: str = "accuracy_mean") -> list[dict[str, Any]]:
    """The rows with a value of ``metric`` in which every client asked to evaluate gave a valid
    evaluation (row key ``eval_missing`` empty or absent); all rows with a value when no round's
    evaluation was complete
    (e.g. a client whose every reply is dropped). A round in which some clients' evaluations failed
    (a crashed worker, a dropped reply) averages over the others only, so its accuracy is not
    comparable with the other rounds': the summary's final and best, and run config
    ``stop-patience``, leave it out."""
    valued = [r for r in rows if r.get(metric) is not None]
    return [r for r in valued if not r.get("eval_missing")] or valued


def best_row(rows: list[dict[str, Any]], metric: str) -> dict[str, Any] | None:
    """The first round row with the highest ``metric`` (a row key; a tie is no new best) among
    :func:`counted_rows`, None when no row has a value for it. The summary's best and run config
    ``stop-patience`` both count from it."""
    return max(counted_rows(rows, metric), key=lambda r: r[metric], default=None)


class ResultsWriter:
    """Appends round rows and keeps ``summary.json`` current.

    Args:
        output_dir: parent folder (created if missing).
        run_name: sub-folder name for this run.
        config: the full run config (stored in the summary).
        logger: ``none`` or ``tensorboard`` (run config key ``logger``).

    Raises:
        ConfigError: ``logger = "tensorboard"`` without the ``tensorboard`` package.
    """

    def __init__(
        self, output_dir: str | os.PathLike, run_name: str, config: dict[str, Any], logger: str = "none"
    ) -> None:
        self.path = Path(output_dir).absolute() / run_name
        writer_class = tensorboard_class(logger)
        self.path.mkdir(parents=True, exist_ok=False)
        self.tensorboard = writer_class(log_dir=str(self.path)) if writer_class is not None else None
        self.config = config
        #: clients taking part (known after the handshake; with ``num-clients`` = 0 the federation's size)
        self.num_clients: int | None = None
        #: the partitions that never train (run config generalization.held-out-clients)
        self.held_out_partitions: list[int] = []
        self.start = time.perf_counter()
        self.rows: list[dict[str, Any]] = []
        self.status = "running"
        self.error: str | None = None  # why a failed or interrupted run ended
        self.client_errors: list[str] = []  # the clients' distinct errors of a run that failed for them
        self._write_summary()
        log.info("Writing results to %s", self.path)

    def write_round(self, row: dict[str, Any]) -> None:
        """Append one round's row to ``metrics.jsonl`` (and TensorBoard) and refresh the summary."""
        data = (json.dumps(row, allow_nan=False) + "\n").encode("utf-8")  # strict JSON: finite numbers only
        path = self.path / ROWS_FILE
        with naming(path):
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                start = os.lseek(fd, 0, os.SEEK_END)
                try:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view) :]
                    os.fsync(fd)
                except OSError:
                    # a row cut off (e.g. by a full disk) is no row: the file keeps whole rows only, as
                    # many as the summary counts
                    os.ftruncate(fd, start)
                    raise
            finally:
                os.close(fd)
        self.rows.append(row)
        if self.tensorboard is not None:
            # plain float32 scalars (7 significant digits; metrics.jsonl keeps the exact values): the only
            # kind TensorBoard's default fast loader shows (it skips float64 tensor scalars)
            for tag, value in scalars(row).items():
                self.tensorboard.add_scalar(tag, value, row["round"])
            self.tensorboard.flush()
        self._write_summary()

    def write_checkpoint(self, state: dict[str, Any]) -> None:
        """Save the run's state atomically and durably as ``checkpoint.pt`` (replaces the
        previous one), numpy arrays stored as tensors so that it loads with ``weights_only=True``."""
        atomic_write(self.path / CHECKPOINT, lambda f: torch.save(_to_tensors(state), f))

    def keep_checkpoint(self, run_dir: str | os.PathLike) -> None:
        """Start this run's ``checkpoint.pt`` as a byte copy of ``run_dir``'s (the ``resume-from`` run's),
        so that a resumed run stopped before its first round can itself be resumed from where it began.

        Raises:
            FileNotFoundError: ``run_dir`` holds no checkpoint.
        """
        source = (Path(run_dir) / CHECKPOINT).read_bytes()
        atomic_write(self.path / CHECKPOINT, lambda f: f.write(source))

    def write_global_arrays(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Save the run's final global arrays (name -> tensor, e.g. FedGH's header ``head.weight``
        float32 [C, d]; Flower's ``ArrayRecord.to_torch_state_dict()`` of the runner's ``Result``) as
        ``global_arrays.pt``, which loads with ``torch.load(weights_only=True)``. A method without global
        arrays (Local, MH-pFedHN: its hypernetwork is in ``checkpoint.pt``) writes nothing."""
        if state_dict:
            atomic_write(self.path / GLOBAL_ARRAYS, lambda f: torch.save(dict(state_dict), f))

    def finish(
        self, status: str = "completed", error: str | None = None, client_errors: list[str] | None = None
    ) -> None:
        """Mark the run ``completed`` (or ``failed``, with ``error`` saying why and the clients' distinct
        ``client_errors`` when they are the cause) in the summary.

        A failed run's summary is written even on a full disk (:meth:`_write_summary`'s fallback); when
        not even that can be written (a read-only disk) the error is logged and not raised, so the
        run's own error is what its caller sees."""
        self.status, self.error, self.client_errors = status, error, list(client_errors or [])
        try:
            self._write_summary()
        except OSError as exc:
            if status == "completed":
                raise
            log.error("Could not record the run as %s in %s: %s", status, self.path / SUMMARY_FILE, exc)
        if self.tensorboard is not None:
            self.tensorboard.close()

    def summary(self) -> dict[str, Any]:
        """Final and best ``accuracy_mean`` and ``accuracy_weighted`` (fractions) with the round of each
        best (the first round that reached it), from :func:`counted_rows` (``incomplete_evaluations``:
        the rounds left out because some clients' evaluations failed), totals, status."""
        evaluated = counted_rows(self.rows)
        best, best_weighted = best_row(self.rows, "accuracy_mean"), best_row(self.rows, "accuracy_weighted")
        total = {
            k: sum(r.get(k, 0) for r in self.rows)
            for k in ("bytes_up", "bytes_down", "eval_bytes_up", "eval_bytes_down")
        }
        return {
            "status": self.status,
            "error": self.error,
            "client_errors": self.client_errors,
            "num_clients": self.num_clients,
            "rounds_completed": len(self.rows),
            # run config stop-patience ended the run before num-server-rounds (None: it did not)
            "stop_reason": self.rows[-1].get("stop_reason") if self.rows else None,
            "final_accuracy_mean": evaluated[-1]["accuracy_mean"] if evaluated else None,
            "final_accuracy_weighted": evaluated[-1]["accuracy_weighted"] if evaluated else None,
            # the round the final accuracies come from (the last evaluated one)
            "final_round": evaluated[-1]["round"] if evaluated else None,
            "best_accuracy_mean": best["accuracy_mean"] if best else None,
            "best_round": best["round"] if best else None,
            # FedTGP's headline (and its presets' stop-metric): best pooled accuracy
            "best_accuracy_weighted": best_weighted["accuracy_weighted"] if best_weighted else None,
            "best_round_weighted": best_weighted["round"] if best_weighted else None,
            "incomplete_evaluations": [
                r["round"] for r in self.rows if r.get("eval_missing") and all(r is not c for c in evaluated)
            ],
            **{f"total_{k}": v for k, v in total.items()},
            **privacy_spent(self.rows),
            **client_privacy_spent(self.rows),
            **held_out_summary(self.held_out_partitions, self.rows),
            "total_seconds": time.perf_counter() - self.start,
            "config": self.config,
        }

    def _write_summary(self) -> None:
        """Replace ``summary.json`` atomically. When that fails (a full disk has no room for the new
        copy) a run that is no longer ``running`` overwrites the old file in place with the summary
        without its ``config``: that reuses the old file's blocks, so a failed run is recorded as
        failed also on a full disk.

        Raises:
            OSError: naming ``summary.json``, when neither write succeeds.
        """
        path = self.path / SUMMARY_FILE
        summary = self.summary()
        text = json.dumps(summary, indent=2, allow_nan=False).encode("utf-8")
        try:
            with naming(path):
                atomic_write(path, lambda f: f.write(text))
        except OSError:
            if self.status == "running":
                raise
            compact = json.dumps({**summary, "config": None}, allow_nan=False).encode("utf-8")
            with naming(path), open(path, "r+b") as f:
                f.truncate(0)
                f.write(compact)
                f.flush()
                os.fsync(f.fileno())


@contextlib.contextmanager
def naming(path: Path) -> Iterator[None]:
    """Re-raise an ``OSError`` of the block (e.g. ``ENOSPC`` from a write, which names no file) as
    an ``OSError`` of the same ``errno`` naming ``path``, so that a run's error says which file failed."""
    try:
        yield
    except OSError as exc:
        if exc.filename is not None:
            raise
        raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from exc


def tensorboard_class(logger: str) -> type | None:
    """``torch.utils.tensorboard.SummaryWriter`` for ``logger = "tensorboard"``, None for ``"none"``.

    Raises:
        ConfigError: naming run config key ``logger`` when the ``tensorboard`` package is missing.
    """
    if logger != "tensorboard":
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise ConfigError(
            "run config key 'logger' = 'tensorboard' needs the tensorboard package: "
            "uv sync --extra tensorboard (allowed values: 'none', 'tensorboard')"
        ) from exc
    return SummaryWriter


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The numbers of one round row as TensorBoard tags (``round`` is the step, not a tag).

    Numbers keep their key; ``accuracy_per_client`` becomes ``accuracy_per_client/<partition id>``;
    booleans become 0/1; None (a round without evaluation), lists and strings are left out.
    """
    out: dict[str, float] = {}
    for key, value in row.items():
        if key == "round":
            continue
        if isinstance(value, dict):
            out.update({f"{key}/{k}": float(v) for k, v in value.items() if isinstance(v, (int, float))})
        elif isinstance(value, (bool, int, float)):
            out[key] = float(value)
    return out


#: key of the dict that stands for a numpy array in a checkpoint (see :func:`_to_tensors`)
NDARRAY = "__ndarray__"


def _to_tensors(obj: Any) -> Any:
    """``obj`` with every numpy array (in dicts, lists, tuples) replaced by ``{NDARRAY: tensor}``
    and numpy scalars by Python numbers: what ``torch.load(weights_only=True)`` accepts."""
    if isinstance(obj, np.ndarray):
        return {NDARRAY: torch.from_numpy(np.ascontiguousarray(obj).copy())}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        return {k: _to_tensors(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_tensors(v) for v in obj)
    return obj


def _to_arrays(obj: Any) -> Any:
    """The inverse of :func:`_to_tensors`."""
    if isinstance(obj, dict):
        if obj.keys() == {NDARRAY}:
            return obj[NDARRAY].numpy()
        return {k: _to_arrays(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_arrays(v) for v in obj)
    return obj


#: the entries of a checkpoint (``MethodServer.checkpoint``) and their types; ``server`` is a dict,
#: or None for a method without server state
CHECKPOINT_KEYS: dict[str, type | tuple[type, ...]] = {
    "round": int,
    "method": str,
    "config": dict,
    "state-key": str,
    "rng": dict,
    "traffic": dict,
    "dropped": dict,
    "rows": list,
    "server": (dict, type(None)),
}


def load_checkpoint(run_dir: str | os.PathLike) -> dict[str, Any]:
    """The state saved by :meth:`ResultsWriter.write_checkpoint` in ``run_dir``, read with
    ``weights_only=True``: a checkpoint cannot run code (a pickle placed in a ``resume-from``
    folder is refused, not executed). Its entries are checked against :data:`CHECKPOINT_KEYS`
    (and ``round`` >= 0, ``rows`` a list of rows with an integer ``round``) before anything uses them.

    Raises:
        FileNotFoundError: naming the run config key when ``run_dir`` holds no checkpoint.
        ConfigError: naming the run config key and the file when it is not a checkpoint of ours.
    """
    path = Path(run_dir) / CHECKPOINT
    if not path.is_file():
        raise FileNotFoundError(f"run config key 'resume-from' = {str(run_dir)!r}: no {CHECKPOINT} there")
    refuse = f"run config key 'resume-from' = {str(run_dir)!r}: {path} is not a checkpoint this system wrote"
    try:
        state = _to_arrays(torch.load(path, weights_only=True))
    except Exception as exc:  # torch raises UnpicklingError, RuntimeError, EOFError... for foreign files
        raise ConfigError(f"{refuse} ({type(exc).__name__}); refusing to load it") from exc
    if not isinstance(state, dict):
        raise ConfigError(f"{refuse}: it holds a {type(state).__name__}, not a dict")
    for key, kind in CHECKPOINT_KEYS.items():
        if key not in state or isinstance(state[key], bool) or not isinstance(state[key], kind):
            allowed = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
            raise ConfigError(f"{refuse}: entry '{key}' is {type(state.get(key)).__name__}, not {allowed}")
    rows_ok = all(isinstance(r, dict) and isinstance(r.get("round"), int) for r in state["rows"])
    if state["round"] < 0 or not rows_ok:
        raise ConfigError(f"{refuse}: 'round' = {state['round']} or its rows are malformed")
    return state


def held_out_summary(partitions: list[int], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The held-out clients (run config ``generalization.*``): ``held_out_partitions``, and from the last
    generalisation phase (``engine.heldout_phase``) ``final_heldout_accuracy_mean`` and
    ``final_heldout_accuracy_weighted`` (fractions after its last personalisation round) and
    ``final_heldout_round``, the round it followed; None before any phase, {} without held-out clients."""
    if not partitions:
        return {}
    phases = [r for r in rows if "heldout_accuracy_mean" in r]
    last = phases[-1] if phases else {}
    return {
        "held_out_partitions": list(partitions),
        "final_heldout_accuracy_mean": last.get("heldout_accuracy_mean"),
        "final_heldout_accuracy_weighted": last.get("heldout_accuracy_weighted"),
        "final_heldout_round": last.get("round"),
    }


def privacy_spent(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """With DP on (rows carry ``dp_epsilon_per_client``): ``dp_epsilon_per_client``, each partition's ε
    as last reported (PLD, at run config ``dp.delta``), ``dp_epsilon_max`` the largest, ``dp_per_client``
    each partition's last ``dp_per_client`` entry of the rows (ε by PLD and RDP, σ of each mechanism, q,
    steps, releases, clips: ``engine.round_rows.round_metrics``), and ``dp_exhausted`` the partitions whose
    budget ran out; empty for a run without DP."""
    spent: dict[str, float] = {}
    last: dict[str, dict[str, Any]] = {}
    for row in rows:
        spent.update(row.get("dp_epsilon_per_client") or {})
        last.update(row.get("dp_per_client") or {})
    if not spent:
        return {}

    def by_partition(values: dict[str, Any]) -> dict[str, Any]:
        return dict(sorted(values.items(), key=lambda item: int(item[0])))

    return {
        "dp_epsilon_per_client": by_partition(spent),
        "dp_epsilon_max": max(spent.values()),
        "dp_per_client": by_partition(last),
        "dp_exhausted": rows[-1].get("dp_exhausted", []),
    }


def client_privacy_spent(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """With client-level DP on (rows carry ``client_dp_epsilon``, ``engine.client_dp``): ``client_dp``, the
    last such row's mechanism and spending (σ, C, q, K, δ, ε by PLD and RDP over the rounds so far) and its
    ``round``; empty for a run without it."""
    private = [row for row in rows if "client_dp_epsilon" in row]
    if not private:
        return {}
    last = private[-1]
    keys = [k for k in last if k.startswith("client_dp_") and k != "client_dp_clipped"]
    return {"client_dp": {"round": last["round"], **{k[len("client_dp_") :]: last[k] for k in keys}}}
