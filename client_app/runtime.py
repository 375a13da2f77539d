"""Per-message client runtime: config, data, the personal model and its persistence, device.

Only ``context.state`` survives between rounds for a client, in simulation and deployment
alike; module globals are shared between virtual clients (simulation) or reset every message
(deployment), so they hold read-only caches only (the decoded data, the parsed config).
"""

from __future__ import annotations

from functools import cached_property, lru_cache

import torch
from flwr.app import ArrayRecord, Context
from torch import nn

from client_app.data import ClientData, DataSpec, load_client_data
from common.config import ConfigError, RunConfig
from models.base import SplitModel
from models.groups import MODEL_GROUPS

MODEL_STATE = "model"


@lru_cache(maxsize=8)
def _parse(items: tuple) -> RunConfig:
    return RunConfig.from_dict(dict(items))


def parse_run_config(run_config) -> RunConfig:
    """The validated :class:`RunConfig` of a Flower ``run_config`` (parsed once per process)."""
    return _parse(tuple(sorted(run_config.items())))


def pick_device(name: str) -> torch.device:
    """``auto``: the GPU when one is visible (granted to this ClientApp), else the CPU.

    Raises:
        ConfigError: for ``cuda`` when no GPU is visible.
    """
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("run config key 'device' = 'cuda' but no GPU is visible to this ClientApp; "
                          "allowed values are 'auto', 'cpu', 'cuda' (in simulation grant GPUs with "
                          "client-resources-num-gpus > 0)")
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda")


class ClientRuntime:
    """What a client procedure needs for one message.

    Node config keys: ``partition-id`` (required), ``num-partitions`` (default: run config
    ``num-clients``), ``data-dir`` (optional, overrides the run config's ``data-dir``).
    """

    def __init__(self, context: Context) -> None:
        self.context = context
        self.cfg = parse_run_config(context.run_config)
        node = context.node_config
        if "partition-id" not in node:
            raise ConfigError("node config lacks 'partition-id' (flower-supernode --node-config "
                              "\"partition-id=0 num-partitions=N\")")
        self.partition_id = int(node["partition-id"])
        self.spec = DataSpec.from_config(self.cfg, int(node.get("num-partitions", self.cfg.num_clients)),
                                         node.get("data-dir"))
        self.device = pick_device(self.cfg.device)
        #: objects the handlers of this one message share (e.g. FedMRL's just-trained small model
        #: for the evaluation in the same train reply); gone with the message
        self.scratch: dict[str, object] = {}

    @cached_property
    def data(self) -> ClientData:
        """This client's decoded partition (cached per process)."""
        return load_client_data(self.spec, self.partition_id)

    @cached_property
    def model(self) -> SplitModel:
        """The personal model: built from the model group and seed, restored from state, on device."""
        info = self.data.info
        model = MODEL_GROUPS[self.cfg.model_group].build(self.partition_id, info.num_classes, info.channels,
                                                         info.image_size, self.cfg.seed, self.cfg.feature_dim)
        self.restore(MODEL_STATE, model)
        return model.to(self.device)

    def restore(self, name: str, module: nn.Module) -> bool:
        """Load ``module`` from ``context.state[name]`` if present; True when it was."""
        if name not in self.context.state.array_records:
            return False
        module.load_state_dict(self.context.state.array_records[name].to_torch_state_dict())
        return True

    def store(self, name: str, module: nn.Module) -> None:
        """Save ``module``'s state dict into ``context.state[name]`` (survives rounds)."""
        self.context.state[name] = ArrayRecord(module.state_dict())

    def save_model(self) -> None:
        """Persist the personal model."""
        self.store(MODEL_STATE, self.model)

    def generator(self, server_round: int, purpose: int = 0) -> torch.Generator:
        """A CPU RNG seeded by (seed, partition, round, purpose): same draws in every process."""
        seed = ((self.cfg.seed * 1_000_003 + self.partition_id) * 10_007 + server_round) * 31 + purpose
        return torch.Generator().manual_seed(seed)
