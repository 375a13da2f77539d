"""FML: Federated Mutual Learning with a shared "meme" model.

Shen et al., "Federated Mutual Learning", 2020; a baseline of FedMRL and FedGH;
docs/methods/fml.md.

Payload: the meme model (``fml.shared-model``, default CNN-5: 670,058 float32 parameters,
2,680,232 B per direction on CIFAR-10), both ways; the private model never leaves.

Client step, on every augmented batch, both models (deep mutual learning, each treating the
other's prediction as a fixed target, which HtFLlib does not detach):
    L_private = α·CE(p_private, y) + (1−α)·KL(p_meme ‖ p_private)
    L_meme    = β·CE(p_meme, y)    + (1−β)·KL(p_private ‖ p_meme)
one SGD step on L_private + L_meme (the two parameter sets are disjoint, so this equals two
optimisers); gradient norms clipped per model at ``clip-norm``.
Server step: sample-weighted FedAvg of the meme models (HtFLlib: uniform).
Inference: the private model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.nn.functional as F

from common.config import RunConfig
from common.options import option
from common.runtime import ClientRuntime
from common.training import kd_loss, train_personal_model
from models.cnn import CNN_SHAPES
from strategies.base import Arrays, Reply
from strategies.method import Method
from strategies.shared_model import (
    SharedModelClient,
    SharedModelStrategy,
    WithCompanions,
    module_arrays,
    shared_cnn,
    shared_schemas,
)


@dataclass(frozen=True)
class FMLOptions:
    """``[tool.flwr.app.config.fml]``: the meme model and the two mutual-learning weights (HtFLlib's script)."""

    shared_model: str = option(
        "cnn5", "the meme model: CNN-1..5 (cnn5: heterogeneous setting, cnn1: homogeneous)", choices=tuple(CNN_SHAPES)
    )
    alpha: float = option(0.5, "private model: alpha*CE + (1-alpha)*KL(meme || private)", low=0, high=1)
    beta: float = option(0.5, "meme model: beta*CE + (1-beta)*KL(private || meme)", low=0, high=1)


def meme_model(cfg: RunConfig, options: FMLOptions):
    """The shared meme model (``fml.shared-model``)."""
    return shared_cnn(cfg, options.shared_model)


class FMLStrategy(SharedModelStrategy):
    """FML server: FedAvg of the meme model."""

    build_shared = staticmethod(meme_model)


class FMLClient(SharedModelClient):
    """FML client: the private model and the received meme model learn from each other."""

    build_shared = staticmethod(meme_model)

    def train(self, client: ClientRuntime, payload: Arrays, config: dict[str, Any]) -> Reply:
        """Returns the trained meme model's tensors and the private model's training metrics."""
        alpha, beta = self.options.alpha, self.options.beta
        meme = self.received(client, payload)
        model = WithCompanions(client.model, meme=meme)

        def mutual_loss(x, features, logits, labels):
            meme_logits = meme(x)
            private = alpha * F.cross_entropy(logits, labels) + (1 - alpha) * kd_loss(logits, meme_logits.detach())
            shared = beta * F.cross_entropy(meme_logits, labels) + (1 - beta) * kd_loss(meme_logits, logits.detach())
            return private + shared

        stats = train_personal_model(client, config, supervised_loss=mutual_loss, model=model, clip_groups=model.groups)
        return module_arrays(meme), stats


METHOD = Method("fml", FMLStrategy, FMLClient, shared_schemas(meme_model), FMLOptions)
