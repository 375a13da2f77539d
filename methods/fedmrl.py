"""FedMRL: a shared small model fused with each private model through Matryoshka representations.

Yi et al., "Federated Model Heterogeneous Matryoshka Representation Learning", NeurIPS 2024;
docs/methods/fedmrl.md (section numbers below refer to it).

Payload (section 2): the small homogeneous model θ = G, its 10 tensors ``conv1.weight`` ...
``fc3.bias`` (CNN-5 layout with FC2 -> d1, float32), server -> client and back: 4·P_θ bytes
per direction (1,862,632 B for d1 = 100 on CIFAR-10). Never the private model, the projector
or any representation.

Client step (section 3, Eqs. 2-10): r = [G^ex(x), F_k^ex(x)] -> projector P_k -> z (d2, no
activation); loss = m_G·CE(G^hd(z[:, :d1]), y) + m_F·CE(F_k^hd(z), y); one SGD step updates
θ, ω_k and φ_k, each parameter set's gradient clipped separately. ω_k and φ_k persist in
client state; θ is replaced by the broadcast every round; optimisers are fresh every round.

Server step (section 4): sample-weighted FedAvg of the returned θ_k (:mod:`methods.blocks.shared_model`),
under run config ``aggregation`` (``mean``: the paper's; default ``norm-bound``, :mod:`engine.robust`).

Evaluation (section 6): the deployed model is "mix-large", F_k^hd(P_k(G^ex(x) ∘ F_k^ex(x)));
"mix-small" (G^hd on the first d1 coordinates) is reported alongside. Protocols:
``fedmrl.eval-protocol = "official"`` (A: sampled clients evaluate right after training with
their own θ_k^t; with run key ``eval-clients = "trained"`` only they are evaluated, as in
the authors' code) or ``"deployment"`` (B: every evaluated client uses the aggregated θ^t).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from common.config import ConfigError, RunConfig
from common.metrics import fraction
from common.options import number, option
from common.protocol import Arrays, Reply
from common.runtime import ClientRuntime
from common.training import SupervisedLoss, evaluate_model, evaluation_metrics, train_personal_model
from engine.contract import Method
from methods.blocks.shared_model import (
    GROUP_FIRST,
    SHARED_LAYOUTS,
    SharedModelClient,
    SharedModelServer,
    module_arrays,
    shared_module,
    shared_schemas,
)
from models.base import SplitModel
from models.cnn import SmallCNN
from models.groups import MODEL_GROUPS

EVAL_PROTOCOLS = ("official", "deployment")
INFERENCE = ("mix-large", "mix-small")
PROJECTOR_STATE = "projector"
#: the just-trained θ_k^t, kept for the evaluation in the same train reply (protocol A)
TRAINED_SMALL = "fedmrl-trained-small-model"


@dataclass(frozen=True)
class FedMRLOptions:
    """``[tool.flwr.app.config.fedmrl]`` (sections 6, 9, 11); ``eval-protocol``: see the module docstring."""

    d1: int = option(100, "the small model's representation size (<= the private model's d2); 200 anchors N=100", low=1)
    small_model: str = option(
        "cnn5",
        "the small model: a CNN layout, cnn5 (heterogeneous setting) | cnn1 (homogeneous) | group-first: client "
        "0's architecture of the run's model group with its representation pooled to d1 (HtFLlib's, P4)",
        choices=SHARED_LAYOUTS,
    )
    weight_global: float = option(1.0, "m_G: weight of the small model's header loss", low=0)
    weight_private: float = option(1.0, "m_F: weight of the private header loss", low=0)
    eval_protocol: str = option(
        "official",
        "official (A: sampled clients, their own trained small model) | deployment (B: the aggregated one)",
        choices=EVAL_PROTOCOLS,
    )
    inference: str = option(
        "mix-large", "primary metric: mix-large (the paper) | mix-small; the other is reported too", choices=INFERENCE
    )
    keep_projector: bool = option(
        True,
        "the trained projector persists between rounds (P3); false: HtFLlib's, which never saves it, so every round "
        "trains and evaluates with the initial projector",
    )

    def check(self, cfg: RunConfig) -> None:
        """Raises ConfigError: ``d1`` above the private models' representation size d2."""
        number("fedmrl.d1", self.d1, kind=int, low=1, high=cfg.representation_dim)
        fixed = MODEL_GROUPS[cfg.model_group].fixed_feature_dim
        if self.small_model == GROUP_FIRST and fixed not in (None, self.d1):
            raise ConfigError(
                f"fedmrl.small-model='group-first': model group {cfg.model_group!r} fixes the representation "
                f"size at {fixed}, so fedmrl.d1 must be {fixed}, not {self.d1}"
            )


def small_model(cfg: RunConfig, options: FedMRLOptions) -> SmallCNN | SplitModel:
    """G: the ``fedmrl.small-model`` with representation size d1 and header d1 -> L (section 7; P4)."""
    return shared_module(cfg, options.small_model, "fedmrl.small-model", options.d1)


class FusedExtractor(nn.Module):
    """x -> z = P_k(concat[G^ex(x), F_k^ex(x)]): ``[B, d2]`` float32, no activation (Eqs. 3-4, P9)."""

    def __init__(self, small: SmallCNN | SplitModel, private_extractor: nn.Module, projector: nn.Linear) -> None:
        super().__init__()
        self.small, self.private_extractor, self.projector = small, private_extractor, projector

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.projector(torch.cat([self.small.extractor(x), self.private_extractor(x)], dim=1))


class MatryoshkaModel(SplitModel):
    """The client's training/inference model: fused extractor + the private header.

    ``forward`` is mix-large (section 6). ``global_head`` is G^hd, fed the first d1 fused
    coordinates (the Matryoshka prefix, Eq. 5); :attr:`mix_small` is that path as a module.
    ``parameters()`` covers θ, ω_k and φ_k once each.
    """

    def __init__(self, small: SmallCNN | SplitModel, private: SplitModel, projector: nn.Linear) -> None:
        super().__init__(
            FusedExtractor(small, private.extractor, projector),
            private.feature_dim,
            private.num_classes,
            head=private.head,
        )
        self.global_head, self.d1 = small.head, small.feature_dim
        self.groups = [list(small.parameters()), list(private.parameters()), list(projector.parameters())]

    @property
    def mix_small(self) -> nn.Module:
        """x -> G^hd(z[:, :d1]): the "mix-small" inference model (Appendix C.3)."""
        return nn.Sequential(self.extractor, Prefix(self.d1), self.global_head)


class Prefix(nn.Module):
    """The first ``n`` coordinates of ``[B, m]``."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return z[:, : self.n]


def projector(cfg: RunConfig, d1: int) -> nn.Linear:
    """P_k = Linear(d1 + d2 -> d2) with bias, PyTorch's default init from ``seed`` (same for every client,
    as in the authors' code; section 5)."""
    d2 = cfg.representation_dim
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        return nn.Linear(d1 + d2, d2)


class FedMRLServer(SharedModelServer):
    """FedMRL server: holds θ (the small model) and averages the clients' θ_k (section 4)."""

    build_shared = staticmethod(small_model)

    def evaluates_after_training(self) -> bool:
        """Only with ``eval-protocol = "official"`` (the post-training models, as the authors' code)."""
        return self.options.eval_protocol == "official"

    def training_companions(self, model: nn.Module) -> list[nn.Module]:
        """The small model and the projector P_k, trained with the private ``model`` in the fused one
        (:meth:`FedMRLClient.local_training`)."""
        return [self.shared, projector(self.cfg, self.options.d1)]


class FedMRLClient(SharedModelClient):
    """FedMRL client: trains G, its private model and its projector together (section 3)."""

    build_shared = staticmethod(small_model)

    def fused(self, client, small: SmallCNN | SplitModel) -> MatryoshkaModel:
        """The client's :class:`MatryoshkaModel` for ``small``, with ω_k and φ_k restored from state."""
        proj = projector(self.cfg, self.options.d1)
        client.restore(PROJECTOR_STATE, proj)
        return MatryoshkaModel(small, client.model, proj.to(client.device))

    def local_training(
        self, client: ClientRuntime, small: SmallCNN | SplitModel
    ) -> tuple[MatryoshkaModel, SupervisedLoss]:
        """(the fused model of ``small``, the private model and the projector, its loss: m_g times the
        cross-entropy of the small model's head on the first d1 fused dimensions plus m_f times that of the
        fused head) that local training optimises (section 3, steps 2-6). The privacy evaluation's attack on
        the small model's update simulates the same."""
        model = self.fused(client, small)
        m_g, m_f = self.options.weight_global, self.options.weight_private

        def matryoshka_loss(x, z, logits, labels):
            return m_g * F.cross_entropy(model.global_head(z[:, : model.d1]), labels) + m_f * F.cross_entropy(
                logits, labels
            )

        return model, matryoshka_loss

    def train(self, client: ClientRuntime, payload: Arrays, config: dict[str, Any]) -> Reply:
        """Section 3 steps 1-7; returns θ_k^t (the 10 tensors of G) and the training metrics."""
        small = self.received(client, payload)
        model, matryoshka_loss = self.local_training(client, small)
        stats = train_personal_model(
            client, config, supervised_loss=matryoshka_loss, model=model, clip_groups=model.groups
        )
        if self.options.keep_projector:
            client.store(PROJECTOR_STATE, model.extractor.projector)
        client.scratch[TRAINED_SMALL] = small
        return module_arrays(small), stats

    def evaluate(self, client: ClientRuntime, payload: Arrays, config: dict[str, Any]) -> Reply:
        """Mix-large and mix-small accuracy with θ from ``payload`` (θ^t) or, without one, the θ_k^t
        this client just trained (protocol A). The ``fedmrl.inference`` one is the primary metric."""
        small = self.received(client, payload) if payload else client.scratch[TRAINED_SMALL]
        model = self.fused(client, small)
        data = client.data
        results = {
            name: evaluate_model(module, data.test_x, data.test_y, data.info, client.device)
            for name, module in (("mix-large", model), ("mix-small", model.mix_small))
        }
        correct, n, loss_sum = results[self.options.inference]
        other = INFERENCE[1 - INFERENCE.index(self.options.inference)]
        return {}, {**evaluation_metrics(correct, n, loss_sum), f"test-acc-{other}": results[other][0] / max(n, 1)}


# evaluate instructions carry θ^t: clients evaluated outside their train reply use it (protocol B)
METHOD = Method(
    "fedmrl",
    FedMRLServer,
    FedMRLClient,
    shared_schemas(small_model, evaluate_payload=True),
    FedMRLOptions,
    # the inference not chosen by fedmrl.inference, as a secondary metric
    metrics={
        "evaluate": {f"test-acc-{name}": fraction(f"test accuracy of the {name} inference") for name in INFERENCE}
    },
)
