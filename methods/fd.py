"""FD: Federated Distillation with per-class mean logits.

Jeong et al., "Communication-Efficient On-Device Machine Learning: Federated Distillation and
Augmentation under Non-IID Private Data", 2018; a baseline of FedMRL and FedGH;
docs/methods/fd.md.

Payload:
- up (train): ``logits`` [k, C] float32, the mean logit vector of each class the client holds,
  and ``logit_labels`` [k] int64: 4·k·C + 8·k bytes (96 B for 2 classes of CIFAR-10).
- down (train): ``logits`` [a, C] float32, the global per-class logits of the classes anyone
  uploaded, and ``mask`` [C] bool: 4·a·C + C bytes. Absent in round 1.

Client step: CE(z, y) + λ·KL(softmax(ẑ_y) ‖ softmax(z)) over the samples whose label has a
global logit ẑ_y (the spec's recommended D); ``fd.target = "logits"`` uses HtFLlib's raw-logit
soft-target CE instead (a quirk, kept as an option to reproduce FedTGP's FD baseline); no
distillation term before global logits exist. After training, the client
uploads the exact per-class means of its model's logits over its whole train split in eval
mode without augmentation (the paper averages logits seen during training; the post-training
means describe the model that is uploaded and do not depend on batch order).
Server step: per-class unweighted mean over the clients that uploaded the class
(:func:`engine.aggregation.class_average`), under run config ``aggregation``
(:func:`methods.blocks.prototypes.aggregate_class_sets`: ``mean`` is the paper's step, ``norm-bound``
bounds each uploaded logit row's change from the global row sent this round (its norm where none
was sent) by the round's median first, ``median`` / ``trimmed-mean``
replace the mean per class). Inference: the personal model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from common.config import RunConfig
from common.options import option
from common.payload import BASE_SCHEMAS, RECEIVED_ROW_FACTOR, ClientReply
from common.protocol import Arrays, Reply
from common.runtime import ClientRuntime
from common.training import kd_loss, train_personal_model, trained_class_means
from engine.contract import ClientProcedure, Method, MethodContext, MethodServer
from engine.robust import require_aggregation
from methods.blocks.prototypes import (
    CLASS_AGGREGATIONS,
    aggregate_class_sets,
    class_set_schemas,
    trusted_rows,
    unpack_global_set,
)

TARGETS = ("softmax", "logits")

UPLOAD, GLOBAL_LOGITS = class_set_schemas("logits", "logit_labels", "C")
SCHEMAS = {**BASE_SCHEMAS, "train": (GLOBAL_LOGITS, UPLOAD)}


@dataclass(frozen=True)
class FDOptions:
    """``[tool.flwr.app.config.fd]``."""

    lambda_: float = option(1.0, "weight of the distillation term towards the global per-class logits", low=0)
    target: str = option(
        "softmax",
        "softmax: KL towards softmax of the global logit (ours) | logits: CE with the raw global logit vector as "
        "soft target (HtFLlib, so FedTGP's FD baseline; unbounded below, it can diverge)",
        choices=TARGETS,
    )

    def check(self, cfg: RunConfig) -> None:
        """Raises ConfigError: ``aggregation`` is not one of :data:`methods.blocks.prototypes.CLASS_AGGREGATIONS`."""
        require_aggregation(cfg, CLASS_AGGREGATIONS)


def fd_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    targets: torch.Tensor | None,
    mask: torch.Tensor | None,
    lam: float,
    target: str,
) -> torch.Tensor:
    """The FD client loss of one batch (docs/methods/fd.md, client step), a scalar.

    Args:
        logits: z, float32 [B, C]; labels: y, int64 [B]; targets: the global logits ẑ, float32
            [C, C] (row c for class c) or None before any exist; mask: bool [C], which rows are
            set; lam: λ; target: ``softmax`` or ``logits`` (:class:`FDOptions`).

    ``softmax``: CE(z, y) + λ·KL(softmax(ẑ_y) ‖ softmax(z)) over the samples whose class has a
    global logit, summed and divided by B (the others add 0). ``logits`` (HtFLlib's
    ``clientfd.py``): CE(z, y) + λ·CE(z, t), t_i = ẑ_{y_i} where set, else z_i (detached), taken as
    a class-probability target, mean over the batch. A global logit the client does not trust for an
    example (:func:`methods.blocks.prototypes.trusted_rows`: far longer than that example's own logits)
    counts as not set.
    """
    ce = F.cross_entropy(logits, labels)
    longest = RECEIVED_ROW_FACTOR * logits.detach().norm(dim=1) if targets is not None else None
    if targets is None or lam == 0 or not (known := trusted_rows(targets, mask, labels, longest)).any():
        return ce
    if target == "logits":
        soft = torch.where(known[:, None], targets[labels], logits.detach())
        return ce + lam * F.cross_entropy(logits, soft)
    return ce + lam * kd_loss(logits[known], targets[labels[known]]) * known.sum() / len(labels)


class FDServer(MethodServer):
    """FD server: averages the uploaded per-class logits per class."""

    checkpointed = ("global_logits",)

    def evaluates_after_training(self) -> bool:
        """Yes: the evaluated model is the post-training personal model, and evaluation needs no payload."""
        return True

    def __init__(self, ctx: MethodContext) -> None:
        super().__init__(ctx)
        self.global_logits: dict = {}

    def global_arrays(self):
        """``logits`` [a, C] and ``mask`` [C] of the last round (empty before round 1's update)."""
        return dict(self.global_logits)

    def aggregate_train(self, server_round: int, replies: list[ClientReply]) -> dict[str, float]:
        """ẑ_c = mean of the uploaded per-class logits of class c, under run config ``aggregation``
        (:func:`methods.blocks.prototypes.aggregate_class_sets`); a round whose valid replies upload
        no logits at all (none arrived, or each carries zero classes) keeps the previous global
        logits (as FedProto keeps its prototypes)."""
        global_logits, metrics = aggregate_class_sets(
            replies, "logits", "logit_labels", self.dims["C"], self.dims["C"], self.cfg, self.global_logits
        )
        if global_logits:
            self.global_logits = global_logits
        return metrics


class FDClient(ClientProcedure):
    """FD client: CE plus distillation towards the global logit of each sample's class."""

    dp_releases = 1

    def train(self, client: ClientRuntime, payload: Arrays, config: dict[str, Any]) -> Reply:
        """Returns ``logits`` float32 [k, C] (post-training class means) and ``logit_labels`` int64 [k]."""
        lam = self.options.lambda_
        targets, mask = unpack_global_set(payload, client.data.info.num_classes, "logits")
        if targets is not None:
            targets, mask = targets.to(client.device), mask.to(client.device)

        def distilled_loss(x, features, logits, labels):
            return fd_loss(logits, labels, targets, mask, lam, self.options.target)

        stats = train_personal_model(client, config, supervised_loss=distilled_loss)
        means, labels = trained_class_means(client, stats, client.model)
        return {"logits": means.numpy(), "logit_labels": labels.numpy()}, stats


METHOD = Method("fd", FDServer, FDClient, SCHEMAS, FDOptions)
