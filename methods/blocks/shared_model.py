"""A shared module every client trains a copy of, averaged by the server (FedAvg, or a robust
rule: run config ``aggregation``, :mod:`engine.robust`).

The machinery of the methods whose payload is a whole homogeneous module: FedMRL's small
global model, FML's meme model, FedKD's mentee, LG-FedAvg's head. Each method module
subclasses :class:`SharedModelServer` with the module to share and keeps its own client
step; the server step, the payload schema, the byte accounting and the checkpoint are here.

Payload: the module's ``state_dict`` tensors by name, float32, in ``state_dict`` order, the
same keys and shapes both ways (4 bytes per parameter per direction).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from common.config import ConfigError, RunConfig
from common.datasets import DATASETS
from common.payload import BASE_SCHEMAS, ArraySpec, ClientReply, PayloadSchema, Schemas
from engine import client_dp
from engine.contract import ClientProcedure, MethodContext, MethodServer
from engine.robust import RobustAggregator
from models.base import SplitModel
from models.cnn import CNN_SHAPES, REPRESENTATION_DIM, SmallCNN
from models.groups import MODEL_GROUPS

#: ``build_shared(cfg, options)``: the module every client of a run trains a copy of
Builder = Callable[[RunConfig, Any], nn.Module]


def non_float32_state(module: nn.Module) -> list[str]:
    """The ``state_dict`` keys of ``module`` that are not float32 (e.g. BatchNorm's int64
    ``num_batches_tracked``): state a FedAvg payload cannot carry."""
    return [k for k, v in module.state_dict().items() if v.dtype != torch.float32]


def module_schema(module: nn.Module) -> PayloadSchema:
    """The payload schema of ``module``: every ``state_dict`` tensor, its exact shape, float32.

    Raises:
        ConfigError: if the module has non-float32 state (:func:`non_float32_state`).
    """
    state = module.state_dict()
    odd = non_float32_state(module)
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


#: a shared-module layout: client 0's architecture in the run's model group, as HtFLlib builds the
#: shared model of FML, FedKD and FedMRL when its model family names no global model
GROUP_FIRST = "group-first"
#: the choices of ``fml.shared-model``, ``fedkd.shared-model`` and ``fedmrl.small-model``
SHARED_LAYOUTS = (*CNN_SHAPES, GROUP_FIRST)


def shared_module(cfg: RunConfig, layout: str, key: str, d: int | None = None) -> SmallCNN | SplitModel:
    """The shared module of ``layout`` (one of :data:`SHARED_LAYOUTS`, the value of option ``key``)
    for ``cfg``'s dataset.

    A CNN-1..5 layout gives a :class:`SmallCNN` with representation size ``d`` (default 500);
    :data:`GROUP_FIRST` gives client 0's model of ``cfg.model_group`` with feature dim ``d``
    (default: the group's own), initialised from ``seed`` (HtFLlib's ``BaseHeadSplit(args, 0,
    feature_dim)``; a group that fixes its representation size keeps it). Both expose
    ``extractor`` (images -> ``[B, d]`` float32), ``head`` and ``feature_dim``.

    Raises:
        KeyError: an unknown layout.
        ConfigError: :data:`GROUP_FIRST` over a group whose client 0 has non-float32 state
            (BatchNorm, e.g. ``htfe3``'s ResNet-10), naming ``key``.
    """
    info = DATASETS[cfg.dataset]
    if layout == GROUP_FIRST:
        group = MODEL_GROUPS[cfg.model_group]
        k = cfg.feature_dim if d is None else d
        module = group.build(0, info.num_classes, info.channels, info.image_size, cfg.seed, k=k, identical=True)
        odd = non_float32_state(module)
        if odd:
            raise ConfigError(
                f"{key}={GROUP_FIRST!r}: client 0's model of model group {cfg.model_group!r} has non-float32 state "
                f"{odd} (BatchNorm's counters), which the averaged payload cannot carry; choose one of "
                f"{list(CNN_SHAPES)} or a model group without BatchNorm at client 0"
            )
        return module
    return SmallCNN(layout, d or REPRESENTATION_DIM, info.num_classes, info.channels, info.image_size)


class SharedModelServer(MethodServer):
    """Server of a method that shares one module: the run's ``aggregation`` of the clients' trained
    copies (:class:`engine.robust.RobustAggregator`; ``mean`` is the papers' FedAvg).

    Subclasses set ``build_shared`` (a ``staticmethod`` ``(cfg, options) -> nn.Module``, which
    their client half uses too). Evaluate instructions carry the module when the method's
    schemas say so (``shared_schemas(..., evaluate_payload=True)``).
    The module starts from PyTorch's default init drawn from ``seed`` (docs/methods/fedmrl.md
    §5), before round 1, so a payload always exists. A round without valid replies
    leaves it unchanged, except under client-level DP (run config ``client-dp.epsilon``), whose
    noisy mean of clipped updates replaces ``aggregation`` and is released every round
    (:class:`engine.client_dp.ClientDPAggregator`).

    Raises:
        ConfigError: also an ``aggregation`` the sampled clients cannot satisfy
            (:func:`engine.robust.check_aggregation`).
    """

    checkpointed = ("shared",)
    #: the upload is a model: client-level DP applies, one Gaussian mechanism per sampled client and round,
    #: hidden in the round's sum, so the sampling amplifies it (``engine.client_dp``)
    client_dp_releases = 1
    client_dp_amplified = True

    def evaluates_after_training(self) -> bool:
        """Yes by default: each client's personal model after training is what is evaluated."""
        return True

    @staticmethod
    def build_shared(cfg: RunConfig, options: Any) -> nn.Module:
        """The module every client trains a copy of."""
        raise NotImplementedError

    def __init__(self, ctx: MethodContext) -> None:
        super().__init__(ctx)
        self.aggregator = RobustAggregator(self.cfg)
        self.client_dp = client_dp.attach(self)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.cfg.seed)
            self.shared = self.build_shared(self.cfg, self.options)

    def global_arrays(self) -> dict[str, np.ndarray]:
        """The shared module's tensors (:func:`module_arrays`)."""
        return module_arrays(self.shared)

    def configure_evaluate(self, node_id: int, server_round: int) -> dict[str, np.ndarray]:
        """The shared module when the evaluate schema carries it, else nothing."""
        return self.global_arrays() if self.schemas["evaluate"][0].arrays else {}

    def aggregate_train(self, server_round: int, replies: list[ClientReply]) -> dict[str, float]:
        """θ^t = the run's ``aggregation`` of the replies against θ^{t-1}, the module they trained
        from (``mean``: :func:`engine.aggregation.fedavg`); unchanged when none trained on an
        example. Metrics: ``server-num-averaged`` and the aggregator's (e.g. ``server-bounded``)."""
        averaged, metrics = self.aggregate(self.global_arrays(), replies, server_round)
        if averaged is not None:
            load_arrays(self.shared, averaged)
        return {"server-num-averaged": len(replies), **metrics}

    def aggregate(
        self, reference: dict[str, np.ndarray], replies: list[ClientReply], server_round: int
    ) -> tuple[dict[str, np.ndarray] | None, dict[str, float]]:
        """The replies' modules combined against ``reference``, the module they trained from: client-level
        DP's noisy mean of clipped updates when ``client-dp.epsilon`` > 0, else the run's ``aggregation``.

        Returns:
            (name -> float32 array, or None to keep the module; the round's metrics).
        """
        if self.client_dp is not None:
            return self.client_dp.replies(reference, replies, server_round)
        return self.aggregator.replies(reference, replies)


class SharedModelClient(ClientProcedure):
    """Client half of a shared-module method: the received module. Subclasses set ``build_shared``
    to the builder their server half uses and implement ``train``.
    """

    @staticmethod
    def build_shared(cfg: RunConfig, options: Any) -> nn.Module:
        """The module the method's server half shares."""
        raise NotImplementedError

    def received(self, client, payload: Mapping[str, np.ndarray]) -> nn.Module:
        """A fresh copy of the shared module holding ``payload`` bit for bit, on the client's device."""
        with torch.device("meta"):
            module = self.build_shared(self.cfg, self.options)
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


def shared_schemas(build_shared: Builder, evaluate_payload: bool = False) -> Callable[[RunConfig, Any], Schemas]:
    """The ``schemas`` of a shared-module method's descriptor: the module ``build_shared`` gives
    (built on the meta device: shapes only, no memory, no RNG draws) both ways in ``train``;
    with ``evaluate_payload`` the evaluate instruction carries it too."""

    def schemas(cfg: RunConfig, options: Any) -> Schemas:
        with torch.device("meta"):
            schema = module_schema(build_shared(cfg, options))
        out = {**BASE_SCHEMAS, "train": (schema, schema)}
        if evaluate_payload:
            out["evaluate"] = (schema, BASE_SCHEMAS["evaluate"][1])
        return out

    return schemas
