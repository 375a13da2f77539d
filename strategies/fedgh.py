"""FedGH: a generalized global header trained on clients' local averaged representations.

Yi et al., "FedGH: Heterogeneous Federated Learning with Generalized Global Header",
ACM MM 2023; spec shared/specs/fedgh.md (section numbers below refer to it).

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
never applies this update (section 11 P1); ``server-mode = "none"`` reproduces that.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from client_app.training import evaluate_model, train_personal_model, trained_class_means
from common.config import ConfigError, RunConfig, choice, flag, number
from strategies.base import BASE_SCHEMAS, NO_PAYLOAD, ClientProcedure, ClientReply, HeteroStrategy
from strategies.payload import ROW_NORM_FACTOR, ArraySpec, PayloadSchema

HEADER = PayloadSchema({"head.weight": ArraySpec(("C", "d"), "float32"), "head.bias": ArraySpec(("C",), "float32")})
LARS = PayloadSchema(
    {
        "lar": ArraySpec(("k", "d"), "float32", row_norm_factor=ROW_NORM_FACTOR),
        "lar_labels": ArraySpec(("k",), "int32", labels=True),
    }
)
SCHEMAS = {**BASE_SCHEMAS, "train": (HEADER, LARS)}
SCHEMAS_GLOBAL_HEAD_EVAL = {**SCHEMAS, "evaluate": (HEADER, NO_PAYLOAD)}

SERVER_MODES = ("per-lar", "per-client", "minibatch", "none")


def require_linear_heads(cfg: RunConfig, payload: str) -> None:
    """Methods that exchange a linear head (FedGH, FedRE) need a model group whose heads are all linear.

    ``payload`` names the exchanged head in the message (FedGH's "header", FedRE's "head").

    Raises:
        ConfigError: naming ``model-group`` and what is allowed.
    """
    from models.groups import MODEL_GROUPS

    if set(MODEL_GROUPS[cfg.model_group].heads) != {"linear"}:
        raise ConfigError(
            f"method '{cfg.method}' exchanges a linear {payload}, but model-group '{cfg.model_group}' has "
            "non-linear heads; allowed: groups without HtC4 heads"
        )


@dataclass(frozen=True)
class FedGHOptions:
    """``[tool.flwr.app.config.fedgh]`` keys (section 4 step 4, section 11 P2).

    ``server_mode``: ``per-lar`` (one SGD step per LAR, the paper), ``per-client`` (one step
    per client on its mean CE), ``minibatch`` (shuffled batches of ``server_batch_size`` for
    ``server_epochs`` passes, HtFLlib style), ``none`` (header never updated: the authors'
    released behaviour, ablation only). ``server_epochs`` also repeats the per-lar and
    per-client passes. ``server_clip_norm`` <= 0 disables clipping.
    """

    server_mode: str
    server_lr: float
    server_epochs: int
    server_batch_size: int
    server_clip_norm: float
    eval_global_head: bool

    @classmethod
    def from_config(cls, cfg: RunConfig) -> FedGHOptions:
        """Validate the ``fedgh.*`` keys.

        Raises:
            ConfigError: naming the key and its allowed values.
        """
        require_linear_heads(cfg, "header")
        o = {
            "server-mode": "per-lar",
            "server-lr": 0.01,
            "server-epochs": 1,
            "server-batch-size": 10,
            "server-clip-norm": 50.0,
            "eval-global-head": False,
            **cfg.method_options(),
        }
        return cls(
            server_mode=choice("fedgh.server-mode", o["server-mode"], SERVER_MODES),
            server_lr=number("fedgh.server-lr", o["server-lr"], low=0),
            server_epochs=number("fedgh.server-epochs", o["server-epochs"], kind=int, low=1),
            server_batch_size=number("fedgh.server-batch-size", o["server-batch-size"], kind=int, low=1),
            server_clip_norm=number("fedgh.server-clip-norm", o["server-clip-norm"]),
            eval_global_head=flag("fedgh.eval-global-head", o["eval-global-head"]),
        )


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

    Replies are ordered by partition id, rows inside a reply by class (section 4 step 2), so
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
    opt = torch.optim.SGD(header.parameters(), lr=opts.server_lr)
    for idx in header_batches([len(r.arrays["lar_labels"]) for r in replies], opts, generator):
        opt.zero_grad()
        F.cross_entropy(header(reps[idx]), labels[idx]).backward()
        if opts.server_clip_norm > 0:
            nn.utils.clip_grad_norm_(header.parameters(), opts.server_clip_norm)
        opt.step()
    with torch.no_grad():
        after = float(F.cross_entropy(header(reps), labels))
    return {"server-num-lars": len(labels), "server-ce-before": before, "server-ce-after": after}


class FedGHStrategy(HeteroStrategy):
    """FedGH server: holds the global header θ = Linear(d, C) and trains it each round.

    θ⁰ is PyTorch's default Linear init drawn from ``seed`` (section 5).
    """

    schemas = SCHEMAS
    evaluate_in_train = True  # the primary metric is the post-training model (section 6)
    checkpointed = ("header", "header_generator")

    def __init__(self, cfg: RunConfig, results=None) -> None:
        super().__init__(cfg, results)
        self.options = FedGHOptions.from_config(cfg)
        if self.options.eval_global_head:
            # the secondary metric needs the header *after* this round's server step
            self.schemas = SCHEMAS_GLOBAL_HEAD_EVAL
            self.evaluate_in_train = False
        self.header = initial_header(self.dims["d"], self.dims["C"], cfg.seed)
        self.header_generator = torch.Generator().manual_seed(cfg.seed)

    def global_arrays(self) -> dict[str, np.ndarray]:
        """The header (:func:`header_arrays`)."""
        return header_arrays(self.header)

    def eval_payload(self, node_id: int, server_round: int) -> dict[str, np.ndarray]:
        """The current header when ``eval-global-head`` is on (secondary metric), else nothing."""
        return self.global_arrays() if self.options.eval_global_head else {}

    def server_update(self, server_round: int, replies: list[ClientReply]) -> dict[str, float]:
        """Train the header on the round's LARs (:func:`train_header`)."""
        return train_header(self.header, replies, self.options, self.header_generator)


def initial_header(d: int, num_classes: int, seed: int) -> nn.Linear:
    """A server's global head ``Linear(d, C)`` with PyTorch's default init drawn from ``seed``
    (FedGH section 5, FedRE section 5), without touching the global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Linear(d, num_classes)


def header_arrays(head: nn.Linear) -> dict[str, np.ndarray]:
    """A head as the payload ``head.weight`` [C, d] and ``head.bias`` [C], float32 copies."""
    return {"head.weight": head.weight.detach().numpy().copy(), "head.bias": head.bias.detach().numpy().copy()}


def load_header(head: nn.Linear, payload: dict[str, np.ndarray]) -> None:
    """Overwrite ``head`` with the received header, bit for bit (section 3 step 2, P3)."""
    with torch.no_grad():
        head.weight.copy_(torch.from_numpy(payload["head.weight"]))
        head.bias.copy_(torch.from_numpy(payload["head.bias"]))


class FedGHClient(ClientProcedure):
    """FedGH client: replace head, train the whole model, upload exact LARs (section 3)."""

    schemas = SCHEMAS

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg)
        if FedGHOptions.from_config(cfg).eval_global_head:
            self.schemas = SCHEMAS_GLOBAL_HEAD_EVAL

    def train(self, client, payload, config):
        """Returns ``lar`` float32 [C_k, d] and ``lar_labels`` int32 [C_k] of the trained extractor."""
        load_header(client.model.head, payload)
        stats = train_personal_model(client, config)
        means, labels = trained_class_means(client, stats)
        return {"lar": means.numpy(), "lar_labels": labels.numpy().astype(np.int32)}, stats

    def evaluate(self, client, payload, config):
        """Personal model accuracy; with a header in the payload also ``test-acc-global-head``."""
        arrays, metrics = super().evaluate(client, payload, config)
        if payload:
            model, data = client.model, client.data
            head = nn.Linear(model.feature_dim, model.num_classes)
            load_header(head, payload)
            global_model = nn.Sequential(model.extractor, head.to(client.device))
            correct, n, _ = evaluate_model(global_model, data.test_x, data.test_y, data.info, client.device)
            metrics["test-acc-global-head"] = correct / max(n, 1)
        return arrays, metrics
