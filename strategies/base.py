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
- :meth:`HeteroStrategy.run_round` is one exchange + :meth:`HeteroStrategy.server_update`
  by default; methods with sequential server updates or two exchanges per round override
  it and call ``sample``/``message``/``exchange``/``validate`` themselves;
- evaluates every client's personal model every ``eval-every`` rounds (and the last) and
  writes one results row per round as it goes.

Client (:class:`ClientProcedure`): one method per message type (``train``, ``evaluate``,
``query``, or ``train_<action>`` for ``train.<action>``), each taking the client runtime,
the validated payload and the config, and returning reply arrays and metrics.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from functools import cached_property
from typing import Any, ClassVar

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from common.config import ConfigError, RunConfig
from common.datasets import DATASETS
from models.groups import MODEL_GROUPS
from strategies.aggregation import sample_weighted_mean
from strategies.method import Method, Schemas
from strategies.payload import (
    ClientReply,
    PayloadError,
    PayloadSchema,
    array_record,
    clip_outlier_rows,
    read_payload,
    tensor_bytes,
)

log = logging.getLogger("flwr." + __name__)  # streamed with Flower's own log

NO_PAYLOAD = PayloadSchema()
BASE_SCHEMAS: Schemas = {"query": (NO_PAYLOAD, NO_PAYLOAD), "evaluate": (NO_PAYLOAD, NO_PAYLOAD)}
#: the schemas of a method that exchanges no arrays at all (Local, and the bare base classes)
NO_PAYLOAD_SCHEMAS: Schemas = {**BASE_SCHEMAS, "train": (NO_PAYLOAD, NO_PAYLOAD)}

#: metric key every reply carries (the client runtime adds it)
PARTITION_ID = "partition-id"
#: further metric keys a reply of a message category must carry
REQUIRED_METRICS = {"evaluate": ("test-correct", "num-examples"), "query": ("num-train", "num-test", "num-partitions")}
#: prefix of evaluation metrics carried in a train reply (see ``HeteroStrategy.evaluate_in_train``)
EVAL_PREFIX = "eval-"
#: seconds between two looks for newly connected nodes during the handshake
NODE_POLL_SECONDS = 0.5
#: seconds between two pulls for replies (Flower's HTTP grid waits 3 s)
PULL_SECONDS = 0.05
#: run config keys a resumed run may set differently from the run that wrote its checkpoint
RESUMABLE_CHANGES = ("num-server-rounds", "resume-from")
#: seconds a node that connected mid-run has to answer the partition query (at most ``round-timeout``)
QUERY_SECONDS = 120.0


def sample_size(fraction: float, num_nodes: int) -> int:
    """Clients per round K = max(1, floor(fraction * N)) (FedGH spec section 4).

    The product is rounded to 9 decimals first so that 0.29 * 100 gives 29, not 28.
    """
    return max(1, math.floor(round(fraction * num_nodes, 9)))


class HeteroStrategy(Strategy):
    """Base Strategy of all methods. Subclasses override the hooks; their method's descriptor
    (``strategies.method.Method``) gives ``self.options`` and ``self.schemas``.

    Args:
        cfg: the validated run config.
        results: receives one row per round and the summary (see ``server_app.results``);
            None keeps rows in memory only (``self.rows``).

    Raises:
        ConfigError: an invalid option of the method's table.

    Hooks (all optional): :meth:`global_arrays`, :meth:`train_payload`,
    :meth:`eval_payload`, :meth:`server_update`, :meth:`run_round`.
    """

    #: the method this strategy serves (set by its ``Method`` descriptor; None: the bare base)
    method: ClassVar[Method | None] = None
    #: True when the evaluated model is the client's post-training personal model and the
    #: evaluate instruction carries no payload (FedGH section 6, Local): sampled clients then
    #: evaluate right after training and report in the train reply, which saves one round trip
    #: per round (in deployment, one ClientApp process per client); only clients not sampled
    #: get a separate evaluate message.
    evaluate_in_train: bool = False
    #: attributes holding the server state (modules, optimisers, torch Generators, dicts of
    #: arrays) saved in the per-round checkpoint; None: the method cannot resume yet; () stateless
    checkpointed: ClassVar[tuple[str, ...] | None] = None

    def __init__(self, cfg: RunConfig, results: Any | None = None) -> None:
        self.cfg = cfg
        self.options, self.schemas = bind_method(self.method, cfg)
        self.info = DATASETS[cfg.dataset]
        self.dims = {"C": self.info.num_classes, "d": cfg.representation_dim}
        self.rng = np.random.default_rng(cfg.seed)
        self.results = results
        self.grid: Grid | None = None
        self.clients: dict[int, dict[str, Any]] = {}  # node id -> handshake metrics
        self.nodes: list[int] = []  # node ids ordered by partition id
        self.sampled: list[int] = []  # the nodes of the last sample() call
        self.connected: set[int] = set()  # nodes the grid listed at the start of this round
        self.round_dropped: set[int] = set()  # partition ids sampled/asked this round that gave no valid reply
        self.round_clipped = 0  # uploaded rows scaled down to the round's outlier bound this round
        #: architecture -> [training images, client train-seconds] of this round's valid train replies
        self.round_work: dict[str, list[float]] = {}
        self.refreshes = 0  # refresh_nodes() calls so far
        #: node id -> (queries it missed, refresh count from which it is asked again)
        self.silent_nodes: dict[int, tuple[int, int]] = {}
        #: node id -> handshake metrics of a node whose claim on a held partition waits for the holder to go
        self.claims: dict[int, dict[str, Any]] = {}
        self.outsiders: set[int] = set()  # nodes that hold a partition outside this run: not asked again
        #: names this run's client state on disk (node config ``state-dir``): the results folder of
        #: the run that started it, kept by a resumed run so clients find their state again
        self.state_key = "in-memory"
        self.traffic: Counter[str] = Counter()  # "<category>_bytes_<up|down>" -> bytes
        self.dropped: Counter[str] = Counter()  # message category -> dropped replies
        self.rows: list[dict[str, Any]] = []
        self._evaluated_in_train: list[ClientReply] = []
        self._timeout = cfg.round_timeout

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
        Any other ``test-acc-<name>`` metric is averaged unweighted into ``accuracy-mean-<name>``.
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
            out["accuracy-mean-" + key[len("test-acc-") :]] = float(
                np.mean([r.metrics[key] for r in valid if key in r.metrics])
            )
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

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord | None = None,
        num_rounds: int | None = None,
        timeout: float | None = None,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Any = None,
    ) -> Result:
        """Run the whole federation: wait for nodes, handshake, rounds, evaluation, results.

        ``num_rounds`` and ``timeout`` default to the config's ``num-server-rounds`` and
        ``round-timeout`` (the wait for a round's replies); the other arguments exist for signature
        compatibility and are unused (the server state lives in the strategy, the config in ``cfg``).

        Raises:
            RuntimeError, ConfigError: from :meth:`handshake` (not all clients answer within
                ``connect-timeout`` seconds, or the nodes do not fit the run config).
        """
        self.grid = grid
        rounds = num_rounds or self.cfg.num_server_rounds
        self._timeout = timeout or self.cfg.round_timeout
        self.state_key = self._initial_state_key()
        self.handshake()
        self.summary()
        first = self.resume() + 1
        result = Result()
        run_start = time.perf_counter()
        for server_round in range(first, rounds + 1):
            before = self.traffic.copy()
            t0 = time.perf_counter()
            self.round_dropped = set()
            self.round_clipped = 0
            self.round_work = {}
            self.refresh_nodes()
            before_state = copy.deepcopy(self.server_state())
            train_metrics = self.run_round(server_round)
            if before_state is not None and not _finite(self.server_state()):
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
            row = self._row(
                server_round,
                train_metrics,
                eval_metrics,
                self.traffic - before,
                t1 - t0,
                t2 - t1,
                time.perf_counter() - run_start,
            )
            self.rows.append(row)
            if self.results is not None:
                self.results.write_round(row)
                self.results.write_checkpoint(self.checkpoint(server_round))
            log.info(_progress_line(row, rounds))
        arrays = self.global_arrays()
        result.arrays = array_record(arrays)
        if self.results is not None:
            self.results.finish()
        return result

    # ------------------------------------------------------ checkpoint/resume
    def server_state(self) -> dict[str, Any] | None:
        """The method's server state for a checkpoint: the state of each attribute in ``checkpointed``.

        Modules and optimisers give their ``state_dict()``, torch Generators their RNG state,
        dicts a shallow copy. None when the method does not declare ``checkpointed`` (it
        cannot resume yet).
        """
        if self.checkpointed is None:
            return None
        return {name: _state_of(getattr(self, name)) for name in self.checkpointed}

    def load_server_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`server_state` (called after the handshake, so per-client state exists)."""
        for name, value in state.items():
            obj = getattr(self, name)
            if isinstance(obj, torch.Generator):
                obj.set_state(value)
            elif isinstance(obj, dict):
                obj.clear()
                obj.update(value)
            else:
                obj.load_state_dict(value)

    @cached_property
    def _saved(self) -> dict[str, Any] | None:
        """The ``resume-from`` checkpoint, read once (None without ``resume-from``)."""
        if not self.cfg.resume_from:
            return None
        from server_app.results import load_checkpoint

        return load_checkpoint(self.cfg.resume_from)

    def _initial_state_key(self) -> str:
        if self._saved is not None and self._saved.get("state-key"):
            return self._saved["state-key"]
        return self.results.path.name if self.results is not None else "in-memory"

    def checkpoint(self, server_round: int) -> dict[str, Any]:
        """Everything needed to continue after ``server_round``: server state, RNG, counters, rows,
        and the clients' state key."""
        return {
            "round": server_round,
            "method": self.cfg.method,
            "config": self.cfg.as_dict(),
            "state-key": self.state_key,
            "rng": self.rng.bit_generator.state,
            "traffic": dict(self.traffic),
            "dropped": dict(self.dropped),
            "rows": self.rows,
            "server": self.server_state(),
        }

    def resume(self) -> int:
        """Restore the checkpoint named by ``resume-from``; returns its last round (0 without one).

        Raises:
            ConfigError: the checkpoint is of another method, the method cannot resume, or the
                checkpoint's run config differs in any key but ``num-server-rounds`` (and
                ``resume-from`` itself): the keys are named.
        """
        if not self.cfg.resume_from:
            return 0
        state = self.__dict__.pop("_saved", None) or self._saved  # read once, not kept for the run
        if state["method"] != self.cfg.method or state["server"] is None:
            raise ConfigError(
                f"run config key 'resume-from' = {self.cfg.resume_from!r}: a '{state['method']}' "
                f"checkpoint cannot resume method '{self.cfg.method}'"
                + ("" if state["server"] is not None else " (this method has no server_state yet)")
            )
        saved, now = state.get("config", {}), self.cfg.as_dict()
        differ = sorted(k for k in set(saved) | set(now) if k not in RESUMABLE_CHANGES and saved.get(k) != now.get(k))
        if differ:
            raise ConfigError(
                f"run config key 'resume-from' = {self.cfg.resume_from!r}: the checkpoint's run used "
                "other values for "
                + ", ".join(f"'{k}' ({saved.get(k)!r}, now {now.get(k)!r})" for k in differ)
                + "; only 'num-server-rounds' may change on resume"
            )
        self.rng.bit_generator.state = state["rng"]
        self.traffic.update(state["traffic"])
        self.dropped.update(state["dropped"])
        self.rows = list(state["rows"])
        if self.results is not None:
            for row in self.rows:
                self.results.write_round(row)
        self.load_server_state(state["server"])
        log.info("Resumed from %s after round %d", self.cfg.resume_from, state["round"])
        return int(state["round"])

    # ------------------------------------------------------------- machinery
    def handshake(self) -> None:
        """Learn every client of the run: its node, partition id and data sizes, and the run's size N.

        N is run config ``num-clients``, or with ``num-clients`` = 0 the ``num-partitions`` the nodes
        report (Flower gives each simulated SuperNode ``partition-id`` and ``num-partitions``; a
        deployed SuperNode has them in its ``--node-config``). Nodes are asked as they connect (a
        simulation's virtual nodes connect over several seconds) until all N partitions have
        answered, so which clients take part never depends on timing. Each node is asked once (a
        broken node is not flooded with queries; its error is logged). Every reply's metrics are
        kept in ``self.clients[node_id]`` (methods may add keys, e.g. a parameter count).

        Raises:
            ConfigError: a node reports a ``num-partitions`` other than ``num-clients`` (or than
                another node), a partition id outside [0, N), or rejects the run config.
            RuntimeError: not all N partitions answer within ``connect-timeout`` seconds.

        A second node claiming a partition already answered for is ignored (logged, counted as a
        dropped query): the first claim stands and the run goes on.
        """
        timeout = self.cfg.connect_timeout
        began = time.monotonic()
        deadline = began + timeout
        wanted: int | None = self.cfg.num_clients or None  # None until a node reports num-partitions
        by_partition: dict[int, int] = {}
        asked: set[int] = set()
        while wanted is None or len(by_partition) < wanted:
            if time.monotonic() > deadline:
                size = (
                    f"num-clients={wanted}"
                    if self.cfg.num_clients
                    else (f"num-partitions={wanted}" if wanted else "? (no node answered)")
                )
                raise RuntimeError(
                    f"only {len(by_partition)} of {size} clients answered the handshake within "
                    f"{timeout:.0f} s (run config key 'connect-timeout')"
                )
            new = sorted(set(self.grid.get_node_ids()) - asked)
            if new:
                asked.update(new)
                replies = self.exchange(
                    [self.message("query", n, {}, ConfigRecord(), 0) for n in new],
                    max(deadline - time.monotonic(), 1.0),
                )
                _raise_config_errors(replies)
                for r in self.validate("query", replies):
                    wanted = self._federation_size(r, wanted)
                    if r.partition_id in by_partition:  # the first claim stands; the run goes on
                        log.warning(
                            "Node %s also claims partition %d, held by node %s: ignored (check each "
                            "SuperNode's --node-config)",
                            r.node_id,
                            r.partition_id,
                            by_partition[r.partition_id],
                        )
                        self.dropped["query"] += 1
                        self.claims[r.node_id] = r.metrics
                        continue
                    by_partition[r.partition_id] = r.node_id
                    self.clients[r.node_id] = r.metrics
                log.info(
                    "Handshake: %d of %s clients answered, %.1f s after the handshake began (slowest "
                    "client: %.1f s from its process start to the handler, %.1f s loading its partition)",
                    len(by_partition),
                    wanted or "?",
                    time.monotonic() - began,
                    max((m.get("app-start-seconds", 0.0) for m in self.clients.values()), default=0.0),
                    max((m.get("data-seconds", 0.0) for m in self.clients.values()), default=0.0),
                )
            if wanted is None or len(by_partition) < wanted:
                time.sleep(NODE_POLL_SECONDS)
        self.nodes = [by_partition[p] for p in sorted(by_partition)]
        self.connected = set(self.nodes)
        if self.results is not None:
            self.results.num_clients = len(self.nodes)
        log.info("Handshake: %d clients, partitions %s", len(self.nodes), sorted(by_partition))

    def _federation_size(self, reply: ClientReply, wanted: int | None) -> int:
        """N after ``reply``: its ``num-partitions``, checked against ``num-clients`` and earlier nodes.

        Raises:
            ConfigError: naming both keys when they disagree, or a partition id outside [0, N).
        """
        n, pid = reply.metrics["num-partitions"], reply.partition_id
        where = f"node {reply.node_id} (partition-id {pid}) has node config 'num-partitions' = {n!r}"
        if not isinstance(n, int) or not 0 <= pid < n:
            raise ConfigError(f"{where}: 'num-partitions' must be an integer and 'partition-id' lie in [0, it)")
        if self.cfg.num_clients and n != self.cfg.num_clients:
            raise ConfigError(
                f"run config key 'num-clients' = {self.cfg.num_clients} but {where}: set "
                "num-clients=0 to follow the federation, or make the two agree"
            )
        if wanted is not None and n != wanted:
            raise ConfigError(f"{where}, other nodes have {wanted}: every node must have the same 'num-partitions'")
        return n

    def refresh_nodes(self) -> None:
        """Track nodes leaving and (re)joining between rounds (deployment: a SuperNode restarts).

        Nodes the grid no longer lists are skipped when sampled (and recorded as dropped). An
        unknown node is asked once for its partition id. It takes a partition over only when the
        partition's node is gone from the grid (a SuperNode restarted without a fixed node id);
        a claim on a partition whose node is still connected is refused and kept waiting, so no
        node can take a connected client's place (and its personal payload), and it is granted
        without a new query once that node is gone. A node that gives no valid answer within
        :data:`QUERY_SECONDS` is asked again only after 1, 2, 4, ... rounds, so a silent or broken
        node cannot stall every round; a node holding a partition outside this run is not asked
        again. A rejoining client restores its state from its node's ``state-dir``.
        """
        self.connected = set(self.grid.get_node_ids())
        self.refreshes += 1
        self.claims = {n: c for n, c in self.claims.items() if n in self.connected}
        new = sorted(
            n
            for n in self.connected - set(self.clients) - set(self.claims) - self.outsiders
            if self.silent_nodes.get(n, (0, 0))[1] <= self.refreshes
        )
        valid = self.validate(
            "query",
            self.exchange(
                [self.message("query", n, {}, ConfigRecord(), 0) for n in new],
                min(QUERY_SECONDS, self.cfg.round_timeout),
            ),
        )
        answered = {r.node_id for r in valid}
        for node in set(new) - answered:  # no reply, or none we can use
            misses = self.silent_nodes.get(node, (0, 0))[0] + 1
            self.silent_nodes[node] = (misses, self.refreshes + 2 ** (misses - 1))
        for reply in valid:
            self.silent_nodes.pop(reply.node_id, None)
            if any(self.clients[n][PARTITION_ID] == reply.partition_id for n in self.nodes):
                self.claims[reply.node_id] = reply.metrics
            else:
                self.outsiders.add(reply.node_id)
                log.warning(
                    "Node %s holds partition %d, which is not part of this run; ignored",
                    reply.node_id,
                    reply.partition_id,
                )
        for node, metrics in sorted(self.claims.items()):
            index = next(i for i, n in enumerate(self.nodes) if self.clients[n][PARTITION_ID] == metrics[PARTITION_ID])
            if self.nodes[index] in self.connected:
                if node in answered:
                    log.warning(
                        "Node %s claims partition %d, held by connected node %s: refused until that node is gone",
                        node,
                        metrics[PARTITION_ID],
                        self.nodes[index],
                    )
                    self.dropped["query"] += 1
                continue
            del self.claims[node]
            self.clients[node] = metrics
            log.info("Partition %d rejoined as node %s (was %s)", metrics[PARTITION_ID], node, self.nodes[index])
            self.nodes[index] = node

    def sample(self) -> list[int]:
        """This round's clients: K of the known nodes, seeded, returned in partition-id order."""
        k = sample_size(self.cfg.fraction_train, len(self.nodes))
        chosen = self.rng.choice(len(self.nodes), size=k, replace=False)
        self.sampled = [self.nodes[i] for i in sorted(chosen)]
        # sampling is over all partitions, so a disconnected client does not shift the RNG stream;
        # it is recorded as dropped instead of being waited for
        gone = [n for n in self.sampled if n not in self.connected]
        if gone:
            log.warning("Sampled but disconnected: partitions %s", [self.clients[n][PARTITION_ID] for n in gone])
            self.round_dropped.update(self.clients[n][PARTITION_ID] for n in gone)
            self.sampled = [n for n in self.sampled if n in self.connected]
        return list(self.sampled)

    def is_eval_round(self, server_round: int) -> bool:
        """Every ``eval-every`` rounds, and the last round."""
        return server_round % self.cfg.eval_every == 0 or server_round == self.cfg.num_server_rounds

    def train_config(self, server_round: int) -> ConfigRecord:
        """The training settings sent with every train instruction (:func:`train_config`); ``evaluate``
        asks the client to evaluate after training (see ``evaluate_in_train``)."""
        return ConfigRecord(
            train_config(self.cfg, server_round, self.evaluate_in_train and self.is_eval_round(server_round))
        )

    def message(
        self, message_type: str, node_id: int, arrays: Mapping[str, np.ndarray], config: ConfigRecord, server_round: int
    ) -> Message:
        """A message to one node: its payload (checked against the schema) plus ``config``."""
        content = self.schemas[message_type][0].to_record(arrays)
        content["config"] = ConfigRecord({**dict(config), "state-key": self.state_key})
        return Message(content, dst_node_id=node_id, message_type=message_type, group_id=str(server_round))

    def exchange(self, messages: Iterable[Message], timeout: float | None = None) -> list[Message]:
        """Send ``messages``, wait for the replies (at most ``timeout`` s, default ``round-timeout``),
        count payload bytes both ways.

        Bytes are added to ``self.traffic["<category>_bytes_down"]`` (per message sent) and
        ``["<category>_bytes_up"]`` (per reply received, valid or not).
        """
        messages = list(messages)
        if not messages:
            return []
        for m in messages:
            self.traffic[_category(m.metadata.message_type) + "_bytes_down"] += tensor_bytes(m.content)
        timeout = timeout or self._timeout
        replies = self.push_and_pull(messages, timeout)
        for r in replies:
            if not r.has_error():
                self.traffic[_category(r.metadata.message_type) + "_bytes_up"] += tensor_bytes(r.content)
        missing = {m.metadata.dst_node_id for m in messages} - {r.metadata.src_node_id for r in replies}
        if missing:
            partitions = sorted(self.clients[n][PARTITION_ID] for n in missing if n in self.clients)
            log.warning(
                "%d of %d %s replies did not arrive within %.0f s (partitions %s)",
                len(missing),
                len(messages),
                messages[0].metadata.message_type,
                timeout,
                partitions,
            )
            self.dropped[_category(messages[0].metadata.message_type)] += len(missing)
            self.round_dropped.update(partitions)
        return replies

    def push_and_pull(self, messages: list[Message], timeout: float) -> list[Message]:
        """Push ``messages`` and pull their replies every :data:`PULL_SECONDS` until all are in or
        ``timeout`` seconds have passed (then the missing ones are late: :meth:`exchange` records
        them as dropped). Returns the replies in the order of ``messages``.

        Flower's ``send_and_receive`` does the same but sleeps 3 s between pulls on the
        deployment (HTTP) grid, which added up to 3 s to every exchange of a deployed round.
        """
        order = {mid: i for i, mid in enumerate(self.grid.push_messages(messages))}
        pending = set(order)
        deadline = time.monotonic() + timeout
        replies: list[Message] = []
        while pending:
            arrived = list(self.grid.pull_messages(pending))
            replies += arrived
            pending -= {r.metadata.reply_to_message_id for r in arrived}
            if not pending or time.monotonic() >= deadline:
                break
            time.sleep(min(PULL_SECONDS, max(deadline - time.monotonic(), 0.0)))
        # in the order the messages were sent, whatever order they arrived in: runs stay reproducible
        return sorted(replies, key=lambda r: order.get(r.metadata.reply_to_message_id, len(order)))

    def validate(self, message_type: str, replies: Iterable[Message]) -> list[ClientReply]:
        """Keep the replies that match the schema of ``message_type``; log and drop the rest.

        A reply is dropped when it is an error, carries records other than the payload and
        one ``metrics`` MetricRecord, lacks ``partition-id`` (or claims another partition
        than its node did at the handshake), or its payload fails the schema.
        """
        up = self.schemas[message_type][1]
        valid = []
        for reply in replies:
            node = reply.metadata.src_node_id
            try:
                if reply.has_error():
                    raise PayloadError(f"client error {reply.error.code}: {reply.error.reason}")
                content = reply.content
                extra = set(content.keys()) - {"payload", "metrics"}
                if extra or "metrics" not in content.metric_records:
                    raise PayloadError(f"records {sorted(content.keys())}, expected payload + metrics")
                metrics = dict(content.metric_records["metrics"])
                pid = metrics.get(PARTITION_ID)
                if not isinstance(pid, int):
                    raise PayloadError("metrics lack an integer 'partition-id'")
                absent = [k for k in REQUIRED_METRICS.get(_category(message_type), ()) if k not in metrics]
                if absent:
                    raise PayloadError(f"metrics lack {absent}")
                check_metrics(metrics, self.clients.get(node), _category(message_type), self.info.train_size)
                self.check_reply(message_type, metrics)
                if node in self.clients and self.clients[node][PARTITION_ID] != pid:
                    raise PayloadError(
                        f"partition-id {pid} differs from the handshake's {self.clients[node][PARTITION_ID]}"
                    )
                arrays = read_payload(content)
                up.validate(arrays, self.reply_dims(node))
                valid.append(ClientReply(node, pid, arrays, metrics))
            except PayloadError as exc:
                self.dropped[_category(message_type)] += 1
                if node in self.clients:
                    self.round_dropped.add(self.clients[node][PARTITION_ID])
                log.warning("Dropped %s reply from node %s: %s", message_type, node, exc)
        if _category(message_type) == "train":
            self._count_work(valid)
        clipped = clip_outlier_rows(up, [r.arrays for r in valid])
        if clipped:
            self.round_clipped += clipped
            log.warning(
                "Scaled down %d uploaded %s rows to the round's outlier bound (ArraySpec.row_norm_factor)",
                clipped,
                message_type,
            )
        return valid

    def _count_work(self, replies: list[ClientReply]) -> None:
        """Add the replies' training images (``num-examples`` x ``local-epochs``) and ``train-seconds``
        to :attr:`round_work` under each client's architecture (its model group's, by partition)."""
        group = MODEL_GROUPS[self.cfg.model_group]
        for r in replies:
            if "train-seconds" in r.metrics and "num-examples" in r.metrics:
                work = self.round_work.setdefault(group.architecture_for(r.partition_id), [0.0, 0.0])
                work[0] += float(r.metrics["num-examples"]) * self.cfg.local_epochs
                work[1] += float(r.metrics["train-seconds"])

    def _row(
        self,
        server_round: int,
        train: Mapping[str, Any],
        evaluation: MetricRecord | None,
        traffic: Mapping[str, int],
        train_s: float,
        eval_s: float,
        elapsed: float,
    ) -> dict[str, Any]:
        ev = dict(evaluation) if evaluation is not None else {}
        row: dict[str, Any] = {
            "round": server_round,
            "evaluated": evaluation is not None,
            "accuracy_mean": ev.get("accuracy-mean"),
            "accuracy_weighted": ev.get("accuracy-weighted"),
            "bytes_up": traffic.get("train_bytes_up", 0),
            "bytes_down": traffic.get("train_bytes_down", 0),
            "eval_bytes_up": traffic.get("evaluate_bytes_up", 0),
            "eval_bytes_down": traffic.get("evaluate_bytes_down", 0),
            "num_clients": int(train.get("num-clients", 0)),
            "dropped_clients": sorted(self.round_dropped),
            "clipped_rows": self.round_clipped,
            # images per second of client training (with its payload computation), per architecture
            "train_images_per_second": {
                arch: images / seconds for arch, (images, seconds) in sorted(self.round_work.items()) if seconds > 0
            },
            "round_seconds": train_s + eval_s,
            "train_phase_seconds": train_s,
            "eval_phase_seconds": eval_s,
            "elapsed_seconds": elapsed,
        }
        if ev:
            row["accuracy_per_client"] = dict(zip((str(p) for p in ev["partition-ids"]), ev["accuracy-per-client"]))
            row.update({k.replace("-", "_"): v for k, v in ev.items() if k.startswith("accuracy-mean-")})
        row.update({k.replace("-", "_"): v for k, v in train.items() if k != "num-clients"})
        return row


class ClientProcedure:
    """Client half of a method. Subclasses implement ``train``; their method's descriptor gives
    ``self.options`` and ``self.schemas``, as on the server.

    Handlers take ``(client, payload, config)``: the :class:`client_app.runtime.ClientRuntime`,
    the validated payload arrays (name -> ndarray) and the message's ConfigRecord as a dict;
    they return ``(arrays, metrics)``: the reply payload (must match the schema) and scalars.
    """

    #: the method this client procedure serves (set by its ``Method`` descriptor; None: the bare base)
    method: ClassVar[Method | None] = None

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.options, self.schemas = bind_method(self.method, cfg)

    def train(self, client, payload, config) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        raise NotImplementedError

    def evaluate(self, client, payload, config) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Accuracy of the client's personal model on its local test split."""
        from client_app.training import evaluate_model, evaluation_metrics

        data = client.data
        return {}, evaluation_metrics(*evaluate_model(client.model, data.test_x, data.test_y, data.info, client.device))

    def query(self, client, payload, config) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
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
    ``local-epochs``, ``batch-size``, ``lr``, ``momentum``, ``weight-decay``, ``clip-norm``,
    ``precision`` of ``cfg``, and ``evaluate`` (evaluate right after training)."""
    return {
        "server-round": server_round,
        "local-epochs": cfg.local_epochs,
        "batch-size": cfg.batch_size,
        "lr": cfg.lr,
        "momentum": cfg.momentum,
        "weight-decay": cfg.weight_decay,
        "clip-norm": cfg.clip_norm,
        "precision": cfg.precision,
        "evaluate": evaluate,
    }


def bind_method(method: Method | None, cfg: RunConfig) -> tuple[Any, Schemas]:
    """(options, schemas) of ``method`` for ``cfg``; (None, :data:`NO_PAYLOAD_SCHEMAS`) without one.

    Raises:
        ConfigError: an invalid option of the method's table.
    """
    if method is None:
        return None, NO_PAYLOAD_SCHEMAS
    options = method.read_options(cfg)
    return options, method.schemas_for(cfg, options)


def round_metrics(replies: list[ClientReply], server: Mapping[str, Any], server_seconds: float) -> dict[str, Any]:
    """The metrics of a training round every method reports.

    Args:
        replies: the round's valid train replies (of every train exchange).
        server: the method's own server metrics.
        server_seconds: wall time of the server's updates, seconds.

    Returns:
        ``num-clients`` (distinct clients with a valid reply), ``server-update-seconds``,
        the clients' summed and maximal ``train-seconds``, ``data-seconds`` (partition loads),
        ``app-start-seconds`` (process start to handler) and ``handler-seconds``, the
        sample-weighted mean ``train-loss``, and ``server``.
    """
    metrics = {"num-clients": len({r.node_id for r in replies}), **server, "server-update-seconds": server_seconds}
    metrics.update(_client_sums(replies, ("train-seconds", "data-seconds", "app-start-seconds", "handler-seconds")))
    # clients that found no state in memory and restored it from their node's state-dir
    metrics["client-state-restores"] = int(sum(r.metrics.get("state-restores", 0) for r in replies))
    # clients whose state was ahead of a resumed server (it crashed after they trained) and was rolled back
    metrics["client-state-rollbacks"] = int(sum(r.metrics.get("state-rollbacks", 0) for r in replies))
    losses = [r for r in replies if "train-loss" in r.metrics]
    if losses:
        metrics["train-loss"] = sample_weighted_mean(
            [r.metrics["train-loss"] for r in losses], [r.metrics.get("num-examples", 1) for r in losses]
        )
    return metrics


def check_metrics(
    metrics: Mapping[str, Any], known: Mapping[str, Any] | None, category: str, dataset_size: int
) -> None:
    """Reject a reply's metrics that the server could not safely use.

    Every value must be a finite int or float (a MetricRecord may also hold lists, which no
    client sends and the aggregations cannot use). Example counts must be non-negative integers:
    at the handshake (``known`` None) ``num-train`` + ``num-test`` at most ``dataset_size`` (the
    partitioned split's size), later within what the client reported at the handshake
    (``known``): a train reply's ``num-examples`` at most its ``num-train``, an evaluation's
    ``num-examples`` at most its ``num-test`` and ``test-correct`` at most ``num-examples``
    (also for the ``eval-`` metrics inside a train reply), so one client cannot claim to
    outweigh the others in a sample-weighted mean.

    Raises:
        PayloadError: naming the metric.
    """
    for key, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise PayloadError(f"metric '{key}' = {value!r} is not a finite number")
    counts = [
        k
        for k in (
            "num-train",
            "num-test",
            "num-examples",
            "test-correct",
            EVAL_PREFIX + "num-examples",
            EVAL_PREFIX + "test-correct",
        )
        if k in metrics
    ]
    for key in counts:
        if not isinstance(metrics[key], int) or metrics[key] < 0:
            raise PayloadError(f"metric '{key}' = {metrics[key]!r} is not a non-negative integer")
    if known is None:
        claimed = metrics.get("num-train", 0) + metrics.get("num-test", 0)
        if claimed > dataset_size:
            raise PayloadError(
                f"metrics 'num-train' + 'num-test' = {claimed} exceed the dataset's {dataset_size} examples"
            )
        return
    limits = {
        "num-examples": known.get("num-train" if category == "train" else "num-test"),
        EVAL_PREFIX + "num-examples": known.get("num-test"),
    }
    for key, limit in limits.items():
        if key in metrics and limit is not None and metrics[key] > limit:
            raise PayloadError(
                f"metric '{key}' = {metrics[key]} exceeds the {limit} examples the client reported at the handshake"
            )
    for prefix in ("", EVAL_PREFIX):
        correct, total = metrics.get(prefix + "test-correct"), metrics.get(prefix + "num-examples")
        if correct is not None and total is not None and correct > total:
            raise PayloadError(f"metric '{prefix}test-correct' = {correct} exceeds '{prefix}num-examples' = {total}")


def _raise_config_errors(replies: Iterable[Message]) -> None:
    """Fail fast when a client rejected the run config (a ConfigError raised in the ClientApp).

    Raises:
        ConfigError: with the client's message, which names the offending key.
    """
    for r in replies:
        if r.has_error() and "ConfigError" in r.error.reason:
            raise ConfigError(f"node {r.metadata.src_node_id} rejected the run config: {r.error.reason}")


def _state_of(obj: Any) -> Any:
    if isinstance(obj, torch.Generator):
        return obj.get_state()
    return dict(obj) if isinstance(obj, dict) else obj.state_dict()


def _finite(state: Any) -> bool:
    """Whether every float tensor and array in a (nested) server state is finite."""
    if isinstance(state, torch.Tensor):
        return not state.is_floating_point() or bool(torch.isfinite(state).all())
    if isinstance(state, np.ndarray):
        return state.dtype.kind != "f" or bool(np.isfinite(state).all())
    if isinstance(state, dict):
        return all(_finite(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return all(_finite(v) for v in state)
    return not isinstance(state, float) or math.isfinite(state)


def _category(message_type: str) -> str:
    return message_type.split(".", 1)[0]


def _client_sums(replies: list[ClientReply], keys: tuple[str, ...]) -> dict[str, float]:
    out = {}
    for key in keys:
        values = [float(r.metrics[key]) for r in replies if key in r.metrics]
        out["client-" + key] = float(sum(values))
        out["client-" + key.replace("seconds", "max-seconds")] = max(values, default=0.0)
    return out


def metric_values(values: Mapping[str, Any]) -> dict[str, Any]:
    """MetricRecord accepts only Python int/float (and lists): cast numpy scalars, drop the rest."""
    out = {}
    for k, v in values.items():
        if isinstance(v, (bool, np.bool_, int, np.integer)):
            out[k] = int(v)
        elif isinstance(v, (float, np.floating)):
            out[k] = float(v)
        elif isinstance(v, list):
            out[k] = v
    return out


def _progress_line(row: Mapping[str, Any], rounds: int) -> str:
    acc = row["accuracy_mean"]
    acc_text = f"acc mean {acc:.4f} weighted {row['accuracy_weighted']:.4f}" if acc is not None else "acc -"
    return (
        f"[round {row['round']}/{rounds}] {acc_text} | clients {row['num_clients']} | "
        f"up {row['bytes_up']} B down {row['bytes_down']} B | {row['round_seconds']:.1f} s"
    )
