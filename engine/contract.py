"""The contract between the engine and the methods, written once: the server half, the client half and
the descriptor that binds them.

One descriptor per method: its name, its two halves, its payload schemas and its options, declared once.

Each method module ends with ``METHOD = Method(...)``; ``methods.registry`` lists them. The
descriptor builds both halves (:meth:`Method.build_strategy`, :meth:`Method.build_client`) and hands
each the same :class:`MethodBinding` (validated options, payload schemas, declared metrics) for the
run config, whichever half is built first and in whichever process; the classes hold nothing that
is set from outside.

Server (:class:`MethodServer`, the method's hooks and one round loop over Flower's Grid):

- a ``query`` handshake with every node as it connects learns its partition id, data sizes and
  the federation's size N (``num-clients``, or the nodes' ``num-partitions`` when that is 0);
  node ids are random, so sampling and ordering by partition id make runs reproducible and
  methods comparable on the same clients (``engine.roster.Roster``);
- ``max(1, floor(fraction-train * N))`` clients are sampled per round with a seeded RNG;
- one message per client carries only that client's payload (:meth:`MethodServer.configure_train`
  may differ per client); the transport sends, receives, counts payload bytes per message
  category and checks every reply against the method's schema, dropping bad ones with a log
  line, so one broken client never stops a round (``engine.transport.Transport``);
- :meth:`MethodServer.train_round` is one exchange + :meth:`MethodServer.aggregate_train` by
  default; methods with sequential server updates or two exchanges per round override it;
- every client's personal model is evaluated every ``eval-every`` rounds (and the last), one
  results row per round is written as it goes (``engine.round_rows``), and a checkpoint after
  every round lets a run resume (``engine.checkpoint.Checkpoints``).

Client (:class:`ClientProcedure`): one method per message type (``train``, ``evaluate``,
``query``, or ``train_<action>`` for ``train.<action>``), each taking the client runtime,
the validated payload and the config, and returning reply arrays and metrics.

Life of a round (docs/architecture.md walks it step by step; a test keeps every hop real):

1. `engine/contract.py::MethodServer.run_round`: the loop's round; refreshes the roster
   (`engine/roster.py::Roster.refresh`) and calls the method's hook;
2. `engine/contract.py::MethodServer.train_round` (the hook): samples
   (`engine/roster.py::Roster.sample`), builds one train message per client
   (`engine/transport.py::Transport.message`, settings from `common/protocol.py::train_config`),
   exchanges them (`engine/transport.py::Transport.exchange`), keeps the valid replies
   (`engine/transport.py::Transport.validate`) and calls the method's
   `engine/contract.py::MethodServer.aggregate_train`;
3. on each client `client_app/handlers.py::handle_message` restores its state
   (`common/runtime.py::ClientRuntime`) and runs the method's `engine/contract.py::ClientProcedure.train`;
4. `engine/contract.py::MethodServer.evaluate_round` with `engine/evaluation.py::evaluate_clients`:
   the round's accuracy;
5. the row (`engine/round_rows.py::round_row`, `common/run_folder.py::ResultsWriter.write_round`) and the
   checkpoint (`common/run_folder.py::ResultsWriter.write_checkpoint`).
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import ConfigRecord, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result

from common import dp, heldout
from common.config import AUTO_SAMPLED_CLIENTS, RunConfig, read_options
from common.datasets import DATASETS
from common.dp import DPPlan, dp_options, make_plan
from common.errors import ConfigError, RunFailed
from common.metrics import MetricSpec
from common.options import declared_defaults
from common.payload import NO_PAYLOAD_SCHEMAS, ClientReply, Schemas, array_record
from common.protocol import HANDSHAKE, MESSAGE_TYPES, SERVER_ROUND, Arrays, Reply, metric_values, train_config
from common.runtime import ClientRuntime
from common.training import evaluate_model, evaluation_metrics
from engine import client_dp
from engine.checkpoint import Checkpoints, broken_state, load_server_state, server_state
from engine.evaluation import evaluate_clients, evaluations_in
from engine.heldout_phase import phase_due, run_phase
from engine.payload_recorder import PayloadRecorder
from engine.roster import Roster
from engine.round_rows import (
    RoundCounters,
    patience_exhausted,
    progress_line,
    round_metrics,
    round_row,
    untrained_error,
    untrained_streak,
)
from engine.transport import ReplyRules, Transport

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
        strategy: the server half (a ``MethodServer`` subclass).
        client: the client half (a ``ClientProcedure`` subclass).
        schemas: message type -> (down, up) payload schemas, or ``(cfg, options) -> schemas``
            for a method whose payload depends on its config (e.g. the shared model's layers).
        options: the frozen dataclass of ``common.options.option`` fields declaring every key of
            the method's table.
        metrics: the scalar metrics its clients report beyond every method's
            (``common.metrics``), by message category; a reply with any other key is dropped.
    """

    name: str
    strategy: type[MethodServer]
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

    def build_strategy(self, cfg: RunConfig, results: ResultsWriter | None = None) -> MethodServer:
        """The server half for ``cfg`` (``results``: see ``MethodServer``).

        Raises:
            ConfigError: as :meth:`bind`, the strategy's own checks, a ``dp.epsilon`` target no client
                can meet with this method's trainings and releases (``common.dp.check_reachable``), or
                client-level DP the run cannot give (``engine.client_dp.check_run``).
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


if TYPE_CHECKING:  # for the annotations only
    from common.run_folder import ResultsWriter

log = logging.getLogger("flwr." + __name__)  # streamed with Flower's own log

#: the folder of a run folder that holds its clients' state when no state-dir is set (simulation)
CLIENT_STATE = "client-state"

#: bytes a recorded file takes beyond its arrays in :meth:`MethodServer.recording_estimate`: a file
#: system block (4 KiB on ext4, XFS and Btrfs), which also covers an upload's metrics file
RECORD_FILE_OVERHEAD = 4096
#: bytes an array takes beyond its data in a recorded file: the ``.npy`` header and zip entry of an
#: ``.npz`` member (about 250), or a tensor's entry in ``torch.save``'s zip archive
RECORD_ARRAY_OVERHEAD = 512
#: the binding of the bare base classes: no options, no payload, no metrics of their own
NO_METHOD = MethodBinding(None, NO_PAYLOAD_SCHEMAS, {})


class MethodServer:
    """The server half of every method: the method's hooks and one round loop (:meth:`start`).

    It is not a Flower ``Strategy``: Flower's strategy API exchanges one global ``ArrayRecord`` and
    one config with every sampled client, while a model-heterogeneous method sends each client its
    own payload, evaluates clients' personal models and may exchange several times per round. It
    drives Flower's ``Grid`` (Message API) itself, through collaborators with explicit inputs:

    - ``counters``: :class:`engine.round_rows.RoundCounters` (bytes, dropped replies, the round's work);
    - ``roster``: :class:`engine.roster.Roster` (handshake, node refresh, sampling);
    - ``transport``: :class:`engine.transport.Transport` (messages, exchange, reply checks by
      this method's :class:`engine.transport.ReplyRules`: its schemas, metrics and hooks);
    - ``checkpoints``: :class:`engine.checkpoint.Checkpoints` (resume, per-round checkpoint).

    Args:
        cfg: the validated run config.
        binding: the method's options, schemas and metrics for ``cfg`` (``self.options``,
            ``self.schemas``, ``self.metrics``); :data:`NO_METHOD` for the bare base.
        results: receives one row per round and the summary (see ``common.run_folder``);
            None keeps rows in memory only (``self.rows``).

    Raises:
        ConfigError: an invalid option of the method's table.

    Hooks (all optional): :meth:`global_arrays`, :meth:`configure_train`, :meth:`configure_evaluate`,
    :meth:`aggregate_train`, :meth:`reply_dims`, :meth:`check_reply`, :meth:`joined`, :meth:`train_round`,
    :meth:`evaluates_after_training`.
    """

    #: attributes holding the server state (modules, optimisers, torch Generators, dicts of
    #: arrays) saved in the per-round checkpoint; None: the method cannot resume yet; () stateless
    checkpointed: tuple[str, ...] | None = None

    def __init__(self, cfg: RunConfig, binding: MethodBinding, results: Any | None = None) -> None:
        self.cfg = cfg
        self.options, self.schemas, self.metrics = binding.options, binding.schemas, binding.metrics
        #: :meth:`evaluates_after_training`, decided once from the options, before the transport that checks
        #: replies against it exists
        self.eval_after_training = self.evaluates_after_training()
        self.info = DATASETS[cfg.dataset]
        self.dp = dp_options(cfg)  # a DP run that cannot give its guarantee fails here, before any message
        self.dims = {"C": self.info.num_classes, "d": cfg.representation_dim}
        self.rng = np.random.default_rng(cfg.seed)
        self.results = results
        self.counters = RoundCounters()
        query_in_train = not (needs_query_first(type(self)) or self.dp.enabled or cfg.record_payloads.strip())
        self.roster = Roster(cfg, self.counters, self.rng, query_in_train)
        recorder = PayloadRecorder(cfg, None if results is None else results.path)
        rules = ReplyRules(self.schemas, self.metrics, self.eval_after_training, self.check_reply, self.reply_dims)
        self.transport = Transport(cfg, rules, self.roster.clients, self.counters, recorder)
        defaults = declared_defaults(RunConfig)
        for table, options in SHARED_OPTION_TABLES.items():
            defaults.update(declared_defaults(options, table))
        if self.options is not None:  # None: the bare base (NO_METHOD)
            defaults.update(declared_defaults(type(self.options), cfg.method))
        self.checkpoints = Checkpoints(cfg, results, defaults)
        self.rows: list[dict[str, Any]] = []
        self.phases = 0  # generalisation phases run by this process (engine.heldout_phase)

    # ------------------------------------------------------------------ hooks
    def evaluates_after_training(self) -> bool:
        """Hook: True when the evaluated model is the client's post-training personal model and the
        evaluate instruction carries no payload (docs/methods/fedgh.md §6, Local): sampled clients then
        evaluate right after training and report in the train reply, which saves one round trip per round
        (in deployment, one ClientApp process per client); only clients not sampled get a separate
        evaluate message. False by default; called once in ``__init__`` with ``self.options`` set, kept as
        ``eval_after_training``."""
        return False

    def global_arrays(self) -> Arrays:
        """The server's current shared arrays (e.g. FedGH's header); empty by default."""
        return {}

    def configure_train(self, node_id: int, server_round: int) -> Arrays:
        """Arrays sent to ``node_id`` with its train instruction. Default: :meth:`global_arrays`. Unless
        :func:`needs_query_first`, ``node_id`` may be a node the roster does not know yet (its first round with
        handshake ``sampled``)."""
        return self.global_arrays()

    def configure_evaluate(self, node_id: int, server_round: int) -> Arrays:
        """Arrays sent with the evaluate instruction; none by default (clients hold their models)."""
        return {}

    def aggregate_train(self, server_round: int, replies: list[ClientReply]) -> dict[str, float]:
        """The method's server step on this round's valid train replies; returns scalar metrics."""
        return {}

    def reply_dims(self, node_id: int) -> dict[str, int]:
        """Symbol values a reply from ``node_id`` is validated with: ``C``, ``d`` and, in
        methods whose payload size differs per client, that client's sizes (e.g. MH-pFedHN's K_i)."""
        return self.dims

    def check_reply(self, message_type: str, metrics: Mapping[str, Any]) -> None:
        """The method's own checks of a reply's metrics before anything is used (e.g. a claimed
        model size); raise PayloadError to drop the reply. None by default."""

    def joined(self) -> None:
        """Called once the handshake knows every client, before a resume restores the server state
        (e.g. MH-pFedHN registers each client's embedding). Nothing by default."""

    def admitted(self, nodes: list[int]) -> None:
        """Called at a round boundary with the nodes of partitions that joined after the handshake
        (``engine.roster.Roster.refresh``), before they are served. Nothing by default."""

    def begin_generalization(self, nodes: list[int], server_round: int) -> None:
        """Called before a generalisation phase serves the held-out ``nodes`` after round
        ``server_round`` (``engine.heldout_phase``). Nothing by default."""

    def end_generalization(self) -> None:
        """Called after a generalisation phase, also when it failed. Nothing by default."""

    def personalize(self, nodes: list[int], step: int, scope: str, server_round: int) -> list[ClientReply]:
        """One personalisation round of held-out ``nodes`` in a generalisation phase after round
        ``server_round``: by default the method's own train message with what a client sampled in the
        next round would receive (:meth:`configure_train` of round ``server_round + 1``), its reply not
        used by the server. ``step`` (1, 2, ...) is the message's round in the client's fresh state
        ``scope``. Returns the valid train replies (with their evaluation when
        ``eval_after_training``). Methods whose new clients get something else override it, leaving
        the server's state unchanged."""
        config = self.generalization_config(step)
        messages = [
            self.transport.message("train", n, self.configure_train(n, server_round + 1), config, step, scope)
            for n in nodes
        ]
        return self.transport.validate("train", self.transport.exchange(messages))

    def train_round(self, server_round: int) -> tuple[dict[str, Any], list[ClientReply]]:
        """The method's hook for a round's training (:meth:`run_round`, the loop's round, calls it): by
        default one train exchange with the sampled clients, then :meth:`aggregate_train`.

        Methods with sequential server updates or several exchanges per round override it, using
        ``self.roster.sample()`` and ``self.transport`` (``message``, ``exchange``, ``validate``).

        Returns:
            the round's train metrics (:func:`engine.round_rows.round_metrics` and the method's
            own) and its valid train replies (whose ``eval-`` metrics, if any, are evaluations).
        """
        config = self.train_config(server_round)
        # a node not known yet (handshake "sampled") answers the handshake's query in its train reply
        handshake = ConfigRecord({**dict(config), HANDSHAKE: True})
        pending = set(self.roster.pending)
        messages = [
            self.transport.message(
                "train", n, self.configure_train(n, server_round), handshake if n in pending else config, server_round
            )
            for n in self.roster.sample()
        ]
        wait = self.roster.exchange_timeout() if pending else ()  # (seconds, run config key) for new nodes
        replies = self.roster.answered(self.transport, self.transport.exchange(messages, *wait))
        valid = self.transport.validate("train", replies)
        start = time.perf_counter()
        server = self.aggregate_train(server_round, valid)
        return round_metrics(valid, server, time.perf_counter() - start), valid

    # ------------------------------------------------------------------ the run
    def start(self, grid: Grid, window: Callable[[], int] | None = None, state_in_run_folder: bool = False) -> Result:
        """Run the whole federation on ``grid``: handshake, rounds, evaluation, results.

        Args:
            grid: Flower's grid of the run.
            window: in a simulation, the most messages of one exchange that wait at once
                (``Transport.window``); None: all at once.
            state_in_run_folder: clients without any ``state-dir`` keep their state in the run
                folder (``<run>/client-state``) instead of ``context.state`` (a simulation, whose
                clients share the server's file system and whose ``context.state`` lives in one
                process for every client).

        Returns:
            Flower's ``Result``: each round's train and evaluation metrics and the final global arrays.

        Raises:
            RuntimeError, ConfigError: from the handshake (not all clients answer within
                ``connect-timeout`` seconds, or the nodes do not fit the run config), a
                ``record-payloads`` above ``record-payloads-max-gib`` for the clients that answered
                (:meth:`check_recording`), or a ``resume-from`` checkpoint that does not fit the run.
        """
        self.checkpoints.check_summary()  # a resume the config refuses is refused before any node is asked
        state_key = self.checkpoints.state_key()
        client_state_dir = ""
        if state_in_run_folder and not self.cfg.state_dir and self.results is not None:
            # the folder of the run that started the clients' state: a resumed run finds it again
            client_state_dir = str(Path(self.results.path).parent / state_key / CLIENT_STATE)
        self.transport.open(grid, state_key, client_state_dir, window=window)
        self.roster.handshake(self.transport)
        if line := self.check_recording(self.roster.size):  # tools.run checked it before the launch
            log.info(line)
        if self.results is not None:
            self.results.num_clients = self.roster.size
            self.results.held_out_partitions = self.roster.held_out_partitions
        self.joined()
        self.log_settings()
        first = self.resume() + 1
        result = Result()
        run_start = time.perf_counter()
        for server_round in range(first, self.cfg.num_server_rounds + 1):
            if self.rows and self.rows[-1].get("stop_reason"):  # stop-patience ran out (maybe before a resume)
                break
            train_metrics, eval_metrics = self.run_round(server_round, run_start)
            result.train_metrics_clientapp[server_round] = MetricRecord(metric_values(train_metrics))
            if eval_metrics is not None:
                result.evaluate_metrics_clientapp[server_round] = eval_metrics
        # a resumed run with no round left to play ends on its restored rows: they must have trained too
        self.check_trained(last_round=True)
        result.arrays = array_record(self.global_arrays())
        if self.results is not None:
            self.results.finish()
        return result

    def run_round(self, server_round: int, run_start: float) -> tuple[dict[str, Any], MetricRecord | None]:
        """One round of the loop (not a method hook): refresh the nodes, :meth:`train_round` (its server
        update undone if it left the server state non-finite or exploded: ``checkpoint.broken_state``),
        :meth:`evaluate_round`, then the round's row (with the ``stop-patience`` verdict) and
        checkpoint written. ``run_start``: :func:`time.perf_counter` at the loop's start. Returns the
        round's train metrics and evaluation."""
        before = self.counters.traffic.copy()
        t0 = time.perf_counter()
        self.counters.begin_round()
        admitted = self.roster.refresh(self.transport)
        if admitted:
            self.admitted(admitted)
        before_state = copy.deepcopy(self.server_state())
        train_metrics, replies = self.train_round(server_round)
        if self.dp.enabled:
            train_metrics["dp-exhausted"] = self.roster.exhaust(replies)
        broken = None if before_state is None else broken_state(before_state, self.server_state())
        if broken:
            # the server would send a broken state to every client from now on: undo this round's update
            self.load_state(before_state)
            train_metrics["server-rolled-back"] = 1
            log.warning("Round %d: the server update made the server state %s; rolled back", server_round, broken)
        t1 = time.perf_counter()
        eval_metrics = self.evaluate_round(server_round, evaluations_in(replies))
        t2 = time.perf_counter()
        row = round_row(
            server_round,
            train_metrics,
            eval_metrics,
            self.counters.traffic - before,
            self.counters,
            t1 - t0,
            t2 - t1,
            time.perf_counter() - run_start,
        )
        stop = patience_exhausted([*self.rows, row], self.cfg.stop_patience, self.cfg.stop_metric)
        last = server_round == self.cfg.num_server_rounds
        if self.dp.enabled and not last and len(row["dp_exhausted"]) == self.roster.trainers:
            stop = "every client's privacy budget (dp.epsilon) is spent"
        if stop:
            row["stop_reason"] = stop
        if phase_due(self, server_round, last or bool(stop)):
            row.update(run_phase(self, server_round))
        self.rows.append(row)
        if self.results is not None:
            self.results.write_round(row)
            state = self.checkpoints.build(
                server_round, self.transport.state_key, self.rng, self.counters, self.rows, self.server_state()
            )
            self.results.write_checkpoint(state)
        log.info(progress_line(row, self.cfg.num_server_rounds))
        if stop:
            log.info("Stopping after round %d: %s", server_round, stop)
        self.check_trained(last_round=bool(stop) or server_round == self.cfg.num_server_rounds)
        return train_metrics, eval_metrics

    def check_trained(self, last_round: bool = False) -> None:
        """Fail the run once ``max-untrained-rounds`` rounds in a row had no valid training reply, or
        when the run ends on such rounds (``last_round``): its result would be an earlier round's.

        Raises:
            RunFailed: naming the rounds, the key and the clients' distinct errors.
        """
        streak = untrained_streak(self.rows)
        if not streak or (len(streak) < self.cfg.max_untrained_rounds and not last_round):
            return
        limit = self.cfg.max_untrained_rounds if len(streak) >= self.cfg.max_untrained_rounds else None
        errors = [e for row in streak for e in row.get("client_errors", [])]
        raise RunFailed(untrained_error(streak, limit), list(dict.fromkeys(errors)))

    def evaluate_round(self, server_round: int, evaluated: list[ClientReply]) -> MetricRecord | None:
        """The round's evaluation (None when it is no evaluation round): one evaluate message to
        every client to evaluate (``eval-clients``: all known clients, or this round's sampled
        ones) that is connected and not among ``evaluated`` (evaluations carried by train replies),
        aggregated over both by :func:`engine.evaluation.evaluate_clients`, which names the
        connected clients asked that gave no valid evaluation (row key ``eval_missing``)."""
        if not self.is_eval_round(server_round):
            return None
        targets = self.roster.training_nodes if self.cfg.eval_clients == "all" else self.roster.sampled
        asked = [node for node in targets if node in self.roster.connected]
        config = ConfigRecord({SERVER_ROUND: server_round})
        return evaluate_clients(
            self.transport,
            asked,
            evaluated,
            lambda node: self.configure_evaluate(node, server_round),
            config,
            server_round,
        )

    def resume(self) -> int:
        """Restore the ``resume-from`` checkpoint (RNG, counters, rows, server state; the rows and the
        checkpoint are written again into this run's folder); returns its last round (0 without one).

        Raises:
            ConfigError: as ``Checkpoints.load``, or the checkpoint has more rounds than
                ``num-server-rounds``.
        """
        state = self.checkpoints.load()
        if state is None:
            return 0
        if state["round"] > self.cfg.num_server_rounds:
            # the rows cannot be undone: a summary would report more rounds than were asked for
            raise ConfigError(
                f"run config key 'resume-from' = {self.cfg.resume_from!r} has {state['round']} completed rounds, "
                f"more than 'num-server-rounds' = {self.cfg.num_server_rounds}: ask for at least {state['round']} "
                "rounds (that many: nothing more is run)"
            )
        self.rng.bit_generator.state = state["rng"]
        self.counters.traffic.update(state["traffic"])
        self.counters.dropped.update(state["dropped"])
        self.rows = list(state["rows"])
        if self.rows:
            self.roster.exhaust_partitions(self.rows[-1].get("dp_exhausted", []))
        if self.results is not None:
            for row in self.rows:
                self.results.write_round(row)
            self.results.keep_checkpoint(self.cfg.resume_from)
        self.load_state(state["server"])
        log.info("Resumed from %s after round %d", self.cfg.resume_from, state["round"])
        return int(state["round"])

    def server_state(self) -> dict[str, Any] | None:
        """The state of the attributes in ``checkpointed`` (:func:`engine.checkpoint.server_state`)."""
        return server_state(self, self.checkpointed)

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`server_state` (a checkpoint's, or a round's that is rolled back)."""
        load_server_state(self, state)

    def recording_dims(self, model: Any) -> dict[str, int]:
        """Hook: the payload symbols at their largest for a client holding ``model`` (a module on the
        meta device), for :meth:`recording_estimate`: ``C``, ``d``, and ``k`` and ``a`` (the classes a
        client holds, or the server has prototypes of) at ``C``. A method whose payload grows with the
        client's model adds its symbols (MH-pFedHN's ``K``)."""
        return {**self.dims, "k": self.info.num_classes, "a": self.info.num_classes}

    def recording_estimate(self, num_clients: int) -> int:
        """Bytes run config ``record-payloads`` writes at most in a run of ``num_clients`` clients: per
        client and recorded round, the download and the upload of every message type at their largest
        (the payload schemas under :meth:`recording_dims`: ``.npz`` files hold their tensor bytes) and
        the client's copy of its personal model (its state dict), plus :data:`RECORD_FILE_OVERHEAD`
        per file and :data:`RECORD_ARRAY_OVERHEAD` per array, times the recorded rounds (0 when none
        is). Each architecture of the model group is built once, on the meta device (nothing is
        allocated)."""
        import torch

        from models.groups import MODEL_GROUPS

        rounds = self.cfg.recorded_rounds
        count = self.cfg.num_server_rounds if rounds is None else len(rounds)
        group, info = MODEL_GROUPS[self.cfg.model_group], self.info
        period = len(group.architectures) * len(group.heads)  # client p holds member p mod period
        total = 0
        for member in range(min(period, num_clients) if count else 0):
            with torch.device("meta"):
                model = group.build(member, info.num_classes, info.channels, info.image_size, 0, self.cfg.feature_dim)
            dims = self.recording_dims(model)
            state = model.state_dict().values()
            schemas = [s for pair in self.schemas.values() for s in pair if s.arrays]
            data = sum(s.nbytes(dims) for s in schemas) + sum(t.numel() * t.element_size() for t in state)
            # a file per schema (an upload's metrics file beside it) and the model's copy
            files = len(schemas) + sum(1 for _, up in self.schemas.values() if up.arrays) + 1
            arrays = sum(len(s.arrays) for s in schemas) + len(state)
            overhead = files * RECORD_FILE_OVERHEAD + arrays * RECORD_ARRAY_OVERHEAD
            total += len(range(member, num_clients, period)) * (data + overhead)
        return total * count

    def check_recording(self, num_clients: int) -> str:
        """The line that tells what run config ``record-payloads`` will take on disk for ``num_clients``
        clients (:meth:`recording_estimate`; empty when nothing is recorded).

        Raises:
            ConfigError: naming ``record-payloads`` and ``record-payloads-max-gib``, when the estimate
                is above ``record-payloads-max-gib`` GiB.
        """
        estimate = self.recording_estimate(num_clients)
        if not estimate:
            return ""
        rounds = self.cfg.recorded_rounds
        count = self.cfg.num_server_rounds if rounds is None else len(rounds)
        what = (
            f"run config key 'record-payloads' = {self.cfg.record_payloads!r} writes up to {estimate / 2**30:.3g} GiB "
            f"({estimate / (count * num_clients) / 2**20:.3g} MiB per client and round x {count} rounds x "
            f"{num_clients} clients: payloads and personal models)"
        )
        limit = self.cfg.record_payloads_max_gib
        if estimate > limit * 2**30:
            raise ConfigError(
                f"{what}, above 'record-payloads-max-gib' = {limit:g}: allowed are fewer recorded rounds "
                "(e.g. '1,10') or fewer clients, or a larger 'record-payloads-max-gib' where the disk has room"
            )
        return f"{what}; at most 'record-payloads-max-gib' = {limit:g}"

    def log_settings(self) -> None:
        """Log the method and the main settings."""
        c = self.cfg
        log.info(
            "%s | %s, %s partitioner, %d clients, model group %s, %d rounds, fraction-train %.2f",
            type(self).__name__,
            c.dataset,
            c.partitioner,
            self.roster.size,
            c.model_group,
            c.num_server_rounds,
            c.fraction_train,
        )
        if c.auto_chosen:
            chosen = [
                f"{key} = '{value}'" + (" (auto)" if key in c.auto_chosen else "")
                for key, value in (("handshake", c.handshake), ("eval-clients", c.eval_clients))
            ]
            log.info(
                "%s for num-clients = %d: 'auto' chooses 'sampled' / 'trained' above %d clients when nothing needs "
                "every client asked up front; set a key to choose",
                ", ".join(chosen),
                c.num_clients,
                AUTO_SAMPLED_CLIENTS,
            )

    def is_eval_round(self, server_round: int) -> bool:
        """Every ``eval-every`` rounds, and the last round."""
        return server_round % self.cfg.eval_every == 0 or server_round == self.cfg.num_server_rounds

    def generalization_config(self, step: int) -> ConfigRecord:
        """The training settings of a held-out client's personalisation round ``step``: as
        :meth:`train_config`, evaluating right after training when ``eval_after_training``, never recorded."""
        config = self.train_config(step)
        config["evaluate"], config["record"] = self.eval_after_training, False
        return config

    def train_config(self, server_round: int) -> ConfigRecord:
        """The training settings sent with every train instruction (:func:`train_config`); ``evaluate``
        asks the client to evaluate after training (see ``eval_after_training``)."""
        return ConfigRecord(
            train_config(self.cfg, server_round, self.eval_after_training and self.is_eval_round(server_round))
        )


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


#: the hooks that read what a client answered in the handshake (its partition or sizes): a method that
#: overrides one must know a node before its train message (:func:`needs_query_first`)
ROSTER_HOOKS = ("train_round", "reply_dims", "joined", "admitted")


def needs_query_first(server: type[MethodServer]) -> bool:
    """Whether a method's server half must know a client's handshake answer before its train message: it
    overrides one of :data:`ROSTER_HOOKS` (FedRE's head trainer, MH-pFedHN's generated weights). With run
    config ``handshake = "sampled"`` such a method asks a drawn node it does not know yet a query first; any
    other sends the node its train message at once and the node answers the query in its train reply, one
    message instead of two (``engine.roster.Roster.answered``): what a Flower simulation engine costs grows
    with the messages sent (docs/running.md). Recording payloads and differential privacy keep the query
    first too: a download is recorded under its partition, a spent budget is known before the client is
    drawn again."""
    return any(getattr(server, hook) is not getattr(MethodServer, hook) for hook in ROSTER_HOOKS)
