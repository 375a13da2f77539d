"""Method name -> (server Strategy class, client procedure class)."""

from __future__ import annotations

from functools import lru_cache

from common.config import ConfigError, RunConfig
from strategies.base import ClientProcedure, HeteroStrategy
from strategies.fd import FDClient, FDStrategy
from strategies.fedgh import FedGHClient, FedGHStrategy
from strategies.fedkd import FedKDClient, FedKDStrategy
from strategies.fedmrl import FedMRLClient, FedMRLStrategy
from strategies.fedproto import FedProtoClient, FedProtoStrategy
from strategies.fedre import FedREClient, FedREStrategy
from strategies.fedtgp import FedTGPClient, FedTGPStrategy
from strategies.fml import FMLClient, FMLStrategy
from strategies.lg_fedavg import LGFedAvgClient, LGFedAvgStrategy
from strategies.local import LocalClient, LocalStrategy
from strategies.mh_pfedhn import MHpFedHNClient, MHpFedHNGDClient, MHpFedHNGDStrategy, MHpFedHNStrategy

METHODS: dict[str, tuple[type[HeteroStrategy], type[ClientProcedure]]] = {
    "fedgh": (FedGHStrategy, FedGHClient),
    "local": (LocalStrategy, LocalClient),
    "fedproto": (FedProtoStrategy, FedProtoClient),
    "fedtgp": (FedTGPStrategy, FedTGPClient),
    "fedre": (FedREStrategy, FedREClient),
    "mh-pfedhn": (MHpFedHNStrategy, MHpFedHNClient),
    "mh-pfedhngd": (MHpFedHNGDStrategy, MHpFedHNGDClient),
    "fedmrl": (FedMRLStrategy, FedMRLClient),
    "fml": (FMLStrategy, FMLClient),
    "fedkd": (FedKDStrategy, FedKDClient),
    "lg-fedavg": (LGFedAvgStrategy, LGFedAvgClient),
    "fd": (FDStrategy, FDClient),
}


def _method(cfg: RunConfig) -> tuple[type[HeteroStrategy], type[ClientProcedure]]:
    if cfg.method not in METHODS:
        raise ConfigError(
            f"run config key 'method' = {cfg.method!r} is invalid: allowed values are "
            + ", ".join(repr(m) for m in METHODS)
        )
    return METHODS[cfg.method]


def build_strategy(cfg: RunConfig, results=None) -> HeteroStrategy:
    """The method's Strategy for ``cfg`` (validates the method name and its options).

    Raises:
        ConfigError: unknown method or an invalid method option.
    """
    return _method(cfg)[0](cfg, results)


@lru_cache(maxsize=8)
def client_procedure(cfg: RunConfig) -> ClientProcedure:
    """The method's client procedure for ``cfg`` (one per config and process)."""
    return _method(cfg)[1](cfg)


def all_message_types() -> list[str]:
    """Every message type some method sends: the ClientApp registers a handler for each."""
    return sorted({t for strategy, client in METHODS.values() for t in (*strategy.schemas, *client.schemas)})
