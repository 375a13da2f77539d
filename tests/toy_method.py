"""A toy method built only from the "Adding a method" checklist (docs/architecture.md): each client trains
its own model with cross-entropy and uploads the mean representation of each class it holds; the server
averages them per class and sends the means back. It lives in ``tests/``, so production never registers
it; ``tests/test_add_a_method.py`` registers it for its tests.

Payload: up (train) ``protos`` [k, d] float32 and ``proto_labels`` [k] int64; down (train) ``protos``
[C_avail, d] and ``mask`` [C] (absent in round 1).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from common.config import RunConfig
from common.metrics import count
from common.payload import BASE_SCHEMAS, ClientReply
from common.protocol import TRAIN, Arrays, Reply
from common.runtime import ClientRuntime
from common.training import train_personal_model, trained_class_means
from engine.contract import ClientProcedure, Method, MethodContext, MethodServer
from engine.robust import require_aggregation
from engine.round_rows import round_metrics
from methods.blocks.prototypes import CLASS_AGGREGATIONS, aggregate_class_sets, class_set_schemas

UPLOAD, GLOBAL_SET = class_set_schemas("protos", "proto_labels", "d")
SCHEMAS = {**BASE_SCHEMAS, TRAIN: (GLOBAL_SET, UPLOAD)}  # [module]
METRICS = {TRAIN: {"toy-classes": count("classes the client uploaded a mean for")}}  # [metrics]


@dataclass(frozen=True)
class ToyOptions:
    """``[tool.flwr.app.config.toy]``: no option of its own."""

    def check(self, cfg: RunConfig) -> None:
        """Raises ConfigError: an ``aggregation`` its per-class step cannot apply ([aggregation])."""
        require_aggregation(cfg, CLASS_AGGREGATIONS)


class ToyServer(MethodServer):
    """The per-class mean of the round's uploads under run config ``aggregation``."""

    checkpointed = ("global_set",)  # [checkpoint]

    def __init__(self, ctx: MethodContext) -> None:
        super().__init__(ctx)
        self.global_set: dict[str, np.ndarray] = {}

    def evaluates_after_training(self) -> bool:
        """[evaluation]: the personal model after training is what is evaluated, with no payload."""
        return True

    def global_arrays(self) -> Arrays:
        """The last round's per-class means and their mask (empty before round 1's step)."""
        return dict(self.global_set)

    def aggregate_train(self, server_round: int, replies: list[ClientReply]) -> dict[str, float]:
        """The per-class mean (:func:`methods.blocks.prototypes.aggregate_class_sets`)."""
        global_set, metrics = aggregate_class_sets(
            replies, "protos", "proto_labels", self.dims["C"], self.dims["d"], self.cfg, self.global_set
        )
        self.global_set = global_set or self.global_set
        return metrics


class ToyWithOwnRound(ToyServer):
    """[own-round]: a round of its own (``engine.contract.OwnRound``; here the standard one written out)."""

    def train_round(self, server_round: int) -> tuple[dict[str, Any], list[ClientReply]]:
        """Sample, one train exchange through the federation, then :meth:`aggregate_train`."""
        nodes = self.federation.sample()
        payloads = {n: self.configure_train(n, server_round) for n in nodes}
        valid = self.federation.send("train", payloads, self.train_config(server_round), server_round)
        start = time.perf_counter()
        server = self.aggregate_train(server_round, valid)
        return round_metrics(valid, server, time.perf_counter() - start), valid


class ToyClient(ClientProcedure):
    """Cross-entropy training, then each class's mean representation ([dp]: released by
    ``common.dp.noisy_class_means`` under record-level DP, through ``trained_class_means``)."""

    dp_releases = 1

    def train(self, client: ClientRuntime, payload: Arrays, config: dict[str, Any]) -> Reply:
        """``protos`` float32 [k, d] and ``proto_labels`` int64 [k] of the client's k classes."""
        stats = train_personal_model(client, config)
        means, labels = trained_class_means(client, stats)
        upload = {"protos": means.numpy(), "proto_labels": labels.numpy().astype(np.int64)}
        return upload, {**stats, "toy-classes": len(labels)}


METHOD = Method("toy", ToyServer, ToyClient, SCHEMAS, ToyOptions, metrics=METRICS)
