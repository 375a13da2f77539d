"""The roster every run keeps: which node serves which partition, learnt by a handshake
as nodes connect, kept current as nodes leave and rejoin between rounds, and sampled each round.

Node ids are random, so everything is ordered by partition id: sampling and reply order, hence
results, do not depend on which node got which id. With run config ``handshake = "sampled"`` no node is
asked before round 1: each round samples K of the connected nodes in node-id order and asks only the
sampled ones it does not know yet, so neither start-up nor a round grows with N (Flower's simulation
engine looks at every waiting message for every node, so asking all N nodes costs O(N^2) there), at
the price that which partitions a seed samples follows the nodes' ids. A :class:`Roster` is built by
``engine.federation.Federation`` from explicit inputs (the run config, the round counters it
records dropped clients in, the run's seeded ``rng``); the handshake and the refresh send
their queries through the :class:`Handshakes` port it is given.
"""

from __future__ import annotations

import bisect
import logging
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from flwr.app import Message

from common.config import ConfigError, RunConfig, sample_size
from common.dp import secret_generator
from common.heldout import generalization_options
from common.metrics import MAX_ERROR_CHARS
from common.payload import ClientReply, short
from common.protocol import CONFIG_ERROR_KEY, CONFIG_ERROR_RECORD, PARTITION_ID
from engine.round_rows import RoundCounters

log = logging.getLogger("flwr." + __name__)  # streamed with Flower's own log

#: seconds between two looks for newly connected nodes during the handshake
NODE_POLL_SECONDS = 0.5
#: seconds a node that connected mid-run has to answer the partition query (at most ``round-timeout``)
QUERY_SECONDS = 120.0


def poisson_sample(count: int, rate: float) -> list[int]:
    """Indices in [0, ``count``) each drawn on its own with probability ``rate`` (Poisson sampling: McMahan et
    al., ICLR 2018, Algorithm 1), from the operating system's entropy (``common.dp.secret_generator``): the
    amplification by sampling that client-level DP's accountant credits holds only against who cannot predict
    the sample, and every client knows the run's seed."""
    if rate >= 1.0:
        return list(range(count))
    draws = torch.rand(count, generator=secret_generator(), dtype=torch.float64)
    return torch.nonzero(draws < rate).flatten().tolist()


@dataclass
class _Answers:
    """What a handshake has heard so far (:meth:`Roster.handshake`)."""

    #: partition id -> the node holding it (the first valid claim)
    by_partition: dict[int, int] = field(default_factory=dict)
    #: node id -> (partition id, num-partitions) of its valid reply
    claims: dict[int, tuple[int, int]] = field(default_factory=dict)
    #: node id -> (partition id, error) it reported
    errors: dict[int, tuple[int | None, str]] = field(default_factory=dict)
    #: the nodes queried (each once)
    asked: set[int] = field(default_factory=set)


class Handshakes(Protocol):
    """What the roster needs of the network to learn who is there (``engine.federation.Federation`` gives
    it): the roster never sees the transport, nor the transport the roster."""

    @property
    def simulated(self) -> bool:
        """True in a simulation (every node shares one run config and one data folder)."""

    def listed(self) -> set[int]:
        """The node ids the grid lists now (``Grid.get_node_ids``)."""

    def ask(self, nodes: list[int], timeout: float, key: str = "round-timeout") -> list[Message]:
        """One ``query`` message to each of ``nodes`` (at most ``timeout`` s; ``key``: the run config key
        that set it), their raw replies."""

    def answers(self, replies: list[Message], in_train: bool = False) -> list[ClientReply]:
        """The valid handshake answers among ``replies``: query replies, or with ``in_train`` the answers
        inside train replies of nodes not known yet."""


class Roster:
    """Handshake, node refresh and sampling.

    Args:
        cfg: the run config (``num-clients``, ``fraction-train``, the timeouts).
        counters: where dropped queries and this round's dropped partitions are recorded.
        rng: the seeded generator that samples each round's clients.
        network: how the handshake and the refresh ask nodes (:class:`Handshakes`).
        query_in_train: handshake "sampled": a drawn node not known yet answers the handshake's query in
            its train reply (one message instead of a query first; ``engine.contract.needs_query_first``).
    """

    def __init__(
        self,
        cfg: RunConfig,
        counters: RoundCounters,
        rng: np.random.Generator,
        network: Handshakes,
        query_in_train: bool = False,
    ) -> None:
        self.cfg, self.counters, self.rng, self.query_in_train = cfg, counters, rng, query_in_train
        self.network = network
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
        #: nodes whose privacy budget is spent (run config dp.epsilon): never sampled again
        self.exhausted: set[int] = set()
        self.generalization = generalization_options(cfg)
        #: client-level DP (run config ``client-dp.epsilon``, set by ``engine.client_dp.attach``): each round
        #: draws every training client on its own at this rate q (:func:`poisson_sample`); None: off
        self.poisson_rate: float | None = None
        #: N, the run's partitions, once the handshake has learnt it
        self.num_partitions = 0
        #: handshake "sampled": this round's known clients, drawn (and asked) by refresh(), handed out by sample()
        self.drawn: list[int] = []
        #: handshake "sampled" with :attr:`query_in_train`: this round's drawn nodes not known yet, in node-id order
        self.pending: list[int] = []
        #: partitions whose privacy budget is spent (their nodes may be unknown yet with handshake "sampled")
        self.exhausted_partitions: set[int] = set()
        if cfg.handshake == "sampled" and self.generalization.enabled:
            raise ConfigError(
                "run config key 'generalization.held-out-clients' must be 0 with handshake = 'sampled' (held-out "
                "clients are served by partition id, which needs every node asked up front)"
            )

    def handshake(self) -> None:
        """Learn the clients of the run: their node, partition id and data sizes, and the run's size N,
        asking through :attr:`network`.

        The run starts once every training partition has answered (the held-out ones of run config
        ``generalization.held-out-clients`` need not), or once ``min-clients`` of them have when that
        is set; a partition that answers later joins at a round boundary (:meth:`refresh`).

        N is run config ``num-clients``, or with ``num-clients`` = 0 the ``num-partitions`` the nodes
        report (Flower gives each simulated SuperNode ``partition-id`` and ``num-partitions``; a
        deployed SuperNode has them in its ``--node-config``). Nodes are asked as they connect (a
        simulation's virtual nodes connect over several seconds) until all N partitions have
        answered, so which clients take part never depends on timing. Each node is asked once (a
        broken node is not flooded with queries; its error is logged). Every reply's metrics are
        kept in ``self.clients[node_id]`` (methods may add keys, e.g. a parameter count).

        Disagreeing ``num-partitions`` claims (with ``num-clients`` = 0) are judged once the
        federation has settled (a look at the grid lists no node that was not asked): the minority
        is blamed, naming its nodes and the majority's value; a tie is reported as such.

        A client that cannot serve the run answers with its configuration or data error
        (:func:`config_error`: a bad run or node config, a faulty data file, a partitioner that
        cannot split the pool). Whether that ends the run depends on who shares the error:

        - in a simulation (``Handshakes.simulated``, see ``server_app.app.run``) every node
          shares one run config and one data folder, so one node's error is the run's: the run
          fails at once with it;
        - in a deployment a node's data and node config are its own, and a hostile node must not
          be able to end a run by claiming an error: the node is excluded (logged, not asked
          again) and the run fails at once only when the settled federation has no node that
          answered validly and at least ``num-clients`` nodes (1 with ``num-clients`` = 0: the
          federation is then whoever has connected) reported an error, i.e. every node would
          hit it; otherwise the handshake waits for the missing partitions, and its timeout
          names the errors.

        Raises:
            ConfigError: a node reports a ``num-partitions`` other than ``num-clients`` (or than
                the other nodes' majority), a partition id outside [0, N), or a configuration or
                data error as above.
            RuntimeError: not all N partitions answer within ``connect-timeout`` seconds.

        A second node claiming a partition already answered for is ignored (logged, counted as a
        dropped query): the first claim stands and the run goes on.
        """
        if self.cfg.handshake == "sampled":
            self._await_nodes()
            return
        timeout = self.cfg.connect_timeout
        began = time.monotonic()
        deadline = began + timeout
        wanted: int | None = self.cfg.num_clients or None  # None until the nodes agree on num-partitions
        heard = _Answers()
        while wanted is None or self._trainers(heard.by_partition, wanted) < self._needed(wanted):
            if time.monotonic() > deadline:
                size = (
                    f"num-clients={wanted}"
                    if self.cfg.num_clients
                    else (f"num-partitions={wanted}" if wanted else "? (no node answered)")
                )
                raise RuntimeError(
                    f"only {len(heard.by_partition)} of {size} clients answered the handshake within "
                    f"{timeout:.0f} s (run config key 'connect-timeout')" + _errors_text(heard.errors, "; ")
                )
            new = sorted(self.network.listed() - heard.asked)
            if not new:  # settled: every node the grid lists has answered (or missed its time)
                wanted = self._federation_size(heard.claims, settled=True)
                if heard.errors and not heard.claims and len(heard.errors) >= max(self.cfg.num_clients, 1):
                    raise ConfigError(
                        f"no node that answered the handshake can serve the run{_errors_text(heard.errors)}"
                    )
            else:
                self._ask(new, max(deadline - time.monotonic(), 1.0), heard)
                wanted = self._federation_size(heard.claims, settled=False)
                log.info(
                    "Handshake: %d of %s clients answered, %.1f s after the handshake began (slowest "
                    "client: %.1f s from its process start to the handler, %.1f s loading its partition)",
                    len(heard.by_partition),
                    wanted or "?",
                    time.monotonic() - began,
                    max((m.get("app-start-seconds", 0.0) for m in self.clients.values()), default=0.0),
                    max((m.get("data-seconds", 0.0) for m in self.clients.values()), default=0.0),
                )
            if wanted is None or self._trainers(heard.by_partition, wanted) < self._needed(wanted):
                time.sleep(NODE_POLL_SECONDS)
        self.num_partitions = wanted
        self.nodes = [heard.by_partition[p] for p in sorted(heard.by_partition)]
        self.connected = set(self.nodes)
        log.info("Handshake: %d clients, partitions %s", len(self.nodes), sorted(heard.by_partition))
        if self.held_out_partitions:
            log.info("Held out (run config generalization.held-out-clients): partitions %s", self.held_out_partitions)

    def _await_nodes(self) -> None:
        """Handshake ``sampled``: N is ``num-clients``; wait until the grid lists the K nodes a round
        samples, asking none of them.

        Raises:
            RuntimeError: fewer than K nodes are listed after ``connect-timeout`` seconds.
        """
        self.num_partitions = self.cfg.num_clients
        k = sample_size(self.cfg.fraction_train, self.num_partitions)
        deadline = time.monotonic() + self.cfg.connect_timeout
        while (listed := len(self.network.listed())) < k:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"only {listed} nodes connected within {self.cfg.connect_timeout:.0f} s (run config key "
                    f"'connect-timeout'); a round samples {k} of num-clients={self.num_partitions}"
                )
            time.sleep(NODE_POLL_SECONDS)
        log.info("Handshake sampled: %d nodes listed; each round asks only the nodes it samples", listed)

    def _ask(self, new: list[int], timeout: float, heard: _Answers) -> None:
        """Query the ``new`` nodes once (within ``timeout`` seconds) and record their answers in
        ``heard``: a node's configuration or data error (:meth:`_valid_answers`), else its claim, its
        partition unless another node holds it (the first claim stands) and its metrics in
        ``self.clients``.

        Raises:
            ConfigError: a node of a simulation reported a configuration or data error.
        """
        heard.asked.update(new)
        valid, errors = self._valid_answers(self.network.ask(new, timeout))
        heard.errors.update(errors)
        for r in valid:
            heard.claims[r.node_id] = _claim(r)
            if r.partition_id in heard.by_partition:  # the first claim stands; the run goes on
                log.warning(
                    "Node %s also claims partition %d, held by node %s: ignored (check each SuperNode's --node-config)",
                    r.node_id,
                    r.partition_id,
                    heard.by_partition[r.partition_id],
                )
                self.counters.dropped["query"] += 1
                self.claims[r.node_id] = r.metrics
                continue
            heard.by_partition[r.partition_id] = r.node_id
            self.clients[r.node_id] = r.metrics

    def _trainers(self, by_partition: dict[int, int], num_partitions: int) -> int:
        """How many of ``by_partition``'s partitions train (are not held out)."""
        return sum(not self.generalization.is_held_out(p, num_partitions) for p in by_partition)

    def _needed(self, num_partitions: int) -> int:
        """Training partitions the handshake waits for: all of them, or ``min-clients`` when set."""
        trainers = num_partitions - self.generalization.count(num_partitions)
        return min(self.cfg.min_clients, trainers) if self.cfg.min_clients else trainers

    @property
    def held_out_partitions(self) -> list[int]:
        """The held-out partition ids of the run, whether their nodes have connected or not."""
        k = self.generalization.count(self.num_partitions) if self.num_partitions else 0
        return list(range(self.num_partitions - k, self.num_partitions))

    @property
    def held_out(self) -> set[int]:
        """The known nodes of held-out partitions (run config generalization.held-out-clients): never
        sampled to train."""
        held = set(self.held_out_partitions)
        return {n for n in self.nodes if self.clients[n][PARTITION_ID] in held}

    @property
    def training_nodes(self) -> list[int]:
        """The known nodes that train (not held out), in partition order."""
        held = self.held_out
        return [n for n in self.nodes if n not in held]

    def _federation_size(self, claims: dict[int, tuple[int, int]], settled: bool) -> int | None:
        """N from the ``(partition id, num-partitions)`` claims of the nodes that answered so far:
        ``num-clients`` when set, else the value every node claims; None while no node answered, or
        while nodes disagree and more may still connect (``settled`` False).

        Raises:
            ConfigError: a node whose ``num-partitions`` differs from ``num-clients`` (naming both
                keys and every such node); with ``num-clients`` = 0 and ``settled``, nodes that
                disagree: the nodes of the minority value(s) and the majority's value, or, on a
                tie, every value with its nodes.
        """
        if self.cfg.num_clients:
            odd = {node: claim for node, claim in claims.items() if claim[1] != self.cfg.num_clients}
            if odd:
                raise ConfigError(
                    f"run config key 'num-clients' = {self.cfg.num_clients} but {_claims_text(odd)}: set "
                    "num-clients=0 to follow the federation, or make the two agree"
                )
            return self.cfg.num_clients
        votes = Counter(n for _, n in claims.values()).most_common()
        if len(votes) <= 1:
            return votes[0][0] if votes else None
        if not settled:
            return None
        (majority, count), runner_up = votes[0], votes[1][1]
        if count == runner_up:
            tied = "; ".join(
                _claims_text({node: c for node, c in sorted(claims.items()) if c[1] == value}) for value, _ in votes
            )
            raise ConfigError(
                f"the nodes disagree on node config 'num-partitions' and no value has a majority: {tied}; every "
                "node must have the same 'num-partitions'"
            )
        odd = {node: claim for node, claim in sorted(claims.items()) if claim[1] != majority}
        raise ConfigError(
            f"{_claims_text(odd)}, other nodes have {majority} (the majority: {count} of {len(claims)} nodes): "
            "every node must have the same 'num-partitions'"
        )

    def refresh(self) -> list[int]:
        """Track nodes leaving and (re)joining between rounds (deployment: a SuperNode restarts),
        asking new nodes through :attr:`network`; returns the nodes admitted as new clients.

        A node holding a partition of the run that no node has held yet (it connected after the
        handshake, or it is a held-out partition) is admitted as a new client, after the
        handshake's checks (its configuration or data error, the method's reply checks, its
        ``num-partitions`` equal to the run's N), and is served from this round on.

        Nodes the grid no longer lists are skipped when sampled (and recorded as dropped). An
        unknown node is asked once for its partition id. It takes a partition over only when the
        partition's node is gone from the grid (a SuperNode restarted without a fixed node id);
        a claim on a partition whose node is still connected is refused and kept waiting, so no
        node can take a connected client's place (and its personal payload), and it is granted
        without a new query once that node is gone. A node that gives no valid answer within
        :data:`QUERY_SECONDS` (silent, broken, or reporting a configuration or data error, which is
        logged: :func:`config_error`) is asked again only after 1, 2, 4, ... rounds, so it cannot
        stall every round; a node holding a partition outside this run is not asked again. A
        rejoining client restores its state from its node's ``state-dir``.
        """
        self.connected = self.network.listed()
        self.refreshes += 1
        if self.cfg.handshake == "sampled":
            return self._draw()
        self.claims = {n: c for n, c in self.claims.items() if n in self.connected}
        new = sorted(
            n
            for n in self.connected - set(self.clients) - set(self.claims) - self.outsiders
            if self.silent_nodes.get(n, (0, 0))[1] <= self.refreshes
        )
        replies = self.network.ask(new, min(QUERY_SECONDS, self.cfg.round_timeout))
        # a node's configuration or data error is its own problem: it is asked again later, as a silent node
        valid, _ = self._valid_answers(replies)
        answered = {r.node_id for r in valid}
        for node in set(new) - answered:  # no reply, or none we can use
            misses = self.silent_nodes.get(node, (0, 0))[0] + 1
            self.silent_nodes[node] = (misses, self.refreshes + 2 ** (misses - 1))
        admitted = []
        for reply in valid:
            self.silent_nodes.pop(reply.node_id, None)
            if any(self.clients[n][PARTITION_ID] == reply.partition_id for n in self.nodes):
                self.claims[reply.node_id] = reply.metrics
            elif 0 <= reply.partition_id < self.num_partitions and reply.metrics.get("num-partitions") == (
                self.num_partitions
            ):
                self.admit(reply)
                admitted.append(reply.node_id)
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
        return admitted

    def _valid_answers(
        self, replies: list[Message], in_train: bool = False
    ) -> tuple[list[ClientReply], dict[int, tuple[int | None, str]]]:
        """The valid query ``replies`` (:meth:`Handshakes.answers`; with ``in_train``, the handshake's
        answers inside train replies) and the configuration or data errors
        (:func:`config_error`, node id -> (partition id or None, text)) the others report. Each error
        is logged and its reply left out; with handshake ``sampled`` (the node was drawn to train) it
        is also the round's client error, which the error of a run that trains nothing quotes.

        Raises:
            ConfigError: a node of a simulation reported one: every simulated node shares the run config
                and the data folder, so it is the run's error, as in the full handshake.
        """
        errors = {r.metadata.src_node_id: config_error(r) for r in replies}
        errors = {node: error for node, error in errors.items() if error is not None}
        if errors and self.network.simulated:
            raise ConfigError(f"the run's configuration or data fail on a simulated node{_errors_text(errors)}")
        for node, (pid, text) in errors.items():
            log.warning("Node %s (partition-id %s) cannot serve the run: %s", node, pid, text)
            if self.cfg.handshake == "sampled":
                self.counters.train_error(f"node {node} (partition-id {pid}) cannot serve the run: {text}")
        rest = [r for r in replies if r.metadata.src_node_id not in errors]
        return self.network.answers(rest, in_train), errors

    def _draw(self) -> list[int]:
        """Handshake ``sampled``: draw this round's K clients from the connected nodes (seeded, in node-id
        order), ask those not asked before for their partition (one query exchange of at most K
        messages) and admit the valid ones; returns the admitted nodes. :meth:`sample` then hands out
        the drawn nodes that are known, in partition order. With :attr:`query_in_train` nothing is
        asked here: the new nodes are :attr:`pending`, answer the query in their train reply and are
        admitted by :meth:`answered`.

        The first draw of the ServerApp's process (a new or a resumed run) waits up to
        ``connect-timeout`` seconds for its answers (the full handshake's wait: ClientApps may still
        be starting), later ones ``round-timeout`` (at most :data:`QUERY_SECONDS`). A sampled node
        that does not answer validly is dropped for the round (its query counted as dropped) and, as
        in :meth:`refresh`, left out of the draws for 1, 2, 4, ... rounds; one holding a partition
        outside the run, or claiming one whose node is still connected, is not asked again and not
        used. A node whose partition's budget is spent (``exhausted_partitions``) is known to be spent
        once asked, and not drawn again.
        """
        backing_off = {n for n, (_, after) in self.silent_nodes.items() if after > self.refreshes}
        candidates = sorted(self.connected - self.exhausted - self.outsiders - backing_off)
        k = min(sample_size(self.cfg.fraction_train, self.num_partitions), len(candidates))
        chosen = [candidates[i] for i in sorted(self.rng.choice(len(candidates), size=k, replace=False))]
        new = [n for n in chosen if n not in self.clients]
        if self.query_in_train:
            self.pending, self.drawn = new, self._known(chosen)
            return []
        timeout, key = self.exchange_timeout(QUERY_SECONDS)
        admitted = self._admit_drawn(new, self.network.ask(new, timeout, key), in_train=False)
        self.drawn = self._known(chosen)
        if new:
            log.info("Round sample: %d nodes, %d asked for their partition, %d admitted", k, len(new), len(admitted))
        return admitted

    def exchange_timeout(self, most: float = math.inf) -> tuple[float, str]:
        """Seconds to wait for the answers of this round's new nodes (handshake ``sampled``) and the run
        config key that sets them: the process's first draw is the run's handshake, and the ClientApps
        may still be starting (a simulation's Ray actors, each building the partitioner), so it waits
        ``connect-timeout`` (plus ``round-timeout`` when the new nodes answer in their train reply:
        :attr:`query_in_train`); later ones ``round-timeout``, at most ``most``."""
        if self.refreshes == 1 and self.query_in_train:
            return self.cfg.connect_timeout + self.cfg.round_timeout, "connect-timeout' + 'round-timeout"
        if self.refreshes == 1:
            return self.cfg.connect_timeout, "connect-timeout"
        return min(most, self.cfg.round_timeout), "round-timeout"

    def answered(self, replies: list[Message]) -> list[Message]:
        """Handshake ``sampled`` with :attr:`query_in_train`: admit the :attr:`pending` nodes whose train
        ``replies`` answer the handshake validly (as :meth:`_draw` admits query replies; a configuration
        or data error as in :meth:`_valid_answers`), and return the train replies of the round's known
        nodes, the just admitted ones included (their query metrics removed:
        ``engine.transport.Transport.read_handshake``), in partition order, the order of a round of known
        nodes.
        :attr:`sampled` becomes those nodes.

        Raises:
            ConfigError: a simulated node answered with a configuration or data error.
        """
        new, self.pending = self.pending, []
        if not new:
            return replies
        k, asked = len(self.drawn) + len(new), set(new)
        admitted = self._admit_drawn(new, [r for r in replies if r.metadata.src_node_id in asked], True)
        self.drawn = self._known([*self.drawn, *admitted])
        self.sampled = list(self.drawn)
        log.info("Round sample: %d nodes, %d asked in their train message, %d admitted", k, len(new), len(admitted))
        drawn = set(self.drawn)
        kept = [r for r in replies if r.metadata.src_node_id in drawn]
        return sorted(kept, key=lambda r: self.clients[r.metadata.src_node_id][PARTITION_ID])

    def _known(self, chosen: list[int]) -> list[int]:
        """The nodes of ``chosen`` that are known, serve the run and have budget left, in partition order."""
        return sorted(
            (n for n in chosen if n in self.clients and n not in self.exhausted and n not in self.outsiders),
            key=lambda n: self.clients[n][PARTITION_ID],
        )

    def _admit_drawn(self, new: list[int], replies: list[Message], in_train: bool) -> list[int]:
        """Admit the ``new`` drawn nodes whose ``replies`` answer the handshake validly
        (:meth:`_valid_answers`), unless they hold a partition outside the run or one whose node is still
        connected (not asked again); back off from the others (:meth:`_draw`); returns the admitted nodes.
        """
        valid, _ = self._valid_answers(replies, in_train)
        holders = {self.clients[n][PARTITION_ID]: n for n in self.nodes}
        admitted = []
        for reply in valid:
            pid, holder = reply.partition_id, holders.get(reply.partition_id)
            if not 0 <= pid < self.num_partitions or reply.metrics.get("num-partitions") != self.num_partitions:
                self.outsiders.add(reply.node_id)
                log.warning("Node %s holds partition %d, which is not part of this run; ignored", reply.node_id, pid)
                continue
            if holder is not None and holder in self.connected:
                self.outsiders.add(reply.node_id)
                self.counters.dropped["query"] += 1
                log.warning(
                    "Node %s claims partition %d, held by connected node %s: refused", reply.node_id, pid, holder
                )
                continue
            if holder is not None:  # its node is gone (a SuperNode restarted without a fixed node id)
                self.nodes.remove(holder)
            self.admit(reply, quiet=True)
            holders[pid] = reply.node_id
            admitted.append(reply.node_id)
            if pid in self.exhausted_partitions:
                self.exhausted.add(reply.node_id)
        for node in set(new) - set(admitted) - self.outsiders:
            misses = self.silent_nodes.get(node, (0, 0))[0] + 1
            self.silent_nodes[node] = (misses, self.refreshes + 2 ** (misses - 1))
        return admitted

    def admit(self, reply: ClientReply, quiet: bool = False) -> None:
        """Add a new client (a valid query reply) in partition order; it may be held out. ``quiet``: no
        log line (handshake ``sampled`` admits up to K nodes a round)."""
        self.clients[reply.node_id] = reply.metrics
        bisect.insort(self.nodes, reply.node_id, key=lambda n: self.clients[n][PARTITION_ID])
        held_out = self.generalization.is_held_out(reply.partition_id, self.num_partitions)
        if not quiet:
            log.info(
                "Partition %d joined as node %s%s", reply.partition_id, reply.node_id, " (held out)" if held_out else ""
            )

    def sample(self) -> list[int]:
        """This round's clients: K of the known nodes, seeded, returned in partition-id order.

        K counts the run's training partitions (N minus the held-out ones). Held-out clients are never
        candidates, nor are clients whose privacy budget is spent (:meth:`exhaust`): the others take
        their places (fewer than K once fewer remain, e.g. before late partitions have joined). Under
        client-level DP each candidate is drawn on its own at rate K / N instead (K on average)."""
        if self.cfg.handshake == "sampled":  # drawn (and asked) at the round's refresh(); new ones after the known
            self.sampled = [*self.drawn, *self.pending]
            return list(self.sampled)
        candidates = [n for n in self.training_nodes if n not in self.exhausted]
        trainers = self.num_partitions - len(self.held_out_partitions) if self.num_partitions else len(self.nodes)
        if self.poisson_rate is not None:
            chosen = poisson_sample(len(candidates), self.poisson_rate)
        else:
            k = min(sample_size(self.cfg.fraction_train, trainers), len(candidates))
            chosen = self.rng.choice(len(candidates), size=k, replace=False)
        self.sampled = [candidates[i] for i in sorted(chosen)]
        # sampling is over all partitions, so a disconnected client does not shift the RNG stream;
        # it is recorded as dropped instead of being waited for
        gone = [n for n in self.sampled if n not in self.connected]
        if gone:
            log.warning("Sampled but disconnected: partitions %s", [self.clients[n][PARTITION_ID] for n in gone])
            self.counters.round_dropped.update(self.clients[n][PARTITION_ID] for n in gone)
            self.sampled = [n for n in self.sampled if n in self.connected]
        return list(self.sampled)

    def exhaust(self, replies: list[ClientReply]) -> list[int]:
        """Note the clients whose train reply says their privacy budget allows no further round
        (metric ``dp-rounds-left`` = 0); returns the partition ids of every such client so far."""
        self.exhausted.update(r.node_id for r in replies if r.metrics.get("dp-rounds-left") == 0)
        self.exhausted_partitions.update(self.clients[n][PARTITION_ID] for n in self.exhausted)
        return sorted(self.exhausted_partitions)

    def exhaust_partitions(self, partitions: list[int]) -> None:
        """Restore :meth:`exhaust`'s clients from their partition ids (a resumed run's last row)."""
        self.exhausted_partitions = set(partitions)
        self.exhausted = {n for n in self.nodes if self.clients[n][PARTITION_ID] in self.exhausted_partitions}

    @property
    def trainers(self) -> int:
        """The run's training clients: N with handshake ``sampled`` (most nodes are not asked yet), else
        the known training nodes."""
        return self.num_partitions if self.cfg.handshake == "sampled" else len(self.training_nodes)

    @property
    def size(self) -> int:
        """The run's clients: N with handshake ``sampled``, else the nodes known so far."""
        return self.num_partitions if self.cfg.handshake == "sampled" else len(self.nodes)


def _claim(reply: ClientReply) -> tuple[int, int]:
    """A valid query reply's (partition id, num-partitions).

    Raises:
        ConfigError: its ``num-partitions`` is not an integer, or its partition id lies outside [0, it).
    """
    n, pid = reply.metrics["num-partitions"], reply.partition_id
    if not isinstance(n, int) or not 0 <= pid < n:
        raise ConfigError(
            f"node {reply.node_id} (partition-id {pid}) has node config 'num-partitions' = {n!r}: 'num-partitions' "
            "must be an integer and 'partition-id' lie in [0, it)"
        )
    return pid, n


#: nodes named in one error message; the others are counted
NODES_SHOWN = 5


def _listed(items: list[str]) -> str:
    """The first :data:`NODES_SHOWN` of ``items``, then how many more: a message stays short."""
    more = len(items) - NODES_SHOWN
    return ", ".join(items[:NODES_SHOWN]) + (f" and {more} more" if more > 0 else "")


def _claims_text(claims: dict[int, tuple[int, int]]) -> str:
    """``node <id> (partition-id <p>) has node config 'num-partitions' = <n>`` for each claim (:func:`_listed`)."""
    return _listed(
        [f"node {i} (partition-id {p}) has node config 'num-partitions' = {n}" for i, (p, n) in claims.items()]
    )


def _errors_text(errors: dict[int, tuple[int | None, str]], lead: str = ": ") -> str:
    """The configuration or data errors of ``errors`` (node id -> (partition id or None, text)), each
    distinct text once with the nodes that reported it (:func:`_listed`); empty for none."""
    if not errors:
        return ""
    by_text: dict[str, list[str]] = {}
    for node, (pid, text) in sorted(errors.items()):
        by_text.setdefault(text, []).append(f"node {node}" + ("" if pid is None else f" (partition-id {pid})"))
    texts = [f"{text} [{_listed(nodes)}]" for text, nodes in by_text.items()]
    return f"{lead}{len(errors)} node(s) reported a configuration or data error: {_listed(texts)}"


def config_error(reply: Message) -> tuple[int | None, str] | None:
    """The configuration or data error a query reply reports instead of its sizes, as (the partition
    id it names or None, the text), or None when it reports none (a valid reply, or any other
    fault, which :meth:`Transport.validate` drops).

    A client reports it with one ConfigRecord ``config-error``: key ``error``, a string, and
    optionally ``partition-id``, an integer (see ``client_app.handlers.config_error_reply``); an error
    reply of a ClientApp that raised a ConfigError counts too. The text is cut to
    ``MAX_ERROR_CHARS`` and unprintable characters are replaced, so a hostile node's claim cannot
    flood the log or the run's summary.
    """
    pid = None
    if reply.has_error():
        text = reply.error.reason if "ConfigError" in reply.error.reason else None
    else:
        content = reply.content
        record = content.config_records.get(CONFIG_ERROR_RECORD) if CONFIG_ERROR_RECORD in content else None
        values = dict(record) if record is not None else {}
        text, pid = values.get(CONFIG_ERROR_KEY), values.get(PARTITION_ID)
        well_formed = (
            list(content.keys()) == [CONFIG_ERROR_RECORD]
            and set(values) <= {CONFIG_ERROR_KEY, PARTITION_ID}
            and isinstance(text, str)
            and (pid is None or (type(pid) is int and 0 <= pid < 2**31))
        )
        if not well_formed:
            return None
    if text is None:
        return None
    return pid, short("".join(c if c.isprintable() else " " for c in text[: MAX_ERROR_CHARS + 1]), MAX_ERROR_CHARS)
