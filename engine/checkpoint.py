"""Checkpoints: everything a run needs to continue after its last completed round, and the resume.

A method declares its server state in ``checkpointed`` (attribute names, see
``engine.contract.MethodServer``); :func:`server_state` and :func:`load_server_state` save and
restore those attributes. :class:`Checkpoints` reads the ``resume-from`` checkpoint once, checks it
fits the run, and builds each round's checkpoint from explicit inputs (server state, RNG, byte
counters, rows, the clients' state key).
"""

from __future__ import annotations

import logging
import math
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common.config import ConfigError, RunConfig
from common.files import SUMMARY_FILE, read_json_object
from common.run_folder import load_checkpoint
from common.state_store import all_finite
from engine.round_rows import RoundCounters

log = logging.getLogger("flwr." + __name__)  # streamed with Flower's own log

#: run config keys a resumed run may set differently from the run that wrote its checkpoint
RESUMABLE_CHANGES = frozenset({"num-server-rounds", "resume-from"})
#: run config keys added later whose declared default is not how runs behaved before they existed:
#: a checkpoint without the key ran as this value (the averaging methods averaged plainly before
#: ``aggregation`` existed, and its default, ``norm-bound``, does not)
BEFORE_THE_KEY = {"aggregation": "mean"}


def server_state(owner: Any, names: tuple[str, ...] | None) -> dict[str, Any] | None:
    """The server state of ``owner`` for a checkpoint: the state of each attribute in ``names``.

    Modules and optimisers give their ``state_dict()``, torch Generators their RNG state,
    dicts a shallow copy. None when ``names`` is None (the method cannot resume yet).
    """
    if names is None:
        return None
    return {name: _state_of(getattr(owner, name)) for name in names}


def load_server_state(owner: Any, state: dict[str, Any]) -> None:
    """Restore :func:`server_state` into ``owner``'s attributes (after the handshake, so per-client
    state exists)."""
    for name, value in state.items():
        obj = getattr(owner, name)
        if isinstance(obj, torch.Generator):
            obj.set_state(value)
        elif isinstance(obj, dict):
            obj.clear()
            obj.update(value)
        else:
            obj.load_state_dict(value)


class Checkpoints:
    """The ``resume-from`` checkpoint of a run, and the checkpoint of each of its rounds.

    Args:
        cfg: the run config (``resume-from``, and the config a checkpoint must match).
        results: the run's results writer (its folder names a new run's client state), or None.
        defaults: run config key -> declared default (``RunConfig`` and the method's options): a
            key a checkpoint's config lacks matches when this run has it at its default, since a
            key added after the checkpoint was written defaults to the behaviour it ran with
            (except the keys of :data:`BEFORE_THE_KEY`, which match at the value given there).
    """

    def __init__(self, cfg: RunConfig, results: Any | None, defaults: dict[str, Any] | None = None) -> None:
        self.cfg, self.results, self.defaults = cfg, results, defaults or {}

    @cached_property
    def _saved(self) -> dict[str, Any] | None:
        """The ``resume-from`` checkpoint, read once (None without ``resume-from``)."""
        if not self.cfg.resume_from:
            return None
        return load_checkpoint(self.cfg.resume_from)

    def completed_round(self) -> int:
        """The rounds the ``resume-from`` checkpoint completed (0 without one): the round the clients'
        state must not be ahead of when the resumed run first asks them (``engine.federation.Federation.ask``)."""
        return int(self._saved["round"]) if self._saved is not None else 0

    def state_key(self) -> str:
        """The clients' state key: the resumed run's, else this run's results folder name."""
        if self._saved is not None and self._saved.get("state-key"):
            return self._saved["state-key"]
        return self.results.path.name if self.results is not None else "in-memory"

    def build(
        self,
        server_round: int,
        state_key: str,
        rng: np.random.Generator,
        counters: RoundCounters,
        rows: list[dict[str, Any]],
        server: dict[str, Any] | None,
    ) -> dict[str, Any]:
        """Everything needed to continue after ``server_round``: server state, RNG, counters, rows,
        and the clients' state key."""
        return {
            "round": server_round,
            "method": self.cfg.method,
            "config": self.cfg.as_dict(),
            "state-key": state_key,
            "rng": rng.bit_generator.state,
            "traffic": dict(counters.traffic),
            "dropped": dict(counters.dropped),
            "rows": rows,
            "server": server,
        }

    def load(self) -> dict[str, Any] | None:
        """The checkpoint named by ``resume-from``, checked to fit this run (None without one); it
        is not kept afterwards.

        Raises:
            ConfigError: the checkpoint is of another method, the method cannot resume, or the
                checkpoint's run config differs in any key but ``num-server-rounds`` (and
                ``resume-from`` itself; a key it lacks differs unless this run has it at its
                declared default, or at its :data:`BEFORE_THE_KEY` value): the keys are named.
        """
        if not self.cfg.resume_from:
            return None
        state = self.__dict__.pop("_saved", None) or self._saved  # read once, not kept for the run
        if state["method"] != self.cfg.method or state["server"] is None:
            raise ConfigError(
                f"run config key 'resume-from' = {self.cfg.resume_from!r}: a '{state['method']}' "
                f"checkpoint cannot resume method '{self.cfg.method}'"
                + ("" if state["server"] is not None else " (this method has no server_state yet)")
            )
        self._refuse_other_config(state.get("config", {}))
        return state

    def check_summary(self) -> None:
        """Refuse a ``resume-from`` run whose ``summary.json`` holds a run config this run cannot
        resume (as :meth:`load` refuses its checkpoint's), from that small file alone: before any node
        is asked, and in ``tools.run`` before anything starts. A summary without a readable config
        object (a missing file, a summary written on a full disk) is left to :meth:`load`.

        Raises:
            ConfigError: naming ``resume-from`` and the keys that differ.
        """
        if not self.cfg.resume_from:
            return
        try:
            summary = read_json_object(Path(self.cfg.resume_from) / SUMMARY_FILE, {"config": dict})
        except ConfigError:
            return
        self._refuse_other_config(summary["config"])

    def _refuse_other_config(self, saved: dict[str, Any]) -> None:
        """Raises ConfigError naming ``resume-from`` and every key of the resumed run's config ``saved``
        this run sets otherwise (but ``num-server-rounds`` and ``resume-from`` itself; a key ``saved``
        lacks differs unless this run has it at its declared default, or at its :data:`BEFORE_THE_KEY`
        value)."""
        now = self.cfg.as_dict()
        behaved = {**self.defaults, **BEFORE_THE_KEY}  # how a run that lacked a key behaved
        added = {k for k in set(now) - set(saved) if k in behaved and now[k] == behaved[k]}
        differ = sorted(
            k for k in set(saved) | set(now) if k not in RESUMABLE_CHANGES | added and saved.get(k) != now.get(k)
        )
        if differ:
            raise ConfigError(
                f"run config key 'resume-from' = {self.cfg.resume_from!r}: the run it resumes used other values for "
                + ", ".join(f"'{k}' ({saved.get(k)!r}, now {now.get(k)!r})" for k in differ)
                + "; only 'num-server-rounds' may change on resume"
            )


def _state_of(obj: Any) -> Any:
    if isinstance(obj, torch.Generator):
        return obj.get_state()
    return dict(obj) if isinstance(obj, dict) else obj.state_dict()


#: a server-state tensor has exploded in one round when its root-mean-square entry grows beyond this
#: factor times the larger of its RMS before the round and 1 (see :func:`exploded`)
GROWTH = 100.0


def broken_state(before: Any, after: Any) -> str | None:
    """Why the server state ``after`` a round's update must not be kept, given the state ``before`` it
    (both as :func:`server_state`); None when it may. Non-finite entries (:func:`finite`), or a tensor
    that exploded (:func:`exploded`); the reason names at most three tensors."""
    if not finite(after):
        return "non-finite"
    grown = exploded(before, after)
    if grown:
        return f"explode (RMS entry above {GROWTH:g} x max(its RMS before, 1) in {grown[:3]})"
    return None


def exploded(before: Any, after: Any, path: str = "") -> list[str]:
    """The paths of the float tensors and arrays of a (nested) server state whose root-mean-square
    entry grew in one round beyond :data:`GROWTH` · max(RMS before, 1).

    Why this bound: an averaged model can be finite and still poisoned beyond use (one upload of
    entries ~1e6 makes the FedAvg's entries ~1e5, and the next round's training NaN for every
    client). Honest state never moves like that in one round: weights, prototypes and headers of
    RMS ~0.01-10 move by a fraction per round; Adam's second moments follow clipped gradients
    with beta2 ~0.999; step counters grow additively. The floor of 1 keeps small or zero-initialised
    tensors (biases, fresh optimiser moments) from tripping it on ordinary steps. Tensors are
    paired by their path and compared only when both exist with the same shape (state created this
    round, e.g. a first Adam step's moments, has no "before").

    Returns:
        dotted paths (e.g. ``shared.conv1.weight``), in the state's order; [] when nothing exploded.
    """
    if isinstance(after, dict) and isinstance(before, dict):
        return [p for k, v in after.items() if k in before for p in exploded(before[k], v, f"{path}{k}.")]
    if isinstance(after, (list, tuple)) and isinstance(before, (list, tuple)) and len(after) == len(before):
        return [p for i, (b, a) in enumerate(zip(before, after)) for p in exploded(b, a, f"{path}{i}.")]
    a, b = _float_values(after), _float_values(before)
    if a is None or b is None or a.shape != b.shape or a.size == 0:
        return []
    rms_after, rms_before = (float(np.sqrt(np.mean(np.square(x)))) for x in (a, b))
    return [path.rstrip(".")] if rms_after > GROWTH * max(rms_before, 1.0) else []


def _float_values(value: Any) -> np.ndarray | None:
    """A float tensor's or array's values as float64 numpy; None for anything else."""
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.detach().cpu().double().numpy()
    if isinstance(value, np.ndarray) and value.dtype.kind == "f":
        return value.astype(np.float64)
    return None


def finite(state: Any) -> bool:
    """Whether every float tensor and array in a (nested) server state is finite."""
    if isinstance(state, torch.Tensor):
        return all_finite(state)
    if isinstance(state, np.ndarray):
        return state.dtype.kind != "f" or bool(np.isfinite(state).all())
    if isinstance(state, dict):
        return all(finite(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return all(finite(v) for v in state)
    return not isinstance(state, float) or math.isfinite(state)
