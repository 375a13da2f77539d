"""Clients that never train (run config table ``[generalization]``, off by default).

A share or number of partitions is held out: the last partition ids of the run's N. The partition
draw is the one of N partitions either way, so a run with held-out clients trains exactly the same
clients on the same data as a run without them, minus the held-out ones. Held-out clients receive
no train message during training; every ``generalization.every`` rounds and after the last round
the server runs a generalisation phase (``engine.heldout_phase``): each held-out client gets
what a new client of its method gets, personalises for ``generalization.rounds`` rounds under a
fresh state of its own (nothing of an earlier phase carries over), and is evaluated before the first and after each.

``generalization.new-architectures`` = r reserves the model group's last r architectures for
held-out clients: training clients cycle over the first A − r members, held-out clients over the
last r, so held-out clients hold architectures no training client used (MH-pFedHN §4.4, "new
architectures"). Both sides (the client building its model, the server counting work per
architecture) use :func:`architecture_for`.

Source: MH-pFedHN (NeurIPS 2025) §4.4 (80 training and 20 held-out clients; the hypernetwork frozen,
only the new clients' embeddings optimised, a new head for a new architecture); PFLlib's new-client
evaluation for the other methods; docs/generalization.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from common.config import RunConfig, read_options
from common.errors import ConfigError
from common.options import option

#: the run config table of the keys below
TABLE = "generalization"


@dataclass(frozen=True)
class GeneralizationOptions:
    """``[tool.flwr.app.config.generalization]``: which clients are held out and how they are served."""

    held_out_clients: float = option(
        0.0,
        "partitions that never train, the last partition ids: 0 none; a share in (0, 1) of N (rounded, at least "
        "1); an integer >= 1: that many",
        low=0,
    )
    new_architectures: int = option(
        0,
        "the model group's last this many architectures are held out too: training clients cycle over the other "
        "members, held-out clients over these (architectures no training client used)",
        low=0,
    )
    every: int = option(
        0, "a generalisation phase every this many rounds (0: only after the last round; always after the last)", low=0
    )
    rounds: int = option(
        5,
        "personalisation rounds of one phase: each held-out client trains locally (`local-epochs`) from what a new "
        "client of its method receives, and is evaluated before the first and after each",
        low=1,
    )

    @property
    def enabled(self) -> bool:
        return self.held_out_clients > 0

    def count(self, num_partitions: int) -> int:
        """Held-out partitions of a federation of ``num_partitions``: 0 when off.

        Raises:
            ConfigError: naming ``generalization.held-out-clients`` when no training client would be left.
        """
        value = self.held_out_clients
        if value == 0:
            return 0
        k = int(value) if value >= 1 else max(1, math.floor(value * num_partitions + 0.5))
        if k >= num_partitions:
            raise ConfigError(
                f"run config key 'generalization.held-out-clients' = {value!r} holds out {k} of {num_partitions} "
                "partitions: at least one client must train"
            )
        return k

    def is_held_out(self, partition_id: int, num_partitions: int) -> bool:
        """True for the last :meth:`count` partition ids."""
        return partition_id >= num_partitions - self.count(num_partitions)

    def check(self, cfg: RunConfig) -> None:
        """Raises ConfigError, naming the key, for a count >= 1 that is not an integer, for
        ``new-architectures`` without held-out clients or leaving no architecture to train, for a
        ``num-clients`` > 0 the held-out count leaves no trainer, and with ``dp.epsilon`` > 0 (a held-out
        client's budget would have to span every phase; not supported)."""
        from common.dp import dp_options
        from models.groups import MODEL_GROUPS

        if self.held_out_clients >= 1 and self.held_out_clients != int(self.held_out_clients):
            raise ConfigError(
                f"run config key 'generalization.held-out-clients' = {self.held_out_clients!r}: a count must be "
                "an integer (or give a share in (0, 1))"
            )
        architectures = len(MODEL_GROUPS[cfg.model_group].architectures)
        if self.new_architectures and (not self.enabled or self.new_architectures >= architectures):
            raise ConfigError(
                f"run config key 'generalization.new-architectures' = {self.new_architectures}: needs "
                f"'generalization.held-out-clients' > 0 and fewer than the {architectures} architecture(s) of "
                f"model-group '{cfg.model_group}' (at least one must be left to the training clients)"
            )
        if cfg.num_clients:
            self.count(cfg.num_clients)
        if self.enabled and dp_options(cfg).enabled:
            raise ConfigError(
                "run config keys 'generalization.held-out-clients' > 0 and 'dp.epsilon' > 0 cannot be combined: "
                "a held-out client's privacy budget would have to span every generalisation phase"
            )


@lru_cache(maxsize=64)
def generalization_options(cfg: RunConfig) -> GeneralizationOptions:
    """The validated ``generalization.*`` keys of ``cfg``.

    Raises:
        ConfigError: an unknown key or a value outside its declaration (:class:`GeneralizationOptions`).
    """
    return read_options(GeneralizationOptions, cfg, TABLE)


def architecture_for(cfg: RunConfig, partition_id: int, num_partitions: int) -> str:
    """The extractor architecture of client ``partition_id`` of ``num_partitions``: the model group's
    member ``partition_id mod A`` (``models.groups.ModelGroup.architecture_for``), or with
    ``generalization.new-architectures`` = r > 0 a training client's member among the first A − r and a
    held-out client's among the last r, each cycled in partition order."""
    from models.groups import MODEL_GROUPS

    group, opts = MODEL_GROUPS[cfg.model_group], generalization_options(cfg)
    reserved = opts.new_architectures
    if not reserved:
        return group.architecture_for(partition_id)
    trained = len(group.architectures) - reserved
    first_held_out = num_partitions - opts.count(num_partitions)
    if partition_id < first_held_out:
        return group.architectures[partition_id % trained]
    return group.architectures[trained + (partition_id - first_held_out) % reserved]
