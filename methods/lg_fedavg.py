"""LG-FedAvg: share the head, keep the feature extractor private.

Liang et al., "Think Locally, Act Globally: Federated Learning with Local and Global
Representations", 2020; a baseline of FedMRL and FedGH; docs/methods/lg-fedavg.md.

Payload: the head ``head.weight`` [C, d] and ``head.bias`` [C], float32, both ways:
4·C·(d+1) bytes per direction (20,040 B for CIFAR-10, d = 500); evaluate: nothing, unless
``lg-fedavg.eval-global-head`` sends the averaged head for the secondary metric (evaluation
traffic). Every member of the model group must have a linear head of the same d (true of CNN-1..5).
Client step: overwrite the local head with the global one, train the whole model with CE,
upload the head. Server step: sample-weighted FedAvg of the heads, under run config ``aggregation``
(``mean``: the paper's; default ``norm-bound``, :mod:`engine.robust`). The head starts from
PyTorch's default init drawn from ``seed``. Inference: the personal model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from common.config import RunConfig
from common.options import option
from common.protocol import Arrays, Reply
from common.runtime import ClientRuntime
from common.training import train_personal_model
from engine.contract import Method
from methods.blocks.heads import GLOBAL_HEAD_METRICS, add_global_head_accuracy, require_linear_heads, shared_head
from methods.blocks.shared_model import (
    SharedModelClient,
    SharedModelServer,
    load_arrays,
    module_arrays,
    shared_schemas,
)


@dataclass(frozen=True)
class LGFedAvgOptions:
    """``[tool.flwr.app.config.lg-fedavg]``: the secondary metric; the model group must have linear heads."""

    eval_global_head: bool = option(
        False, "also report accuracy with the current global head (HtFLlib's metric: every client, after the broadcast)"
    )

    def check(self, cfg: RunConfig) -> None:
        """Raises ConfigError: the model group has a non-linear head (LG-FedAvg shares a linear one)."""
        require_linear_heads(cfg, "head")


def schemas(cfg: RunConfig, options: LGFedAvgOptions) -> dict:
    """The head both ways in ``train``; with ``eval-global-head`` the evaluate instruction carries it too."""
    return shared_schemas(shared_head, evaluate_payload=options.eval_global_head)(cfg, options)


class LGFedAvgServer(SharedModelServer):
    """LG-FedAvg server: FedAvg of the heads."""

    build_shared = staticmethod(shared_head)

    def evaluates_after_training(self) -> bool:
        """Not with ``eval-global-head``: the secondary metric needs the head *after* this round's average."""
        return not self.options.eval_global_head


class LGFedAvgClient(SharedModelClient):
    """LG-FedAvg client: global head in, whole model trained, head out."""

    build_shared = staticmethod(shared_head)

    def train(self, client: ClientRuntime, payload: Arrays, config: dict[str, Any]) -> Reply:
        """Returns the trained head's tensors and the training metrics."""
        head = nn.ModuleDict({"head": client.model.head})
        load_arrays(head, payload)
        stats = train_personal_model(client, config)
        return module_arrays(head), stats

    def evaluate(self, client: ClientRuntime, payload: Arrays, config: dict[str, Any]) -> Reply:
        """Personal model accuracy; with the global head in the payload also ``test-acc-global-head``."""
        return add_global_head_accuracy(super().evaluate(client, payload, config), client, payload)


METHOD = Method(
    "lg-fedavg",
    LGFedAvgServer,
    LGFedAvgClient,
    schemas,
    LGFedAvgOptions,
    metrics=GLOBAL_HEAD_METRICS,
)
