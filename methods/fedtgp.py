"""FedTGP: trainable global prototypes learned with adaptive-margin-enhanced contrastive learning.

Zhang et al., "FedTGP: Trainable Global Prototypes with Adaptive-Margin-Enhanced Contrastive
Learning for Data and Model Heterogeneity in Federated Learning", AAAI 2024; docs/methods/fedtgp.md
(section numbers below refer to it).

Payload (section 2):
- up (train): ``protos`` [C_i, K] float32, eval-mode class means of the trained extractor (or,
  ``prototype-pass = "before-training"``, the round-start one) for the classes the client holds,
  ``proto_labels`` [C_i] int64: 4*C_i*K + 8*C_i bytes.
- down (train from round 2, evaluate): ``global_protos`` [C, K] float32: 4*C*K bytes.
  Nothing in round 1 (no global prototypes yet).

Client (section 3): CE + lambda * prototype regulariser (default the official code's
lambda = 10 with mean squared error; ``fedtgp.reg-form = "paper-l2"``, ``fedtgp.lambda = 0.1``
give the paper's Eq. 11), then an eval-mode pass for the class prototypes. Inference by the
nearest global prototype over all C classes (section 6).

Server (section 4): an embedding table E [C, K] and a generator F = Linear(K, H) -> ReLU ->
Linear(H, K) (H = ``fedtgp.hidden-dim``, 512), kept across rounds, trained for ``server-epochs``
epochs of SGD on the round's uploads with the ACL loss (Eq. 10) and the adaptive margin
delta(t) (the official nearest-centre rule, ``fedtgp.margin = "max-pairwise"`` for the paper's
Eq. 9), then P̂ = F(E). Each round row also carries diagnostics of P̂: the smallest distance
between two global prototypes and how far they moved since the last round (the margin grows
by design, as in the official code; these show whether it settles). Run config ``aggregation``:
``mean`` is the paper's step on the rows as uploaded; ``norm-bound`` (default) first bounds the rows
of each class that at least 3 uploads hold to the class's lower median change from the P̂ sent
(:func:`methods.blocks.prototypes.bound_class_rows` with ``voted_only``) and leaves the other classes'
rows to the step, whose ACL gradient on P̂ is -‖p - P̂_c‖'s, a unit vector whatever the row's length.
Against colluders claiming a class that honest clients hold too, the paper's step lets one upload
pull P̂_c anywhere; bounded, it cannot (``results/byzantine/colluding-120x5/``, docs/methods/fedtgp.md).
``fedtgp.margin-freeze`` (off by default; not the paper's) holds the margin at a level once it
reaches it (:func:`held_margin`), to test whether the growing margin makes the runs diverge.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from common.config import RunConfig
from common.optim import SGD
from common.options import number, option
from common.payload import BASE_SCHEMAS, NO_PAYLOAD, ArraySpec, ClientReply, PayloadSchema
from common.protocol import Arrays, Reply
from common.runtime import ClientRuntime
from common.training import evaluation_metrics, train_personal_model, trained_class_means
from engine.contract import ClientProcedure, Method, MethodContext, MethodServer
from engine.robust import BOUNDED, require_aggregation
from methods.blocks.prototypes import (
    ROW_AGGREGATIONS,
    RegularizerOptions,
    bound_class_rows,
    class_set_schemas,
    guarded_regularizer,
    nearest_prototype_correct,
)

log = logging.getLogger("flwr." + __name__)  # streamed with Flower's own log

UPLOAD, _ = class_set_schemas("protos", "proto_labels", "d")
GLOBAL = PayloadSchema({"global_protos": ArraySpec(("C", "d"), "float32")}, optional=True)
SCHEMAS = {**BASE_SCHEMAS, "train": (GLOBAL, UPLOAD), "evaluate": (GLOBAL, NO_PAYLOAD)}

MARGINS = ("nearest", "max-pairwise")
#: which model the uploaded prototypes are of: the one just trained (paper Algorithm 1, spec step 4)
#: or the one the round started with (the official code: ``collect_protos`` reloads the model saved
#: at the end of the previous round, before saving this round's)
PROTOTYPE_PASSES = ("after-training", "before-training")


@dataclass(frozen=True)
class FedTGPOptions(RegularizerOptions):
    """``[tool.flwr.app.config.fedtgp]``: the client's prototype term (``lambda``, ``reg-form``) and
    the server's generator training (section 9)."""

    margin: str = option(
        "nearest",
        "adaptive margin: nearest (official code's nearest-centre rule) | max-pairwise (Eq. 9)",
        choices=MARGINS,
    )
    tau: float = option(100.0, "margin cap", low=0)
    margin_freeze: float = option(
        0.0,
        "stability option, not the paper's: once the capped margin first reaches this value it is held"
        " there for every later round (0 = off: the adaptive rule every round; at most tau)",
        low=0,
    )
    prototype_pass: str = option(
        "after-training",
        "prototypes of the model after this round's training (paper) | before-training (official code:"
        " the round-start model, one round stale)",
        choices=PROTOTYPE_PASSES,
    )
    server_epochs: int = option(100, "epochs of the generator's SGD per round", low=0)
    server_lr: float = option(0.01, "learning rate of the generator's SGD", low=0)
    server_batch_size: int = option(10, "prototypes per server step", low=1)
    hidden_dim: int = option(512, "hidden width H of the generator", low=1)

    def check(self, cfg: RunConfig) -> None:
        """Raises ConfigError: ``aggregation`` is not one of :data:`methods.blocks.prototypes.ROW_AGGREGATIONS`,
        or ``margin-freeze`` is above ``tau`` (the capped margin would never reach it), or ``reg-form``
        cannot be trained privately (:meth:`RegularizerOptions.require_per_example`)."""
        require_aggregation(cfg, ROW_AGGREGATIONS)
        number("fedtgp.margin-freeze", self.margin_freeze, low=0, high=self.tau)
        self.require_per_example(cfg)


class PrototypeGenerator(nn.Module):
    """Trainable global prototypes: P̂ = F(E), E ~ N(0, 1) [C, K], F = Linear-ReLU-Linear (section 4)."""

    def __init__(self, num_classes: int, k: int, hidden: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(num_classes, k)
        self.mlp = nn.Sequential(nn.Linear(k, hidden), nn.ReLU(), nn.Linear(hidden, k))

    def forward(self) -> torch.Tensor:
        """All C global prototypes ``[C, K]`` float32."""
        return self.mlp(self.embedding.weight)


def adaptive_margin(protos: torch.Tensor, labels: torch.Tensor, tau: float, mode: str = "nearest") -> float:
    """delta(t) from this round's uploads (section 4, section 11 items 2-4).

    Q^c = unweighted mean of the uploads of class c. ``nearest`` (official code): for each
    class its distance to the nearest other centre, then the maximum over classes.
    ``max-pairwise`` (paper Eq. 9): the largest distance between any two centres. Both capped
    at ``tau``; 0 when fewer than two classes were uploaded.

    Args:
        protos: float32 [M, K] uploads; labels: int64 [M].
    """
    classes = torch.unique(labels)
    if len(classes) < 2:
        return 0.0
    centres = torch.stack([protos[labels == c].mean(0) for c in classes]).double()
    dist = torch.cdist(centres, centres)
    if mode == "max-pairwise":
        value = float(dist.max())
    else:
        value = float(dist.masked_fill(torch.eye(len(classes), dtype=torch.bool), float("inf")).min(1).values.max())
    return min(value, tau)


def held_margin(rule: float, level: float, frozen: bool) -> tuple[float, bool]:
    """The margin the server trains with under ``fedtgp.margin-freeze`` = ``level``, and whether it is
    frozen from now on (docs/methods/fedtgp.md §11 item 16; a stability option, not the paper's).

    Once the rule's margin (after the tau cap) first reaches ``level``, the margin is ``level``
    exactly, in that round and in every later one, whatever the rule gives (also when it falls
    again); unlike ``tau``, which caps each round's value anew. ``level`` = 0: off, the rule's margin.

    Args:
        rule: this round's :func:`adaptive_margin`; level: the freeze level (>= 0);
        frozen: whether an earlier round froze the margin.

    Returns:
        (delta, frozen after this round).
    """
    if level > 0 and (frozen or rule >= level):
        return level, True
    return rule, False


def acl_loss(protos: torch.Tensor, labels: torch.Tensor, global_protos: torch.Tensor, delta: float) -> torch.Tensor:
    """Adaptive-margin contrastive loss (FedTGP Eq. 10), mean over the batch.

    z_{b,c} = -||p_b - P̂_c||_2 - delta * 1[c = y_b]; loss = CE(z_b, y_b). The squared distance is
    clamped at 1e-12 before the square root so identical vectors give finite gradients
    (§11 item 6).
    """
    sq = (
        protos.pow(2).sum(1, keepdim=True) - 2 * protos @ global_protos.T + global_protos.pow(2).sum(1)[None]
    ).clamp_min(1e-12)
    logits = -sq.sqrt() - delta * F.one_hot(labels, global_protos.shape[0]).to(protos.dtype)
    return F.cross_entropy(logits, labels)


def train_generator(
    generator: PrototypeGenerator,
    replies: list[ClientReply],
    opts: FedTGPOptions,
    rng: torch.Generator,
    frozen: bool = False,
) -> dict[str, float]:
    """Train the generator in place on this round's uploads (section 4).

    SGD (lr ``server-lr``, fresh each round: stateless), ``server-epochs`` epochs of shuffled
    batches of ``server-batch-size`` (last partial batch kept). Only this round's uploads.
    ``frozen``: an earlier round froze the margin at ``margin-freeze`` (:func:`held_margin`).

    Returns:
        ``server-num-protos`` (M), ``server-margin`` (delta), ``server-acl-before`` /
        ``server-acl-after`` (mean ACL over all uploads); with ``margin-freeze`` > 0 also
        ``server-margin-frozen``: 1 once the margin is frozen, else 0. Without uploads only
        ``server-num-protos`` (the frozen state is unchanged).
    """
    protos = torch.from_numpy(np.concatenate([r.arrays["protos"] for r in replies])) if replies else None
    if protos is None or len(protos) == 0:
        return {"server-num-protos": 0}
    labels = torch.from_numpy(np.concatenate([r.arrays["proto_labels"] for r in replies]))
    delta, frozen = held_margin(adaptive_margin(protos, labels, opts.tau, opts.margin), opts.margin_freeze, frozen)
    if len(torch.unique(labels)) < 2 and not frozen:
        log.warning("FedTGP: fewer than two classes uploaded this round; margin set to 0")
    with torch.no_grad():
        before = float(acl_loss(protos, labels, generator(), delta))
    opt = SGD(generator.parameters(), lr=opts.server_lr)
    for _ in range(opts.server_epochs):
        for idx in torch.split(torch.randperm(len(labels), generator=rng), opts.server_batch_size):
            loss = acl_loss(protos[idx], labels[idx], generator(), delta)
            opt.zero_grad()
            loss.backward()
            opt.step()
    with torch.no_grad():
        after = float(acl_loss(protos, labels, generator(), delta))
    metrics = {
        "server-num-protos": len(labels),
        "server-margin": delta,
        "server-acl-before": before,
        "server-acl-after": after,
    }
    if opts.margin_freeze > 0:
        metrics["server-margin-frozen"] = int(frozen)
    return metrics


def prototype_diagnostics(new: np.ndarray, old: np.ndarray | None) -> dict[str, float]:
    """How the global prototypes look after a round.

    Args:
        new: float32 [C, K] global prototypes after the server step; old: those of the round
            before (None in the first round).

    Returns:
        ``server-proto-min-distance``: the smallest Euclidean distance between two global
        prototypes; with ``old``, ``server-proto-shift``: the mean over classes of
        ||P̂_c(t) - P̂_c(t-1)||_2.
    """
    p = torch.from_numpy(new).double()
    dist = torch.cdist(p, p).masked_fill(torch.eye(len(p), dtype=torch.bool), float("inf"))
    out = {"server-proto-min-distance": float(dist.min())}
    if old is not None:
        out["server-proto-shift"] = float((p - torch.from_numpy(old).double()).norm(dim=1).mean())
    return out


class FedTGPServer(MethodServer):
    """FedTGP server: the generator persists across rounds; P̂ is regenerated after every update."""

    checkpointed = ("generator", "batch_rng", "global_set", "margin_hold")

    def __init__(self, ctx: MethodContext) -> None:
        super().__init__(ctx)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.cfg.seed)
            self.generator = PrototypeGenerator(self.dims["C"], self.dims["d"], self.options.hidden_dim)
        self.batch_rng = torch.Generator().manual_seed(self.cfg.seed)  # server mini-batch shuffling
        self.global_set: dict[str, np.ndarray] = {}  # "global_protos" [C, K] once the first update ran
        # whether the margin is frozen at fedtgp.margin-freeze (a checkpoint without it: not frozen)
        self.margin_hold: dict[str, bool] = {"frozen": False}

    def global_arrays(self) -> dict[str, np.ndarray]:
        """``global_protos`` [C, K] after the first server update; empty before."""
        return {k: v.copy() for k, v in self.global_set.items()}

    def configure_evaluate(self, node_id: int, server_round: int) -> dict[str, np.ndarray]:
        """Evaluation uses the global prototypes (nearest-prototype inference)."""
        return self.global_arrays()

    def aggregate_train(self, server_round: int, replies: list[ClientReply]) -> dict[str, float]:
        """Train the generator on the round's prototypes (under ``norm-bound`` bounded first, see the
        module docstring; ``server-bounded`` counts the scaled rows), then emit P̂ for all C classes."""
        bounded = {}
        if self.cfg.aggregation == "norm-bound":
            sent = self.global_set.get("global_protos")
            reference = None if sent is None else sent.astype(np.float64)
            replies, bounded[BOUNDED] = bound_class_rows(replies, "protos", "proto_labels", reference, voted_only=True)
        metrics = train_generator(self.generator, replies, self.options, self.batch_rng, self.margin_hold["frozen"])
        self.margin_hold["frozen"] = bool(metrics.get("server-margin-frozen", self.margin_hold["frozen"]))
        old = self.global_set.get("global_protos")
        if metrics["server-num-protos"] or old is None:
            with torch.no_grad():
                self.global_set["global_protos"] = self.generator().numpy().astype(np.float32)
        return {**metrics, **prototype_diagnostics(self.global_set["global_protos"], old), **bounded}


class FedTGPClient(ClientProcedure):
    """FedTGP client: FedProto's objective towards P̂ (from round 2), eval-mode prototypes after training."""

    dp_releases = 1

    def train(self, client: ClientRuntime, payload: Arrays, config: dict[str, Any]) -> Reply:
        """Returns ``protos`` float32 [C_i, K] and ``proto_labels`` int64 [C_i] (section 3): the
        eval-mode class means of the extractor after this round's training, or with
        ``prototype-pass = "before-training"`` of the extractor this round started with (the
        official code's order, docs/methods/fedtgp.md §11 item 15)."""
        protos = torch.from_numpy(payload["global_protos"]).to(client.device) if payload else None
        mask = torch.ones(len(protos), dtype=torch.bool, device=client.device) if payload else None
        pass_stats = {"train-seconds": 0.0}
        if self.options.prototype_pass == "before-training":
            means, labels = trained_class_means(client, pass_stats)
        stats = train_personal_model(client, config, guarded_regularizer(client, protos, mask, self.options))
        if self.options.prototype_pass == "after-training":
            means, labels = trained_class_means(client, pass_stats)
        stats["train-seconds"] += pass_stats["train-seconds"]
        return {"protos": means.numpy(), "proto_labels": labels.numpy().astype(np.int64)}, stats

    def evaluate(self, client: ClientRuntime, payload: Arrays, config: dict[str, Any]) -> Reply:
        """Nearest global prototype over all C classes; 0 correct before any P̂ exists."""
        if not payload:
            return {}, evaluation_metrics(*nearest_prototype_correct(client, None, None))
        protos = torch.from_numpy(payload["global_protos"])
        return {}, evaluation_metrics(
            *nearest_prototype_correct(client, protos, torch.ones(len(protos), dtype=torch.bool))
        )


METHOD = Method("fedtgp", FedTGPServer, FedTGPClient, SCHEMAS, FedTGPOptions)
