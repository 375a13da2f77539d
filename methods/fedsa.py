"""FedSA: semantic anchors as the shared knowledge of prototype-based federated learning.

Zhou et al., "FedSA: A Unified Representation Learning via Semantic Anchors for Prototype-based Federated
Learning", AAAI 2025; as the authors' code lokinko/FedSA 75bf106 computes it (``clientsa.py``, ``serversa.py``);
docs/methods/fedsa.md (section numbers below refer to it).

Payload (§2), C classes, K the representation size:
- down (train): ``anchors`` [C, K] float32, the semantic anchors A: 4·C·K bytes, round 1 included.
- up (train): ``protos`` [C_i, K] float32, the train-mode class means of the representations seen in training,
  ``proto_labels`` [C_i] int64: 4·C_i·K + 8·C_i bytes.
- down (evaluate): ``protos`` [C_avail, K] float32 and ``mask`` [C] bool, the global prototypes P̄ of the last
  round's uploads (FedProto's): 4·C_avail·K + C bytes. Absent before any upload.

Client step (§3): per batch CE(h(r), y) + γ·L_CC + λ·L_R + μ·L_MCL with r the representations:
L_CC = (1/C) Σ_c CE(h(a_c), c) over all C anchors (only the head learns from it); L_R = (1/(B·K)) Σ ‖r − a_y‖²;
L_MCL = CE(−(d + δ_i·e_y), y) with d_c = ‖r − a_c‖ (the squared distance clamped at 1e-12 before the root,
decision 3) and the margin δ_i = max(g_i, g_A): g_A the anchors' mean nearest-neighbour distance, g_i the same
over the client's own last upload (0 before it has uploaded or when it held one class: the code's 0.0 and −∞
give the same δ_i). Plain SGD as the run config says. Inference: the nearest global prototype (FedProto's).

Server step (§4): P̄ the per-class unweighted mean of the uploads under run config ``aggregation`` (FedProto's
:func:`methods.blocks.prototypes.aggregate_class_sets`), then a_c ← (1 − ``ema``)·a_c + ``ema``·P̄_c for the
classes uploaded this round. Anchors start (§5) as MLP(Z), Z ~ N(0, 1)^{C×K}, MLP = Linear(K, K) → BatchNorm →
ReLU → Linear(K, K) → BatchNorm → ReLU in training mode (batch statistics over the C rows), never trained, drawn
from ``seed``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from common.config import ConfigError, RunConfig
from common.dp import dp_options
from common.options import option
from common.payload import BASE_SCHEMAS, NO_PAYLOAD, ArraySpec, ClientReply, PayloadSchema
from common.protocol import Arrays, Reply
from common.runtime import ClientRuntime
from common.training import evaluation_metrics, train_personal_model
from engine.contract import ClientProcedure, Method, MethodContext, MethodServer
from engine.robust import require_aggregation
from methods.blocks.prototypes import (
    CLASS_AGGREGATIONS,
    ClassMeanCollector,
    aggregate_class_sets,
    class_set_schemas,
    nearest_prototype_correct,
    unpack_global_set,
)

UPLOAD, GLOBAL_SET = class_set_schemas("protos", "proto_labels", "d")
ANCHORS = PayloadSchema({"anchors": ArraySpec(("C", "d"), "float32")})
SCHEMAS = {**BASE_SCHEMAS, "train": (ANCHORS, UPLOAD), "evaluate": (GLOBAL_SET, NO_PAYLOAD)}
#: the client's state record of g_i, the mean nearest-neighbour distance of its last upload
LOCAL_GAP_STATE = "fedsa-local-gap"


@dataclass(frozen=True)
class FedSAOptions:
    """``[tool.flwr.app.config.fedsa]`` (the authors' scripts, ``cross-device setting.sh``; §9)."""

    lambda_: float = option(10.0, "weight λ of the anchor regulariser, squared error averaged over B and K", low=0)
    mcl: float = option(1.0, "weight μ of the margin-enhanced contrastive loss to the anchors", low=0)
    cc: float = option(1.0, "weight γ of the classifier calibration on the anchors", low=0)
    ema: float = option(0.0001, "step of the anchors' EMA towards the global prototypes (code: 0.0001)", low=0, high=1)

    def check(self, cfg: RunConfig) -> None:
        """Raises ConfigError: ``aggregation`` is not one of :data:`methods.blocks.prototypes.CLASS_AGGREGATIONS`,
        or ``dp.epsilon`` > 0: the calibration term runs the head on the anchors, a batch that is not the
        examples', which DP-SGD's per-example clipping here cannot separate from theirs."""
        require_aggregation(cfg, CLASS_AGGREGATIONS)
        if dp_options(cfg).enabled:
            raise ConfigError(
                f"run config key 'dp.epsilon' > 0 with method '{cfg.method}': its classifier calibration runs the "
                "head on the anchors beside the examples, which per-example clipping here cannot bound; set "
                "'dp.epsilon' = 0"
            )


def initial_anchors(num_classes: int, k: int, seed: int) -> torch.Tensor:
    """A⁰ = MLP(Z) float32 [C, K] (§5): the MLP's layers then Z ~ N(0, 1) drawn in that order from ``seed`` (the
    authors' order), one forward pass in training mode, nothing trained; the global RNG untouched.

    Raises:
        ValueError: fewer than 2 classes (BatchNorm needs two rows).
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        mlp = nn.Sequential(
            nn.Linear(k, k), nn.BatchNorm1d(k), nn.ReLU(), nn.Linear(k, k), nn.BatchNorm1d(k), nn.ReLU()
        )
        z = torch.randn(num_classes, k)
        with torch.no_grad():
            return mlp.train()(z)


def mean_nearest_distance(rows: torch.Tensor) -> float:
    """(1/M) Σ_m min_{m'≠m} ‖rows_m − rows_m'‖ of ``rows`` [M, K] (§3's g_A and g_i); 0.0 when M < 2."""
    if len(rows) < 2:
        return 0.0
    distances = torch.cdist(rows.double(), rows.double()).fill_diagonal_(float("inf"))
    return float(distances.min(dim=1).values.mean())


def anchor_loss(
    features: torch.Tensor,
    y: torch.Tensor,
    head: nn.Module,
    anchors: torch.Tensor,
    margin: float,
    options: FedSAOptions,
) -> torch.Tensor:
    """γ·L_CC + λ·L_R + μ·L_MCL of §3 for representations ``features`` [B, K] of labels ``y`` [B] int64, the
    client's ``head`` and ``anchors`` [C, K] float32, the margin δ_i (a float ≥ 0). Scalar."""
    classes = torch.arange(len(anchors), device=anchors.device)
    calibration = F.cross_entropy(head(anchors), classes)
    regulariser = F.mse_loss(features, anchors[y])
    squared = (features.pow(2).sum(1, keepdim=True) - 2 * features @ anchors.T + anchors.pow(2).sum(1)[None]).clamp(
        min=1e-12
    )
    distances = squared.sqrt() + margin * F.one_hot(y, len(anchors)).to(features.dtype)
    contrastive = F.cross_entropy(-distances, y)
    return options.cc * calibration + options.lambda_ * regulariser + options.mcl * contrastive


class FedSAServer(MethodServer):
    """The semantic anchors A [C, K] (EMA towards the global prototypes) and the last global prototypes P̄."""

    checkpointed = ("anchors", "global_set")

    def __init__(self, ctx: MethodContext) -> None:
        super().__init__(ctx)
        anchors = initial_anchors(self.dims["C"], self.dims["d"], self.cfg.seed)
        self.anchors: dict[str, np.ndarray] = {"anchors": anchors.numpy()}
        self.global_set: dict[str, np.ndarray] = {}

    def global_arrays(self) -> dict[str, np.ndarray]:
        """``anchors`` float32 [C, K]."""
        return dict(self.anchors)

    def configure_evaluate(self, node_id: int, server_round: int) -> dict[str, np.ndarray]:
        """The global prototypes P̄ (``protos``, ``mask``) for nearest-prototype inference; nothing before any."""
        return dict(self.global_set)

    def aggregate_train(self, server_round: int, replies: list[ClientReply]) -> dict[str, float]:
        """P̄ under run config ``aggregation``; a_c ← (1 − ema)·a_c + ema·P̄_c for the classes uploaded this round.
        A round without prototypes changes nothing. Row metric ``server-anchor-shift``: ‖ΔA‖_F."""
        global_set, metrics = aggregate_class_sets(
            replies, "protos", "proto_labels", self.dims["C"], self.dims["d"], self.cfg, self.global_set
        )
        if not global_set:
            return metrics
        self.global_set = global_set
        anchors = self.anchors["anchors"].astype(np.float64)
        before = anchors.copy()
        mask, ema = global_set["mask"], self.options.ema
        anchors[mask] = (1 - ema) * anchors[mask] + ema * global_set["protos"].astype(np.float64)
        self.anchors["anchors"] = anchors.astype(np.float32)
        return {**metrics, "server-anchor-shift": float(np.linalg.norm(self.anchors["anchors"] - before))}


class LocalGap(nn.Module):
    """The client's g_i (float32 [1]) kept between rounds in its state store."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("gap", torch.zeros(1))


class FedSAClient(ClientProcedure):
    """Anchor-regularised training (§3), train-mode class means collected during it, nearest-prototype inference."""

    def train(self, client: ClientRuntime, payload: Arrays, config: dict[str, Any]) -> Reply:
        """Returns ``protos`` float32 [C_i, K] and ``proto_labels`` int64 [C_i], the classes seen in training."""
        anchors = torch.from_numpy(np.asarray(payload["anchors"])).to(client.device)
        local = LocalGap()
        client.restore(LOCAL_GAP_STATE, local)
        margin = max(float(local.gap), mean_nearest_distance(anchors.cpu()))
        collector = ClassMeanCollector(client.data.info.num_classes)
        head = client.model.head

        def objective(x, features, logits, y):
            collector.add(features, y)  # train-mode, before this batch's update (the code's agg_func)
            return F.cross_entropy(logits, y) + anchor_loss(features, y, head, anchors, margin, self.options)

        stats = train_personal_model(client, config, supervised_loss=objective)
        means, labels = collector.means(client.model.feature_dim)
        local.gap.fill_(mean_nearest_distance(torch.from_numpy(means)))
        client.store(LOCAL_GAP_STATE, local)
        return {"protos": means, "proto_labels": labels}, stats

    def evaluate(self, client: ClientRuntime, payload: Arrays, config: dict[str, Any]) -> Reply:
        """Nearest-global-prototype accuracy over the classes that have one (§6)."""
        protos, mask = unpack_global_set(payload, client.data.info.num_classes)
        return {}, evaluation_metrics(*nearest_prototype_correct(client, protos, mask))


METHOD = Method("fedsa", FedSAServer, FedSAClient, SCHEMAS, FedSAOptions)
