"""A linear head exchanged as a payload: FedGH's global header, FedRE's global classifier, LG-FedAvg's
shared head.

Payload ``head.weight`` [C, d] and ``head.bias`` [C], float32: 4*C*(d+1) bytes.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from common.config import ConfigError, RunConfig
from common.datasets import DATASETS
from common.metrics import fraction
from common.payload import ArraySpec, PayloadSchema
from common.training import evaluate_model

HEADER = PayloadSchema({"head.weight": ArraySpec(("C", "d"), "float32"), "head.bias": ArraySpec(("C",), "float32")})


def require_linear_heads(cfg: RunConfig, payload: str) -> None:
    """Methods that exchange a linear head need a model group whose heads are all linear.

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


def shared_head(cfg: RunConfig, options=None) -> nn.ModuleDict:
    """The linear head ``Linear(d, C)`` a shared-model method exchanges (LG-FedAvg's, FedGen's; a
    ``build_shared`` of :mod:`methods.blocks.shared_model`), keyed so its payload names are ``head.weight``
    [C, d] and ``head.bias`` [C]; PyTorch's default init."""
    return nn.ModuleDict({"head": nn.Linear(cfg.representation_dim, DATASETS[cfg.dataset].num_classes)})


def initial_header(d: int, num_classes: int, seed: int) -> nn.Linear:
    """A server's global head ``Linear(d, C)`` with PyTorch's default init drawn from ``seed``
    (FedGH and FedRE start from it), without touching the global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Linear(d, num_classes)


def header_arrays(head: nn.Linear) -> dict[str, np.ndarray]:
    """A head as the payload ``head.weight`` [C, d] and ``head.bias`` [C], float32 copies."""
    return {"head.weight": head.weight.detach().numpy().copy(), "head.bias": head.bias.detach().numpy().copy()}


def load_header(head: nn.Linear, payload: dict[str, np.ndarray]) -> None:
    """Overwrite ``head`` with the received header, bit for bit."""
    with torch.no_grad():
        head.weight.copy_(torch.from_numpy(payload["head.weight"]))
        head.bias.copy_(torch.from_numpy(payload["head.bias"]))


def global_head_accuracy(client, payload: dict[str, np.ndarray]) -> float:
    """Test accuracy (a fraction) of the client's extractor with the linear head in ``payload``
    (``head.weight`` [C, d], ``head.bias`` [C], float32), its own head untouched: the model HtFLlib
    evaluates for FedGH and LG-FedAvg (every client right after the server's head is broadcast)."""
    model, data = client.model, client.data
    head = nn.Linear(model.feature_dim, model.num_classes)
    load_header(head, payload)
    correct, n, _ = evaluate_model(
        nn.Sequential(model.extractor, head.to(client.device)), data.test_x, data.test_y, data.info, client.device
    )
    return correct / max(n, 1)


#: the secondary metric of a method whose evaluate instruction may carry the global head
GLOBAL_HEAD_METRICS = {
    "evaluate": {"test-acc-global-head": fraction("test accuracy of the extractor with the global head")}
}


def add_global_head_accuracy(result: tuple[dict, dict], client, payload: dict[str, np.ndarray]) -> tuple[dict, dict]:
    """``result`` (an evaluate handler's ``(arrays, metrics)``) with ``test-acc-global-head``
    (:func:`global_head_accuracy`) added when ``payload`` carries a head."""
    arrays, metrics = result
    if payload:
        metrics["test-acc-global-head"] = global_head_accuracy(client, payload)
    return arrays, metrics
