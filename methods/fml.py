"""FML: Federated Mutual Learning with a shared "meme" model.

Shen et al., "Federated Mutual Learning", 2020; a baseline of FedMRL and FedGH;
docs/methods/fml.md.

Payload: the meme model (``fml.shared-model``, default CNN-5: 670,058 float32 parameters,
2,680,232 B per direction on CIFAR-10), both ways; the private model never leaves.

Client step, on every augmented batch, both models (deep mutual learning, each treating the
other's prediction as a fixed target unless ``fml.detach-targets = false``, HtFLlib's; the KL is
per example unless ``fml.kl-reduction = "mean"``, HtFLlib's KL / C):
    L_private = α·CE(p_private, y) + (1−α)·KL(p_meme ‖ p_private)
    L_meme    = β·CE(p_meme, y)    + (1−β)·KL(p_private ‖ p_meme)
one SGD step on L_private + L_meme (the two parameter sets are disjoint, so this equals two
optimisers); gradient norms clipped per model at ``clip-norm``.
Server step: sample-weighted FedAvg of the meme models (HtFLlib: uniform), under run config
``aggregation`` (default ``norm-bound``: each upload's change bounded by the round's median;
``mean``: the paper's plain FedAvg; :mod:`engine.robust`).
Inference: the private model.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from common.config import RunConfig
from common.options import option
from common.protocol import Arrays, Reply
from common.runtime import ClientRuntime
from common.training import SupervisedLoss, kd_loss, train_personal_model
from engine.contract import Method
from methods.blocks.shared_model import (
    SHARED_LAYOUTS,
    SharedModelClient,
    SharedModelServer,
    WithCompanions,
    module_arrays,
    shared_module,
    shared_schemas,
)

#: ``fml.kl-reduction``: how each KL term is averaged (:func:`mutual_kl`)
KL_REDUCTIONS = ("batchmean", "mean")


@dataclass(frozen=True)
class FMLOptions:
    """``[tool.flwr.app.config.fml]``: the meme model and the two mutual-learning weights (HtFLlib's script)."""

    shared_model: str = option(
        "cnn5",
        "the meme model: CNN-1..5 (cnn5: heterogeneous setting, cnn1: homogeneous) | group-first: client 0's "
        "model of the run's model group (HtFLlib's)",
        choices=SHARED_LAYOUTS,
    )
    alpha: float = option(0.5, "private model: alpha*CE + (1-alpha)*KL(meme || private)", low=0, high=1)
    beta: float = option(0.5, "meme model: beta*CE + (1-beta)*KL(private || meme)", low=0, high=1)
    kl_reduction: str = option(
        "batchmean",
        "batchmean: KL per example, averaged over the batch (the paper's KL, ours) | mean: averaged over batch x "
        "classes, i.e. KL / C (HtFLlib's nn.KLDivLoss() default)",
        choices=KL_REDUCTIONS,
    )
    detach_targets: bool = option(
        True,
        "each KL term treats the other model's prediction as a fixed target (false: HtFLlib's, gradients flow "
        "into both models)",
    )


def mutual_kl(
    student_logits: torch.Tensor, target_logits: torch.Tensor, options: FMLOptions, per_example: bool = False
) -> torch.Tensor:
    """KL(softmax(target) ‖ softmax(student)) of one FML loss term (docs/methods/fml.md, client step).

    ``*_logits``: float [B, C]. ``kl-reduction = "mean"`` divides the per-example mean by C, which is
    what ``nn.KLDivLoss()`` (reduction ``mean``, over all B·C elements) gives in HtFLlib's
    ``clientfml.py``; ``detach-targets = false`` lets the gradient reach the target's model too.
    A scalar, or with ``per_example`` float [B], the terms whose mean it is.
    """
    target = target_logits.detach() if options.detach_targets else target_logits
    kl = kd_loss(student_logits, target, per_example=per_example)
    return kl / student_logits.shape[1] if options.kl_reduction == "mean" else kl


def meme_model(cfg: RunConfig, options: FMLOptions):
    """The shared meme model (``fml.shared-model``)."""
    return shared_module(cfg, options.shared_model, "fml.shared-model")


class FMLServer(SharedModelServer):
    """FML server: FedAvg of the meme model."""

    build_shared = staticmethod(meme_model)

    def training_companions(self, model: nn.Module) -> list[nn.Module]:
        """The meme model, trained with every client's private model (:meth:`FMLClient.local_training`)."""
        return [self.shared]


class FMLClient(SharedModelClient):
    """FML client: the private model and the received meme model learn from each other."""

    build_shared = staticmethod(meme_model)

    def local_training(self, client: ClientRuntime, meme: nn.Module) -> tuple[WithCompanions, SupervisedLoss]:
        """(the private model with ``meme`` as a companion, the mutual-learning loss of both) that local
        training optimises; the privacy evaluation's attack on the meme model's update simulates the same."""
        alpha, beta = self.options.alpha, self.options.beta

        def mutual_terms(x, features, logits, labels, per_example=False):
            meme_logits = meme(x)
            reduction = "none" if per_example else "mean"
            private = alpha * F.cross_entropy(logits, labels, reduction=reduction) + (1 - alpha) * mutual_kl(
                logits, meme_logits, self.options, per_example
            )
            shared = beta * F.cross_entropy(meme_logits, labels, reduction=reduction) + (1 - beta) * mutual_kl(
                meme_logits, logits, self.options, per_example
            )
            return private + shared

        def mutual_loss(x, features, logits, labels):
            return mutual_terms(x, features, logits, labels)

        # DP-SGD clips it by ghost clipping over these (common.training.private_training)
        mutual_loss.per_example = functools.partial(mutual_terms, per_example=True)
        return WithCompanions(client.model, meme=meme), mutual_loss

    def train(self, client: ClientRuntime, payload: Arrays, config: dict[str, Any]) -> Reply:
        """Returns the trained meme model's tensors and the private model's training metrics."""
        meme = self.received(client, payload)
        model, mutual_loss = self.local_training(client, meme)
        stats = train_personal_model(client, config, supervised_loss=mutual_loss, model=model, clip_groups=model.groups)
        return module_arrays(meme), stats


METHOD = Method("fml", FMLServer, FMLClient, shared_schemas(meme_model), FMLOptions)
