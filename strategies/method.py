"""One descriptor per method: its name, its two halves, its payload schemas and its options, declared once.

Each method module ends with ``METHOD = Method(...)``; ``strategies.registry`` lists them. The
descriptor builds both halves (:meth:`Method.build_strategy`, :meth:`Method.build_client`) and hands
each the same :class:`MethodBinding` (validated options, payload schemas, declared metrics) for the
run config, whichever half is built first and in whichever process; the classes hold nothing that
is set from outside.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from common import dp, generalization
from common.config import RunConfig, read_options
from common.metrics import MetricSpec
from common.payload import Schemas
from common.protocol import MESSAGE_TYPES
from strategies import client_dp

if TYPE_CHECKING:  # for the annotations only: strategies.base imports this module
    from common.results import ResultsWriter
    from strategies.base import ClientProcedure, HeteroStrategy

#: the message types of a method whose schemas are computed from its config: the protocol's plain ones
DEFAULT_MESSAGE_TYPES = tuple(t for t in MESSAGE_TYPES if "." not in t)
#: the option tables every method shares (differential privacy of examples and of clients, held-out
#: clients), beside each method's own table
SHARED_OPTION_TABLES: dict[str, type] = {
    dp.TABLE: dp.DPOptions,
    client_dp.TABLE: client_dp.ClientDPOptions,
    generalization.TABLE: generalization.GeneralizationOptions,
}


@dataclass(frozen=True)
class NoOptions:
    """The options of a method without a table of its own: any ``<method>.*`` key is unknown."""


@dataclass(frozen=True)
class MethodBinding:
    """What both halves of a method are built with for one run config (:meth:`Method.bind`).

    Attributes:
        options: the method's validated options (its options dataclass; None for the bare base).
        schemas: message type -> (down, up) payload schemas.
        metrics: the scalar metrics its clients report beyond every method's, by message category.
    """

    options: Any
    schemas: Schemas
    metrics: Mapping[str, Mapping[str, MetricSpec]]


@dataclass(frozen=True)
class Method:
    """A method, declared once.

    Args:
        name: the run config value of ``method`` (and the name of its options table).
        strategy: the server half (a ``HeteroStrategy`` subclass).
        client: the client half (a ``ClientProcedure`` subclass).
        schemas: message type -> (down, up) payload schemas, or ``(cfg, options) -> schemas``
            for a method whose payload depends on its config (e.g. the shared model's layers).
        options: the frozen dataclass of ``common.options.option`` fields declaring every key of
            the method's table.
        metrics: the scalar metrics its clients report beyond every method's
            (``common.metrics``), by message category; a reply with any other key is dropped.
    """

    name: str
    strategy: type[HeteroStrategy]
    client: type[ClientProcedure]
    schemas: Schemas | Callable[[RunConfig, Any], Schemas]
    options: type = NoOptions
    metrics: Mapping[str, Mapping[str, MetricSpec]] = field(default_factory=dict)

    def read_options(self, cfg: RunConfig) -> Any:
        """This method's validated options from ``cfg`` (see :func:`common.config.read_options`).

        Raises:
            ConfigError: an unknown key of the method's table or a value outside its declaration.
        """
        return read_options(self.options, cfg, self.name)

    def schemas_for(self, cfg: RunConfig, options: Any) -> Schemas:
        """The message schemas of a run with ``cfg`` and the method's ``options``."""
        return self.schemas(cfg, options) if callable(self.schemas) else self.schemas

    def bind(self, cfg: RunConfig) -> MethodBinding:
        """Options, schemas and metrics of a run with ``cfg``.

        Raises:
            ConfigError: an unknown key of the method's table or a value outside its declaration.
        """
        options = self.read_options(cfg)
        return MethodBinding(options, self.schemas_for(cfg, options), self.metrics)

    def build_strategy(self, cfg: RunConfig, results: ResultsWriter | None = None) -> HeteroStrategy:
        """The server half for ``cfg`` (``results``: see ``HeteroStrategy``).

        Raises:
            ConfigError: as :meth:`bind`, the strategy's own checks, a ``dp.epsilon`` target no client
                can meet with this method's trainings and releases (``common.dp.check_reachable``), or
                client-level DP the run cannot give (``strategies.client_dp.check_run``).
        """
        binding = self.bind(cfg)
        dp.check_reachable(cfg, self.client.dp_trainings, self.client.dp_releases)
        client_dp.check_run(cfg, self.strategy)
        return self.strategy(cfg, binding, results)

    def build_client(self, cfg: RunConfig) -> ClientProcedure:
        """The client half for ``cfg``.

        Raises:
            ConfigError: as :meth:`bind`.
        """
        return self.client(cfg, self.bind(cfg))

    @property
    def message_types(self) -> tuple[str, ...]:
        """Every message type this method sends (the ClientApp registers a handler for each)."""
        return tuple(sorted(self.schemas)) if isinstance(self.schemas, dict) else DEFAULT_MESSAGE_TYPES
