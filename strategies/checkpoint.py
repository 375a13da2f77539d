"""Checkpoints: everything a run needs to continue after its last completed round, and the resume.

:class:`Checkpointing` is a mixin of ``strategies.base.HeteroStrategy``: the method declares its
server state in ``checkpointed`` (attribute names); the machinery's own state (RNG, byte
counters, rows, the clients' state key) is saved alongside it after every round.
"""

from __future__ import annotations

import logging
import math
from functools import cached_property
from typing import Any, ClassVar

import numpy as np
import torch

from common.config import ConfigError
from common.results import load_checkpoint

log = logging.getLogger("flwr." + __name__)  # streamed with Flower's own log

#: run config keys a resumed run may set differently from the run that wrote its checkpoint
RESUMABLE_CHANGES = ("num-server-rounds", "resume-from")


class Checkpointing:
    """Server state, checkpoint and resume (a mixin of ``HeteroStrategy``)."""

    #: attributes holding the server state (modules, optimisers, torch Generators, dicts of
    #: arrays) saved in the per-round checkpoint; None: the method cannot resume yet; () stateless
    checkpointed: ClassVar[tuple[str, ...] | None] = None

    def server_state(self) -> dict[str, Any] | None:
        """The method's server state for a checkpoint: the state of each attribute in ``checkpointed``.

        Modules and optimisers give their ``state_dict()``, torch Generators their RNG state,
        dicts a shallow copy. None when the method does not declare ``checkpointed`` (it
        cannot resume yet).
        """
        if self.checkpointed is None:
            return None
        return {name: _state_of(getattr(self, name)) for name in self.checkpointed}

    def load_server_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`server_state` (called after the handshake, so per-client state exists)."""
        for name, value in state.items():
            obj = getattr(self, name)
            if isinstance(obj, torch.Generator):
                obj.set_state(value)
            elif isinstance(obj, dict):
                obj.clear()
                obj.update(value)
            else:
                obj.load_state_dict(value)

    @cached_property
    def _saved(self) -> dict[str, Any] | None:
        """The ``resume-from`` checkpoint, read once (None without ``resume-from``)."""
        if not self.cfg.resume_from:
            return None
        return load_checkpoint(self.cfg.resume_from)

    def _initial_state_key(self) -> str:
        if self._saved is not None and self._saved.get("state-key"):
            return self._saved["state-key"]
        return self.results.path.name if self.results is not None else "in-memory"

    def checkpoint(self, server_round: int) -> dict[str, Any]:
        """Everything needed to continue after ``server_round``: server state, RNG, counters, rows,
        and the clients' state key."""
        return {
            "round": server_round,
            "method": self.cfg.method,
            "config": self.cfg.as_dict(),
            "state-key": self.state_key,
            "rng": self.rng.bit_generator.state,
            "traffic": dict(self.traffic),
            "dropped": dict(self.dropped),
            "rows": self.rows,
            "server": self.server_state(),
        }

    def resume(self) -> int:
        """Restore the checkpoint named by ``resume-from``; returns its last round (0 without one).

        Raises:
            ConfigError: the checkpoint is of another method, the method cannot resume, or the
                checkpoint's run config differs in any key but ``num-server-rounds`` (and
                ``resume-from`` itself): the keys are named.
        """
        if not self.cfg.resume_from:
            return 0
        state = self.__dict__.pop("_saved", None) or self._saved  # read once, not kept for the run
        if state["method"] != self.cfg.method or state["server"] is None:
            raise ConfigError(
                f"run config key 'resume-from' = {self.cfg.resume_from!r}: a '{state['method']}' "
                f"checkpoint cannot resume method '{self.cfg.method}'"
                + ("" if state["server"] is not None else " (this method has no server_state yet)")
            )
        saved, now = state.get("config", {}), self.cfg.as_dict()
        differ = sorted(k for k in set(saved) | set(now) if k not in RESUMABLE_CHANGES and saved.get(k) != now.get(k))
        if differ:
            raise ConfigError(
                f"run config key 'resume-from' = {self.cfg.resume_from!r}: the checkpoint's run used "
                "other values for "
                + ", ".join(f"'{k}' ({saved.get(k)!r}, now {now.get(k)!r})" for k in differ)
                + "; only 'num-server-rounds' may change on resume"
            )
        self.rng.bit_generator.state = state["rng"]
        self.traffic.update(state["traffic"])
        self.dropped.update(state["dropped"])
        self.rows = list(state["rows"])
        if self.results is not None:
            for row in self.rows:
                self.results.write_round(row)
        self.load_server_state(state["server"])
        log.info("Resumed from %s after round %d", self.cfg.resume_from, state["round"])
        return int(state["round"])


def _state_of(obj: Any) -> Any:
    if isinstance(obj, torch.Generator):
        return obj.get_state()
    return dict(obj) if isinstance(obj, dict) else obj.state_dict()


def finite(state: Any) -> bool:
    """Whether every float tensor and array in a (nested) server state is finite."""
    if isinstance(state, torch.Tensor):
        return not state.is_floating_point() or bool(torch.isfinite(state).all())
    if isinstance(state, np.ndarray):
        return state.dtype.kind != "f" or bool(np.isfinite(state).all())
    if isinstance(state, dict):
        return all(finite(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return all(finite(v) for v in state)
    return not isinstance(state, float) or math.isfinite(state)
