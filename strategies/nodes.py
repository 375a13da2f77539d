"""The node registry every strategy keeps: which node serves which partition, learnt by a handshake
as nodes connect, kept current as nodes leave and rejoin between rounds, and sampled each round.

Node ids are random, so everything is ordered by partition id: sampling and reply order, hence
results, do not depend on which node got which id. A :class:`NodeRegistry` is built by
``strategies.base.HeteroStrategy`` from explicit inputs (the run config, the round counters it
records dropped clients in, the strategy's seeded ``rng``); the handshake and the refresh send
their queries through the transport they are given.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Message

from common.config import ConfigError, RunConfig
from common.metrics import PARTITION_ID
from common.payload import ClientReply
from strategies.records import RoundCounters
from strategies.transport import Transport

log = logging.getLogger("flwr." + __name__)  # streamed with Flower's own log

#: seconds between two looks for newly connected nodes during the handshake
NODE_POLL_SECONDS = 0.5
#: seconds a node that connected mid-run has to answer the partition query (at most ``round-timeout``)
QUERY_SECONDS = 120.0


def sample_size(fraction: float, num_nodes: int) -> int:
    """Clients per round K = max(1, floor(fraction * N)) (docs/methods/fedgh.md §4).

    The product is rounded to 9 decimals first so that 0.29 * 100 gives 29, not 28.
    """
    return max(1, math.floor(round(fraction * num_nodes, 9)))


class NodeRegistry:
    """Handshake, node refresh and sampling.

    Args:
        cfg: the run config (``num-clients``, ``fraction-train``, the timeouts).
        counters: where dropped queries and this round's dropped partitions are recorded.
        rng: the seeded generator that samples each round's clients.
    """

    def __init__(self, cfg: RunConfig, counters: RoundCounters, rng: np.random.Generator) -> None:
        self.cfg, self.counters, self.rng = cfg, counters, rng
        self.clients: dict[int, dict[str, Any]] = {}  # node id -> handshake metrics
        self.nodes: list[int] = []  # node ids ordered by partition id
        self.sampled: list[int] = []  # the nodes of the last sample() call
        self.connected: set[int] = set()  # nodes the grid listed at the start of this round
        self.refreshes = 0  # refresh() calls so far
        #: node id -> (queries it missed, refresh count from which it is asked again)
        self.silent_nodes: dict[int, tuple[int, int]] = {}
        #: node id -> handshake metrics of a node whose claim on a held partition waits for the holder to go
        self.claims: dict[int, dict[str, Any]] = {}
        self.outsiders: set[int] = set()  # nodes that hold a partition outside this run: not asked again

    def handshake(self, transport: Transport) -> None:
        """Learn every client of the run: its node, partition id and data sizes, and the run's size N,
        asking through ``transport`` on its grid.

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
            new = sorted(set(transport.grid.get_node_ids()) - asked)
            if new:
                asked.update(new)
                replies = transport.exchange(
                    [transport.message("query", n, {}, ConfigRecord(), 0) for n in new],
                    max(deadline - time.monotonic(), 1.0),
                )
                _raise_config_errors(replies)
                for r in transport.validate("query", replies):
                    wanted = self._federation_size(r, wanted)
                    if r.partition_id in by_partition:  # the first claim stands; the run goes on
                        log.warning(
                            "Node %s also claims partition %d, held by node %s: ignored (check each "
                            "SuperNode's --node-config)",
                            r.node_id,
                            r.partition_id,
                            by_partition[r.partition_id],
                        )
                        self.counters.dropped["query"] += 1
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

    def refresh(self, transport: Transport) -> None:
        """Track nodes leaving and (re)joining between rounds (deployment: a SuperNode restarts),
        asking new nodes through ``transport``.

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
        self.connected = set(transport.grid.get_node_ids())
        self.refreshes += 1
        self.claims = {n: c for n, c in self.claims.items() if n in self.connected}
        new = sorted(
            n
            for n in self.connected - set(self.clients) - set(self.claims) - self.outsiders
            if self.silent_nodes.get(n, (0, 0))[1] <= self.refreshes
        )
        valid = transport.validate(
            "query",
            transport.exchange(
                [transport.message("query", n, {}, ConfigRecord(), 0) for n in new],
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
                    self.counters.dropped["query"] += 1
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
            self.counters.round_dropped.update(self.clients[n][PARTITION_ID] for n in gone)
            self.sampled = [n for n in self.sampled if n in self.connected]
        return list(self.sampled)


def _raise_config_errors(replies: Iterable[Message]) -> None:
    """Fail fast when a client rejected the run config (a ConfigError raised in the ClientApp).

    Raises:
        ConfigError: with the client's message, which names the offending key.
    """
    for r in replies:
        if r.has_error() and "ConfigError" in r.error.reason:
            raise ConfigError(f"node {r.metadata.src_node_id} rejected the run config: {r.error.reason}")
