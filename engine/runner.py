"""One run of one method over Flower's Grid: the handshake, the rounds, evaluation, rows, checkpoints and
the generalisation phases, read top to bottom in :meth:`Runner.start` and :meth:`Runner.run_round`.

The method (``engine.contract.MethodServer``) says what each client is sent and what the server makes
of the replies; the runner decides when, and talks to the clients only through the
:class:`engine.federation.Federation` (handshake, sample, send, evaluate). A method with a round of its
own (``engine.contract.OwnRound``: FedRE's head trainer, MH-pFedHN's sequential steps) runs it through
the same federation.

Life of a round (docs/architecture.md walks it step by step; a test keeps every hop real):

1. `engine/runner.py::Runner.run_round`: the loop's round; refreshes the nodes
   (`engine/federation.py::Federation.refresh`, `engine/roster.py::Roster.refresh`);
2. `engine/runner.py::Runner.train_round`: samples (`engine/roster.py::Roster.sample`), asks the method
   for each client's arrays (`engine/contract.py::MethodServer.configure_train`), exchanges one train
   message per client (`engine/federation.py::Federation.train`: `engine/transport.py::Transport.message`,
   settings from `common/protocol.py::train_config`, `engine/transport.py::Transport.exchange`) and keeps
   the valid replies (`engine/transport.py::Transport.validate`) for the method's
   `engine/contract.py::MethodServer.aggregate_train`;
3. on each client `client_app/handlers.py::handle_message` restores its state
   (`common/runtime.py::ClientRuntime`) and runs the method's `engine/contract.py::ClientProcedure.train`;
4. `engine/runner.py::Runner.evaluate_round` with `engine/federation.py::Federation.evaluate` and the
   method's `engine/contract.py::MethodServer.aggregate_evaluate`: the round's accuracy;
5. the row (`engine/round_rows.py::round_row`, `common/run_folder.py::ResultsWriter.write_round`) and the
   checkpoint (`common/run_folder.py::ResultsWriter.write_checkpoint`).
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import ConfigRecord, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result

from common.config import AUTO_SAMPLED_CLIENTS, RunConfig
from common.dp import check_reachable, dp_options
from common.errors import ConfigError, RunFailed
from common.options import declared_defaults
from common.payload import ClientReply, array_record
from common.protocol import SERVER_ROUND, metric_values
from engine import client_dp
from engine.checkpoint import Checkpoints, broken_state
from engine.contract import (
    SHARED_OPTION_TABLES,
    Method,
    MethodBinding,
    MethodContext,
    MethodServer,
    OwnRound,
    PerClientServer,
    needs_query_first,
)
from engine.evaluation import evaluations_in
from engine.federation import Federation
from engine.heldout_phase import phase_due, run_phase
from engine.payload_recorder import PayloadRecorder
from engine.round_rows import (
    RoundCounters,
    patience_exhausted,
    progress_line,
    round_metrics,
    round_row,
    untrained_error,
    untrained_streak,
)
from engine.transport import ReplyRules

if TYPE_CHECKING:  # for the annotations only
    from common.run_folder import ResultsWriter

log = logging.getLogger("flwr." + __name__)  # streamed with Flower's own log

#: the folder of a run folder that holds its clients' state when no state-dir is set (simulation)
CLIENT_STATE = "client-state"

#: bytes a recorded file takes beyond its arrays in :meth:`Runner.recording_estimate`: a file
#: system block (4 KiB on ext4, XFS and Btrfs), which also covers an upload's metrics file
RECORD_FILE_OVERHEAD = 4096
#: bytes an array takes beyond its data in a recorded file: the ``.npy`` header and zip entry of an
#: ``.npz`` member (about 250), or a tensor's entry in ``torch.save``'s zip archive
RECORD_ARRAY_OVERHEAD = 512


class Runner:
    """One run of one method: the loop over rounds, the federation of nodes, rows and checkpoints.

    It is not a Flower ``Strategy``: Flower's strategy API exchanges one global ``ArrayRecord`` and one
    config with every sampled client, while a model-heterogeneous method sends each client its own
    payload, evaluates clients' personal models and may exchange several times per round. It drives
    Flower's ``Grid`` (Message API) itself, through collaborators with explicit inputs:

    - ``method``: the method's server half (``engine.contract.MethodServer``), built with a
      ``MethodContext`` that hands it the run config, its binding, the run's RNG and the federation;
    - ``federation``: :class:`engine.federation.Federation` (handshake, refresh, sampling, every exchange);
    - ``counters``: :class:`engine.round_rows.RoundCounters` (bytes, dropped replies, the round's work);
    - ``checkpoints``: :class:`engine.checkpoint.Checkpoints` (resume, per-round checkpoint).

    Args:
        cfg: the validated run config.
        server: the method's server half (a ``MethodServer`` subclass).
        binding: the method's options, schemas and metrics for ``cfg`` (``engine.contract.NO_METHOD`` for
            the bare base).
        results: receives one row per round and the summary (see ``common.run_folder``); None keeps rows
            in memory only (``self.rows``).

    Raises:
        ConfigError: a ``dp.*`` target that cannot be given, or an invalid option of the method's table.
    """

    def __init__(
        self, cfg: RunConfig, server: type[MethodServer], binding: MethodBinding, results: ResultsWriter | None = None
    ) -> None:
        self.cfg = cfg
        self.dp = dp_options(cfg)  # a DP run that cannot give its guarantee fails here, before any message
        self.rng = np.random.default_rng(cfg.seed)
        self.results = results
        self.counters = RoundCounters()
        query_in_train = not (needs_query_first(server) or self.dp.enabled or cfg.record_payloads.strip())
        recorder = PayloadRecorder(cfg, None if results is None else results.path)
        self.federation = Federation(cfg, self.counters, self.rng, recorder, query_in_train)
        self.method = server(MethodContext(cfg, binding, self.rng, self.federation))
        method = self.method
        per_client = isinstance(method, PerClientServer)
        self.federation.bind(
            ReplyRules(
                method.schemas,
                method.metrics,
                method.eval_after_training,
                method.check_reply if per_client else _no_check,
                method.reply_dims if per_client else (lambda node_id: method.dims),
            )
        )
        defaults = declared_defaults(RunConfig)
        for table, options in SHARED_OPTION_TABLES.items():
            defaults.update(declared_defaults(options, table))
        if binding.options is not None:  # None: the bare base (NO_METHOD)
            defaults.update(declared_defaults(type(binding.options), cfg.method))
        self.checkpoints = Checkpoints(cfg, results, defaults)
        self.rows: list[dict[str, Any]] = []
        self.phases = 0  # generalisation phases run by this process (engine.heldout_phase)

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
        self.federation.open(grid, state_key, client_state_dir, window=window)
        self.federation.completed_round = self.checkpoints.completed_round()
        self.federation.handshake()
        roster = self.federation.roster
        if line := self.check_recording(roster.size):  # tools.run checked it before the launch
            log.info(line)
        if self.results is not None:
            self.results.num_clients = roster.size
            self.results.held_out_partitions = roster.held_out_partitions
        if isinstance(self.method, PerClientServer):
            self.method.joined()
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
        result.arrays = array_record(self.method.global_arrays())
        if self.results is not None:
            self.results.finish()
        return result

    def run_round(self, server_round: int, run_start: float) -> tuple[dict[str, Any], MetricRecord | None]:
        """One round of the loop: refresh the nodes, :meth:`train_round` (its server
        update undone if it left the server state non-finite or exploded: ``checkpoint.broken_state``),
        :meth:`evaluate_round`, then the round's row (with the ``stop-patience`` verdict) and
        checkpoint written. ``run_start``: :func:`time.perf_counter` at the loop's start. Returns the
        round's train metrics and evaluation."""
        before = self.counters.traffic.copy()
        t0 = time.perf_counter()
        self.counters.begin_round()
        admitted = self.federation.refresh()
        if admitted and isinstance(self.method, PerClientServer):
            self.method.admitted(admitted)
        refreshed = time.perf_counter()
        before_state = copy.deepcopy(self.method.server_state())
        train_metrics, replies = self.train_round(server_round)
        train_metrics["refresh-seconds"] = refreshed - t0
        if self.dp.enabled:
            train_metrics["dp-exhausted"] = self.federation.exhaust(replies)
        broken = None if before_state is None else broken_state(before_state, self.method.server_state())
        if broken:
            # the server would send a broken state to every client from now on: undo this round's update
            self.method.load_state(before_state)
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
        if self.dp.enabled and not last and len(row["dp_exhausted"]) == self.federation.roster.trainers:
            stop = "every client's privacy budget (dp.epsilon) is spent"
        if stop:
            row["stop_reason"] = stop
        if phase_due(self, server_round, last or bool(stop)):
            row.update(run_phase(self, server_round))
        self.rows.append(row)
        self.federation.completed_round = server_round
        if self.results is not None:
            self.results.write_round(row)
            state = self.checkpoints.build(
                server_round,
                self.federation.transport.state_key,
                self.rng,
                self.counters,
                self.rows,
                self.method.server_state(),
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
        aggregated over both by the method's ``aggregate_evaluate``, which names the
        connected clients asked that gave no valid evaluation (row key ``eval_missing``)."""
        if not self.cfg.is_eval_round(server_round):
            return None
        roster = self.federation.roster
        targets = roster.training_nodes if self.cfg.eval_clients == "all" else roster.sampled
        asked = [node for node in targets if node in roster.connected]
        return self.evaluate_nodes(asked, evaluated, server_round, server_round)

    def evaluate_nodes(
        self, nodes: list[int], evaluated: list[ClientReply], step: int, server_round: int, scope: str = ""
    ) -> MetricRecord | None:
        """The evaluation of ``nodes`` (a round's, or a generalisation phase's personalisation ``step``):
        the evaluations ``evaluated`` carried by train replies and one evaluate message to each other node
        (:meth:`engine.federation.Federation.evaluate`, the method's ``configure_evaluate`` of
        ``server_round``), aggregated by the method's ``aggregate_evaluate`` over the partitions of
        ``nodes``. ``step``: the messages' round (``server_round`` itself outside a phase); ``scope``:
        the client state they use (a phase's)."""
        replies = self.federation.evaluate(
            nodes,
            evaluated,
            lambda node: self.method.configure_evaluate(node, server_round),
            ConfigRecord({SERVER_ROUND: step}),
            step,
            scope,
        )
        return self.method.aggregate_evaluate(step, replies, [self.federation.partition_of(n) for n in nodes])

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
            self.federation.roster.exhaust_partitions(self.rows[-1].get("dp_exhausted", []))
        if self.results is not None:
            for row in self.rows:
                self.results.write_round(row)
            self.results.keep_checkpoint(self.cfg.resume_from)
        self.method.load_state(state["server"])
        log.info("Resumed from %s after round %d", self.cfg.resume_from, state["round"])
        return int(state["round"])

    def recording_estimate(self, num_clients: int) -> int:
        """Bytes run config ``record-payloads`` writes at most in a run of ``num_clients`` clients: per
        client and recorded round, the download and the upload of every message type at their largest
        (the payload schemas under :meth:`recording_dims`: ``.npz`` files hold their tensor bytes) and
        the client's copy of its personal model (its state dict) and, for a method that trains it with
        companions, their copy with it at the start of training (``MethodServer.training_companions``),
        plus :data:`RECORD_FILE_OVERHEAD` per file and :data:`RECORD_ARRAY_OVERHEAD` per array, times the
        recorded rounds (0 when none is). Each architecture of the model group is built once, on the meta
        device (nothing is allocated)."""
        import torch

        from models.groups import MODEL_GROUPS

        rounds = self.cfg.recorded_rounds
        count = self.cfg.num_server_rounds if rounds is None else len(rounds)
        group, info = MODEL_GROUPS[self.cfg.model_group], self.method.info
        period = len(group.architectures) * len(group.heads)  # client p holds member p mod period
        total = 0
        for member in range(min(period, num_clients) if count else 0):
            with torch.device("meta"):
                model = group.build(member, info.num_classes, info.channels, info.image_size, 0, self.cfg.feature_dim)
                companions = self.method.training_companions(model)
            dims = self.method.recording_dims(model)
            state = list(model.state_dict().values())
            schemas = [s for pair in self.method.schemas.values() for s in pair if s.arrays]
            if companions:  # the copy of the personal model with them at the start of training
                state = [*state, *state, *(t for m in companions for t in m.state_dict().values())]
            data = sum(s.nbytes(dims) for s in schemas) + sum(t.numel() * t.element_size() for t in state)
            # a file per schema (an upload's metrics file beside it), the model's copy and its start copy
            files = len(schemas) + sum(1 for _, up in self.method.schemas.values() if up.arrays) + 1 + bool(companions)
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
            type(self.method).__name__,
            c.dataset,
            c.partitioner,
            self.federation.roster.size,
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

    def train_round(self, server_round: int) -> tuple[dict[str, Any], list[ClientReply]]:
        """A round's training: the method's own round (``engine.contract.OwnRound``), or one train exchange
        with the sampled clients (each sent the method's ``configure_train``) and the method's
        ``aggregate_train`` on the valid replies.

        Returns:
            the round's train metrics (:func:`engine.round_rows.round_metrics` and the method's
            own; in a standard round also ``configure-seconds``, the sampling and the payloads, and
            ``exchange-seconds``, sending them and waiting for the replies) and its valid train replies
            (whose ``eval-`` metrics, if any, are evaluations).
        """
        if isinstance(self.method, OwnRound):
            return self.method.train_round(server_round)
        start = time.perf_counter()
        config = self.method.train_config(server_round)
        nodes = self.federation.sample()
        payloads = {n: self.method.configure_train(n, server_round) for n in nodes}
        configured = time.perf_counter()
        valid = self.federation.train(payloads, config, server_round)
        exchanged = time.perf_counter()
        server = self.method.aggregate_train(server_round, valid)
        metrics = round_metrics(valid, server, time.perf_counter() - exchanged)
        # where a round's wall time goes beside the clients' own (bench.deployment's breakdown)
        metrics.update({"configure-seconds": configured - start, "exchange-seconds": exchanged - configured})
        return metrics, valid


def build_run(cfg: RunConfig, method: Method, results: ResultsWriter | None = None) -> Runner:
    """The run of ``method`` for ``cfg`` (``results``: see :class:`Runner`).

    Raises:
        ConfigError: as ``Method.bind``, the server half's own checks, a ``dp.epsilon`` target no client can
            meet with this method's trainings and releases (``common.dp.check_reachable``), or client-level
            DP the run cannot give (``engine.client_dp.check_run``).
    """
    binding = method.bind(cfg)
    check_reachable(cfg, method.client.dp_trainings, method.client.dp_releases)
    client_dp.check_run(cfg, method.server)
    return Runner(cfg, method.server, binding, results)


def _no_check(message_type: str, metrics: Any) -> None:
    """A method without checks of its own on a reply's metrics."""
