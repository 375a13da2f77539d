"""The machinery every method shares, written once: server half and client half.

Server (:class:`HeteroStrategy`, a Flower Message-API ``Strategy``):

- runs a ``query`` handshake with every node as it connects to learn its partition id, data
  sizes and the federation's size N (``num-clients``, or the nodes' ``num-partitions`` when
  that is 0); node ids are random, so sampling and ordering by partition id make runs
  reproducible and methods comparable on the same clients;
- samples ``max(1, floor(fraction-train * N))`` clients per round with a seeded RNG;
- builds one message per client carrying only that client's payload
  (:meth:`HeteroStrategy.train_payload` may differ per client);
- :meth:`HeteroStrategy.exchange` sends, receives and counts payload bytes per message
  category; :meth:`HeteroStrategy.validate` checks every reply against the method's schema
  and drops bad ones with a log line, so one broken client never stops a round;
- saves a checkpoint after every round and resumes from one;
- :meth:`HeteroStrategy.run_round` is one exchange + :meth:`HeteroStrategy.server_update`
  by default; methods with sequential server updates or two exchanges per round override
  it and call ``sample``/``message``/``exchange``/``validate`` themselves;
- evaluates every client's personal model every ``eval-every`` rounds (and the last) and
  writes one results row per round as it goes.

The machinery lives in small mixins, each in its own module: ``strategies.nodes.NodeRegistry``
(handshake, node refresh, sampling), ``strategies.transport.Transport`` (messages, exchange, byte
counts, reply checks), ``strategies.checkpoint.Checkpointing`` (server state, checkpoint,
resume) and ``strategies.records`` (round metrics and rows). This module holds the method hooks,
Flower's Strategy API and the round loop.

Client (:class:`ClientProcedure`): one method per message type (``train``, ``evaluate``,
``query``, or ``train_<action>`` for ``train.<action>``), each taking the client runtime,
the validated payload and the config, and returning reply arrays and metrics.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from common.config import RunConfig
from common.datasets import DATASETS
from common.metrics import EVAL_PREFIX, REQUIRED_METRICS
from common.payload import ClientReply, PayloadSchema, array_record
from common.runtime import ClientRuntime
from common.training import evaluate_model, evaluation_metrics
from strategies.checkpoint import Checkpointing, finite
from strategies.method import MethodBinding, Schemas
from strategies.nodes import NodeRegistry
from strategies.records import metric_values, patience_exhausted, progress_line, round_metrics, round_row
from strategies.transport import Transport

log = logging.getLogger("flwr." + __name__)  # streamed with Flower's own log

#: the folder of a run folder that holds its clients' state when no state-dir is set (simulation)
CLIENT_STATE = "client-state"

#: a payload: array name -> array (the message's arrays after schema validation)
Arrays = dict[str, np.ndarray]
#: what a client handler returns: (reply payload, scalar metrics)
Reply = tuple[Arrays, dict[str, Any]]

NO_PAYLOAD = PayloadSchema()
BASE_SCHEMAS: Schemas = {"query": (NO_PAYLOAD, NO_PAYLOAD), "evaluate": (NO_PAYLOAD, NO_PAYLOAD)}
#: the schemas of a method that exchanges no arrays at all (Local, and the bare base classes)
NO_PAYLOAD_SCHEMAS: Schemas = {**BASE_SCHEMAS, "train": (NO_PAYLOAD, NO_PAYLOAD)}
#: the binding of the bare base classes: no options, no payload, no metrics of their own
NO_METHOD = MethodBinding(None, NO_PAYLOAD_SCHEMAS, {})


class HeteroStrategy(NodeRegistry, Transport, Checkpointing, Strategy):
    """Base Strategy of all methods. Subclasses override the hooks; their method's descriptor
    builds them (``strategies.method.Method.build_strategy``).

    Args:
        cfg: the validated run config.
        binding: the method's options, schemas and metrics for ``cfg`` (``self.options``,
            ``self.schemas``, ``self.metrics``); :data:`NO_METHOD` for the bare base.
        results: receives one row per round and the summary (see ``common.results``);
            None keeps rows in memory only (``self.rows``).

    Raises:
        ConfigError: an invalid option of the method's table.

    Hooks (all optional): :meth:`global_arrays`, :meth:`train_payload`,
    :meth:`eval_payload`, :meth:`server_update`, :meth:`run_round`.
    """

    #: True when the evaluated model is the client's post-training personal model and the
    #: evaluate instruction carries no payload (docs/methods/fedgh.md §6, Local): sampled clients then
    #: evaluate right after training and report in the train reply, which saves one round trip
    #: per round (in deployment, one ClientApp process per client); only clients not sampled
    #: get a separate evaluate message.
    evaluate_in_train: bool = False

    #: keep the state of clients without any ``state-dir`` in the run folder (``<run>/client-state``)
    #: instead of ``context.state``: set by the ServerApp in a simulation, where the clients share the
    #: server's file system and ``context.state`` lives in the simulation's one process
    client_state_in_run_folder: bool = False

    def __init__(self, cfg: RunConfig, binding: MethodBinding, results: Any | None = None) -> None:
        self.cfg = cfg
        self.options, self.schemas, self.metrics = binding.options, binding.schemas, binding.metrics
        self.info = DATASETS[cfg.dataset]
        self.dims = {"C": self.info.num_classes, "d": cfg.representation_dim}
        self.rng = np.random.default_rng(cfg.seed)
        self.results = results
        self.init_registry()
        self.init_transport(cfg.round_timeout)
        self.rows: list[dict[str, Any]] = []
        self._evaluated_in_train: list[ClientReply] = []

    # ------------------------------------------------------------------ hooks
    def global_arrays(self) -> dict[str, np.ndarray]:
        """The server's current shared arrays (e.g. FedGH's header); empty by default."""
        return {}

    def train_payload(self, node_id: int, server_round: int) -> dict[str, np.ndarray]:
        """Arrays sent to ``node_id`` with its train instruction. Default: :meth:`global_arrays`."""
        return self.global_arrays()

    def eval_payload(self, node_id: int, server_round: int) -> dict[str, np.ndarray]:
        """Arrays sent with the evaluate instruction; none by default (clients hold their models)."""
        return {}

    def server_update(self, server_round: int, replies: list[ClientReply]) -> dict[str, float]:
        """The method's server step on this round's valid train replies; returns scalar metrics."""
        return {}

    def reply_dims(self, node_id: int) -> dict[str, int]:
        """Symbol values a reply from ``node_id`` is validated with: ``C``, ``d`` and, in
        methods whose payload size differs per client, that client's sizes (e.g. MH-pFedHN's K_i)."""
        return self.dims

    def check_reply(self, message_type: str, metrics: Mapping[str, Any]) -> None:
        """The method's own checks of a reply's metrics before anything is used (e.g. a claimed
        model size); raise PayloadError to drop the reply. None by default."""

    def run_round(self, server_round: int) -> dict[str, float]:
        """One training round: sample, one train exchange, server update. Returns server metrics."""
        messages = self.configure_train(server_round, ArrayRecord(), self.train_config(server_round), self.grid)
        _, metrics = self.aggregate_train(server_round, self.exchange(messages))
        return dict(metrics or {})

    # ------------------------------------------------------ Flower Strategy API
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """One train message per sampled client, each with its own payload."""
        return [
            self.message("train", node, self.train_payload(node, server_round), config, server_round)
            for node in self.sample()
        ]

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate replies, run :meth:`server_update`, return the new global arrays and metrics."""
        valid = self.validate("train", replies)
        self._evaluated_in_train = [
            ClientReply(
                r.node_id,
                r.partition_id,
                {},
                {k[len(EVAL_PREFIX) :]: v for k, v in r.metrics.items() if k.startswith(EVAL_PREFIX)},
            )
            for r in valid
            if all(EVAL_PREFIX + k in r.metrics for k in REQUIRED_METRICS["evaluate"])
        ]
        start = time.perf_counter()
        server = self.server_update(server_round, valid)
        metrics = round_metrics(valid, server, time.perf_counter() - start)
        arrays = self.global_arrays()
        return (array_record(arrays) if arrays else None), MetricRecord(metric_values(metrics))

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """One evaluate message to every client to evaluate (``eval-clients``: all known clients,
        or this round's sampled ones) not already evaluated in its train reply this round."""
        if not self.is_eval_round(server_round):
            return []
        done = {r.node_id for r in self._evaluated_in_train}
        targets = self.nodes if self.cfg.eval_clients == "all" else self.sampled
        return [
            self.message("evaluate", node, self.eval_payload(node, server_round), config, server_round)
            for node in targets
            if node not in done and node in self.connected
        ]

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Accuracy of the clients' personal models on their local test splits.

        ``accuracy-mean`` is the unweighted mean over clients (the papers' "average test
        accuracy"), ``accuracy-weighted`` the sample-weighted mean; both fractions in [0, 1].
        Per-client values come as parallel lists ``partition-ids`` / ``accuracy-per-client``.
        Any other ``test-acc-<name>`` metric is averaged unweighted into ``accuracy-mean-<name>`` and
        weighted by ``num-examples`` into ``accuracy-weighted-<name>`` (over the replies that have it).
        """
        valid = self.validate("evaluate", replies) + self._evaluated_in_train
        valid = sorted(valid, key=lambda r: r.partition_id)
        self._evaluated_in_train = []
        if not valid:
            return None
        correct = np.array([r.metrics["test-correct"] for r in valid], dtype=np.float64)
        total = np.array([r.metrics["num-examples"] for r in valid], dtype=np.float64)
        acc = correct / np.maximum(total, 1)
        out: dict[str, Any] = {
            "accuracy-mean": float(acc.mean()),
            "accuracy-weighted": float(correct.sum() / max(total.sum(), 1)),
            "num-evaluated": len(valid),
            "partition-ids": [r.partition_id for r in valid],
            "accuracy-per-client": [float(a) for a in acc],
        }
        extra = sorted({k for r in valid for k in r.metrics if k.startswith("test-acc-")})
        for key in extra:
            having = [r for r in valid if key in r.metrics]
            values = np.array([r.metrics[key] for r in having], dtype=np.float64)
            weights = np.array([r.metrics["num-examples"] for r in having], dtype=np.float64)
            name = key[len("test-acc-") :]
            out["accuracy-mean-" + name] = float(values.mean())
            out["accuracy-weighted-" + name] = float((values * weights).sum() / max(weights.sum(), 1))
        return MetricRecord(out)

    def summary(self) -> None:
        """Log the method and the main settings."""
        c = self.cfg
        log.info(
            "%s | %s, %s partitioner, %d clients, model group %s, %d rounds, fraction-train %.2f",
            type(self).__name__,
            c.dataset,
            c.partitioner,
            len(self.nodes),
            c.model_group,
            c.num_server_rounds,
            c.fraction_train,
        )

    def start(self, grid: Grid, num_rounds: int | None = None, timeout: float | None = None) -> Result:  # type: ignore[override]
        """Run the whole federation: wait for nodes, handshake, rounds, evaluation, results.

        ``num_rounds`` and ``timeout`` default to the config's ``num-server-rounds`` and
        ``round-timeout`` (the wait for a round's replies). Flower's other ``start`` arguments
        (initial arrays, train/evaluate configs, a server-side evaluate function) have no
        meaning here: every method builds its own server state, per-client payloads and configs
        from the run config, and evaluation is on the clients' personal models.

        Raises:
            RuntimeError, ConfigError: from :meth:`handshake` (not all clients answer within
                ``connect-timeout`` seconds, or the nodes do not fit the run config).
        """
        self.grid = grid
        rounds = num_rounds or self.cfg.num_server_rounds
        self._timeout = timeout or self.cfg.round_timeout
        self.state_key = self._initial_state_key()
        if self.client_state_in_run_folder and not self.cfg.state_dir and self.results is not None:
            # the folder of the run that started the clients' state: a resumed run finds it again
            self.client_state_dir = str(Path(self.results.path).parent / self.state_key / CLIENT_STATE)
        self.handshake()
        self.summary()
        first = self.resume() + 1
        result = Result()
        run_start = time.perf_counter()
        for server_round in range(first, rounds + 1):
            if self.rows and self.rows[-1].get("stop_reason"):  # stop-patience ran out (maybe before a resume)
                break
            before = self.traffic.copy()
            t0 = time.perf_counter()
            self.begin_round()
            self.refresh_nodes()
            before_state = copy.deepcopy(self.server_state())
            train_metrics = self.run_round(server_round)
            if before_state is not None and not finite(self.server_state()):
                # the server would send non-finite state to every client from now on: undo this round's update
                self.load_server_state(before_state)
                train_metrics["server-rolled-back"] = 1
                log.warning("Round %d: the server update made the server state non-finite; rolled back", server_round)
            t1 = time.perf_counter()
            eval_messages = list(
                self.configure_evaluate(server_round, ArrayRecord(), ConfigRecord({"server-round": server_round}), grid)
            )
            eval_metrics = (
                self.aggregate_evaluate(server_round, self.exchange(eval_messages))
                if self.is_eval_round(server_round)
                else None
            )
            t2 = time.perf_counter()
            result.train_metrics_clientapp[server_round] = MetricRecord(metric_values(train_metrics))
            if eval_metrics is not None:
                result.evaluate_metrics_clientapp[server_round] = eval_metrics
            row = round_row(
                server_round,
                train_metrics,
                eval_metrics,
                self.traffic - before,
                t1 - t0,
                t2 - t1,
                time.perf_counter() - run_start,
                self.round_dropped,
                self.round_clipped,
                self.round_work,
                self.round_gpu,
                self.round_ray_nodes,
            )
            stop = patience_exhausted([*self.rows, row], self.cfg.stop_patience)
            if stop:
                row["stop_reason"] = stop
            self.rows.append(row)
            if self.results is not None:
                self.results.write_round(row)
                self.results.write_checkpoint(self.checkpoint(server_round))
            log.info(progress_line(row, rounds))
            if stop:
                log.info("Stopping after round %d: %s", server_round, stop)
        arrays = self.global_arrays()
        result.arrays = array_record(arrays)
        if self.results is not None:
            self.results.finish()
        return result

    def is_eval_round(self, server_round: int) -> bool:
        """Every ``eval-every`` rounds, and the last round."""
        return server_round % self.cfg.eval_every == 0 or server_round == self.cfg.num_server_rounds

    def train_config(self, server_round: int) -> ConfigRecord:
        """The training settings sent with every train instruction (:func:`train_config`); ``evaluate``
        asks the client to evaluate after training (see ``evaluate_in_train``)."""
        return ConfigRecord(
            train_config(self.cfg, server_round, self.evaluate_in_train and self.is_eval_round(server_round))
        )


class ClientProcedure:
    """Client half of a method. Subclasses implement ``train``; their method's descriptor builds them
    with the same :class:`strategies.method.MethodBinding` as the server half (``self.options``,
    ``self.schemas``; ``strategies.method.Method.build_client``).

    Handlers take ``(client, payload, config)``: the :class:`common.runtime.ClientRuntime`,
    the validated payload arrays (name -> ndarray) and the message's ConfigRecord as a dict;
    they return ``(arrays, metrics)``: the reply payload (must match the schema) and scalars.
    """

    def __init__(self, cfg: RunConfig, binding: MethodBinding) -> None:
        self.cfg = cfg
        self.options, self.schemas = binding.options, binding.schemas

    def train(self, client: ClientRuntime, payload: Arrays, config: dict[str, Any]) -> Reply:
        raise NotImplementedError

    def evaluate(self, client: ClientRuntime, payload: Arrays, config: dict[str, Any]) -> Reply:
        """Accuracy of the client's personal model on its local test split."""
        data = client.data
        return {}, evaluation_metrics(*evaluate_model(client.model, data.test_x, data.test_y, data.info, client.device))

    def query(self, client: ClientRuntime, payload: Arrays, config: dict[str, Any]) -> Reply:
        """Handshake: data sizes (the runtime adds the partition id), from the partition's labels
        or its cache file, without decoding images; a partition that cannot be split fails here."""
        start = time.perf_counter()
        num_train, num_test = client.data_sizes()
        return {}, {
            "num-train": num_train,
            "num-test": num_test,
            "num-partitions": client.spec.num_partitions,
            "data-seconds": time.perf_counter() - start,
        }


def train_config(cfg: RunConfig, server_round: int, evaluate: bool = False) -> dict[str, Any]:
    """The training settings every train instruction carries (not counted as payload): the round,
    ``local-epochs``, ``batch-size``, ``batch-order``, ``lr``, ``momentum``, ``weight-decay``,
    ``clip-norm``, ``precision`` of ``cfg``, and ``evaluate`` (evaluate right after training)."""
    return {
        "server-round": server_round,
        "local-epochs": cfg.local_epochs,
        "batch-size": cfg.batch_size,
        "batch-order": cfg.batch_order,
        "lr": cfg.lr,
        "momentum": cfg.momentum,
        "weight-decay": cfg.weight_decay,
        "clip-norm": cfg.clip_norm,
        "precision": cfg.precision,
        "evaluate": evaluate,
    }
