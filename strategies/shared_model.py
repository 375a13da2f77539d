"""A shared module every client trains a copy of, averaged by the server (FedAvg).

The machinery of the methods whose payload is a whole homogeneous module: FedMRL's small
global model, FML's meme model, FedKD's mentee, LG-FedAvg's head. Each method module
subclasses :class:`SharedModelStrategy` with the module to share and keeps its own client
step; the server step, the payload schema, the byte accounting and the checkpoint are here.

Payload: the module's ``state_dict`` tensors by name, float32, in ``state_dict`` order, the
same keys and shapes both ways (4 bytes per parameter per direction).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

from common.config import ConfigError, RunConfig
from models.base import SplitModel
from strategies.base import BASE_SCHEMAS, ClientProcedure, ClientReply, HeteroStrategy
from strategies.payload import ArraySpec, PayloadError, PayloadSchema


def module_schema(module: nn.Module) -> PayloadSchema:
    """The payload schema of ``module``: every ``state_dict`` tensor, its exact shape, float32.

    Raises:
        ConfigError: if the module has non-float32 state (e.g. BatchNorm's int64 counter),
            which a FedAvg payload cannot carry.
    """
    state = module.state_dict()
    odd = [k for k, v in state.items() if v.dtype != torch.float32]
    if odd:
        raise ConfigError(f"shared module has non-float32 state {odd}: not averageable")
    return PayloadSchema({k: ArraySpec(tuple(v.shape), "float32") for k, v in state.items()})


def module_arrays(module: nn.Module) -> dict[str, np.ndarray]:
    """``module``'s state as payload arrays (float32 CPU copies, ``state_dict`` order)."""
    return {k: v.detach().cpu().numpy().copy() for k, v in module.state_dict().items()}


def load_arrays(module: nn.Module, arrays: Mapping[str, np.ndarray]) -> nn.Module:
    """Overwrite ``module`` with the payload ``arrays`` bit for bit (all keys required); returns it."""
    module.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in arrays.items()})
    return module


def fedavg(replies: list[ClientReply], keys: list[str]) -> dict[str, np.ndarray]:
    """Sample-weighted mean of the replies' arrays: Σ_k (n_k / Σ_j n_j) · θ_k (FedAvg; FedMRL spec section 4).

    Weights are the replies' ``num-examples`` (training samples), accumulated in float64.
    With all n_k = 0 the mean is unweighted.

    Returns:
        name -> float32 array, for every name in ``keys``.

    Raises:
        PayloadError: if ``replies`` is empty.
    """
    if not replies:
        raise PayloadError("no replies to average")
    weights = np.array([float(r.metrics.get("num-examples", 0)) for r in replies])
    weights = weights / weights.sum() if weights.sum() > 0 else np.full(len(replies), 1 / len(replies))
    return {
        k: sum(w * r.arrays[k].astype(np.float64) for w, r in zip(weights, replies)).astype(np.float32) for k in keys
    }


class SharedModelStrategy(HeteroStrategy):
    """Server of a method that shares one module: FedAvg of the clients' trained copies.

    Subclasses set ``build_shared`` (a ``staticmethod`` ``cfg -> nn.Module``, the same the
    client uses) and ``evaluate_payload`` (True: evaluate instructions carry the module).
    The module starts from PyTorch's default init drawn from ``seed`` (FedMRL spec
    section 5), before round 1, so a payload always exists. A round without valid replies
    leaves it unchanged.
    """

    evaluate_in_train = True
    evaluate_payload: bool = False
    checkpointed = ("shared",)

    @staticmethod
    def build_shared(cfg: RunConfig) -> nn.Module:
        """The module every client trains a copy of."""
        raise NotImplementedError

    def __init__(self, cfg: RunConfig, results=None) -> None:
        super().__init__(cfg, results)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            self.shared = self.build_shared(cfg)
        self.schemas = shared_schemas(self.shared, self.evaluate_payload)

    def global_arrays(self) -> dict[str, np.ndarray]:
        """The shared module's tensors (:func:`module_arrays`)."""
        return module_arrays(self.shared)

    def eval_payload(self, node_id: int, server_round: int) -> dict[str, np.ndarray]:
        """The shared module when ``evaluate_payload``, else nothing."""
        return self.global_arrays() if self.evaluate_payload else {}

    def server_update(self, server_round: int, replies: list[ClientReply]) -> dict[str, float]:
        """θ^t = :func:`fedavg` of the replies (unchanged without replies)."""
        if replies:
            load_arrays(self.shared, fedavg(replies, list(self.shared.state_dict())))
        return {"server-num-averaged": len(replies)}


class SharedModelClient(ClientProcedure):
    """Client half of a shared-module method: the schema and the received module.

    Subclasses set ``build_shared`` and ``evaluate_payload`` as their strategy does and
    implement ``train``.
    """

    evaluate_payload: bool = False
    build_shared = SharedModelStrategy.build_shared

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg)
        with torch.device("meta"):  # shapes only: no memory, no RNG draws
            self.schemas = shared_schemas(self.build_shared(cfg), self.evaluate_payload)

    def received(self, client, payload: Mapping[str, np.ndarray]) -> nn.Module:
        """A fresh copy of the shared module holding ``payload`` bit for bit, on the client's device."""
        with torch.device("meta"):
            module = self.build_shared(self.cfg)
        return load_arrays(module.to_empty(device=client.device), payload)


class WithCompanions(SplitModel):
    """The personal model plus modules trained alongside it in one optimiser (FML's meme model,
    FedKD's mentee and alignment map).

    ``extractor``/``head`` are the personal model's, so the training loop's representations
    and logits are the personal model's; ``groups`` lists each model's parameters for
    separate gradient clipping.
    """

    def __init__(self, private: SplitModel, **companions: nn.Module) -> None:
        super().__init__(private.extractor, private.feature_dim, private.num_classes, head=private.head)
        for name, module in companions.items():
            self.add_module(name, module)
        self.groups = [list(private.parameters())] + [list(m.parameters()) for m in companions.values()]


def shared_schemas(module: nn.Module, evaluate_payload: bool = False) -> dict:
    """Message schemas of a shared-module method: the module both ways in ``train``; with
    ``evaluate_payload`` the evaluate instruction carries it too."""
    schema = module_schema(module)
    schemas = {**BASE_SCHEMAS, "train": (schema, schema)}
    if evaluate_payload:
        schemas["evaluate"] = (schema, BASE_SCHEMAS["evaluate"][1])
    return schemas
