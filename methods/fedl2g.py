"""FedL2G: trainable guiding vectors learnt from the clients' quiz gradients, two variants.

Zhang et al., "FedL2G: Learning to Guide Local Training in Heterogeneous Federated Learning", arXiv
2410.06490; as HtFLlib e959261 (``serverl2g_feat.py`` / ``clientl2g_feat.py`` and the ``_logit``
pair); docs/methods/fedl2g.md. ``fedl2g-feat`` guides the representation (D = d), ``fedl2g-logit``
the logits (D = C).

Payload (docs/methods/fedl2g.md §2):
- down (train): ``guiding`` [C, D] float32, the guiding vectors G: 4·C·D bytes, warm-up rounds too.
- up (train): ``grads`` [m_i, D] float32, the rows of ∂L_q/∂G of the m_i classes of the client's study
  batches, and ``grad_labels`` [m_i] int64: 4·m_i·D + 8·m_i bytes.

Client step (§3): the first ``quiz-batches``·B training examples are the quiz set Q, the rest the study
set S. After ``warm-up-rounds`` rounds, local training on S: CE + ``guide-weight``·(1/(B·D))·Σ‖r_b −
g_{y_b}‖² (r: the representation or the logits). Every round, with the model that training left: one
virtual SGD step θ' = θ − η∇_θ L_study(θ; G) on ``study-batches`` shuffled batches of S, then the gradient
of the quiz loss CE(f_θ'(x_q), y_q) with respect to G, by double backward through the step
(:func:`quiz_gradient`); the virtual step is discarded.

Server step (§4): per class the unweighted mean of the uploaded rows (zero for a class nobody sent), the
[C, D] gradient clipped to global norm ``server-clip-norm``, one SGD step G ← G − η_s·∇ (η_s =
``server-lr``). Run config ``aggregation``: ``mean`` is that step; ``norm-bound`` (default),
``median`` and ``trimmed-mean`` act on the uploaded rows as for the other per-class uploads
(:func:`methods.blocks.prototypes.aggregate_class_sets`, each row's reference zero).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from common.config import ConfigError, RunConfig
from common.data import augment, batches, normalize
from common.dp import dp_options
from common.options import option
from common.payload import BASE_SCHEMAS, ArraySpec, ClientReply, PayloadSchema
from common.protocol import SERVER_ROUND, Arrays, Reply
from common.runtime import ClientRuntime
from common.training import train_personal_model
from engine.contract import ClientProcedure, Method, MethodContext, MethodServer
from engine.robust import require_aggregation
from methods.blocks.prototypes import CLASS_AGGREGATIONS, aggregate_class_sets, class_set_schemas

_META_RNG = 11  # ``purpose`` of the client's study / quiz batch RNG (independent of training's)


def fedl2g_schemas(width: str) -> dict[str, tuple[PayloadSchema, PayloadSchema]]:
    """The message schemas of a variant whose guided output has ``width`` entries (``d`` or ``C``)."""
    upload, _ = class_set_schemas("grads", "grad_labels", width)
    guiding = PayloadSchema({"guiding": ArraySpec(("C", width), "float32")})
    return {**BASE_SCHEMAS, "train": (guiding, upload)}


@dataclass(frozen=True)
class FedL2GOptions:
    """``[tool.flwr.app.config.fedl2g-feat]`` (HtFLlib's and the authors' script's settings, §9)."""

    server_lr: float = option(100.0, "SGD step size of the server on the guiding vectors (authors' script)", low=0)
    warm_up_rounds: int = option(50, "rounds of guide learning alone before local training starts (both codes)", low=0)
    study_batches: int = option(1, "shuffled study batches of the virtual step (M_s)", low=1)
    quiz_batches: int = option(1, "quiz batches (M_q); the first M_q·B training examples are the quiz set", low=1)
    guide_weight: float = option(1.0, "weight of the squared-error pull towards the guiding vector (code: 1)", low=0)
    server_clip_norm: float = option(100.0, "global L2 norm the averaged gradient is clipped to (code: 100)", low=0)

    def check(self, cfg: RunConfig) -> None:
        """Raises ConfigError: ``aggregation`` is not one of :data:`methods.blocks.prototypes.CLASS_AGGREGATIONS`,
        or ``dp.epsilon`` > 0: the upload is a gradient of the quiz and study examples that no DP mechanism here
        releases."""
        require_aggregation(cfg, CLASS_AGGREGATIONS)
        if dp_options(cfg).enabled:
            raise ConfigError(
                f"run config key 'dp.epsilon' > 0 with method '{cfg.method}': its upload, a gradient of the quiz loss "
                "through one step on study examples, has no DP release here; set 'dp.epsilon' = 0"
            )


@dataclass(frozen=True)
class FedL2GLogitOptions(FedL2GOptions):
    """``[tool.flwr.app.config.fedl2g-logit]``: as the feature variant, the authors' server step size for logits."""

    server_lr: float = option(0.1, "SGD step size of the server on the guiding vectors (authors' script)", low=0)


class FedL2GServer(MethodServer):
    """The guiding vectors G [C, D], drawn from N(0, 1) with the run's seed, and their SGD step."""

    checkpointed = ("guide",)
    #: the guided output: the representation (D = d); the logit variant sets "C"
    width = "d"

    def __init__(self, ctx: MethodContext) -> None:
        super().__init__(ctx)
        generator = torch.Generator().manual_seed(self.cfg.seed)
        rows = torch.randn(self.dims["C"], self.dims[self.width], generator=generator)
        self.guide: dict[str, np.ndarray] = {"guiding": rows.numpy()}

    def evaluates_after_training(self) -> bool:
        """The personal model with its own head is evaluated; G is not used at inference (§6)."""
        return True

    def global_arrays(self) -> dict[str, np.ndarray]:
        """``guiding`` float32 [C, D]."""
        return dict(self.guide)

    def aggregate_train(self, server_round: int, replies: list[ClientReply]) -> dict[str, float]:
        """G ← G − η_s·clip(mean_c), the per-class mean of the uploaded gradient rows under run config
        ``aggregation`` (zero for a class nobody sent), clipped to global norm ``server-clip-norm`` (§4).
        Row metrics: ``server-guide-grad-norm`` (before the clip) and what the aggregation reports."""
        num_classes, width = self.dims["C"], self.dims[self.width]
        mean, metrics = aggregate_class_sets(replies, "grads", "grad_labels", num_classes, width, self.cfg, {})
        gradient = np.zeros((num_classes, width), np.float64)
        if mean:
            gradient[mean["mask"]] = mean["grads"]
        norm = float(np.linalg.norm(gradient))
        if norm > self.options.server_clip_norm > 0:
            gradient *= self.options.server_clip_norm / norm
        step = self.guide["guiding"].astype(np.float64) - self.options.server_lr * gradient
        self.guide["guiding"] = step.astype(np.float32)
        return {**metrics, "server-guide-grad-norm": norm}


class FedL2GLogitServer(FedL2GServer):
    """The logit variant: G [C, C] guides the logits."""

    width = "C"


class FedL2GClient(ClientProcedure):
    """Local training pulled towards G (after the warm-up), then the quiz gradient of G."""

    #: True: the logits are guided (the logit variant)
    on_logits = False

    def query(self, client: ClientRuntime, payload: Arrays, config: dict[str, Any]) -> Reply:
        """The handshake, refusing a partition too small for a quiz set and a study batch.

        Raises:
            ConfigError: fewer than (``quiz-batches`` + ``study-batches``)·``batch-size`` training examples.
        """
        arrays, metrics = super().query(client, payload, config)
        needed = (self.options.quiz_batches + self.options.study_batches) * self.cfg.batch_size
        if metrics["num-train"] < needed:
            raise ConfigError(
                f"partition {client.partition_id} has {metrics['num-train']} training examples, fewer than the "
                f"{needed} a quiz set and a study batch take ('{self.cfg.method}.quiz-batches' + "
                f"'{self.cfg.method}.study-batches' times 'batch-size'): raise 'max-examples-per-client' or lower those"
            )
        return arrays, metrics

    def train(self, client: ClientRuntime, payload: Arrays, config: dict[str, Any]) -> Reply:
        """Returns ``grads`` float32 [m, D] and ``grad_labels`` int64 [m], the classes of the study batches."""
        data, device, opts = client.data, client.device, self.options
        guiding = torch.from_numpy(payload["guiding"]).to(device)
        size = int(config["batch-size"])
        quiz_n = opts.quiz_batches * size
        study = replace(data, train_x=data.train_x[quiz_n:], train_y=data.train_y[quiz_n:])
        server_round = int(config[SERVER_ROUND])
        if server_round > opts.warm_up_rounds:
            stats = train_personal_model(client, config, *self.guide_terms(guiding), data=study)
        else:  # warm-up: the guiding vectors learn from the untrained model (both codes)
            stats = {"num-examples": len(study.train_y), "train-seconds": 0.0}
        generator = client.generator(server_round, _META_RNG)

        def drawn(x: torch.Tensor, y: torch.Tensor, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
            # the first ``count`` full batches of a shuffled drop-last loader (HtFLlib's)
            idx = [b for b in batches(len(y), size, generator) if len(b) == size][:count]
            return [
                (augment(normalize(x[i], data.info), data.info, generator).to(device), y[i].to(device)) for i in idx
            ]

        study_batches = drawn(study.train_x, study.train_y, opts.study_batches)
        quiz_batches = drawn(data.train_x[:quiz_n], data.train_y[:quiz_n], opts.quiz_batches)
        gradient = quiz_gradient(
            client.model, guiding, study_batches, quiz_batches, float(config["lr"]), opts.guide_weight, self.on_logits
        )
        classes = torch.unique(torch.cat([y for _, y in study_batches]))
        upload = {"grads": gradient[classes].cpu().numpy(), "grad_labels": classes.cpu().numpy().astype(np.int64)}
        return upload, stats

    def guide_terms(self, guiding: torch.Tensor) -> tuple[Callable | None, Callable | None]:
        """``(regularizer, supervised_loss)`` for ``common.training.train_personal_model``: the squared-error
        pull (1/(B·D))·Σ‖r_b − g_{y_b}‖² weighted by ``guide-weight``, on the representation (feature variant,
        as a regularizer) or on the logits (logit variant, added to the cross-entropy)."""
        weight = self.options.guide_weight
        if self.on_logits:
            return (
                None,
                lambda x, features, logits, y: F.cross_entropy(logits, y) + weight * F.mse_loss(logits, guiding[y]),
            )
        return (lambda features, y: weight * F.mse_loss(features, guiding[y])), None


class FedL2GLogitClient(FedL2GClient):
    """The logit variant's client."""

    on_logits = True


def quiz_gradient(
    model: nn.Module,
    guiding: torch.Tensor,
    study: list[tuple[torch.Tensor, torch.Tensor]],
    quiz: list[tuple[torch.Tensor, torch.Tensor]],
    lr: float,
    weight: float,
    on_logits: bool,
) -> torch.Tensor:
    """∂L_q(θ'(G))/∂G with θ'(G) = θ − η·∇_θ L_study(θ; G) (docs/methods/fedl2g.md §3 (b); HtFLlib's
    ``clientL2G.meta_study`` through ``higher``): double backward through one differentiable SGD step.

    Args:
        model: the client's ``SplitModel`` (its parameters θ are read, never changed; BatchNorm runs on batch
            statistics, its running statistics untouched).
        guiding: G, float32 [C, D].
        study, quiz: (normalised images [B, C_in, H, W] float32, labels [B] int64) batches; L_study is the mean
            over the study batches of CE + ``weight``·MSE(r, G[y]), L_q the mean over the quiz batches of CE.
        lr: η, the virtual step's size (the client's ``lr``; no momentum, no clipping).
        weight: the guiding term's weight.
        on_logits: r is the logits (the logit variant), else the representation.

    Returns:
        float32 [C, D]: zero in the rows of classes absent from the study batches.
    """
    was_training = model.training
    model.train()
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    params = dict(model.named_parameters())
    buffers = {name: b.clone() for name, b in model.named_buffers()}  # the virtual passes leave them alone
    rows = guiding.detach().clone().requires_grad_(True)

    def outputs(state: dict[str, torch.Tensor], x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = functional_call(model.extractor, _within(state, "extractor."), (x,))
        return features, functional_call(model.head, _within(state, "head."), (features,))

    study_loss = 0.0
    for x, y in study:
        features, logits = outputs({**params, **buffers}, x)
        guided = logits if on_logits else features
        study_loss = study_loss + F.cross_entropy(logits, y) + weight * F.mse_loss(guided, rows[y])
    study_loss = study_loss / len(study)
    grads = torch.autograd.grad(study_loss, [params[n] for n in names], create_graph=True, allow_unused=True)
    stepped = {**params, **{n: params[n] - lr * g for n, g in zip(names, grads) if g is not None}}
    quiz_loss = sum(F.cross_entropy(outputs({**stepped, **buffers}, x)[1], y) for x, y in quiz) / len(quiz)
    (gradient,) = torch.autograd.grad(quiz_loss, rows, allow_unused=True)
    model.train(was_training)
    return torch.zeros_like(rows) if gradient is None else gradient.detach()


def _within(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The entries of ``state`` under ``prefix``, with the prefix removed (a submodule's own names)."""
    return {name[len(prefix) :]: value for name, value in state.items() if name.startswith(prefix)}


METHOD = Method("fedl2g-feat", FedL2GServer, FedL2GClient, fedl2g_schemas("d"), FedL2GOptions)
METHOD_LOGIT = Method("fedl2g-logit", FedL2GLogitServer, FedL2GLogitClient, fedl2g_schemas("C"), FedL2GLogitOptions)
