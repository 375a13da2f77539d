"""FedGH: a generalized global header trained on clients' local averaged representations.

Yi et al., "FedGH: Heterogeneous Federated Learning with Generalized Global Header",
ACM MM 2023; docs/methods/fedgh.md (section numbers below refer to it).

Payload (section 2):
- down (train): the global header ``head.weight`` [C, d], ``head.bias`` [C], float32:
  4*C*(d+1) bytes per client (20,040 B for CIFAR-10, d=500).
- up (train): ``lar`` [C_k, d] float32, the per-class mean representation of each class
  the client holds, and ``lar_labels`` [C_k] int32: 4*C_k*(d+1) bytes (4,008 B for 2 classes).
- evaluate: nothing, unless ``fedgh.eval-global-head`` sends the header for the secondary
  metric (section 6), counted as evaluation traffic.

Client step (section 3): overwrite the local head with the global header, train the whole
model, then upload the exact per-class means of the post-training extractor.
Server step (section 4, Eq. 4): SGD on cross-entropy of the header over the round's LARs,
one step per LAR in (partition id, class) order by default. The authors' released code
never applies this update (P1); ``server-mode = "none"`` reproduces that. Run config
``aggregation``: ``mean`` trains on the LARs as uploaded (the paper); ``norm-bound`` (default) first
bounds each LAR's norm by the round's median (:func:`methods.blocks.prototypes.bound_class_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from common.config import RunConfig
from common.optim import SGD
from common.options import option
from common.payload import BASE_SCHEMAS, NO_PAYLOAD, ROW_NORM_FACTOR, ArraySpec, ClientReply, PayloadSchema
from common.protocol import Arrays, Reply
from common.runtime import ClientRuntime
from common.training import train_personal_model, trained_class_means
from engine.contract import ClientProcedure, Method, MethodContext, MethodServer
from engine.robust import BOUNDED, require_aggregation
from methods.blocks.heads import (
    GLOBAL_HEAD_METRICS,
    HEADER,
    add_global_head_accuracy,
    header_arrays,
    initial_header,
    load_header,
    require_linear_heads,
)
from methods.blocks.prototypes import ROW_AGGREGATIONS, bound_class_rows

LARS = PayloadSchema(
    {
        "lar": ArraySpec(("k", "d"), "float32", row_norm_factor=ROW_NORM_FACTOR),
        "lar_labels": ArraySpec(("k",), "int32", labels=True),
    }
)
SCHEMAS = {**BASE_SCHEMAS, "train": (HEADER, LARS)}
SCHEMAS_GLOBAL_HEAD_EVAL = {**SCHEMAS, "evaluate": (HEADER, NO_PAYLOAD)}

SERVER_MODES = ("per-lar", "per-client", "minibatch", "none")


@dataclass(frozen=True)
class FedGHOptions:
    """``[tool.flwr.app.config.fedgh]``: the server step (Eq. 4) and the secondary metric."""

    server_mode: str = option(
        "per-lar",
        "per-lar: one SGD step per LAR (the paper); per-client: one step per client on its mean CE; "
        "minibatch: shuffled batches of server-batch-size (HtFLlib); none: header never updated "
        "(the authors' released code, ablation only)",
        choices=SERVER_MODES,
    )
    server_lr: float = option(0.01, "learning rate of the header's SGD", low=0)
    server_epochs: int = option(1, "passes over the round's LARs (every server-mode)", low=1)
    server_batch_size: int = option(10, "LARs per step in minibatch mode", low=1)
    server_clip_norm: float = option(50.0, "gradient norm clip of the header's steps (<= 0: off)")
    eval_global_head: bool = option(False, "also report accuracy with the current global header")

    def check(self, cfg: RunConfig) -> None:
        """Raises ConfigError: the model group has a non-linear head (FedGH exchanges a linear one), or
        ``aggregation`` is not one of :data:`methods.blocks.prototypes.ROW_AGGREGATIONS`."""
        require_linear_heads(cfg, "header")
        require_aggregation(cfg, ROW_AGGREGATIONS)


def schemas(cfg: RunConfig, options: FedGHOptions) -> dict:
    """The train exchange; with ``eval-global-head`` the evaluate instruction also carries the header."""
    return SCHEMAS_GLOBAL_HEAD_EVAL if options.eval_global_head else SCHEMAS


def header_batches(sizes: list[int], opts: FedGHOptions, generator: torch.Generator) -> list[torch.Tensor]:
    """Row-index batches of the server's SGD steps over M = sum(sizes) LARs.

    ``sizes``: number of LARs of each reply, in partition-id order.
    """
    m = sum(sizes)
    if opts.server_mode == "none" or m == 0:
        return []
    out: list[torch.Tensor] = []
    for _ in range(opts.server_epochs):
        if opts.server_mode == "per-lar":
            out += [torch.tensor([j]) for j in range(m)]
        elif opts.server_mode == "per-client":
            out += [idx for idx in torch.split(torch.arange(m), sizes) if len(idx)]
        else:
            out += list(torch.split(torch.randperm(m, generator=generator), opts.server_batch_size))
    return out


def train_header(
    header: nn.Linear, replies: list[ClientReply], opts: FedGHOptions, generator: torch.Generator
) -> dict[str, float]:
    """The FedGH server step (Eq. 4): train ``header`` in place on this round's LARs.

    Replies are ordered by partition id, rows inside a reply by class (section 4), so
    the result does not depend on the order replies arrived in. Plain SGD (lr
    ``server_lr``, no momentum, no weight decay), created fresh each round; gradient norm
    clipped at ``server_clip_norm``. Only this round's LARs are used (nothing is stored).

    Returns:
        ``server-num-lars`` (M), ``server-ce-before`` / ``server-ce-after`` (mean CE of the
        header over the round's LARs before and after the update; absent when M = 0).
    """
    replies = sorted(replies, key=lambda r: r.partition_id)
    if not replies or sum(len(r.arrays["lar_labels"]) for r in replies) == 0:
        return {"server-num-lars": 0}
    ordered = [np.argsort(r.arrays["lar_labels"], kind="stable") for r in replies]
    reps = torch.from_numpy(np.concatenate([r.arrays["lar"][o] for r, o in zip(replies, ordered)]))
    labels = torch.from_numpy(
        np.concatenate([r.arrays["lar_labels"][o] for r, o in zip(replies, ordered)]).astype(np.int64)
    )
    with torch.no_grad():
        before = float(F.cross_entropy(header(reps), labels))
    opt = SGD(header.parameters(), lr=opts.server_lr)
    for idx in header_batches([len(r.arrays["lar_labels"]) for r in replies], opts, generator):
        opt.zero_grad()
        F.cross_entropy(header(reps[idx]), labels[idx]).backward()
        if opts.server_clip_norm > 0:
            nn.utils.clip_grad_norm_(header.parameters(), opts.server_clip_norm)
        opt.step()
    with torch.no_grad():
        after = float(F.cross_entropy(header(reps), labels))
    return {"server-num-lars": len(labels), "server-ce-before": before, "server-ce-after": after}


class FedGHServer(MethodServer):
    """FedGH server: holds the global header θ = Linear(d, C) and trains it each round.

    θ⁰ is PyTorch's default Linear init drawn from ``seed`` (section 5).
    """

    checkpointed = ("header", "header_generator")

    def __init__(self, ctx: MethodContext) -> None:
        super().__init__(ctx)
        self.header = initial_header(self.dims["d"], self.dims["C"], self.cfg.seed)
        self.header_generator = torch.Generator().manual_seed(self.cfg.seed)

    def evaluates_after_training(self) -> bool:
        """The primary metric is the post-training model (section 6); not with ``eval-global-head``: the
        secondary metric needs the header *after* this round's server step."""
        return not self.options.eval_global_head

    def global_arrays(self) -> dict[str, np.ndarray]:
        """The header (:func:`header_arrays`)."""
        return header_arrays(self.header)

    def configure_evaluate(self, node_id: int, server_round: int) -> dict[str, np.ndarray]:
        """The current header when ``eval-global-head`` is on (secondary metric), else nothing."""
        return self.global_arrays() if self.options.eval_global_head else {}

    def aggregate_train(self, server_round: int, replies: list[ClientReply]) -> dict[str, float]:
        """Train the header on the round's LARs (:func:`train_header`), under ``norm-bound`` bounded
        first (:func:`methods.blocks.prototypes.bound_class_rows`)."""
        bounded = {}
        if self.cfg.aggregation == "norm-bound":
            replies, bounded[BOUNDED] = bound_class_rows(replies, "lar", "lar_labels")
        return {**train_header(self.header, replies, self.options, self.header_generator), **bounded}


class FedGHClient(ClientProcedure):
    """FedGH client: replace head, train the whole model, upload exact LARs (section 3)."""

    dp_releases = 1

    def train(self, client: ClientRuntime, payload: Arrays, config: dict[str, Any]) -> Reply:
        """Returns ``lar`` float32 [C_k, d] and ``lar_labels`` int32 [C_k] of the trained extractor."""
        load_header(client.model.head, payload)
        stats = train_personal_model(client, config)
        means, labels = trained_class_means(client, stats)
        return {"lar": means.numpy(), "lar_labels": labels.numpy().astype(np.int32)}, stats

    def evaluate(self, client: ClientRuntime, payload: Arrays, config: dict[str, Any]) -> Reply:
        """Personal model accuracy; with a header in the payload also ``test-acc-global-head``."""
        return add_global_head_accuracy(super().evaluate(client, payload, config), client, payload)


METHOD = Method(
    "fedgh",
    FedGHServer,
    FedGHClient,
    schemas,
    FedGHOptions,
    metrics=GLOBAL_HEAD_METRICS,
)
