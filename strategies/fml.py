"""FML: Federated Mutual Learning with a shared "meme" model.

Shen et al., "Federated Mutual Learning", 2020; a baseline of FedMRL (spec
shared/specs/fedmrl.md, appendix "Baselines in brief").

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

import torch.nn.functional as F

from client_app.training import kd_loss, train_personal_model
from common.config import RunConfig, choice, number
from common.datasets import DATASETS
from models.cnn import CNN_SHAPES, REPRESENTATION_DIM, SmallCNN
from strategies.shared_model import SharedModelClient, SharedModelStrategy, WithCompanions, module_arrays


def shared_cnn(cfg: RunConfig) -> SmallCNN:
    """The shared model of FML/FedKD: ``<method>.shared-model`` (CNN-1..5, d = 500), default CNN-5
    (the heterogeneous setting; CNN-1 in the homogeneous one, spec fedmrl.md section 7).

    Raises:
        ConfigError: for another value of ``<method>.shared-model``.
    """
    info = DATASETS[cfg.dataset]
    name = choice(f"{cfg.method}.shared-model", cfg.method_options().get("shared-model", "cnn5"), tuple(CNN_SHAPES))
    return SmallCNN(name, REPRESENTATION_DIM, info.num_classes, info.channels, info.image_size)


def mutual_weights(cfg: RunConfig) -> tuple[float, float]:
    """(α, β) from ``fml.alpha`` / ``fml.beta`` (default 0.5 each, HtFLlib's script).

    Raises:
        ConfigError: a value outside [0, 1].
    """
    o = {"alpha": 0.5, "beta": 0.5, **cfg.method_options()}
    return number("fml.alpha", o["alpha"], low=0, high=1), number("fml.beta", o["beta"], low=0, high=1)


class FMLStrategy(SharedModelStrategy):
    """FML server: FedAvg of the meme model."""

    build_shared = staticmethod(shared_cnn)

    def __init__(self, cfg: RunConfig, results=None) -> None:
        mutual_weights(cfg)  # fail fast on bad client options
        super().__init__(cfg, results)


class FMLClient(SharedModelClient):
    """FML client: the private model and the received meme model learn from each other."""

    build_shared = staticmethod(shared_cnn)

    def train(self, client, payload, config):
        """Returns the trained meme model's tensors and the private model's training metrics."""
        alpha, beta = mutual_weights(self.cfg)
        meme = self.received(client, payload)
        model = WithCompanions(client.model, meme=meme)

        def mutual_loss(x, features, logits, labels):
            meme_logits = meme(x)
            private = alpha * F.cross_entropy(logits, labels) + (1 - alpha) * kd_loss(logits, meme_logits.detach())
            shared = beta * F.cross_entropy(meme_logits, labels) + (1 - beta) * kd_loss(meme_logits, logits.detach())
            return private + shared

        stats = train_personal_model(client, config, supervised_loss=mutual_loss, model=model, clip_groups=model.groups)
        return module_arrays(meme), stats
