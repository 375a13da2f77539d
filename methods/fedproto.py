"""FedProto: clients share class prototypes, the server averages them per class.

Tan et al., "FedProto: Federated Prototype Learning across Heterogeneous Clients", AAAI 2022;
FedTGP's baseline, as HtFLlib's clientproto / serverproto (aggregation as yuetan031/FedProto);
docs/methods/fedproto.md.

Payload:
- up (train): ``protos`` [C_i, K] float32, the mean train-mode representation of each class,
  collected during local training; ``proto_labels`` [C_i] int64. 4*C_i*K + 8*C_i bytes.
- down (train, evaluate): ``protos`` [C_avail, K] float32, the global prototypes of the classes
  uploaded this round, and ``mask`` [C] bool marking those classes: 4*K*C_avail + C bytes.
  Absent in round 1 (nothing uploaded yet).

Client step: CE + lambda * prototype regulariser (FedTGP's client objective, so that the
comparison isolates the server), inference by the nearest available global prototype.
Server step: unweighted per-class mean of the uploads (no per-class counts are sent); classes
nobody uploaded this round get no prototype and are never predicted. Run config ``aggregation``:
``mean`` is that step; ``norm-bound`` (default) first bounds each uploaded prototype's change from
the global prototype sent this round (its norm where none was sent) by the round's median
(:func:`methods.blocks.prototypes.bound_class_rows`); ``median`` / ``trimmed-mean`` take
that statistic per class instead of the mean (:func:`methods.blocks.prototypes.aggregate_class_sets`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from common.config import RunConfig
from common.payload import BASE_SCHEMAS, NO_PAYLOAD, ClientReply
from common.protocol import Arrays, Reply
from common.runtime import ClientRuntime
from common.training import evaluation_metrics, train_personal_model, trained_class_means
from engine.contract import ClientProcedure, Method, MethodContext, MethodServer
from engine.robust import require_aggregation
from methods.blocks.prototypes import (
    CLASS_AGGREGATIONS,
    ClassMeanCollector,
    RegularizerOptions,
    aggregate_class_sets,
    class_set_schemas,
    guarded_regularizer,
    nearest_prototype_correct,
    unpack_global_set,
)

UPLOAD, GLOBAL_SET = class_set_schemas("protos", "proto_labels", "d")
SCHEMAS = {**BASE_SCHEMAS, "train": (GLOBAL_SET, UPLOAD), "evaluate": (GLOBAL_SET, NO_PAYLOAD)}


@dataclass(frozen=True)
class FedProtoOptions(RegularizerOptions):
    """``[tool.flwr.app.config.fedproto]``: the client's prototype term (FedTGP's client objective)."""

    def check(self, cfg: RunConfig) -> None:
        """Raises ConfigError: ``aggregation`` is not one of :data:`methods.blocks.prototypes.CLASS_AGGREGATIONS`, or
        ``reg-form`` cannot be trained privately (:meth:`RegularizerOptions.require_per_example`)."""
        require_aggregation(cfg, CLASS_AGGREGATIONS)
        self.require_per_example(cfg)


class FedProtoServer(MethodServer):
    """FedProto server: per-class unweighted mean of this round's uploads (no learned state)."""

    checkpointed = ("global_set",)

    def __init__(self, ctx: MethodContext) -> None:
        super().__init__(ctx)
        self.global_set: dict[str, np.ndarray] = {}

    def global_arrays(self) -> dict[str, np.ndarray]:
        """``protos`` [C_avail, K] and ``mask`` [C] of the last round (empty before round 1's update)."""
        return dict(self.global_set)

    def configure_evaluate(self, node_id: int, server_round: int) -> dict[str, np.ndarray]:
        """Evaluation uses the global prototypes (nearest-prototype inference)."""
        return self.global_arrays()

    def aggregate_train(self, server_round: int, replies: list[ClientReply]) -> dict[str, float]:
        """P̄^c = unweighted mean of the uploaded P_i^c for every class uploaded this round, under run
        config ``aggregation`` (:func:`methods.blocks.prototypes.aggregate_class_sets`).

        A round whose valid replies upload no prototype at all (none arrived, or each carries zero
        classes) keeps the previous global set: no upload is no evidence, and clients would
        otherwise train without the regulariser and evaluate against nothing next round.
        """
        global_set, metrics = aggregate_class_sets(
            replies, "protos", "proto_labels", self.dims["C"], self.dims["d"], self.cfg, self.global_set
        )
        if global_set:
            self.global_set = global_set
        return metrics


class FedProtoClient(ClientProcedure):
    """FedProto client: prototype-regularised training, prototypes collected during training."""

    dp_releases = 1

    def train(self, client: ClientRuntime, payload: Arrays, config: dict[str, Any]) -> Reply:
        """Returns ``protos`` float32 [C_i, K] (train-mode means during training), ``proto_labels`` int64.

        With DP on (run config ``dp.epsilon``) the prototypes are the trained extractor's eval-mode class
        means, released by ``common.dp.noisy_class_means``: means collected during training sum each
        example once per epoch under a changing model, which the per-class sums' bound does not cover."""
        data = client.data
        protos, mask = unpack_global_set(payload, data.info.num_classes)
        device_protos = (protos.to(client.device), mask.to(client.device)) if protos is not None else (None, None)
        regularizer = guarded_regularizer(client, *device_protos, self.options)
        collector = ClassMeanCollector(data.info.num_classes)

        def regularize_and_collect(features, labels):
            collector.add(features, labels)  # train-mode, before this batch's update (FedProto's code)
            return regularizer(features, labels)

        if client.dp is not None:
            stats = train_personal_model(client, config, regularizer)
            means, labels = trained_class_means(client, stats)
            return {"protos": means.numpy(), "proto_labels": labels.numpy().astype(np.int64)}, stats
        stats = train_personal_model(client, config, regularize_and_collect)
        means, labels = collector.means(client.model.feature_dim)
        return {"protos": means, "proto_labels": labels}, stats

    def evaluate(self, client: ClientRuntime, payload: Arrays, config: dict[str, Any]) -> Reply:
        """Nearest-prototype accuracy over the classes that have a global prototype."""
        protos, mask = unpack_global_set(payload, client.data.info.num_classes)
        return {}, evaluation_metrics(*nearest_prototype_correct(client, protos, mask))


METHOD = Method("fedproto", FedProtoServer, FedProtoClient, SCHEMAS, FedProtoOptions)
