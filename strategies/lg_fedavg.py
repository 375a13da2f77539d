"""LG-FedAvg: share the head, keep the feature extractor private.

Liang et al., "Think Locally, Act Globally: Federated Learning with Local and Global
Representations", 2020; a baseline of FedMRL and FedGH; docs/methods/lg-fedavg.md.

Payload: the head ``head.weight`` [C, d] and ``head.bias`` [C], float32, both ways:
4·C·(d+1) bytes per direction (20,040 B for CIFAR-10, d = 500). Every member of the model
group must have a linear head of the same d (true of CNN-1..5).
Client step: overwrite the local head with the global one, train the whole model with CE,
upload the head. Server step: sample-weighted FedAvg of the heads. The head starts from
PyTorch's default init drawn from ``seed``. Inference: the personal model.
"""

from __future__ import annotations

from torch import nn

from client_app.training import train_personal_model
from common.config import RunConfig
from common.datasets import DATASETS
from strategies.heads import require_linear_heads
from strategies.method import Method, NoOptions
from strategies.shared_model import SharedModelClient, SharedModelStrategy, load_arrays, module_arrays, shared_schemas


class LGFedAvgOptions(NoOptions):
    """LG-FedAvg has no keys of its own; its model group must have linear heads."""

    def check(self, cfg: RunConfig) -> None:
        """Raises ConfigError: the model group has a non-linear head (LG-FedAvg shares a linear one)."""
        require_linear_heads(cfg, "head")


def global_head(cfg: RunConfig, options: LGFedAvgOptions) -> nn.ModuleDict:
    """The shared head, keyed so its payload names are ``head.weight`` / ``head.bias``."""
    return nn.ModuleDict({"head": nn.Linear(cfg.representation_dim, DATASETS[cfg.dataset].num_classes)})


class LGFedAvgStrategy(SharedModelStrategy):
    """LG-FedAvg server: FedAvg of the heads."""

    build_shared = staticmethod(global_head)


class LGFedAvgClient(SharedModelClient):
    """LG-FedAvg client: global head in, whole model trained, head out."""

    def train(self, client, payload, config):
        """Returns the trained head's tensors and the training metrics."""
        head = nn.ModuleDict({"head": client.model.head})
        load_arrays(head, payload)
        stats = train_personal_model(client, config)
        return module_arrays(head), stats


METHOD = Method("lg-fedavg", LGFedAvgStrategy, LGFedAvgClient, shared_schemas(global_head), LGFedAvgOptions)
