"""The contract between the engine and the methods, written once: the server half, the client half and
the descriptor that binds them.

One descriptor per method: its name, its two halves, its payload schemas and its options, declared once.

Each method module ends with ``METHOD = Method(...)``; ``methods.registry`` lists them. The
descriptor hands both halves the same :class:`MethodBinding` (validated options, payload schemas,
declared metrics) for the run config (:meth:`Method.bind`; the runner is built by
``engine.runner.build_run``, the client half by :meth:`Method.build_client`), whichever half is built
first and in whichever process; the classes hold nothing that is set from outside.

Server (:class:`MethodServer`): Flower's four verbs, ``configure_train``, ``aggregate_train``,
``configure_evaluate`` and ``aggregate_evaluate``, with each client sent arrays of its own; two optional
protocols for the methods that need more: :class:`OwnRound` (a round that is not one exchange and one
aggregation) and :class:`PerClientServer` (state per client on the server). ``engine.runner.Runner``
drives it: handshake, sampling, exchanges, evaluation, rows, checkpoints.

Client (:class:`ClientProcedure`): one method per message type (``train``, ``evaluate``,
``query``, or ``train_<action>`` for ``train.<action>``), each taking the client runtime,
the validated payload and the config, and returning reply arrays and metrics.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
from flwr.app import ConfigRecord, MetricRecord

from common import dp, heldout
from common.config import RunConfig, read_options
from common.datasets import DATASETS
from common.dp import DPPlan, dp_options, make_plan
from common.metrics import MetricSpec
from common.payload import NO_PAYLOAD_SCHEMAS, ClientReply, Schemas
from common.protocol import MESSAGE_TYPES, Arrays, Reply, train_config
from common.runtime import ClientRuntime
from common.training import evaluate_model, evaluation_metrics
from engine import client_dp
from engine.checkpoint import load_server_state, server_state
from engine.evaluation import aggregate_evaluation
from engine.federation import Federation

#: the message types of a method whose schemas are computed from its config: the protocol's plain ones
DEFAULT_MESSAGE_TYPES = tuple(t for t in MESSAGE_TYPES if "." not in t)
#: the option tables every method shares (differential privacy of examples and of clients, held-out
#: clients), beside each method's own table
SHARED_OPTION_TABLES: dict[str, type] = {
    dp.TABLE: dp.DPOptions,
    client_dp.TABLE: client_dp.ClientDPOptions,
    heldout.TABLE: heldout.GeneralizationOptions,
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
        server: the server half (a ``MethodServer`` subclass).
        client: the client half (a ``ClientProcedure`` subclass).
        schemas: message type -> (down, up) payload schemas, or ``(cfg, options) -> schemas``
            for a method whose payload depends on its config (e.g. the shared model's layers).
        options: the frozen dataclass of ``common.options.option`` fields declaring every key of
            the method's table.
        metrics: the scalar metrics its clients report beyond every method's
            (``common.metrics``), by message category; a reply with any other key is dropped.
    """

    name: str
    server: type[MethodServer]
    client: type[ClientProcedure]
    schemas: Schemas | Callable[[RunConfig, Any], Schemas]
    options: type = NoOptions
    metrics: Mapping[str, Mapping[str, MetricSpec]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Refuse a server half that defines part of :class:`PerClientServer`: the runner would call none of it.

        Raises:
            TypeError: naming the method and the members it lacks.
        """
        defined = [h for h in PER_CLIENT_HOOKS if callable(getattr(self.server, h, None))]
        if defined and len(defined) < len(PER_CLIENT_HOOKS):
            missing = sorted(set(PER_CLIENT_HOOKS) - set(defined))
            raise TypeError(
                f"method '{self.name}': its server defines {defined} of PerClientServer but not {missing}: "
                "define all of them or none"
            )

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


#: the binding of the bare base classes: no options, no payload, no metrics of their own
NO_METHOD = MethodBinding(None, NO_PAYLOAD_SCHEMAS, {})


@dataclass(frozen=True)
class MethodContext:
    """What the server half of a method is built with, for one run (``engine.runner.Runner`` makes it).

    Attributes:
        cfg: the validated run config.
        binding: the method's validated options, payload schemas and declared reply metrics.
        rng: the run's seeded generator. It also samples the clients and is saved in every checkpoint:
            draw from it only in a round (MH-pFedHN's order of clients), never at construction.
        federation: the run's clients (``engine.federation.Federation``): what a method reads of them
            (``clients``, ``training_nodes``, ...) and, in a round of its own, ``sample`` and ``send``.
    """

    cfg: RunConfig
    binding: MethodBinding
    rng: np.random.Generator
    federation: Federation


class MethodServer:
    """The server half of a method: what each client is sent, what the server makes of the replies, and
    the state it keeps. The four verbs carry the names of Flower's ``flwr.serverapp.strategy.Strategy``
    (``configure_train``, ``aggregate_train``, ``configure_evaluate``, ``aggregate_evaluate``); their
    arguments differ because a model-heterogeneous method sends each client arrays of its own and
    evaluates clients' personal models, not one global ``ArrayRecord``. ``engine.runner.Runner`` drives
    it; a method never talks to the grid itself except in a round of its own (:class:`OwnRound`),
    through ``self.federation``.

    Args:
        ctx: the run config, the binding (``self.options``, ``self.schemas``, ``self.metrics``), the
            run's ``rng`` and the ``federation``.

    Class attributes:
        checkpointed: attributes holding the server state (modules, optimisers, torch Generators, dicts
            of arrays) saved in the per-round checkpoint; None: the method cannot resume yet; () stateless.
        client_dp_releases, client_dp_amplified: client-level DP applies (the upload is a model;
            ``engine.client_dp``): releases per round, and whether the sampling amplifies them.
    """

    checkpointed: tuple[str, ...] | None = None
    client_dp_releases: int = 0
    client_dp_amplified: bool = False

    def __init__(self, ctx: MethodContext) -> None:
        self.cfg = ctx.cfg
        self.options, self.schemas, self.metrics = ctx.binding.options, ctx.binding.schemas, ctx.binding.metrics
        #: :meth:`evaluates_after_training`, decided once from the options
        self.eval_after_training = self.evaluates_after_training()
        self.info = DATASETS[self.cfg.dataset]
        self.dims = {"C": self.info.num_classes, "d": self.cfg.representation_dim}
        self.rng = ctx.rng
        self.federation = ctx.federation

    def evaluates_after_training(self) -> bool:
        """True when the evaluated model is the client's post-training personal model and the evaluate
        instruction carries no payload (docs/methods/fedgh.md §6, Local): sampled clients then evaluate
        right after training and report in the train reply, which saves one round trip per round (in
        deployment, one ClientApp process per client); only clients not sampled get a separate evaluate
        message. False by default; asked once, with ``self.options`` set, kept as ``eval_after_training``."""
        return False

    def global_arrays(self) -> Arrays:
        """The server's current shared arrays (e.g. FedGH's header): the run's result and the default
        train payload; empty by default."""
        return {}

    def configure_train(self, node_id: int, server_round: int) -> Arrays:
        """Arrays sent to ``node_id`` with its train instruction (Flower: ``configure_train``). Default:
        :meth:`global_arrays`. Unless :func:`needs_query_first`, ``node_id`` may be a node the federation
        does not know yet (its first round with handshake ``sampled``)."""
        return self.global_arrays()

    def aggregate_train(self, server_round: int, replies: list[ClientReply]) -> dict[str, float]:
        """The server step on this round's valid train replies; returns its scalar metrics (row keys)
        (Flower: ``aggregate_train``; the new global arrays are read through :meth:`global_arrays`)."""
        return {}

    def configure_evaluate(self, node_id: int, server_round: int) -> Arrays:
        """Arrays sent with the evaluate instruction (Flower: ``configure_evaluate``); none by default
        (clients hold their models)."""
        return {}

    def aggregate_evaluate(
        self, server_round: int, replies: list[ClientReply], asked: Sequence[int]
    ) -> MetricRecord | None:
        """The round's accuracy from the valid evaluations (Flower: ``aggregate_evaluate``): by default the
        pooled accuracies of :func:`engine.evaluation.aggregate_evaluation`; ``asked``: the partition ids
        asked to evaluate."""
        return aggregate_evaluation(replies, asked)

    def personalize(self, nodes: list[int], step: int, scope: str, server_round: int) -> list[ClientReply]:
        """One personalisation round of held-out ``nodes`` in a generalisation phase after round
        ``server_round`` (``engine.heldout_phase``): by default the method's own train message with what a
        client sampled in the next round would receive (:meth:`configure_train` of round
        ``server_round + 1``), its reply not used by the server. ``step`` (1, 2, ...) is the message's
        round in the client's fresh state ``scope``. Returns the valid train replies (with their
        evaluation when ``eval_after_training``). Methods whose new clients get something else override
        it, leaving the server's state unchanged."""
        payloads = {n: self.configure_train(n, server_round + 1) for n in nodes}
        return self.federation.send("train", payloads, self.generalization_config(step), step, scope)

    def recording_dims(self, model: Any) -> dict[str, int]:
        """The payload symbols at their largest for a client holding ``model`` (a module on the meta
        device), for run config ``record-payloads``' disk estimate (``engine.runner.Runner.recording_estimate``):
        ``C``, ``d``, and ``k`` and ``a`` (the classes a client holds, or the server has prototypes of) at
        ``C``. A method whose payload grows with the client's model adds its symbols (MH-pFedHN's ``K``)."""
        return {**self.dims, "k": self.info.num_classes, "a": self.info.num_classes}

    def training_companions(self, model: Any) -> list[Any]:
        """The modules (on the meta device) a client holding ``model`` (its personal model, on the meta
        device) trains together with it, for ``record-payloads``' disk estimate: a client keeps them and its
        personal model as they were at the start of a recorded round (``common.protocol.start_snapshot_name``).
        Empty (the default) for a method whose client trains its personal model alone; FML's meme model,
        FedKD's mentee and alignment map, FedMRL's small model and projector."""
        return []

    def server_state(self) -> dict[str, Any] | None:
        """The state of the attributes in ``checkpointed`` (:func:`engine.checkpoint.server_state`)."""
        return server_state(self, self.checkpointed)

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`server_state` (a checkpoint's, or a round's that is rolled back)."""
        load_server_state(self, state)

    def train_config(self, server_round: int) -> ConfigRecord:
        """The training settings sent with every train instruction (:func:`common.protocol.train_config`);
        ``evaluate`` asks the client to evaluate after training in an evaluation round (see
        ``eval_after_training``)."""
        evaluate = self.eval_after_training and self.cfg.is_eval_round(server_round)
        return ConfigRecord(train_config(self.cfg, server_round, evaluate))

    def generalization_config(self, step: int) -> ConfigRecord:
        """The training settings of a held-out client's personalisation round ``step``: as
        :meth:`train_config`, evaluating right after training when ``eval_after_training``, never recorded."""
        config = self.train_config(step)
        config["evaluate"], config["record"] = self.eval_after_training, False
        return config


@runtime_checkable
class OwnRound(Protocol):
    """A method whose round is not one train exchange and one :meth:`MethodServer.aggregate_train`
    (FedRE's head trainer sent another message type, MH-pFedHN's hypernetwork stepped per reply): the
    runner calls its ``train_round`` instead, which samples and exchanges through ``self.federation``."""

    def train_round(self, server_round: int) -> tuple[dict[str, Any], list[ClientReply]]:
        """The round's train metrics (:func:`engine.round_rows.round_metrics` and the method's own) and
        its valid train replies."""


@runtime_checkable
class PerClientServer(Protocol):
    """A method that keeps state per client on the server (MH-pFedHN's embeddings and heads): it learns
    each client at the handshake, checks and sizes each reply by its sender, and serves held-out clients
    from a copy it sets up and drops. All of these are asked of a method only when it defines every one
    (``Method`` refuses a partial set)."""

    def joined(self) -> None:
        """Once the handshake knows every client, before a resume restores the server state."""

    def admitted(self, nodes: list[int]) -> None:
        """At a round boundary, with the nodes of partitions that joined after the handshake
        (``engine.roster.Roster.refresh``), before they are served."""

    def reply_dims(self, node_id: int) -> dict[str, int]:
        """Symbol values a reply from ``node_id`` is validated with: ``C``, ``d`` and that client's sizes
        (MH-pFedHN's K_i)."""

    def check_reply(self, message_type: str, metrics: Mapping[str, Any]) -> None:
        """The method's own checks of a reply's metrics before anything is used (a claimed model size);
        raises ``common.payload.PayloadError`` to drop the reply."""

    def begin_generalization(self, nodes: list[int], server_round: int) -> None:
        """Before a generalisation phase serves the held-out ``nodes`` after round ``server_round``."""

    def end_generalization(self) -> None:
        """After a generalisation phase, also when it failed."""


#: the members of :class:`PerClientServer`, all or none of which a method defines
PER_CLIENT_HOOKS = ("joined", "admitted", "reply_dims", "check_reply", "begin_generalization", "end_generalization")


class ClientProcedure:
    """Client half of a method. Subclasses implement ``train``; their method's descriptor builds them
    with the same :class:`engine.contract.MethodBinding` as the server half (``self.options``,
    ``self.schemas``; ``engine.contract.Method.build_client``).

    Handlers take ``(client, payload, config)``: the :class:`common.runtime.ClientRuntime`,
    the validated payload arrays (name -> ndarray) and the message's ConfigRecord as a dict;
    they return ``(arrays, metrics)``: the reply payload (must match the schema) and scalars.
    """

    #: with run config ``dp.epsilon`` > 0: local trainings per round (each DP-SGD) and payload releases
    #: per round computed from the examples themselves (each by ``common.dp.noisy_class_means``); what the
    #: client's noise multiplier is calibrated for (``common.dp.make_plan``)
    dp_trainings: int = 1
    dp_releases: int = 0

    def __init__(self, cfg: RunConfig, binding: MethodBinding) -> None:
        self.cfg = cfg
        self.options, self.schemas = binding.options, binding.schemas

    def dp_plan(self, client: ClientRuntime) -> DPPlan | None:
        """This client's calibrated DP mechanisms (None with DP off).

        Raises:
            ConfigError: the ``dp.*`` target cannot be met for this client (``common.dp.make_plan``).
        """
        if not dp_options(self.cfg).enabled:
            return None
        num_train, _ = client.data_sizes()
        return make_plan(self.cfg, num_train, client.spec.num_partitions, self.dp_trainings, self.dp_releases)

    def train(self, client: ClientRuntime, payload: Arrays, config: dict[str, Any]) -> Reply:
        raise NotImplementedError

    def evaluate(self, client: ClientRuntime, payload: Arrays, config: dict[str, Any]) -> Reply:
        """Accuracy of the client's personal model on its local test split."""
        data = client.data
        return {}, evaluation_metrics(*evaluate_model(client.model, data.test_x, data.test_y, data.info, client.device))

    def query(self, client: ClientRuntime, payload: Arrays, config: dict[str, Any]) -> Reply:
        """Handshake: data sizes (the runtime adds the partition id) of the partition, decoded, checked
        and cached here, so a partition that cannot be split or holds bad data fails at the handshake."""
        start = time.perf_counter()
        num_train, num_test = client.data_sizes()
        metrics = {
            "num-train": num_train,
            "num-test": num_test,
            "num-partitions": client.spec.num_partitions,
            "data-seconds": time.perf_counter() - start,
        }
        if client.dp is not None:
            metrics["dp-noise-multiplier"] = client.dp.noise_multiplier
            metrics["dp-release-noise-multiplier"] = client.dp.release_noise_multiplier
        return {}, metrics


def needs_query_first(server: type[MethodServer]) -> bool:
    """Whether a method's server half must know a client's handshake answer before its train message: it
    has a round of its own (:class:`OwnRound`: FedRE's head trainer is partition 0) or per-client state
    (:class:`PerClientServer`: MH-pFedHN's generated weights). With run config ``handshake = "sampled"`` such
    a method asks a drawn node it does not know yet a query first; any other sends the node its train
    message at once and the node answers the query in its train reply, one message instead of two
    (``engine.roster.Roster.answered``): what a Flower simulation engine costs grows with the messages sent
    (docs/running.md). Recording payloads and differential privacy keep the query first too: a download is
    recorded under its partition, a spent budget is known before the client is drawn again."""
    return issubclass(server, OwnRound) or issubclass(server, PerClientServer)
